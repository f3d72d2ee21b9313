r"""Matched loss-rise study: every sharpness measure calibrated separately to the same median loss
rise, on the width-64 ViT fine-tune population of the vision study.

Why: a radius ρ means a different ball in every geometry (the adaptive and inv norms are
scale-free, the mix metric has units), and the vision study calibrates each family to a median
of 3 nats, a regime where the second-order mix step is far off its geodesic. Here each measure
gets its own ρ for each of a few loss-rise *levels* (default ≈ 0.1, ≈ 1 and ≈ 3 nats, the last
the vision study's regime), so that the measures are compared at the same size of effect, and the
geodesic measures are taken along the exact geodesic (with the second-order step beside them).
Each measure is calibrated with the retraction it is reported with: ``inv-exact`` and
``mix-exact`` along the exact geodesic, ``geodesic-inv`` and ``geodesic-mix`` with the
second-order step (the vision study instead measured ``mix-exact`` at the ρ calibrated for
``geodesic-mix``, which put it at a median of 0.13 nats against 1.3–3 for the others).

Protocol
--------
* **Population**: the 48 fine-tunes of the vision study's default protocol (``quotient-manifolds
  vision``: one pretrained ViT width 64, depth 4, 4 heads of dim 16; model i's
  hyperparameters from ``default_rng([seed, i, 29])``), retrained from their seeds with the
  vision study's own training function (bit for bit on the same CPU kernels and software:
  :func:`quotient_manifolds.experiments.provenance.reproducible_training`; the committed two-level
  run predates it and its models differ from the vision study's), or reused from its checkpoints
  (``--checkpoint-dir runs/vision-finetune/checkpoints``: the checkpoint names and training hashes
  are the vision study's).
* **Points**: the first ``points`` (256) images of the fixed sharpness points of the vision study
  (training points of every model), one batch, eval mode, ``n_iters`` (20) Auto-PGD iterations.
* **Measures** (:data:`MATCHED_MEASURES`, :data:`quotient_manifolds.experiments.measures.MEASURES`): the paper's
  baseline ``adaptive-andriushchenko`` (elementwise adaptive sharpness with Andriushchenko et al.'s
  ∇⊙|w| direction), our ``adaptive`` (∇⊙w²), and ``inv-exact`` / ``mix-exact`` (GL blocks along
  the exact geodesic, RK4) with ``geodesic-inv`` / ``geodesic-mix`` (the second-order step) beside
  them.
* **Calibration** (the population *median* is the target, so it is a property of the population,
  not of one model): on the first ``pilot_models`` (6) models, for every measure and level, the
  library's safeguarded secant :func:`quotient_manifolds.adapters.calibration.find_rho` (the search behind
  :func:`quotient_manifolds.adapters.calibrate_rho`) finds the ρᵢ at which model i's loss rise is the level
  (tolerance factor 1.25, at most ``max_evals`` sharpness runs of that measure itself, starting
  from the vision study's 3-nat starting ρ of the family, or of the measure where ``rho_start``
  names it, scaled by √(level / 3); ``mix-exact``: 0.18, the committed 1-nat ρ* 0.105 × √3);
  ρ* = exp(median log ρᵢ)
  (:func:`quotient_manifolds.experiments.calibrate.combine_roots`). An exact geodesic that leaves GL(h) inside the
  ball counts as "above the level" in the search. Then **every** model (pilot ones included) is
  measured at that one ρ* per measure and level: the achieved population median is reported
  beside the level.
* **Per model and (measure, level)** the record holds the sharpness value (the worst-case loss
  rise over the ball, in nats: the measured loss rise at ρ*), the initial and worst losses, the
  share of the worst perturbation's squared metric norm that lies on the attention weights (the
  weights of the GL blocks; ``attention_norm_shares`` of
  :class:`quotient_manifolds.adapters.SharpnessResult`, in each measure's own metric, for the
  adaptive measures too: where each measure's worst perturbation lives), the second-order step's gap to
  the exact geodesic (``retraction_gaps``), and, where the exact geodesic left GL (G or H lost
  rank), ``value = NaN`` with the message in ``error``: a **failure**, counted in the report for
  every measure and level and never dropped silently (τ is given over the models with a value,
  with n, and again with the failures ranked as the sharpest models).
* **Report** (``quotient-manifolds report DIR``): per level, τ-b of each measure with the
  generalisation gap on the model's own training subset (``gap_own``, as the vision study) and
  the paired-bootstrap Δτ against the baseline and against our adaptive (same resampled models
  for both τ's; :func:`quotient_manifolds.experiments.reporting.paired_section`), the calibrated ρ*, the achieved loss
  rises, the failures and the attention shares; the figure ``fig_matched.png`` shows τ against the level
  with the 95 % CIs. Models above the vision study's train-error target (5 %) are excluded and
  listed, as there.

Resume: the pilot records go to ``DIR/calibration.jsonl``, the combined ρ* to
``DIR/calibration.json`` (reused on resume, written to ``config.json`` as ``rho_used``), the
per-model records to ``DIR/results.jsonl``, each appended as the model finishes (crash-safe:
:mod:`quotient_manifolds.experiments.runner`); a killed run resumes where it stopped.

Cost, measured on one model of the real configuration (``benchmarks/bench_matched.py``, one
thread, CPU seconds): the six measures once on 256 points take 113 s (inv-exact 51 s, mix-exact
48 s, the four others 3.4–4.1 s each), so a model costs ≈ 380 s with three levels and its
fine-tune and evaluation (≈ 40 s), and a pilot model ≈ 1,360 s more (4 sharpness runs per
search); with the pretraining (≈ 220 s estimated at two threads; it now trains at one, not
timed) the full study is ≈ 7.5 CPU-hours, ≈ 3.8 h wall with ``--workers 2 --threads 1`` on an idle
2-core machine. On the shared machine the two-level run of 2026-11-26 took 18 min for the
pilot (``calibration.json``: ``wall_s``) and 3.1 h for the 48 models (first and last
``finished`` of ``results.jsonl``); scaled by 3/2 levels for the pilot and 379/266 for the
models, a three-level run there takes ≈ 5 h.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from quotient_manifolds.adapters.calibration import find_rho

from . import vision as V
from .calibrate import CALIBRATION, PILOT_RESULTS, check_rho_unchanged, combine_roots, load, run_pilot
from .measures import MEASURES, batch_len, on_study_device, run_plan
from .options import defaults_of, float_list, positive_int
from .population import device_name, log_line, run_population_study
from .reporting import PAIRED_N_BOOT, PAIRED_SEED, TARGET_LABEL, finish_figure, paired_section, pyplot, write_summary
from .runner import ExperimentError, check_parent_alive, display_path, fmt_seconds
from .stats import paired_delta_tau, tau_ci_weighted

NAME = "matched"
#: the baseline, our adaptive, and the geodesic measures along the exact geodesic with the
#: second-order step beside them
MATCHED_MEASURES = ("adaptive-andriushchenko", "adaptive", "inv-exact", "geodesic-inv",
                    "mix-exact", "geodesic-mix")


def defaults(quick: bool, synthetic: bool) -> Dict[str, Any]:
    """The study's configuration: the vision fine-tune population (``population``: the keys that
    define data, pretraining and models; the vision study's sharpness settings left out) and the
    matched-loss-rise settings (module docstring)."""
    pop = V.finetune_defaults(quick, synthetic)
    for key in ("measures", "calibration", "rho", "rho_sweep", "points", "hessian", "models",
                "n_iters", "eps", "sharp_points", "sharp_batch"):
        pop.pop(key)
    c: Dict[str, Any] = dict(
        population=pop, levels=[0.1, 1.0, 3.0], points=256, batch=256, n_iters=20, eps=0.0,
        measures=list(MATCHED_MEASURES),
        rho_start={"adaptive": 2.0, "inv": 0.6, "mix": 0.03, "mix-exact": 0.18},
        rho_start_level=3.0, pilot_models=6, tolerance=1.25, max_evals=6, target="gap_own",
        models=48)
    if quick:
        c["quick"] = True  # a smoke test: every output says so (reporting.SMOKE_TEST)
        c.update(points=32, batch=32, n_iters=2, pilot_models=2, max_evals=2, models=3,
                 levels=[0.1, 3.0])
    return c


def level_key(level: float) -> str:
    return f"{float(level):g}"


def _start(config: Dict[str, Any], measure: str, level: float) -> float:
    """First ρ of the search: the measure's own starting ρ at ``rho_start_level`` nats where
    ``rho_start`` has one (``mix-exact``: along the exact geodesic the mix ball needs a larger ρ
    than the second-order step's), else its family's, scaled by √(level / rho_start_level)
    (S ∝ ρ² near a minimum)."""
    starts = config["rho_start"]
    start = starts.get(measure, starts[MEASURES[measure]["family"]])
    return float(start) * math.sqrt(level / float(config["rho_start_level"]))


def _model_and_batches(model_id: int, config: Dict[str, Any], ckpt_dir: str,
                       data_dir: Optional[str], progress: bool):
    pop = config["population"]
    data = V.load_data(pop, data_dir)
    model, hp, info = V.get_model(model_id, pop, data, ckpt_dir, progress)
    batches = on_study_device(V.sharpness_batches(
        {"sharp_points": config["points"], "sharp_batch": config["batch"]}, data), pop)
    return data, model, hp, info, batches


# ------------------------------------------------------------------------------------ pilot
def pilot_job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
              progress: bool) -> Dict[str, Any]:
    """One pilot model (run in a worker): train or reuse it, then :func:`find_rho` for every
    measure and level on the study's points."""
    started = time.perf_counter()
    _, model, hp, info, batches = _model_and_batches(model_id, config, ckpt_dir, data_dir,
                                                     progress)
    out: Dict[str, Any] = dict(hparams=hp, checkpoint=info["checkpoint"],
                               weights_sha256=info.get("weights_sha256"),
                               n_points=sum(batch_len(b) for b in batches), searches={})
    for level in config["levels"]:
        for measure in config["measures"]:
            t0 = time.perf_counter()
            errors: List[str] = []

            def loss_rise(rho: float) -> float:
                entry = run_plan(model, batches, [(measure, rho)], n_iters=config["n_iters"],
                                 eps=config["eps"], check=check_parent_alive)[0]
                if "error" in entry:
                    errors.append(entry["error"])
                return float(entry["value"])

            res = find_rho(loss_rise, _start(config, measure, level), float(level),
                           tolerance=float(config["tolerance"]),
                           max_evals=int(config["max_evals"]))
            out["searches"][f"{measure}@{level_key(level)}"] = dict(
                measure=measure, level=float(level), failures=len(errors),
                time_s=time.perf_counter() - t0, **res)
    out["timing"] = dict(train_s=info["train_time_s"], total_s=time.perf_counter() - started)
    return out


def combine(records: Sequence[Dict[str, Any]], config: Dict[str, Any], config_hash: str
            ) -> Dict[str, Any]:
    """calibration.json from the pilot records: ρ* per measure and level
    (:func:`quotient_manifolds.experiments.calibrate.combine_roots`)."""
    out: Dict[str, Any] = dict(
        config_hash=config_hash, levels=list(config["levels"]),
        pilot_models=[r["model_id"] for r in records], points=config["points"],
        n_iters=config["n_iters"], rho={}, searches={},
        method="per pilot model: safeguarded secant in (log ρ, log S) "
               "(adapters.calibration.find_rho); ρ* = geometric median of the per-model roots",
        created=_dt.datetime.now().isoformat(timespec="seconds"))
    for measure in config["measures"]:
        for level in config["levels"]:
            key = f"{measure}@{level_key(level)}"
            per = {str(r["model_id"]): r["searches"][key] for r in records}
            found = combine_roots(per, what=f"the {measure} ρ at {level:g} nats")
            found["failures"] = {k: p["failures"] for k, p in per.items()}
            out["rho"].setdefault(measure, {})[level_key(level)] = found["rho"]
            out["searches"][key] = dict(measure=measure, level=float(level), **found)
    return out


def calibrate(config: Dict[str, Any], od, ckpt_dir: str, *, data_dir: Optional[str],
              workers: int, threads: Optional[int], progress: bool, log=print) -> Dict[str, Any]:
    """Run (or reuse) the pilot calibration in the output directory ``od``; returns
    calibration.json's content and records ρ* in config.json as ``rho_used``."""
    found = load(od.file(CALIBRATION))
    if found is not None and found.get("config_hash") == od.hash:
        log(f"calibration: reusing {od.file(CALIBRATION)}")
    else:
        pilot = list(range(int(config["pilot_models"])))
        log(f"calibration: ρ of {len(config['measures'])} measures × {len(config['levels'])} "
            f"levels so that the median loss rise of {len(pilot)} pilot models is each level "
            f"(per-model work in {od.file(PILOT_RESULTS)})")
        found = run_pilot(od, pilot_job, pilot, config, ckpt_dir,
                          combine_records=lambda records: combine(records, config, od.hash),
                          data_dir=data_dir, workers=workers, threads=threads,
                          progress=progress, log=log)
        log(f"calibration done in {fmt_seconds(found['wall_s'])}")
    for key, d in found["searches"].items():
        log(f"  {key}: ρ* = {d['rho']:.4g} (predicted pilot median "
            f"{d['predicted_pilot_median']:.3g} nats; {d['converged']} converged, "
            f"{sum(d['failures'].values())} exact-geodesic failures in the search)")
    od.record_in_config("rho_used", found["rho"])
    return found


def resolved(config: Dict[str, Any], calibration: Dict[str, Any]) -> Dict[str, Any]:
    """``config`` with ``rho``: measure -> level -> the calibrated ρ*."""
    return {**config, "rho": {m: {level_key(lv): float(calibration["rho"][m][level_key(lv)])
                                  for lv in config["levels"]} for m in config["measures"]}}


# ------------------------------------------------------------------------------------ models
def job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
        progress: bool) -> Dict[str, Any]:
    """One model (run in a worker): train or reuse, evaluate, then every measure at its ρ* of
    every level (``config["rho"]``, from :func:`resolved`)."""
    started = time.perf_counter()
    data, model, hp, info, batches = _model_and_batches(model_id, config, ckpt_dir, data_dir,
                                                        progress)
    t0 = time.perf_counter()
    metrics = V.evaluate(model, config["population"], data, hp)
    eval_s = time.perf_counter() - t0
    pairs = [(m, float(config["rho"][m][level_key(lv)]))
             for lv in config["levels"] for m in config["measures"]]
    t0 = time.perf_counter()
    entries = run_plan(model, batches, pairs, n_iters=config["n_iters"], eps=config["eps"],
                       progress=progress, desc=f"matched m{model_id}", check=check_parent_alive)
    levels = [float(lv) for lv in config["levels"] for _ in config["measures"]]
    for entry, level in zip(entries, levels):
        entry["level"] = level
    return dict(seed=hp["seed"], hparams=hp, study_config=config, metrics=metrics,
                sharpness=entries, checkpoint=info["checkpoint"],
                reused_checkpoint=info["reused"], train_info=info["train"],
                weights_sha256=info.get("weights_sha256"),
                timing=dict(train_s=info["train_time_s"], eval_s=eval_s,
                            sharpness_s=time.perf_counter() - t0,
                            total_s=time.perf_counter() - started,
                            threads=torch.get_num_threads()))


def exclusions(records: Sequence[Dict[str, Any]]) -> Dict[int, str]:
    """The vision study's exclusions (own-subset train error above its target)."""
    return V.exclusions([{**r, "study_config": r["study_config"]["population"]}
                         for r in records])


# ------------------------------------------------------------------------------------ report
def _entry(record: Dict[str, Any], measure: str, level: float) -> Optional[Dict[str, Any]]:
    """The record's entry of ``measure`` at ``level`` (None if absent)."""
    for e in record["sharpness"]:
        if e["measure"] == measure and math.isclose(e["level"], level, rel_tol=1e-9):
            return e
    return None


def values(records: Sequence[Dict[str, Any]], measure: str, level: float, key: str = "value"
           ) -> np.ndarray:
    """Per record, ``key`` of the entry of ``measure`` at ``level`` (NaN where absent);
    ``key="attention_share"``: the mean over batches of ``attention_norm_shares`` (records
    without it: ``gl_norm_shares``, which equals it for the geodesic measures); ``key="gap"``: the largest
    |relative gap| over batches of the second-order loss rise to the exact geodesic's
    (``retraction_gaps``; inf where that geodesic left GL)."""
    out = []
    for r in records:
        e = _entry(r, measure, level) or {}
        if key == "attention_share":
            shares = e.get("attention_norm_shares") or e.get("gl_norm_shares")
            got = float(np.mean(shares)) if shares else None
        elif key == "gap":
            got = max(abs(g) for g in e["retraction_gaps"]) if e.get("retraction_gaps") else None
        else:
            got = e.get(key)
        out.append(float("nan") if got is None else float(got))
    return np.array(out, dtype=float)


def failed(records: Sequence[Dict[str, Any]], measure: str, level: float) -> np.ndarray:
    """Per record: did the measure fail at ``level`` (the exact geodesic left GL(h))?"""
    return np.array([("error" in (_entry(r, measure, level) or {})) for r in records], bool)


def _failures_sharpest(x: np.ndarray, fail: np.ndarray) -> np.ndarray:
    """``x`` with the failed models set above every finite value (tied among themselves):
    Kendall τ only uses the order."""
    x = x.copy()
    top = np.nanmax(x[np.isfinite(x)]) if np.isfinite(x).any() else 0.0
    x[fail] = top + 1.0
    return x


def _median(v: np.ndarray) -> Optional[float]:
    """Median of the values that are not NaN (inf kept: a geodesic that left GL); None if none."""
    v = v[~np.isnan(v)]
    return float(np.median(v)) if v.size else None


def _median_range(v: np.ndarray, fmt: str = "{:.3g}") -> str:
    """"median [min, max]" of the values that are not NaN; "—" if none."""
    v = v[~np.isnan(v)]
    if not v.size:
        return "—"
    return f"{fmt.format(float(np.median(v)))} [{fmt.format(float(v.min()))}, " \
           f"{fmt.format(float(v.max()))}]"


def report(out_dir: str, config: Dict[str, Any], config_hash: str,
           records: Sequence[Dict[str, Any]], *, wall_s: Optional[float] = None,
           source: Optional[str] = None, **_: Any) -> Dict[str, Any]:
    """summary.md, summary.json and fig_matched.png from the records alone (module docstring);
    the same whether written by the run or by ``quotient-manifolds report DIR``."""
    source = source or os.path.join(out_dir, "results.jsonl")
    excluded = exclusions(records)
    used = [r for r in records if r["model_id"] not in excluded]
    target = config.get("target", "gap_own")
    levels = [float(lv) for lv in config["levels"]]
    measures = list(config["measures"])
    y = np.array([float(r["metrics"].get(target, np.nan)) for r in used])
    synthetic = config["population"].get("data") == "synthetic"
    summary: Dict[str, Any] = dict(study=NAME, config_hash=config_hash, target=target,
                                   models=len(records), used=len(used),
                                   excluded={str(k): v for k, v in excluded.items()},
                                   levels=levels, measures=measures, synthetic=synthetic,
                                   source=display_path(source),
                                   wall_s=wall_s, matched={})
    lines = [f"# Matched loss-rise study{' (SYNTHETIC DATA: tests only)' if synthetic else ''}",
             "",
             f"{len(used)} of {len(records)} models of the vision fine-tune population "
             f"(ViT width {config['population']['arch']['width']}, "
             f"{config['population']['arch']['heads']} heads); sharpness on the first "
             f"{config['points']} fixed training points, {config['n_iters']} Auto-PGD iterations; "
             f"every measure calibrated separately so that the median loss rise of the "
             f"{config['pilot_models']} pilot models is each level (ρ* = geometric median of "
             f"the pilot roots), then every model measured at that ρ*. Target: "
             f"{TARGET_LABEL.get(target, target)}. Config hash {config_hash}.", ""]
    if excluded:
        lines += ["Excluded (above the train-error target): "
                  + "; ".join(f"model {k}: {v}" for k, v in sorted(excluded.items())), ""]
    views = []
    for level in levels:
        cols = {m: values(used, m, level) for m in measures}
        views.append((f"loss rise ≈ {level:g} nats", "models resampled", {}, cols))
    lines += paired_section(y, views, summary)
    lines += _level_changes(used, y, levels, measures, summary)
    lines += _calibration_table(config, used, y, levels, measures, summary)
    if len(used) >= 3:
        _fig_matched(os.path.join(out_dir, "fig_matched.png"), summary, levels, measures,
                     title=f"τ-b vs matched loss rise ({len(used)} ViTs"
                           + (", SYNTHETIC" if synthetic else "") + ")")
        lines += ["![τ vs loss-rise level](fig_matched.png)", ""]
    write_summary(out_dir, lines, summary, config)
    return summary


def _level_changes(used: Sequence[Dict[str, Any]], y: np.ndarray, levels: Sequence[float],
                   measures: Sequence[str], summary: Dict[str, Any]) -> List[str]:
    """Per measure, how its τ changes from each level to the next: Δτ = τ-b(at the higher
    level) − τ-b(at the lower), both on the same resampled models (the paired section's
    resamples and seed; into ``summary["level_changes"]``)."""
    if len(levels) < 2 or len(used) < 3:
        return []
    steps = list(zip(levels[:-1], levels[1:]))
    lines = ["## τ from one level to the next", "",
             "Δτ = τ-b(measure at the higher level) − τ-b(the same measure at the lower level), "
             "on the same models, paired bootstrap as above.", "",
             "| measure | " + " | ".join(f"{a:g} → {b:g} nats [95% CI]" for a, b in steps) + " |",
             "|---|" + "---|" * len(steps)]
    out: Dict[str, Any] = {}
    for m in measures:
        cells = []
        for a, b in steps:
            d = paired_delta_tau(values(used, m, b), values(used, m, a), y, n_boot=PAIRED_N_BOOT,
                                 seed=PAIRED_SEED)
            out.setdefault(m, {})[f"{level_key(a)}->{level_key(b)}"] = d.as_dict()
            cells.append(d.fmt())
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    summary["level_changes"] = out
    return lines + [""]


def _calibration_table(config: Dict[str, Any], used: Sequence[Dict[str, Any]], y: np.ndarray,
                       levels: Sequence[float], measures: Sequence[str], summary: Dict[str, Any]
                       ) -> List[str]:
    """Per level and measure: ρ*, the achieved loss rise, the exact-geodesic failures, the
    attention share, the second-order gap and τ with the failures ranked sharpest (also into
    ``summary["matched"]``)."""
    lines = ["## Calibration, achieved loss rise, exact-geodesic failures, attention share", "",
             "ρ*: the calibrated radius; loss rise: the population's sharpness values at ρ* "
             "(median [min, max], nats); failures: models whose exact geodesic left GL(h) inside "
             "the ball (value undefined; τ above is over the other models, the last column ranks "
             "them as the sharpest); attention share: share of the worst perturbation's squared "
             "metric norm on the attention weights, the weights of the GL blocks (median [min, "
             "max]; for every measure in its own metric, the adaptive ones included); second-order "
             "gap: |S_exact/S − 1| at the worst "
             "second-order perturbation, the exact geodesic (8 RK4 steps) taken with the same "
             "initial velocity (median [min, max]; `retraction_gaps` of adapters.sharpness).", "",
             "| level (nats) | measure | ρ* | loss rise | failures | attention share "
             "| second-order gap | τ-b, failures ranked sharpest |",
             "|---|---|---|---|---|---|---|---|"]
    for level in levels:
        for m in measures:
            x = values(used, m, level)
            fail = failed(used, m, level)
            n_fail = int(fail.sum())
            rho = config["rho"][m][level_key(level)]
            t_all = tau_ci_weighted(_failures_sharpest(x, fail), y, n_boot=PAIRED_N_BOOT,
                                    seed=PAIRED_SEED) if n_fail and len(used) >= 3 else None
            share = values(used, m, level, "attention_share")
            gap = values(used, m, level, "gap")
            summary["matched"].setdefault(level_key(level), {})[m] = dict(
                rho=rho, median_loss_rise=_median(x), failures=n_fail, models=len(used),
                median_attention_share=_median(share),
                median_second_order_gap=_median(gap),
                tau_failures_sharpest=t_all.as_dict() if t_all else None)
            lines.append(f"| {level:g} | {m} | {rho:.4g} | {_median_range(x)} | "
                         f"{n_fail} of {len(used)} | {_median_range(share, '{:.2f}')} | "
                         f"{_median_range(gap, '{:.2g}')} | "
                         f"{t_all.fmt() if t_all else '(no failures)'} |")
    lines.append("")
    return lines


def _fig_matched(path: str, summary: Dict[str, Any], levels: Sequence[float],
                 measures: Sequence[str], *, title: str) -> None:
    """Left: τ-b of each measure against the loss-rise level, with its 95 % bootstrap CI. Right:
    Δτ of each measure against the paper's baseline (the first reference of the paired section),
    with the paired CI. Measures side by side around each level; the paired section's resamples."""
    plt = pyplot()


    paired = summary.get("paired", {})
    views = paired.get("views", {})
    reference = (paired.get("references") or [None])[0]
    fig, (ax_tau, ax_delta) = plt.subplots(1, 2, figsize=(9.0, 3.6), sharex=True)
    for k, m in enumerate(measures):
        style = "o" + ("--" if m.startswith("geodesic-") else "-")
        for ax, pick in ((ax_tau, lambda row: (row["tau_b"], row["ci_low"], row["ci_high"])),
                         (ax_delta, lambda row: (lambda d: None if d is None else
                                                 (d["delta"], d["ci_low"], d["ci_high"]))(
                                                     row.get("vs", {}).get(reference)))):
            xs, mid, lo, hi = [], [], [], []
            for level in levels:
                row = views.get(f"loss rise ≈ {level:g} nats", {}).get("rows", {}).get(m)
                point = None if row is None else pick(row)
                if point is None or not math.isfinite(point[0]):
                    continue
                xs.append(level * 1.08 ** (k - (len(measures) - 1) / 2))
                mid.append(point[0])
                lo.append(point[0] - point[1] if math.isfinite(point[1]) else 0.0)
                hi.append(point[2] - point[0] if math.isfinite(point[2]) else 0.0)
            if xs:
                ax.errorbar(xs, mid, yerr=[lo, hi], fmt=style, ms=3, capsize=2, lw=1, label=m,
                            color=f"C{k}")
    for ax in (ax_tau, ax_delta):
        ax.axhline(0.0, color="0.6", lw=0.6)
        ax.set_xscale("log")
    ax_delta.set_title(f"Δτ vs {reference} [paired 95% CI]", fontsize=9)
    ax_delta.set_xlabel("loss-rise level: median over the pilot models (nats)", fontsize=8)
    ax_delta.set_ylabel("Δτ-b (negative: ranks the gap better)", fontsize=8)
    ax_delta.tick_params(labelsize=7)
    finish_figure(fig, ax_tau, path, title=title,
                  xlabel="loss-rise level: median over the pilot models (nats)",
                  ylabel="Kendall τ-b with the gap [95% CI]")


# ------------------------------------------------------------------------------------ CLI
def add_arguments(p) -> None:
    """The study's options (``quotient-manifolds matched --help``)."""
    # the configuration of a real run (synthetic=False) and of --quick
    default = defaults_of(defaults(False, False), defaults(True, False))
    g = p.add_argument_group("matched loss rise")
    g.add_argument("--levels", type=float_list, default=None, metavar="L1,...",
                   help=f"median loss rises in nats {default('levels')}")
    g.add_argument("--pilot-models", type=positive_int, default=None,
                   help=f"pilot models of the calibration {default('pilot_models')}")
    g.add_argument("--n-iters", type=positive_int, default=None,
                   help=f"Auto-PGD iterations {default('n_iters')}")
    g.add_argument("--calibrate-only", action="store_true",
                   help="stop after the calibration")


def run(args, log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds matched``: the pretrained ViT, the calibration of every measure's ρ per
    loss rise on the pilot models, then every model at those ρ, and the report."""
    config = defaults(args.quick, args.synthetic)
    if args.seed is not None:
        config["population"]["seed"] = args.seed
    for key in ("levels", "pilot_models", "n_iters"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    if len({level_key(v) for v in config["levels"]}) != len(config["levels"]):
        raise ExperimentError(f"--levels has repeated values: {config['levels']}; give each "
                              f"loss rise once")
    device = device_name(args.device)
    if device is not None:  # key only off the CPU, as for vision
        config["population"]["device"] = device
    if not args.synthetic:  # fail early with the preparing command
        V.require_data(config["population"], args.data_dir)

    def prepare(od, ckpt, threads):
        V.pretrain(config["population"], ckpt, threads, args.data_dir, not args.no_progress, log)
        cal = calibrate(config, od, ckpt, data_dir=args.data_dir, workers=args.workers,
                        threads=args.threads or threads, progress=not args.no_progress, log=log)
        run_config = resolved(config, cal)
        check_rho_unchanged(od, run_config)
        return None if args.calibrate_only else run_config

    return run_population_study(sys.modules[__name__], config, args, prepare=prepare, log=log,
                                report_kwargs=dict(report_fn=report))
