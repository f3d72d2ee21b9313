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


#: The qualified name of :class:`~quotient_manifolds.adapters.Layout`, for :func:`optional_layout`.
LAYOUT_CLASS = f"{__package__}.layouts.Layout"


def optional_layout(name: str, value: Any) -> Any:
    """``value``, refused unless it is ``None`` or a :class:`~quotient_manifolds.adapters.Layout`
    (or an instance of a subclass)."""
    # every adapters module imports this one (layouts too, through verify): it names the class
    # rather than importing it
    if value is not None and not any(f"{c.__module__}.{c.__qualname__}" == LAYOUT_CLASS for c in type(value).__mro__):
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


#: Hugging Face inputs laid out like the token ids: (batch, sequence), or (batch, choices,
#: sequence) for the ``...ForMultipleChoice`` heads
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def token_inputs(model: torch.nn.Module, inputs: Any, index: int) -> None:
    """Refuse token inputs of a Hugging Face model (one with a ``config`` and a
    ``main_input_name``) whose shape it cannot take, before the call that would fail inside the
    model with no word of which batch or which shape (``too many values to unpack``).  ``inputs``
    is what the model is called with: a dict of keyword arguments or one positional tensor (its
    ``main_input_name``)."""
    main = getattr(model, "main_input_name", None)
    if getattr(model, "config", None) is None or not isinstance(main, str):
        return
    named = dict(inputs) if isinstance(inputs, Mapping) else {main: inputs}
    choices = type(model).__name__.endswith("ForMultipleChoice")
    ndim, layout = (3, "(batch, choices, sequence)") if choices else (2, "(batch, sequence)")
    ids = named.get("input_ids")
    for key in TOKEN_INPUTS:
        value = named.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        shape = tuple(value.shape)
        if key == "attention_mask" and value.dim() > ndim:
            continue                            # a (batch, heads, query, key) mask of its own
        if value.dim() != ndim:
            if value.dim() == ndim + 1 and shape[0] == 1:
                hint = ("it has an extra leading dimension of 1: batches batched again (a DataLoader "
                        "over ready-made batches needs batch_size=None), or remove it with .squeeze(0)")
            elif value.dim() == ndim - 1:
                hint = "it has no batch dimension: for one example add it with .unsqueeze(0)"
            else:
                hint = f"give {key} as a {ndim}-D tensor"
            raise ValueError(f"batch {index}: {key} has shape {shape}, but {type(model).__name__} "
                             f"expects {ndim} dimensions {layout}; {hint}")
        if key != "input_ids" and isinstance(ids, torch.Tensor) and ids.dim() == ndim and shape != tuple(ids.shape):
            raise ValueError(f"batch {index}: {key} has shape {shape}, but input_ids has shape "
                             f"{tuple(ids.shape)}; they must match (one entry per token)")
    if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex()):
        raise TypeError(f"batch {index}: input_ids has dtype {ids.dtype}; token ids are integers "
                        f"(torch.long), e.g. the tokenizer's output or ids.long()")


def materialised(model: torch.nn.Module, what: str) -> None:
    """Refuse a model whose parameters or buffers are on the meta device (shapes without values:
    built under ``torch.device("meta")``, ``init_empty_weights`` ...): a measure needs the weights'
    values. Building a layout needs only shapes and works on such a model."""
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (", ..." if len(meta) > 3 else "")
        raise ValueError(
            f"{what}: {len(meta)} weight(s) of the model are on the meta device ({shown}): they have "
            f"shapes but no values, so nothing can be measured. Materialise the model first, e.g. "
            f"model.to_empty(device='cpu') and then model.load_state_dict(state_dict) with the trained "
            f"weights (or load it without device='meta' / init_empty_weights); adapters.layout(model) "
            f"alone works on a meta model")


# Tensor checks live with the geometry core (which must not import adapters); re-exported here.
from quotient_manifolds._validation import floating_tensor, same_shape  # noqa: E402,F401
