r"""The report of a text or vision population (:func:`population_report`): Kendall τ tables with
bootstrap CIs beside the paper's Table 1 (docs/maths.md §11.6), paired Δτ, curvature, the ρ
calibration, second-order vs exact geodesic, ρ sweeps, ablations, other targets, partial and
within-knob τ, R² of each knob (:func:`knob_r2`), and figures in the style of the paper's
Figs. 3–5 (generalisation gap against sharpness, one panel per measure, τ in the title).
:func:`population_kwargs` gives its arguments from a population's configuration alone."""

from __future__ import annotations

import datetime as _dt
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .measures import ABLATIONS, AT_WEIGHTS, FAMILY_MEASURE, FLATNESS, MAIN, MEASURES, is_exact, main_measure_of
from .reporting import (PAPER, TARGET_LABEL, closing_sections, fig_sweep, finish_span, fmt_rho, fmt_signed,
                        is_smoke_test, measures_of, median_at, median_range_at, metric_ranges, paired_section,
                        pyplot, rho_label, rhos_of, tau_for, value_of, write_summary)
from .population_knobs import default_knobs, r2_section, within_section
from .runner import display_path
from .stats import TauResult, partial_tau_with_ci, tau_with_ci
from .studies import STUDY


# the training loss on the same points the gap's train error is measured on: the partial τ holds it
# fixed, since sharpness and gap both grow as a model fits its training data
GAP_CONTROL = {"gap": "train_loss", "gap_own": "own_train_loss"}


#: measures reported beside the main three when present: the paper's adaptive baseline and the
#: exact-geodesic versions of the second-order measures
EXTRA_MAIN = ("adaptive-andriushchenko", "inv-exact", "mix-exact")


def population_kwargs(study: str, config: Dict[str, Any], target: str,
                      synthetic: Optional[bool] = None) -> Dict[str, Any]:
    """The arguments of :func:`population_report` for a text or vision population, from its
    configuration alone (so a run and ``report DIR`` write the same summary)."""
    mod = STUDY[study].load()
    rho = {m: config["rho"][MEASURES[m]["family"]] for m in MEASURES}
    rho.update({m: 0.0 for m in AT_WEIGHTS})
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
                curvature=[m for m in AT_WEIGHTS if m in measures],
                flatness=[m for m in FLATNESS if m in measures],
                other_targets=tuple(t for t in ("gap", "gap_own", "test_error") if t != target),
                knobs=getattr(mod, "KNOBS", None),
                synthetic=(config.get("data") == "synthetic") if synthetic is None else synthetic,
                notes=notes)


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


def population_report(out_dir: str, study: str, config: Dict[str, Any], config_hash: str,
                      records: List[Dict[str, Any]], *, target: str, main: Sequence[str],
                      default_rho: Dict[str, float], extra_main: Sequence[str] = (),
                      ablations: Sequence[str] = (), other_targets: Sequence[str] = (),
                      curvature: Sequence[str] = (), flatness: Sequence[str] = (),
                      knobs: Optional[Sequence[Tuple[str, str, str]]] = None,
                      calibration: Optional[Dict[str, Any]] = None,
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
    the training loss of the gap's train error), paired Δτ of those and of ``flatness`` (relative
    flatness, also among the ``curvature`` measures at the trained weights), the curvature
    measures, the ρ calibration and the population median at the calibrated ρ, the second-order vs exact retraction on the same points,
    the ρ sweep, the ablations, other targets, R² of each knob (:func:`knob_r2`) for the gap and
    for every measure, the population and the excluded models. The main ρ is named as it was
    chosen (``rho_label`` in the summary: calibrated, or configured); a --quick configuration's
    summary says first that it is a smoke test (``smoke_test``) and sets nothing beside the
    paper's Table 1."""
    exclude = exclude or {}
    used = [r for r in records if r["model_id"] not in exclude]
    smoke = is_smoke_test(config)
    lines = _population_header(out_dir, study, config_hash, records, used, target, synthetic,
                               exclude, wall_s, n_boot, source, second_passes)
    summary: Dict[str, Any] = {"study": study, "config_hash": config_hash, "n_models": len(used),
                               "target": target, "synthetic": synthetic,
                               **({"smoke_test": True} if smoke else {}),
                               "rho_label": rho_label(config, calibration), "main": {},
                               "sweep": {}, "ablations": {}, "other_targets": {},
                               "excluded": {str(k): v for k, v in sorted(exclude.items())},
                               **({"second_passes": list(second_passes)} if second_passes else {})}
    if len(used) < 2:
        lines.append("Fewer than 2 models: no correlations yet.")
        write_summary(out_dir, lines, summary, config)
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
    lines += _main_section(taus, main + extra_main, {} if smoke else PAPER.get(study, {}), control,
                           summary)
    flat = [m for m in flatness if m in present]
    lines += paired_section(np.asarray(y, float), _paired_views(used, main + extra_main + flat,
                                                                default_rho, summary["rho_label"]),
                            summary)
    if curvature:
        lines += _curvature_section(taus, curvature, control, summary)
    if calibration:
        lines += _calibration_section(calibration, used, default_rho, summary)
    lines += _retraction_section(used, [m for m in extra_main if is_exact(m)],
                                 default_rho, target, n_boot, summary)
    lines += _sweep_section(taus, main, summary, os.path.join(out_dir, "fig_rho_sweep.png"),
                            f"{study}: τ vs ρ{tag}")
    if abl:
        lines += _ablation_section(taus, abl, summary, summary["rho_label"])
        _fig_scatter(os.path.join(out_dir, "fig_ablations.png"), used,
                     [(m, default_rho[m]) for m in abl], target, taus.taus,
                     f"{study}: ablations{tag}", logx, logy)
    others = [t for t in other_targets if all(t in r["metrics"] for r in used)]
    if others:
        lines += _other_targets_section(taus, others, main + extra_main + curvature, summary)
    if z is not None:
        lines += _partial_section(taus, control, main + extra_main + abl + curvature, summary)
    lines += within_section(taus, knobs if knobs is not None else default_knobs(used),
                             main + extra_main + curvature, summary)
    lines += r2_section(used, target, main + extra_main + curvature, default_rho, knobs, summary)
    lines += _population_section(records, used, exclude, config)
    lines += closing_sections(notes, config)
    _population_figures(out_dir, study, taus, main + extra_main, curvature, tag, logx, logy)
    write_summary(out_dir, lines, summary, config)
    return summary


def _population_figures(out_dir: str, study: str, taus: _PopulationTaus, measures: Sequence[str],
                        curvature: Sequence[str], tag: str, logx: bool, logy: bool) -> None:
    """fig_scatter.png (the target against each measure at its main ρ; none for a pass that
    measures only at the trained weights) and, with curvature measures, fig_curvature.png."""
    used, target = taus.used, taus.target
    if measures:
        _fig_scatter(os.path.join(out_dir, "fig_scatter.png"), used,
                     [(m, taus.default_rho[m]) for m in measures], target, taus.taus,
                     f"{study}: {TARGET_LABEL.get(target, target)} vs sharpness ({len(used)} models)"
                     + tag, logx, logy)
    if curvature:
        _fig_scatter(os.path.join(out_dir, "fig_curvature.png"), used,
                     [(m, 0.0) for m in curvature], target, taus.taus,
                     f"{study}: {TARGET_LABEL.get(target, target)} vs curvature" + tag, False, logy)


def _population_header(out_dir: str, study: str, config_hash: str, records, used, target: str,
                       synthetic: bool, exclude: Dict[int, str], wall_s: Optional[float],
                       n_boot: int, source: Optional[str], second_passes: Sequence[str]
                       ) -> List[str]:
    banner = ("\n> **SYNTHETIC DATA — smoke test only; these numbers mean nothing about the "
              "paper.**\n" if synthetic else "")
    span = finish_span(records)
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
    """τ-b, τ-a and partial τ of the main (and extra) measures beside the paper's Table 1 row,
    with each measure's median value over the models at its ρ: measures compare like for like
    only at similar loss rises."""
    used, rho = taus.used, taus.default_rho
    smoke = summary.get("smoke_test", False)       # no paper column beside a smoke test's numbers
    heading = ("not compared with the paper: a smoke test" if smoke else
               f"paper Table 1 row: {paper.get('label', '—')}")
    lines = [f"## Main measures ({heading})", "",
             f"| measure | {summary.get('rho_label', 'ρ')} | points | median value (nats) | τ-b [95% CI] | τ-a "
             f"| partial τ given {control or '—'} |" + ("" if smoke else " paper τ |"),
             "|---|---|---|---|---|---|---|" + ("" if smoke else "---|")]
    for m in measures:
        t, pt = taus.row(m)
        ref = paper.get(m)
        median = median_at(used, m, rho[m])
        lines.append(f"| {m} | {fmt_rho(rho[m])} | {_points(used, m, rho[m])} | "
                     f"{f'{median:.3g}' if math.isfinite(median) else '—'} | "
                     f"{t.fmt()} | {fmt_signed(t.tau_a)} | {pt.fmt() if pt else '—'} |"
                     + ("" if smoke else f" {'' if ref is None else f'{ref:+.2f}'} |"))
        summary["main"][m] = {"rho": rho[m], **t.as_dict(), "paper": ref, "median_value": median,
                              **({"partial": pt.as_dict()} if pt else {})}
    return lines + [""]


def _paired_views(used, measures: Sequence[str], default_rho: Dict[str, float],
                  label: str = "calibrated ρ"
                  ) -> List[Tuple[str, str, Dict[str, Any], Dict[str, np.ndarray]]]:
    """The views of :func:`paired_section` for a population: the main ρ, named ``label``
    (:func:`~quotient_manifolds.experiments.reporting.rho_label`: calibrated or configured), on
    all models and within stopping epochs where training stops at a threshold; and ρ × 0.1,
    ρ × 10."""
    def at(factor: float) -> Dict[str, np.ndarray]:  # the measures with values at factor × ρ
        cols = {m: np.array([value_of(r, m, default_rho[m] * factor) for r in used])
                for m in measures if factor == 1.0 or default_rho[m] > 0}  # no ρ: one view
        return {m: v for m, v in cols.items() if np.isfinite(v).sum() >= 3}

    plain = "models resampled with replacement"
    views: List[Tuple[str, str, Dict[str, Any], Dict[str, np.ndarray]]] = [
        (label, plain, {}, at(1.0))]
    stop = [r["metrics"].get("epochs_used") for r in used]
    if all(isinstance(v, (int, float)) for v in stop) and 1 < len(set(stop)) < len(used) / 2:
        # training stops at a train-error threshold, so the epochs used track sharpness: compare
        # only models that stopped at the same epoch
        views.append((f"{label}, within stopping epoch", "pairs of models that stopped at "
                      "the same epoch; models resampled within each stopping epoch",
                      {"strata": stop, "within": True}, at(1.0)))
    for factor in (0.1, 10.0):  # the sweep's radii, where measured
        views.append((f"ρ × {factor:g}", plain, {}, at(factor)))
    return views


def _curvature_section(taus: _PopulationTaus, curvature: Sequence[str], control: Optional[str],
                       summary: Dict[str, Any]) -> List[str]:
    summary["curvature"] = {}
    what = ([] if all(m in FLATNESS for m in curvature) else
            ["trace and largest eigenvalue of the Riemannian Hessian on the quotient (inv / mix metric "
             "on the GL blocks, adaptive metric elsewhere; docs/maths.md §4) and of the Euclidean "
             "Hessian (not GL-invariant)"])
    what += (["relative flatness (Petzka et al. 2021) of the output layer, κ = Σ ⟨w_s, w_s'⟩ Tr "
              "H_{s,s'} (adapters.relative_flatness), invariant to its neuron-wise rescalings"]
             if any(m in FLATNESS for m in curvature) else [])
    text = "; ".join(what)
    lines = ["## Curvature at the trained weights", "",
             f"{text[0].upper()}{text[1:]}; on the first "
             f"{_points(taus.used, curvature[0], 0.0)} sharpness points.", "",
             f"| measure | median value | τ-b [95% CI] | τ-a | partial τ given "
             f"{control or '—'} |", "|---|---|---|---|---|"]
    for m in curvature:
        t, pt = taus.row(m)
        vals = np.array([value_of(r, m, 0.0) for r in taus.used])
        med = _nanmedian(vals)
        lines.append(f"| {m} | {med:.4g} | {t.fmt()} | {fmt_signed(t.tau_a)} | "
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
        summary["sweep"][m] = [{"rho": r, "points": _points(used, m, r),
                                "median_value": median_at(used, m, r), **t.as_dict()}
                               for r, t in rows]
    if not any(len(v) > 1 for v in sweep.values()):
        return []
    lines = ["## ρ sweep (τ-b [95% CI]; points per value and the values' median [min, max] "
             "in nats in parentheses)", "",
             "The mix ρ has units (docs/maths.md §12.14); inv and adaptive are "
             "scale-free.", ""]
    for m, rows in sweep.items():  # a radius measured on fewer models says so
        lines.append(f"- **{m}**: " + "; ".join(
            f"ρ={fmt_rho(r)} ({_points(used, m, r)}; {median_range_at(used, m, r)}"
            + ("" if t.n == len(used) else f"; {t.n} of {len(used)} models")
            + f"): {t.fmt()}" for r, t in rows))
    lines.append("")
    fig_sweep(fig_path, sweep, title, relative_to={m: taus.default_rho[m] for m in sweep})
    return lines


def _ablation_section(taus: _PopulationTaus, abl: Sequence[str], summary: Dict[str, Any],
                      label: str) -> List[str]:
    used, rho = taus.used, taus.default_rho
    lines = [f"## Ablations at the {label} (docs/maths.md §11.8, paper App. G)", "",
             "| measure | ρ | points | τ-b [95% CI] | τ-a | full measure τ-b |",
             "|---|---|---|---|---|---|"]
    for m in abl:
        t, _ = taus.row(m)
        full = main_measure_of(m)
        ft = taus.taus.get((full, rho.get(full, float("nan"))))
        lines.append(f"| {m} | {fmt_rho(rho[m])} | "
                     f"{_points(used, m, rho[m])} | {t.fmt()} | {fmt_signed(t.tau_a)} | "
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
        lines.append(f"| {m} | {fmt_rho(rho)} | " + " | ".join(cells) + " |")
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
        lines.append(f"| {m} | {fmt_rho(rho)} | {t.fmt()} | {tz.fmt()} | {pt.fmt()} |")
    lines += ["", f"τ({control}, {target}) = {ty.fmt()}.", ""]
    summary["control_vs_target"] = ty.as_dict()
    return lines


def _population_section(records, used, exclude: Dict[int, str], config: Dict[str, Any]
                        ) -> List[str]:
    """The metrics' ranges, time per model, the train-error target and the excluded models."""
    lines = ["## Population", ""] + metric_ranges(used)
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


def _calibration_section(cal: Dict[str, Any], used, default_rho, summary) -> List[str]:
    """ρ* per family, the pilot's roots and the population's median at ρ* vs the band."""
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


def _retraction_section(used, exact: Sequence[str], default_rho, target: str, n_boot: int,
                        summary) -> List[str]:
    """The exact-geodesic measures beside the second-order one on the same batches, and the
    second-order point's gap to the exact geodesic at the worst perturbation
    (``retraction_gaps`` of adapters.sharpness) on all points."""
    lines: List[str] = []
    rows = []
    for m in exact:
        second = main_measure_of(m)
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
                         f"{_nanmedian(ratio):.3g} | {fmt_signed(rank.tau_b)} |")
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


def _fig_scatter(path: str, records, panels: Sequence[Tuple[str, float]], target: str,
                 taus: Dict[Tuple[str, float], TauResult], title: str, logx: bool = False,
                 logy: bool = False) -> None:
    plt = pyplot()

    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(3.1 * n, 2.9), squeeze=False)
    y = np.array([float(r["metrics"].get(target, np.nan)) for r in records])
    for ax, (m, rho) in zip(axes[0], panels):
        x = np.array([value_of(r, m, rho) for r in records])
        ok = np.isfinite(x) & np.isfinite(y)
        ax.scatter(x[ok], y[ok], s=14, c="#1f77b4", alpha=0.8, edgecolors="none")
        t = taus.get((m, rho))
        name = m if rho == 0 else f"{m} (ρ={fmt_rho(rho)})"  # ρ = 0: a curvature measure
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


def _points(records, measure: str, rho: float) -> str:
    """The number(s) of sharpness points behind ``measure`` at ``rho`` ("?" for old records)."""
    found = sorted({e.get("n_points") for r in records for e in r.get("sharpness", [])
                    if e["measure"] == measure and math.isclose(e["rho"], rho, rel_tol=1e-9)},
                   key=lambda v: (v is None, v))
    return "/".join("?" if v is None else str(v) for v in found) or "—"


def value_on(record: Dict[str, Any], measure: str, rho: float, n_batches: int) -> float:
    """The sharpness of ``measure`` at ``rho`` restricted to its first ``n_batches`` batches (the
    mean of its per-batch values), e.g. to compare with a measure taken on fewer points."""
    for e in record.get("sharpness", []):
        if e["measure"] == measure and math.isclose(e["rho"], rho, rel_tol=1e-9):
            pb = e.get("per_batch") or []
            return float(np.mean(pb[:n_batches])) if len(pb) >= n_batches else float("nan")
    return float("nan")


def _nanmedian(v) -> float:
    v = np.asarray(v, float)
    v = v[~np.isnan(v)]
    return float(np.median(v)) if v.size else float("nan")


