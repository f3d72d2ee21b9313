"""The argument checks of the adapters: models, batches, token inputs, losses, layouts, the
options of the measures and the solver, and the results' warnings (the geometry's own checks live
in :mod:`quotient_manifolds._validation`). Each raises ``ValueError`` or ``TypeError`` with a
message that names the argument, says what was given, what was expected and how to fix it. This
module imports only torch and the geometry's checks: every module of the adapters may use it."""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from quotient_manifolds import _validation as base
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UnknownName


# ----------------------------------------------------------------- numbers, names, models

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
        raise InvalidArgumentType(f"{name} must be {what}, got {value!r} ({type(value).__name__}); pass e.g. "
                                  f"{name}={example}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_allowed):
        raise InvalidArgument(f"{name} must be {what}, got {v!r}; pass e.g. {name}={example}")
    return v


def module(name: str, value: Any) -> torch.nn.Module:
    """``value``, refused unless it is a ``torch.nn.Module``."""
    if not isinstance(value, torch.nn.Module):
        raise InvalidArgumentType(f"{name} must be a torch.nn.Module (the model itself), got "
                                  f"{type(value).__name__}")
    return value


def names(name: str, value: Any) -> Tuple[str, ...]:
    """A non-empty sequence of strings as a tuple (a bare string is refused: it would be read as a
    sequence of one-letter names)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset)) or not all(
            isinstance(v, str) for v in value):
        hint = f"; for one name pass {name}=[{value!r}]" if isinstance(value, str) else ""
        raise InvalidArgumentType(f"{name} must be a list of names (strings), got {value!r}{hint}")
    if not value:
        raise InvalidArgument(f"{name} must name at least one, got an empty {type(value).__name__}; pass "
                              f"None for all")
    return tuple(value)


def batches(name: str, value: Any) -> Any:
    """``value``, refused unless it is an iterable of batches (a lone tensor, dict or string is one
    batch, or none: iterating it would yield its rows, keys or characters)."""
    if isinstance(value, (str, bytes, torch.Tensor, Mapping)) or not isinstance(value, Iterable):
        raise InvalidArgumentType(f"{name} must be an iterable of batches (e.g. a list of (inputs, targets) "
                                  f"pairs or a DataLoader), got {type(value).__name__}; for one batch pass "
                                  f"[batch]")
    return value


def optional_callable(name: str, value: Any, what: str) -> Any:
    """``value``, refused unless it is ``None`` or callable (``what`` says how it is called)."""
    if value is not None and not callable(value):
        raise InvalidArgumentType(f"{name} must be a function {what}, or None for the default, got "
                                  f"{type(value).__name__}")
    return value


#: The qualified name of :class:`~quotient_manifolds.adapters.Layout`, for :func:`optional_layout`.
LAYOUT_CLASS = "quotient_manifolds.adapters.layouts.Layout"


def optional_layout(name: str, value: Any) -> Any:
    """``value``, refused unless it is ``None`` or a :class:`~quotient_manifolds.adapters.Layout`
    (or an instance of a subclass)."""
    # every module imports this one (the adapters' layouts too, through verify): it names the
    # class rather than importing it
    if value is not None and not any(f"{c.__module__}.{c.__qualname__}" == LAYOUT_CLASS for c in type(value).__mro__):
        raise InvalidArgumentType(f"{name} must be an adapters.Layout (from adapters.layout(model)) or None to "
                                  f"detect it, got {type(value).__name__}")
    return value


def positive_finite_sequence(name: str, values: Any) -> Tuple[float, ...]:
    """A non-empty sequence of positive finite numbers, as a tuple of floats."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidArgumentType(f"{name} must be a non-empty sequence of positive finite numbers, got "
                                  f"{values!r} ({type(values).__name__})")
    if len(values) == 0:
        raise InvalidArgument(f"{name} must be a non-empty sequence of positive finite numbers, got an "
                              f"empty one; pass at least one value (e.g. {name}=(1e-2, 1.0, 1e2))")
    return tuple(positive_finite(f"{name}[{i}]", v) for i, v in enumerate(values))


def scalar_loss(loss: Any, *, needs_grad: bool, closure: bool = False) -> torch.Tensor:
    """``loss``, refused unless it is a one-element floating tensor that, when ``needs_grad``,
    depends differentiably on the weights (what every measure maximises and differentiates).
    ``closure``: the loss is the value of a solver's ``closure(points)``, which the messages name
    (else ``loss_fn`` or the model's own loss)."""
    if closure:
        source, maker, inputs = "the closure's value closure(points)", "the closure", "points"
        example = "((points[0] - 1) ** 2).sum()"
    else:
        source = "the loss (loss_fn(outputs, targets), or the model's own outputs.loss)"
        maker, inputs = "loss_fn", "outputs"
        example = "torch.nn.functional.cross_entropy(outputs.logits, targets)"
    if not isinstance(loss, torch.Tensor):
        raise InvalidArgumentType(f"{source} must be a tensor, got {type(loss).__name__} {loss!r}: make {maker} "
                                  f"return a tensor computed from the {inputs} with torch operations (no .item(), "
                                  f"float() or numpy), e.g. {example}")
    if loss.numel() != 1:
        raise InvalidArgument(f"{source} must be one number, got a tensor of shape {tuple(loss.shape)}: make "
                              f"{maker} reduce it, e.g. .mean() over the batch (cross_entropy's default "
                              f"reduction='mean')")
    if not loss.dtype.is_floating_point:
        raise InvalidArgumentType(f"{source} must be a floating-point tensor, got dtype {loss.dtype}")
    if needs_grad and not loss.requires_grad:
        gradients_available("this call (a Riemannian Hessian, a worst-case ascent)")  # the cause there
        raise InvalidArgument(f"{source} does not depend on the weights (it has no gradient): {maker} must "
                              f"compute it from the {inputs} it is given, with torch operations, not return a "
                              f"constant or a detached value")
    return loss.reshape(())


#: Hugging Face inputs laid out like the token ids: (batch, sequence), or (batch, choices,
#: sequence) for the ``...ForMultipleChoice`` heads
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class TokenInputs:
    """The checks of a model's token inputs, with what they read of the model read once (its class
    name, ``main_input_name``, whether it has a Hugging Face ``config``, the rows of its input
    embedding): ``TokenInputs(model).check(inputs, index)`` refuses a batch the model cannot take,
    naming the batch, before the call that would fail inside the model with no word of which batch
    or which shape (``too many values to unpack``, ``index out of range in self``)."""

    def __init__(self, model: torch.nn.Module):
        main = getattr(model, "main_input_name", None)
        self.model_name = type(model).__name__
        #: the name of the model's one positional input (Hugging Face ``main_input_name``), or None
        self.main_input = main if isinstance(main, str) else None
        self.hugging_face = getattr(model, "config", None) is not None and self.main_input is not None
        #: the number of rows of the input embedding (``get_input_embeddings()``), or None
        self.vocabulary = _vocabulary(model)

    def check(self, inputs: Any, index: int) -> None:
        """Refuse ``inputs`` (what the model is called with: a dict of keyword arguments or one
        positional tensor) of batch ``index``: empty, of a token shape the model cannot take,
        floating token ids (of a Hugging Face model: one with a ``config`` and a
        ``main_input_name``), or ids outside the vocabulary (the rows of its input embedding)."""
        non_empty_batch(inputs, index)
        if self.hugging_face:
            self._shapes(inputs, index)
        self._in_vocabulary(inputs, index)

    def _shapes(self, inputs: Any, index: int) -> None:
        named = dict(inputs) if isinstance(inputs, Mapping) else {self.main_input: inputs}
        choices = self.model_name.endswith("ForMultipleChoice")
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
                raise InvalidArgument(f"batch {index}: {key} has shape {shape}, but {self.model_name} "
                                      f"expects {ndim} dimensions {layout}; {hint}")
            if key != "input_ids" and isinstance(ids, torch.Tensor) and ids.dim() == ndim and shape != tuple(ids.shape):
                raise InvalidArgument(f"batch {index}: {key} has shape {shape}, but input_ids has shape "
                                      f"{tuple(ids.shape)}; they must match (one entry per token)")
        if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex()):
            raise InvalidArgumentType(f"batch {index}: input_ids has dtype {ids.dtype}; token ids are integers "
                                      f"(torch.long), e.g. the tokenizer's output or ids.long()")

    def _in_vocabulary(self, inputs: Any, index: int) -> None:
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else (
            inputs if self.main_input == "input_ids" else None)
        vocab = self.vocabulary
        if vocab is None or not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.numel() == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            where = tuple(int(i) for i in torch.nonzero(ids == bad)[0])
            raise InvalidArgument(f"batch {index}: input_ids holds the token id {bad} (at {where}), outside "
                                  f"the vocabulary of {self.model_name} (ids 0 .. {vocab - 1}): the "
                                  f"batch was tokenised with another tokenizer, or padding / ignore values "
                                  f"(-100) were put in input_ids rather than in labels")


def _vocabulary(model: torch.nn.Module) -> Optional[int]:
    """The rows of the model's input embedding (``get_input_embeddings().num_embeddings``), or None
    where it has none that says."""
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        return None
    try:
        embedding = get()
    except (NotImplementedError, AttributeError):
        return None
    vocab = getattr(embedding, "num_embeddings", None)
    return vocab if isinstance(vocab, int) else None


def materialised(model: torch.nn.Module, what: str) -> None:
    """Refuse a model whose parameters or buffers are on the meta device (shapes without values:
    built under ``torch.device("meta")``, ``init_empty_weights`` ...): a measure needs the weights'
    values. Building a layout needs only shapes and works on such a model."""
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (", ..." if len(meta) > 3 else "")
        raise InvalidArgument(
            f"{what}: {len(meta)} weight(s) of the model are on the meta device ({shown}): they have "
            f"shapes but no values, so nothing can be measured. Materialise the model first, e.g. "
            f"model.to_empty(device='cpu') and then model.load_state_dict(state_dict) with the trained "
            f"weights (or load it without device='meta' / init_empty_weights); adapters.layout(model) "
            f"alone works on a meta model")


# ----------------------------------------------------------------- sizes and intervals
def positive_integer(name: str, value: Any) -> int:
    """``value`` as a Python int, refused unless it is an integer >= 1: Python and NumPy integers
    (``np.int64(5)``) alike, never a bool or a float (``5.0``)."""
    return base.integer_at_least(name, value, 1)


def in_interval(name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool,
                meaning: str = "") -> float:
    """``value`` as a float, refused unless it is a finite real number in the interval from ``low``
    to ``high`` (open or closed at each end as told); ``meaning`` says what it is."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    what = f"a number in {interval}" + (f" ({meaning})" if meaning else "")
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)) or (
            isinstance(value, torch.Tensor) and value.numel() != 1):
        raise InvalidArgumentType(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    v = float(value)
    inside = (math.isfinite(v) and (v > low if low_open else v >= low)
              and (v < high if high_open else v <= high))
    if not inside:
        raise InvalidArgument(f"{name} must be {what}, got {v!r}")
    return v


def radius(rho: Any, name: str = "rho") -> float:
    """``rho`` (the argument ``name``) as a float: Python or NumPy scalars and 0-d arrays or
    tensors; refused unless finite and > 0."""
    value = rho
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        if getattr(value, "ndim", 0) != 0:
            raise InvalidArgument(f"{name} must be a scalar, got an array of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} must be a number > 0 (float, int, numpy scalar or 0-d "
                              f"array/tensor), got {rho!r} of type {type(rho).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{name} must be a finite number > 0 (the radius of the ball), got {rho!r}")
    return value


# ----------------------------------------------------------------- evaluation of a model
def gradients_available(what: str) -> None:
    """Refuse to start ``what`` under ``torch.inference_mode()``: tensors made there can never
    take part in autograd, so no gradient of the loss could be taken (and ``enable_grad`` does
    not lift it), whatever the loss function."""
    if torch.is_inference_mode_enabled():
        raise InvalidArgument(
            f"{what} needs the gradient of the loss with respect to the weights, which "
            f"torch.inference_mode() forbids, and it is active here. Call it outside the "
            f"inference_mode block (torch.no_grad() around it is fine)")


def class_logits(logits: torch.Tensor, targets: Any) -> None:
    """Refuse logits the default loss would read on the wrong axis: it is
    ``cross_entropy(logits, targets)``, which takes dim 1 as the classes. For logits of shape
    (batch, classes) that is right; for (batch, tokens, classes) — a causal LM, a token
    classifier — dim 1 is the tokens, and the loss is silently wrong (when tokens == classes) or
    a shape error."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 3:
        return
    shown = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
    raise InvalidArgument(
        f"the default loss is cross_entropy(logits, targets), which reads dim 1 of the logits as "
        f"the classes, but these logits have shape {tuple(logits.shape)} ({logits.dim()} "
        f"dimensions; targets {shown}): for per-token logits (batch, tokens, classes) dim 1 is the "
        f"tokens. Pass loss_fn=: for a causal language model loss_fn=adapters.next_token_loss; for "
        f"token classification loss_fn=lambda outputs, targets: torch.nn.functional.cross_entropy("
        f"outputs.logits.flatten(0, 1), targets.flatten()); for logits laid out (batch, classes, "
        f"...) on purpose (segmentation) loss_fn=torch.nn.functional.cross_entropy")


def own_loss(outputs: Any, inputs: Any) -> torch.Tensor:
    """The model's own loss (``outputs.loss``, which Hugging Face models compute from a batch's
    ``labels``), refused with the reason when the model did not return one."""
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    keys = sorted(inputs) if isinstance(inputs, Mapping) else []
    if isinstance(outputs, (tuple, list)) and "labels" in keys:
        raise InvalidArgument(
            f"the model returned a {type(outputs).__name__} (config.return_dict=False), not an "
            f"output object with .loss, although the batch has 'labels': without loss_fn the "
            f"model's own outputs.loss is used. Set model.config.return_dict = True, or pass "
            f"loss_fn=callable(outputs, labels) that reads the logits from the tuple")
    if "labels" in keys:
        raise InvalidArgument(
            f"the model's output ({type(outputs).__name__}) has no loss although the batch has "
            f"'labels' (keys {keys}): pass loss_fn=callable(outputs, labels), e.g. "
            f"adapters.next_token_loss for a causal language model")
    raise InvalidArgument(
        f"the model returned no loss for a dict batch (keys {keys}): without loss_fn the model's "
        f"own `outputs.loss` is used, which Hugging Face models compute only when the batch has "
        f"'labels'. Add 'labels' to the batch or pass loss_fn=callable(outputs, labels), e.g. "
        f"adapters.next_token_loss")


def non_empty_batch(inputs: Any, index: int) -> None:
    """Refuse a batch with no example (a tensor, or a dict of tensors, whose batch dimension is
    0): its mean loss is 0/0, or the model fails on it with no word of which batch."""
    tensors = ([inputs] if isinstance(inputs, torch.Tensor) else
               [v for v in inputs.values() if isinstance(v, torch.Tensor)] if isinstance(inputs, Mapping)
               else [v for v in inputs if isinstance(v, torch.Tensor)]
               if isinstance(inputs, (tuple, list)) else [])
    empty = [t for t in tensors if t.dim() >= 1 and t.shape[0] == 0]
    if tensors and len(empty) == len([t for t in tensors if t.dim() >= 1]) and empty:
        raise InvalidArgument(f"batch {index} is empty (batch dimension 0, inputs of shape "
                              f"{tuple(empty[0].shape)}): a loss over no example is undefined; drop "
                              f"empty batches (e.g. DataLoader(..., drop_last=True) when the last one "
                              f"can be empty)")


# ----------------------------------------------------------------- results
def ascent_found(result: Any, rho: float, *, stacklevel: int = 2) -> None:
    """Warn when a worst-case run found no point of the ball with a loss above the unperturbed
    one (``result``: an :class:`~quotient_manifolds.adapters.solver.APGDResult`). Its sharpness is then
    reported as 0, a lower bound and not the maximum: a larger ball contains every smaller one,
    whose rise may well be > 0. The cause is the solver, not the model: either every point it
    tried had a lower loss than the centre (steps of length ~2ρ overshoot into a region where the
    loss falls, typically a softmax saturated at probability 1 where the loss and its gradient
    are exactly 0 in float32, so no step can leave it), or the loss did not change at all (its
    gradient at the centre is 0 to the precision of the loss)."""
    init, worst = result.init_loss, result.worst_loss
    tried = list(result.history[1:])
    if worst > init or not tried:
        return
    moved = [v for v in tried if v != init]
    if moved:
        zeros = sum(v == 0.0 for v in tried)
        cause = (f"every point tried had a lower loss (largest {max(moved):.4g}"
                 f"{f'; {zeros} of {len(tried)} exactly 0: the loss saturated there and its gradient vanished' if zeros else ''}): "
                 f"the steps, of initial length 2·rho·step_size_mult, overshoot into a region where the "
                 f"loss falls")
    else:
        cause = ("the loss did not change at any point tried: its gradient at the unperturbed "
                 "weights is 0 to the precision of the loss (saturated)")
    import warnings
    warnings.warn(
        f"worst-case sharpness at rho={rho:g}: no point with a loss above the unperturbed loss "
        f"{init:.6g} was found in {len(tried)} iterations, so the sharpness is reported as 0, a "
        f"lower bound and not the maximum (a smaller ball may report more). Cause: {cause}. Use "
        f"adapters.sharpness_sweep over increasing radii ending at this one (each starts from the "
        f"worst point of the smaller ball), a smaller step_size_mult (e.g. 1e-2), or compute in "
        f"float64", UserWarning, stacklevel=stacklevel + 1)


def plain_numbers(options: Any, *, ints: Sequence[str] = (), floats: Sequence[str] = ()) -> None:
    """Set the fields ``ints`` and ``floats`` of a frozen dataclass of checked options to the
    Python ``int`` / ``float`` they equal (a NumPy scalar or 0-d tensor given for one is taken as
    its value), so that options recorded in a result are plain numbers (JSON, comparisons);
    ``None`` stays ``None``."""
    for names, kind in ((ints, int), (floats, float)):
        for name in names:
            value = getattr(options, name)
            if value is not None:
                object.__setattr__(options, name, kind(value))


# ----------------------------------------------------------------- the low-level solver and layouts
def layout_for_ball(layout: Any, params0: Mapping[str, torch.Tensor], geometry: str) -> None:
    """Refuse a layout a geodesic ball cannot be built from: none at all, or one whose weights
    disagree with the weights perturbed now (``params0``: the parameters with
    ``requires_grad=True``, and the frozen ones with ``include_frozen``). A block on a weight that
    is frozen now would fail on it; a trainable weight the layout left out (it was frozen when the
    layout was built) would silently stay out of the ball."""
    if layout is None:
        raise InvalidArgument(f"geometry={geometry!r} needs layout=: the GL blocks of the model, e.g. "
                              f"layout = adapters.layout(model), verified on a batch with "
                              f"adapters.accept_layout(model, layout, inputs)[0]; for the elementwise "
                              f"ball of every weight pass geometry='adaptive'")
    optional_layout("layout", layout)
    in_blocks = {n: b.name for b in layout.blocks for n in b.params}
    missing = [n for n in in_blocks if n not in params0]
    covered = set(in_blocks) | set(layout.adaptive)
    left_out = [n for n in params0 if n not in covered]
    if not (missing or left_out):
        return
    if missing:
        what = (f"its block(s) use weight(s) that are not perturbed now (requires_grad=False): "
                f"{', '.join(f'{n} (block {in_blocks[n]})' for n in missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''}")
    else:
        what = (f"weight(s) perturbed now (requires_grad=True) are in none of its parts: "
                f"{', '.join(left_out[:4])}{', ...' if len(left_out) > 4 else ''} (frozen when the "
                f"layout was built?)")
    raise InvalidArgument(f"the layout does not match the model's current requires_grad flags: {what}. "
                          f"Build the layout after setting requires_grad (adapters.layout(model)), or "
                          f"pass include_frozen=True to perturb frozen weights too")


def condition_number(name: str, value: Any) -> Optional[float]:
    """``value`` as a float, refused unless it is ``None`` or a finite number >= 1 (the condition
    number of the random group elements; ``None``: Gaussian ones)."""
    if value is None:
        return None
    if positive_finite(name, value) < 1:
        raise InvalidArgument(f"{name} must be a condition number >= 1 (or None for Gaussian actions), "
                              f"got {value!r}")
    return float(value)


def ball_and_closure(ball: Any, closure: Any) -> None:
    """Refuse a ``ball`` that is not a product ball (``build_ball``'s first result) and a
    ``closure`` that is not callable."""
    if not hasattr(ball, "components") or not hasattr(ball, "zeros"):
        raise InvalidArgumentType(f"ball must be a ProductBall (the first result of adapters.ball.build_ball), got "
                                  f"{type(ball).__name__}")
    if not callable(closure):
        raise InvalidArgumentType(f"closure must be a function closure(points) -> scalar loss tensor, got "
                                  f"{type(closure).__name__}")


def scalar_closure(closure: Callable) -> Callable:
    """``closure`` with every loss it returns checked to be one floating number that, where
    gradients are being taken, depends on the points (:func:`scalar_loss`)."""
    def checked(points):
        loss = closure(points)
        return scalar_loss(loss, closure=True, needs_grad=torch.is_grad_enabled() and any(
            isinstance(p, torch.Tensor) and p.requires_grad for p in points))
    return checked


def warm_start(start: Any, zeros: Sequence[torch.Tensor]) -> None:
    """Refuse a warm start of ``auto_pgd`` that is not ``(ξ₀, ℓ(0))``: a tangent vector shaped
    like the ball's points (``zeros``: ``ball.zeros()``) and a finite loss."""
    if start is None:
        return
    if not isinstance(start, (tuple, list)) or len(start) != 2:
        raise InvalidArgumentType(f"start must be a pair (xi, loss0) (e.g. the .xi and .init_loss of an earlier "
                                  f"APGDResult), got {type(start).__name__}")
    xi, loss0 = start
    shapes = [tuple(z.shape) for z in zeros]
    if (isinstance(xi, torch.Tensor) or not isinstance(xi, (tuple, list)) or len(xi) != len(shapes)
            or not all(isinstance(t, torch.Tensor) for t in xi)):
        raise InvalidArgumentType(f"start[0] must be a list of {len(shapes)} tensors shaped like the ball's points "
                                  f"{shapes}, got {type(xi).__name__}")
    bad = [i for i, (t, s) in enumerate(zip(xi, shapes)) if tuple(t.shape) != s or not t.is_floating_point()]
    if bad:
        i = bad[0]
        raise InvalidArgument(f"start[0][{i}] has shape {tuple(xi[i].shape)} and dtype {xi[i].dtype}, expected "
                              f"a floating tensor of shape {shapes[i]} (the ball's component {i})")
    if isinstance(loss0, bool) or not isinstance(loss0, numbers.Real) or not math.isfinite(float(loss0)):
        raise InvalidArgument(f"start[1] must be the finite loss at the centre, got {loss0!r}")


def group_actions(blocks: Sequence[Any], actions: Any) -> None:
    """Refuse ``actions`` (block name → ``(heads, h, h)`` tensor) that are not group elements of
    the blocks: an unknown block, a tensor of another shape, integer or complex entries, a
    non-finite or a (numerically) singular matrix, whose inverse in ``H A⁻ᵀ`` would be garbage."""
    if not isinstance(actions, Mapping):
        raise InvalidArgumentType(f"actions must be a dict block name -> (heads, h, h) tensor (e.g. "
                                  f"layout.random_actions(scale=1.0)), got {type(actions).__name__}")
    by_name = {b.name: b for b in blocks}
    unknown = [k for k in actions if k not in by_name]
    if unknown:
        raise UnknownName(f"actions for unknown blocks {sorted(map(str, unknown))}; the layout's blocks "
                         f"are {sorted(by_name)}")
    for name, A in actions.items():
        b = by_name[name]
        want = (b.num_heads, b.head_dim, b.head_dim)
        if not isinstance(A, torch.Tensor) or not A.is_floating_point() or tuple(A.shape) != want:
            what = (f"a {A.dtype} tensor of shape {tuple(A.shape)}" if isinstance(A, torch.Tensor)
                    else type(A).__name__)
            raise InvalidArgumentType(f"actions[{name!r}] must be a real floating tensor of shape {want} "
                                      f"(heads, h, h), got {what}")
        if not bool(torch.isfinite(A).all()):
            raise InvalidArgument(f"actions[{name!r}] contains non-finite values (nan or inf): not a group "
                                  f"element")
        sv = torch.linalg.svdvals(A.double())
        if bool((sv[..., -1] <= sv[..., 0] * 1e3 * torch.finfo(A.dtype).eps).any()):
            raise InvalidArgument(f"actions[{name!r}] holds a singular (or numerically singular) matrix: not "
                                  f"an element of GL(h); its smallest/largest singular value is "
                                  f"{float((sv[..., -1] / sv[..., 0].clamp_min(1e-300)).min()):.1e}")


def parameter_tensors(name: str, params: Any, model: torch.nn.Module) -> None:
    """Refuse ``params`` (parameter name → tensor) unless it is a non-empty mapping of real
    floating tensors named and shaped like parameters of ``model``."""
    if not isinstance(params, Mapping):
        raise InvalidArgumentType(f"{name} must be a dict parameter name -> tensor (e.g. {{n: p.detach() for n, p "
                                  f"in model.named_parameters()}}), got {type(params).__name__}")
    if not params:
        raise InvalidArgument(f"{name} is empty: pass the parameters to perturb, e.g. {{n: p.detach() for n, "
                              f"p in model.named_parameters() if p.requires_grad}}")
    # a sharded (DTensor) parameter may be given as this rank's shard or as the whole tensor
    shapes = {n: tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
              for n, p in model.named_parameters()}
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for n, t in params.items():
        if n not in shapes:
            raise InvalidArgument(f"{name}[{n!r}]: the model has no parameter of that name")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InvalidArgumentType(f"{name}[{n!r}] must be a real floating tensor, got "
                                      f"{getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) not in (shapes[n], whole[n]):
            raise InvalidArgument(f"{name}[{n!r}] has shape {tuple(t.shape)}, the parameter {shapes[n]}")


#: integer targets found in range, by tensor (a view by its base): the view's place, the
#: version counter and the number of classes at that check. A loss evaluated many times on one
#: batch (every iteration of a sharpness run) reads its targets' range once: the range check
#: reads values on the host, a sync that would stall an accelerator in every evaluation.
_TARGETS_IN_RANGE = WeakIdKeyDictionary()


def class_targets(logits: torch.Tensor, targets: Any, what: str = "the default loss") -> None:
    """Refuse ``targets`` that ``cross_entropy(logits, targets)`` cannot read as class indices
    (or probabilities) of these ``logits`` — a non-tensor, a batch size of its own, a class out
    of range — before torch fails with no word of which argument (``Target 5 is out of
    bounds``). The range is read once per targets tensor and number of classes, and again after
    torch modifies the tensor in place (its version counter; a write through a numpy view of it
    is not seen)."""
    if not isinstance(targets, torch.Tensor):
        raise InvalidArgumentType(f"{what}: the targets must be a tensor of class indices, got "
                                  f"{type(targets).__name__}")
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise InvalidArgumentType(f"{what}: the logits must be a real floating tensor, got "
                                  f"{getattr(logits, 'dtype', type(logits).__name__)}")
    classes = logits.shape[-1]
    if targets.is_floating_point():
        if tuple(targets.shape) != tuple(logits.shape):
            raise InvalidArgument(f"{what}: floating targets are read as class probabilities and must have "
                                  f"the logits' shape {tuple(logits.shape)}, got {tuple(targets.shape)}; "
                                  f"class indices are integers (targets.long())")
        return
    if targets.is_complex() or targets.dtype == torch.bool:
        raise InvalidArgumentType(f"{what}: the targets must be integer class indices, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise InvalidArgument(f"{what}: the targets have shape {tuple(targets.shape)}, but the logits "
                              f"{tuple(logits.shape)} need {tuple(logits.shape[:-1])} (one class index per "
                              f"row of logits)")
    base = targets if targets._base is None else targets._base
    # an inference tensor has no version counter: it is read every time
    seen = None if targets.is_inference() else (
        targets.storage_offset(), tuple(targets.shape), targets.stride(), targets._version, classes)
    if seen is not None and _TARGETS_IN_RANGE.get(base) == seen:
        return
    kept = targets[targets != -100]
    low, high = torch.stack(torch.aminmax(kept)).tolist() if kept.numel() else (0, 0)  # one read
    if low < 0 or high >= classes:
        bad = low if low < 0 else high
        raise InvalidArgument(f"{what}: the targets hold the class {bad}, but the logits have {classes} "
                              f"classes (0 .. {classes - 1}; -100 marks an ignored position)")
    if seen is not None:
        _TARGETS_IN_RANGE[base] = seen
