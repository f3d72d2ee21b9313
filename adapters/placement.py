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
:class:`~quotient_manifolds.adapters.sharded.ShardedPlacement`; :func:`placement_of` picks the one
of a model.
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterable, Protocol, Tuple

import torch
from torch import nn

from .ball import ball_of
from .components import ProductBall
from .evaluation import ModelClosure
from .gate import Prepared, prepare_run
from .modes import eval_mode
from .sharded import ShardedPlacement, is_sharded
from .validation import TokenInputs

__all__ = ["Placement", "LocalPlacement", "placement_of"]


class Placement(Protocol):
    """The seam of a sharpness run (module docstring)."""

    #: the number of processes the run spans (1 in one process)
    world_size: int
    #: whether this process reports for the run (shows the progress bar): rank 0, or the only one
    is_main: bool

    def session(self) -> ContextManager[None]:
        """The context of the whole run (eval mode, and what is restored at its end)."""

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


def placement_of(model: nn.Module, what: str) -> Placement:
    """The placement of ``model``: sharded when any of its parameters is a DTensor (FSDP2), else
    local. ``what`` names the caller in messages."""
    if is_sharded(model):
        return ShardedPlacement(model, what)
    return LocalPlacement(model)

