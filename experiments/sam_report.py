r"""The SAM study's report (:mod:`quotient_manifolds.experiments.sam_study`): the summary of its
records (:func:`summarise`), one sentence per task (:func:`verdict`), and ``summary.md``,
``summary.json`` and the figures (:func:`report`), from the records alone."""

from __future__ import annotations

import datetime as _dt
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .reporting import finish_figure, pyplot, write_summary
from .runner import display_path
from .sam_plan import NAME, rho_grid, select_rho, synthetic, tasks_of
from .sam_training import METHODS
from .stats import mean_std


def _num(v: Optional[float], fmt: str) -> str:
    """``v`` formatted, or "—" when missing (records written before a field existed)."""
    return "—" if v is None or not math.isfinite(v) else format(v, fmt)


def _pm(m: float, s: float, scale: float = 100.0, digits: int = 2) -> str:
    """"mean ± sd" in percent (accuracies are stored as fractions)."""
    if not math.isfinite(m):
        return "—"
    return f"{m * scale:.{digits}f}" + (f" ± {s * scale:.{digits}f}" if math.isfinite(s) else "")


def summarise(records: Sequence[Dict[str, Any]], config: Dict[str, Any]) -> Dict[str, Any]:
    """Per task: the timing job, the sweep (mean val / test accuracy per (method, ρ) over the
    sweep seeds), the selected ρ, and per method the test accuracy over seeds at it (with the
    paired difference to SAM: same seeds, same init and data order)."""
    selected = select_rho(records, config)
    out: Dict[str, Any] = {"tasks": {}}
    for task, t in tasks_of(config):
        recs = [r for r in records if r["task"] == task]
        timing = next((r["timing"] for r in recs if r.get("kind") == "timing"), None)
        train = [r for r in recs if r.get("kind") == "train"]
        sweep: Dict[str, List[Dict[str, Any]]] = {}
        for m in config["methods"]:
            if METHODS[m] is None:
                continue
            for ri, rho in enumerate(rho_grid(t, m)):
                rs = [r for r in train if r["method"] == m and r["rho_index"] == ri
                      and r["seed"] < config["sweep_seeds"]]
                sweep.setdefault(m, []).append(dict(
                    rho=rho, factor=t["rho_factors"][ri], n=len(rs),
                    val_acc=mean_std([r["metrics"]["val_acc"] for r in rs])[0],
                    test_acc=mean_std([r["metrics"]["test_acc"] for r in rs])[0],
                    train_loss=mean_std([r["metrics"]["train_loss"] for r in rs])[0],
                    selected=selected.get((task, m)) == ri))
        methods: Dict[str, Any] = {}
        for m in config["methods"]:
            ri = selected.get((task, m))
            rs = sorted((r for r in train if r["method"] == m and r["rho_index"] == ri),
                        key=lambda r: r["seed"])
            if ri is None or not rs:
                continue
            acc = {r["seed"]: r["metrics"]["test_acc"] for r in rs}
            row = dict(rho=None if METHODS[m] is None else rho_grid(t, m)[ri], n_seeds=len(rs),
                       seeds=sorted(acc), test_acc=mean_std(list(acc.values())),
                       val_acc=mean_std([r["metrics"]["val_acc"] for r in rs]),
                       train_loss=mean_std([r["metrics"]["train_loss"] for r in rs]),
                       train_acc=mean_std([r["metrics"]["train_acc"] for r in rs]),
                       update_s=float(np.median([r["timing"]["update_median_s"] for r in rs])),
                       update_cpu_s=float(np.median([r["timing"].get("update_cpu_median_s",
                                                                     math.nan) for r in rs])),
                       grad_evals=rs[0]["grad_evals"], updates=rs[0]["updates"],
                       curve=_mean_curve(rs))
            methods[m] = row
        sam_acc = {}
        if "sam" in methods:
            ri = selected[(task, "sam")]
            sam_acc = {r["seed"]: r["metrics"]["test_acc"] for r in train
                       if r["method"] == "sam" and r["rho_index"] == ri}
        for m, row in methods.items():
            rs = [r for r in train if r["method"] == m and r["rho_index"] == selected[(task, m)]]
            diffs = [r["metrics"]["test_acc"] - sam_acc[r["seed"]] for r in rs
                     if r["seed"] in sam_acc]
            row["diff_to_sam"] = mean_std(diffs) if m != "sam" and diffs else None
            if "sam" in methods:  # medians over runs made at different machine loads
                row["update_ratio_runs"] = row["update_s"] / methods["sam"]["update_s"]
                row["update_cpu_ratio_runs"] = row["update_cpu_s"] / methods["sam"]["update_cpu_s"]
            if timing is not None and m in timing["ratio_to_sam"]:
                row["update_ratio_same_process"] = timing["ratio_to_sam"][m]
                row["update_cpu_ratio_same_process"] = timing.get("cpu_ratio_to_sam", {}).get(m)
        out["tasks"][task] = dict(timing=timing, sweep=sweep, methods=methods)
    return out


def _mean_curve(rs: Sequence[Dict[str, Any]]) -> List[Tuple[int, float, float]]:
    """(update, mean, std) of the validation accuracy over runs at each curve point."""
    if not rs:
        return []
    pts = [c["update"] for c in rs[0]["curve"]]
    out = []
    for k, u in enumerate(pts):
        v = [r["curve"][k]["val_acc"] for r in rs if len(r["curve"]) > k]
        m, s = mean_std(v)
        out.append((u, m, s))
    return out


def verdict(task: str, s: Dict[str, Any]) -> str:
    """One plain sentence on what wins on ``task`` (mean test accuracy at the selected ρ), with
    the geodesic arms' paired difference to SAM against its spread over seeds."""
    methods = s["methods"]
    if not methods:
        return f"{task}: no finished runs."
    best = max(methods, key=lambda m: methods[m]["test_acc"][0])
    parts = [f"{task}: best mean test accuracy {best} ({_pm(*methods[best]['test_acc'])} %)"]
    for m in ("geodesic-inv", "geodesic-mix", "asam", "base"):
        d = methods.get(m, {}).get("diff_to_sam")
        if d is None:
            continue
        mean, sd = d
        if not math.isfinite(mean):
            continue
        n = methods[m]["n_seeds"]
        # a paired difference is called only with ≥ 3 seeds and beyond 2 standard errors
        where = ("too few seeds to tell" if n < 3 or not math.isfinite(sd) else
                 "beyond 2 standard errors" if abs(mean) > 2 * sd / math.sqrt(n) else
                 "within 2 standard errors: no clear difference")
        parts.append(f"{m} − SAM = {mean * 100:+.2f} pts (paired over {n} seeds"
                     + (f", sd {sd * 100:.2f}" if math.isfinite(sd) else "") + f"; {where})")
    ratio = [f"{m} {methods[m]['update_ratio_same_process']:.2f}× wall, "
             f"{_num(methods[m].get('update_cpu_ratio_same_process'), '.2f')}× CPU"
             for m in ("geodesic-inv", "geodesic-mix") if m in methods
             and methods[m].get("update_ratio_same_process") is not None]
    if ratio:
        parts.append("cost per update vs SAM (same process) " + "; ".join(ratio)
                     + " (goal ≤ 1.1×)")
    return "; ".join(parts) + "."


def report(out_dir: str, config: Dict[str, Any], config_hash: str,
           records: Sequence[Dict[str, Any]], *, wall_s: Optional[float] = None,
           source: Optional[str] = None) -> Dict[str, Any]:
    """summary.md, summary.json, fig_rho_sweep.png and fig_curves.png, from the records alone
    (``quotient-manifolds report DIR`` rewrites them)."""
    s = summarise(records, config)
    syn = " [SYNTHETIC]" if synthetic(config) else ""
    lines = [f"# SAM training study{syn}", "",
             f"config hash `{config_hash}`, {len([r for r in records if r.get('kind') == 'train'])}"
             f" training runs; written {_dt.datetime.now().isoformat(timespec='seconds')}"
             + (f"; this run {wall_s / 60:.1f} min wall" if wall_s is not None else "")
             + (f"; from {display_path(source)}" if source else ""), ""]
    if syn:
        lines += ["**SYNTHETIC data and tiny models (a --quick smoke test): the numbers mean "
                  "nothing.**", ""]
    lines += ["Protocol (module docstring of `experiments/sam_study.py`): every arm the same number "
              "of optimizer updates (SAM arms: 2 gradient evaluations per update; `base-2x`: the "
              "base optimizer with 2× the updates, i.e. equal gradient evaluations); ρ swept over "
              f"the same multipliers of each arm's centre on the first {config['sweep_seeds']} "
              f"seed(s), selected by validation accuracy, then {config['seeds']} seeds at it "
              "(same init and data order per seed for every arm).", ""]
    for task, t in tasks_of(config):
        lines += _task_section(task, t, s["tasks"][task], config)
    lines += ["Figures: `fig_rho_sweep.png` (test and validation accuracy against ρ / centre per "
              "method; base arms as lines), `fig_curves.png` (validation accuracy along training "
              "at the selected ρ, mean over seeds)."]
    _fig_sweep(os.path.join(out_dir, "fig_rho_sweep.png"), s, config, syn)
    _fig_curves(os.path.join(out_dir, "fig_curves.png"), s, config, syn)
    summary = dict(study=NAME, config_hash=config_hash, config=config, **s,
                   verdicts={task: verdict(task, ts) for task, ts in s["tasks"].items()})
    write_summary(out_dir, lines, summary, config)
    return summary


def _task_section(task: str, t: Dict[str, Any], ts: Dict[str, Any], config: Dict[str, Any]
                  ) -> List[str]:
    """The report of one task: its protocol, the table of every method at its selected ρ, the
    same-process timing, the ρ sweep and the verdict."""
    desc = (f"ViT {t['arch']} from scratch on {t['train_size']} Fashion-MNIST images"
            if task == "vit" else
            f"MiniLM ({t['layers']} layers, embeddings "
            f"{'trained' if t['train_embeddings'] else 'frozen'}) on {t['train_size']} "
            f"Rotten Tomatoes snippets")
    if t["data"] == "synthetic":
        desc = "SYNTHETIC data, tiny model"
    lines = [f"## {task}: {desc}", "",
             f"val {t['val_size']}, test {t['test_size']}; AdamW lr {t['lr']:g}, weight decay "
             f"{t['weight_decay']:g}, batch {t['batch_size']}, {t['steps']} updates "
             f"({t['decay']} schedule, warm-up {t['warmup']:g}), grad-norm clip 1.", "",
             "| method | selected ρ | test acc % (mean ± sd) | seeds | val acc % | train loss "
             "| train acc % | s / update (wall / CPU) | × SAM same process (wall / CPU) | "
             "× SAM runs (CPU) | test − SAM (paired, pts) | gradients |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, row in ts["methods"].items():
        d = row.get("diff_to_sam")
        same = (f"{_num(row.get('update_ratio_same_process'), '.2f')} / "
                f"{_num(row.get('update_cpu_ratio_same_process'), '.2f')}")
        rho = "—" if row["rho"] is None else f"{row['rho']:.4g}"
        lines.append(
            f"| {m} | {rho} | "
            f"{_pm(*row['test_acc'])} | {row['n_seeds']} | {_pm(*row['val_acc'])} | "
            f"{row['train_loss'][0]:.4f} | {_pm(*row['train_acc'])} | "
            f"{row['update_s']:.3f} / {_num(row['update_cpu_s'], '.3f')} | {same} | "
            f"{_num(row.get('update_cpu_ratio_runs'), '.2f')} | "
            f"{'—' if d is None else _pm(*d)} | {row['grad_evals']} |")
    timing = ts["timing"]
    if timing:
        lines += ["", f"Same-process timing ({timing['timed_updates']} timed updates per arm, "
                  f"interleaved, {timing['threads']} thread(s)): "
                  + ", ".join(f"{m} {v:.3f} s" for m, v in timing["update_median_s"].items())
                  + " (wall; CPU: " + ", ".join(
                      f"{m} {v:.3f} s" for m, v in timing.get("update_cpu_median_s",
                                                               {}).items())
                  + "). Loss increase L(w_adv) − L(w) at each arm's centre ρ (its strength "
                  "over the first updates of training): "
                  + ", ".join(f"{m} {v:.3g} (ρ {timing['rho'][m]:g}, ‖g‖ "
                              f"{timing['grad_norm'][m]:.3g})"
                              for m, v in timing["loss_increase"].items()) + "."]
    lines += ["", f"ρ sweep (mean over the first {config['sweep_seeds']} seed(s); * = "
              "selected by validation accuracy):", "",
              "| method | " + " | ".join(f"×{f:g}" for f in t["rho_factors"]) + " |",
              "|---|" + "---|" * len(t["rho_factors"])]
    for m, pts in ts["sweep"].items():
        cells = [(f"ρ {p['rho']:.3g}: val {p['val_acc'] * 100:.2f} / test "
                  f"{p['test_acc'] * 100:.2f}" + (" *" if p["selected"] else ""))
                 if p["n"] else "—" for p in pts]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", f"**{verdict(task, ts)}**", ""]
    return lines


_COLORS = {"base": "#7f7f7f", "base-2x": "#000000", "sam": "#1f77b4", "asam": "#ff7f0e",
           "geodesic-inv": "#2ca02c", "geodesic-mix": "#d62728"}


def _fig_sweep(path: str, s: Dict[str, Any], config: Dict[str, Any], syn: str) -> None:
    plt = pyplot()
    tasks = list(s["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.8 * len(tasks), 3.1), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        ts = s["tasks"][task]
        for m, pts in ts["sweep"].items():
            f = [p["factor"] for p in pts if p["n"]]
            ax.plot(f, [p["test_acc"] * 100 for p in pts if p["n"]], "o-", color=_COLORS[m],
                    label=m)
            ax.plot(f, [p["val_acc"] * 100 for p in pts if p["n"]], ":", color=_COLORS[m])
        for m in ("base", "base-2x"):
            if m in ts["methods"]:
                ax.axhline(ts["methods"][m]["test_acc"][0] * 100, color=_COLORS[m], lw=0.8,
                           ls="--", label=f"{m} (mean)")
        ax.set_xscale("log")
        factors = [float(f) for f in config["tasks"][task]["rho_factors"]]
        ax.set_xticks(factors, [f"×{f:g}" for f in factors])
        ax.minorticks_off()
        labels = (f"{task}{syn}", "ρ / the arm's centre (dotted: val)", "test accuracy %")
        if ax is axes[0][-1]:  # the last panel saves the figure
            finish_figure(fig, ax, path, title=labels[0], xlabel=labels[1], ylabel=labels[2])
        else:
            _label(ax, *labels)


def _label(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)


def _fig_curves(path: str, s: Dict[str, Any], config: Dict[str, Any], syn: str) -> None:
    plt = pyplot()
    tasks = list(s["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.8 * len(tasks), 3.1), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for m, row in s["tasks"][task]["methods"].items():
            c = row["curve"]
            if c:
                ax.plot([u for u, _, _ in c], [v * 100 for _, v, _ in c], "o-", ms=3,
                        color=_COLORS[m], label=m)
        if ax is axes[0][-1]:
            finish_figure(fig, ax, path, title=f"{task}{syn}", xlabel="update",
                          ylabel="val accuracy % (mean over seeds)")
        else:
            _label(ax, f"{task}{syn}", "update", "val accuracy % (mean over seeds)")


