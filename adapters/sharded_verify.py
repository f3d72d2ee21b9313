r"""Checks of a sharded model's layout, module by module: the layout of a model sharded with FSDP2
checked without ever holding the whole model in one process (what
:meth:`Layout.verify <quotient_manifolds.adapters.Layout.verify>` and the gate of a geodesic run do
on such a model).

A GL block lives inside one attention module: its weights are that module's, and the model's
output depends on them only through that module's output. So checking a block needs only the
module, its weights and the inputs it receives in the model's forward pass
(:func:`checked_on_owners`):

1. one sharded forward pass of the model on the given inputs records the inputs of every module
   that holds a block (every rank its own inputs, FSDP2 gathering and freeing the layers as in
   training);
2. each such module is given to one rank (balanced by size); for each module in turn its weights
   are gathered (``DTensor.full_tensor``: one module at a time, about one layer's attention) and
   its owner runs the check, on a plain copy of the module alone (:class:`ModuleAlone`) with the
   inputs it recorded and the layout restricted to it (:func:`sub_layout`);
3. the outcomes are shared by every rank (one ``all_gather_object``); an error met on one rank is
   raised on every rank, and the warnings of the checks are raised on every rank alike.

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

from quotient_manifolds.errors import InvalidArgument, NotSupported, SymmetryError

from .evaluation import capture_module_inputs
from .sharded import assign_owners, group_of, reshard
from .verify import VerifyReport, verify_layout

__all__ = ["ModuleAlone", "sub_layout", "checked_on_owners", "verify_on_shards"]


class ModuleAlone(nn.Module):
    """One submodule of a model, alone: at the same path as in the model (so its parameters have
    the model's names), called with the inputs it received in the model's forward pass
    (``forward(args, kwargs)`` calls it as ``module(*args, **kwargs)``). What
    :func:`checked_on_owners` checks a sharded model's blocks on."""

    def __init__(self, path: str, module: nn.Module):
        super().__init__()
        if not path:
            raise InvalidArgument("ModuleAlone needs the path of a submodule, not the model itself")
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
        raise NotSupported(
            f"the attention module {path!r} (or its submodule {nested[0]!r}) is itself an FSDP2 unit: "
            f"its blocks are checked on a copy of the module alone, which an FSDP2 unit's hooks do not "
            f"allow. Apply fully_shard to the layers that hold the attention modules (and to the "
            f"root), not to the attention modules themselves")
    memo = {id(p): nn.Parameter(full[f"{path}.{n}"], requires_grad=p.requires_grad)
            for n, p in module.named_parameters()}
    return copy.deepcopy(module, memo)


def sub_layout(layout: Any, path: str, names: List[str]) -> Any:
    """``layout`` restricted to the module at ``path``: its blocks, and the parameters ``names``
    (the module's), so that it belongs to a :class:`ModuleAlone` of that module."""
    own = set(names)
    blocks = [b for b in layout.blocks if b.module == path]
    outside = sorted({p for b in blocks for p in b.params} - own)
    if outside:
        raise NotSupported(
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


def _rebuilt(error: Tuple[type, str]) -> Exception:
    """The exception ``(class, message)`` one rank met, to raise on every rank (an exception object
    itself may not survive pickling: its class may take other arguments than the message)."""
    kind, message = error
    try:
        return kind(message)
    except TypeError:  # a class that takes other arguments: the message under a plain RuntimeError
        return RuntimeError(f"{kind.__name__}: {message}")


def checked_on_owners(model: nn.Module, layout: Any, example_inputs: Any,
                      check: Callable[[nn.Module, Any, Dict[str, Any]], Any], *, what: str,
                      on_reference: Optional[Callable[[Any], None]] = None, stacklevel: int = 2
                      ) -> Dict[str, Any]:
    """``{module path: check(alone, sub, inputs)}`` for every module of ``layout``'s blocks, on every
    rank (module docstring): ``alone`` is the module alone (:class:`ModuleAlone`, its weights
    gathered), ``sub`` the layout restricted to it, ``inputs`` the keyword inputs of ``alone`` (what
    the module received in a sharded forward pass of ``model`` on ``example_inputs``). ``check``
    runs on the module's owner only; its warnings are raised again on every rank (``stacklevel``
    as in ``warnings.warn`` from the caller) and an exception it raises is raised on every rank.
    ``on_reference`` is called with the model's output of that forward pass on every rank (e.g. to
    refuse the batch's targets). A collective: every rank of the model's process group calls it."""
    import torch.distributed as dist

    params = dict(model.named_parameters())
    group = group_of(params, what)
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
            outcomes[path] = _run_check(check, modules[path], path, full, captured[path], layout, tied[path])
        del full
    shared: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shared, (problem, outcomes), group=group)
    problems = [p for p, _ in shared if p is not None]
    if problems:
        raise _rebuilt(problems[0])
    merged = {path: outcome for _, part in shared for path, outcome in part.items()}
    for path in paths:
        if merged[path]["error"] is not None:
            raise _rebuilt(merged[path]["error"])
    for path in paths:
        for message, category in merged[path]["warnings"]:
            warnings.warn(message, category, stacklevel=stacklevel + 1)
    return {path: merged[path]["value"] for path in paths}


def _run_check(check: Callable, module: nn.Module, path: str, full: Dict[str, Tensor],
               inputs: Tuple[tuple, dict], layout: Any, tied: List[str]) -> Dict[str, Any]:
    """``check`` on the module alone (on its owner): its value, the warnings it raised, or the
    error it met (raised again on every rank: a rank raising alone would hang the others)."""
    outcome: Dict[str, Any] = dict(value=None, warnings=[], error=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if tied:
                raise NotSupported(_tied_message(path, tied))
            alone = ModuleAlone(path, _plain_copy(module, path, full))
            args, kwargs = inputs
            outcome["value"] = check(alone, sub_layout(layout, path, list(full)), {"args": args, "kwargs": kwargs})
        except Exception as err:  # recorded, and raised on every rank by checked_on_owners
            outcome["error"] = (type(err), str(err))
    outcome["warnings"] = [(str(w.message), w.category) for w in caught]
    return outcome


def verify_on_shards(layout: Any, model: nn.Module, example_inputs: Any, *, raise_on_failure: bool = True,
                     **options: Any) -> VerifyReport:
    """:meth:`Layout.verify <quotient_manifolds.adapters.Layout.verify>` on a model sharded with FSDP2:
    each module's blocks checked alone (module docstring) with the same ``options`` (``scales``,
    ``cond``, ``rtol``, ``atol``, ``seed``, ``per_block``, ``output_fn``, ``compute_dtype``), the
    modules' reports merged into one: per scale the largest deviation of the joint actions, every
    block's check, the largest tolerance and output scale. Deviations are relative to each module's
    output. A collective: every rank calls it, each with its own inputs."""
    reports = checked_on_owners(
        model, layout, example_inputs, what="verify()",
        check=lambda alone, sub, inputs: verify_layout(sub, alone, inputs, raise_on_failure=False, **options))
    parts = [reports[path] for path in reports]
    if not parts:   # no block: nothing acts
        return verify_layout(layout, model, example_inputs, raise_on_failure=raise_on_failure, **options)
    first = parts[0]
    report = VerifyReport(
        joint={s: max(r.joint[s] for r in parts) for s in first.joint},
        joint_passed=all(r.joint_passed for r in parts),
        blocks=[b for r in parts for b in r.blocks], rtol=max(r.rtol for r in parts),
        atol=first.atol, dtype=first.dtype, cond=first.cond, scales=first.scales,
        output_scale=max(r.output_scale for r in parts),
        per_block_checked=all(r.per_block_checked for r in parts))
    if raise_on_failure and not report.passed:
        failing = "; ".join(f"{b.name} (max rel dev {b.max_rel_dev:.2e})" for b in report.blocks if not b.passed)
        raise SymmetryError(f"GL symmetry broken by block(s): {failing or 'all blocks together'} "
                            f"(checked module by module on the shards).\n{report}", report)
    return report
