r"""Sharpness of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

:func:`~quotient_manifolds.adapters.sharpness` takes this path by itself when the model's
parameters are DTensors sharded on their first dimension (``Shard(0)``, FSDP2's default) or
replicated. Every rank calls it with its own batches (the same ones, or each its share of a
global batch: data parallelism combined with sharding); the loss of an evaluation is the mean over
the ranks of their mean losses, so equal batch sizes give the loss of the union of the batches,
and every rank returns the same :class:`~quotient_manifolds.adapters.SharpnessResult`.

What each rank holds: the perturbation ξ and every buffer of the solver over the *local shard* of
each elementwise (adaptive) weight, a copy of that shard (the trained weights, to move from and to
restore), and the GL(h) attention blocks whole. The solver's norms and inner products over the
elementwise part are summed over the ranks (``all_reduce``). A GL block's heads take their rows
from several parameters, which FSDP2 cuts at other places than head boundaries (a head may
straddle two ranks, and its G and H live on different ones), so the blocks' factors are assembled
whole on every rank (``DTensor.full_tensor``, one parameter at a time) and their geometry (Gram
matrices, projections, retraction) is computed identically everywhere. Memory per rank is thus
about 1/world of the elementwise part (most of a transformer's weights) plus all of the attention
blocks; the values equal those of the unsharded model.

An evaluation writes the perturbed weights into the local shards (in place, under ``no_grad``;
the sharded weights must be float32 or float64), runs the model as it is (FSDP2 gathers and
scatters as in training, with its mixed-precision policy if it has one), and reads the gradient
from the sharded ``.grad`` (averaged over the ranks by FSDP2's reduce-scatter). The trained weights
and the parameters' ``.grad`` are restored when the run ends, also after an exception. The layout
of a geodesic geometry must have been verified before sharding (``layout.verify(model, inputs)``
on the unsharded model); it is passed as ``layout=``.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .ball import _written, build_ball, head_writes
from .components import ElementwiseComponent, ProductBall, StreamedPoint
from .evaluation import eval_mode

__all__ = ["is_sharded", "ShardedElementwise"]


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


def _reshard(model: nn.Module) -> None:
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


def _local_rows(p) -> Tuple[Tensor, int, int]:
    """(local tensor, first row, last row + 1) of a DTensor sharded on dim 0 or replicated, the
    rows of the full tensor this rank holds (``torch.chunk`` semantics, as FSDP2 cuts)."""
    from torch.distributed.tensor import Replicate, Shard

    local = p.to_local()
    placements = tuple(p.placements)
    if all(isinstance(pl, Replicate) for pl in placements):
        return local, 0, p.shape[0] if p.dim() else 1
    if len(placements) != 1 or not (isinstance(placements[0], Shard) and placements[0].dim == 0):
        raise NotImplementedError(
            f"a parameter placed as {placements} on its device mesh: sharded sharpness supports "
            f"FSDP2's Shard(0) on a one-dimensional mesh (or replicated parameters); apply "
            f"fully_shard without tensor parallelism")
    mesh = p.device_mesh
    rank, world = mesh.get_local_rank(), mesh.size()
    rows = p.shape[0]
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    if start + local.shape[0] > rows:
        raise RuntimeError(f"unexpected FSDP2 shard: rank {rank} holds {local.shape[0]} of {rows} rows "
                           f"from {start}")
    return local, start, start + local.shape[0]


class ShardedElementwise(ElementwiseComponent):
    """The streaming elementwise component over this rank's shards of the weights: every norm and
    inner product it returns is summed over the ranks of ``group`` (one ``all_reduce`` per
    call), so the solver sees the component of the whole model."""

    def __init__(self, tensors: Dict[str, Tensor], *, group: Any = None, **options):
        super().__init__(tensors, streaming=True, **options)
        self.group = group

    def _summed(self, *values: Tensor) -> Tuple[Tensor, ...]:
        import torch.distributed as dist

        stacked = torch.stack([v.to(torch.float64) for v in values])
        dist.all_reduce(stacked, group=self.group)
        return tuple(stacked.unbind())

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


class ShardedClosure:
    """The loss of the sharded model on its batch at the ball's points (module docstring); with
    gradients enabled it runs the backward itself, hands the elementwise gradient to the
    component's buffer and returns a loss whose only graph carries the GL blocks' gradient
    (value + ⟨point, ∂L/∂point⟩ − ⟨point, ∂L/∂point⟩ detached: the same number)."""

    def __init__(self, model: nn.Module, local: Dict[str, Tensor],
                 rows: Dict[str, Tuple[int, int]], elementwise: Optional[ShardedElementwise],
                 quotients: List[Tuple[Any, Tuple[list, List[int]]]], full0: Dict[str, Tensor],
                 local_masks: Dict[str, Tensor], group: Any):
        self.model, self.local, self.rows = model, local, rows
        self.elementwise, self.quotients, self.full0 = elementwise, quotients, full0
        self.local_masks, self.group = local_masks, group
        self.params = dict(model.named_parameters())
        self.inputs: Any = None
        self.targets: Any = None
        self.loss_fn = None

    def _write(self, points: List[Any]) -> Dict[str, List]:
        """Writes the perturbed weights into the local shards; returns the GL writes per weight."""
        n_quot = len(self.quotients)
        stream = points[n_quot] if len(points) > n_quot else None
        if isinstance(stream, StreamedPoint):
            comp = self.elementwise
            for i, name in enumerate(comp.names):
                self.local[name].copy_(comp.moved(comp.tensors[i], stream.leaves[i].detach()))
        writes = head_writes([groups for _, groups in self.quotients],
                             [p.detach() for p in points[:n_quot]], self.full0)
        for name, pieces in writes.items():
            full = _written(self.full0[name], pieces, None)
            a, b = self.rows[name]
            mask = self.local_masks.get(name)
            target = self.local[name]
            target.copy_(full[a:b] if mask is None else torch.where(mask, full[a:b], target))
        return writes

    def __call__(self, points: List[Any]) -> Tensor:
        import torch.distributed as dist

        grad = torch.is_grad_enabled()
        with torch.no_grad():
            writes = self._write(points)
        if isinstance(self.inputs, dict):
            outputs = self.model(**self.inputs)
        else:
            outputs = self.model(self.inputs)
        loss = getattr(outputs, "loss", None) if self.loss_fn is None else self.loss_fn(
            outputs, self.targets)
        value = loss.detach().to(torch.float64).reshape(1)
        dist.all_reduce(value, group=self.group)
        value = value / dist.get_world_size(self.group)
        if not grad:
            _reshard(self.model)
            return value.reshape(())
        loss.backward()
        n_quot = len(self.quotients)
        stream = points[n_quot] if len(points) > n_quot else None
        if isinstance(stream, StreamedPoint):
            comp = self.elementwise
            for i, name in enumerate(comp.names):
                g = self.params[name].grad
                if g is not None:
                    comp.accumulate_(stream, i, g.to_local() if hasattr(g, "to_local") else g,
                                     stream.leaves[i].detach())
        full_grads = {}
        for name in writes:
            g = self.params[name].grad
            full_grads[name] = (torch.zeros_like(self.full0[name]) if g is None else
                                g.full_tensor() if hasattr(g, "full_tensor") else g)
        for p in self.params.values():
            p.grad = None
        surrogate = value.reshape(())
        for (comp, (blocks, counts)), point in zip(self.quotients, points[:n_quot]):
            from .ball import _gather_heads

            cot = _gather_heads(blocks, counts, full_grads, point.device, point.dtype)
            surrogate = surrogate + ((point * cot).sum() - (point.detach() * cot).sum())
        return surrogate


@contextlib.contextmanager
def _restored(model: nn.Module, params: Dict[str, nn.Parameter], local: Dict[str, Tensor],
              copies: Dict[str, Tensor]) -> Iterator[None]:
    """Restores the local shards from ``copies`` and every parameter's ``.grad`` on exit."""
    grads = {n: p.grad for n, p in params.items()}
    try:
        for p in params.values():
            p.grad = None
        yield
    finally:
        with torch.no_grad():
            for name, copy in copies.items():
                local[name].copy_(copy)
        _reshard(model)
        for n, p in params.items():
            p.grad = grads[n]


def run_sharded(model: nn.Module, batches: Any, rhos: Sequence[float], options, *, stacklevel: int
                ) -> List[Any]:
    """The body of :func:`~quotient_manifolds.adapters.sharpness` for a sharded model (module
    docstring): one :class:`~quotient_manifolds.adapters.SharpnessResult` per radius."""
    import torch.distributed as dist

    from .solver import auto_pgd, average_case
    from .worst_case import _result, default_loss, split_batch

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the model's parameters are DTensors but no torch.distributed process group "
                           "is initialised: call sharpness on every rank of the group the model is "
                           "sharded over (e.g. under torchrun)")
    _reshard(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("the model has no trainable parameter: sharpness perturbs the trainable weights")
    # the ranks the weights are sharded over (FSDP2's one-dimensional mesh), not necessarily the world
    group = next((p.device_mesh.get_group() for p in params.values() if hasattr(p, "device_mesh")), None)
    geodesic = options.spec.geodesic
    layout = options.layout
    if geodesic:
        failed = getattr(layout, "verify_failed", None)
        if layout is None or failed is None or failed:
            raise ValueError(
                f"{options.geometry} sharpness of a sharded model needs layout= a layout verified before "
                f"sharding: layout = adapters.layout(model); layout.verify(model, example_inputs) on "
                f"the unsharded model, then fully_shard, then sharpness(..., layout=layout)"
                + ("" if not failed else f" (this one failed on blocks {list(failed)})"))
    half = sorted(n for n, p in params.items() if p.dtype in (torch.float16, torch.bfloat16))
    if half:
        raise TypeError(
            f"the sharded parameters {half[:3]} are in half precision: a perturbation of relative size "
            f"~1e-4 rounds away in them, and the sharded path writes the perturbed weights in place. "
            f"Keep the sharded weights in float32 (FSDP2's MixedPrecisionPolicy(param_dtype="
            f"torch.bfloat16) still computes in bfloat16 if you want that)")
    local, rows, copies, local_masks = {}, {}, {}, {}
    for name, p in params.items():
        local[name], a, b = _local_rows(p)
        rows[name] = (a, b)
    finite = torch.tensor([float(all(bool(torch.isfinite(t).all()) for t in local.values()))])
    dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=group)
    if finite.item() < 1:
        raise ValueError("a parameter contains non-finite values; sharpness is undefined at such weights")
    gl_names = sorted({piece.param for block in layout.blocks for piece in block.pieces}) if geodesic else []
    full0 = {n: params[n].full_tensor().detach() for n in gl_names}
    masks = dict(getattr(layout, "gl_masks", {}) or {}) if geodesic else {}
    adaptive = [n for n in (layout.adaptive if geodesic else params) if n in params]
    for n in adaptive:
        copies[n] = local[n].detach().clone()
        if n in masks:
            a, b = rows[n]
            local_masks[n] = masks[n].to(local[n].device)[a:b]
    for n in gl_names:
        if n not in copies:
            copies[n] = local[n].detach().clone()
    quotients: List = []
    if geodesic and layout.blocks:
        ball, write_back = build_ball(model, {n: full0[n] for n in gl_names}, geometry=options.geometry,
                                      layout=layout, retraction=options.retraction,
                                      gram_eps=options.gram_eps, use_metric_norm=options.use_metric_norm)
        quotients = [(comp, groups) for (groups, comp) in write_back._quotients]
    elementwise = ShardedElementwise(
        {n: copies[n] for n in adaptive},
        masks={n: ~m for n, m in local_masks.items()}, direction=options.adaptive_direction,
        second_order=options.elementwise_second_order, group=group) if adaptive else None
    components = [c for c, _ in quotients] + ([elementwise] if elementwise is not None else [])
    ball = ProductBall(components)
    closure = ShardedClosure(model, local, rows, elementwise, quotients, full0,
                             local_masks, group)
    generator = torch.Generator(device=next(iter(local.values())).device).manual_seed(options.seed)
    runs: List[List[Dict[str, Any]]] = [[] for _ in rhos]
    setup_started = time.perf_counter()
    with eval_mode(model), _restored(model, params, local, copies):
        for index, batch in enumerate(batches):
            inputs, targets, own_loss = split_batch(model, batch, index, options.loss_fn,
                                                    options.normalize_logits)
            closure.inputs, closure.targets = inputs, targets
            closure.loss_fn = None if own_loss else (options.loss_fn or default_loss)
            previous = None
            for runs_at, rho in zip(runs, rhos):
                started = time.perf_counter()
                if options.measure == "worst":
                    res = auto_pgd(ball, closure, rho, n_iters=options.n_iters, momentum=options.momentum,
                                   step_normalisation=options.step_normalisation,
                                   step_size_mult=options.step_size_mult,
                                   start=None if previous is None else (previous.xi, previous.init_loss))
                    previous = res
                    share = ball.quotient_share(res.xi)
                    run = dict(init=res.init_loss, worst=res.worst_loss, norm=res.norm,
                               fwd=res.n_forward, bwd=res.n_backward, gap=None, share=share,
                               attention=share if geodesic and layout.blocks else None)
                else:
                    res = average_case(ball, closure, rho, n_samples=options.n_samples, generator=generator)
                    run = dict(init=res.init_loss, worst=res.mean_loss, norm=rho,
                               fwd=1 + options.n_samples, bwd=0, gap=None)
                run["time"] = time.perf_counter() - started
                runs_at.append(run)
    if not runs[0]:
        raise ValueError("`batches` is empty: pass at least one (inputs, targets) pair or dict batch")
    setup = time.perf_counter() - setup_started - sum(r["time"] for at in runs for r in at)
    results = []
    for rho, at in zip(rhos, runs):
        results.append(_result(rho, at, options, setup / len(rhos), False, stacklevel + 1))
    for r in results:
        r.options["world_size"] = dist.get_world_size(group)
    return results
