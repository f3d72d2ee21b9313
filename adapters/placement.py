r"""Where a sharpness run's tensors live: the one seam between a model in one process and a model
sharded over several (FSDP2).

:func:`~quotient_manifolds.adapters.worst_case.run_sharpness` has one loop over batches and radii,
with the retraction check, progress, warnings and result, for every placement. What differs
between placements is behind a :class:`Placement`:

* :meth:`Placement.session`: what holds for the whole run (eval mode; for a sharded model also the
  trained shards and every ``.grad`` restored at the end, also after an exception);
* :meth:`Placement.prepare`: the weights, the layout accepted on the first batch (detected,
  verified, a failing block's group derived), the batches;
* :meth:`Placement.build`: the ball of perturbations and the closure that evaluates the loss at
  its points. The ball's components own the reductions: norms and inner products of a sharded
  component are summed over the ranks, so the solver and the run loop never ask where a tensor is.

Two placements: :class:`LocalPlacement` (here) and
:class:`ShardedPlacement` (a model whose parameters are DTensors: FSDP2).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterable, Iterator, Protocol, Tuple

import torch
from torch import Tensor, nn

from quotient_manifolds.errors import InvalidArgument

from .ball import ball_of, quotient_components
from .components import ProductBall
from .evaluation import ModelClosure
from .gate import Prepared, prepare_run
from .modes import eval_mode
from .sharded import (ShardedClosure, ShardedElementwise, ShardedQuotients, assign_owners, computed_in_float32,
                      gradients_kept, group_of, local_rows, shards_restored)
from .sharded_gate import accept_on_shards
from .validation import TokenInputs

__all__ = ["Placement", "LocalPlacement", "ShardedPlacement"]


class Placement(Protocol):
    """The seam of a sharpness run (module docstring)."""

    #: the number of processes the run spans (1 in one process)
    world_size: int
    #: whether this process reports for the run (shows the progress bar): rank 0, or the only one
    is_main: bool

    def session(self) -> ContextManager[None]:
        """The context of the whole run (eval mode, and what is restored at its end)."""

    def seed_of(self, seed: int) -> int:
        """The seed of this process's random draws (``measure="average"``) for the run's ``seed``."""

    def prepare(self, batches: Iterable[Any], options: Any, tokens: TokenInputs,
                stacklevel: int) -> Prepared:
        """The set-up before the first batch: weights, layout accepted on the first batch, batches."""

    def build(self, prepared: Prepared, options: Any) -> Tuple[ProductBall, Any]:
        """The ball of perturbations and the closure: ``closure(points)`` is the loss at the
        ball's points on the batch set in ``closure.inputs`` / ``closure.targets`` /
        ``closure.loss_fn``."""


class LocalPlacement:
    """A model in one process: the ball's iterates beside the weights, which are never written
    (the closure reads the perturbed weights where the model reads them)."""

    world_size = 1
    is_main = True

    def __init__(self, model: nn.Module):
        self.model = model

    def session(self) -> ContextManager[None]:
        return eval_mode(self.model)

    def seed_of(self, seed: int) -> int:
        return seed

    def prepare(self, batches: Iterable[Any], options: Any, tokens: TokenInputs,
                stacklevel: int) -> Prepared:
        return prepare_run(self.model, batches, options, tokens, stacklevel + 1)

    def build(self, prepared: Prepared, options: Any) -> Tuple[ProductBall, ModelClosure]:
        ball, write_back = ball_of(
            prepared.params0, geometry=options.geometry, layout=prepared.layout,
            retraction=options.retraction, gram_eps=options.gram_eps, use_metric_norm=options.use_metric_norm,
            adaptive_direction=options.adaptive_direction,
            elementwise_second_order=options.elementwise_second_order, streaming=True,
            compute_dtype=torch.float32 if prepared.upcast else None)
        # the loss function is set per batch (dict batches may use the model's own loss)
        return ball, ModelClosure(self.model, prepared.params0, prepared.buffers, write_back, None,
                                  options.normalize_logits)


class ShardedPlacement:
    """The :class:`~quotient_manifolds.adapters.placement.Placement` of a model sharded with FSDP2
    (module docstring): every rank calls the run with its own batches; the ball's vectors are the
    ranks' shards, each GL block held whole by one rank; the layout is verified module by module on
    the sharded model (:func:`~quotient_manifolds.adapters.sharded_gate.accept_on_shards`)."""

    def __init__(self, model: nn.Module, what: str):
        import torch.distributed as dist

        self.model, self.what = model, what
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.group = group_of(self.params, what)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.is_main = self.rank == 0
        #: this rank's shard of each weight and its rows of the whole weight, read in the session
        #: (after a half-precision model's shards were converted to float32)
        self.local: Dict[str, Tensor] = {}
        self.rows: Dict[str, Tuple[int, int]] = {}
        #: the trained values of the shards the run writes, restored when it ends
        self.copies: Dict[str, Tensor] = {}
        #: whether the model computes in half precision and runs in float32 here
        self.upcast = False

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        # exits in reverse: the trained shards back, eval mode off, half precision back, .grad back
        with gradients_kept(self.params), computed_in_float32(self.model, self.what) as upcast, \
                eval_mode(self.model):
            self.upcast = upcast
            for name, p in self.params.items():
                self.local[name], a, b = local_rows(p)
                self.rows[name] = (a, b)
            with shards_restored(self.model, self.local, self.copies):
                yield

    def seed_of(self, seed: int) -> int:
        # every rank draws its own shards' directions: the same generator on every rank would
        # repeat one draw in every shard of equal size (directions correlated across the ranks)
        return (seed * self.world_size + self.rank) % 2 ** 64   # the range torch.manual_seed takes

    def prepare(self, batches: Any, options: Any, tokens: Any, stacklevel: int) -> Any:
        if options.include_frozen:
            raise InvalidArgument(
                f"{self.what}: include_frozen=True on a model sharded with FSDP2: FSDP2 computes no "
                f"gradient for frozen weights, which the run needs. Set requires_grad=True on the "
                f"weights to perturb (the run leaves .grad as it was), or measure unsharded")
        prepared = prepare_run(self.model, batches, options, tokens, stacklevel + 1, accept=accept_on_shards)
        return prepared._replace(upcast=self.upcast)   # recorded; half-precision inputs cast to float32

    def build(self, prepared: Any, options: Any) -> Tuple[ProductBall, "ShardedClosure"]:
        params, local, rows, copies = self.params, self.local, self.rows, self.copies
        layout = prepared.layout
        geodesic = options.spec.geodesic
        gl_names = sorted({piece.param for block in layout.blocks for piece in block.pieces}) if geodesic else []
        owners = (assign_owners(layout.blocks, {n: params[n].numel() for n in gl_names}, self.world_size)
                  if gl_names else {})
        gl_weights = {n: (owners[n], tuple(params[n].shape), params[n].dtype) for n in gl_names}
        full0 = {}
        for n in gl_names:  # gathered one at a time, kept by the owner only
            full = params[n].full_tensor().detach()
            if owners[n] == self.rank:
                full0[n] = full
            del full
        masks = dict(getattr(layout, "gl_masks", {}) or {}) if geodesic else {}
        adaptive = [n for n in (layout.adaptive if geodesic else params) if n in params]
        local_masks = {}
        for n in adaptive:
            copies[n] = local[n].detach().clone()
            if n in masks:
                a, b = rows[n]
                local_masks[n] = masks[n].to(local[n].device)[a:b]
        for n in gl_names:
            if n not in copies:
                copies[n] = local[n].detach().clone()
        quotients = None
        if geodesic and layout.blocks:
            owned = [b for b in layout.blocks if owners[b.g_pieces[0].param] == self.rank]
            # streaming=True: the owner keeps the heads in the weights' dtype (the frame promotes
            # them where it uses them: the same numbers, no float64 copy)
            components, groups = quotient_components(
                owned, full0, metric=options.spec.metric, retraction=options.retraction,
                gram_eps=options.gram_eps, use_metric_norm=options.use_metric_norm, streaming=True)
            quotients = ShardedQuotients(components, groups, dtype=params[gl_names[0]].dtype,
                                         device=local[gl_names[0]].device, group=self.group)
        elementwise = ShardedElementwise(
            {n: copies[n] for n in adaptive},
            masks={n: ~m for n, m in local_masks.items()}, direction=options.adaptive_direction,
            second_order=options.elementwise_second_order, group=self.group) if adaptive else None
        if prepared.covered:   # an adaptive run's attention entries, as this rank's rows
            prepared.covered.update({n: m.to(local[n].device)[slice(*rows[n])]
                                     for n, m in prepared.covered.items() if n in local})
        ball = ProductBall([c for c in (quotients, elementwise) if c is not None])
        closure = ShardedClosure(self.model, local, rows, elementwise, quotients, gl_weights, full0,
                                 local_masks, self.group, normalise=options.normalize_logits)
        return ball, closure
