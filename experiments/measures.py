r"""The sharpness measures of the correlation study and the plan of (measure, ρ) pairs per model.

Measures (all worst-case, Auto-PGD, :func:`adapters.sharpness.sharpness`):

=====================  ===============  ============  =====================================
name                   geometry         retraction    norm
=====================  ===============  ============  =====================================
adaptive               adaptive         –             elementwise ‖ξ⊘|w|‖ (c = |w|)
geodesic-inv           geodesic-inv     second_order  inv metric on GL blocks
geodesic-mix           geodesic-mix     second_order  mix metric on GL blocks
inv-no-gamma           geodesic-inv     first_order   (ablation "no Γ": w + ξ)
mix-no-gamma           geodesic-mix     first_order   (ablation "no Γ")
inv-no-metric-norm     geodesic-inv     second_order  elementwise norm on GL blocks (ablation)
mix-no-metric-norm     geodesic-mix     second_order  elementwise norm on GL blocks (ablation)
inv-exact, mix-exact   geodesic-*       exact (RK4)   (retraction study)
=====================  ===============  ============  =====================================

ρ: each measure uses the ρ of its geometry family (adaptive / inv / mix); the mix ρ is not
dimensionless (docs/maths.md §12.14), so the three are set separately. The no-metric-norm
ablations measure their ball with the elementwise norm, so they take the adaptive ρ. The ρ sweep
evaluates the three main measures at ρ_family × each multiplier of ``rho_sweep``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

MEASURES: Dict[str, Dict[str, Any]] = {
    "adaptive": dict(geometry="adaptive", retraction="second_order", use_metric_norm=True,
                     family="adaptive"),
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
MAIN = ("adaptive", "geodesic-inv", "geodesic-mix")
ABLATIONS = ("inv-no-gamma", "mix-no-gamma", "inv-no-metric-norm", "mix-no-metric-norm")
DEFAULT_MEASURES = MAIN + ABLATIONS


def parse_measures(text: str) -> Tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in MEASURES]
    if unknown or not names:
        raise ValueError(f"unknown measure(s) {unknown or text!r}; valid: {', '.join(MEASURES)}")
    return names


def parse_floats(text: str, what: str = "values") -> Tuple[float, ...]:
    try:
        vals = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if any(not (math.isfinite(v) and v > 0) for v in vals):
        raise ValueError(f"{what}: every value must be a positive number, got {text!r}")
    return vals


def plan(measures: Sequence[str], rho: Dict[str, float], rho_sweep: Sequence[float]
         ) -> List[Tuple[str, float]]:
    """Ordered unique (measure, ρ) pairs: every measure at its family ρ, then the sweep."""
    out: List[Tuple[str, float]] = []
    for m in measures:
        out.append((m, float(rho[MEASURES[m]["family"]])))
    for m in MAIN:
        if m not in measures:
            continue
        for mult in rho_sweep:
            r = float(rho[MEASURES[m]["family"]]) * float(mult)
            if (m, r) not in out:
                out.append((m, r))
    return out


def measure_key(name: str, rho: float) -> str:
    return f"{name}@{rho:.6g}"


def run_plan(model, batches, pairs: Sequence[Tuple[str, float]], *, n_iters: int, eps: float = 0.0,
             progress: bool = False, desc: str = "sharpness", check=None) -> List[Dict[str, Any]]:
    """Evaluate every (measure, ρ) pair on the fixed ``batches``; one dict per pair.

    A perturbation that makes the loss non-finite (ρ too large) gives ``value = nan`` with the
    message in ``error`` instead of failing the model."""
    import adapters
    from adapters.sharpness import sharpness

    layout = adapters.layout(model)
    batches = list(batches)
    out: List[Dict[str, Any]] = []
    it = pairs
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(pairs, desc=desc, unit="measure", leave=False, dynamic_ncols=True)
        it = bar
    for name, rho in it:
        if check is not None:
            check()
        spec = MEASURES[name]
        started = time.perf_counter()
        entry: Dict[str, Any] = dict(measure=name, rho=rho, geometry=spec["geometry"],
                                     retraction=spec["retraction"],
                                     use_metric_norm=spec["use_metric_norm"], n_iters=n_iters)
        try:
            res = sharpness(model, batches, geometry=spec["geometry"], rho=rho, n_iters=n_iters,
                            retraction=spec["retraction"], use_metric_norm=spec["use_metric_norm"],
                            eps=eps, layout=layout)
            entry.update(value=res.value, per_batch=res.per_batch, init_losses=res.init_losses,
                         worst_losses=res.worst_losses, norms=res.norms,
                         n_forward=res.n_forward, n_backward=res.n_backward)
        except FloatingPointError as err:
            entry.update(value=float("nan"), error=str(err))
        entry["time_s"] = time.perf_counter() - started
        out.append(entry)
    if bar is not None:
        bar.close()
    return out


def population_job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
                   progress: bool, *, load_data, get_model, evaluate, sharpness_batches
                   ) -> Dict[str, Any]:
    """The per-model work of the text and vision populations: load the data, train (or reuse the
    checkpoint), evaluate, then every (measure, ρ) of the plan on the fixed sharpness batches."""
    import torch

    from .runner import check_parent_alive

    started = time.perf_counter()
    data = load_data(config, data_dir)
    model, hp, info = get_model(model_id, config, data, ckpt_dir, progress)
    t0 = time.perf_counter()
    metrics = evaluate(model, config, data, hp)
    eval_s = time.perf_counter() - t0
    pairs = plan(config["measures"], config["rho"], config["rho_sweep"])
    t0 = time.perf_counter()
    sharp = run_plan(model, sharpness_batches(config, data), pairs, n_iters=config["n_iters"],
                     eps=config["eps"], progress=progress, desc=f"sharpness m{model_id}",
                     check=check_parent_alive)
    return dict(seed=hp["seed"], hparams=hp, study_config=config, metrics=metrics,
                sharpness=sharp, checkpoint=info["checkpoint"], reused_checkpoint=info["reused"],
                train_info=info["train"],
                timing=dict(train_s=info["train_time_s"], eval_s=eval_s,
                            sharpness_s=time.perf_counter() - t0,
                            total_s=time.perf_counter() - started,
                            threads=torch.get_num_threads()))
