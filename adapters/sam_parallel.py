r"""Geodesic SAM across processes: DistributedDataParallel (every rank the whole model) and FSDP2
(``fully_shard``: every rank a shard of each weight), the parts of
:class:`~quotient_manifolds.adapters.GeodesicSAM` that talk to the other ranks.

* DDP: the ascent direction comes from the gradient averaged over the ranks (DDP's own all-reduce,
  or one by :meth:`ParallelAscent._synchronised_gradients` after a pass inside ``no_sync()``), so
  every rank perturbs alike; a layout verified on each rank's own first batch must come out the
  same on every rank.
* FSDP2: the ascent (:meth:`GeodesicSAM._ball_ascent_`, the same for one process) runs over the
  pieces of :meth:`ParallelAscent._sharded_pieces`: the weights outside the GL blocks are moved on
  each rank's shard, with one all-reduce of the squared norm; the GL blocks, whose heads straddle
  shard boundaries and whose G and H live in different weights, are assembled whole one attention
  module at a time (``DTensor.full_tensor()``), their direction is formed identically on every
  rank, and each rank writes back its shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from quotient_manifolds.errors import SymmetryError, UsageError

from .evaluation import as_compute
from .sharded import _dtensor_type

__all__ = ["ParallelAscent", "AscentPiece"]


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (its storage: writes reach the parameter); ``t`` otherwise."""
    DTensor = _dtensor_type()
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _whole(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor (an all-gather); ``t`` otherwise."""
    DTensor = _dtensor_type()
    return t.full_tensor() if DTensor is not None and isinstance(t, DTensor) else t


def _shard_of(whole: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of ``whole`` in the layout of the DTensor ``like`` (no communication)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(whole.to(like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None).to_local()


class AscentPiece(NamedTuple):
    """A part of the ball of one ascent step (:meth:`GeodesicSAM._ball_ascent_`): its ball, the map
    to the parameters, the Riemannian gradient in its coordinates, and how the perturbed point is
    written back to the model's weights. ``summed``: its ‖g‖² is summed over the ranks (a rank's
    shards) rather than counted once (the same on every rank); ``kept``: held between the
    ascent's two passes (else formed again for the second)."""

    ball: Any
    ball_params: Any
    rgrad: List[Tensor]
    write: Callable[[Dict[str, Tensor]], None]
    summed: bool
    kept: bool


class ParallelAscent:
    """The methods of :class:`~quotient_manifolds.adapters.GeodesicSAM` that involve other ranks
    (module docstring); mixed into it."""

    def _verify_layout_on_every_rank(self) -> None:
        """:meth:`_verify_layout`; under DDP each rank verifies on its own batch, so the outcomes
        (a refusal, or blocks whose group was derived or dropped) are compared across the ranks
        (one all_gather_object, once): they must agree, or every rank perturbs differently."""
        if self._ddp is None:
            self._verify_layout()
            return
        import torch.distributed as dist

        error: Optional[BaseException] = None
        try:
            self._verify_layout()
        except Exception as err:   # raised below, after the other ranks have heard of it
            error = err
        mine = (None if error is None else f"{type(error).__name__}: {error}",
                None if error is not None else [b.describe() for b in self.layout.blocks])
        group = getattr(self._ddp, "process_group", None)
        outcomes: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(outcomes, mine, group=group)
        if error is not None:
            raise error
        failed = [rank for rank, (err, _) in enumerate(outcomes) if err is not None]
        if failed:
            raise SymmetryError(f"GeodesicSAM({self.geometry}): the layout failed verification on "
                                f"rank(s) {failed} ({outcomes[failed[0]][0]}); every rank stops")
        if any(blocks != mine[1] for _, blocks in outcomes):
            raise UsageError(f"GeodesicSAM({self.geometry}): the ranks accepted different layouts "
                             f"when verifying on their own first batches (a block's group derived "
                             f"or dropped on some ranks only), so they would perturb differently: "
                             f"verify the layout once (lay = adapters.layout(model); "
                             f"lay.verify(model, inputs) with the same inputs on every rank) and "
                             f"pass layout=lay")

    def _sharded_pieces(self, grads: Dict[str, Optional[Tensor]], upcast: bool,
                        rebuilt_only: bool = False) -> Iterator["AscentPiece"]:
        r"""The pieces of the ascent's ball for FSDP2-sharded parameters (DTensors sharded on one
        mesh dimension), with which :meth:`_ball_ascent_` takes the same ε = ρ g/‖g‖ and w_adv on
        every rank as for the unsharded model.

        * Weights outside the GL blocks (elementwise metric, every weight for ``"adaptive"``): one
          piece, each rank's own shard; its ‖g‖² is summed over the ranks (one all-reduce of a
          scalar). Kept between the ascent's two passes (``rebuilt_only`` leaves it out).
        * GL blocks: a head's rows may straddle shard boundaries and its G and H live in different
          parameters, so the parameters of one attention module's blocks (blocks that share a
          parameter are taken together) are assembled whole (``DTensor.full_tensor()``, one
          parameter at a time) and their ascent direction is formed on every rank alike (the Gram
          matrices need no collective, and their ‖g‖² is counted once). One piece per module,
          formed again in the second pass, so only one module's attention weights and gradients
          are whole at a time: the transient memory is 2× the largest attention module's
          parameters in the compute dtype, plus a few float64 copies of its heads (point,
          gradient, direction), not the model's.
        """
        if not rebuilt_only:
            covered = self._block_parameters()
            local_names = [n for n in self._perturbed if n not in covered and _local(self._perturbed[n]).numel()]
            layout = None
            if self.layout is not None:   # the weights a geodesic ball moves elementwise
                layout = dataclasses.replace(self.layout, blocks=[])
                local_names = [n for n in local_names if n in set(self.layout.adaptive)]
            if local_names:   # this rank's shards of them (a rank may hold none)
                params0 = {n: as_compute(_local(self._perturbed[n]).detach(), upcast) for n in local_names}
                ball, ball_params = self._ball_of(params0, layout)
                rgrad = ball.rgrad(ball_params.gather({n: None if grads[n] is None else _local(grads[n])
                                                       for n in local_names}))

                def write_shards(params: Dict[str, Tensor], params0=params0) -> None:
                    for n in params0:
                        if params[n] is not params0[n]:
                            _local(self._perturbed[n]).copy_(params[n])

                yield AscentPiece(ball, ball_params, rgrad, write_shards, summed=True, kept=True)
        for blocks in self._block_groups():
            ball, ball_params, rgrad = self._whole_blocks(blocks, grads, upcast)

            def write_whole(params: Dict[str, Tensor], params0=ball_params.params0) -> None:
                for n, whole in params.items():
                    if whole is not params0[n]:
                        p = self._perturbed[n]
                        _local(p).copy_(_shard_of(whole, p))

            yield AscentPiece(ball, ball_params, rgrad, write_whole, summed=False, kept=False)

    def _block_parameters(self) -> set:
        """Names of the parameters that a GL block touches (wholly or in part)."""
        if self.layout is None:
            return set()
        return {p for b in self.layout.blocks for p in b.params}

    def _block_groups(self) -> List[List]:
        """The layout's blocks in groups that share no parameter (one attention module's blocks),
        in the layout's order (the same on every rank: the gathers are collectives)."""
        blocks = list(self.layout.blocks) if self.layout is not None else []
        groups: List[Tuple[set, List]] = []
        for block in blocks:
            touching = [g for g in groups if g[0] & set(block.params)]
            names, members = set(block.params), [block]
            for g in touching:
                names |= g[0]
                members = g[1] + members
                groups.remove(g)
            groups.append((names, members))
        order = {id(b): i for i, b in enumerate(blocks)}
        return [sorted(members, key=lambda b: order[id(b)]) for _, members in
                sorted(groups, key=lambda g: min(order[id(b)] for b in g[1]))]

    def _whole_blocks(self, blocks: List, grads: Dict[str, Optional[Tensor]], upcast: bool):
        """(ball, ball parameters, Riemannian gradient) of ``blocks`` on their whole parameters."""
        touched = {p for b in blocks for p in b.params}
        # in the model's order (the same on every rank: the gathers are collectives); entries of
        # these parameters outside the blocks are elementwise, in this ball too (its masks)
        names = [n for n in self._perturbed if n in touched]
        params0 = {n: as_compute(_whole(self._perturbed[n].detach()), upcast) for n in names}
        whole_grads = {n: None if grads[n] is None else _whole(grads[n]) for n in names}
        ball, ball_params = self._ball_of(params0, dataclasses.replace(self.layout, blocks=blocks))
        return ball, ball_params, ball.rgrad(ball_params.gather(whole_grads))

    def _synchronised_gradients(self) -> Dict[str, Optional[Tensor]]:
        """The gradients in ``.grad``; under DDP after a backward pass inside ``no_sync()``,
        averaged over the ranks first (in place: one all-reduce per dtype, after one of which
        parameters hold a gradient)."""
        grads = {n: p.grad for n, p in self._perturbed.items()}
        if self._ddp is None or self._ddp_state["synced"]:
            return grads
        import torch.distributed as dist

        group = getattr(self._ddp, "process_group", None)
        world = dist.get_world_size(group)
        names = [n for n, g in grads.items() if g is None or not g.is_sparse]   # sparse: refused next
        # a parameter unused on some ranks has no gradient there: it counts as 0 in the average,
        # and keeps .grad None only where no rank has one (AdamW would decay a zero gradient)
        device = next(iter(self._perturbed.values())).device   # NCCL reduces on the GPU only
        held = torch.tensor([grads[n] is not None for n in names], dtype=torch.float64, device=device)
        dist.all_reduce(held, group=group)
        names = [n for n, count in zip(names, held.tolist()) if count > 0]
        for dtype in sorted({self._perturbed[n].dtype for n in names}, key=str):
            part = [n for n in names if self._perturbed[n].dtype == dtype]
            flat = torch.cat([torch.zeros(self._perturbed[n].numel(), dtype=dtype,
                                          device=self._perturbed[n].device) if grads[n] is None
                              else grads[n].reshape(-1).to(dtype) for n in part])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            for n, piece in zip(part, torch.split(flat, [self._perturbed[n].numel() for n in part])):
                piece = piece.view_as(self._perturbed[n])
                if grads[n] is None:
                    self._perturbed[n].grad = grads[n] = piece.clone()
                else:
                    grads[n].copy_(piece)
        self._ddp_state["synced"] = True
        return grads

    def _sum_over_ranks(self, value: float) -> float:
        """Σ over the ranks of the sharded parameters' process group (float64)."""
        if self._shard_group is None:
            return value
        import torch.distributed as dist

        device = next(iter(self._perturbed.values())).device
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self._shard_group)
        return float(t[0])
