r"""What the hyperparameters of a text or vision population explain
(:mod:`quotient_manifolds.experiments.population_summary`): τ within the levels of each
categorical knob (:func:`within_section`) and R² of each knob for the target and for every
measure (:func:`knob_r2`, :func:`r2_section`); the knobs of records that declare none
(:func:`default_knobs`)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .reporting import value_of
from .stats import dummies, r_squared, within_tau_with_ci


def within_section(taus, knobs: Sequence[Tuple[str, str, str]],
                    measures: Sequence[str], summary: Dict[str, Any]) -> List[str]:
    """τ within the levels of each categorical knob with few levels (pairs of models that share
    the knob's value only). ``taus``: the report's τ's (``used`` models, ``default_rho``, target
    values ``y``, ``n_boot``; population_summary._PopulationTaus)."""
    used = taus.used
    strata = [(label, key) for label, key, how in knobs if how == "categorical"
              and all(key in r["hparams"] for r in used)
              and 1 < len({repr(r["hparams"][key]) for r in used}) < len(used) / 2]
    if not strata:
        return []
    summary["within"] = {}
    lines = ["## τ within the levels of each categorical knob (τ-b [95% CI])", "",
             "Only pairs of models that share the knob's value (e.g. the same label "
             "smoothing) are compared (`within_tau_with_ci`, bootstrap within levels): a knob "
             "that moves sharpness and the gap together cannot make these τ's.", "",
             "| measure | " + " | ".join(f"within {lab}" for lab, _ in strata) + " |",
             "|---|" + "---|" * len(strata)]
    for m in measures:
        x = [value_of(r, m, taus.default_rho[m]) for r in used]
        cells = []
        for lab, key in strata:
            w = within_tau_with_ci(x, taus.y, [repr(r["hparams"][key]) for r in used],
                                   n_boot=taus.n_boot)
            summary["within"].setdefault(m, {})[lab] = w.as_dict()
            cells.append(w.fmt())
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines + [""]


def r2_section(used, target: str, measures: Sequence[str], default_rho: Dict[str, float],
                knobs: Optional[Sequence[Tuple[str, str, str]]], summary: Dict[str, Any]
                ) -> List[str]:
    r2 = knob_r2(used, target, [(m, default_rho[m]) for m in measures], knobs)
    if not r2["columns"]:
        return []
    summary["r2"] = r2
    heads = [target] + [f"{'log ' if r2['log'].get(m) else ''}{m}" for m in measures]
    lines = ["## R² of each hyperparameter (least squares on one knob; last row: all knobs)",
             "", f"How much of the {target} and of each measure each knob explains "
             "(measures: log of the value where all values are positive; categorical knobs "
             "as dummies).", "",
             "| knob | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for k in list(r2["columns"]) + ["all knobs"]:
        lines.append(f"| {k} | " + " | ".join(_r2fmt(r2["values"][col].get(k))
                                               for col in [target] + list(measures)) + " |")
    return lines + [""]


def _r2fmt(v: Optional[float]) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v:.2f}"



def _knob_transform(values: Sequence[Any], how: str):
    if how == "log":
        return np.log(np.asarray(values, float))
    if how == "categorical":
        return dummies(values)
    return np.asarray(values, float)


def default_knobs(records) -> List[Tuple[str, str, str]]:
    """Knobs of records without a declared list: every hyperparameter except the seed that varies;
    booleans and ≤ 3 distinct values categorical, positive values spanning ≥ 10× logarithmic."""
    out = []
    for key in sorted({k for r in records for k in r.get("hparams", {})} - {"seed"}):
        vals = [r["hparams"].get(key) for r in records]
        if any(v is None or isinstance(v, (str, list, dict)) for v in vals) or len(set(vals)) < 2:
            continue
        if any(isinstance(v, bool) for v in vals) or len(set(vals)) <= 3:
            out.append((f"{key} (categorical)", key, "categorical"))
        elif min(vals) > 0 and max(vals) >= 10 * min(vals):
            out.append((f"log {key}", key, "log"))
        else:
            out.append((key, key, "linear"))
    return out


def knob_r2(records, target: str, measures: Sequence[Tuple[str, float]],
            knobs: Optional[Sequence[Tuple[str, str, str]]] = None) -> Dict[str, Any]:
    """R² (:func:`r_squared`) of the target and of each measure on each knob alone and on all
    knobs together. ``knobs``: (label, hparams key, "log" | "linear" | "categorical"); default
    :func:`default_knobs`. Knobs constant over the records are skipped. A measure is taken as its
    log when all its values are positive."""
    knobs = [k for k in (knobs if knobs is not None else default_knobs(records))
             if len({repr(r["hparams"].get(k[1])) for r in records}) > 1
             and all(k[1] in r["hparams"] for r in records)]
    cols = {label: _knob_transform([r["hparams"][key] for r in records], how)
            for label, key, how in knobs}
    out: Dict[str, Any] = {"columns": list(cols), "values": {}, "log": {}}
    ys = {target: np.array([float(r["metrics"].get(target, np.nan)) for r in records])}
    for m, rho in measures:
        v = np.array([value_of(r, m, rho) for r in records])
        out["log"][m] = bool(np.isfinite(v).all() and (v > 0).all())
        ys[m] = np.log(v) if out["log"][m] else v
    for name, yv in ys.items():
        ok = np.isfinite(yv)
        row: Dict[str, float] = {}
        if ok.sum() >= 3 and cols:
            for label, c in cols.items():
                row[label] = r_squared(yv[ok], np.asarray(c)[ok])
            row["all knobs"] = r_squared(yv[ok], *[np.asarray(c)[ok] for c in cols.values()])
        out["values"][name] = row
    return out
