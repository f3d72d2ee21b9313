r"""Choosing the sharpness radius ρ: calibrate it per geometry to a target loss rise.

Worst-case sharpness is the largest loss rise in a ball of radius ρ,

    S(ρ) = max_{‖ξ‖ ≤ ρ} L(w ⊕ ξ) − L(w),

and the ball's norm differs between geometries: the adaptive norm (elementwise c = |w|) and the
invariant metric ``"inv"`` are scale-free, the ``"mix"`` metric is not (its ρ has units of the
weights). The same number ρ is therefore a different ball in each geometry (on one small
Llama-architecture model at ρ = 0.05 the adaptive loss rise was 0.0023 nats, the mix one 0.27), and sharpness values of
different geometries are comparable only at a matched loss rise. :func:`calibrate_rho` finds, per
geometry, the ρ at which the model's worst-case loss rise equals a target (the studies use 3 nats
over a pilot of models; any value in the regime you care about works, e.g. 0.1 nats for a local,
nearly quadratic probe).

Root finding (:func:`find_rho`): S(ρ) increases with ρ, and S ∝ ρ² near a minimum. Starting at
``start``, step by (target/S)^{1/2} (at most ×10 per step) until the target is bracketed, then
regula falsi in (log ρ, log S) inside the bracket, each new ρ kept at least 10 % of the bracket's
log-width away from its ends, until |log(S/target)| ≤ log(tolerance) or ``max_evals``
evaluations. A non-finite loss counts as "above the target". The returned root is the log–log
interpolation inside the final bracket (else the closest evaluation corrected with slope 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from typing_extensions import Unpack

from quotient_manifolds._validation import integer_at_least
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

from . import validation as check
from .ball import geometry_of
from .options import GeometryName, PerGeometryKwargs, SharpnessOptions, document_options
from .worst_case import run_sharpness

__all__ = ["RhoCalibration", "calibrate_rho", "find_rho", "root_estimate", "interpolate_at"]


def _loglog(a: Tuple[float, float], b: Tuple[float, float], target: float) -> float:
    """log ρ where the line through (log ρ, log S) of a and b reaches log target."""
    (ra, sa), (rb, sb) = a, b
    la, lb = math.log(sa), math.log(sb)
    if la == lb:
        return 0.5 * (math.log(ra) + math.log(rb))
    return math.log(ra) + (math.log(target) - la) * (math.log(rb) - math.log(ra)) / (lb - la)


def _bracket(evals: Sequence[Tuple[float, float]], target: float):
    """(largest ρ below the target, smallest ρ at or above it, non-finite counting as above)."""
    below = [(r, s) for r, s in evals if math.isfinite(s) and s < target]
    above = [(r, s) for r, s in evals if not (math.isfinite(s) and s < target)]
    lo = max(below, key=lambda e: e[0]) if below else None
    hi = min(above, key=lambda e: e[0]) if above else None
    return lo, hi


def root_estimate(evals: Sequence[Tuple[float, float]], target: float) -> float:
    """ρ with S(ρ) = target from evaluations [(ρ, S(ρ))]: log–log interpolation in the tightest
    bracket, else the evaluation closest to the target corrected with S ∝ ρ² (NaN if no
    evaluation is finite and positive)."""
    lo, hi = _bracket(evals, target)
    if lo is not None and hi is not None and lo[1] > 0 and math.isfinite(hi[1]) and lo[0] < hi[0]:
        return float(math.exp(_loglog(lo, hi, target)))
    ok = [(r, s) for r, s in evals if math.isfinite(s) and s > 0]
    if not ok:
        return float("nan")
    r, s = min(ok, key=lambda e: abs(math.log(e[1] / target)))
    return float(r * math.sqrt(target / s))


def find_rho(f: Callable[[float], float], start: float, target: float, *,
             tolerance: float = 1.25, max_evals: int = 7, max_factor: float = 10.0
             ) -> Dict[str, Any]:
    """ρ with f(ρ) ≈ target for an increasing f (safeguarded secant in log–log; module docstring).

    Parameters
    ----------
    f: increasing function of ρ > 0 (a loss rise); a non-finite value counts as above the target.
    start: first ρ tried (> 0).
    target: the value of f sought (> 0).
    tolerance: stop when f(ρ)/target lies in [1/tolerance, tolerance] (> 1).
    max_evals: at most this many evaluations of f.
    max_factor: largest factor between consecutive ρ while the target is not yet bracketed.

    Returns a dict with ``root`` (the estimate, :func:`root_estimate`), ``evals`` ([ρ, f(ρ)] in
    the order evaluated) and ``converged`` (some evaluation within the tolerance factor).
    """
    if not (start > 0 and target > 0 and tolerance > 1 and max_evals >= 1):
        raise InvalidArgument(f"find_rho needs start > 0, target > 0, tolerance > 1, max_evals ≥ 1; "
                              f"got {start}, {target}, {tolerance}, {max_evals}")
    evals: List[Tuple[float, float]] = []
    rho = float(start)
    converged = False
    for _ in range(max_evals):
        s = float(f(rho))
        evals.append((rho, s))
        if math.isfinite(s) and s > 0 and abs(math.log(s / target)) <= math.log(tolerance):
            converged = True
            break
        lo, hi = _bracket(evals, target)
        if lo is not None and hi is not None and lo[0] < hi[0]:
            a, b = math.log(lo[0]), math.log(hi[0])
            x = _loglog(lo, hi, target) if (lo[1] > 0 and math.isfinite(hi[1])) else 0.5 * (a + b)
            x = min(max(x, a + 0.1 * (b - a)), b - 0.1 * (b - a))
            rho = math.exp(x)
        elif lo is not None and (hi is None or lo[0] >= hi[0]):
            step = math.sqrt(target / lo[1]) if lo[1] > 0 else max_factor
            rho = lo[0] * min(max(step, 1.2), max_factor)
        else:
            step = math.sqrt(hi[1] / target) if math.isfinite(hi[1]) else max_factor
            rho = hi[0] / min(max(step, 1.2), max_factor)
    return dict(root=root_estimate(evals, target), evals=[list(e) for e in evals],
                converged=converged)


def interpolate_at(evals: Sequence[Sequence[float]], rho: float) -> float:
    """S(ρ) by log–log interpolation of evaluations [(ρ, S)] (slope 2 outside their range)."""
    ok = sorted((float(r), float(s)) for r, s in evals if math.isfinite(s) and s > 0)
    if not ok:
        return float("nan")
    lr = [math.log(r) for r, _ in ok]
    ls = [math.log(s) for _, s in ok]
    x = math.log(rho)
    if x <= lr[0]:
        return float(math.exp(ls[0] + 2 * (x - lr[0])))
    if x >= lr[-1]:
        return float(math.exp(ls[-1] + 2 * (x - lr[-1])))
    return float(math.exp(np.interp(x, lr, ls)))


@dataclass
class RhoCalibration:
    """Result of :func:`calibrate_rho`.

    ``rho``: the radius to use (the evaluated ρ whose loss rise met the target when converged,
    else the log–log root estimate); ``loss_rise``: the measured worst-case loss rise at ``rho``
    (NaN if ``rho`` was estimated and not evaluated); ``evals``: every (ρ, loss rise) evaluated, in
    order; ``converged``: some evaluation within the tolerance factor of the target.

    Attributes
    ----------
    geometry, target_loss_rise:
        As passed to :func:`calibrate_rho`.
    rho, loss_rise, converged, evals:
        As described above.


    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> cal = adapters.calibrate_rho(model, batches, geometry="geodesic-mix", target_loss_rise=0.05,
    ...                              loss_fn=torch.nn.MSELoss(), n_iters=5)
    >>> cal.converged, cal.rho, round(cal.loss_rise, 3), len(cal.evals)
    (True, 0.05, 0.058, 1)
    """

    geometry: str
    target_loss_rise: float
    rho: float
    loss_rise: float
    converged: bool
    evals: List[Tuple[float, float]] = field(default_factory=list)


@document_options
def calibrate_rho(model: torch.nn.Module, batches: Iterable[Any], *, geometry: GeometryName,
                  target_loss_rise: float, rho_start: Optional[float] = None,
                  tolerance: float = 1.25, max_evals: int = 7,
                  **sharpness_options: Unpack[PerGeometryKwargs]) -> RhoCalibration:
    r"""The radius ρ at which the worst-case loss rise of ``model`` on ``batches`` in ``geometry``
    equals ``target_loss_rise``.

    How to choose ρ: the radius means something different in every geometry (the adaptive and inv
    norms are scale-free, the mix metric is not), so pick the *loss rise* instead — the size of
    the perturbation's effect, in the loss's own units (nats for cross-entropy) — and let this
    function find each geometry's ρ for it. Sharpness values of different geometries, or of
    models compared under one geometry's fixed ρ, are comparable only at a matched loss rise.

    Each evaluation is one worst-case :func:`~quotient_manifolds.adapters.sharpness` run (Auto-PGD over all
    ``batches``); the search (:func:`find_rho`) needs 2–5 on a smooth loss. Pass the options you
    will measure with (``n_iters``, ``gram_eps``, ``retraction``, ``loss_fn``, …) as keywords: the
    calibrated ρ is for those.

    The search stops at the first ρ whose loss rise is within a *factor* ``tolerance`` of the
    target, so the rise at the returned ρ is not the target itself: with the default
    ``tolerance=1.25``, ``target_loss_rise=0.1`` returns a ρ whose rise lies anywhere in
    [0.08, 0.125] (``result.loss_rise`` says where). To come closer, pass a smaller factor, e.g.
    ``tolerance=1.05`` for [0.095, 0.105], and allow more runs (``max_evals=10``): each step
    of the search is one more sharpness run.

    Parameters
    ----------
    model, batches: as for :func:`~quotient_manifolds.adapters.sharpness` (``batches`` is re-iterated: a list).
    geometry: ``"adaptive"``, ``"geodesic-inv"`` or ``"geodesic-mix"``.
    target_loss_rise: the worst-case loss rise S(ρ) = max L(w ⊕ ξ) − L(w) sought (> 0).
    rho_start: first radius tried (default: the geometry's ``rho_start``,
        :data:`~quotient_manifolds.adapters.ball.GEOMETRY_TABLE`, 0.05 for mix and 0.1 otherwise: a
        few evaluations from most models' answer).
    tolerance: accept ρ when S(ρ)/target lies in [1/tolerance, tolerance] (a factor > 1; default
        1.25, i.e. within −20 % / +25 % of the target).
    max_evals: at most this many sharpness runs (default 7); when none was within the tolerance,
        ``converged`` is False and ``rho`` is the log–log estimate of the root.
    sharpness_options: the options of :func:`~quotient_manifolds.adapters.sharpness` but
        ``geometry``, ``measure`` and ``rho``
        (:class:`~quotient_manifolds.adapters.options.PerGeometryKwargs`), used in every run.

    Returns
    -------
    RhoCalibration
        ``rho``, the ``loss_rise`` at it, ``converged`` and every evaluation of the search.

    Raises
    ------
    InvalidArgument, InvalidArgumentType
        A bad target, tolerance, budget or sharpness option (``geometry=``, ``measure=`` and
        ``rho=`` are this function's to set).
    SymmetryError, UnsupportedModel, SharpnessOutOfMemoryError
        As for :func:`~quotient_manifolds.adapters.sharpness`.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> cal = adapters.calibrate_rho(model, batches, geometry="geodesic-inv", target_loss_rise=0.1,
    ...                              n_iters=5, loss_fn=torch.nn.MSELoss())
    >>> cal.converged, 0.08 <= cal.loss_rise <= 0.125
    (True, True)
    >>> result = adapters.sharpness(model, batches, geometry="geodesic-inv", rho=cal.rho, n_iters=5,
    ...                             loss_fn=torch.nn.MSELoss())
    """
    check.module("model", model)
    check.batches("batches", batches)
    spec = geometry_of(geometry)
    target_loss_rise = check.positive_finite("target_loss_rise", target_loss_rise)
    if rho_start is not None:
        rho_start = check.positive_finite("rho_start", rho_start)
    if check.positive_finite("tolerance", tolerance) <= 1:
        raise InvalidArgument(f"tolerance must be a factor > 1 (stop when the loss rise is within it of "
                              f"the target), got {tolerance!r}; e.g. tolerance=1.25")
    integer_at_least("max_evals", max_evals, 1)
    if sharpness_options.get("measure", "worst") != "worst":
        raise InvalidArgument("calibrate_rho calibrates the worst-case loss rise; drop measure=")
    if "rho" in sharpness_options:
        raise InvalidArgumentType("calibrate_rho finds rho itself: drop rho= (pass rho_start= to choose the "
                                  "first radius tried)")
    options = SharpnessOptions.from_keywords({**sharpness_options, "geometry": geometry})
    batches = list(batches)
    start = rho_start if rho_start is not None else spec.rho_start
    measured: Dict[float, float] = {}

    def loss_rise(rho: float) -> float:
        value = float(run_sharpness(model, batches, [rho], options, stacklevel=5)[0].value)
        measured[rho] = value
        return value

    res = find_rho(loss_rise, float(start), float(target_loss_rise), tolerance=tolerance,
                   max_evals=max_evals)
    evals = [(float(r), float(s)) for r, s in res["evals"]]
    if res["converged"]:
        rho, rise = evals[-1]
    else:
        rho, rise = float(res["root"]), measured.get(res["root"], float("nan"))
    return RhoCalibration(geometry=geometry, target_loss_rise=float(target_loss_rise), rho=rho,
                          loss_rise=rise, converged=bool(res["converged"]), evals=evals)
