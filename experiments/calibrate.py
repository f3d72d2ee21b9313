r"""Calibration of the sharpness radius ρ per family (adaptive / inv / mix) on a pilot of models.

Goal (issue: sharpness in the paper's regime): the median worst-case sharpness over the population
is ``target`` nats (default 3; acceptable band 1–10), for each family's main measure
(adaptive, geodesic-inv, geodesic-mix; docs/maths.md §12.14: the three ρ are not comparable, the
mix ρ has units).

Protocol
--------
1. **Pilot**: the first ``pilot_models`` (6) models of the population, trained (or fine-tuned) and
   checkpointed exactly as the population's (the main run reuses their checkpoints), sharpness on
   the first ``points`` (512) of the fixed sharpness points (whole batches of ``sharp_batch``; the
   per-batch worst case has the same expectation as on all points, with more noise), the study's
   ``n_iters`` Auto-PGD iterations.
2. **Per pilot model i, per family**: the radius ρᵢ where its sharpness Sᵢ(ρ) equals the target,
   by the library's safeguarded secant in (log ρ, log S) (``adapters.calibration.find_rho``,
   the search behind ``adapters.calibrate_rho``): start at the configuration's ρ,
   step by (target/S)^{1/2} (S ∝ ρ² near a minimum, at most ×10 per step) until the target is
   bracketed, then regula falsi in log–log inside the bracket (kept at least 10 % of the bracket
   away from its ends) until |log(S/target)| ≤ log(``tolerance``) (1.25) or ``max_evals`` (6)
   evaluations. A non-finite loss counts as "above". ρᵢ is the log–log interpolation inside the
   final bracket (else the closest value corrected with slope 2).
3. **Combine**: ρ* = exp(median_i log ρᵢ). Since each Sᵢ is increasing in ρ, Sᵢ(ρ) ≥ target ⇔
   ρ ≥ ρᵢ, so the median over the pilot of Sᵢ(ρ*) is the target (for an even pilot, ρ* is the
   geometric mean of the two middle ρᵢ). ``predicted_pilot_median`` interpolates each model's
   evaluations at ρ*; the report gives the population's actual median at ρ*.

Everything is saved in ``DIR/calibration.json`` (per model: ρᵢ, every (ρ, S) evaluated, whether it
converged) and the per-model work in ``DIR/calibration.jsonl`` (crash-safe like results.jsonl, so
a killed calibration resumes). A finished calibration.json of the same configuration hash is
reused, never recomputed; the population then runs with ρ* (recorded in every result line's
``study_config``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from quotient_manifolds.adapters.calibration import find_rho, interpolate_at

from .measures import FAMILY_MEASURE, batch_len, first_points, on_study_device, run_plan
from .runner import ExperimentError, atomic_write_bytes, check_parent_alive, fmt_seconds, load_current, run_population

CALIBRATION = "calibration.json"
PILOT_RESULTS = "calibration.jsonl"
FAMILIES = ("adaptive", "inv", "mix")


def calibration_defaults() -> Dict[str, Any]:
    """The calibration settings of a configuration (``config["calibration"]``)."""
    return dict(families=list(FAMILIES), target=3.0, band=[1.0, 10.0], pilot_models=6,
                points=512, tolerance=1.25, max_evals=6)


def families_to_calibrate(config: Dict[str, Any]) -> List[str]:
    cal = config.get("calibration") or {}
    return [f for f in cal.get("families", []) if f in FAMILIES]


# ------------------------------------------------------------------------------------ pilot job
def pilot_job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
              progress: bool, *, load_data, get_model, sharpness_batches) -> Dict[str, Any]:
    """One pilot model (run in a worker): train or reuse it, then :func:`find_rho` per family on
    the first ``calibration.points`` sharpness points."""
    started = time.perf_counter()
    cal = config["calibration"]
    data = load_data(config, data_dir)
    model, hp, info = get_model(model_id, config, data, ckpt_dir, progress)
    batches = on_study_device(first_points(sharpness_batches(config, data), int(cal["points"])),
                              config)
    out: Dict[str, Any] = dict(hparams=hp, checkpoint=info["checkpoint"],
                               weights_sha256=info.get("weights_sha256"),
                               n_points=sum(batch_len(b) for b in batches), families={})
    for fam in families_to_calibrate(config):
        measure = FAMILY_MEASURE[fam]
        t0 = time.perf_counter()

        def f(rho: float) -> float:
            entry = run_plan(model, batches, [(measure, rho)], n_iters=config["n_iters"],
                             eps=config["eps"], check=check_parent_alive)[0]
            return float(entry["value"])

        res = find_rho(f, float(config["rho"][fam]), float(cal["target"]),
                       tolerance=float(cal["tolerance"]), max_evals=int(cal["max_evals"]))
        out["families"][fam] = dict(measure=measure, time_s=time.perf_counter() - t0, **res)
    out["timing"] = dict(train_s=info["train_time_s"], total_s=time.perf_counter() - started)
    return out


# ------------------------------------------------------------------------------------ combine
def combine_roots(per: Dict[str, Dict[str, Any]], what: str = "ρ") -> Dict[str, Any]:
    """ρ* = exp(median_i log ρᵢ) over the pilot models' :func:`find_rho` results ``per``
    (model id -> {root, evals, converged}), with each model's loss rise interpolated at ρ*
    (module docstring, step 3). Models without a finite positive root are left out of the median
    (their evaluations are kept); none at all raises :class:`ExperimentError`."""
    roots = np.array([p["root"] for p in per.values()], dtype=float)
    good = roots[np.isfinite(roots) & (roots > 0)]
    if good.size == 0:
        raise ExperimentError(f"calibration of {what} failed on every pilot model (no "
                              f"finite positive sharpness); see {PILOT_RESULTS}")
    rho = float(np.exp(np.median(np.log(good))))
    predicted = [interpolate_at(p["evals"], rho) for p in per.values()]
    return dict(rho=rho, roots={k: p["root"] for k, p in per.items()},
                predicted_pilot_median=float(np.nanmedian(predicted)),
                predicted_pilot_values=dict(zip(per, predicted)),
                converged=sum(bool(p["converged"]) for p in per.values()),
                evals={k: p["evals"] for k, p in per.items()},
                evaluations=int(sum(len(p["evals"]) for p in per.values())))


def combine(records: Sequence[Dict[str, Any]], config: Dict[str, Any], config_hash: str
            ) -> Dict[str, Any]:
    """calibration.json from the pilot records (module docstring, step 3)."""
    cal = config["calibration"]
    fams = families_to_calibrate(config)
    out: Dict[str, Any] = dict(config_hash=config_hash, target=cal["target"], band=cal["band"],
                               pilot_models=[r["model_id"] for r in records],
                               points=records[0]["n_points"] if records else None,
                               n_iters=config["n_iters"], method="per-model safeguarded secant "
                               "in (log ρ, log S); ρ* = geometric median of the per-model roots",
                               rho=dict(config["rho"]), calibrated=fams, families={},
                               created=_dt.datetime.now().isoformat(timespec="seconds"))
    for fam in fams:
        per = {str(r["model_id"]): r["families"][fam] for r in records}
        found = combine_roots(per, what=f"the {fam} ρ")
        out["rho"][fam] = found["rho"]
        out["families"][fam] = dict(measure=next(iter(per.values()))["measure"], **found)
    return out


def load(path: str) -> Optional[Dict[str, Any]]:
    """DIR/calibration.json (or the file) if present and readable, else None."""
    path = os.path.join(path, CALIBRATION) if os.path.isdir(path) else path
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def calibrate(mod, config: Dict[str, Any], od, ckpt_dir: str, *, data_dir: Optional[str],
              workers: int, threads: Optional[int], progress: bool, log=print
              ) -> Optional[Dict[str, Any]]:
    """Run (or reuse) the calibration of ``config`` in the output directory ``od`` and return
    calibration.json's content; None when no family is calibrated."""
    fams = families_to_calibrate(config)
    if not fams:
        return None
    found = load(od.file(CALIBRATION))
    if found is not None and found.get("config_hash") == od.hash:
        log(f"calibration: reusing {od.file(CALIBRATION)} (ρ = "
            + ", ".join(f"{f} {found['rho'][f]:.4g}" for f in fams) + ")")
        _record_rho(od, config, found)
        return found
    cal = config["calibration"]
    pilot = list(range(int(cal["pilot_models"])))
    log(f"calibration: ρ of {', '.join(fams)} so that the median sharpness of {len(pilot)} "
        f"pilot models is {cal['target']:g} nats (per-model work in {od.file(PILOT_RESULTS)})")
    result = run_pilot(od, mod.calibration_job, pilot, config, ckpt_dir,
                       combine_records=lambda records: combine(records, config, od.hash),
                       data_dir=data_dir, workers=workers, threads=threads, progress=progress,
                       log=log)
    for f in fams:
        d = result["families"][f]
        log(f"  {f}: ρ* = {d['rho']:.4g} (pilot roots "
            + ", ".join(f"{v:.3g}" for v in d["roots"].values())
            + f"; predicted pilot median {d['predicted_pilot_median']:.3g} nats, "
            f"{d['converged']}/{len(pilot)} converged)")
    log(f"calibration done in {fmt_seconds(result['wall_s'])}")
    _record_rho(od, config, result)
    return result


def run_pilot(od, job, pilot: Sequence[int], config: Dict[str, Any], ckpt_dir: str, *,
              combine_records, data_dir: Optional[str], workers: int, threads: Optional[int],
              progress: bool, log=print) -> Dict[str, Any]:
    """Run ``job(model_id, config, ckpt_dir, data_dir, progress)`` on the ``pilot`` models (their
    records crash-safe in ``DIR/calibration.jsonl``, so a killed calibration resumes), combine
    them with ``combine_records(records)`` and write the result, with its wall time, to
    ``DIR/calibration.json``; returns it."""
    started = time.perf_counter()
    records, failed = run_population(
        od, job, pilot, (config, ckpt_dir, data_dir, progress and workers <= 1),
        workers=workers, progress=progress, log=log, desc="calibration", threads=threads,
        results=PILOT_RESULTS)
    if failed:
        raise ExperimentError(f"calibration failed on pilot model(s) {failed} (see "
                              f"{od.file('errors.jsonl')}); rerun to retry them")
    result = combine_records(records)
    result["wall_s"] = time.perf_counter() - started
    atomic_write_bytes(od.file(CALIBRATION),
                       (json.dumps(result, indent=1, sort_keys=True) + "\n").encode())
    return result


def _record_rho(od, config: Dict[str, Any], calibration: Dict[str, Any]) -> None:
    """config.json's ``config.rho`` holds the calibration's starting values (they are part of the
    configuration hash); the ρ the sharpness is measured at goes beside it as ``rho_used``."""
    od.record_in_config("rho_used", resolved(config, calibration)["rho"])


def resolved(config: Dict[str, Any], calibration: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``config`` with the calibrated ρ in place of the starting values."""
    if not calibration:
        return config
    rho = dict(config["rho"])
    for f in calibration.get("calibrated", []):
        rho[f] = float(calibration["rho"][f])
    return {**config, "rho": rho}


def check_rho_unchanged(od, run_config: Dict[str, Any]) -> None:
    """Refuse to go on when results.jsonl holds models measured at another ρ than the calibration
    gives now (calibration.json changed or removed after they ran)."""
    stale = [r["model_id"] for r in load_current(od.path, od.hash)
             if r.get("study_config", {}).get("rho") != run_config["rho"]]
    if stale:
        raise ExperimentError(
            f"{od.file('results.jsonl')} holds models {stale[:8]} measured at another ρ than "
            f"{od.file('calibration.json')} gives ({run_config['rho']}); the calibration file "
            f"was changed or removed. Restore it, or use another --out")

