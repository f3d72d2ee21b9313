r"""The sharpness and curvature measures of the correlation studies, and the per-model plan.

Sharpness measures (all worst-case, Auto-PGD, :func:`quotient_manifolds.adapters.sharpness`):

========================  ===============  ============  =========================================
name                      geometry         retraction    norm / ascent direction
========================  ===============  ============  =========================================
adaptive                  adaptive         –             elementwise ‖ξ⊘|w|‖ (c = |w|); ∇⊙w²
adaptive-andriushchenko   adaptive         –             same ball; ascent ∇⊙|w| (the paper's
                                                         baseline, Andriushchenko et al.'s code)
geodesic-inv              geodesic-inv     second_order  inv metric on GL blocks
geodesic-mix              geodesic-mix     second_order  mix metric on GL blocks
inv-no-gamma              geodesic-inv     first_order   (ablation "no Γ": w + ξ)
mix-no-gamma              geodesic-mix     first_order   (ablation "no Γ")
inv-no-metric-norm        geodesic-inv     second_order  elementwise norm on GL blocks (ablation)
mix-no-metric-norm        geodesic-mix     second_order  elementwise norm on GL blocks (ablation)
inv-exact, mix-exact      geodesic-*       exact (RK4)   the exact geodesic beside second order
========================  ===============  ============  =========================================

Curvature measures (:mod:`quotient_manifolds.adapters.hessian`, at the trained weights, no ρ): ``hess-trace-*`` and
``hess-lmax-*`` are the trace and the largest eigenvalue of the Riemannian Hessian of the loss on
the quotient (docs/maths.md §4; GL blocks with the inv or mix metric, the other weights with the
adaptive metric Σ ξ²/w²) for ``*`` = inv / mix, and of the Euclidean Hessian ∇²f for ``*`` =
euclidean (curvlinops' ``HessianLinearOperator``; not invariant under the GL(h) action, for
contrast). Trace: Hutch++ with ``trace_matvecs`` products (``adapters.hessian.trace``); λ_max:
Lanczos (``adapters.hessian.top_eigenvalues``, relative tolerance ``lanczos_tol``). Both operators
are the mean loss over the given points (curvlinops' ``reduction="mean"`` convention).

Relative flatness (``relative-flatness``, :func:`quotient_manifolds.adapters.relative_flatness`, at
the trained weights, no ρ): Petzka et al.'s κ(W) = Σ_{s,s'} ⟨w_s, w_s'⟩ Tr H_{s,s'} of the model's
output layer (the classifier head of the text and vision models), on the curvature measures' points;
exact for these heads (their Hessian has at most 10⁷ entries). It is invariant to neuron-wise and
layer-wise rescalings of that layer, not to the GL(h) action on the attention blocks it does not see.

ρ: each sharpness measure uses the ρ of its family (adaptive / inv / mix); the mix ρ is not
dimensionless (docs/maths.md §12.14), so the three are set separately. The no-metric-norm
ablations measure their ball with the elementwise norm, so they take the adaptive ρ, as does the
Andriushchenko baseline (same ball, other ascent direction). The ρ sweep evaluates the three main
measures at ρ_family × each multiplier of ``rho_sweep``.

Points: by default every measure uses all ``sharp_points``. A configuration may give
``points = {"ablations": n, "sweep": n, "exact": n, "hessian": n}``: the ablations, the sweep's
other radii, the exact-retraction measures and the curvature measures then use the first n
points (whole batches of ``sharp_batch``) — a cost cut, recorded per entry as ``n_points``.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from quotient_manifolds import adapters
from quotient_manifolds.adapters import relative_flatness
from quotient_manifolds.adapters.evaluation import to_device
from quotient_manifolds.adapters.worst_case import sharpness
from quotient_manifolds.core.metrics import GeodesicLeftManifold

from .runner import check_parent_alive, progress_bar, study_device

MEASURES: Dict[str, Dict[str, Any]] = {
    "adaptive": dict(geometry="adaptive", retraction="second_order", use_metric_norm=True,
                     family="adaptive"),
    "adaptive-andriushchenko": dict(geometry="adaptive", retraction="second_order",
                                    use_metric_norm=True, family="adaptive",
                                    adaptive_direction="andriushchenko"),
    "geodesic-inv": dict(geometry="geodesic-inv", retraction="second_order", use_metric_norm=True,
                         family="inv"),
    "geodesic-mix": dict(geometry="geodesic-mix", retraction="second_order", use_metric_norm=True,
                         family="mix"),
    "inv-no-gamma": dict(geometry="geodesic-inv", retraction="first_order", use_metric_norm=True,
                         family="inv"),
    "mix-no-gamma": dict(geometry="geodesic-mix", retraction="first_order", use_metric_norm=True,
                         family="mix"),
    # the ball of the no-metric-norm ablations is measured elementwise: adaptive units of ρ
    "inv-no-metric-norm": dict(geometry="geodesic-inv", retraction="second_order",
                               use_metric_norm=False, family="adaptive"),
    "mix-no-metric-norm": dict(geometry="geodesic-mix", retraction="second_order",
                               use_metric_norm=False, family="adaptive"),
    "inv-exact": dict(geometry="geodesic-inv", retraction="exact", use_metric_norm=True,
                      family="inv"),
    "mix-exact": dict(geometry="geodesic-mix", retraction="exact", use_metric_norm=True,
                      family="mix"),
}
#: curvature measures: (operator geometry, quantity); "euclidean" is curvlinops' plain Hessian
CURVATURE: Dict[str, Tuple[str, str]] = {
    "hess-trace-inv": ("geodesic-inv", "trace"), "hess-lmax-inv": ("geodesic-inv", "lmax"),
    "hess-trace-mix": ("geodesic-mix", "trace"), "hess-lmax-mix": ("geodesic-mix", "lmax"),
    "hess-trace-euclidean": ("euclidean", "trace"), "hess-lmax-euclidean": ("euclidean", "lmax"),
}
#: measures at the trained weights that are no Hessian operator: Petzka et al.'s relative flatness
#: of the output layer (adapters.relative_flatness)
FLATNESS = ("relative-flatness",)
#: the measures without a radius (rho = 0 in their entries)
AT_WEIGHTS = tuple(CURVATURE) + FLATNESS
MAIN = ("adaptive", "geodesic-inv", "geodesic-mix")
ABLATIONS = ("inv-no-gamma", "mix-no-gamma", "inv-no-metric-norm", "mix-no-metric-norm")
EXACT = ("inv-exact", "mix-exact")
DEFAULT_MEASURES = MAIN + ABLATIONS + FLATNESS
#: the family whose calibrated ρ each main measure defines (docs/maths.md §12.14: not comparable)
FAMILY_MEASURE = {"adaptive": "adaptive", "inv": "geodesic-inv", "mix": "geodesic-mix"}
#: defaults of the curvature measures' cost knobs (config["hessian"] overrides)
HESSIAN_DEFAULTS = dict(trace_matvecs=12, lanczos_tol=1e-2, seed=0)


def main_measure_of(name: str) -> str:
    """The main measure (:data:`MAIN`) of a variant's geometry: the second-order measure an
    ablation or an exact-geodesic measure is compared with (``"inv-exact"`` → ``"geodesic-inv"``)."""
    return next(m for m in MAIN if MEASURES[m]["geometry"] == MEASURES[name]["geometry"])


def is_exact(name: str) -> bool:
    """Whether the measure moves along the exact geodesic."""
    return MEASURES.get(name, {}).get("retraction") == "exact"


def parse_measures(text: str) -> Tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in MEASURES and n not in AT_WEIGHTS]
    if unknown or not names:
        raise ValueError(f"unknown measure(s) {unknown or text!r}; valid: "
                         f"{', '.join([*MEASURES, *AT_WEIGHTS])}")
    return names


def curvature_unavailable(measures: Sequence[str]) -> Optional[str]:
    """Why the curvature measures among ``measures`` cannot run here (their operators need
    curvlinops, which does not import: the reason, with how to install it), or None; checked
    before a study trains its first model rather than after each."""
    if not any(m in CURVATURE for m in measures):
        return None
    try:
        from quotient_manifolds.adapters import hessian  # noqa: F401  (imports curvlinops)
    except ImportError as err:
        return str(err)
    return None


def parse_floats(text: str, what: str = "values") -> Tuple[float, ...]:
    try:
        vals = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if any(not (math.isfinite(v) and v > 0) for v in vals):
        raise ValueError(f"{what}: every value must be a positive number, got {text!r}")
    return vals


def plan(measures: Sequence[str], rho: Dict[str, float], rho_sweep: Sequence[float],
         sweep_only: bool = False) -> List[Tuple[str, float]]:
    """Ordered unique (measure, ρ) pairs of the sharpness measures: every measure at its family ρ,
    then the sweep of the main ones. The measures at the trained weights (no ρ: curvature, relative
    flatness) are not part of the plan.
    ``sweep_only``: the main measures only at the sweep's radii, not at their family ρ (a second
    pass whose first pass already measured them there)."""
    out: List[Tuple[str, float]] = []
    for m in measures:
        if m in AT_WEIGHTS or (sweep_only and m in MAIN):
            continue
        out.append((m, float(rho[MEASURES[m]["family"]])))
    for m in MAIN:
        if m not in measures:
            continue
        for mult in rho_sweep:
            r = float(rho[MEASURES[m]["family"]]) * float(mult)
            if (m, r) not in out:
                out.append((m, r))
    return out


def points_of(config: Dict[str, Any], name: str, rho: Optional[float] = None) -> int:
    """How many of the fixed sharpness points measure ``name`` at ``rho`` uses (module docstring:
    ``config["points"]`` cuts the ablations, the sweep, the exact measures and the curvature, relative
    flatness with it)."""
    full = int(config["sharp_points"])
    points = config.get("points") or {}
    if name in AT_WEIGHTS:
        group = "hessian"
    elif name in EXACT:
        group = "exact"
    elif name in ABLATIONS:
        group = "ablations"
    elif rho is not None and name in MEASURES and not math.isclose(
            rho, float(config["rho"][MEASURES[name]["family"]]), rel_tol=1e-9):
        group = "sweep"
    else:
        return full
    return min(full, int(points.get(group, full)))


def first_points(batches: Sequence[Any], n: int) -> List[Any]:
    """The whole batches that cover the first ``n`` points (at least one batch)."""
    out, seen = [], 0
    for b in batches:
        if seen >= n and out:
            break
        out.append(b)
        seen += batch_len(b)
    return out


def batch_len(batch: Any) -> int:
    """The number of points in a batch: the leading size of its input (the first element of a
    tuple / list batch; of a dict, its first array)."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(x, dict):
        x = next(v for v in x.values() if hasattr(v, "shape"))
    return int(x.shape[0])


def on_study_device(batches: Sequence[Any], config: Dict[str, Any]) -> List[Any]:
    """The sharpness batches moved to the study's device once (not at every measure)."""
    device = study_device(config)
    return [to_device(b, device) for b in batches]


def measure_key(name: str, rho: float) -> str:
    return f"{name}@{rho:.6g}"


def run_plan(model, batches, pairs: Sequence[Tuple[str, float]], *, n_iters: int, eps: float = 0.0,
             progress: bool = False, desc: str = "sharpness", check=None,
             n_points: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
    """Evaluate every (measure, ρ) pair on the fixed ``batches``; one dict per pair.

    ``n_points[k]`` (default: all) restricts pair k to the batches covering the first n points.
    A perturbation that makes the loss non-finite (ρ too large), or an exact geodesic that leaves
    the manifold inside the ball, gives ``value = nan`` with the message in ``error`` instead of
    failing the model. The per-batch relative gap of the
    second-order point to the exact geodesic (``retraction_gaps``, docs/maths.md §12) and the share
    of the worst perturbation's squared metric norm in the GL blocks (``gl_norm_shares``) and on the
    attention weights, in every geometry (``attention_norm_shares``) are kept;
    the library's warning about the gap is recorded in ``warnings`` instead of printed."""
    layout = adapters.layout(model)
    batches = list(batches)
    out: List[Dict[str, Any]] = []
    it = list(enumerate(pairs))
    bar = None
    if progress:
        bar = progress_bar(iterable=it, desc=desc, unit="measure", leave=False)
        it = bar
    for k, (name, rho) in it:
        if check is not None:
            check()
        spec = MEASURES[name]
        use = batches if n_points is None else first_points(batches, int(n_points[k]))
        started = time.perf_counter()
        entry: Dict[str, Any] = dict(measure=name, rho=rho, geometry=spec["geometry"],
                                     retraction=spec["retraction"],
                                     use_metric_norm=spec["use_metric_norm"], n_iters=n_iters,
                                     n_points=sum(batch_len(b) for b in use))
        direction = spec.get("adaptive_direction", "riemannian")
        if direction != "riemannian":
            entry["adaptive_direction"] = direction
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                res = sharpness(model, use, geometry=spec["geometry"], rho=rho, n_iters=n_iters,
                                retraction=spec["retraction"],
                                use_metric_norm=spec["use_metric_norm"],
                                adaptive_direction=direction, gram_eps=eps, layout=layout)
            entry.update(value=res.value, per_batch=res.per_batch, init_losses=res.init_losses,
                         worst_losses=res.worst_losses, norms=res.norms,
                         n_forward=res.n_forward, n_backward=res.n_backward)
            if res.retraction_gaps:
                entry["retraction_gaps"] = res.retraction_gaps
            if res.gl_norm_shares:
                entry["gl_norm_shares"] = res.gl_norm_shares
            if res.attention_norm_shares:
                entry["attention_norm_shares"] = res.attention_norm_shares
            if caught:
                entry["warnings"] = sorted({str(w.message) for w in caught})
        except FloatingPointError as err:
            entry.update(value=float("nan"), error=str(err))
        except GeodesicLeftManifold as err:
            # the exact (RK4) geodesic left GL (G or H lost rank) or diverged inside the ball: the
            # exact measure is undefined at this ρ for this model (the mix metric is incomplete)
            entry.update(value=float("nan"), error=str(err))
        entry["time_s"] = time.perf_counter() - started
        out.append(entry)
    if bar is not None:
        bar.close()
    return out


def run_curvature(model, batches, names: Sequence[str], *, trace_matvecs: int = 12,
                  lanczos_tol: float = 1e-2, seed: int = 0, check=None) -> List[Dict[str, Any]]:
    """The curvature measures ``names`` (module docstring) on ``batches``; one dict per name, in
    the shape of :func:`run_plan`'s entries (``rho`` = 0: no radius). One operator per geometry,
    shared by its trace and λ_max."""
    # the Hessian needs curvlinops (an optional install): imported when a curvature is measured
    from quotient_manifolds.adapters import hessian as H

    batches = list(batches)
    n_points = sum(batch_len(b) for b in batches)
    by_geometry: Dict[str, List[str]] = {}
    for n in names:
        by_geometry.setdefault(CURVATURE[n][0], []).append(n)
    found: Dict[str, Dict[str, Any]] = {}
    for geometry, group in by_geometry.items():
        if check is not None:
            check()
        started = time.perf_counter()
        if geometry == "euclidean":
            import curvlinops  # optional: see above
            model.eval()
            params = [p for p in model.parameters() if p.requires_grad]
            op = curvlinops.HessianLinearOperator(model, torch.nn.CrossEntropyLoss(), params,
                                                  batches, check_deterministic=False)
            dims = dict(dim=int(op.shape[0]))
        else:
            op = H.riemannian_hessian(model, batches, geometry=geometry)
            dims = dict(dim=int(op.shape[0]), quotient_dim=int(op.quotient_dim))
        setup = time.perf_counter() - started
        for n in group:
            t0 = time.perf_counter()
            entry: Dict[str, Any] = dict(measure=n, rho=0.0, kind="curvature",
                                         geometry=geometry, quantity=CURVATURE[n][1],
                                         n_points=n_points, **dims)
            try:
                if CURVATURE[n][1] == "trace":
                    entry.update(value=H.trace(op, method="hutch++", num_matvecs=trace_matvecs,
                                               seed=seed), method="hutch++",
                                 num_matvecs=trace_matvecs)
                else:
                    entry.update(value=float(H.top_eigenvalues(op, 1, tol=lanczos_tol,
                                                               seed=seed)[0]),
                                 method="lanczos", tol=lanczos_tol)
            except FloatingPointError as err:
                entry.update(value=float("nan"), error=str(err))
            entry["time_s"] = time.perf_counter() - t0 + setup / len(group)
            found[n] = entry
    return [found[n] for n in names]


def run_flatness(model, batches, *, check=None) -> List[Dict[str, Any]]:
    """Relative flatness of the model's output layer (module docstring) on ``batches``: one entry
    in the shape of :func:`run_plan`'s (``rho`` = 0: no radius), ``value`` NaN with the message in
    ``error`` when the loss is not finite."""
    if check is not None:
        check()
    batches = list(batches)
    started = time.perf_counter()
    entry: Dict[str, Any] = dict(measure=FLATNESS[0], rho=0.0, kind="flatness",
                                 n_points=sum(batch_len(b) for b in batches))
    try:
        res = relative_flatness(model, batches)
        entry.update(value=res.value, per_batch=res.per_batch, layer=res.layer, shape=list(res.shape),
                     method=res.method, n_products=res.n_products, std_error=res.std_error)
    except FloatingPointError as err:
        entry.update(value=float("nan"), error=str(err))
    entry["time_s"] = time.perf_counter() - started
    return [entry]


def population_job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
                   progress: bool, *, load_data, get_model, evaluate, sharpness_batches
                   ) -> Dict[str, Any]:
    """The per-model work of the text and vision populations: load the data, train (or reuse the
    checkpoint), evaluate, then every (measure, ρ) of the plan on the fixed sharpness batches and
    the curvature measures and relative flatness (:func:`points_of` says how many points each uses)."""
    started = time.perf_counter()
    data = load_data(config, data_dir)
    model, hp, info = get_model(model_id, config, data, ckpt_dir, progress)
    t0 = time.perf_counter()
    metrics = evaluate(model, config, data, hp)
    eval_s = time.perf_counter() - t0
    pairs = plan(config["measures"], config["rho"], config["rho_sweep"],
                 sweep_only=bool(config.get("sweep_only")))
    batches = on_study_device(sharpness_batches(config, data), config)
    t0 = time.perf_counter()
    sharp = run_plan(model, batches, pairs, n_iters=config["n_iters"],
                     eps=config["eps"], progress=progress, desc=f"sharpness m{model_id}",
                     check=check_parent_alive,
                     n_points=[points_of(config, m, r) for m, r in pairs])
    sharpness_s = time.perf_counter() - t0
    curv = [m for m in config["measures"] if m in CURVATURE]
    t0 = time.perf_counter()
    if curv:
        opts = {**HESSIAN_DEFAULTS, **(config.get("hessian") or {})}
        sharp += run_curvature(model, first_points(batches, points_of(config, curv[0])), curv,
                               trace_matvecs=int(opts["trace_matvecs"]),
                               lanczos_tol=float(opts["lanczos_tol"]), seed=int(opts["seed"]),
                               check=check_parent_alive)
    if any(m in FLATNESS for m in config["measures"]):
        sharp += run_flatness(model, first_points(batches, points_of(config, FLATNESS[0])),
                              check=check_parent_alive)
    return dict(seed=hp["seed"], hparams=hp, study_config=config, metrics=metrics,
                sharpness=sharp, checkpoint=info["checkpoint"], reused_checkpoint=info["reused"],
                train_info=info["train"], weights_sha256=info.get("weights_sha256"),
                timing=dict(train_s=info["train_time_s"], eval_s=eval_s,
                            sharpness_s=sharpness_s, curvature_s=time.perf_counter() - t0,
                            total_s=time.perf_counter() - started,
                            threads=torch.get_num_threads()))
