"""Small named checks for the arguments of the public API.

Each check raises ``ValueError`` or ``TypeError`` with a message that names the argument, says what was
given, what was expected and how to fix it, so that a bad argument never turns into a silent wrong
number or a crash deep inside the library.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Mapping, Sequence, Tuple

import torch


def positive_finite(name: str, value: Any) -> float:
    """``value`` as a float, refused unless it is a real number with ``0 < value < inf``."""
    return _finite_number(name, value, zero_allowed=False)


def non_negative_finite(name: str, value: Any) -> float:
    """``value`` as a float, refused unless it is a real number with ``0 <= value < inf``."""
    return _finite_number(name, value, zero_allowed=True)


def _finite_number(name: str, value: Any, *, zero_allowed: bool) -> float:
    what, example = ("a finite number >= 0", 0.0) if zero_allowed else ("a positive finite number", 1.0)
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)) or (
            isinstance(value, torch.Tensor) and value.numel() != 1):
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__}); pass e.g. "
                        f"{name}={example}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_allowed):
        raise ValueError(f"{name} must be {what}, got {v!r}; pass e.g. {name}={example}")
    return v


def module(name: str, value: Any) -> torch.nn.Module:
    """``value``, refused unless it is a ``torch.nn.Module``."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module (the model itself), got "
                        f"{type(value).__name__}")
    return value


def names(name: str, value: Any) -> Tuple[str, ...]:
    """A non-empty sequence of strings as a tuple (a bare string is refused: it would be read as a
    sequence of one-letter names)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset)) or not all(
            isinstance(v, str) for v in value):
        hint = f"; for one name pass {name}=[{value!r}]" if isinstance(value, str) else ""
        raise TypeError(f"{name} must be a list of names (strings), got {value!r}{hint}")
    if not value:
        raise ValueError(f"{name} must name at least one, got an empty {type(value).__name__}; pass "
                         f"None for all")
    return tuple(value)


def batches(name: str, value: Any) -> Any:
    """``value``, refused unless it is an iterable of batches (a lone tensor, dict or string is one
    batch, or none: iterating it would yield its rows, keys or characters)."""
    if isinstance(value, (str, bytes, torch.Tensor, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of batches (e.g. a list of (inputs, targets) "
                        f"pairs or a DataLoader), got {type(value).__name__}; for one batch pass "
                        f"[batch]")
    return value


def flag(name: str, value: Any) -> bool:
    """``value``, refused unless it is ``True`` or ``False`` (a string such as ``"no"`` is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def optional_callable(name: str, value: Any, what: str) -> Any:
    """``value``, refused unless it is ``None`` or callable (``what`` says how it is called)."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a function {what}, or None for the default, got "
                        f"{type(value).__name__}")
    return value


def optional_layout(name: str, value: Any) -> Any:
    """``value``, refused unless it is ``None`` or a :class:`~adapters.layout.Layout`."""
    from .layout import Layout
    if value is not None and not isinstance(value, Layout):
        raise TypeError(f"{name} must be an adapters.Layout (from adapters.layout(model)) or None to "
                        f"detect it, got {type(value).__name__}")
    return value


def integer_at_least(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, refused unless it is an integer (not a bool) with ``value >= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r} "
                        f"({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    """``value``, refused unless it is one of ``allowed``."""
    if value not in tuple(allowed):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def positive_finite_sequence(name: str, values: Any) -> Tuple[float, ...]:
    """A non-empty sequence of positive finite numbers, as a tuple of floats."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a non-empty sequence of positive finite numbers, got "
                        f"{values!r} ({type(values).__name__})")
    if len(values) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of positive finite numbers, got an "
                         f"empty one; pass at least one value (e.g. {name}=(1e-2, 1.0, 1e2))")
    return tuple(positive_finite(f"{name}[{i}]", v) for i, v in enumerate(values))


def scalar_loss(loss: Any, *, needs_grad: bool) -> torch.Tensor:
    """``loss``, refused unless it is a one-element floating tensor that, when ``needs_grad``,
    depends differentiably on the weights (what every measure maximises and differentiates)."""
    source = "the loss (loss_fn(outputs, targets), or the model's own outputs.loss)"
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{source} must be a tensor, got {type(loss).__name__} {loss!r}: make loss_fn "
                        f"return a tensor computed from the outputs with torch operations (no .item(), "
                        f"float() or numpy), e.g. torch.nn.functional.cross_entropy(outputs.logits, targets)")
    if loss.numel() != 1:
        raise ValueError(f"{source} must be one number, got a tensor of shape {tuple(loss.shape)}: make "
                         f"loss_fn reduce it, e.g. .mean() over the batch (cross_entropy's default "
                         f"reduction='mean')")
    if not loss.dtype.is_floating_point:
        raise TypeError(f"{source} must be a floating-point tensor, got dtype {loss.dtype}")
    if needs_grad and not loss.requires_grad:
        raise ValueError(f"{source} does not depend on the weights (it has no gradient): loss_fn must "
                         f"compute it from the outputs it is given, with torch operations, not return a "
                         f"constant or a detached value")
    return loss.reshape(())


# Tensor checks live with the geometry core (which must not import adapters); re-exported here.
from quotient_manifolds._validation import floating_tensor, same_shape  # noqa: E402,F401
