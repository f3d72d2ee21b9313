r"""Geodesic sharpness and geodesic SAM inside the Hugging Face ``Trainer`` (needs the ``hf`` extra).

* :class:`SharpnessCallback`: a ``TrainerCallback`` that measures sharpness on held batches every
  ``every_n_steps`` optimizer steps and/or at each evaluation (a
  :class:`~quotient_manifolds.adapters.monitor.SharpnessMonitor`), and logs it through
  ``Trainer.log``, so that every reporter of ``report_to`` (TensorBoard, W&B, CSV, the console)
  and ``trainer.state.log_history`` receive ``sharpness/<geometry>``, its ``rho``,
  ``initial_loss`` and ``seconds``.
* :class:`GeodesicSAMTrainer`: a ``Trainer`` whose updates are :class:`~quotient_manifolds.adapters.GeodesicSAM`
  steps around the optimizer the Trainer builds (AdamW by default, with its weight-decay groups
  and learning-rate schedule).

Under the Trainer's DistributedDataParallel the callback spreads the held batches over the ranks
(every rank gets the value of all of them) and only process zero's reporters write it; under FSDP2
(``fully_shard``) :func:`~quotient_manifolds.adapters.sharpness` runs its sharded path on every
rank. The Trainer's FSDP1 wrapper (``fsdp=`` in ``TrainingArguments`` without
``fsdp_version=2``) holds flattened parameters, on which no attention block can be found:
measure a checkpoint instead (``quotient-manifolds sharpness CHECKPOINT_DIR``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Union

import torch
from typing_extensions import Unpack
import transformers
from torch import nn

from quotient_manifolds._validation import flag, integer_at_least
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UsageError

from .ball import geometry_of
from .monitor import DEFAULT_GEOMETRIES, SharpnessMonitor
from .options import PerGeometryKwargs, as_rho
from .sam import SAM_GEOMETRIES, GeodesicSAM

__all__ = ["SharpnessCallback", "GeodesicSAMTrainer"]


class SharpnessCallback(transformers.TrainerCallback):
    r"""Track geodesic (and adaptive) sharpness during ``Trainer.train()``.

    The measurement is :meth:`SharpnessMonitor.measure <quotient_manifolds.adapters.monitor.SharpnessMonitor.measure>`:
    worst-case sharpness on the held batches, the model in eval mode for it and, after it, the
    model's train/eval flags, its gradients and the random generators restored, so the training
    run is bit-identical with and without the callback. The numbers go through ``trainer.log``:
    ``sharpness/<geometry>`` (the worst-case loss rise at ρ, in nats), ``sharpness/<geometry>/rho``,
    ``sharpness/<geometry>/initial_loss`` and ``sharpness/<geometry>/seconds``.

    Parameters
    ----------
    trainer: the ``transformers.Trainer`` it is added to (the callback logs through it); add it
        with ``trainer.add_callback(callback)``.
    batches: the held batches: dict batches with ``labels`` (the model's own loss), e.g.
        ``[trainer.data_collator(rows[i:i + 16]) for i in range(0, 64, 16)]``, or
        ``(inputs, targets)`` pairs. Build them with the collator rather than by iterating a
        ``DataLoader``: starting a DataLoader's iterator draws from torch's generator, which
        changes the training run that follows.
    geometries: default ``("geodesic-inv", "adaptive")``.
    every_n_steps: measure after every n-th optimizer step (``state.global_step % n == 0``);
        ``None``: not by steps.
    at_evaluation: also measure at each evaluation (``on_evaluate``).
    at_train_begin: also measure before the first step (step 0, or the step resumed from).
    rho, target_loss_rise: exactly one: the radius (a number or {geometry: radius}), or the loss
        rise that ρ is calibrated to, once, at the first measurement.
    sharpness_options: options of :func:`~quotient_manifolds.adapters.sharpness` (``n_iters``,
        ``loss_fn`` …).

    Raises
    ------
    TypeError / ValueError: no trainer, an unknown geometry or option, no moment to measure at.

    Examples
    --------
    A tiny BERT from a config, trained two steps, measured after each:

    >>> import tempfile, torch, transformers
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> config = transformers.BertConfig(vocab_size=10, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
    ...                                  intermediate_size=8, max_position_embeddings=8, num_labels=2)
    >>> model = transformers.BertForSequenceClassification(config).double()
    >>> rows = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor(i % 2)} for i in range(4)]
    >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2,
    ...                                       report_to=[], use_cpu=True, save_strategy="no")
    >>> trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    >>> held = [trainer.data_collator(rows[:2])]
    >>> trainer.add_callback(adapters.SharpnessCallback(trainer, held, every_n_steps=1, rho=0.1, n_iters=2))
    >>> _ = trainer.train()                             # doctest: +ELLIPSIS
    {...}
    >>> [entry["sharpness/geodesic-inv/rho"] for entry in trainer.state.log_history
    ...  if "sharpness/geodesic-inv" in entry]
    [0.1, 0.1]
    """

    def __init__(self, trainer: "transformers.Trainer", batches: Iterable[Any], *,
                 geometries: Sequence[str] = DEFAULT_GEOMETRIES, every_n_steps: Optional[int] = None,
                 at_evaluation: bool = False, at_train_begin: bool = False,
                 rho: Union[None, float, Mapping[str, float]] = None,
                 target_loss_rise: Optional[float] = None,
                 **sharpness_options: Unpack[PerGeometryKwargs]) -> None:
        if not isinstance(trainer, transformers.Trainer):
            raise InvalidArgumentType(f"SharpnessCallback needs the transformers.Trainer it logs through, got "
                                      f"{type(trainer).__name__}: SharpnessCallback(trainer, held_batches, ...), "
                                      f"then trainer.add_callback(callback)")
        self.trainer = trainer
        if every_n_steps is not None:
            integer_at_least("every_n_steps", every_n_steps, 1)
        self.every_n_steps = every_n_steps
        self.at_evaluation = flag("at_evaluation", at_evaluation)
        self.at_train_begin = flag("at_train_begin", at_train_begin)
        if every_n_steps is None and not at_evaluation and not at_train_begin:
            raise InvalidArgument("the callback would never measure: pass every_n_steps=N, "
                                  "at_evaluation=True or at_train_begin=True")
        self.monitor = SharpnessMonitor(batches, geometries=geometries, rho=rho,
                                        target_loss_rise=target_loss_rise, **sharpness_options)
        self._last_step: Optional[int] = None

    def _measure(self, state, model: Optional[nn.Module]) -> None:
        if self._last_step == state.global_step:      # e.g. a step that is also an evaluation
            return
        self._last_step = state.global_step
        metrics = self.monitor.measure(model if model is not None else self.trainer.model,
                                       step=state.global_step)
        self.trainer.log(dict(metrics))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self not in self.trainer.callback_handler.callbacks:
            raise UsageError("this SharpnessCallback was built with another Trainer than the one "
                             "running it: build it with the trainer it is added to")
        if self.at_train_begin:
            self._measure(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps is not None and state.global_step % self.every_n_steps == 0:
            self._measure(state, model)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if self.at_evaluation:
            self._measure(state, model)


class _TrainerGeodesicSAM(GeodesicSAM):
    """GeodesicSAM whose ``step()`` without a closure is :meth:`second_step`: the Trainer calls
    ``optimizer.step()`` after :meth:`GeodesicSAMTrainer.training_step` took the first step."""

    def step(self, closure=None):
        if closure is None:
            self.second_step()
            return None
        return super().step(closure)


class GeodesicSAMTrainer(transformers.Trainer):
    r"""A ``transformers.Trainer`` whose updates are geodesic SAM steps.

    The optimizer the Trainer would build (``optim=`` of ``TrainingArguments``: AdamW by default,
    with its weight-decay groups; or ``optimizers=``) becomes the base optimizer of a
    :class:`~quotient_manifolds.adapters.GeodesicSAM`, and each training step runs the two passes of SAM:

        ∇L(w) (forward + backward),  w ← w_adv = R_w(ρ g/‖g‖)  (first_step),
        ∇L(w_adv) (forward + backward),  w restored, base step with ∇L(w_adv)  (second_step).

    The logged loss is L(w); :attr:`perturbed_loss` holds the last step's L(w_adv) (a detached
    tensor: the SAM objective). The ascent step is invariant under the per-head GL reparametrisations
    of the attention blocks (:class:`~quotient_manifolds.adapters.GeodesicSAM`); gradient clipping
    (``max_grad_norm``) clips ∇L(w_adv), and the learning-rate schedule drives the base optimizer.
    Checkpoints hold the base optimizer's state (``GeodesicSAM.state_dict``), so ``train(
    resume_from_checkpoint=...)`` works as usual.

    Parameters
    ----------
    sam_rho: the SAM radius ρ in the geometry's norm (default 0.05).
    sam_geometry: ``"geodesic-mix"`` (default), ``"geodesic-inv"``, ``"adaptive"`` or ``"sam"``.
    sam_options: further keywords of :class:`~quotient_manifolds.adapters.GeodesicSAM`
        (``retraction``, ``gram_eps``, ``layout`` …).
    *args, **kwargs: those of ``transformers.Trainer``.

    Raises
    ------
    ValueError: ``gradient_accumulation_steps > 1`` (both SAM passes need the whole batch's
        gradient before the ascent; use a larger ``per_device_train_batch_size``) or ``fp16=True``
        (use ``bf16=True``, or ``GeodesicSAM`` with a ``GradScaler`` in your own loop).

    Examples
    --------
    A tiny BERT from a config, two SAM steps:

    >>> import tempfile, torch, transformers
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> config = transformers.BertConfig(vocab_size=10, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
    ...                                  intermediate_size=8, max_position_embeddings=8, num_labels=2)
    >>> model = transformers.BertForSequenceClassification(config).double()
    >>> rows = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor(i % 2)} for i in range(4)]
    >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2,
    ...                                       report_to=[], use_cpu=True, save_strategy="no")
    >>> trainer = adapters.GeodesicSAMTrainer(model=model, args=args, train_dataset=rows, sam_rho=0.05,
    ...                                       sam_geometry="geodesic-mix")
    >>> trainer.train().global_step                     # doctest: +ELLIPSIS
    {...}
    2
    >>> trainer.perturbed_loss.dtype                    # L(w_adv) of the last step
    torch.float64
    """

    def __init__(self, *args: Any, sam_rho: float = 0.05, sam_geometry: str = "geodesic-mix",
                 sam_options: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise InvalidArgument(f"GeodesicSAMTrainer needs gradient_accumulation_steps=1 (got "
                                  f"{self.args.gradient_accumulation_steps}): the ascent step needs the "
                                  f"whole batch's gradient before the second pass; raise "
                                  f"per_device_train_batch_size instead")
        if self.args.fp16:
            raise InvalidArgument("GeodesicSAMTrainer does not support fp16=True (the loss scaler would "
                                  "unscale the gradients twice per step): use bf16=True")
        if sam_options is not None and not isinstance(sam_options, Mapping):
            raise InvalidArgumentType(f"sam_options must be a dict of GeodesicSAM keywords, got {sam_options!r}")
        # checked now, not when the Trainer builds the optimizer at train()
        self.sam_rho = as_rho(sam_rho, "sam_rho")
        self.sam_geometry = geometry_of(sam_geometry, SAM_GEOMETRIES, "sam_geometry").name
        self.sam_options = dict(sam_options or {})
        #: the loss at the perturbed weights w_adv of the last training step (``None`` before it)
        self.perturbed_loss: Optional[torch.Tensor] = None

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """The Trainer's optimizer, wrapped in :class:`~quotient_manifolds.adapters.GeodesicSAM` (once)."""
        base = super().create_optimizer(*args, **kwargs)
        if not isinstance(base, GeodesicSAM):
            self.optimizer = _TrainerGeodesicSAM(self.model, base, rho=self.sam_rho,
                                                 geometry=self.sam_geometry, **self.sam_options)
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: Dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """The two SAM passes: the loss and gradient at w, the ascent (``first_step``), the
        gradient at w_adv; the Trainer's ``optimizer.step()`` is then ``second_step``."""
        # accelerate wraps the optimizer (AcceleratedOptimizer.optimizer is the one built here)
        sam = getattr(self.optimizer, "optimizer", self.optimizer)
        if not isinstance(sam, GeodesicSAM):
            raise UsageError("GeodesicSAMTrainer's optimizer is not a GeodesicSAM: "
                             "create_optimizer wraps the Trainer's (or the one given with "
                             "optimizers=); do not replace trainer.optimizer after it is built")
        # transformers < 4.46 has no num_items_in_batch (and never passes it)
        extra = () if num_items_in_batch is None else (num_items_in_batch,)
        loss = super().training_step(model, inputs, *extra)
        sam.first_step(zero_grad=True)
        try:
            self.perturbed_loss = super().training_step(model, inputs, *extra)
        except BaseException:
            sam._restore()   # the weights back at w before the error leaves
            raise
        return loss
