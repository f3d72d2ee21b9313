r"""Evaluating a model: inputs onto its device (:func:`split_inputs`), tensors inside nested containers
(:func:`map_tensors`), the parts of a batch (:func:`split_batch`), the loss at perturbed weights
(:class:`ModelClosure`) and the half-precision policy (:func:`as_compute`, :func:`to_device`).

Half precision: a float16 / bfloat16 model is evaluated in float32 at its trained weights (its
weights read in float32 where the model reads them, float32 copies of its buffers, half-precision
floating inputs cast too; :mod:`~quotient_manifolds.adapters.streaming`). The reported value is the sharpness of the same weights in float32: in half precision the perturbations
(relative size ~ρ/√#weights) round away against the weights, and loss differences below the half
resolution of the loss vanish.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Dict, Iterable, List, Mapping, NoReturn, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from quotient_manifolds._validation import integer_at_least
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

from . import validation as check
from .elementwise import KERNEL_LIMIT
from .losses import HALF_DTYPES, default_loss, logits_of, normalize_logits
from .modes import eval_mode
from .streaming import LazyWeight, Slots, parameter_slots, substituted
from .validation import TokenInputs, scalar_loss

__all__ = ["map_tensors", "device_of", "split_inputs", "split_batch", "ModelClosure",
           "as_compute", "to_device", "class_targets_check", "all_finite", "loss_of", "detach_inputs",
           "capture_module_inputs", "weighted_batches", "batch_size_of", "raise_explained"]


def map_tensors(fn: Callable[[Tensor], Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, also inside dicts, tuples and lists (a
    batch's inputs or targets); anything else is returned as it is."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if type(obj) in (tuple, list):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def device_of(tensors: Iterable[Tensor]) -> Optional[torch.device]:
    """The device of the first of ``tensors`` (e.g. ``itertools.chain(model.parameters(),
    model.buffers())``) that is not on the meta device; None when there is none."""
    return next((t.device for t in tensors if not t.is_meta), None)


def split_inputs(example_inputs, device: Optional[torch.device]) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of a model with ``example_inputs`` (a tensor, a tuple / list of
    positional arguments or a dict of keyword arguments), every tensor moved to ``device`` (the
    model's: :func:`device_of`), so that inputs prepared on the CPU work on a model moved to a GPU;
    ``device=None`` leaves them where they are."""

    def moved(x):
        return x if device is None else map_tensors(lambda t: t.to(device), x)

    if isinstance(example_inputs, Mapping):
        return (), moved(dict(example_inputs))
    if isinstance(example_inputs, (tuple, list)):
        return moved(tuple(example_inputs)), {}
    return (moved(example_inputs),), {}


class ModelClosure:
    """Evaluates the loss of ``model`` on one batch at the perturbed parameters given by a ball.

    ``loss_fn=None`` takes the model's own ``outputs.loss`` (Hugging Face models given labels)."""

    def __init__(self, model: torch.nn.Module, params0: Dict[str, Tensor],
                 buffers: Dict[str, Tensor], write_back: Callable[[List[Tensor]], Dict[str, Tensor]],
                 loss_fn: Optional[Callable], normalise: bool):
        self.model, self.params0, self.buffers = model, params0, buffers
        self.write_back, self.loss_fn, self.normalise = write_back, loss_fn, normalise
        self.inputs: Any = None
        self.targets: Any = None
        #: where the recipes' parameters live, found once (the same names at every evaluation)
        self._slots: Optional[Tuple[frozenset, Slots]] = None

    def __call__(self, points: List[Tensor]) -> Tensor:
        params = self.write_back(points)
        # recipes (streaming ball points, frozen half-precision weights) are read where the model
        # reads the weight; the other tensors are swapped in for the call
        lazy = {n: v for d in (self.buffers, params) for n, v in d.items() if isinstance(v, LazyWeight)}
        tensors = {n: v for d in (self.buffers, params) for n, v in d.items() if n not in lazy}
        if lazy and (self._slots is None or self._slots[0] != lazy.keys()):
            self._slots = (frozenset(lazy), parameter_slots(self.model, lazy))
        # tensors the model holds already (its own buffers, when every parameter streams) need no
        # swap: functional_call walks every module's parameters and buffers at each call (about
        # 1 ms on a 12-layer model on the CPU, host time a GPU waits for)
        swapped = any(not self._holds(n, v) for n, v in tensors.items())
        args, kwargs = (((), dict(self.inputs)) if isinstance(self.inputs, Mapping)
                        else ((self.inputs,), {}))
        with substituted(self.model, lazy, slots=self._slots[1]) if lazy else contextlib.nullcontext():
            if swapped:
                outputs = functional_call(self.model, tensors, args=args, kwargs=kwargs)
            else:
                outputs = self.model(*args, **kwargs)
        loss = loss_of(outputs, self.inputs, self.targets, self.loss_fn, self.normalise)
        return scalar_loss(loss, needs_grad=torch.is_grad_enabled() and any(
            p.requires_grad if isinstance(p, Tensor) else any(t.requires_grad for t in p.leaves)
            for p in points))

    def _holds(self, name: str, tensor: Tensor) -> bool:
        """Whether ``tensor`` is the very parameter or buffer the model holds under ``name``."""
        prefix, _, leaf = name.rpartition(".")
        try:
            module = self.model.get_submodule(prefix) if prefix else self.model
        except AttributeError:
            return False
        return module._parameters.get(leaf) is tensor or module._buffers.get(leaf) is tensor


def loss_of(outputs: Any, inputs: Any, targets: Any, loss_fn: Optional[Callable], normalise: bool) -> Any:
    """The loss of a batch from the model's ``outputs``: the model's own ``outputs.loss`` when
    ``loss_fn`` is None, else ``loss_fn(outputs, targets)`` (on Andriushchenko et al.'s normalised
    logits when ``normalise``); refused in half precision (the differences a sharpness measures
    would round away)."""
    if loss_fn is None:
        loss = check.own_loss(outputs, inputs)
    else:
        if normalise:
            outputs = normalize_logits(logits_of(outputs))
        loss = loss_fn(outputs, targets)
    if isinstance(loss, Tensor) and loss.dtype in HALF_DTYPES:
        # the half resolution of the loss (~1e-3 relative) is the size of typical sharpness
        raise InvalidArgumentType(
            f"the loss is computed in {loss.dtype}: sharpness differences of the order of its "
            f"resolution ({torch.finfo(loss.dtype).eps:.1e} relative) would be rounded away. "
            f"The model or loss_fn casts to half precision although its weights are given in "
            f"float32 (torch.autocast?): run without autocast and compute the loss in float32")
    return loss


def split_batch(tokens: TokenInputs, batch: Any, index: int, loss_fn: Optional[Callable],
                normalise: bool) -> Tuple[Any, Any, bool]:
    """(inputs, targets, use the model's own loss) of one batch; see :func:`sharpness`.  Inputs the
    model cannot take are refused here, naming the batch (``tokens``: the model's
    :class:`~quotient_manifolds.adapters.validation.TokenInputs`)."""
    inputs, targets, own_loss = _batch_parts(batch, index, loss_fn, normalise)
    tokens.check(inputs, index)
    return inputs, targets, own_loss


def _batch_parts(batch: Any, index: int, loss_fn: Optional[Callable], normalise: bool
                 ) -> Tuple[Any, Any, bool]:
    """The parts of a batch, by its form: a dict of keyword arguments or an (inputs, targets) pair."""
    if isinstance(batch, Mapping):
        if loss_fn is None:
            if normalise:
                raise InvalidArgument("normalize_logits=True needs a loss_fn for dict batches (the "
                                      "model's own loss does not see normalised logits): pass e.g. "
                                      "loss_fn=adapters.next_token_loss")
            return batch, None, True
        if "labels" not in batch:
            raise InvalidArgument(f"dict batch {index} has no 'labels' (keys {sorted(batch)}): with "
                                  f"loss_fn the loss is loss_fn(outputs, batch['labels']); add the "
                                  f"labels, or yield (inputs, targets) pairs")
        return batch, batch["labels"], False
    if not isinstance(batch, Sequence) or isinstance(batch, str) or len(batch) != 2:
        what = f" of length {len(batch)}" if isinstance(batch, Sequence) else ""
        raise InvalidArgument(f"batch {index} is a {type(batch).__name__}{what}; expected an (inputs, "
                              f"targets) pair or a dict of model keyword arguments (a Hugging Face "
                              f"batch)")
    inputs, targets = batch
    return inputs, targets, False


def raise_explained(err: RuntimeError, model: nn.Module, index: Optional[int]) -> NoReturn:
    """Raises ``err``, raised by forward passes of ``model`` on batch ``index`` (or on a batch when
    ``None``), as the error :func:`input_mismatch` makes of it when the batch's input does not fit
    the model's first layer (integer or float16 inputs to a float32 layer, a wrong feature
    dimension: torch's ``mat1 and mat2 ...``): an :class:`~quotient_manifolds.errors.InvalidArgumentType`
    / :class:`~quotient_manifolds.errors.InvalidArgument` naming the batch, the input's dtype and
    shape and what the layer expects, chained to ``err``; any other error unchanged. Called in the
    ``except`` of the passes only (the model is not followed into this module on a normal run)."""
    explained = input_mismatch(err, model, index)
    if explained is None:
        raise err
    raise explained from err


def input_mismatch(err: BaseException, model: nn.Module, index: Optional[int]) -> Optional[Exception]:
    """The error to raise for ``err`` when it was raised inside the first layer of ``model`` (the
    first module with parameters of its own, when it is the innermost module in the traceback)
    because its input tensor does not fit it: a dtype other than its weight's (or not integer
    indices, for an embedding), or a last dimension (channel dimension, for a convolution) other
    than its input size. ``None`` when ``err`` is not that."""
    names = {id(m): name for name, m in model.named_modules()}
    layer, received, tb = None, None, err.__traceback__
    while tb is not None:          # the innermost frame of a module of the model, and its input
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names and isinstance(owner, nn.Module):
            inputs = [v for k, v in tb.tb_frame.f_locals.items() if k != "self" and isinstance(v, Tensor)]
            if inputs:
                layer, received = owner, inputs[0]
        tb = tb.tb_next
    first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
    weight = getattr(layer, "weight", None)
    if layer is None or layer is not first or received is None or not isinstance(weight, Tensor):
        return None   # a layer inside the model: its input is the model's own, not the batch's
    where = f"batch {index}" if index is not None else "a batch"
    about = f"{where}: the model's first layer {names[id(layer)] or 'model'!r} ({layer}) cannot take its input"
    if isinstance(layer, nn.Embedding):
        if received.is_floating_point() or received.is_complex():
            return InvalidArgumentType(f"{about}: it takes integer token ids, and its input is a {received.dtype} "
                             f"tensor of shape {tuple(received.shape)}. Pass the ids as integers "
                             f"(e.g. inputs.long())")
        return None
    # a half-precision model runs in float32 (module docstring): its layers get float32 inputs
    upcast = weight.dtype in HALF_DTYPES and received.dtype == torch.float32
    if received.dtype != weight.dtype and not upcast:
        integer = not (received.is_floating_point() or received.is_complex())
        cast = "inputs.float()" if integer and weight.dtype == torch.float32 else f"inputs.to({weight.dtype})"
        other = "" if integer else ", or the model the inputs' (model.to(...))"
        return InvalidArgumentType(f"{about}: its weights are {weight.dtype} and its input is {'an integer' if integer else 'a'} "
                         f"{received.dtype} tensor of shape {tuple(received.shape)}. Give the batch's "
                         f"inputs the model's dtype ({cast}){other}")
    if isinstance(layer, nn.modules.conv._ConvNd):
        size_dim, expected, axis = -(len(layer.kernel_size) + 1), layer.in_channels, "channel"
    elif isinstance(layer, nn.Linear):
        size_dim, expected, axis = -1, layer.in_features, "last"
    else:
        return None
    if received.ndim >= -size_dim and received.shape[size_dim] != expected:
        return InvalidArgument(f"{about}: it takes inputs whose {axis} dimension is {expected}, and its input "
                          f"is a {received.dtype} tensor of shape {tuple(received.shape)}. Check the "
                          f"batch's inputs (their feature size, and the order (inputs, targets) of "
                          f"each batch)")
    return None


def class_targets_check(targets: Any, index: int = 0) -> Optional[Callable[[Any], None]]:
    """A check of the model's output on the batch of ``targets`` (its first forward pass, at its
    own weights) that refuses integer ``targets`` the default cross-entropy cannot take: class
    indices must lie in 0 … C−1 for a model with C outputs (``-100``, cross-entropy's ignored
    index, aside). So labels of ±1 are refused at the first forward pass of the set-up, with what
    to do, not after the many of a run. None when ``targets`` are not class indices (nothing to
    check)."""
    if (not isinstance(targets, Tensor) or targets.is_floating_point() or targets.is_complex()
            or targets.dtype == torch.bool):
        return None
    valid = targets[targets != -100]
    if valid.numel() == 0:
        return None
    low, high = int(valid.min()), int(valid.max())

    def check_outputs(outputs: Any) -> None:
        logits = logits_of(outputs)
        classes = logits.shape[1] if logits.ndim >= 2 else logits.shape[0]   # cross_entropy's class dim
        if 0 <= low and high < classes:
            return
        hint = (" Labels of -1/+1? Map them to 0/1 with (y + 1) // 2." if (low, high) in ((-1, 1), (-1, 0))
                else "")
        raise InvalidArgument(f"batch {index}: the default loss is cross-entropy, whose targets are class indices "
                              f"0..{classes - 1} of the model's {classes} outputs, but these range over "
                              f"{low}..{high}.{hint} For another loss pass loss_fn=callable(outputs, targets).")

    return check_outputs


def all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, checked in pieces of at most
    :data:`~quotient_manifolds.adapters.elementwise.KERNEL_LIMIT` elements (no temporary of the
    tensor's size: a model of billions of weights is checked in place); one host sync. A DTensor
    is checked shard by shard, the answer agreed by its ranks (a collective: every rank calls it)."""
    local = getattr(t, "to_local", None)
    if local is not None:   # a DTensor: its shards checked where they are, the vote of the ranks
        import torch.distributed as dist

        shard = local()
        finite = torch.tensor(float(all_finite(shard)), device=shard.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=t.device_mesh.get_group())
        return bool(finite.item() == 1)
    flat = t.reshape(-1)
    checks = [torch.isfinite(flat[a:a + KERNEL_LIMIT]).all() for a in range(0, flat.numel(), KERNEL_LIMIT)]
    return bool(torch.stack(checks).all()) if checks else True


def as_compute(t: Tensor, upcast: bool) -> Tensor:
    """``t`` in the compute dtype: float32 for half-precision tensors when ``upcast``."""
    return t.float() if upcast and t.dtype in HALF_DTYPES else t


def to_device(obj: Any, device: torch.device, upcast: bool = False) -> Any:
    """``obj`` (a tensor, or tuples, lists and dicts of them) with every tensor moved to ``device``,
    in the compute dtype when ``upcast`` (:func:`as_compute`)."""
    return map_tensors(lambda t: as_compute(t.to(device), upcast), obj)


# ------------------------------------------------------------------------------------ module inputs
def detach_inputs(x):
    """``x`` with every tensor detached, through nested tuples, lists and mappings (captured module
    or model inputs must not keep the caller's autograd graph alive)."""
    if isinstance(x, Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(detach_inputs(v) for v in x)
    if isinstance(x, Mapping):
        return {k: detach_inputs(v) for k, v in x.items()}
    return x


def _stateless(kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """The keyword inputs without key/value caches: a cache object is updated by every call (the
    derivation calls the module hundreds of times), so it is dropped and ``use_cache`` set off."""
    out = {}
    for k, v in kwargs.items():
        if "cache" in type(v).__name__.lower() or k in ("past_key_value", "past_key_values", "layer_past"):
            v = None
        out[k] = False if k == "use_cache" else v
    return out


def capture_module_inputs(model: nn.Module, module_paths: Sequence[str], example_inputs: Any
                          ) -> Dict[str, Tuple[tuple, dict]]:
    """``{path: (args, kwargs)}``: the inputs of each module in ``module_paths`` at its first call
    during one forward pass of ``model`` on ``example_inputs`` (a tensor, a tuple of positional
    arguments or a dict of keyword arguments), detached.  The pass runs in eval mode with gradients
    enabled (fused inference fast paths such as ``nn.TransformerEncoderLayer``'s would bypass the
    attention module's ``forward``); the model's weights are untouched and its flags restored."""
    captured: Dict[str, Tuple[tuple, dict]] = {}
    handles = []
    for path in dict.fromkeys(module_paths):
        mod = model.get_submodule(path)

        def hook(module, args, kwargs, path=path):
            captured.setdefault(path, (detach_inputs(tuple(args)), _stateless(detach_inputs(kwargs))))

        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        args, kwargs = split_inputs(example_inputs, device_of(itertools.chain(model.parameters(), model.buffers())))
        with eval_mode(model), torch.enable_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return captured


def weighted_batches(tokens: check.TokenInputs, batches: Iterable[Any], loss_fn: Optional[Callable],
                     reduction: str, batch_size_fn: Optional[Callable[[Any], int]], device: torch.device,
                     upcast: bool) -> Tuple[List[tuple], int]:
    """``[(inputs, targets, loss_fn, weight)]`` of every batch on ``device`` (weight |b|/N for
    ``"mean"``, 1 for ``"sum"``) and the number N of data points; an empty ``batches`` is refused."""
    if iter(batches) is batches:           # an iterator: keep its batches for repeated passes
        batches = list(batches)
    data, sizes = [], []
    for index, batch in enumerate(batches):
        inputs, targets, own_loss = split_batch(tokens, batch, index, loss_fn, False)
        data.append((to_device(inputs, device, upcast), to_device(targets, device, upcast),
                     None if own_loss else (loss_fn or default_loss)))
        sizes.append(batch_size_of(inputs, targets, index, batch_size_fn))
    if not data:
        raise InvalidArgument("`batches` is empty: pass at least one (inputs, targets) pair or dict batch")
    num_data = sum(sizes)
    weights = [n / num_data if reduction == "mean" else 1.0 for n in sizes]
    return [(*d, w) for d, w in zip(data, weights)], num_data


def batch_size_of(inputs: Any, targets: Any, index: int,
                  batch_size_fn: Optional[Callable[[Any], int]] = None) -> int:
    """``batch_size_fn(inputs)``, else the leading dimension of the input tensor, of the first
    tensor of a dict input, or of the targets; refused unless an integer >= 1 (the weight |b|/N of
    batch ``index`` divides by the total)."""
    if batch_size_fn is not None:
        size = batch_size_fn(inputs)
        if isinstance(size, Tensor) and size.numel() == 1 and not size.is_floating_point():
            size = size.item()
        return integer_at_least(f"batch_size_fn(inputs) of batch {index}", size, 1)
    candidates = [inputs] if isinstance(inputs, Tensor) else []
    if isinstance(inputs, Mapping):
        candidates += [v for v in inputs.values() if isinstance(v, Tensor) and v.ndim]
    if isinstance(targets, Tensor) and targets.ndim:
        candidates.append(targets)
    if not candidates:
        raise InvalidArgument("cannot infer the batch size of a batch without tensors (needed for "
                              "reduction='mean'); pass batch_size_fn=callable(inputs) -> int, or "
                              "reduction='sum'")
    size = int(candidates[0].shape[0])
    if size < 1:
        raise InvalidArgument(f"batch {index} is empty (leading dimension 0 of a tensor of shape "
                              f"{tuple(candidates[0].shape)}): drop empty batches, or pass "
                              f"batch_size_fn=callable(inputs) -> int if the batch dimension is not the first")
    return size
