"""Eval mode for the length of a call, with every submodule's own ``training`` flag restored
afterwards (a plain ``model.train(flag)`` would overwrite submodules deliberately kept in eval
mode), and the mode of a second-order pass (:func:`second_order_mode`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Tuple

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["eval_mode", "second_order_mode"]


class eval_mode:  # noqa: N801 - a context manager named like torch.no_grad
    """``with eval_mode(model):`` runs the block with ``model`` in eval mode, then restores every
    submodule's own ``training`` flag, also when the block raises. The flags are read when the
    block is entered, the modules are remembered then: leaving needs nothing of the model."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._flags: List[Tuple[nn.Module, bool]] = []

    def __enter__(self) -> nn.Module:
        self._flags = [(mod, mod.training) for mod in self.model.modules()]
        self.model.eval()
        return self.model

    def __exit__(self, *exc) -> None:
        for mod, flag in self._flags:
            mod.training = flag
        self._flags = []


@contextmanager
def second_order_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode (flags restored afterwards, :class:`eval_mode`), gradients on, and
    ``scaled_dot_product_attention`` on its math kernel: the fused kernels (flash,
    memory-efficient) have no double backward, which a Hessian-vector product needs."""
    with eval_mode(model), sdpa_kernel([SDPBackend.MATH]), torch.enable_grad():
        yield model
