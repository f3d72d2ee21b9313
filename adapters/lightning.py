r"""Geodesic sharpness tracked during a Lightning run (needs ``lightning``: the ``lightning`` extra).

:class:`LightningSharpnessCallback` is the Lightning face of
:class:`~quotient_manifolds.adapters.monitor.SharpnessMonitor`: every ``every_n_steps`` optimizer
steps and/or after each validation it measures sharpness on held batches (the model in eval mode,
its flags, gradients and the random generators restored after: the run is unchanged), and hands the
metrics (``sharpness/<geometry>``, ``…/rho``, ``…/initial_loss``, ``…/seconds``) to every logger of
the Trainer (``logger.log_metrics``: TensorBoard, CSV, W&B …; Lightning's loggers write on rank zero
only). Under DDP the held batches are spread over the ranks, as in the Hugging Face callback.

Geodesic SAM needs two backward passes per update, so it runs with Lightning's manual optimization:
return :class:`~quotient_manifolds.adapters.GeodesicSAM` from ``configure_optimizers`` and step it
with a closure (forward + ``manual_backward``) through ``self.optimizers().step(closure=...)``:
GeodesicSAM calls it at w and at w_adv, and Lightning counts one optimizer step (the guide has the
example).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
from typing_extensions import Unpack

from quotient_manifolds._validation import flag, integer_at_least
from quotient_manifolds.errors import InvalidArgument

from .monitor import DEFAULT_GEOMETRIES, SharpnessMonitor
from .options import PerGeometryKwargs

__all__ = ["LightningSharpnessCallback"]


class LightningSharpnessCallback(pl.Callback):
    r"""Track geodesic (and adaptive) sharpness during ``lightning.pytorch.Trainer.fit``.

    Parameters
    ----------
    batches: the held batches, as for :func:`~quotient_manifolds.adapters.sharpness` (``(inputs, targets)``
        pairs evaluated as ``model(inputs)`` with ``loss_fn``, or dict batches; the model measured is
        the LightningModule itself, so its ``forward`` must return what the loss reads).
    geometries: default ``("geodesic-inv", "adaptive")``.
    every_n_steps: measure after every n-th optimizer step (``trainer.global_step % n == 0``).
    at_validation: also measure after each validation loop (not during the sanity check).
    rho, target_loss_rise: exactly one (as :class:`~quotient_manifolds.adapters.monitor.SharpnessMonitor`).
    sharpness_options: options of :func:`~quotient_manifolds.adapters.sharpness`.

    Raises
    ------
    TypeError, ValueError
        An unknown geometry or option, neither or both of ``rho`` and ``target_loss_rise``, no
        moment to measure at, an empty set of batches.

    Examples
    --------
    >>> import lightning.pytorch as pl, torch
    >>> from quotient_manifolds import adapters
    >>> class Module(pl.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                                     batch_first=True)
    ...     def forward(self, x):
    ...         return self.net(x)
    ...     def training_step(self, batch, batch_idx):
    ...         return torch.nn.functional.mse_loss(self(batch[0]), batch[1])
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> _ = torch.manual_seed(0)
    >>> x, y = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    >>> callback = adapters.LightningSharpnessCallback([(x, y)], every_n_steps=1, rho=0.1,
    ...                                                loss_fn=torch.nn.functional.mse_loss, n_iters=2)
    >>> trainer = pl.Trainer(max_steps=2, callbacks=[callback], accelerator="cpu", logger=False,
    ...                      enable_checkpointing=False, enable_progress_bar=False,
    ...                      enable_model_summary=False)
    >>> trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3))
    >>> [step for step, metrics in callback.monitor.history]
    [1, 2]
    """

    def __init__(self, batches: Iterable[Any], *, geometries: Sequence[str] = DEFAULT_GEOMETRIES,
                 every_n_steps: Optional[int] = None, at_validation: bool = False,
                 rho: Union[None, float, Mapping[str, float]] = None,
                 target_loss_rise: Optional[float] = None,
                 **sharpness_options: Unpack[PerGeometryKwargs]) -> None:
        super().__init__()
        if every_n_steps is not None:
            integer_at_least("every_n_steps", every_n_steps, 1)
        self.every_n_steps = every_n_steps
        self.at_validation = flag("at_validation", at_validation)
        if every_n_steps is None and not at_validation:
            raise InvalidArgument("the callback would never measure: pass every_n_steps=N or at_validation=True")
        self.monitor = SharpnessMonitor(batches, geometries=geometries, rho=rho,
                                        target_loss_rise=target_loss_rise, **sharpness_options)
        self._last_step: Optional[int] = None

    def _measure(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        step = trainer.global_step
        if self._last_step == step:
            return
        self._last_step = step
        metrics = self.monitor.measure(pl_module, step=step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0:
            self._measure(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.at_validation and not trainer.sanity_checking:
            self._measure(trainer, pl_module)
