"""Calling a model: inputs onto its device (:func:`split_inputs`), tensors inside nested containers
(:func:`map_tensors`) and eval mode that restores every submodule's flag (:func:`eval_mode`)."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator, Mapping, Tuple

from torch import Tensor, nn

__all__ = ["map_tensors", "eval_mode", "split_inputs"]


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


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``with eval_mode(model):`` runs the block with ``model`` in eval mode, then restores every
    submodule's own ``training`` flag (a plain ``model.train(flag)`` afterwards would overwrite
    submodules deliberately kept in eval mode), also when the block raises."""
    flags = {name: mod.training for name, mod in model.named_modules(remove_duplicate=False)}
    try:
        model.eval()
        yield model
    finally:
        for name, mod in model.named_modules(remove_duplicate=False):
            if name in flags:
                mod.training = flags[name]


def split_inputs(example_inputs, model: nn.Module) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of ``model``, with every tensor on the model's device: inputs
    prepared on the CPU work on a model moved to a GPU."""
    device = next((t.device for t in itertools.chain(model.parameters(), model.buffers())
                   if not t.is_meta), None)

    def moved(x):
        return x if device is None else map_tensors(lambda t: t.to(device), x)

    if isinstance(example_inputs, Mapping):
        return (), moved(dict(example_inputs))
    if isinstance(example_inputs, (tuple, list)):
        return moved(tuple(example_inputs)), {}
    return (moved(example_inputs),), {}

