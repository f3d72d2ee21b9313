r"""The gate on a model sharded with FSDP2: a layout's blocks verified, and a failing block's group
derived, without ever holding the whole model in one process.

A GL block lives inside one attention module: its weights are that module's, and the model's
output depends on them only through that module's output. So checking a block needs only the
module, its weights and the inputs it receives in the model's forward pass:

1. one sharded forward pass of the model on the first batch records the inputs of every module
   that holds a block (every rank its own batch, FSDP2 gathering and freeing the layers as in
   training);
2. each such module is given to one rank (balanced by size); for each module in turn its weights
   are gathered (``DTensor.full_tensor``: one module at a time, about one layer's attention) and
   its owner runs, on a plain copy of the module alone with the inputs it recorded, the same
   checks as for a model in one process (:func:`~quotient_manifolds.adapters.accept.accept_layout`:
   random ill-conditioned actions at five scales, the failing blocks' groups derived and checked
   again, what still fails treated elementwise);
3. the outcomes are shared by every rank (one ``all_gather_object``), merged in the layout's block
   order, and settled by the gate as in one process (:meth:`~quotient_manifolds.adapters.gate.Gate.settle`:
   a layout passed in of which no block verifies is refused, derived groups are named in a
   warning); every warning and error is raised alike on every rank.

Why this is as strong as the whole-model check: if the module's output is unchanged under an
action on its weights, for the inputs it receives in the forward pass, everything after it
computes the same numbers, so the model's output is unchanged too; and conversely a change of the
model's output under the action can only come through this module's output. The check is the same
statement about the same forward pass, made where the action happens; its tolerance is relative to
the module's output instead of the model's (the rounding of the check, not its power, differs).
It needs the block's weights to be used by this module alone: a weight tied to another module is
refused, naming it.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor, nn

from .accept import accept_layout
from .derive import capture_module_inputs, with_blocks
from .gate import Gate
from .layouts import Layout
from .verify import record_verification, verified_before_sharding

__all__ = ["accept_on_shards", "ModuleAlone"]


class ModuleAlone(nn.Module):
    """One submodule of a model, alone: at the same path as in the model (so its parameters have
    the model's names), called with the inputs it received in the model's forward pass
    (``forward(args, kwargs)`` calls it as ``module(*args, **kwargs)``). What
    :func:`accept_on_shards` verifies a sharded model's blocks on."""

    def __init__(self, path: str, module: nn.Module):
        super().__init__()
        if not path:
            raise ValueError("ModuleAlone needs the path of a submodule, not the model itself")
        parent: nn.Module = self
        *containers, leaf = path.split(".")
        for part in containers:
            child = nn.Module()
            parent.add_module(part, child)
            parent = child
        parent.add_module(leaf, module)
        self.path = path

    def forward(self, args: tuple, kwargs: dict) -> Any:
        return self.get_submodule(self.path)(*args, **kwargs)


def _plain_copy(module: nn.Module, path: str, full: Dict[str, Tensor]) -> nn.Module:
    """A copy of ``module`` (the model's submodule at ``path``) whose parameters are the plain
    tensors ``full`` (the gathered weights, by the model's parameter names) instead of the model's
    shards; buffers are copied. The model is not touched."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    nested = [f"{path}.{n}" if n else path for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    if nested:
        raise NotImplementedError(
            f"the attention module {path!r} (or its submodule {nested[0]!r}) is itself an FSDP2 unit: "
            f"its blocks are checked on a copy of the module alone, which an FSDP2 unit's hooks do not "
            f"allow. Apply fully_shard to the layers that hold the attention modules (and to the "
            f"root), not to the attention modules themselves")
    memo = {id(p): nn.Parameter(full[f"{path}.{n}"], requires_grad=p.requires_grad)
            for n, p in module.named_parameters()}
    return copy.deepcopy(module, memo)


def _sub_layout(layout: Layout, path: str, names: List[str]) -> Layout:
    """``layout`` restricted to the module at ``path``: its blocks, and the parameters ``names``
    (the module's), so that it belongs to a :class:`ModuleAlone` of that module."""
    own = set(names)
    blocks = [b for b in layout.blocks if b.module == path]
    outside = sorted({p for b in blocks for p in b.params} - own)
    if outside:
        raise NotImplementedError(
            f"block(s) of {path!r} read the weights {outside[:3]} of another module: a block of a sharded "
            f"model is checked on its module alone. Measure this model unsharded, or with "
            f"geometry='adaptive'")
    structure = layout.head_structure or {}
    return replace(layout, blocks=blocks, adaptive=[n for n in layout.adaptive if n in own],
                   gl_masks={n: m for n, m in layout.gl_masks.items() if n in own},
                   frozen=[n for n in layout.frozen if n in own], unsupported=[],
                   param_shapes={n: s for n, s in layout.param_shapes.items() if n in own},
                   notes=[], verify_failed=[],
                   head_structure={path: structure[path]} if path in structure else None)


def _module_owners(paths: List[str], sizes: Dict[str, int], world: int) -> Dict[str, int]:
    """Which rank checks each module: largest first, each to the least loaded rank (the lowest on
    ties); the same on every rank."""
    from .sharded import assign_owners

    modules = [SimpleNamespace(params=(path,)) for path in paths]
    return assign_owners(modules, sizes, world)


def _tied(model: nn.Module, path: str) -> List[str]:
    """The parameters of the module at ``path`` that the model also holds under a name outside it."""
    inside = {id(p) for p in model.get_submodule(path).parameters()}
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False)
                  if id(p) in inside and not n.startswith(path + "."))


def _tied_message(path: str, tied: List[str]) -> str:
    return (f"the weights of {path!r} are also held as {tied[:3]}: a block of a sharded model is "
            f"checked on its module alone, which needs its weights to be that module's only. "
            f"Measure this model unsharded, or with geometry='adaptive'")


def _check_module(module: nn.Module, path: str, full: Dict[str, Tensor], inputs: Tuple[tuple, dict],
                  layout: Layout, what: str) -> Dict[str, Any]:
    """The outcome of the checks of the blocks of ``module`` (the model's submodule at ``path``; on
    its owner): the accepted blocks, the blocks newly left out (``unsupported``), the failing
    candidates, the warnings raised (to raise again on every rank), or the error."""
    outcome: Dict[str, Any] = dict(blocks=[], unsupported=[], failed=[], warnings=[], error=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            alone = ModuleAlone(path, _plain_copy(module, path, full))
            sub = _sub_layout(layout, path, list(full))
            args, kwargs = inputs
            accepted, _ = accept_layout(alone, sub, {"args": args, "kwargs": kwargs}, what=what)
            outcome.update(blocks=list(accepted.blocks), failed=list(sub.verify_failed),
                           unsupported=[u for u in accepted.unsupported if u not in sub.unsupported])
        except Exception as err:  # raised again on every rank (a rank raising alone would hang the others)
            outcome["error"] = (type(err), str(err))
    outcome["warnings"] = [(str(w.message), w.category) for w in caught]
    return outcome


def accept_on_shards(gate: Gate, example_inputs: Any, on_reference: Optional[Callable[[Any], None]],
                     stacklevel: int) -> Layout:
    """The layout of ``gate`` accepted on the first inputs of a model sharded with FSDP2 (module
    docstring): its blocks verified module by module, a failing block's group derived, the outcome
    the same on every rank. A collective: every rank of the model's process group calls it, each
    with its own first inputs. ``on_reference`` checks the model's output at its own weights (the
    batch's targets) on every rank; ``stacklevel``: of the warnings, as in :meth:`Gate.accept`."""
    import torch.distributed as dist

    from .sharded import group_of, reshard

    model, layout = gate.model, gate.layout
    if gate.pending and verified_before_sharding(model, layout):
        record_verification(model, layout, True)   # the whole model's check stands for the shards
    if not gate.pending:   # verified on this model before, or run unchecked with unsafe=True
        return gate.accept(example_inputs, on_reference=on_reference, stacklevel=stacklevel + 1)
    params = dict(model.named_parameters())
    group = group_of(params, gate.what)
    paths = list(dict.fromkeys(b.module for b in layout.blocks))
    modules = {path: model.get_submodule(path) for path in paths}
    names = {path: [n for n in params if n.startswith(path + ".")] for path in paths}
    tied = {path: _tied(model, path) for path in paths}
    reference: Dict[str, Any] = {}

    def keep_output(module: nn.Module, args: Any, out: Any) -> None:
        reference.setdefault("out", out)

    handle = model.register_forward_hook(keep_output)
    try:
        captured = capture_module_inputs(model, paths, example_inputs)
    finally:
        handle.remove()
        reshard(model)   # a forward pass without backward leaves the root's weights gathered
    problem = None
    if on_reference is not None:
        try:
            on_reference(reference["out"])
        except ValueError as err:
            problem = (type(err), str(err))
    reference.clear()
    owners = _module_owners(paths, {path: sum(params[n].numel() for n in names[path]) for path in paths},
                            dist.get_world_size(group))
    me = dist.get_rank(group)
    outcomes: Dict[str, Dict[str, Any]] = {}
    for path in paths:   # one module's weights gathered at a time, kept by its owner only
        full = {}
        for n in names[path]:
            p = params[n].detach()
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            if owners[path] == me:
                full[n] = whole
            del whole
        if owners[path] == me and problem is None:
            outcomes[path] = (_check_module(modules[path], path, full, captured[path], layout, gate.what)
                              if not tied[path] else dict(error=(NotImplementedError, _tied_message(path, tied[path]))))
        del full
    shared: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shared, (problem, outcomes), group=group)
    problems = [p for p, _ in shared if p is not None]
    if problems:
        raise _rebuilt(problems[0])
    merged = {path: outcome for _, part in shared for path, outcome in part.items()}
    for path in paths:
        error = merged[path]["error"]
        if error is not None:
            raise _rebuilt(error)
    for path in paths:
        for message, category in merged[path]["warnings"]:
            warnings.warn(message, category, stacklevel=stacklevel + 1)
    return _settled(gate, layout, paths, merged, stacklevel + 1)


def _rebuilt(error: Tuple[type, str]) -> Exception:
    """The exception ``(class, message)`` one rank met, to raise on every rank (an exception object
    itself may not survive pickling: its class may take other arguments than the message)."""
    kind, message = error
    try:
        return kind(message)
    except TypeError:  # a class that takes other arguments: the message under a plain RuntimeError
        return RuntimeError(f"{kind.__name__}: {message}")


def _settled(gate: Gate, layout: Layout, paths: List[str], merged: Dict[str, Dict[str, Any]],
             stacklevel: int) -> Layout:
    """The modules' outcomes as one layout of the whole model (blocks in the layout's order),
    recorded as verified on the sharded model and settled by the gate."""
    accepted_blocks = {b.name: b for path in paths for b in merged[path]["blocks"]}
    failed = [name for path in paths for name in merged[path]["failed"]]
    unsupported = list(layout.unsupported) + [u for path in paths for u in merged[path]["unsupported"]]
    if not failed:
        record_verification(gate.model, layout, True)
        layout.verify_failed = []
        return gate.settle(layout, None, stacklevel=stacklevel + 1)
    layout.verify_failed = failed
    blocks = [accepted_blocks[b.name] for b in layout.blocks if b.name in accepted_blocks]
    accepted = with_blocks(layout, blocks, unsupported, list(layout.notes))
    record_verification(gate.model, accepted, True)
    return gate.settle(accepted, None, stacklevel=stacklevel + 1)
