"""Checks of tangent-vector arguments of the manifold faces (shared by the geoopt and pymanopt faces).

Messages name the argument, say what was given and expected, and how to fix it.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def floating_tensor(name: str, value: Any) -> torch.Tensor:
    """``value``, refused unless it is a real floating-point tensor (integer tangent vectors would be
    truncated by the metric weights; the imaginary part of a complex one would be dropped)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a real floating-point tensor, got dtype {value.dtype}; "
                        f"convert it with {name}.to(x.dtype)")
    return value


def same_shape(name: str, value: torch.Tensor, expected: Sequence[int], what: str) -> None:
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


def all_finite(name: str, value: torch.Tensor) -> None:
    """Refuse ``value`` if it holds a NaN or an infinity (every result computed from it would)."""
    if not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name} contains {bad} non-finite value(s) (nan or inf); a tangent vector "
                         f"must be finite: look for a diverged gradient or a division by zero where "
                         f"it was computed")


def tangent(name: str, value: Any, expected: Sequence[int], what: str, *,
            finite: bool = True) -> torch.Tensor:
    """``value`` checked to be a usable tangent vector at a point of shape ``expected``: a real
    floating tensor (:func:`floating_tensor`), of that shape (:func:`same_shape`), finite
    (:func:`all_finite`; ``finite=False`` leaves that to the caller, e.g. a retraction, for which
    a non-finite step is a step too large)."""
    floating_tensor(name, value)
    same_shape(name, value, expected, what)
    if finite:
        all_finite(name, value)
    return value


def real_array_as_float64(name: str, value: Any, expected: Optional[Sequence[int]] = None
                          ) -> torch.Tensor:
    """A numpy-like array of real numbers as a float64 tensor (integers convert exactly: the pymanopt
    faces compute and answer in float64 whatever the input), refused if it holds anything else
    (booleans, complex numbers, strings, objects) or, given ``expected``, has another shape."""
    import numpy as np

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as err:  # ragged nested lists
        raise TypeError(f"{name} must be an array of real numbers, got {type(value).__name__}: {err}"
                        ) from None
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be an array of real numbers, got dtype {array.dtype} "
                        f"({type(value).__name__}); pass a float array, e.g. np.asarray({name}, "
                        f"dtype=float) for real values")
    if expected is not None and array.shape != tuple(expected):
        raise ValueError(f"{name} has shape {array.shape}, expected {tuple(expected)}; pass an array "
                         f"shaped like the corresponding factor of the point")
    if not array.flags.writeable or any(s < 0 for s in array.strides) or array.dtype != np.float64:
        array = array.astype(np.float64)  # torch.from_numpy refuses negative strides, warns on read-only
    return torch.from_numpy(array)
