r"""What the studies' reports share: the paper's Table 1 (:data:`PAPER`), a record's sharpness
values (:func:`value_of`, :func:`rhos_of`, :func:`measures_of`) and their τ with a target
(:func:`tau_for`), the paired-bootstrap Δτ tables (:func:`paired_section`), the figure helpers
(:func:`fig_sweep`, :func:`finish_figure`), and the writing of ``summary.md`` / ``summary.json``
(:func:`write_summary`). The statistics themselves are in :mod:`quotient_manifolds.experiments.stats`."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .provenance import commits_of, provenance_label
from .runner import atomic_write_bytes
from .stats import TauResult, paired_delta_tau, tau_ci_weighted, tau_with_ci


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
#: what every --quick run says, first, in its summary.md and on the console
SMOKE_TEST = ("--quick: a smoke test of the study's steps on a tiny configuration; its numbers mean "
              "nothing (run without --quick for results)")


def is_smoke_test(config: Dict[str, Any]) -> bool:
    """Whether ``config`` is a --quick configuration (each study's ``defaults(quick=True)`` marks
    it ``quick``)."""
    return bool(config.get("quick"))


def smoke_test_banner(config: Dict[str, Any]) -> List[str]:
    """The first lines of a --quick configuration's summary.md (:data:`SMOKE_TEST`); none
    otherwise."""
    return [f"> **{SMOKE_TEST}**", ""] if is_smoke_test(config) else []


def rho_label(config: Dict[str, Any], calibration: Optional[Dict[str, Any]]) -> str:
    """How a population's main ρ was chosen, for its headings: "calibrated ρ" when its calibration
    (calibration.json) calibrated a family, or when its protocol calibrates (``config`` has a
    ``calibration`` entry) and every family was given with --rho-* instead (a calibration's result
    passed on, as the random text population takes the seeds population's); else "configured ρ"
    (the study's defaults, used as they are: e.g. the small text protocol and every --quick run
    that calibrates nothing)."""
    if calibration and calibration.get("calibrated"):
        return "calibrated ρ"
    cal = config.get("calibration")
    return "calibrated ρ" if cal is not None and not cal.get("families") else "configured ρ"


TARGET_LABEL = {"gap": "generalisation gap (test err − train err)",
                "gap_own": "gap on own training subset (test err − own train err)",
                "test_error": "test error", "test_loss": "test loss"}


def value_of(record: Dict[str, Any], measure: str, rho: float) -> float:
    """The sharpness of ``measure`` at ``rho`` in a record (NaN when it is missing or undefined)."""
    for e in record.get("sharpness", []):
        if e["measure"] == measure and math.isclose(e["rho"], rho, rel_tol=1e-9):
            v = e.get("value")
            return float(v) if v is not None else float("nan")
    return float("nan")


def _values_at(records: Sequence[Dict[str, Any]], measure: str, rho: float) -> np.ndarray:
    v = np.array([value_of(r, measure, rho) for r in records], dtype=float)
    return v[~np.isnan(v)]


def median_at(records: Sequence[Dict[str, Any]], measure: str, rho: float) -> float:
    """The median over ``records`` of the values of ``measure`` at ``rho`` (NaN where none): the
    loss rise a measure was compared at."""
    v = _values_at(records, measure, rho)
    return float(np.median(v)) if v.size else float("nan")


def median_range_at(records: Sequence[Dict[str, Any]], measure: str, rho: float) -> str:
    """"median m [min, max]" of the values of ``measure`` at ``rho`` over ``records``."""
    v = _values_at(records, measure, rho)
    if not v.size:
        return "no values"
    return f"median {np.median(v):.3g} [{v.min():.2g}, {v.max():.2g}]"


def rhos_of(records: Sequence[Dict[str, Any]], measure: str) -> List[float]:
    """The radii at which ``measure`` was measured on any of the records, ascending."""
    out: List[float] = []
    for r in records:
        for e in r.get("sharpness", []):
            if e["measure"] == measure and not any(math.isclose(e["rho"], x, rel_tol=1e-9)
                                                   for x in out):
                out.append(float(e["rho"]))
    return sorted(out)


def measures_of(records: Sequence[Dict[str, Any]]) -> List[str]:
    """The measures of the records, in the order they first appear."""
    out: List[str] = []
    for r in records:
        for e in r.get("sharpness", []):
            if e["measure"] not in out:
                out.append(e["measure"])
    return out


def tau_for(records, measure: str, rho: float, target: str, *, n_boot: int = 2000,
            seed: int = 0) -> TauResult:
    """τ-b of ``measure`` at ``rho`` with the metric ``target`` over the records, with its
    bootstrap CI (:func:`~quotient_manifolds.experiments.stats.tau_with_ci`)."""
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


def fmt_signed(v: float) -> str:
    """A τ (or Δτ) in a table cell: "+0.12", or "n/a" where it is undefined (never "+nan")."""
    return f"{v:+.2f}" if math.isfinite(v) else "n/a"


def fmt_rho(r: float) -> str:
    """ρ in a table cell; "—" for 0, the radius of a curvature measure (which has none)."""
    return "—" if r == 0 else f"{r:g}"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, imported when a figure is drawn: matplotlib
    takes about a second to import, and the command line must start fast."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def fig_sweep(path: str, sweep: Dict[str, List[Tuple[float, TauResult]]], title: str,
               relative_to: Optional[Dict[str, float]] = None) -> None:
    """τ against ρ per measure; with ``relative_to`` (each measure's main ρ, e.g. the calibrated
    one) against ρ / ρ_main, so measures whose ρ have different scales share one axis."""
    plt = pyplot()
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter  # with pyplot: lazy

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
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.axhline(0, color="k", lw=0.5)
    finish_figure(fig, ax, path, title=title,
                  xlabel=("ρ / the measure's main ρ" if relative_to else
                          "ρ (mix ρ has units; not comparable across measures)"),
                  ylabel="Kendall τ-b")


def finish_figure(fig, ax, path: str, *, title: str, xlabel: str, ylabel: str) -> None:
    """Labels, legend and small fonts of the report figures; save and close."""
    plt = pyplot()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def metric_ranges(records) -> List[str]:
    """"- key: min …, median …, max …" of every numeric metric of the records."""
    lines = []
    for key in sorted({k for r in records for k, v in r["metrics"].items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}):
        vals = np.array([float(r["metrics"][key]) for r in records
                         if isinstance(r["metrics"].get(key), (int, float))])
        lines.append(f"- {key}: min {vals.min():.4g}, median {np.median(vals):.4g}, "
                     f"max {vals.max():.4g}")
    return lines


def finish_span(records) -> Optional[float]:
    """Seconds from the first model's start (finish time − its total time) to the last finish."""
    try:
        fin = [(_dt.datetime.fromisoformat(r["finished"]).timestamp(), r["timing"]["total_s"])
               for r in records]
    except (KeyError, TypeError, ValueError):
        return None
    return max(f for f, _ in fin) - min(f - t for f, t in fin) if fin else None


def write_summary(out_dir: str, lines: List[str], summary: Dict[str, Any],
                  config: Optional[Dict[str, Any]] = None) -> None:
    """DIR/summary.md (``lines``) and DIR/summary.json (``summary``), each written atomically.
    When ``config`` is a --quick configuration, summary.md says so under its title
    (:func:`smoke_test_banner`) and ``summary["smoke_test"]`` is set."""
    if config is not None and is_smoke_test(config):
        summary["smoke_test"] = True
        lines = lines[:1] + [""] + smoke_test_banner(config) + lines[1:]
    atomic_write_bytes(os.path.join(out_dir, "summary.md"), ("\n".join(lines) + "\n").encode())
    _write_summary_json(out_dir, summary)


def _write_summary_json(out_dir: str, summary: Dict[str, Any]) -> None:
    atomic_write_bytes(os.path.join(out_dir, "summary.json"),
                       (json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n").encode())


def stamp_provenance(out_dir: str, records: Sequence[Dict[str, Any]],
                     summary: Dict[str, Any]) -> None:
    """End DIR/summary.md with a "Provenance" section (which commit and versions wrote
    ``records``, :func:`~quotient_manifolds.experiments.provenance.provenance_label`) and put it
    into ``summary`` and DIR/summary.json as ``provenance`` (``label`` and ``commits``: records per
    commit)."""
    label = provenance_label(records)
    summary["provenance"] = dict(label=label, commits=commits_of(records))
    path = os.path.join(out_dir, "summary.md")
    with open(path, encoding="utf-8") as fh:
        text = fh.read().rstrip("\n")
    atomic_write_bytes(path, (text + "\n\n## Provenance\n\n" + label + "\n").encode())
    _write_summary_json(out_dir, summary)


def closing_sections(notes: Sequence[str], config: Dict[str, Any]) -> List[str]:
    """The last sections of a summary: the notes (if any), one bullet each, and the configuration
    as JSON."""
    lines = ["## Notes", ""] + [f"- {n}" for n in notes] + [""] if notes else []
    return lines + ["## Configuration", "", "```json", json.dumps(config, indent=1, sort_keys=True,
                                                                  default=str), "```", ""]


def print_table(summary: Dict[str, Any], log=print) -> None:
    """The main table of a summary (τ-b, CI, τ-a and the paper's τ per measure) on ``log``; a
    --quick run's (``summary["smoke_test"]``) has no paper column. The ρ column says how ρ was
    chosen (``summary["rho_label"]``: :func:`rho_label`)."""
    main = summary.get("main", {})
    smoke = summary.get("smoke_test", False)
    if not main:
        return
    rho = summary.get("rho_label", "rho").replace("ρ", "rho")
    log(f"{'measure':26s} {rho:>16s}  {'tau-b [95% CI]':30s} tau-a" + ("" if smoke else "   paper"))
    for m, d in main.items():
        if not math.isfinite(d["tau_b"]):
            log(f"{m:26s} {d['rho']:16.4g}  n/a")
            continue
        ci = (f"[{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]"
              if math.isfinite(d["ci_low"]) and math.isfinite(d["ci_high"]) else f"[{TauResult.NO_CI}]")
        paper = "" if smoke or d.get("paper") is None else f"   {d['paper']:+.2f}"
        log(f"{m:26s} {d['rho']:16.4g}  {d['tau_b']:+.2f} {ci:24s} {fmt_signed(d['tau_a'])}{paper}")
