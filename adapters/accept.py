r"""Accept a layout's blocks only after verification: a geodesic number never comes from an
unverified block.

A block is a symmetry of the model when acting on it with elements of its group leaves the output
unchanged; :meth:`~quotient_manifolds.adapters.Layout.verify` checks this with random, ill-conditioned
elements of each block's *own* group (``group.random_element``) at several scales.  The geodesic
entry points reach this module through one gate (:class:`~quotient_manifolds.adapters.gate.Gate`), which
calls :func:`accept_layout` on the first batch before they use a layout, whether it was detected or
passed in:

* a layout that already passed ``verify`` on this model (explicitly, or automatically before) is
  used at no extra cost;
* otherwise ``verify`` runs once (all blocks together at five scales, bisected only when that
  fails, to name the culprit: six forward passes when it passes) and its result is remembered;
* the failing blocks get their group derived from the model (:func:`accept_layout`: the candidate
  is replaced, the layout verified again); what still fails is removed and reported with a warning;
* the gate refuses a layout passed in of which no block verifies (:func:`refuse_failed_blocks`;
  ``unsafe=True`` runs a layout whose last verification failed as it is, with a warning).

The record of what passed (:func:`~quotient_manifolds.adapters.verify.record_verification`) is kept
per model, by a signature of what a verification depends on: the layout's blocks (by value: a
layout detected again from the same model needs no new check) and, for every parameter a block
touches, its shape, dtype, device and storage address.  Training updates parameters in place (same
storage), so a ``GeodesicSAM`` run verifies once; replacing a parameter tensor or changing the
layout's blocks verifies again.  Plain, rotary and grouped-query blocks are symmetries whatever the
weights' values (a property of the forward computation), so in-place updates keep them valid; a
group that holds only at special values of other weights (an orthogonal gauge under QK-norm gains
that are all equal) is checked at the weights of the check.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Set, Tuple

import torch
from torch import nn

from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, OutputNotFound, SymmetryError

from .derive import derive_groups, with_blocks
from .evaluation import detach_inputs
from .layouts import Layout, Unsupported
from .verify import VerifyReport, default_tolerance, refuse_empty_inputs, verify_once

__all__ = ["accept_layout", "ensure_verified", "refuse_failed_blocks"]


#: Relative tolerance of the automatic check, above ``default_tolerance`` (which is tuned to the
#: rounding of moderate weights): float64 models ``1e-8`` (``default_tolerance`` is 6.7e-13;
#: 1.4e-12 measured on a tiny random BERT), others ``AUTO_MARGIN`` times ``default_tolerance``
#: (float32: 3.6e-3; 3.9e-4 measured on a LoRA Llama whose blocks were already acted on with
#: condition number 1e2).  A block that is not a symmetry changes the output by 1e-2 .. 1.
AUTO_RTOL_FLOAT64 = 1e-8
AUTO_MARGIN = 10.0


def _auto_rtol(dtypes: Set[torch.dtype]) -> float:
    """The tolerance of the automatic check of a model whose floating weights have ``dtypes``."""
    if dtypes == {torch.float64}:
        return AUTO_RTOL_FLOAT64
    compute = torch.float64 if torch.float64 in dtypes else torch.float32
    return AUTO_MARGIN * default_tolerance(compute, 1e2)


def ensure_verified(model: nn.Module, layout: Optional[Layout], example_inputs: Any, *,
                    what: str, on_reference: Optional[Callable[[Any], None]] = None) -> Optional[VerifyReport]:
    """Verify ``layout`` on ``model`` with ``example_inputs`` (a tensor, a tuple of positional
    arguments or a dict of keyword arguments: the first batch's inputs) unless it already passed;
    return the report (``None`` when nothing had to run).  Sets ``layout.verify_failed``; never
    raises on a broken block (see :func:`refuse_failed_blocks`).  ``what`` names the caller in
    error messages; ``on_reference`` is called with the model's output at its own weights when the
    check runs (:func:`~quotient_manifolds.adapters.verify.verify_once`)."""
    if layout is None:
        return None
    rtol = _auto_rtol({p.dtype for p in model.parameters() if p.is_floating_point()})
    try:
        return verify_once(layout, model, example_inputs, rtol=rtol, on_reference=on_reference)
    except OutputNotFound as err:
        raise InvalidArgument(
            f"{what}: the layout's blocks must be verified before a geodesic value is computed, and "
            f"automatic verification cannot find the output tensor of {type(model).__name__} ({err}). "
            f"Verify it yourself once, e.g. lay = adapters.layout(model); "
            f"lay.verify(model, inputs, output_fn=lambda out: out[...]), and pass layout=lay") from None


def accept_layout(model: nn.Module, layout: Layout, example_inputs: Any, *, what: str = "accept_layout",
                  derive: bool = True, warn: bool = True, stacklevel: int = 3,
                  on_reference: Optional[Callable[[Any], None]] = None) -> Tuple[Layout, Optional[VerifyReport]]:
    """The layout to use on ``model``: ``layout`` when it passes verification; otherwise (with
    ``derive``) the blocks that fail get their group derived from the model
    (:func:`quotient_manifolds.adapters.derive.derive_groups` on those blocks only), the derived groups replace the
    candidates and the layout is verified again.  Blocks that still fail, or whose derived algebra is
    trivial, are removed (their parameters treated elementwise) and reported in
    ``layout.unsupported`` with the reason (and a ``UserWarning`` when ``warn``): a block is never
    perturbed along a group that is not a symmetry.  Returns ``(layout, report)`` (report ``None``
    when nothing had to run).  ``layout`` itself is never modified; ``what`` names the caller in
    messages, ``stacklevel`` the warning's (as in ``warnings.warn`` from this function);
    ``on_reference`` is called with the model's output at its own weights when the first check runs
    (e.g. to refuse the batch's targets before the many forward passes of a run).

    This is what the geodesic entry points do with a layout they detect themselves (``layout=None``);
    call it to see the layout they use: ``print(adapters.accept_layout(model, adapters.layout(model),
    inputs)[0])`` shows each block's group and how it was found (``GLBlock.group_source``).

    Parameters
    ----------
    model:
        The model; never modified.
    layout:
        The candidate :class:`~quotient_manifolds.adapters.Layout` (e.g. ``adapters.layout(model)``).
    example_inputs:
        Inputs the model is called with for the check (a tensor, tuple or mapping).
    what, stacklevel:
        The caller's name in messages and the warning's stack level.
    derive:
        Derive the group of a failing block from the model before removing it.
    warn:
        Warn about the blocks removed.
    on_reference:
        Called with the model's output at its own weights when the first check runs.

    Returns
    -------
    tuple
        ``(layout, report)``: the accepted :class:`~quotient_manifolds.adapters.Layout` and the
        last :class:`~quotient_manifolds.adapters.VerifyReport` (None when nothing had to run).

    Raises
    ------
    TypeError
        ``layout`` is not a Layout.
    ValueError
        The output tensor of the model cannot be found for the check (verify it yourself with
        ``output_fn=`` and pass that layout).

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> x = torch.randn(3, 5, 4, dtype=torch.float64)
    >>> accepted, report = adapters.accept_layout(model, adapters.layout(model), x)
    >>> [block.name for block in accepted.blocks], report.passed
    (['self_attn/qk', 'self_attn/vo'], True)
    >>> accepted.blocks[0].group_source
    'family torch-mha'
    """
    if not isinstance(model, nn.Module):       # refused with the message of every entry point
        from . import validation as check

        check.module("model", model)
    if not isinstance(layout, Layout):
        raise InvalidArgumentType(f"{what}: layout must be a Layout (e.g. adapters.layout(model)), got "
                                  f"{type(layout).__name__}")
    refuse_empty_inputs(example_inputs, what)
    report = ensure_verified(model, layout, example_inputs, what=what, on_reference=on_reference)
    if layout is None or not derive or not layout.verify_failed:
        return layout, report

    failed = set(layout.verify_failed)
    derived, _ = derive_groups(model, layout, example_inputs, only=failed)
    report = ensure_verified(model, derived, example_inputs, what=what)
    dropped = list(derived.verify_failed)
    if dropped:
        deviations = {c.name: c.max_rel_dev for c in (report.blocks if report is not None else [])}
        unsupported = list(derived.unsupported)
        for b in derived.blocks:
            if b.name in dropped:
                dev = deviations.get(b.name)
                unsupported.append(Unsupported(
                    f"{b.module}/{b.kind}", type(model.get_submodule(b.module)).__name__,
                    f"not a symmetry with its group {b.group.describe(b.head_dim)} (output change "
                    f"{'n/a' if dev is None else f'{dev:.1e}'} relative; group: {b.group_source})"))
        derived = with_blocks(derived, [b for b in derived.blocks if b.name not in dropped], unsupported,
                               list(derived.notes))
        report = ensure_verified(model, derived, example_inputs, what=what)
        if derived.verify_failed:            # blocks that fail only together: nothing left to trust
            derived = with_blocks(derived, [], unsupported + [
                Unsupported(f"{b.module}/{b.kind}", type(model.get_submodule(b.module)).__name__,
                            "fails verification together with the other blocks") for b in derived.blocks],
                list(derived.notes))
    removed = [u for u in derived.unsupported if u not in layout.unsupported]
    if warn and removed:
        lines = "; ".join(f"{u.module}: {u.reason}" for u in removed)
        warnings.warn(f"{what}: {len(removed)} block(s) of the layout have no group found under which "
                      f"the model is unchanged (candidate or derived) and are treated elementwise: {lines}",
                      UserWarning, stacklevel=stacklevel)
    return derived, report


def refuse_failed_blocks(layout: Optional[Layout], *, unsafe: bool, what: str, consequence: str,
                         report: Optional[VerifyReport] = None, stacklevel: int = 3) -> None:
    """Raise :class:`~quotient_manifolds.adapters.SymmetryError` (a ``ValueError`` too) when the layout's last
    verification found blocks that are not symmetries of the model, unless ``unsafe`` (then warn)."""
    failed = list(getattr(layout, "verify_failed", None) or [])
    if not failed:
        return
    if unsafe:
        warnings.warn(f"unsafe=True: {what} uses block(s) {failed} that failed verification; "
                      f"{consequence}", UserWarning, stacklevel=stacklevel)
        return
    detail = f"\n{report}" if report is not None else ""
    raise _Refused(
        f"{what}: block(s) {failed} of the layout are not symmetries of the model (the output changes "
        f"under random elements of their group, nor of a group derived from the model): {consequence}. "
        f"Inspect them with layout.verify(model, inputs) and adapters.accept_layout(model, layout, inputs); "
        f"fix their declaration (group=, num_kv_heads=, offsets) or "
        f"leave them out of the layout (adapters.layout(model, blocks=..., detect_blocks=False)), use "
        f"geometry='adaptive', or pass unsafe=True to run anyway{detail}", report)


class _Refused(SymmetryError, InvalidArgument):
    """A layout refused because some block failed verification (both a ``SymmetryError`` and, as
    before automatic verification, a ``ValueError``: :class:`InvalidArgument`)."""


def capture_first_call(model: nn.Module, store: dict) -> Any:
    """Register a one-shot forward pre-hook that stores the inputs of the model's next call in
    ``store["inputs"]`` (detached) and removes itself; returns the hook handle."""
    handle_box = {}

    def hook(module, args, kwargs):
        if args and kwargs:                  # Layout.verify takes positional OR keyword inputs
            store["inputs"], store["mixed"] = None, True
        else:
            store["inputs"] = detach_inputs(tuple(args)) if args else dict(detach_inputs(kwargs))
        handle_box["h"].remove()

    handle_box["h"] = model.register_forward_pre_hook(hook, with_kwargs=True)
    return handle_box["h"]
