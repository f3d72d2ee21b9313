"""The argument checks of the geometry: the core, the geoopt and pymanopt faces and the runtime
helpers (the checks of the adapters' models, batches, layouts and options live in
:mod:`quotient_manifolds.adapters.validation`, which uses these).

Each check raises ``ValueError`` or ``TypeError`` with a message that names the argument, says what
was given, what was expected and how to fix it, so that a bad argument never turns into a silent
wrong number or a crash deep inside the library. This module imports only torch (and numpy where
an array is converted): the core may use it without importing the adapters.
"""
from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Optional, Sequence, Tuple

import torch
from .errors import InvalidArgument, InvalidArgumentType


# ----------------------------------------------------------------- tensors (core and faces)
def floating_tensor(name: str, value: Any) -> torch.Tensor:
    """``value``, refused unless it is a real floating-point tensor (integer tangent vectors would be
    truncated by the metric weights; the imaginary part of a complex one would be dropped)."""
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentType(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise InvalidArgumentType(f"{name} must be a real floating-point tensor, got dtype {value.dtype}; "
                                  f"convert it with {name + '.double()' if name == 'x' else name + '.to(x.dtype)'}")
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
        raise InvalidArgument(f"{name} has shape {shape}, expected {exp} (the shape of {what}) or batch "
                              f"dimensions that broadcast against it; pass a tangent vector shaped like "
                              f"the point")


def all_finite(name: str, value: torch.Tensor) -> None:
    """Refuse ``value`` if it holds a NaN or an infinity (every result computed from it would)."""
    if not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise InvalidArgument(f"{name} contains {bad} non-finite value(s) (nan or inf); a tangent vector "
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
        raise InvalidArgumentType(f"{name} must be an array of real numbers, got {type(value).__name__}: {err}"
                                  ) from None
    if array.dtype.kind not in "iuf":
        raise InvalidArgumentType(f"{name} must be an array of real numbers, got dtype {array.dtype} "
                                  f"({type(value).__name__}); pass a float array, e.g. np.asarray({name}, "
                                  f"dtype=float) for real values")
    if expected is not None and array.shape != tuple(expected):
        raise InvalidArgument(f"{name} has shape {array.shape}, expected {tuple(expected)}; pass an array "
                              f"shaped like the corresponding factor of the point")
    if not array.flags.writeable or any(s < 0 for s in array.strides) or array.dtype != np.float64:
        array = array.astype(np.float64)  # torch.from_numpy refuses negative strides, warns on read-only
    return torch.from_numpy(array)


# ----------------------------------------------------------------- numbers, flags, dtypes, generators
def flag(name: str, value: Any) -> bool:
    """``value``, refused unless it is ``True`` or ``False`` (a string such as ``"no"`` is truthy)."""
    if not isinstance(value, bool):
        raise InvalidArgumentType(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def integer_at_least(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, refused unless it is an integer (not a bool) with ``value >= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentType(f"{name} must be an integer >= {minimum}, got {value!r} "
                                  f"({type(value).__name__})")
    if value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def floating_dtype(name: str, dtype: Any) -> Optional[torch.dtype]:
    """``dtype``, refused unless it is ``None`` (torch's default) or a real floating torch dtype: a
    point of a real manifold has no complex or integer entries."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgumentType(f"{name} must be a real floating torch.dtype (torch.float32 or torch.float64) "
                                  f"or None for torch's default, got {dtype!r}: the points of these manifolds "
                                  f"are real matrices")
    return dtype


def optional_generator(name: str, value: Any) -> Optional[torch.Generator]:
    """``value``, refused unless it is ``None`` or a ``torch.Generator``."""
    if value is not None and not isinstance(value, torch.Generator):
        raise InvalidArgumentType(f"{name} must be a torch.Generator (e.g. torch.Generator().manual_seed(0)) or "
                                  f"None, got {type(value).__name__}")
    return value


def choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    """``value``, refused unless it is one of ``allowed`` (the message lists them, and names the
    closest when ``value`` is a string that looks like a misspelling of one)."""
    allowed = tuple(allowed)
    if value not in allowed:
        close = difflib.get_close_matches(value, allowed, n=1) if isinstance(value, str) else []
        raise InvalidArgument(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
                              + (f"; did you mean {close[0]!r}?" if close else ""))
    return value


# ----------------------------------------------------------------- the core's constructor arguments
# (ValueError for every bad value, the core's contract since its first version)
def size(name: str, value: Any) -> int:
    """A dimension (``n``, ``m``, ``h``, ``d`` ...) as a Python int: an integer >= 1, Python or
    NumPy (``np.int64(5)``, e.g. read from an array's shape), never a bool or a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidArgument(f"{name} must be a positive integer (a Python or NumPy int), got {value!r}"
                              + (f"; pass {name}={int(value)}" if isinstance(value, float) and value.is_integer()
                            and value >= 1 else ""))
    return int(value)


def relaxation(name: str, value: Any) -> float:
    """A relaxation ε of the Gram matrices as a float: a finite real number >= 0 (Python, NumPy
    or a one-element tensor)."""
    ok = not isinstance(value, bool) and isinstance(value, (numbers.Real, torch.Tensor)) and (
        not isinstance(value, torch.Tensor) or value.numel() == 1)
    if not ok or not (math.isfinite(float(value)) and float(value) >= 0):
        raise InvalidArgument(f"{name} must be a finite number ≥ 0, got {value!r}")
    return float(value)


# ----------------------------------------------------------------- group elements and sampling (core)
def batch_shape(name: str, dims: Sequence[Any]) -> Tuple[int, ...]:
    """Batch dimensions as Python ints, each an integer >= 0 (Python or NumPy)."""
    return tuple(integer_at_least(f"{name}[{i}]", d, 0) for i, d in enumerate(dims))


def group_element(name: str, value: Any, h: Optional[int] = None) -> torch.Tensor:
    """``value``, refused unless it is a finite real floating tensor (of shape (..., h, h) given
    ``h``): a NaN or an integer "group element" would give NaN or truncated points."""
    floating_tensor(name, value)
    if h is not None and tuple(value.shape[-2:]) != (h, h):
        raise InvalidArgument(f"{name} has shape {tuple(value.shape)}, expected (..., {h}, {h}): an element "
                              f"of GL({h}) per batch element")
    if not bool(torch.isfinite(value).all()):
        raise InvalidArgument(f"{name} contains non-finite values (nan or inf): not a group element")
    return value


def finite_real(name: str, value: Any) -> float:
    """``value`` as a float, refused unless it is a finite real number (of any sign)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)) or (
            isinstance(value, torch.Tensor) and value.numel() != 1) or not math.isfinite(float(value)):
        raise InvalidArgument(f"{name} must be a finite real number, got {value!r}")
    return float(value)
