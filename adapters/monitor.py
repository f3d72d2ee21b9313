r"""Sharpness tracked during training: the measurement that the training-loop callbacks run.

:class:`SharpnessMonitor` measures worst-case sharpness in one or more geometries on a fixed set of
held batches, at whatever moments a training loop chooses (the Hugging Face callback of
:mod:`quotient_manifolds.adapters.integrations`, a Lightning callback, or a hand-written loop), and
returns the numbers as a flat dict of scalars ready for any logger:

* ``sharpness/<geometry>``: the worst-case loss rise max_{‖ξ‖ ≤ ρ} L(w ⊕ ξ) − L(w), averaged over
  the held batches (:func:`~quotient_manifolds.adapters.sharpness`), in the loss's units (nats);
* ``sharpness/<geometry>/rho``: the radius ρ it was measured at;
* ``sharpness/<geometry>/initial_loss``: L(w) on the held batches (mean over batches);
* ``sharpness/<geometry>/seconds``: the wall time of the measurement.

**ρ.** Give it (``rho=``, one number or one per geometry), or give ``target_loss_rise=``: ρ is
then calibrated per geometry at the first measurement (:func:`~quotient_manifolds.adapters.calibrate_rho`,
a few sharpness runs) and kept fixed afterwards, so that the values along training are at one ball
and comparable with each other.

**Training is left as it was.** A measurement runs the model in eval mode (every submodule's own
flag restored after), writes no ``.grad`` (the gradients the loop holds are put back as they were,
the same tensors), and restores the random-number generators it may touch (torch's CPU and CUDA
generators, Python's ``random``, NumPy's global generator): training with and without the monitor
gives bit-identical weights.

**Many processes.** Under ``torch.distributed`` (e.g. DistributedDataParallel) with more than one
rank, the held batches are spread over the ranks (:func:`~quotient_manifolds.adapters.distributed_sharpness`):
every rank must call :meth:`SharpnessMonitor.measure` with the same held batches, and every rank
returns the same numbers. The calibration of ρ (once) runs on every rank on all the held batches,
with the same result on each. A model sharded with FSDP2 (``fully_shard``) is measured by
:func:`~quotient_manifolds.adapters.sharpness`'s sharded path, which runs collectives on every rank
(each rank gets the value of all the held batches).
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from typing_extensions import Unpack
from torch import nn

from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

from . import validation as check
from .ball import geometry_of
from .calibration import RhoCalibration, calibrate_rho
from .distributed import distributed_sharpness
from .modes import eval_mode
from .options import PerGeometryKwargs, SharpnessOptions, as_rho, renamed_options
from .sharded import is_sharded
from .worst_case import SharpnessResult, sharpness

__all__ = ["SharpnessMonitor", "preserved_training_state", "metric_name"]

#: the geometries tracked by default: the symmetry-aware one and the one it corrects
DEFAULT_GEOMETRIES = ("geodesic-inv", "adaptive")


def metric_name(geometry: str, field: Optional[str] = None) -> str:
    """The logged name of ``geometry``'s sharpness (``"sharpness/geodesic-inv"``), or of one of its
    companions (``field`` = ``"rho"``, ``"initial_loss"``, ``"seconds"``)."""
    return f"sharpness/{geometry}" if field is None else f"sharpness/{geometry}/{field}"


@contextlib.contextmanager
def preserved_training_state(model: nn.Module) -> Iterator[None]:
    """Run the block with ``model`` in eval mode, then put back what a training loop holds: every
    submodule's ``training`` flag, each parameter's ``.grad`` (the same tensor object, or ``None``),
    and the states of torch's CPU and (initialised) CUDA generators, Python's ``random`` and
    NumPy's global generator. Also when the block raises."""
    grads = [(p, p.grad) for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    python_rng = random.getstate()
    numpy_rng = np.random.get_state()
    try:
        with eval_mode(model):
            yield
    finally:
        for p, g in grads:
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)


class SharpnessMonitor:
    r"""Worst-case sharpness of a model in training, measured on fixed held batches (module docstring).

    Parameters
    ----------
    batches: the held batches (a list, or any iterable, read once and kept): as for
        :func:`~quotient_manifolds.adapters.sharpness` — ``(inputs, targets)`` pairs or Hugging Face dict batches
        (``model(**batch)``, the model's own loss). They are moved to the model's device at each
        measurement. A few batches of the validation set is the usual choice.
    geometries: the geometries to measure (default ``("geodesic-inv", "adaptive")``); each of
        :data:`~quotient_manifolds.adapters.GEOMETRIES`.
    rho: the radius, one number for every geometry or a dict {geometry: radius}. Exclusive with
        ``target_loss_rise``.
    target_loss_rise: calibrate ρ per geometry at the first measurement so that the worst-case loss
        rise equals this many nats (:func:`~quotient_manifolds.adapters.calibrate_rho`), then keep it.
    sharpness_options: the options of :func:`~quotient_manifolds.adapters.sharpness` (``n_iters``,
        ``loss_fn``, ``retraction``, ``progress`` …; not ``geometry`` or ``measure``:
        :class:`~quotient_manifolds.adapters.options.PerGeometryKwargs`), used for the
        calibration and every measurement.

    Attributes
    ----------
    rhos: {geometry: ρ} (filled at the first measurement when calibrating).
    calibrations: {geometry: :class:`~quotient_manifolds.adapters.RhoCalibration`} when calibrating.
    history: every measurement so far, as (step, metrics) pairs.
    last_results: {geometry: :class:`~quotient_manifolds.adapters.SharpnessResult`} of the last measurement.

    Raises
    ------
    TypeError / ValueError: an unknown geometry or option, neither or both of ``rho`` and
        ``target_loss_rise``, an empty set of batches.

    Examples
    --------
    In a training loop, ``monitor.measure(model, step=step)`` every few hundred steps:

    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> held = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> monitor = adapters.SharpnessMonitor(held, geometries=["geodesic-inv", "adaptive"], rho=0.1,
    ...                                     loss_fn=torch.nn.MSELoss(), n_iters=3)
    >>> metrics = monitor.measure(model, step=0)
    >>> sorted(name for name in metrics if not name.endswith("seconds"))   # doctest: +NORMALIZE_WHITESPACE
    ['sharpness/adaptive', 'sharpness/adaptive/initial_loss', 'sharpness/adaptive/rho',
     'sharpness/geodesic-inv', 'sharpness/geodesic-inv/initial_loss', 'sharpness/geodesic-inv/rho']
    >>> round(metrics["sharpness/geodesic-inv"], 3), monitor.history[0][0]
    (0.108, 0)
    """

    def __init__(self, batches: Iterable[Any], *, geometries: Sequence[str] = DEFAULT_GEOMETRIES,
                 rho: Union[None, float, Mapping[str, float]] = None,
                 target_loss_rise: Optional[float] = None,
                 **sharpness_options: Unpack[PerGeometryKwargs]) -> None:
        check.batches("batches", batches)
        self.batches = list(batches)
        if not self.batches:
            raise InvalidArgument("batches is empty: pass the held batches to measure on (e.g. a few "
                                  "batches of the validation set)")
        self.geometries = tuple(geometry_of(g).name for g in check.names("geometries", geometries))
        if len(set(self.geometries)) != len(self.geometries):
            raise InvalidArgument(f"geometries names one geometry twice: {list(self.geometries)}")
        for reserved in ("geometry", "measure", "rho"):
            if reserved in sharpness_options:
                raise InvalidArgumentType(f"{reserved}= is set by the monitor (geometries=, rho= / "
                                          f"target_loss_rise=), not a sharpness option to pass it")
        # a former spelling warned about here, once; an unknown option refused here, not at step 1000
        self.options = renamed_options(sharpness_options)
        SharpnessOptions.from_keywords(self.options)
        if (rho is None) == (target_loss_rise is None):
            raise InvalidArgumentType("give exactly one of rho= (the radius: a number, or {geometry: radius}) "
                                      "and target_loss_rise= (calibrate rho per geometry at the first "
                                      "measurement, e.g. target_loss_rise=0.1)")
        self.target_loss_rise = (None if target_loss_rise is None
                                 else check.positive_finite("target_loss_rise", target_loss_rise))
        self.rhos: Dict[str, float] = {}
        if isinstance(rho, Mapping):
            missing = [g for g in self.geometries if g not in rho]
            extra = [g for g in rho if g not in self.geometries]
            if missing or extra:
                raise InvalidArgument(f"rho= as a dict needs one radius per geometry of {list(self.geometries)}; "
                                      f"missing {missing}, not measured {extra}")
            self.rhos = {g: as_rho(rho[g], f"rho[{g!r}]") for g in self.geometries}
        elif rho is not None:
            self.rhos = {g: as_rho(rho) for g in self.geometries}
        self.calibrations: Dict[str, RhoCalibration] = {}
        self.history: List[Tuple[Optional[int], Dict[str, float]]] = []
        self.last_results: Dict[str, SharpnessResult] = {}

    def measure(self, model: nn.Module, step: Optional[int] = None) -> Dict[str, float]:
        """Measure every geometry on the held batches (calibrating ρ first, the first time, when
        ``target_loss_rise`` was given); returns the metrics (module docstring) and appends them
        to :attr:`history` with ``step``. The model's mode, gradients and the random generators
        are as they were afterwards (:func:`preserved_training_state`).

        Parameters
        ----------
        model:
            The model in training (left as it was).
        step:
            The training step, recorded with the metrics.

        Returns
        -------
        dict
            ``{"sharpness/<geometry>": value, ".../rho", ".../initial_loss", ".../seconds"}``.

        Raises
        ------
        TypeError
            ``model`` is not an ``nn.Module``.
        ValueError
            As :func:`~quotient_manifolds.adapters.sharpness` on the held batches.

        Examples
        --------
        See the class's example.
        """
        check.module("model", model)
        metrics: Dict[str, float] = {}
        with preserved_training_state(model):
            for geometry in self.geometries:
                if geometry not in self.rhos:
                    cal = calibrate_rho(model, self.batches, geometry=geometry,
                                        target_loss_rise=self.target_loss_rise, **self.options)
                    self.calibrations[geometry] = cal
                    self.rhos[geometry] = cal.rho
                started = time.perf_counter()
                result = self._measure_one(model, geometry)
                self.last_results[geometry] = result
                metrics[metric_name(geometry)] = float(result.value)
                metrics[metric_name(geometry, "rho")] = float(result.rho)
                metrics[metric_name(geometry, "initial_loss")] = float(np.mean(result.init_losses))
                metrics[metric_name(geometry, "seconds")] = time.perf_counter() - started
        self.history.append((step, dict(metrics)))
        return metrics

    def _measure_one(self, model: nn.Module, geometry: str) -> SharpnessResult:
        import torch.distributed as dist

        rho = self.rhos[geometry]
        spread = (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
                  and not is_sharded(model))
        if spread:
            return distributed_sharpness(model, self.batches, geometry=geometry, rho=rho, **self.options)
        return sharpness(model, self.batches, geometry=geometry, rho=rho, **self.options)

    def __repr__(self) -> str:
        radius = (f"target_loss_rise={self.target_loss_rise:g}" if self.target_loss_rise is not None
                  else f"rho={self.rhos}")
        return (f"SharpnessMonitor(geometries={list(self.geometries)}, {radius}, "
                f"{len(self.batches)} held batch(es), {len(self.history)} measurement(s))")
