r"""The training loop of every study, written once.

:func:`train_steps` is the loop itself (one update per batch; a worker whose parent died exits
between two updates); :func:`train_epochs` runs it epoch by epoch on a :class:`TrainingLoop` (the
text and vision populations); the SAM and LoRA studies drive it with their own updates.
:class:`TrainingLoop` is the per-step bookkeeping (clip, optimiser and schedule step, progress
bar) with the learning-rate schedule of :func:`schedule_factor`; :func:`adamw` the optimiser the
text models and the SAM study train with.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

from .runner import check_parent_alive, progress_bar

__all__ = ["schedule_factor", "TrainingLoop", "adamw", "train_steps", "train_epochs"]


def schedule_factor(total: int, warmup: float, decay: str) -> Callable[[int], float]:
    """The learning-rate multiplier at step s of ``total``: linear warm-up over the first
    ``warmup`` fraction of the steps, then ``decay`` ("linear" to 0 at ``total``, or "cosine")."""
    warm = max(1, int(warmup * total))
    if decay == "linear":
        def factor(s: int) -> float:
            return min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm)))
    elif decay == "cosine":
        def factor(s: int) -> float:
            progress_ = min(1.0, (s - warm) / max(1, total - warm))
            after = 0.5 * (1 + math.cos(math.pi * progress_)) if s >= warm else 1.0
            return min((s + 1) / warm, after)
    else:
        raise ValueError(f"unknown decay {decay!r}; valid: 'linear', 'cosine'")
    return factor


class TrainingLoop:
    """The bookkeeping the text and vision training loops share: a linear warm-up over the first
    ``warmup`` fraction of the steps, then ``decay`` ("linear" to 0, or "cosine"); per step
    backward, gradient-norm clipping to 1, optimiser and schedule step; a progress bar."""

    def __init__(self, opt, params, *, steps_per_epoch: int, epochs: int, warmup: float,
                 decay: str, progress: bool):
        total = steps_per_epoch * epochs
        factor = schedule_factor(total, warmup, decay)
        self.opt, self.params = opt, list(params)
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        self.steps_per_epoch, self.total = steps_per_epoch, total
        self.losses: List[float] = []
        self.bar = None
        if progress:
            self.bar = progress_bar(total=total, desc="train", unit="step", leave=False)

    def step(self, loss) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.sched.step()
        # kept as tensors: a float() per step would wait for the GPU after every step
        self.losses.append(loss.detach())
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{float(torch.stack(self.losses[-20:]).mean()):.3f}")

    def finish(self, model) -> Dict[str, Any]:
        """Close the bar, put the model in eval mode; steps and the last epoch's mean loss."""
        if self.bar is not None:
            self.bar.close()
        model.eval()
        last = self.losses[-max(1, self.steps_per_epoch):]
        return dict(steps=self.total,
                    final_train_loss=float(torch.stack(last).double().mean()) if last
                    else float("nan"))


def adamw(params: Sequence[Any], *, lr: float, weight_decay: float, fused: bool = False):
    """AdamW on ``params`` with weight decay on the matrices only (``p.dim() ≥ 2``; none on
    biases and norms). ``fused``: torch's fused kernel where this torch has it (the same update;
    5x faster than the for-loop one on the 22.6M MiniLM weights in the text study's pilot)."""
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=lr, fused=True)
        except (RuntimeError, TypeError):  # pragma: no cover - a torch without the CPU kernel
            pass
    return torch.optim.AdamW(groups, lr=lr)


def train_steps(update: Callable[[Any], Any], batches: Iterable[Any],
                after_step: Optional[Callable[[int, Any], bool]] = None) -> int:
    """The training loop: ``update(batch)`` for each batch of ``batches`` in turn, then
    ``after_step(k, what update returned)`` for the k-th (from 1), which stops the loop by
    returning True. A worker whose parent died exits before its next update. Returns the number of
    updates made."""
    k = 0
    for k, batch in enumerate(batches, 1):
        check_parent_alive()
        out = update(batch)
        if after_step is not None and after_step(k, out):
            break
    return k


def train_epochs(model, loop: TrainingLoop, epochs: int, epoch_batches: Callable[[], Iterable[Any]],
                 loss: Callable[[Any], Any], after_epoch: Optional[Callable[[int], bool]] = None
                 ) -> Dict[str, Any]:
    """Up to ``epochs`` epochs of :func:`train_steps`: each in train mode over the batches of a
    fresh ``epoch_batches()`` (drawn when the epoch starts), one ``loop.step(loss(batch))`` per
    batch; ``after_epoch(epoch)`` (from 0) stops the training by returning True. Returns
    :meth:`TrainingLoop.finish`'s info (the model is left in eval mode)."""
    for epoch in range(epochs):
        model.train()
        train_steps(lambda batch: loop.step(loss(batch)), epoch_batches())
        if after_epoch is not None and after_epoch(epoch):
            break
    return loop.finish(model)
