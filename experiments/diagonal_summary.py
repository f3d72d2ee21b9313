r"""The report of the diagonal study (:func:`diagonal_report`). The study has several data draws
and several knobs per model; its report is its own: τ pooled over all models, τ over within-draw
pairs only, per draw, Kendall's partial τ given the initialisation scale and given the step
factor, and R² of log test loss per knob. Everything is recomputed from the records alone
(``quotient-manifolds report DIR``)."""

from __future__ import annotations

import datetime as _dt
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .reporting import (PAIRED_N_BOOT, PAIRED_SEED, PAPER, closing_sections, fig_sweep, finish_figure, fmt_signed,
                        finish_span, fmt_rho, measures_of, metric_ranges, paired_section, pyplot, rhos_of,
                        value_of, write_summary)
from .runner import display_path
from .stats import (TauResult, dummies, kendall_tau_b, paired_delta_tau, partial_tau_with_ci, r_squared,
                    tau_ci_weighted, tau_with_ci, within_partial_tau_with_ci, within_tau_with_ci)
from .studies import STUDY


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
    own = [m for m in spec.OWN if m in present]
    alg1 = [m for m in spec.ALG1 if m in present]
    rho = {m: float(config["rho"][spec.FAMILY[m]]) for m in main + own + alg1}
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
        write_summary(out_dir, lines, summary, config)
        return summary
    d = _DiagonalColumns(used, main, own, rho, n_boot)
    headline, partial_rows = _diagonal_headline(d, summary)
    lines += headline
    lines += _paper_posed_section(d, alg1, summary)
    lines += _identity_section(d, summary)
    lines += _mix_constant_section(d, config, spec, summary)
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
    lines += _diagonal_train_loss_section(
        d, min(config.get("polish_loss", math.inf), config.get("target_loss", math.inf)), summary)
    lines += _diagonal_per_draw_section(d, summary)
    lines += _diagonal_sweep_section(d, summary, os.path.join(out_dir, "fig_rho_sweep.png"))
    lines += _diagonal_r2_section(used, draws, summary)
    lines += _diagonal_population_section(used, exclude)
    notes = list(notes) + diagonal_notes(config)
    lines += closing_sections(notes, config)
    _fig_diagonal_scatter(os.path.join(out_dir, "fig_scatter.png"), used,
                          [(m, rho[m]) for m in d.measures], d.taus,
                          f"diagonal: test loss vs sharpness ({len(used)} models, "
                          f"{len(draws)} draws)")
    _fig_diagonal_knobs(os.path.join(out_dir, "fig_knobs.png"), used,
                        "diagonal: what sets the test loss")
    write_summary(out_dir, lines, summary, config)
    return summary


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
        f"{c['target_loss']:g}" + (
            f"; then full-batch GD at {c['polish_factor']:g} × its local stability limit until "
            f"L ≤ {c['polish_loss']:g}." if c["polish_loss"] < c["target_loss"] else
            " (the paper's stopping rule; no polishing)."),
        f"Sharpness: solver {c['solver']} ({solver}); geodesic-mix is the paper's measure, "
        "docs/maths.md §8.6 verbatim (polynomial continuation)"
        + (", solved exactly (trust region)" if c.get("mix_literal") == "exact" else "")
        + "; geodesic-mix-manifold (this project's variant) keeps 1 + 2b ≥ 1e-3 (endpoints of "
        "geodesics that exist)"
        + (f"; the *-alg1 measures: one auto_pgd run of {c['alg1_iters']} iterations from ξ = 0 "
           "(the paper's Algorithm 1) at the main ρ." if c.get("alg1_iters") else "."),
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
    span = finish_span(records)
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
                "geodesic-mix": paper["geodesic-mix"]}
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
        label = m if m in d.main else f"{m} (this project's variant)"
        lines.append(f"| {label} | {fmt_rho(d.rho[m])} | {t.fmt()} | {tc.fmt()} | {w.fmt()} | "
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
        partial_rows.append(f"| {label} | {fmt_rho(d.rho[m])} | " + " | ".join(cells) + " |")
    lines += ["", "`geodesic-mix` is the paper's mix measure (docs/maths.md §8.6 verbatim: the "
              "polynomial continuation β₀⊙(1 + 2b) of the geodesic's β); the paper's mix value "
              "stands beside it. `geodesic-mix-manifold` is this project's own variant, not the "
              "paper's: it keeps 1 + 2b ≥ 1e-3, the endpoints of geodesics that exist on the "
              "manifold. The paper reports one data draw: its comparable numbers are the per-draw "
              f"τ's (next section), not the pooled ones. The clustered CI resamples the {len(d.draws)} draws ({PAIRED_N_BOOT} resamples, "
              f"seed {PAIRED_SEED}): with this few clusters it is coarse, but resampling nets as "
              "if independent understates the spread between draws.", ""]
    return lines, partial_rows


def _paper_posed_section(d: _DiagonalColumns, alg1: Sequence[str], summary: Dict[str, Any]
                         ) -> List[str]:
    """The study as the paper poses it: τ of the paper's three measures one data draw at a time
    (the paper reports one draw), maximised exactly and by the paper's Algorithm 1 (one Auto-PGD
    run of a few iterations from ξ = 0), with Δτ(inv − adaptive) of each solver, beside the
    paper's single-draw values."""
    paper = PAPER["diagonal"]
    solvers = [("exact", list(d.main))]
    if alg1:
        solvers.append(("alg1", [f"{m}-alg1" for m in d.main]))
    pairs = {name: (ms[d.main.index("geodesic-inv")], ms[d.main.index("adaptive")])
             for name, ms in solvers if "geodesic-inv" in d.main and "adaptive" in d.main}
    per_draw: Dict[str, Dict[str, Any]] = {}
    header = ["draw", "models"]
    for name, ms in solvers:
        header += [f"{m.replace('-alg1', '')} ({_SOLVER_LABEL[name]})" for m in ms]
        if name in pairs:
            header.append(f"Δτ inv − adaptive ({_SOLVER_LABEL[name]})")
    lines = ["## As the paper poses it: τ per data draw, exact maximum and Algorithm 1", "",
             "The paper reports one data draw, so its numbers compare with the τ of one draw "
             "(rows), not with the pooled τ. *exact*: the maximum over the ball (restarted PGA; "
             "the paper's mix, a trust-region problem, in closed form). *Alg. 1*: one run of the "
             "paper's Algorithm 1 (Auto-PGD, started at ξ = 0, "
             f"{_alg1_iters(d)} iterations, no restarts) on the same objective, at the same ρ: "
             "what a short ascent reports (20 iterations is the default of Andriushchenko et "
             "al.'s code, which the paper's Algorithm 1 modifies). Δτ = τ(geodesic-inv) − "
             "τ(adaptive) on the same nets.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in d.draws:
        k = d.groups == s
        cells, row = [], {}
        for name, ms in solvers:
            for m in ms:
                row[m] = kendall_tau_b(d.xs(m, d.rho[m])[k], d.y[k])
                cells.append(fmt_signed(row[m]))
            if name in pairs:
                a, b = pairs[name]
                row[f"delta_{name}"] = row[a] - row[b]
                cells.append(fmt_signed(row[f"delta_{name}"]))
        per_draw[str(s)] = row
        lines.append(f"| {s} | {int(k.sum())} | " + " | ".join(cells) + " |")
    # the paper's diagonal values come from restarted PGA (docs/maths.md §8.6): the exact columns
    paper_cells = [f"{paper[m]:+.2f}" for m in solvers[0][1]]
    if "exact" in pairs:
        paper_cells.append(f"{paper['geodesic-inv'] - paper['adaptive']:+.2f}")
    paper_cells += [""] * (len(header) - 2 - len(paper_cells))
    lines.append("| paper (one draw) | 50 | " + " | ".join(paper_cells) + " |")
    within: Dict[str, Any] = {}
    for name, (a, b) in pairs.items():
        r = paired_delta_tau(d.xs(a, d.rho[a]), d.xs(b, d.rho[b]), d.y, n_boot=PAIRED_N_BOOT,
                             seed=PAIRED_SEED, strata=d.groups, within=True)
        within[name] = r.as_dict()
    summary["paper_posed"] = {"per_draw": per_draw, "within_draw_delta": within,
                              "alg1_iters": _alg1_iters(d),
                              "paper": {m: paper[m] for m in d.main}}
    if within:
        lines += ["", "Within draws, Δτ(inv − adaptive) with a paired 95 % CI (nets resampled "
                  f"within draws, {PAIRED_N_BOOT} resamples, seed {PAIRED_SEED}): "
                  + "; ".join(f"{_SOLVER_LABEL[n]} {_delta_fmt(v)}" for n, v in within.items())
                  + "."]
    return lines + [""]


_SOLVER_LABEL = {"exact": "exact", "alg1": "Alg. 1"}


def _alg1_iters(d: _DiagonalColumns) -> Any:
    return d.used[0].get("study_config", {}).get("alg1_iters", "n/a")


def _delta_fmt(v: Dict[str, Any]) -> str:
    return (f"{v['delta']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]"
            if math.isfinite(v["delta"]) else "n/a")


def _identity_section(d: _DiagonalColumns, summary: Dict[str, Any]) -> List[str]:
    """Adaptive and geodesic-inv maximise one objective, L(β₀⊙e^{2s}) − L(β₀), over the balls
    Σ(e^{sⁱ} − 1)² ≤ ρ²/2 and Σ sⁱ² ≤ ρ²/2: the per-net ratio inv / adaptive and Δτ(inv −
    adaptive) at every ρ both were measured at."""
    if not {"adaptive", "geodesic-inv"} <= set(d.main):
        return []
    rows = []
    lines = ["## Adaptive and geodesic-inv: one objective, two balls", "",
             "With s = log((u + δ_u)/u) = log((v + δ_v)/v), adaptive sharpness maximises "
             "L(β₀⊙e^{2s}) − L(β₀) over Σ(e^{sⁱ} − 1)² ≤ ρ²/2 (the cheapest (δ_u, δ_v) for a given "
             "product scales u and v alike), geodesic-inv the same objective over Σ sⁱ² ≤ ρ²/2. "
             "The balls agree to first order, so the exact maxima (O(ρ²)) agree up to O(ρ³): at "
             "small ρ the ratio inv / adaptive is nearly the same for every net and the two "
             "measures rank the nets alike. Δτ = τ(geodesic-inv) − τ(adaptive), point values.", "",
             "| ρ | inv / adaptive per net (min … max) | Δτ pooled | Δτ within draws | "
             "Δτ per draw (min … max) |", "|---|---|---|---|---|"]
    for r_ in rhos_of(d.used, "adaptive"):
        if not any(math.isclose(r_, x, rel_tol=1e-9) for x in rhos_of(d.used, "geodesic-inv")):
            continue
        xa, xi = d.xs("adaptive", r_), d.xs("geodesic-inv", r_)
        ok = np.isfinite(xa) & np.isfinite(xi) & (xa > 0)
        ratio = xi[ok] / xa[ok]
        pooled = kendall_tau_b(xi, d.y) - kendall_tau_b(xa, d.y)
        within = (within_tau_with_ci(xi, d.y, d.groups, n_boot=1).tau_b
                  - within_tau_with_ci(xa, d.y, d.groups, n_boot=1).tau_b)
        per = {str(s): kendall_tau_b(xi[d.groups == s], d.y[d.groups == s])
               - kendall_tau_b(xa[d.groups == s], d.y[d.groups == s]) for s in d.draws}
        rows.append({"rho": r_, "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
                     "delta_pooled": pooled, "delta_within_draw": within, "delta_per_draw": per})
        lines.append(f"| {fmt_rho(r_)} | {ratio.min():.4f} … {ratio.max():.4f} | {pooled:+.3f} | "
                     f"{within:+.3f} | {min(per.values()):+.3f} … {max(per.values()):+.3f} |")
    summary["identity"] = rows
    return lines + [""]


def _mix_constant_section(d: _DiagonalColumns, config: Dict[str, Any], spec,
                          summary: Dict[str, Any]) -> List[str]:
    """The paper's mix measure at an interpolator: L(β₀ + 2δ) − L(β₀) = 2gᵀδ + (2/n)δᵀXᵀXδ with
    g = Xᵀr/n, whose maximum over ‖δ‖ ≤ ρ/√2 is (ρ²/n)λ_max(XᵀX) when r = 0: a constant of the
    data draw. Per draw: that constant and each net's value divided by it."""
    if "geodesic-mix" not in d.main:
        return []
    rho = d.rho["geodesic-mix"]
    x = d.xs("geodesic-mix", rho)
    rows = {}
    lines = ["## The paper's mix measure is a constant of the data", "",
             "At an interpolator (training residual r = 0) L(β₀ + 2δ) − L(β₀) = (2/n)δᵀXᵀXδ, whose "
             "maximum over ‖δ‖ ≤ ρ/√2 is (ρ²/n)λ_max(XᵀX) for every net of a draw: the paper's "
             "mix measure sees the data, not the net. Only the leftover residual, through "
             "2gᵀδ with g = Xᵀr/n, separates the nets of one draw (τ with the training loss: "
             "section \"Diagnostic\" below).", "",
             f"| draw | (ρ²/n)λ_max(XᵀX) at ρ = {fmt_rho(rho)} | geodesic-mix / it, per net "
             "(min … max) | final training loss (min … max) |", "|---|---|---|---|"]
    for s in d.draws:
        X = spec.make_data(config, s)[0]
        const = rho * rho / X.shape[0] * float(np.linalg.eigvalsh(X.T @ X).max())
        k = d.groups == s
        ratio = x[k] / const
        rows[str(s)] = {"constant": const, "ratio_min": float(np.nanmin(ratio)),
                        "ratio_max": float(np.nanmax(ratio))}
        lines.append(f"| {s} | {const:.6g} | {np.nanmin(ratio):.6f} … {np.nanmax(ratio):.6f} | "
                     f"{d.ltrain[k].min():.2g} … {d.ltrain[k].max():.2g} |")
    summary["mix_constant"] = {"rho": rho, "per_draw": rows}
    return lines + [""]


def _diagonal_train_loss_section(d: _DiagonalColumns, polish_loss: float,
                                 summary: Dict[str, Any]) -> List[str]:
    """τ of each measure with the final training loss, and of the training loss with the test
    loss and with α."""
    ltrain, groups, n_boot = d.ltrain, d.groups, d.n_boot
    lines = ["## Diagnostic: τ with the final training loss", "",
             "Every model ends at L ≤ "
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
        lines.append(f"| {m} | {fmt_rho(d.rho[m])} | {d.taus[(m, d.rho[m])].fmt()} | {t.fmt()} | "
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
            cells.append(f"{t.fmt()}; {fmt_signed(e['partial_alpha'])} / {fmt_signed(e['partial_step'])}")
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
        lines += ["| measure | " + " | ".join(f"ρ={fmt_rho(r_)}" for r_ in first)
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
                         f"ρ={fmt_rho(r_)}: {t.fmt()} ({w.tau_b:+.2f})")
            summary["sweep"].setdefault(m, []).append({"rho": r_, **t.as_dict(),
                                                       "within_draw": w.tau_b})
        sweep[m] = rows
        lines.append(f"| {m} | " + " | ".join(cells) + " |" if same
                     else f"- **{m}**: " + "; ".join(cells))
    fig_sweep(fig_path, sweep, "diagonal: pooled τ vs ρ")
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
    lines = ["## Population", ""] + metric_ranges(used)
    restarted = sum(r.get("train_info", {}).get("restarts", 0) > 0 for r in used)
    lines.append(f"- runs restarted at half the step after diverging: {restarted}")
    times = [r.get("timing", {}).get("total_s") for r in used if r.get("timing")]
    if times:
        lines.append(f"- time per model (s): median {np.median(times):.1f}, max {max(times):.1f}, "
                     f"sum {sum(times):.0f}")
    for mid, why in sorted(exclude.items()):
        lines.append(f"- excluded model {mid}: {why}")
    return lines + [""]


def diagonal_r2(records) -> Dict[str, float]:
    """R² of log test loss on each knob alone, on all knobs, and (several draws) all + draw."""
    y = np.log([float(r["metrics"]["test_loss"]) for r in records])
    cols = _knob_columns(records)
    out = {k: r_squared(y, c) for k, c in cols.items()}
    draws = [r["hparams"]["data_seed"] for r in records]
    if len(set(draws)) > 1:
        out["draw (categorical)"] = r_squared(y, dummies(draws))
    out["all knobs"] = r_squared(y, *cols.values())
    if len(set(draws)) > 1:
        out["all knobs + draw"] = r_squared(y, *cols.values(), dummies(draws))
    return out


def _knob_columns(records) -> Dict[str, Any]:
    hp = [r["hparams"] for r in records]
    info = [r.get("train_info", {}) for r in records]
    return {"log α": np.log([h["alpha"] for h in hp]),
            "log step factor": np.log([i.get("lr_factor_used", h["lr_factor"])
                                       for h, i in zip(hp, info)]),
            "batch size (categorical)": dummies([h["batch_size"] for h in hp]),
            "log large-step epochs": np.log([h["phase_epochs"] for h in hp])}


def _rng_fmt(vals) -> str:
    vals = [v for v in vals if math.isfinite(v)]
    return f"{min(vals):+.2f} … {max(vals):+.2f}" if vals else "n/a"


def _plain_log_ticks(ax) -> None:
    """Log axes with unlabelled minor ticks and small labels (no overlapping 2×10⁻³ labels)."""
    from matplotlib.ticker import NullFormatter  # lazily, as pyplot (reporting.pyplot)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.tick_params(which="both", labelsize=7)


def _fig_diagonal_scatter(path, records, panels, taus, title) -> None:
    plt = pyplot()

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
        ax.set_title(f"{m} (ρ={fmt_rho(rho)})" + (f"\npooled τ = {t.tau_b:+.2f}"
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
    plt = pyplot()

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
