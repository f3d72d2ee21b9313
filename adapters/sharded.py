r"""Sharpness of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

:func:`~quotient_manifolds.adapters.sharpness` takes this path by itself when the model's
parameters are DTensors sharded on their first dimension (``Shard(0)``, FSDP2's layout) over one
one-dimensional device mesh (:func:`group_of` refuses others). Every rank calls it with its own batches (the same ones, or each its share of a
global batch: data parallelism combined with sharding); the loss of an evaluation is the mean over
the ranks of their mean losses, so equal batch sizes give the loss of the union of the batches,
and every rank returns the same :class:`~quotient_manifolds.adapters.SharpnessResult`.

What each rank holds: the perturbation ξ and every buffer of the solver over the *local shard* of
each elementwise (adaptive) weight, a copy of that shard (the trained weights, to move from and to
restore), and the GL(h) attention blocks it owns. The solver's norms and inner products are
summed over the ranks (``all_reduce``). A GL block's heads take their rows from several
parameters, which FSDP2 cuts at other places than head boundaries (a head may straddle two ranks,
and its G and H live on different ones), so no rank holds the rows of a head's Gram matrices,
even in part. Each group of blocks sharing a weight is held by one rank instead
(:func:`assign_owners`: largest groups first, each to the least loaded rank): the owner holds the
blocks' trained heads, their geometry (Gram matrices, projections, retraction) and their part of
every solver vector (:class:`ShardedQuotients`). Memory per rank is thus about 1/world of the
solver's state of the whole model; the values equal those of the unsharded model.

An evaluation writes the perturbed weights into the local shards (in place, under ``no_grad``;
each attention weight is sent whole from its owner, one weight at a time, and every rank copies
its rows), runs the model as it is (FSDP2 gathers and scatters as in training; a model that
computes in half precision, by its shards' dtype or its mixed-precision policy, is evaluated in
float32 for the run: :func:`computed_in_float32`), and reads the gradient
from the sharded ``.grad`` (averaged over the ranks by FSDP2's reduce-scatter; an attention
weight's gradient is gathered whole, one weight at a time, and kept by its owner). The trained weights
and the parameters' ``.grad`` are restored when the run ends, also after an exception. The layout
of a geodesic geometry is detected on the sharded model and verified on its shards, module by
module (:mod:`~quotient_manifolds.adapters.sharded_gate`); the run itself is the one loop of
:func:`~quotient_manifolds.adapters.worst_case.run_sharpness`, with this module's components and
closure behind :class:`~quotient_manifolds.adapters.placement.ShardedPlacement`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, NotSupported, UsageError

from .ball import _gather_heads, _written, head_writes
from .components import QuotientComponent
from .elementwise import ElementwiseComponent, StreamedPoint
from .evaluation import loss_of
from .losses import HALF_DTYPES
from .validation import scalar_loss

__all__ = ["is_sharded", "assign_owners", "group_of", "reshard", "gradients_kept", "shards_restored",
           "computed_in_float32", "ShardedElementwise",
           "ShardedQuotients", "ShardedClosure"]


def _dtensor_type():
    """``DTensor``, or ``None`` where torch has no distributed support."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2, tensor parallelism)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def reshard(model: nn.Module) -> None:
    """Every FSDP2 module of ``model`` back to its sharded parameters: the root keeps its weights
    gathered after a forward without backward, and its next forward would reuse them instead of
    gathering the shards just written."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_rows(p) -> Tuple[Tensor, int, int]:
    """(local tensor, first row, last row + 1) of a DTensor sharded on dim 0 or replicated, the
    rows of the full tensor this rank holds (``torch.chunk`` semantics, as FSDP2 cuts)."""
    from torch.distributed.tensor import Replicate, Shard

    local = p.to_local()
    placements = tuple(p.placements)
    if all(isinstance(pl, Replicate) for pl in placements):
        return local, 0, p.shape[0] if p.dim() else 1
    if len(placements) != 1 or not (isinstance(placements[0], Shard) and placements[0].dim == 0):
        raise NotSupported(
            f"a parameter placed as {placements} on its device mesh: sharded sharpness supports "
            f"FSDP2's Shard(0) on a one-dimensional mesh (or replicated parameters); apply "
            f"fully_shard without tensor parallelism")
    mesh = p.device_mesh
    rank, world = mesh.get_local_rank(), mesh.size()
    rows = p.shape[0]
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    if start + local.shape[0] > rows:
        raise NotSupported(f"unexpected FSDP2 shard: rank {rank} holds {local.shape[0]} of {rows} rows "
                           f"from {start}")
    return local, start, start + local.shape[0]


def _summed(group: Any, *values: Tensor) -> Tuple[Tensor, ...]:
    """The 0-d ``values`` summed over the ranks of ``group`` (one ``all_reduce``), in float64."""
    import torch.distributed as dist

    stacked = torch.stack([v.to(torch.float64) for v in values])
    dist.all_reduce(stacked, group=group)
    return tuple(stacked.unbind())


class _OverRanks:
    """A component of the ball sharded over the ranks of its process group ``group``."""

    group: Any

    def _summed(self, *values: Tensor) -> Tuple[Tensor, ...]:
        return _summed(self.group, *values)

    def sum_over_ranks(self, value: Tensor) -> Tensor:
        """The 0-d ``value`` summed over the ranks of ``group`` (:meth:`ProductBall.on_every_rank`)."""
        return self._summed(value)[0]


class ShardedElementwise(_OverRanks, ElementwiseComponent):
    """The streaming elementwise component over this rank's shards of the weights: every norm and
    inner product it returns is summed over the ranks of ``group`` (one ``all_reduce`` per
    call), so the solver sees the component of the whole model."""

    row_reads = False  # its tensors are this rank's shards, not the tables a lookup indexes

    def __init__(self, tensors: Dict[str, Tensor], *, group: Any = None, **options):
        super().__init__(tensors, streaming=True, **options)
        self.group = group

    def inner(self, u: Tensor, v: Tensor) -> Tensor:
        return self._summed(super().inner(u, v))[0]

    def sq_norm_on(self, u: Tensor, masks) -> float:
        return float(self._summed(torch.tensor(super().sq_norm_on(u, masks), dtype=torch.float64))[0])

    def gradient(self, grads, r):
        h, sq, dot = super().gradient(grads, r)
        sq, dot = self._summed(sq, dot)
        return h, sq, dot

    def combine(self, out, r, d, h, a, c, b) -> Tensor:
        return self._summed(super().combine(out, r, d, h, a, c, b))[0]


def assign_owners(blocks: Sequence, sizes: Mapping[str, int], world: int) -> Dict[str, int]:
    """Which rank holds each weight of the GL ``blocks`` (weight name → rank in ``0..world-1``):
    blocks that share a weight go to one rank together (a weight is written by one rank), and the
    groups of blocks, largest first (``sizes``: elements per weight), each go to the rank holding
    the fewest elements so far (the lowest rank on ties). The same on every rank."""
    parent: Dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for block in blocks:
        names = list(block.params)
        root(names[0])   # a block of one weight is a group of its own
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    connected: Dict[str, List[str]] = {}
    for name in sorted(parent):
        connected.setdefault(root(name), []).append(name)
    load = [0] * world
    owner: Dict[str, int] = {}
    for names in sorted(connected.values(), key=lambda ns: (-sum(sizes[n] for n in ns), ns[0])):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += sum(sizes[n] for n in names)
        owner.update({n: rank for n in names})
    return owner


class ShardedQuotients(_OverRanks):
    """The GL(h) blocks of a sharded model, each held whole by one rank, as one component of the
    ball.

    A head's rows of W_Q, W_K or W_V are cut by FSDP2 at arbitrary rows, so no rank could form
    its h×h Gram matrices from partial sums. Instead each group of blocks sharing weights belongs
    to one rank (:func:`assign_owners`), which holds their heads, frames and solver buffers (this
    rank's ``components``, a list that may be empty); on every rank the component's vectors are
    one flat tensor of the owned components' coordinates (empty on a rank owning nothing). Every
    norm and inner product is the owned components' sum, summed over the ranks of ``group`` (one
    ``all_reduce`` of scalars per call), so all ranks take the same steps. A point is the list of
    the owned components' points; :class:`ShardedClosure` sends each weight from its owner to the
    ranks holding its rows."""

    quotient = True

    def __init__(self, components: List[QuotientComponent], groups: List[Tuple[list, List[int]]], *,
                 dtype: torch.dtype, device: torch.device, group: Any = None):
        self.components, self.groups = components, groups
        self.dtype, self.device, self.group = dtype, device, group
        self.shapes = [c.zeros().shape for c in components]
        self.sizes = [math.prod(shape) for shape in self.shapes]

    def _views(self, u: Tensor) -> List[Tensor]:
        return [part.view(shape) for part, shape in zip(torch.split(u, self.sizes), self.shapes)]

    def _each(self, method: str, *vectors: Tensor, **kwargs) -> Tensor:
        """A new flat vector whose owned parts are ``component.method(parts of vectors)``."""
        out = self.zeros()
        for comp, o, *parts in zip(self.components, self._views(out), *map(self._views, vectors)):
            o.copy_(getattr(comp, method)(*parts, **kwargs))
        return out

    def _local_sum(self, values) -> Tensor:
        return sum(values, torch.zeros((), dtype=torch.float64, device=self.device))

    def zeros(self) -> Tensor:
        return torch.zeros(sum(self.sizes), dtype=self.dtype, device=self.device)

    def inner(self, u: Tensor, v: Tensor) -> Tensor:
        local = self._local_sum(c.inner(a, b) for c, a, b in
                                zip(self.components, self._views(u), self._views(v)))
        return self._summed(local)[0]

    def project(self, u: Tensor) -> Tensor:
        return self._each("project", u)

    def rgrad(self, egrad: Tensor) -> Tensor:
        return self._each("rgrad", egrad)

    def random(self, generator: Optional[torch.Generator]) -> Tensor:
        out = self.zeros()
        for comp, o in zip(self.components, self._views(out)):
            o.copy_(comp.random(generator))
        return out

    def point(self, xi: Tensor, retraction: Optional[str] = None, exact_steps: Optional[int] = None,
              *, out: Optional[Tensor] = None) -> List[Tensor]:
        return [c.point(a, retraction, exact_steps) for c, a in zip(self.components, self._views(xi))]

    # solver protocol (BallComponent)
    def to_coords(self, xi: Tensor, out: Tensor) -> None:
        out.copy_(xi)

    def from_coords_(self, u: Tensor) -> Tensor:
        return u

    def leaf_point(self, u: Tensor, need_grad: bool, into: Optional[Tensor] = None
                   ) -> Tuple[List[Tensor], List[Tensor]]:
        leaves: List[Tensor] = []
        points: List[Tensor] = []
        for comp, part in zip(self.components, self._views(u)):
            (leaf,), point = comp.leaf_point(part, need_grad)
            leaves.append(leaf)
            points.append(point)
        return leaves, points

    def gradient(self, grads: List[Optional[Tensor]], u: Tensor) -> Tuple[List[Tensor], Tensor, Tensor]:
        parts = [c.gradient([g], a) for c, g, a in zip(self.components, grads, self._views(u))]
        sq, dot = self._summed(self._local_sum(p[1] for p in parts),
                               self._local_sum(p[2] for p in parts))
        return [p[0] for p in parts], sq, dot

    def step_buffer(self, compact: bool) -> Tensor:
        return self.zeros()  # exact, as every quotient component's (QuotientComponent.step_buffer)

    def solver_vector(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        return self.zeros()  # in the iterates' dtype, as QuotientComponent.solver_vector

    def combine(self, out: Tensor, u: Tensor, d: Optional[Tensor], g: List[Tensor], a: Tensor,
                c: Tensor, b: Tensor) -> Tensor:
        ds = self._views(d) if d is not None else [None] * len(self.components)
        local = self._local_sum(comp.combine(o, x, dd, gg, a, c, b) for comp, o, x, dd, gg in
                                zip(self.components, self._views(out), self._views(u), ds, g))
        return self._summed(local)[0]

    def finish_step_(self, out: Tensor, f: Tensor, u: Tensor, d: Tensor) -> None:
        for comp, o, x, dd in zip(self.components, self._views(out), self._views(u), self._views(d)):
            comp.finish_step_(o, f, x, dd)


class ShardedClosure:
    """The loss of the sharded model on its batch at the ball's points (module docstring); with
    gradients enabled it runs the backward itself, hands the elementwise gradient to the
    component's buffer and returns a loss whose only graph carries the owned GL blocks' gradient
    (value + ⟨point, ∂L/∂point⟩ − ⟨point, ∂L/∂point⟩ detached: the same number).

    ``gl_weights``: every weight a GL block writes (name → (owner's rank in ``group``, shape,
    dtype)), the same on every rank; ``full0``: the trained values of the weights this rank owns."""

    def __init__(self, model: nn.Module, local: Dict[str, Tensor],
                 rows: Dict[str, Tuple[int, int]], elementwise: Optional[ShardedElementwise],
                 quotients: Optional[ShardedQuotients], gl_weights: Dict[str, Tuple[int, Any, Any]],
                 full0: Dict[str, Tensor], local_masks: Dict[str, Tensor], group: Any,
                 normalise: bool = False):
        import torch.distributed as dist

        self.model, self.local, self.rows = model, local, rows
        self.elementwise, self.quotients, self.full0 = elementwise, quotients, full0
        self.gl_weights, self.local_masks, self.group = gl_weights, local_masks, group
        self.rank = dist.get_rank(group)
        self.params = dict(model.named_parameters())
        self.inputs: Any = None
        self.targets: Any = None
        self.loss_fn = None
        self.normalise = normalise

    def _global(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _write(self, points: List[Any]) -> None:
        """Writes the perturbed weights into the local shards: the elementwise ones from this
        rank's shards, the GL ones whole from their owner (a broadcast per weight, one weight
        held at a time), each rank copying its rows."""
        import torch.distributed as dist

        stream, comp = points[-1], self.elementwise
        if isinstance(stream, StreamedPoint):
            for i, name in enumerate(comp.names):
                self.local[name].copy_(comp.moved(comp.tensors[i], stream.leaves[i].detach()))
        elif comp is not None:   # a flat point (ProductBall.points, e.g. the retraction check's)
            for name, value in comp.unflatten(stream.detach()).items():
                self.local[name].copy_(value)
        if self.quotients is None:
            return
        writes = head_writes(self.quotients.groups, [p.detach() for p in points[0]], self.full0)
        for name, (owner, shape, dtype) in self.gl_weights.items():
            mine = owner == self.rank
            full = (_written(self.full0[name], writes[name], None) if mine else
                    torch.empty(shape, dtype=dtype, device=self.local[name].device))
            dist.broadcast(full, src=self._global(owner), group=self.group)
            a, b = self.rows[name]
            mask = self.local_masks.get(name)
            target = self.local[name]
            target.copy_(full[a:b] if mask is None else torch.where(mask, full[a:b], target))
            del full

    def _gl_gradients(self) -> Dict[str, Tensor]:
        """The gradients of the GL weights this rank owns, whole (each gathered in turn, kept by
        its owner only)."""
        grads = {}
        for name, (owner, _, _) in self.gl_weights.items():
            g = self.params[name].grad
            full = None if g is None else g.full_tensor() if hasattr(g, "full_tensor") else g
            if owner == self.rank:
                grads[name] = torch.zeros_like(self.full0[name]) if full is None else full
            del full
        return grads

    def __call__(self, points: List[Any]) -> Tensor:
        import torch.distributed as dist

        grad = torch.is_grad_enabled()
        with torch.no_grad():
            self._write(points)
        if isinstance(self.inputs, dict):
            outputs = self.model(**self.inputs)
        else:
            outputs = self.model(self.inputs)
        loss = scalar_loss(loss_of(outputs, self.inputs, self.targets, self.loss_fn, self.normalise),
                           needs_grad=grad)
        value = loss.detach().to(torch.float64).reshape(1)
        dist.all_reduce(value, group=self.group)
        value = value / dist.get_world_size(self.group)
        if not grad:
            reshard(self.model)
            return value.reshape(())
        loss.backward()
        stream = points[-1]
        if isinstance(stream, StreamedPoint):
            comp = self.elementwise
            for i, name in enumerate(comp.names):
                g = self.params[name].grad
                if g is not None:
                    comp.accumulate_(stream, i, g.to_local() if hasattr(g, "to_local") else g,
                                     stream.leaves[i].detach())
        full_grads = self._gl_gradients() if self.quotients is not None else {}
        for p in self.params.values():
            p.grad = None
        surrogate = value.reshape(())
        if self.quotients is not None:
            for (blocks, counts), point in zip(self.quotients.groups, points[0]):
                cot = _gather_heads(blocks, counts, full_grads, point.device, point.dtype)
                surrogate = surrogate + ((point * cot).sum() - (point.detach() * cot).sum())
        return surrogate


@contextlib.contextmanager
def gradients_kept(params: Mapping[str, nn.Parameter]) -> Iterator[None]:
    """Every parameter's ``.grad`` set aside (``None`` inside) and given back on exit."""
    grads = {n: p.grad for n, p in params.items()}
    try:
        for p in params.values():
            p.grad = None
        yield
    finally:
        for n, p in params.items():
            p.grad = grads[n]


@contextlib.contextmanager
def shards_restored(model: nn.Module, local: Dict[str, Tensor], copies: Dict[str, Tensor]) -> Iterator[None]:
    """The local shards restored from ``copies`` on exit (the trained values a run writes over),
    every FSDP2 module resharded on entry and exit."""
    reshard(model)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, copy in copies.items():
                local[name].copy_(copy)
        reshard(model)


def _fsdp_groups(model: nn.Module) -> List[Tuple[Any, Any]]:
    """(FSDP2 state, parameter group) of every FSDP2 module of ``model``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    pairs = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            pairs += [(state, group) for group in getattr(state, "_fsdp_param_groups", [])]
    return pairs


def _half_compute(pairs: List[Tuple[Any, Any]]) -> Optional[torch.dtype]:
    """The half-precision ``param_dtype`` of one of the groups' mixed-precision policies, or None."""
    for _, group in pairs:
        dtype = getattr(getattr(group, "mp_policy", None), "param_dtype", None)
        if dtype in HALF_DTYPES:
            return dtype
    return None


def _set_policy(pairs: List[Tuple[Any, Any]], policies: List[Any]) -> None:
    """Each (state, group) of ``pairs`` given its policy: the gathered weights dropped, so that the
    next all-gather allocates them in the policy's (and the shards') dtype."""
    for (state, group), policy in zip(pairs, policies):
        state._mp_policy = group.mp_policy = policy
        for param in group.fsdp_params:
            param.all_gather_outputs = []
            if hasattr(param, "_unsharded_param"):
                del param._unsharded_param
        group._init_mp_dtypes()


def _float32_supported(pairs: List[Tuple[Any, Any]]) -> bool:
    """Whether this torch's FSDP2 has the state :func:`computed_in_float32` changes (no public API
    sets a module's mixed-precision policy after ``fully_shard``; checked here, not assumed)."""
    return all(hasattr(state, "_mp_policy") and hasattr(group, "mp_policy") and hasattr(group, "_init_mp_dtypes")
               and all(hasattr(p, "all_gather_outputs") for p in group.fsdp_params) for state, group in pairs)


@contextlib.contextmanager
def computed_in_float32(model: nn.Module, what: str) -> Iterator[bool]:
    """A sharded model evaluated in float32 inside (yields whether anything changed): its
    half-precision shards (and buffers) converted to float32, and any FSDP2 mixed-precision policy
    that computes in half precision replaced by the default (float32) one; on exit the shards and
    buffers are converted back (bit for bit: half-precision values are float32 values) and the
    policies restored. The local path's rule for a half-precision model: the value is the sharpness
    of the same weights in float32, since half precision would round the perturbations (relative
    size ~1e-4) away. Refused (TypeError) where this torch's FSDP2 keeps its state elsewhere."""
    params = [p for p in model.parameters() if p.dtype in HALF_DTYPES]
    pairs = _fsdp_groups(model)
    policy = _half_compute(pairs)
    if not params and policy is None:
        yield False
        return
    if not pairs or not _float32_supported(pairs):
        cause = f"its shards are {params[0].dtype}" if params else f"MixedPrecisionPolicy(param_dtype={policy})"
        raise InvalidArgumentType(
            f"{what}: the sharded model computes in half precision ({cause}), "
            f"which rounds the perturbations away, and this torch's FSDP2 does not let the run "
            f"evaluate it in float32. Shard a float32 copy with fully_shard's default policy, or "
            f"measure the unsharded model (evaluated in float32 at its half-precision weights)")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    saved = [group.mp_policy for _, group in pairs]
    half_params = {id(p): p.dtype for p in params}
    buffers = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items()
               if buf is not None and buf.dtype in HALF_DTYPES]
    reshard(model)
    try:
        for module, name, buf in buffers:
            module._buffers[name] = buf.float()
        if half_params:   # FSDP2's _apply re-registers the converted shards
            model._apply(lambda t: t.float() if id(t) in half_params else t)
        _set_policy(pairs, [MixedPrecisionPolicy()] * len(pairs))
        yield True
    finally:
        reshard(model)
        if half_params:
            model._apply(lambda t: t.to(half_params[id(t)]) if id(t) in half_params else t)
        for module, name, buf in buffers:
            module._buffers[name] = buf
        _set_policy(pairs, saved)


def group_of(params: Mapping[str, Tensor], what: str) -> Any:
    """The process group over which FSDP2 (``fully_shard``) shards ``params`` (the group of their
    one-dimensional device mesh, not necessarily the world), ``None`` when no parameter is a
    DTensor. Refused unless ``torch.distributed`` is initialised and every one of ``params`` is a
    DTensor sharded on one dimension of one 1-D mesh (FSDP2's layout; HSDP and tensor parallelism
    are not supported), naming ``what`` (the caller) and what to do."""
    DTensor = _dtensor_type()
    sharded = [n for n, p in params.items() if DTensor is not None and isinstance(p, DTensor)]
    if not sharded:
        return None
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(f"{what}: the model's parameters are DTensors but no torch.distributed process "
                         f"group is initialised: call it on every rank of the group the model is "
                         f"sharded over (e.g. under torchrun)")
    plain = [n for n in params if n not in set(sharded)]
    if plain:
        raise InvalidArgument(f"{what}: {len(sharded)} parameter(s) are sharded (DTensors) and "
                              f"{len(plain)} are not ({', '.join(plain[:3])}): apply fully_shard to the "
                              f"root module too (fully_shard(model) after its blocks), so that every "
                              f"trained parameter is sharded and its gradient reduced")
    mesh = params[sharded[0]].device_mesh   # fully_shard builds one mesh object per call: compare ranks
    meshes = {tuple(params[n].device_mesh.mesh.flatten().tolist()) for n in sharded}
    odd = [n for n in sharded if params[n].device_mesh.ndim != 1 or len(params[n].placements) != 1
           or not isinstance(params[n].placements[0], Shard)]
    if odd or len(meshes) != 1:
        name = (odd or sharded)[0]
        p = params[name]
        several = "" if len(meshes) == 1 else " (and the parameters use several meshes)"
        raise InvalidArgument(f"{what} supports parameters sharded by FSDP2 (fully_shard) on one 1-D "
                              f"device mesh; {name} has placements {tuple(p.placements)} on a "
                              f"{p.device_mesh.ndim}-D mesh{several}: shard the model with "
                              f"fully_shard(module) over one mesh")
    return mesh.get_group()