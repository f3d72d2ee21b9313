r"""The LoRA study's report (:mod:`quotient_manifolds.experiments.lora`): every number from the
records alone (:func:`summarise`), ``summary.md``, ``summary.json`` and the figure
(:func:`report`), and the table the command prints (:func:`print_summary`)."""

from __future__ import annotations

import datetime as _dt
import math
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .lora_plan import ARM_LABEL, NAME, cell_name, pick_lrs, steps_to
from .reporting import pyplot, write_summary
from .stats import mean_std


def comparison_runs(records: Sequence[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """Per ``task/r<rank>/arm``: the seed-0 grid run at the picked lr and the other seeds' runs."""
    picked = pick_lrs(records)
    out: Dict[str, List[Dict[str, Any]]] = {cell: [rec] for cell, rec in picked.items()}
    for rec in records:
        if rec.get("kind") == "seed":
            cell = cell_name(rec["task"], rec["rank"], rec["arm"])
            if cell in out:
                out[cell].append(rec)
    for runs in out.values():
        runs.sort(key=lambda r: r["seed"])
    return out


def summarise(config: Dict[str, Any], records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Every number of the report, from the records alone."""
    runs = comparison_runs(records)
    timing = {f"{r['task']}/r{r['rank']}": r for r in records if r.get("kind") == "timing"}
    cells: Dict[str, Any] = {}
    verdicts: Dict[str, str] = {}
    for task in config["tasks"]:
        for rank in config["ranks"]:
            here = {a: runs.get(cell_name(task, rank, a), []) for a in config["arms"]}
            # one seed: sd 0.0, not nan (this report's "mean ± sd" cells and summary.json have
            # always shown a single run so; the SAM study's leave the sd out instead)
            finals = {a: mean_std([r["final_test_acc"] for r in rs], sd_of_one=0.0)
                      for a, rs in here.items()}
            valid = [m for m, _ in finals.values() if math.isfinite(m)]
            target = config["target_fraction"] * max(valid) if valid else float("nan")
            tkey = f"{task}/r{rank}"
            for a, rs in here.items():
                st = [steps_to(r["eval_steps"], r["test_acc_curve"], target) for r in rs]
                reached = [s for s in st if s is not None]
                steps_mean, steps_std = mean_std(reached, sd_of_one=0.0)
                t = timing.get(tkey)
                grid = sorted((r for r in records if r.get("kind") == "grid" and r["task"] == task
                               and r["rank"] == rank and r["arm"] == a), key=lambda r: r["lr"])
                cells[cell_name(task, rank, a)] = dict(
                    task=task, rank=rank, arm=a, lr=rs[0]["lr"] if rs else None,
                    seeds=[r["seed"] for r in rs], final_acc=[r["final_test_acc"] for r in rs],
                    diverged=sum(bool(r["diverged"]) for r in rs),
                    final_mean=finals[a][0], final_std=finals[a][1], target=target,
                    steps_to_target=st, steps_mean=steps_mean,
                    steps_std=steps_std, reached=len(reached),
                    median_step_ms=float(np.median([r["median_step_ms"] for r in rs]))
                    if rs else float("nan"),
                    timing_ratio=(t or {}).get("ratio_vs_adamw", {}).get(a, float("nan")),
                    timing_ms=(t or {}).get("median_step_ms", {}).get(a, float("nan")),
                    timing_opt_ms=(t or {}).get("median_opt_step_ms", {}).get(a, float("nan")),
                    grid=[dict(lr=r["lr"], val_acc=r["val_acc"], val_loss=r["val_loss"],
                               diverged=r["diverged"]) for r in grid],
                    # a pick at the end of a grid of ≥ 3 lrs may be beaten just outside it
                    at_grid_edge=bool(rs) and len(grid) >= 3
                    and rs[0]["lr"] in (grid[0]["lr"], grid[-1]["lr"]))
            verdicts[tkey] = _verdict(task, rank, {a: cells[cell_name(task, rank, a)]
                                                   for a in config["arms"]})
    return dict(cells=cells, verdicts=verdicts)


def _verdict(task: str, rank: int, cells: Dict[str, Dict[str, Any]]) -> str:
    """One plain sentence: the arm with the best mean final accuracy, and whether its lead over the
    runner-up exceeds the seed spread (the larger of the two standard deviations)."""
    ok = [(c["final_mean"], a) for a, c in cells.items() if math.isfinite(c["final_mean"])]
    if not ok:
        return f"{task}, r = {rank}: no finished runs yet."
    ok.sort(reverse=True)
    best, a = ok[0]
    if len(ok) == 1:
        return f"{task}, r = {rank}: only {ARM_LABEL[a]} has finished runs ({best:.4f})."
    second, b = ok[1]
    spread = max(cells[a]["final_std"], cells[b]["final_std"])
    n = min(len(cells[a]["final_acc"]), len(cells[b]["final_acc"]))
    lead = best - second
    head = (f"{task}, r = {rank}: {ARM_LABEL[a]} has the best final test accuracy "
            f"({best:.4f}), {lead:.4f} ahead of {ARM_LABEL[b]} ({second:.4f}); ")
    if n < 2:
        return head + "one seed only, so no seed spread to judge the lead by."
    if lead > spread:
        return head + f"the lead exceeds the seed spread (std {spread:.4f}, {n} seeds)."
    return head + (f"the lead is within the seed spread (std {spread:.4f}, {n} seeds): no clear "
                   f"winner.")


def _fmt(m: float, s: float, digits: int = 4) -> str:
    return "—" if not math.isfinite(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def _figure(path: str, config: Dict[str, Any], records, title: str) -> None:
    plt = pyplot()

    runs = comparison_runs(records)
    panels = [(t, r) for t in config["tasks"] for r in config["ranks"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.8 * len(panels), 3.0), squeeze=False)
    colors = {"adamw": "#7f7f7f", "peft-riemannian": "#ff7f0e", "ours-adam": "#1f77b4",
              "ours-sgd": "#2ca02c"}
    for ax, (task, rank) in zip(axes[0], panels):
        for a in config["arms"]:
            rs = runs.get(cell_name(task, rank, a), [])
            if not rs:
                continue
            x = np.asarray(rs[0]["eval_steps"])
            y = np.asarray([r["test_acc_curve"] for r in rs], dtype=float)
            m = np.nanmean(y, axis=0)
            s = np.nanstd(y, axis=0, ddof=1) if len(rs) > 1 else np.zeros_like(m)
            ax.plot(x, m, color=colors.get(a), lw=1.4,
                    label=f"{ARM_LABEL[a]} (lr {rs[0]['lr']:g}, n={len(rs)})")
            ax.fill_between(x, m - s, m + s, color=colors.get(a), alpha=0.18, lw=0)
        ax.set_title(f"{task}, r = {rank}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("test accuracy (mean ± std over seeds)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out_dir: str, config: Dict[str, Any], config_hash: str,
           records: Sequence[Dict[str, Any]], wall_s: Optional[float] = None,
           source: Optional[str] = None) -> Dict[str, Any]:
    """Write ``summary.md``, ``summary.json`` and ``fig_lora_accuracy.png`` from the records alone
    (the same output from a run and from ``quotient-manifolds report DIR``)."""
    summ = summarise(config, records)
    syn = config.get("synthetic", False)
    tag = " [SYNTHETIC: tiny random BERT on synthetic tokens, smoke test only]" if syn else ""
    n_train = sum(1 for r in records if r.get("kind") in ("grid", "seed"))
    lines = [f"# LoRA optimizers: AdamW vs peft Riemannian vs GL(r)-invariant{tag}", "",
             f"Configuration hash `{config_hash}`; {n_train} training runs and "
             f"{sum(1 for r in records if r.get('kind') == 'timing')} timing runs; "
             f"written {_dt.datetime.now().isoformat(timespec='seconds')}"
             + (f"; this run took {wall_s / 60:.1f} min" if wall_s else "")
             + (f"; source {source}" if source else "") + ".", "",
             f"Model: {'SYNTHETIC tiny BERT' if syn else 'all-MiniLM-L6-v2'} ({config['layers']} "
             f"layers, frozen), mean-pool head (AdamW lr {config['head_lr']:g}, weight decay "
             f"{config['head_weight_decay']:g}, every arm); LoRA on "
             f"{', '.join(config['target_modules'])}, lora_alpha = {config['alpha_over_r']:g}·r. "
             f"Data: {'SYNTHETIC tokens' if syn else ', '.join(config['tasks'])}, "
             f"{config['train_size']} train / {config['val_size']} validation / "
             f"{config['test_size']} test; {config['steps']} steps of {config['batch_size']}, "
             f"warm-up {config['warmup']:g} then linear decay. lr per arm picked on seed "
             f"{config['seeds'][0]} by final validation accuracy; target of steps-to-accuracy = "
             f"{config['target_fraction']:g} × the best final mean test accuracy at that r "
             f"(runs that never reach it are counted in 'reached', not in the mean).", "",
             "| task | r | arm | lr | final test acc (mean ± std) | seeds | steps to target "
             "(mean ± std) | reached | step ms (runs, median) | timing run: step ms | "
             "optimizer ms | ratio vs AdamW |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in summ["cells"].values():
        lines.append(
            f"| {cell['task']} | {cell['rank']} | {ARM_LABEL[cell['arm']]} | "
            f"{'—' if cell['lr'] is None else format(cell['lr'], 'g')} | "
            f"{_fmt(cell['final_mean'], cell['final_std'])} | {len(cell['seeds'])}"
            + (f" ({cell['diverged']} diverged, left out)" if cell["diverged"] else "") + " | "
            f"{_fmt(cell['steps_mean'], cell['steps_std'], 0)} (target "
            f"{cell['target']:.4f}) | {cell['reached']}/{len(cell['seeds'])} | "
            f"{cell['median_step_ms']:.0f} | {cell['timing_ms']:.0f} | "
            f"{cell['timing_opt_ms']:.1f} | {cell['timing_ratio']:.3f} |")
    lines += ["", "**Which wins.** " + " ".join(summ["verdicts"].values()), "",
              "Step-time ratio: one timing run per (task, r), all arms in one process, steps "
              "interleaved on the same batches (goal ≤ 1.1× AdamW). 'step ms (runs)' comes from "
              "the separate runs, whose machine load differs.", "",
              "## lr grids (seed 0, final validation accuracy)", "",
              "| task | r | arm | lr: val acc |", "|---|---|---|---|"]
    for cell in summ["cells"].values():
        grid = ", ".join(f"{g['lr']:g}: " + ("diverged" if g["diverged"] else
                                              f"{g['val_acc']:.4f}") for g in cell["grid"])
        lines.append(f"| {cell['task']} | {cell['rank']} | {ARM_LABEL[cell['arm']]} | {grid} |")
    edges = [f"{ARM_LABEL[c['arm']]} ({c['task']}, r = {c['rank']}, lr {c['lr']:g})"
             for c in summ["cells"].values() if c["at_grid_edge"]]
    if edges:
        lines += ["", "Picked at an end of its lr grid (a value outside the grid might do "
                  "better): " + "; ".join(edges) + "."]
    lines += ["", "![test accuracy vs step](fig_lora_accuracy.png)", ""]
    _figure(os.path.join(out_dir, "fig_lora_accuracy.png"), config, records,
            f"LoRA optimizers{tag}")
    summary = dict(study=NAME, config_hash=config_hash, synthetic=syn, **summ)
    write_summary(out_dir, lines, summary, config)
    return summary


def print_summary(summary: Dict[str, Any], log=print) -> None:
    log(f"{'task':5s} {'r':>3s} {'arm':16s} {'lr':>8s}  final acc          steps  ratio")
    for c in summary["cells"].values():
        log(f"{c['task']:5s} {c['rank']:3d} {c['arm']:16s} "
            f"{'-' if c['lr'] is None else format(c['lr'], '8.2g'):>8s}  "
            f"{_fmt(c['final_mean'], c['final_std']):17s}  "
            f"{c['steps_mean']:5.0f}  {c['timing_ratio']:.3f}")
    for v in summary["verdicts"].values():
        log(v)

