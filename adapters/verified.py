"""The record of verifications: which layouts passed :meth:`Layout.verify
<quotient_manifolds.adapters.Layout.verify>` on which model, in the model's current state.

:meth:`Layout.verify` writes it; the geodesic entry points read it (:mod:`~quotient_manifolds.adapters.accept`)
so that a layout verified once is not verified again.  The record is a ``WeakKeyDictionary`` model ->
set of signatures, so it never keeps a model alive.  A signature (:func:`signature`) is what a
verification depends on: the layout's blocks (by value: a layout detected again from the same model
needs no new check) and, for every parameter a block touches, its shape, dtype, device and storage
address (training updates parameters in place, so it keeps them; replacing a parameter tensor or
changing the blocks does not)."""

from __future__ import annotations

import weakref
from typing import Any, Tuple

from torch import nn

from .blocks import GLBlock
from .verify import Checkable

__all__ = ["record_verification", "is_verified", "signature"]

#: model -> signatures of the layouts that passed verification on it
_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()


def _block_key(block: GLBlock) -> Any:
    try:                                   # frozen dataclasses compare by value: a re-detected
        hash(block)                        # layout with the same blocks counts as verified
        return block
    except TypeError:                      # a group holding tensors: by identity
        return id(block)


def signature(model: nn.Module, layout: Checkable) -> Tuple:
    """What a verification of ``layout`` on ``model`` depends on: its blocks (by value where they are
    hashable, else by identity) and ``(name, shape, dtype, device, storage address)`` of every
    parameter they touch (``(name, None)`` for one the model lacks)."""
    params = dict(model.named_parameters())
    touched = sorted({p for b in layout.blocks for p in b.params})
    state = tuple((n, tuple(params[n].shape), params[n].dtype, str(params[n].device), params[n].data_ptr())
                  if n in params else (n, None) for n in touched)
    return tuple(_block_key(b) for b in layout.blocks), state


def record_verification(model: nn.Module, layout: Checkable, passed: bool) -> None:
    """Remember (``passed=True``) or forget that ``layout`` passed verification on ``model`` (called
    by :meth:`Layout.verify <quotient_manifolds.adapters.Layout.verify>`)."""
    try:
        done = _VERIFIED.setdefault(model, set())
    except TypeError:                       # a model that cannot be weakly referenced: no record
        return
    sig = signature(model, layout)
    if passed:
        done.add(sig)
    else:
        done.discard(sig)


def is_verified(model: nn.Module, layout: Checkable) -> bool:
    """Whether ``layout`` (or a layout with equal blocks) passed :meth:`Layout.verify
    <quotient_manifolds.adapters.Layout.verify>` on ``model`` in its current state (same parameter
    tensors)."""
    try:
        done = _VERIFIED.get(model)
    except TypeError:
        return False
    return bool(done) and signature(model, layout) in done
