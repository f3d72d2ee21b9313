r"""Reports of the correlation studies: Kendall τ tables with bootstrap CIs beside the paper's
Table 1 (docs/maths.md §11.6), ρ sweeps, ablations, and figures in the style of the paper's
Figs. 3–5 (generalisation gap against sharpness, one panel per measure, τ in the title)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .stats import (TauResult, paired_delta_tau, partial_tau_with_ci, tau_ci_weighted, tau_with_ci,
                    r_squared, within_partial_tau_with_ci, within_tau_with_ci)
from .runner import display_path  # also imported from here by the studies
from .studies import STUDY

# docs/maths.md §11.6 (paper Table 1). Our text study is the analogue of MNLI/BERT, vision of
# ImageNet/CLIP.
PAPER: Dict[str, Dict[str, Any]] = {
    "diagonal": {"label": "Diagonal nets", "adaptive": -0.68, "geodesic-inv": -0.83,
                 "geodesic-mix": -0.86},
    "vision": {"label": "ImageNet (CLIP ViT-B/32)", "adaptive": -0.41, "geodesic-inv": -0.71,
               "geodesic-mix": -0.70},
    "text": {"label": "MNLI (BERT)", "adaptive": 0.06, "geodesic-inv": 0.28,
             "geodesic-mix": 0.38},
}
TARGET_LABEL = {"gap": "generalisation gap (test err − train err)",
                "gap_own": "gap on own training subset (test err − own train err)",
                "test_error": "test error", "test_loss": "test loss"}
# the training loss on the same points the gap's train error is measured on: the partial τ holds it
# fixed, since sharpness and gap both grow as a model fits its training data
GAP_CONTROL = {"gap": "train_loss", "gap_own": "own_train_loss"}


def value_of(record: Dict[str, Any], measure: str, rho: float) -> float:
    for e in record.get("sharpness", []):
        if e["measure"] == measure and math.isclose(e["rho"], rho, rel_tol=1e-9):
            v = e.get("value")
            return float(v) if v is not None else float("nan")
    return float("nan")


def rhos_of(records: Sequence[Dict[str, Any]], measure: str) -> List[float]:
    out: List[float] = []
    for r in records:
        for e in r.get("sharpness", []):
            if e["measure"] == measure and not any(math.isclose(e["rho"], x, rel_tol=1e-9)
                                                   for x in out):
                out.append(float(e["rho"]))
    return sorted(out)


def measures_of(records: Sequence[Dict[str, Any]]) -> List[str]:
    out: List[str] = []
    for r in records:
        for e in r.get("sharpness", []):
            if e["measure"] not in out:
                out.append(e["measure"])
    return out


def tau_for(records, measure: str, rho: float, target: str, *, n_boot: int = 2000,
            seed: int = 0) -> TauResult:
    x = [value_of(r, measure, rho) for r in records]
    y = [float(r["metrics"].get(target, float("nan"))) for r in records]
    return tau_with_ci(x, y, n_boot=n_boot, seed=seed)


#: the paired bootstrap of Δτ: resamples and seed, fixed and recorded in every summary. 40000
#: resamples: two seeds give CI ends within 0.006 of each other on every committed text / vision
#: population; the diagonal draws (5 clusters: a discrete bootstrap distribution) within 0.02
#: (measured: docs/results.md, "How the intervals are computed").
PAIRED_N_BOOT = 40000
PAIRED_SEED = 20251125
#: the references every measure is compared with, where the population has them: the paper's
#: baseline (Andriushchenko et al.'s adaptive sharpness) and our adaptive
PAIRED_REFERENCES = ("adaptive-andriushchenko", "adaptive")


def paired_section(y: np.ndarray,
                   views: Sequence[Tuple[str, str, Dict[str, Any], Dict[str, np.ndarray]]],
                   summary: Dict[str, Any], *, n_boot: int = PAIRED_N_BOOT,
                   seed: int = PAIRED_SEED) -> List[str]:
    """The paired-bootstrap Δτ tables: for each view (name, what is resampled, keyword arguments
    of :func:`stats.paired_delta_tau`, e.g. ``clusters``, and the columns: measure -> its values on
    the models), τ-b of every measure and Δτ = τ(measure) − τ(reference) for each reference of
    :data:`PAIRED_REFERENCES` among the view's columns, both τ's on the same resampled models."""
    views = [v for v in views if any(r in v[3] for r in PAIRED_REFERENCES)]
    if not views:
        return []
    out: Dict[str, Any] = {"n_boot": n_boot, "seed": seed, "level": 0.95,
                           "references": [r for r in PAIRED_REFERENCES
                                          if any(r in v[3] for v in views)], "views": {}}
    lines = ["## Paired comparisons: Δτ against the paper's baseline and our adaptive", "",
             ("The paper's baseline is `adaptive-andriushchenko` (Andriushchenko et al.'s "
              "adaptive sharpness). " if PAIRED_REFERENCES[0] in out["references"] else
              "This population has no measurement of the paper's baseline "
              "(`adaptive-andriushchenko`). ")
             + "Δτ = τ-b(measure, target) − τ-b(reference, target) on the same models; 95 % "
             f"percentile CI of a paired bootstrap (both τ's on each resample; {n_boot} resamples, "
             f"seed {seed}; `stats.paired_delta_tau`). A Δτ whose CI excludes 0 separates the two "
             "measures on this population; the sign of a better measure is that of the target's "
             "expected association.", ""]
    for name, unit, kw, columns in views:
        refs = [r for r in PAIRED_REFERENCES if r in columns]
        rows: Dict[str, Any] = {}
        lines += [f"### {name} ({unit})", "",
                  "| measure | τ-b [95% CI] | n | " + " | ".join(f"Δτ vs {r} [95% CI]" for r in refs)
                  + " |", "|---|---|---|" + "---|" * len(refs)]
        for m, x in columns.items():
            t = tau_ci_weighted(x, y, n_boot=n_boot, seed=seed, **kw)
            ds = {r: paired_delta_tau(x, columns[r], y, n_boot=n_boot, seed=seed, **kw)
                  for r in refs if r != m}
            rows[m] = {**t.as_dict(), "vs": {r: d.as_dict() for r, d in ds.items()}}
            lines.append(f"| {m} | {t.fmt()} | {t.n} | " + " | ".join(
                ds[r].fmt() + ("" if ds[r].n == t.n else f" (n={ds[r].n})") if r in ds else "—"
                for r in refs) + " |")
        out["views"][name] = {"unit": unit, "references": refs, "rows": rows}
        lines.append("")
    summary["paired"] = out
    return lines


def _fmt_rho(r: float) -> str:
    return "—" if r == 0 else f"{r:g}"  # 0: a curvature measure (no radius)


def _fig_scatter(path: str, records, panels: Sequence[Tuple[str, float]], target: str,
                 taus: Dict[Tuple[str, float], TauResult], title: str, logx: bool = False,
                 logy: bool = False) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(3.1 * n, 2.9), squeeze=False)
    y = np.array([float(r["metrics"].get(target, np.nan)) for r in records])
    for ax, (m, rho) in zip(axes[0], panels):
        x = np.array([value_of(r, m, rho) for r in records])
        ok = np.isfinite(x) & np.isfinite(y)
        ax.scatter(x[ok], y[ok], s=14, c="#1f77b4", alpha=0.8, edgecolors="none")
        t = taus.get((m, rho))
        name = m if rho == 0 else f"{m} (ρ={_fmt_rho(rho)})"  # ρ = 0: a curvature measure
        ax.set_title(f"{name}\nτ = {t.tau_b:+.2f}" if t and math.isfinite(t.tau_b) else name,
                     fontsize=9)
        ax.set_xlabel("sharpness", fontsize=8)
        if logx and ok.any() and (x[ok] > 0).all():
            ax.set_xscale("log")
        if logy and ok.any() and (y[ok] > 0).all():
            ax.set_yscale("log")
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel(TARGET_LABEL.get(target, target), fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fig_sweep(path: str, sweep: Dict[str, List[Tuple[float, TauResult]]], title: str,
               relative_to: Optional[Dict[str, float]] = None) -> None:
    """τ against ρ per measure; with ``relative_to`` (each measure's main ρ, e.g. the calibrated
    one) against ρ / ρ_main, so measures whose ρ have different scales share one axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 3.0))
    for m, rows in sweep.items():
        rows = [(r, t) for r, t in rows if math.isfinite(t.tau_b)]
        if not rows:
            continue
        rs = np.array([r for r, _ in rows]) / (relative_to[m] if relative_to else 1.0)
        tb = np.array([t.tau_b for _, t in rows])
        lo = np.array([t.ci_low for _, t in rows])
        hi = np.array([t.ci_high for _, t in rows])
        ax.plot(rs, tb, marker="o", ms=3, label=m)
        if np.isfinite(lo).all():
            ax.fill_between(rs, lo, hi, alpha=0.15)
    ax.set_xscale("log")
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.axhline(0, color="k", lw=0.5)
    finish_figure(fig, ax, path, title=title,
                  xlabel=("ρ / the measure's main (calibrated) ρ" if relative_to else
                          "ρ (mix ρ has units; not comparable across measures)"),
                  ylabel="Kendall τ-b")


def finish_figure(fig, ax, path: str, *, title: str, xlabel: str, ylabel: str) -> None:
    """Labels, legend and small fonts of the report figures; save and close."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _PopulationTaus:
    """The τ's of one population report, each computed once: τ-b of a (measure, ρ) with the target
    and, where the control ``z`` (the training loss of the gap's train error) is known, the
    partial τ given it."""

    def __init__(self, used: List[Dict[str, Any]], target: str, default_rho: Dict[str, float],
                 n_boot: int, y: List[float], z: Optional[List[float]]):
        self.used, self.target, self.default_rho, self.n_boot = used, target, default_rho, n_boot
        self.y, self.z = y, z
        self.taus: Dict[Tuple[str, float], TauResult] = {}
        self.partials: Dict[str, TauResult] = {}

    def at(self, m: str, rho: float) -> TauResult:
        t = self.taus.get((m, rho)) or tau_for(self.used, m, rho, self.target, n_boot=self.n_boot)
        self.taus[(m, rho)] = t
        return t

    def row(self, m: str) -> Tuple[TauResult, Optional[TauResult]]:
        """τ at the measure's main ρ and the partial τ given the control (None without one)."""
        rho = self.default_rho[m]
        t = self.at(m, rho)
        if self.z is not None and m not in self.partials:
            self.partials[m] = partial_tau_with_ci([value_of(r, m, rho) for r in self.used],
                                                   self.y, self.z, n_boot=self.n_boot)
        return t, self.partials.get(m)


def _population_header(out_dir: str, study: str, config_hash: str, records, used, target: str,
                       synthetic: bool, exclude: Dict[int, str], wall_s: Optional[float],
                       n_boot: int, source: Optional[str], second_passes: Sequence[str]
                       ) -> List[str]:
    banner = ("\n> **SYNTHETIC DATA — smoke test only; these numbers mean nothing about the "
              "paper.**\n" if synthetic else "")
    span = _finish_span(records)
    when = ((f"wall time of this run: {wall_s:.0f} s" if wall_s is not None else
             "recomputed from results.jsonl by `quotient-manifolds report`")
            + (f"; the models were computed over {span:.0f} s (first start to last finish)"
               if span is not None else ""))
    return [f"# {study} study: Kendall τ of sharpness vs {TARGET_LABEL.get(target, target)}",
            banner,
            f"- output: `{display_path(out_dir)}`  (config hash `{config_hash}`)"
            + (f"; records: `{display_path(source)}`" if source else "")
            + "".join(f" + `{display_path(os.path.join(os.path.dirname(source), p))}`"
                      for p in second_passes if source),
            f"- models: {len(used)} used" + (f", {len(exclude)} excluded (listed under "
                                             "Population)" if exclude else ""),
            f"- generated: {_dt.datetime.now().isoformat(timespec='seconds')}; {when}",
            f"- τ-b with 95 % percentile-bootstrap CI over models ({n_boot} resamples); τ-a is "
            f"the paper's formula (docs/maths.md §11.1)", ""]


def _main_section(taus: _PopulationTaus, measures: Sequence[str], paper: Dict[str, Any],
                  control: Optional[str], summary: Dict[str, Any]) -> List[str]:
    """τ-b, τ-a and partial τ of the main (and extra) measures beside the paper's Table 1 row."""
    used, rho = taus.used, taus.default_rho
    lines = [f"## Main measures (paper Table 1 row: {paper.get('label', '—')})", "",
             f"| measure | ρ | points | τ-b [95% CI] | τ-a | partial τ given {control or '—'} "
             "| paper τ |", "|---|---|---|---|---|---|---|"]
    for m in measures:
        t, pt = taus.row(m)
        ref = paper.get(m)
        lines.append(f"| {m} | {_fmt_rho(rho[m])} | {_points(used, m, rho[m])} | "
                     f"{t.fmt()} | {t.tau_a:+.2f} | {pt.fmt() if pt else '—'} | "
                     f"{'' if ref is None else f'{ref:+.2f}'} |")
        summary["main"][m] = {"rho": rho[m], **t.as_dict(), "paper": ref,
                              **({"partial": pt.as_dict()} if pt else {})}
    return lines + [""]


def _paired_views(used, measures: Sequence[str], default_rho: Dict[str, float]
                  ) -> List[Tuple[str, str, Dict[str, Any], Dict[str, np.ndarray]]]:
    """The views of :func:`paired_section` for a population: the calibrated ρ (all models, and
    within stopping epochs where training stops at a threshold) and ρ × 0.1, ρ × 10."""
    def at(factor: float) -> Dict[str, np.ndarray]:  # the measures with values at factor × ρ
        cols = {m: np.array([value_of(r, m, default_rho[m] * factor) for r in used])
                for m in measures}
        return {m: v for m, v in cols.items() if np.isfinite(v).sum() >= 3}

    plain = "models resampled with replacement"
    views: List[Tuple[str, str, Dict[str, Any], Dict[str, np.ndarray]]] = [
        ("calibrated ρ", plain, {}, at(1.0))]
    stop = [r["metrics"].get("epochs_used") for r in used]
    if all(isinstance(v, (int, float)) for v in stop) and 1 < len(set(stop)) < len(used) / 2:
        # training stops at a train-error threshold, so the epochs used track sharpness: compare
        # only models that stopped at the same epoch
        views.append(("calibrated ρ, within stopping epoch", "pairs of models that stopped at "
                      "the same epoch; models resampled within each stopping epoch",
                      {"strata": stop, "within": True}, at(1.0)))
    for factor in (0.1, 10.0):  # the sweep's radii, where measured
        views.append((f"ρ × {factor:g}", plain, {}, at(factor)))
    return views


def _curvature_section(taus: _PopulationTaus, curvature: Sequence[str], control: Optional[str],
                       summary: Dict[str, Any]) -> List[str]:
    summary["curvature"] = {}
    lines = ["## Curvature at the trained weights (adapters.hessian)", "",
             "Trace and largest eigenvalue of the Riemannian Hessian on the quotient (inv / "
             "mix metric on the GL blocks, adaptive metric elsewhere; docs/maths.md §4) and "
             "of the Euclidean Hessian (not GL-invariant), on the first "
             f"{_points(taus.used, curvature[0], 0.0)} sharpness points.", "",
             f"| measure | median value | τ-b [95% CI] | τ-a | partial τ given "
             f"{control or '—'} |", "|---|---|---|---|---|"]
    for m in curvature:
        t, pt = taus.row(m)
        vals = np.array([value_of(r, m, 0.0) for r in taus.used])
        med = _nanmedian(vals)
        lines.append(f"| {m} | {med:.4g} | {t.fmt()} | {t.tau_a:+.2f} | "
                     f"{pt.fmt() if pt else '—'} |")
        summary["curvature"][m] = {"median": med, **t.as_dict(),
                                   **({"partial": pt.as_dict()} if pt else {})}
    return lines + [""]


def _sweep_section(taus: _PopulationTaus, main: Sequence[str], summary: Dict[str, Any],
                   fig_path: str, title: str) -> List[str]:
    """τ at every ρ of each main measure (and its figure, where a measure has several ρ)."""
    used = taus.used
    sweep: Dict[str, List[Tuple[float, TauResult]]] = {}
    for m in main:
        rows = [(rho, taus.at(m, rho)) for rho in rhos_of(used, m)]
        sweep[m] = rows
        summary["sweep"][m] = [{"rho": r, "points": _points(used, m, r), **t.as_dict()}
                               for r, t in rows]
    if not any(len(v) > 1 for v in sweep.values()):
        return []
    lines = ["## ρ sweep (τ-b [95% CI]; points per value in parentheses)", "",
             "The mix ρ has units (docs/maths.md §12.14); inv and adaptive are "
             "scale-free.", ""]
    for m, rows in sweep.items():  # a radius measured on fewer models says so
        lines.append(f"- **{m}**: " + "; ".join(
            f"ρ={_fmt_rho(r)} ({_points(used, m, r)}"
            + ("" if t.n == len(used) else f"; {t.n} of {len(used)} models")
            + f"): {t.fmt()}" for r, t in rows))
    lines.append("")
    _fig_sweep(fig_path, sweep, title, relative_to={m: taus.default_rho[m] for m in sweep})
    return lines


def _ablation_section(taus: _PopulationTaus, abl: Sequence[str], summary: Dict[str, Any]
                      ) -> List[str]:
    used, rho = taus.used, taus.default_rho
    lines = ["## Ablations at the calibrated ρ (docs/maths.md §11.8, paper App. G)", "",
             "| measure | ρ | points | τ-b [95% CI] | τ-a | full measure τ-b |",
             "|---|---|---|---|---|---|"]
    for m in abl:
        t, _ = taus.row(m)
        full = "geodesic-" + m.split("-", 1)[0]
        ft = taus.taus.get((full, rho.get(full, float("nan"))))
        lines.append(f"| {m} | {_fmt_rho(rho[m])} | "
                     f"{_points(used, m, rho[m])} | {t.fmt()} | {t.tau_a:+.2f} | "
                     f"{ft.fmt() if ft else ''} |")
        summary["ablations"][m] = {"rho": rho[m], **t.as_dict()}
    return lines + [""]


def _other_targets_section(taus: _PopulationTaus, others: Sequence[str], measures: Sequence[str],
                           summary: Dict[str, Any]) -> List[str]:
    lines = ["## Other targets (τ-b [95% CI])", "",
             "| measure | ρ | " + " | ".join(others) + " |",
             "|---|---|" + "---|" * len(others)]
    for m in measures:
        rho = taus.default_rho[m]
        cells = []
        for tg in others:
            t = tau_for(taus.used, m, rho, tg, n_boot=taus.n_boot)
            summary["other_targets"].setdefault(tg, {})[m] = t.as_dict()
            cells.append(t.fmt())
        lines.append(f"| {m} | {_fmt_rho(rho)} | " + " | ".join(cells) + " |")
    return lines + [""]


def _partial_section(taus: _PopulationTaus, control: str, measures: Sequence[str],
                     summary: Dict[str, Any]) -> List[str]:
    """τ of each measure with the target and with the control, and the partial τ given it."""
    target, n_boot, z = taus.target, taus.n_boot, taus.z
    lines = [f"## Partial τ given {control} (τ-b [95% CI])", "",
             "Kendall's partial τ of sharpness and the gap with the training loss held fixed "
             "(`stats.partial_kendall_tau`; descriptive: not 0 in general even when the two "
             "are related only through the training loss).", "",
             f"| measure | ρ | τ(S, {target}) | τ(S, {control}) | partial τ |",
             "|---|---|---|---|---|"]
    ty = tau_with_ci(z, taus.y, n_boot=n_boot)
    for m in measures:
        rho = taus.default_rho[m]
        t, pt = taus.row(m)
        tz = tau_with_ci([value_of(r, m, rho) for r in taus.used], z, n_boot=n_boot)
        summary.setdefault("partial", {})[m] = {"rho": rho, "control": control,
                                                 **pt.as_dict(), "tau_control": tz.as_dict()}
        lines.append(f"| {m} | {_fmt_rho(rho)} | {t.fmt()} | {tz.fmt()} | {pt.fmt()} |")
    lines += ["", f"τ({control}, {target}) = {ty.fmt()}.", ""]
    summary["control_vs_target"] = ty.as_dict()
    return lines


def _within_section(taus: _PopulationTaus, knobs: Sequence[Tuple[str, str, str]],
                    measures: Sequence[str], summary: Dict[str, Any]) -> List[str]:
    """τ within the levels of each categorical knob with few levels (pairs of models that share
    the knob's value only)."""
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


def _r2_section(used, target: str, measures: Sequence[str], default_rho: Dict[str, float],
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


def _population_section(records, used, exclude: Dict[int, str], config: Dict[str, Any]
                        ) -> List[str]:
    """The metrics' ranges, time per model, the train-error target and the excluded models."""
    lines = ["## Population", ""] + _metric_ranges(used)
    times = [r.get("timing", {}).get("total_s") for r in records if r.get("timing")]
    if times:
        parts = {k: [r["timing"].get(k) for r in records if r.get("timing", {}).get(k) is not None]
                 for k in ("train_s", "sharpness_s", "curvature_s")}
        lines.append(f"- time per model (s): median {np.median(times):.1f}, max {max(times):.1f}, "
                     f"sum {sum(times):.0f}" + "".join(
                         f"; {k[:-2]} median {np.median(v):.1f}" for k, v in parts.items() if v))
    target_err = config.get("train_error_target")
    if target_err is not None:
        lines.append(f"- train-error target (own subset) ≤ {target_err:g}: "
                     f"{len(records) - len(exclude)} of {len(records)} models met it")
    for mid, why in sorted(exclude.items()):
        lines.append(f"- **excluded** model {mid}: {why}")
    return lines + [""]


def population_report(out_dir: str, study: str, config: Dict[str, Any], config_hash: str,
                      records: List[Dict[str, Any]], *, target: str, main: Sequence[str],
                      default_rho: Dict[str, float], extra_main: Sequence[str] = (),
                      ablations: Sequence[str] = (), other_targets: Sequence[str] = (),
                      curvature: Sequence[str] = (), knobs: Optional[Sequence[Tuple[str, str, str]]]
                      = None, calibration: Optional[Dict[str, Any]] = None,
                      synthetic: bool = False, notes: Sequence[str] = (),
                      wall_s: Optional[float] = None, exclude: Optional[Dict[int, str]] = None,
                      logx: bool = False, logy: bool = False, n_boot: int = 2000,
                      source: Optional[str] = None, second_passes: Sequence[str] = ()
                      ) -> Dict[str, Any]:
    """Write ``summary.md``, ``summary.json`` and figures of a text/vision population; return the
    summary dict. Every number is a function of ``records`` (the lines of results.jsonl), the
    arguments and ``calibration`` (calibration.json), so ``quotient-manifolds report DIR``
    reproduces it (:func:`report_from_results`; ``second_passes``: the directories of the second
    passes merged into ``records``, relative to ``source``'s directory, recorded in the summary so
    that it says how to recompute it).

    Sections: τ-b of each main / extra measure with the gap (bootstrap CI, τ-a, partial τ given
    the training loss of the gap's train error), the curvature measures, the ρ calibration and the
    population median at the calibrated ρ, the second-order vs exact retraction on the same points,
    the ρ sweep, the ablations, other targets, R² of each knob (:func:`knob_r2`) for the gap and
    for every measure, the population and the excluded models."""
    exclude = exclude or {}
    used = [r for r in records if r["model_id"] not in exclude]
    lines = _population_header(out_dir, study, config_hash, records, used, target, synthetic,
                               exclude, wall_s, n_boot, source, second_passes)
    summary: Dict[str, Any] = {"study": study, "config_hash": config_hash, "n_models": len(used),
                               "target": target, "synthetic": synthetic, "main": {},
                               "sweep": {}, "ablations": {}, "other_targets": {},
                               "excluded": {str(k): v for k, v in sorted(exclude.items())},
                               **({"second_passes": list(second_passes)} if second_passes else {})}
    if len(used) < 2:
        lines.append("Fewer than 2 models: no correlations yet.")
        write_summary(out_dir, lines, summary)
        return summary
    present = measures_of(used)
    main = [m for m in main if m in present]
    extra_main = [m for m in extra_main if m in present]
    curvature = [m for m in curvature if m in present]
    abl = [m for m in ablations if m in present]
    y = [float(r["metrics"].get(target, float("nan"))) for r in used]
    control = GAP_CONTROL.get(target)
    z = ([float(r["metrics"][control]) for r in used]
         if control and all(control in r["metrics"] for r in used) and len(used) >= 3 else None)
    taus = _PopulationTaus(used, target, default_rho, n_boot, y, z)
    tag = " [SYNTHETIC]" if synthetic else ""
    lines += _main_section(taus, main + extra_main, PAPER.get(study, {}), control, summary)
    lines += paired_section(np.asarray(y, float), _paired_views(used, main + extra_main,
                                                                default_rho), summary)
    if curvature:
        lines += _curvature_section(taus, curvature, control, summary)
    if calibration:
        lines += _calibration_section(calibration, used, default_rho, summary)
    lines += _retraction_section(used, [m for m in extra_main if m.endswith("-exact")],
                                 default_rho, target, n_boot, summary)
    lines += _sweep_section(taus, main, summary, os.path.join(out_dir, "fig_rho_sweep.png"),
                            f"{study}: τ vs ρ{tag}")
    if abl:
        lines += _ablation_section(taus, abl, summary)
        _fig_scatter(os.path.join(out_dir, "fig_ablations.png"), used,
                     [(m, default_rho[m]) for m in abl], target, taus.taus,
                     f"{study}: ablations{tag}", logx, logy)
    others = [t for t in other_targets if all(t in r["metrics"] for r in used)]
    if others:
        lines += _other_targets_section(taus, others, main + extra_main + curvature, summary)
    if z is not None:
        lines += _partial_section(taus, control, main + extra_main + abl + curvature, summary)
    lines += _within_section(taus, knobs if knobs is not None else default_knobs(used),
                             main + extra_main + curvature, summary)
    lines += _r2_section(used, target, main + extra_main + curvature, default_rho, knobs, summary)
    lines += _population_section(records, used, exclude, config)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    lines += ["## Configuration", "", "```json", json.dumps(config, indent=1, sort_keys=True,
                                                             default=str), "```", ""]
    _fig_scatter(os.path.join(out_dir, "fig_scatter.png"), used,
                 [(m, default_rho[m]) for m in main + extra_main], target, taus.taus,
                 f"{study}: {TARGET_LABEL.get(target, target)} vs sharpness ({len(used)} models)"
                 + tag, logx, logy)
    if curvature:
        _fig_scatter(os.path.join(out_dir, "fig_curvature.png"), used,
                     [(m, 0.0) for m in curvature], target, taus.taus,
                     f"{study}: {TARGET_LABEL.get(target, target)} vs curvature" + tag, False, logy)
    write_summary(out_dir, lines, summary)
    return summary


def _metric_ranges(records) -> List[str]:
    """"- key: min …, median …, max …" of every numeric metric of the records."""
    lines = []
    for key in sorted({k for r in records for k, v in r["metrics"].items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}):
        vals = np.array([float(r["metrics"][key]) for r in records
                         if isinstance(r["metrics"].get(key), (int, float))])
        lines.append(f"- {key}: min {vals.min():.4g}, median {np.median(vals):.4g}, "
                     f"max {vals.max():.4g}")
    return lines


def _points(records, measure: str, rho: float) -> str:
    """The number(s) of sharpness points behind ``measure`` at ``rho`` ("?" for old records)."""
    found = sorted({e.get("n_points") for r in records for e in r.get("sharpness", [])
                    if e["measure"] == measure and math.isclose(e["rho"], rho, rel_tol=1e-9)},
                   key=lambda v: (v is None, v))
    return "/".join("?" if v is None else str(v) for v in found) or "—"


def _r2fmt(v: Optional[float]) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v:.2f}"


def value_on(record: Dict[str, Any], measure: str, rho: float, n_batches: int) -> float:
    """The sharpness of ``measure`` at ``rho`` restricted to its first ``n_batches`` batches (the
    mean of its per-batch values), e.g. to compare with a measure taken on fewer points."""
    for e in record.get("sharpness", []):
        if e["measure"] == measure and math.isclose(e["rho"], rho, rel_tol=1e-9):
            pb = e.get("per_batch") or []
            return float(np.mean(pb[:n_batches])) if len(pb) >= n_batches else float("nan")
    return float("nan")


def _calibration_section(cal: Dict[str, Any], used, default_rho, summary) -> List[str]:
    """ρ* per family, the pilot's roots and the population's median at ρ* vs the band."""
    from .measures import FAMILY_MEASURE

    lo, hi = cal.get("band", [1.0, 10.0])
    lines = ["## ρ calibration (experiments/calibrate.py)", "",
             f"Target: median sharpness {cal.get('target')} nats over the population (band "
             f"{lo:g}–{hi:g}). Pilot: models {cal.get('pilot_models')} on the first "
             f"{cal.get('points')} sharpness points, {cal.get('n_iters')} iterations; per model the "
             "ρ where its sharpness is the target (safeguarded secant in log ρ, log S), "
             "ρ* = geometric median of these roots.", "",
             "| family | measure | ρ* | pilot roots (min … max) | evaluations | predicted pilot "
             "median | population median at ρ* | in band |", "|---|---|---|---|---|---|---|---|"]
    out: Dict[str, Any] = {}
    for fam in cal.get("calibrated", []):
        d = cal["families"][fam]
        m = FAMILY_MEASURE[fam]
        vals = np.array([value_of(r, m, default_rho.get(m, d["rho"])) for r in used])
        med = _nanmedian(vals)
        ok = lo <= med <= hi
        roots = [v for v in d["roots"].values() if v is not None and math.isfinite(v)]
        lines.append(f"| {fam} | {m} | {d['rho']:.4g} | "
                     f"{min(roots):.3g} … {max(roots):.3g} | {d.get('evaluations', '')} | "
                     f"{d['predicted_pilot_median']:.3g} | {med:.3g} | "
                     f"{'yes' if ok else '**NO**'} |")
        out[fam] = dict(rho=d["rho"], population_median=med, in_band=bool(ok),
                        predicted_pilot_median=d["predicted_pilot_median"])
    summary["calibration"] = out
    return lines + [""]


def _nanmedian(v) -> float:
    v = np.asarray(v, float)
    v = v[~np.isnan(v)]
    return float(np.median(v)) if v.size else float("nan")


def _retraction_section(used, exact: Sequence[str], default_rho, target: str, n_boot: int,
                        summary) -> List[str]:
    """The exact-geodesic measures beside the second-order one on the same batches, and the
    second-order point's gap to the exact geodesic at the worst perturbation
    (``retraction_gaps`` of adapters.sharpness) on all points."""
    lines: List[str] = []
    rows = []
    for m in exact:
        second = "geodesic-" + m.split("-", 1)[0]
        rho = default_rho[m]
        entries = [e for r in used for e in r["sharpness"]
                   if e["measure"] == m and math.isclose(e["rho"], rho, rel_tol=1e-9)]
        k = [len(e["per_batch"]) for e in entries if e.get("per_batch")]
        nb = min(k) if k else 0
        failed = sum("error" in e for e in entries)
        xs = np.array([value_of(r, m, rho) for r in used])
        x2 = np.array([value_on(r, second, default_rho[second], nb) if nb else np.nan
                       for r in used])
        t_e = tau_for(used, m, rho, target, n_boot=n_boot)
        t_2 = tau_with_ci(x2, [float(r["metrics"].get(target, np.nan)) for r in used],
                          n_boot=n_boot)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = x2 / xs
        rank = tau_with_ci(xs, x2, n_boot=1)
        rows.append((m, second, nb, t_e, t_2, ratio, rank, failed, len(entries)))
        summary.setdefault("retraction", {})[m] = dict(
            batches=nb, tau_exact=t_e.as_dict(), tau_second_order_same_batches=t_2.as_dict(),
            median_ratio_second_over_exact=_nanmedian(ratio), tau_exact_vs_second=rank.tau_b,
            undefined=failed, models=len(entries))
    gaps = {}
    for m in ("geodesic-inv", "geodesic-mix"):
        g = np.array([abs(v) for r in used for e in r["sharpness"] if e["measure"] == m
                      and math.isclose(e["rho"], default_rho.get(m, np.nan), rel_tol=1e-9)
                      for v in e.get("retraction_gaps", []) if v is not None], float)
        if g.size:
            fin = g[np.isfinite(g)]
            gaps[m] = (_nanmedian(fin), float(fin.max()) if fin.size else float("nan"),
                       int(g.size - fin.size), int(g.size))
    if not rows and not gaps:
        return lines
    lines += ["## Second-order vs exact geodesic", ""]
    if rows:
        lines += ["| exact measure | batches | undefined (geodesic left GL) | τ-b exact [95% CI] "
                  "| τ-b second order, same batches | median S_second / S_exact | "
                  "τ(S_exact, S_second) |", "|---|---|---|---|---|---|---|"]
        for m, second, nb, t_e, t_2, ratio, rank, failed, n in rows:
            lines.append(f"| {m} | {nb or '—'} | {failed} of {n} | {t_e.fmt()} | {t_2.fmt()} | "
                         f"{_nanmedian(ratio):.3g} | {rank.tau_b:+.2f} |")
        lines.append("")
    if gaps:
        lines += ["At the worst second-order perturbation of the main measures (every batch), the "
                  "exact geodesic with the same initial velocity (adapters.sharpness "
                  "`retraction_gaps`, 8 RK4 steps) changes the loss rise by |ΔS|/S: "
                  + "; ".join(f"{m}: median {a:.2g}, max {b:.2g}"
                              + (f", geodesic left GL on {k} of {n} batches" if k else "")
                              for m, (a, b, k, n) in gaps.items()) + ".", ""]
        summary["retraction_gaps"] = {m: {"median": a, "max": b, "left_manifold": k,
                                          "batches": n} for m, (a, b, k, n) in gaps.items()}
    return lines


def _knob_transform(values: Sequence[Any], how: str):
    if how == "log":
        return np.log(np.asarray(values, float))
    if how == "categorical":
        return _dummies(values)
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


def write_summary(out_dir: str, lines: List[str], summary: Dict[str, Any]) -> None:
    """DIR/summary.md (``lines``) and DIR/summary.json (``summary``), each written atomically."""
    from .runner import atomic_write_bytes
    atomic_write_bytes(os.path.join(out_dir, "summary.md"), ("\n".join(lines) + "\n").encode())
    atomic_write_bytes(os.path.join(out_dir, "summary.json"),
                       (json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n").encode())


def print_table(summary: Dict[str, Any], log=print) -> None:
    main = summary.get("main", {})
    if not main:
        return
    log(f"{'measure':26s} {'rho':>8s}  tau-b [95% CI]          tau-a   paper")
    for m, d in main.items():
        if not math.isfinite(d["tau_b"]):
            log(f"{m:26s} {d['rho']:8.4g}  n/a")
            continue
        ci = (f"[{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]" if math.isfinite(d["ci_low"])
              else "")
        paper = "" if d.get("paper") is None else f"{d['paper']:+.2f}"
        log(f"{m:26s} {d['rho']:8.4g}  {d['tau_b']:+.2f} {ci:17s} {d['tau_a']:+.2f}   {paper}")


# ------------------------------------------------------------------------------------ diagonal
# The diagonal study has several data draws and several knobs per model; its report is its own:
# τ pooled over all models, τ over within-draw pairs only, per draw, Kendall's partial τ given the
# initialisation scale and given the step factor, and R² of log test loss per knob. Everything is
# recomputed from the records alone (``quotient-manifolds report DIR``).
def _dummies(values) -> np.ndarray:
    """One-hot columns of a categorical variable, the first level dropped (intercept)."""
    values = np.asarray(values)
    levels = sorted(set(values.tolist()))
    return np.column_stack([(values == lv).astype(float) for lv in levels[1:]]) if len(levels) > 1 \
        else np.zeros((values.size, 0))


def _knob_columns(records) -> Dict[str, Any]:
    hp = [r["hparams"] for r in records]
    info = [r.get("train_info", {}) for r in records]
    return {"log α": np.log([h["alpha"] for h in hp]),
            "log step factor": np.log([i.get("lr_factor_used", h["lr_factor"])
                                       for h, i in zip(hp, info)]),
            "batch size (categorical)": _dummies([h["batch_size"] for h in hp]),
            "log large-step epochs": np.log([h["phase_epochs"] for h in hp])}


def diagonal_r2(records) -> Dict[str, float]:
    """R² of log test loss on each knob alone, on all knobs, and (several draws) all + draw."""
    y = np.log([float(r["metrics"]["test_loss"]) for r in records])
    cols = _knob_columns(records)
    out = {k: r_squared(y, c) for k, c in cols.items()}
    draws = [r["hparams"]["data_seed"] for r in records]
    if len(set(draws)) > 1:
        out["draw (categorical)"] = r_squared(y, _dummies(draws))
    out["all knobs"] = r_squared(y, *cols.values())
    if len(set(draws)) > 1:
        out["all knobs + draw"] = r_squared(y, *cols.values(), _dummies(draws))
    return out


def _num(v: float) -> str:
    return f"{v:+.2f}" if math.isfinite(v) else "n/a"


def _rng_fmt(vals) -> str:
    vals = [v for v in vals if math.isfinite(v)]
    return f"{min(vals):+.2f} … {max(vals):+.2f}" if vals else "n/a"


def _plain_log_ticks(ax) -> None:
    """Log axes with unlabelled minor ticks and small labels (no overlapping 2×10⁻³ labels)."""
    from matplotlib.ticker import NullFormatter
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.tick_params(which="both", labelsize=7)


def _fig_diagonal_scatter(path, records, panels, taus, title) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draws = sorted({r["hparams"]["data_seed"] for r in records})
    colours = plt.get_cmap("tab10")
    y = np.array([float(r["metrics"]["test_loss"]) for r in records])
    d = np.array([r["hparams"]["data_seed"] for r in records])
    fig, axes = plt.subplots(1, len(panels), figsize=(3.1 * len(panels), 3.0), squeeze=False)
    for ax, (m, rho) in zip(axes[0], panels):
        x = np.array([value_of(r, m, rho) for r in records])
        for k, s in enumerate(draws):
            ok = (d == s) & np.isfinite(x) & (x > 0)
            ax.scatter(x[ok], y[ok], s=10, color=colours(k % 10), alpha=0.8, edgecolors="none",
                       label=f"draw {s}")
        t = taus.get((m, rho))
        ax.set_title(f"{m} (ρ={_fmt_rho(rho)})" + (f"\npooled τ = {t.tau_b:+.2f}"
                                                    if t and math.isfinite(t.tau_b) else ""),
                     fontsize=8)
        ok = np.isfinite(x) & (x > 0)
        if ok.any() and x[ok].max() >= 10 * x[ok].min():
            ax.set_xscale("log")  # else linear: a log axis shorter than a decade has no labels
        ax.set_yscale("log")
        _plain_log_ticks(ax)
        if ax.get_xscale() == "linear":
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 2))
        ax.xaxis.get_offset_text().set_fontsize(7)
        ax.set_xlabel("sharpness", fontsize=8)
    axes[0][0].set_ylabel("test loss ‖β − β*‖²", fontsize=8)
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fig_diagonal_knobs(path, records, title) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hp = [r["hparams"] for r in records]
    a = np.array([h["alpha"] for h in hp])
    c = np.array([r.get("train_info", {}).get("lr_factor_used", h["lr_factor"])
                  for r, h in zip(records, hp)])
    b = np.array([h["batch_size"] for h in hp])
    y = np.array([float(r["metrics"]["test_loss"]) for r in records])
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    for k, bs in enumerate(sorted(set(b.tolist()))):
        ok = b == bs
        ax.scatter(a[ok], y[ok], s=8 + 40 * c[ok], alpha=0.7, edgecolors="none",
                   label=f"batch {bs}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    finish_figure(fig, ax, path, title=title, xlabel="initialisation scale α (marker size: step "
                  "factor c)", ylabel="test loss ‖β − β*‖²")


def _finish_span(records) -> Optional[float]:
    """Seconds from the first model's start (finish time − its total time) to the last finish."""
    try:
        fin = [(_dt.datetime.fromisoformat(r["finished"]).timestamp(), r["timing"]["total_s"])
               for r in records]
    except (KeyError, TypeError, ValueError):
        return None
    return max(f for f, _ in fin) - min(f - t for f, t in fin) if fin else None


def diagonal_notes(config: Dict[str, Any]) -> List[str]:
    """The protocol in a few lines, from the configuration alone."""
    c = config
    solver = (f"{c['restarts']} restarts × {c['pga_iters']} PGA iterations, batched over the ρ grid"
              if c["solver"] == "pga" else
              f"{c['restarts']} restarts × {c['apgd_iters']} auto_pgd iterations, exact retraction")
    return [
        f"Data: {len(c['draws'])} draws (data seeds {c['draws']}) of n = {c['n']}, d = {c['d']} "
        f"Gaussian X and β* with {c['k']} non-zeros |N(0,1)| scaled to ‖β*‖ = 1, noiseless y; "
        "L = ‖Xβ − y‖²/(2n); test loss ‖β − β*‖² (exact population risk).",
        f"Nets: u₀ = α·1, v₀ = 0; α log-uniform in {c['alpha_range']}; batch from "
        f"{c['batch_choices']}; step c·η_stab (stability limit at the interpolator) with c "
        f"log-uniform in {c['lr_factor_range']}; large-step phase of E epochs, E log-uniform in "
        f"{c['phase_epochs_range']}, then the step / {c['lr_decay']:g} until L ≤ "
        f"{c['target_loss']:g}; then full-batch GD at {c['polish_factor']:g} × its local "
        f"stability limit until L ≤ {c['polish_loss']:g}.",
        f"Sharpness: solver {c['solver']} ({solver}); geodesic-mix-manifold keeps 1 + 2b ≥ 1e-3 "
        "(endpoints of geodesics that exist), geodesic-mix is docs/maths.md §8.6 verbatim "
        "(polynomial continuation)"
        + (", solved exactly (trust region)." if c.get("mix_literal") == "exact" else "."),
        "Protocol and reasons: experiments/diagonal.py (module docstring), experiments/README.md.",
    ]


class _DiagonalColumns:
    """The per-model columns of the diagonal report (test loss ``y``, final training loss, data
    draw, α, step factor actually used), its measures and ρ, and the τ's already computed."""

    def __init__(self, used: List[Dict[str, Any]], main: List[str], diag: List[str],
                 rho: Dict[str, float], n_boot: int):
        self.used, self.main, self.measures = used, main, main + diag
        self.rho, self.n_boot = rho, n_boot
        self.draws = sorted({r["hparams"]["data_seed"] for r in used})
        self.y = np.array([float(r["metrics"]["test_loss"]) for r in used])
        self.ltrain = np.array([float(r["metrics"]["train_loss"]) for r in used])
        self.groups = np.array([r["hparams"]["data_seed"] for r in used])
        self.alpha = np.array([r["hparams"]["alpha"] for r in used])
        self.step = np.array([r.get("train_info", {}).get("lr_factor_used",
                                                           r["hparams"]["lr_factor"]) for r in used])
        self.taus: Dict[Tuple[str, float], TauResult] = {}

    def xs(self, m: str, rho: float) -> np.ndarray:
        return np.array([value_of(r, m, rho) for r in self.used])


def _diagonal_header(out_dir: str, config_hash: str, records, used, draws, exclude: Dict[int, str],
                     wall_s: Optional[float], n_boot: int, source: Optional[str]) -> List[str]:
    per_draw_n = {s: sum(r["hparams"]["data_seed"] == s for r in used) for s in draws}
    total_s = sum(r.get("timing", {}).get("total_s", 0.0) for r in records)
    span = _finish_span(records)
    when = ((f"wall time of this run: {wall_s:.0f} s" if wall_s is not None else
             "recomputed from results.jsonl by `quotient-manifolds report`")
            + (f"; the models were computed over {span:.0f} s (first start to last finish, "
               "from the records' timestamps)" if span is not None else ""))
    return ["# diagonal study: Kendall τ of sharpness vs test loss ‖β − β*‖²", "",
            f"- output: `{display_path(out_dir)}`  (config hash `{config_hash}`)"
            + (f"; records: `{display_path(source)}`" if source else ""),
            f"- models: {len(used)} used over {len(draws)} data draws ("
            + ", ".join(f"draw {s}: {k}" for s, k in per_draw_n.items()) + ")"
            + (f", {len(exclude)} excluded" if exclude else ""),
            f"- generated: {_dt.datetime.now().isoformat(timespec='seconds')}; {when}; sum of "
            f"per-model times {total_s:.0f} s",
            f"- τ-b with 95 % percentile-bootstrap CI over models ({n_boot} resamples). *pooled*: "
            "all pairs of models; *within draws*: only pairs of models of the same data draw "
            "(bootstrap within draws); *per draw*: the τ of each draw taken alone. Draws "
            "differ in how sparse the best interpolators are and in the scale of sharpness, so "
            "the pooled τ mixes between-draw differences into the ranking.", ""]


def _diagonal_headline(d: _DiagonalColumns, summary: Dict[str, Any]
                       ) -> Tuple[List[str], List[str]]:
    """The headline table (pooled, clustered, within-draw and per-draw τ beside the paper's) and
    the rows of the partial-τ table (given α, given the step factor), both filled per measure."""
    paper = PAPER["diagonal"]
    paper_of = {"adaptive": paper["adaptive"], "geodesic-inv": paper["geodesic-inv"],
                "geodesic-mix-manifold": paper["geodesic-mix"]}
    y, groups, n_boot = d.y, d.groups, d.n_boot
    lines = ["## Headline: τ(sharpness, test loss) (paper Table 1 row: Diagonal nets)", "",
             "| measure | ρ | pooled τ [95% CI] | pooled τ, CI with draws resampled whole | "
             "within draws τ [95% CI] | per draw (min … max) | paper τ |",
             "|---|---|---|---|---|---|---|"]
    partial_rows = []
    for m in d.measures:
        x = d.xs(m, d.rho[m])
        t = tau_with_ci(x, y, n_boot=n_boot)
        # nets share their data draw: the unit of resampling for a pooled τ is the draw
        tc = tau_ci_weighted(x, y, n_boot=PAIRED_N_BOOT, seed=PAIRED_SEED, clusters=groups)
        w = within_tau_with_ci(x, y, groups, n_boot=n_boot)
        per = {}
        for s in d.draws:
            k = groups == s
            per[s] = tau_with_ci(x[k], y[k], n_boot=n_boot)
            pa_s = partial_tau_with_ci(x[k], y[k], d.alpha[k], n_boot=1).tau_b
            ps_s = partial_tau_with_ci(x[k], y[k], d.step[k], n_boot=1).tau_b
            summary["per_draw"].setdefault(str(s), {})[m] = dict(
                per[s].as_dict(), partial_alpha=pa_s, partial_step=ps_s)
        d.taus[(m, d.rho[m])] = t
        ref = paper_of.get(m)
        label = m if m in d.main else f"{m} (diagnostic)"
        lines.append(f"| {label} | {_fmt_rho(d.rho[m])} | {t.fmt()} | {tc.fmt()} | {w.fmt()} | "
                     f"{_rng_fmt([p.tau_b for p in per.values()])} | "
                     f"{'' if ref is None else f'{ref:+.2f}'} |")
        summary["main"][m] = {"rho": d.rho[m], **t.as_dict(), "paper": ref}
        summary["within_draw"][m] = w.as_dict()
        summary.setdefault("main_clustered", {})[m] = tc.as_dict()
        cells = []
        for key, z in (("alpha", d.alpha), ("step", d.step)):
            pp = partial_tau_with_ci(x, y, z, n_boot=n_boot)
            pw = within_partial_tau_with_ci(x, y, z, groups, n_boot=n_boot)
            pd = [summary["per_draw"][str(s)][m][f"partial_{key}"] for s in d.draws]
            summary[f"partial_{key}"][m] = pp.as_dict()
            summary[f"partial_{key}_within_draw"][m] = pw.as_dict()
            cells += [pp.fmt(), pw.fmt(), _rng_fmt(pd)]
        partial_rows.append(f"| {label} | {_fmt_rho(d.rho[m])} | " + " | ".join(cells) + " |")
    lines += ["", "The paper's mix value stands beside `geodesic-mix-manifold` (geodesics that "
              "exist on the manifold); the literal `geodesic-mix` is a diagnostic, see below. "
              f"The clustered CI resamples the {len(d.draws)} draws ({PAIRED_N_BOOT} resamples, "
              f"seed {PAIRED_SEED}): with this few clusters it is coarse, but resampling nets as "
              "if independent understates the spread between draws.", ""]
    return lines, partial_rows


def _diagonal_train_loss_section(d: _DiagonalColumns, polish_loss: float,
                                 summary: Dict[str, Any]) -> List[str]:
    """τ of each measure with the final training loss, and of the training loss with the test
    loss and with α."""
    ltrain, groups, n_boot = d.ltrain, d.groups, d.n_boot
    lines = ["## Diagnostic: τ with the final training loss", "",
             "Every model is polished to L ≤ "
             f"{polish_loss:g}; what is left of the training residual "
             "should not rank sharpness. At an interpolator the literal geodesic-mix is "
             "ρ²λ_max(XᵀX/n) + O(ρ√L) for every model of a draw: within a draw only the residual "
             "(its component along the top eigenvector of XᵀX) can rank it, and across draws "
             "λ_max(XᵀX/n) does.", "",
             "| measure | ρ | τ(S, test loss) pooled | τ(S, train loss) pooled | "
             "τ(S, train loss) within draws | per draw (min … max) |", "|---|---|---|---|---|---|"]
    for m in d.measures:
        x = d.xs(m, d.rho[m])
        t = tau_with_ci(x, ltrain, n_boot=n_boot)
        w = within_tau_with_ci(x, ltrain, groups, n_boot=n_boot)
        per = [tau_with_ci(x[groups == s], ltrain[groups == s], n_boot=1).tau_b for s in d.draws]
        summary["train_loss"][m] = {"pooled": t.as_dict(), "within_draw": w.as_dict(),
                                    "per_draw": dict(zip(map(str, d.draws), per))}
        lines.append(f"| {m} | {_fmt_rho(d.rho[m])} | {d.taus[(m, d.rho[m])].fmt()} | {t.fmt()} | "
                     f"{w.fmt()} | {_rng_fmt(per)} |")
    tt = tau_with_ci(ltrain, d.y, n_boot=n_boot)
    tw = within_tau_with_ci(ltrain, d.y, groups, n_boot=n_boot)
    ta = tau_with_ci(ltrain, d.alpha, n_boot=n_boot)
    summary["train_vs_test"] = {"pooled": tt.as_dict(), "within_draw": tw.as_dict(),
                                "train_vs_alpha": ta.as_dict()}
    lines += ["", f"The final training loss itself ranks with the test loss: τ(train loss, test "
              f"loss) = {tt.fmt()} pooled, {tw.fmt()} within draws, because it ranks with α "
              f"(τ(train loss, α) = {ta.fmt()}: polishing converges faster for larger α, so its "
              "last check lands further below the threshold). A measure that follows the "
              "residual inherits that τ without seeing the geometry."]
    return lines + [""]


def _diagonal_per_draw_section(d: _DiagonalColumns, summary: Dict[str, Any]) -> List[str]:
    lines = ["## Per draw (ρ as above): τ-b [95% CI]; partial τ given α / given c", "",
             "| draw | models | test loss | " + " | ".join(d.measures) + " |",
             "|---|---|---|" + "---|" * len(d.measures)]
    for s in d.draws:
        k = d.groups == s
        cells = []
        for m in d.measures:
            e = summary["per_draw"][str(s)][m]
            t = TauResult(e["tau_b"], e["tau_a"], e["ci_low"], e["ci_high"], e["n"])
            cells.append(f"{t.fmt()}; {_num(e['partial_alpha'])} / {_num(e['partial_step'])}")
        lines.append(f"| {s} | {int(k.sum())} | {d.y[k].min():.3g} … {d.y[k].max():.3g} | "
                     + " | ".join(cells) + " |")
    return lines + [""]


def _diagonal_sweep_section(d: _DiagonalColumns, summary: Dict[str, Any], fig_path: str
                            ) -> List[str]:
    """Pooled τ (and the within-draw point value) at every ρ of each measure, and its figure."""
    sweep: Dict[str, List[Tuple[float, TauResult]]] = {}
    grids = {m: rhos_of(d.used, m) for m in d.measures}
    first = grids[d.main[0]]
    same = all(len(g) == len(first) and all(math.isclose(a, b) for a, b in zip(g, first))
               for g in grids.values())
    lines = ["## ρ sweep", "", "Pooled τ-b [95% CI]; within draws in parentheses. The mix ρ has "
             "units (of β); inv and adaptive are scale-free.", ""]
    if same:
        lines += ["| measure | " + " | ".join(f"ρ={_fmt_rho(r_)}" for r_ in first)
                  + " |", "|---|" + "---|" * len(first)]
    for m in d.measures:
        rows, cells = [], []
        for r_ in grids[m]:
            x = d.xs(m, r_)
            t = d.taus.get((m, r_)) or tau_with_ci(x, d.y, n_boot=d.n_boot)
            w = within_tau_with_ci(x, d.y, d.groups, n_boot=1)  # the point value only
            d.taus[(m, r_)] = t
            rows.append((r_, t))
            cells.append(f"{t.fmt()} ({w.tau_b:+.2f})" if same else
                         f"ρ={_fmt_rho(r_)}: {t.fmt()} ({w.tau_b:+.2f})")
            summary["sweep"].setdefault(m, []).append({"rho": r_, **t.as_dict(),
                                                       "within_draw": w.tau_b})
        sweep[m] = rows
        lines.append(f"| {m} | " + " | ".join(cells) + " |" if same
                     else f"- **{m}**: " + "; ".join(cells))
    _fig_sweep(fig_path, sweep, "diagonal: pooled τ vs ρ")
    return lines + [""]


def _diagonal_r2_section(used, draws, summary: Dict[str, Any]) -> List[str]:
    """R² of log test loss on the knobs (:func:`diagonal_r2`), pooled and per draw."""
    r2 = diagonal_r2(used)
    per_r2 = {s: diagonal_r2([r for r in used if r["hparams"]["data_seed"] == s]) for s in draws}
    summary["r2"] = {"pooled": r2, "per_draw": {str(s): v for s, v in per_r2.items()}}
    lines = ["## What sets the test loss: R² of log test loss (least squares)", "",
             "| knob | pooled | per draw (min … max) |", "|---|---|---|"]
    for k, v in r2.items():
        vals = [p[k] for p in per_r2.values() if k in p]
        rng_ = f"{min(vals):.2f} … {max(vals):.2f}" if vals else "—"
        lines.append(f"| {k} | {v:.2f} | {rng_} |")
    return lines + [""]


def _diagonal_population_section(used, exclude: Dict[int, str]) -> List[str]:
    lines = ["## Population", ""] + _metric_ranges(used)
    restarted = sum(r.get("train_info", {}).get("restarts", 0) > 0 for r in used)
    lines.append(f"- runs restarted at half the step after diverging: {restarted}")
    times = [r.get("timing", {}).get("total_s") for r in used if r.get("timing")]
    if times:
        lines.append(f"- time per model (s): median {np.median(times):.1f}, max {max(times):.1f}, "
                     f"sum {sum(times):.0f}")
    for mid, why in sorted(exclude.items()):
        lines.append(f"- excluded model {mid}: {why}")
    return lines + [""]


def diagonal_report(out_dir: str, config: Dict[str, Any], config_hash: str,
                    records: List[Dict[str, Any]], *, wall_s: Optional[float] = None,
                    exclude: Optional[Dict[int, str]] = None, n_boot: int = 2000,
                    source: Optional[str] = None, notes: Sequence[str] = ()) -> Dict[str, Any]:
    """Write ``summary.md``, ``summary.json`` and figures of the diagonal study; return the summary.

    Everything is a function of ``records`` (the lines of ``results.jsonl``) and ``n_boot``:
    ``quotient-manifolds report DIR`` reproduces every τ of a run's summary."""
    spec = STUDY["diagonal"].load()  # the study's measures, from its module through the registry
    exclude = exclude or {}
    used = [r for r in records if r["model_id"] not in exclude]
    present = measures_of(used)
    main = [m for m in spec.MAIN if m in present]
    diag = [m for m in spec.DIAGNOSTIC if m in present]
    rho = {m: float(config["rho"][spec.FAMILY[m]]) for m in main + diag}
    draws = sorted({r["hparams"]["data_seed"] for r in used})
    lines = _diagonal_header(out_dir, config_hash, records, used, draws, exclude, wall_s, n_boot,
                             source)
    summary: Dict[str, Any] = {"study": "diagonal", "config_hash": config_hash,
                               "n_models": len(used), "target": "test_loss", "draws": draws,
                               "main": {}, "within_draw": {}, "per_draw": {}, "partial_alpha": {},
                               "partial_alpha_within_draw": {}, "partial_step": {},
                               "partial_step_within_draw": {}, "train_loss": {}, "sweep": {},
                               "r2": {}}
    if len(used) < 3:
        lines.append("Fewer than 3 models: no correlations yet.")
        write_summary(out_dir, lines, summary)
        return summary
    d = _DiagonalColumns(used, main, diag, rho, n_boot)
    headline, partial_rows = _diagonal_headline(d, summary)
    lines += headline
    columns = {m: d.xs(m, rho[m]) for m in d.measures}
    lines += paired_section(d.y, [
        ("pooled", "whole data draws resampled", {"clusters": d.groups}, columns),
        ("within draws", "pairs of nets of the same draw; nets resampled within each draw",
         {"strata": d.groups, "within": True}, columns)], summary)
    lines += ["## Partial τ given the initialisation scale α and given the step factor c", "",
              "Kendall's partial τ of sharpness and test loss with α (resp. the step factor c "
              "actually used) held fixed: pooled over all models, from within-draw τ's, and per "
              "draw.", "",
              "| measure | ρ | given α: pooled | given α: within draws | given α: per draw | "
              "given c: pooled | given c: within draws | given c: per draw |",
              "|---|---|---|---|---|---|---|---|"] + partial_rows + [""]
    lines += _diagonal_train_loss_section(d, config.get("polish_loss", float("nan")), summary)
    lines += _diagonal_per_draw_section(d, summary)
    lines += _diagonal_sweep_section(d, summary, os.path.join(out_dir, "fig_rho_sweep.png"))
    lines += _diagonal_r2_section(used, draws, summary)
    lines += _diagonal_population_section(used, exclude)
    notes = list(notes) + diagonal_notes(config)
    lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    lines += ["## Configuration", "", "```json", json.dumps(config, indent=1, sort_keys=True,
                                                             default=str), "```", ""]
    _fig_diagonal_scatter(os.path.join(out_dir, "fig_scatter.png"), used,
                          [(m, rho[m]) for m in d.measures], d.taus,
                          f"diagonal: test loss vs sharpness ({len(used)} models, "
                          f"{len(draws)} draws)")
    _fig_diagonal_knobs(os.path.join(out_dir, "fig_knobs.png"), used,
                        "diagonal: what sets the test loss")
    write_summary(out_dir, lines, summary)
    return summary


# ------------------------------------------------------------------------------------ `report`
def read_records(path: str) -> List[Dict[str, Any]]:
    """The valid records of a results.jsonl, read only, as the runner reads them: a corrupt line
    that is not the last raises :class:`~quotient_manifolds.experiments.runner.ExperimentError` (a report must not
    silently lose a model); a partial last line (a study still writing, or killed mid-write) is
    left out with a note on stderr and repaired by the next run of the study."""
    from .runner import ResultStore

    records, tail = ResultStore(path).scan()
    if tail is not None:
        print(f"note: {path}: the last line is partial or corrupt and is left out of this report "
              f"(rerunning the study repairs it)", file=sys.stderr)
    return records


#: measures reported beside the main three when present: the paper's adaptive baseline and the
#: exact-geodesic versions of the second-order measures
EXTRA_MAIN = ("adaptive-andriushchenko", "inv-exact", "mix-exact")


def population_kwargs(study: str, config: Dict[str, Any], target: str,
                      synthetic: Optional[bool] = None) -> Dict[str, Any]:
    """The arguments of :func:`population_report` for a text or vision population, from its
    configuration alone (so a run and ``report DIR`` write the same summary)."""
    from .measures import ABLATIONS, CURVATURE, MAIN, MEASURES
    mod = STUDY[study].load()
    rho = {m: config["rho"][MEASURES[m]["family"]] for m in MEASURES}
    rho.update({m: 0.0 for m in CURVATURE})
    measures = list(config["measures"])
    notes = [f"sharpness on {config['sharp_points']} fixed training points in batches of "
             f"{config['sharp_batch']}, {config['n_iters']} Auto-PGD iterations, eval mode "
             f"(paper: {mod.PAPER_SHARPNESS}, 20 iterations)",
             "gap = test error − error on the fixed full train split (clean labels); gap_own uses "
             "each model's own (possibly noisy) training subset"]
    notes += list(getattr(mod, "report_notes", lambda c: [])(config))
    return dict(target=target, main=[m for m in MAIN if m in measures], default_rho=rho,
                extra_main=[m for m in EXTRA_MAIN if m in measures],
                ablations=[m for m in ABLATIONS if m in measures],
                curvature=[m for m in CURVATURE if m in measures],
                other_targets=tuple(t for t in ("gap", "gap_own", "test_error") if t != target),
                knobs=getattr(mod, "KNOBS", None),
                synthetic=(config.get("data") == "synthetic") if synthetic is None else synthetic,
                notes=notes)


def _results_file(path: str) -> str:
    from .runner import ExperimentError
    src = os.path.join(path, "results.jsonl") if os.path.isdir(path) else path
    if not os.path.exists(src):
        raise ExperimentError(f"no results.jsonl at {path}")
    return src


def _records_of_one_config(src: str, config_hash: Optional[str] = None
                           ) -> Tuple[str, List[Dict[str, Any]], List[str]]:
    """(chosen hash, its records sorted by model id, all hashes present) of a results.jsonl; the
    chosen configuration is ``config_hash``, else that of the last line."""
    from .runner import ExperimentError
    records = read_records(src)
    if not records:
        raise ExperimentError(f"{src} holds no valid result lines")
    hashes = list(dict.fromkeys(r.get("config_hash") for r in records))
    chosen = config_hash or records[-1].get("config_hash")
    if chosen not in hashes:
        raise ExperimentError(f"config hash {chosen} not in {src} (present: {', '.join(hashes)})")
    return chosen, sorted((r for r in records if r.get("config_hash") == chosen),
                          key=lambda r: r["model_id"]), hashes


def merge_second_pass(records: List[Dict[str, Any]], config: Dict[str, Any], extra_src: str,
                      log=print) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Add the sharpness values of a second pass over the same models (a run from the first
    pass's checkpoints with other ``--measures`` / ρ, written to its own directory) to the first
    pass's records. A model is matched by id and must have the same seed and hyperparameters (else
    it is not the same model and the merge stops); a (measure, ρ) the first pass already holds is
    kept from the first pass. Returns new records and the configuration with the union of both
    passes' measures; models of the first pass missing from the second simply lack its values."""
    from .runner import ExperimentError
    _, extra, _ = _records_of_one_config(extra_src)
    by_id = {r["model_id"]: r for r in extra}
    if extra[0].get("study") != records[0].get("study"):
        raise ExperimentError(f"{extra_src} holds the {extra[0].get('study')!r} study, not "
                              f"{records[0].get('study')!r}: pass a second pass of the same study")
    merged, added = [], 0
    for r in records:
        e = by_id.get(r["model_id"])
        if e is None:
            merged.append(r)
            continue
        if e.get("seed") != r.get("seed") or e.get("hparams") != r.get("hparams"):
            raise ExperimentError(
                f"model {r['model_id']} of {extra_src} has other seed/hyperparameters than the "
                "first pass: a second pass must run from the first pass's checkpoints "
                "(--checkpoint-dir FIRST/checkpoints) with the same population settings")
        have = [(x["measure"], x["rho"]) for x in r.get("sharpness", [])]
        new = [x for x in e.get("sharpness", []) if not any(
            m == x["measure"] and math.isclose(rho, x["rho"], rel_tol=1e-9) for m, rho in have)]
        added += len(new)
        merged.append({**r, "sharpness": list(r.get("sharpness", [])) + new})
    measures = list(dict.fromkeys(list(config.get("measures", []))
                                  + list(extra[0]["study_config"].get("measures", []))))
    log(f"{extra_src}: merged {added} sharpness values of {len(by_id)} models")
    return merged, {**config, "measures": measures}


def report_from_results(path: str, out_dir: Optional[str] = None, *, n_boot: int = 2000,
                        config_hash: Optional[str] = None, target: Optional[str] = None,
                        extra: Sequence[str] = (), log=print) -> Dict[str, Any]:
    """Recompute a study's summary from ``results.jsonl`` (a file, or a directory holding one).

    Diagonal: :func:`diagonal_report`. Text / vision populations: :func:`population_report` with
    :func:`population_kwargs` of the records' configuration, the study's ``exclusions`` and, when
    the directory holds one for the same configuration, ``calibration.json``; the target is
    ``target``, else the one of the directory's summary.json, else the study's default. ``extra``:
    results of second passes over the same models (:func:`merge_second_pass`)."""
    from .runner import ExperimentError
    src = _results_file(path)
    chosen, records, hashes = _records_of_one_config(src, config_hash)
    study = records[0].get("study")
    kind = STUDY[study].report if study in STUDY else None
    src_dir = os.path.dirname(os.path.abspath(src))
    out_dir = out_dir or src_dir
    if kind == "own":  # the study's own report, from the records alone
        if extra:
            raise ExperimentError(f"--extra merges second passes of the text / vision "
                                  f"populations; the {study} study has none")
        os.makedirs(out_dir, exist_ok=True)
        return STUDY[study].own_report()(out_dir, records[0]["study_config"], chosen, records, source=src)
    if kind is None:
        reported = [n for n, s in STUDY.items() if s.report is not None]
        raise ExperimentError(f"`report` recomputes the {', '.join(reported[:-1])} and {reported[-1]} "
                              f"studies' summaries; {src} holds the {study!r} study (its "
                              f"summary is written by its own run)")
    os.makedirs(out_dir, exist_ok=True)
    if len(hashes) > 1:
        log(f"{src}: {len(hashes)} configurations; using {chosen} ({len(records)} models)")
    if kind == "diagonal":
        if extra:
            raise ExperimentError("--extra merges second passes of the text / vision "
                                  "populations; the diagonal study has none")
        return diagonal_report(out_dir, records[0]["study_config"], chosen, records,
                               exclude=STUDY[study].load().exclusions(records), n_boot=n_boot, source=src)
    from . import calibrate
    mod = STUDY[study].load()
    if target is None:
        try:
            with open(os.path.join(src_dir, "summary.json")) as fh:
                old = json.load(fh)
            target = old.get("target") if old.get("config_hash") == chosen else None
        except (OSError, ValueError):
            target = None
    target = target or STUDY[study].target
    config = records[0]["study_config"]
    for extra_path in extra:
        records, config = merge_second_pass(records, config, _results_file(extra_path), log=log)
    cal = calibrate.load(src_dir)
    if cal is not None and cal.get("config_hash") != chosen:
        cal = None
    kwargs = population_kwargs(study, config, target)
    exclude = getattr(mod, "exclusions", lambda recs: {})(records)
    return population_report(out_dir, study, config, chosen, records, exclude=exclude,
                             calibration=cal, n_boot=n_boot, source=src,
                             second_passes=[os.path.relpath(os.path.dirname(os.path.abspath(
                                 _results_file(e))), src_dir) for e in extra], **kwargs)
