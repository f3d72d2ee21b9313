r"""Reports of the correlation studies: Kendall τ tables with bootstrap CIs beside the paper's
Table 1 (docs/maths.md §11.6), ρ sweeps, ablations, and figures in the style of the paper's
Figs. 3–5 (generalisation gap against sharpness, one panel per measure, τ in the title)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .stats import TauResult, partial_tau_with_ci, tau_with_ci

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


def display_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (reports get committed)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


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


def _fmt_rho(r: float) -> str:
    return f"{r:g}"


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
        ax.set_title(f"{m} (ρ={_fmt_rho(rho)})\nτ = {t.tau_b:+.2f}" if t and math.isfinite(t.tau_b)
                     else f"{m} (ρ={_fmt_rho(rho)})", fontsize=9)
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


def _fig_sweep(path: str, sweep: Dict[str, List[Tuple[float, TauResult]]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 3.0))
    for m, rows in sweep.items():
        rows = [(r, t) for r, t in rows if math.isfinite(t.tau_b)]
        if not rows:
            continue
        rs = np.array([r for r, _ in rows])
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
                  xlabel="ρ (mix ρ has units; not comparable across measures)",
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


def population_report(out_dir: str, study: str, config: Dict[str, Any], config_hash: str,
                      records: List[Dict[str, Any]], *, target: str, main: Sequence[str],
                      default_rho: Dict[str, float], extra_main: Sequence[str] = (),
                      ablations: Sequence[str] = (), other_targets: Sequence[str] = (),
                      synthetic: bool = False, notes: Sequence[str] = (),
                      wall_s: Optional[float] = None, exclude: Optional[Dict[int, str]] = None,
                      logx: bool = False, logy: bool = False, n_boot: int = 2000) -> Dict[str, Any]:
    """Write ``summary.md``, ``summary.json`` and figures; return the summary dict."""
    exclude = exclude or {}
    used = [r for r in records if r["model_id"] not in exclude]
    paper = PAPER.get(study, {})
    banner = ("\n> **SYNTHETIC DATA — smoke test only; these numbers mean nothing about the "
              "paper.**\n" if synthetic else "")
    lines = [f"# {study} study: Kendall τ of sharpness vs {TARGET_LABEL.get(target, target)}",
             banner,
             f"- output: `{display_path(out_dir)}`  (config hash `{config_hash}`)",
             f"- models: {len(used)} used" + (f", {len(exclude)} excluded" if exclude else ""),
             f"- generated: {_dt.datetime.now().isoformat(timespec='seconds')}"
             + (f"; wall time of this run: {wall_s:.0f} s" if wall_s is not None else ""),
             f"- τ-b with 95 % percentile-bootstrap CI over models ({n_boot} resamples); τ-a is "
             f"the paper's formula (docs/maths.md §11.1)", ""]
    summary: Dict[str, Any] = {"study": study, "config_hash": config_hash, "n_models": len(used),
                               "target": target, "synthetic": synthetic, "main": {},
                               "sweep": {}, "ablations": {}, "other_targets": {}}
    if len(used) < 2:
        lines.append("Fewer than 2 models: no correlations yet.")
        _write(out_dir, lines, summary)
        return summary
    # main table -----------------------------------------------------------------------------
    taus: Dict[Tuple[str, float], TauResult] = {}
    lines += [f"## Main measures (paper Table 1 row: {paper.get('label', '—')})", "",
              "| measure | ρ | τ-b [95% CI] | τ-a | paper τ |", "|---|---|---|---|---|"]
    for m in list(main) + list(extra_main):
        rho = default_rho[m]
        t = tau_for(used, m, rho, target, n_boot=n_boot)
        taus[(m, rho)] = t
        ref = paper.get(m)
        lines.append(f"| {m} | {_fmt_rho(rho)} | {t.fmt()} | "
                     f"{t.tau_a:+.2f} | {'' if ref is None else f'{ref:+.2f}'} |")
        summary["main"][m] = {"rho": rho, **t.as_dict(), "paper": ref}
    lines.append("")
    # ρ sweep -------------------------------------------------------------------------------
    sweep: Dict[str, List[Tuple[float, TauResult]]] = {}
    for m in list(main) + list(extra_main):
        rows = []
        for rho in rhos_of(used, m):
            t = taus.get((m, rho)) or tau_for(used, m, rho, target, n_boot=n_boot)
            taus[(m, rho)] = t
            rows.append((rho, t))
        sweep[m] = rows
        summary["sweep"][m] = [{"rho": r, **t.as_dict()} for r, t in rows]
    if any(len(v) > 1 for v in sweep.values()):
        lines += ["## ρ sweep (τ-b [95% CI])", "",
                  "The mix ρ has units (docs/maths.md §12.14); inv and adaptive are "
                  "scale-free.", ""]
        for m, rows in sweep.items():
            lines.append(f"- **{m}**: " + "; ".join(f"ρ={_fmt_rho(r)}: {t.fmt()}" for r, t in rows))
        lines.append("")
        _fig_sweep(os.path.join(out_dir, "fig_rho_sweep.png"), sweep,
                   f"{study}: τ vs ρ" + (" [SYNTHETIC]" if synthetic else ""))
    # ablations -----------------------------------------------------------------------------
    present = [m for m in ablations if m in measures_of(used)]
    if present:
        lines += ["## Ablations (docs/maths.md §11.8, paper App. G)", "",
                  "| measure | ρ | τ-b [95% CI] | τ-a | full measure τ-b |", "|---|---|---|---|---|"]
        for m in present:
            rho = default_rho[m]
            t = tau_for(used, m, rho, target, n_boot=n_boot)
            taus[(m, rho)] = t
            full = "geodesic-" + m.split("-", 1)[0]
            ft = taus.get((full, default_rho.get(full, float("nan"))))
            lines.append(f"| {m} | {_fmt_rho(rho)} | {t.fmt()} | {t.tau_a:+.2f} | "
                         f"{ft.fmt() if ft else ''} |")
            summary["ablations"][m] = {"rho": rho, **t.as_dict()}
        lines.append("")
        _fig_scatter(os.path.join(out_dir, "fig_ablations.png"), used,
                     [(m, default_rho[m]) for m in present], target, taus,
                     f"{study}: ablations" + (" [SYNTHETIC]" if synthetic else ""), logx, logy)
    # other targets -------------------------------------------------------------------------
    others = [t for t in other_targets if all(t in r["metrics"] for r in used)]
    if others:
        lines += ["## Other targets (τ-b [95% CI])", "",
                  "| measure | ρ | " + " | ".join(others) + " |",
                  "|---|---|" + "---|" * len(others)]
        for m in list(main) + list(extra_main):
            rho = default_rho[m]
            cells = []
            for tg in others:
                t = tau_for(used, m, rho, tg, n_boot=n_boot)
                summary["other_targets"].setdefault(tg, {})[m] = t.as_dict()
                cells.append(t.fmt())
            lines.append(f"| {m} | {_fmt_rho(rho)} | " + " | ".join(cells) + " |")
        lines.append("")
    # partial τ given the training loss ----------------------------------------------------
    control = GAP_CONTROL.get(target)
    if control and all(control in r["metrics"] for r in used) and len(used) >= 3:
        z = [float(r["metrics"][control]) for r in used]
        y = [float(r["metrics"][target]) for r in used]
        lines += [f"## Partial τ given {control} (τ-b [95% CI])", "",
                  "Kendall's partial τ of sharpness and the gap with the training loss held fixed "
                  "(`stats.partial_kendall_tau`; descriptive: not 0 in general even when the two "
                  "are related only through the training loss).", "",
                  f"| measure | ρ | τ(S, {target}) | τ(S, {control}) | partial τ |",
                  "|---|---|---|---|---|"]
        for m in list(main) + list(extra_main) + present:
            rho = default_rho[m]
            x = [value_of(r, m, rho) for r in used]
            pt = partial_tau_with_ci(x, y, z, n_boot=n_boot)
            tz = tau_with_ci(x, z, n_boot=n_boot)
            summary.setdefault("partial", {})[m] = {"rho": rho, "control": control,
                                                     **pt.as_dict()}
            lines.append(f"| {m} | {_fmt_rho(rho)} | {taus[(m, rho)].fmt()} | {tz.fmt()} | "
                         f"{pt.fmt()} |")
        lines.append("")
    # population description ----------------------------------------------------------------
    lines += ["## Population", ""]
    for key in sorted({k for r in used for k, v in r["metrics"].items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}):
        vals = np.array([float(r["metrics"][key]) for r in used])
        lines.append(f"- {key}: min {vals.min():.4g}, median {np.median(vals):.4g}, "
                     f"max {vals.max():.4g}")
    times = [r.get("timing", {}).get("total_s") for r in used if r.get("timing")]
    if times:
        lines.append(f"- time per model (s): median {np.median(times):.1f}, max {max(times):.1f}, "
                     f"sum {sum(times):.0f}")
    for mid, why in sorted(exclude.items()):
        lines.append(f"- excluded model {mid}: {why}")
    lines.append("")
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    lines += ["## Configuration", "", "```json", json.dumps(config, indent=1, sort_keys=True,
                                                             default=str), "```", ""]
    _fig_scatter(os.path.join(out_dir, "fig_scatter.png"), used,
                 [(m, default_rho[m]) for m in list(main) + list(extra_main)], target, taus,
                 f"{study}: {TARGET_LABEL.get(target, target)} vs sharpness ({len(used)} models)"
                 + (" [SYNTHETIC]" if synthetic else ""), logx, logy)
    _write(out_dir, lines, summary)
    return summary


def _write(out_dir: str, lines: List[str], summary: Dict[str, Any]) -> None:
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
        ci = (f"[{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]" if math.isfinite(d["ci_low"])
              else "")
        paper = "" if d.get("paper") is None else f"{d['paper']:+.2f}"
        log(f"{m:26s} {d['rho']:8.4g}  {d['tau_b']:+.2f} {ci:17s} {d['tau_a']:+.2f}   {paper}")
