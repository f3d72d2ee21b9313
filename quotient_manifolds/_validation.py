"""Checks of tangent-vector arguments of the manifold faces (shared by the geoopt and pymanopt faces).

Messages name the argument, say what was given and expected, and how to fix it.
"""
from __future__ import annotations

from typing import Any

import torch


def floating_tensor(name: str, value: Any) -> torch.Tensor:
    """``value``, refused unless it is a floating-point tensor (integer tangent vectors would be
    truncated by the metric weights)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not (value.is_floating_point() or value.is_complex()):
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}; convert it "
                        f"with {name}.to(x.dtype)")
    return value


def same_shape(name: str, value: torch.Tensor, expected: torch.Size, what: str) -> None:
    """Refuse ``value`` unless its last two dimensions equal those of ``expected`` (the shape of
    ``what``) and its batch dimensions broadcast against those of ``expected``."""
    shape, exp = tuple(value.shape), tuple(expected)
    ok = shape[-2:] == exp[-2:]
    if ok:
        try:
            torch.broadcast_shapes(shape[:-2], exp[:-2])
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(f"{name} has shape {shape}, expected {exp} (the shape of {what}) or batch "
                         f"dimensions that broadcast against it; pass a tangent vector shaped like "
                         f"the point")
