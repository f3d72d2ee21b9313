r"""SAM training study: does taking SAM's ascent step on the GL(h) quotient help training?

``quotient-manifolds sam`` trains every arm below on two tasks, with the same number of
optimizer updates per arm, and reports test accuracy at each method's validation-selected ρ.

Arms (all through :class:`quotient_manifolds.adapters.GeodesicSAM` except the base optimizer; ``METHODS``)::

    base           AdamW alone: w ← AdamW(w, ∇L(w))
    base-2x        AdamW alone with twice the updates (as many gradients as a SAM arm)
    sam            ε = ρ ∇/‖∇‖₂,              w_adv = w + ε                  (Foret et al.)
    asam           ε = ρ T²∇/‖T∇‖₂, T = |w|,  w_adv = w + ε                  (Kwon et al.)
    geodesic-inv   ε = ρ g/‖g‖_inv  (horizontal Riemannian gradient of the inv metric on every
                   GL block, adaptive recipe elsewhere), w_adv = x + ε − ½Γ(ε, ε)
    geodesic-mix   the same with the mix metric (its ρ has units: ‖·‖_mix scales like |w|⁴)

and every SAM arm then takes w ← AdamW(w, ∇L(w_adv)) (two gradients per update). The ascent of
each arm is GeodesicSAM's ``geometry`` option ("sam"; "adaptive" with the first-order
retraction, exactly ASAM; "geodesic-inv" / "geodesic-mix" with the second-order geodesic); the
maths is in :mod:`quotient_manifolds.adapters.sam`.

Tasks (``defaults``):

* ``vit``: the small ViT of :mod:`quotient_manifolds.experiments.vit` (139k weights) trained **from scratch** on a
  Fashion-MNIST subset: the first ``train_size`` images of the vision study's fixed seeded order
  (:func:`quotient_manifolds.experiments.vision.load_data`), the next ``val_size`` are the validation split, test on
  the official test images. AdamW (not SGD + momentum): ViTs train poorly from scratch with SGD,
  the vision study's AdamW recipe (lr 1e-3, cosine, warm-up 5 %) is known to converge on these
  images, and SAM for ViTs is usually run on AdamW (Chen et al. 2022). No augmentation.
* ``minilm``: all-MiniLM-L6-v2 (real weights, all 6 layers, mean-pool head,
  :func:`quotient_manifolds.experiments.text_model.build_model`) fine-tuned on Rotten Tomatoes snippets
  (:func:`quotient_manifolds.experiments.text_model.load_data`: one fixed class-balanced seeded split; the last
  ``val_size`` sentences of the train part are the validation split). AdamW (the fine-tuning
  default), linear warm-up 10 % and decay to 0; token / position embeddings frozen as in the text
  study's small protocol (half of the 22.6M weights: freezing them halves AdamW's state and the
  parameters every SAM ascent visits).

Both tasks: grad-norm clip 1 on the gradient the base optimizer uses (at w for the base arms, at
w_adv for the SAM arms), weight decay on matrices only, the same initialisation and data order for
every arm at a given seed (paired comparison), and for MiniLM the same dropout mask in both passes
of a SAM update (so the ascent perturbs the weights, not the mask).

Protocol:

1. ρ sweep: each SAM arm's ρ has its own scale, so each is swept over the same multipliers
   ``rho_factors`` (default ×¼, ×1, ×4) of its own centre ``rho[method]``. The centres were chosen
   in the pilot so that the first-order loss increase at w_adv, ρ·‖g‖ (‖g‖ the arm's metric norm
   of its ascent direction), is SAM's at ρ = 0.05 for every arm, at the weights after 150 (ViT) /
   25 (MiniLM) AdamW updates (experiments/README.md, "sam"). The sweep runs on the first
   ``sweep_seeds`` seeds.
2. Selection: per (task, arm) the ρ with the highest mean validation accuracy over the sweep
   seeds (ties: the one nearest the centre).
3. Seeds: the selected ρ is run on the remaining seeds (``seeds`` in all, ≥ 3); the base arms run
   every seed.
4. Timing: one job per task times every arm in ONE process, interleaved over rounds on the same
   batches (median seconds per update, ratio to SAM), and records the loss increase
   L(w_adv) − L(w) of each arm at its centre ρ.

Per run (one line of results.jsonl per (task, method, ρ, seed)): final train loss / accuracy (eval
mode, the whole training split), validation and test accuracy and loss, the validation curve at
``evals`` equally spaced updates, the median seconds per update of that run, the number of gradient
evaluations, hyperparameters and seed. ``--quick`` runs the same protocol on SYNTHETIC data with a
tiny ViT and a tiny random BERT in seconds (tests only).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

from .data import find_fashion_mnist, find_rt
from .options import float_list, positive_int, shown
from .population import default_out, log_line, set_threads
from .runner import ExperimentError, OutputDir, fmt_seconds, load_current, run_population
from .sam_plan import (NAME, check_config, defaults, longest_first, plan, rho_grid, run_seed, seed_ids,
                       select_rho, sweep_ids, synthetic, tasks_of)
from .sam_report import report, summarise, verdict
from .sam_training import METHODS, SAM_METHODS, STEP_FACTOR, TASKS, get_task, timing_run, train_run
from .text_model import model_path

__all__ = ["NAME", "TASKS", "METHODS", "SAM_METHODS", "STEP_FACTOR", "defaults", "plan", "rho_grid",
           "select_rho", "seed_ids", "sweep_ids", "longest_first", "tasks_of", "summarise", "verdict",
           "job", "report", "add_arguments", "config_from_args", "run"]


def job(model_id: int, config: Dict[str, Any], data_dir: Optional[str], progress: bool
        ) -> Dict[str, Any]:
    """One job of :func:`plan` (run in a worker process)."""
    j = plan(config)[model_id]
    cfg = config["tasks"][j["task"]]
    task = get_task(j["task"], cfg, data_dir)
    started = time.perf_counter()
    if j["kind"] == "timing":
        out = timing_run(task, cfg, config["methods"], run_seed(config, 0), config["timing"])
        return dict(j, timing=out, study_config=config, total_s=time.perf_counter() - started)
    seed = run_seed(config, j["seed"])
    out = train_run(task, cfg, j["method"], j["rho"], seed, progress)
    hp = {k: cfg[k] for k in ("optimizer", "lr", "weight_decay", "batch_size", "warmup",
                              "decay")}
    hp.update(steps=out["updates"], geometry=METHODS[j["method"]], torch_seed=seed)
    return dict(j, **out, rho_factor=(cfg["rho_factors"][j["rho_index"]]
                                      if METHODS[j["method"]] is not None else None),
                hparams=hp, study_config=config, total_s=time.perf_counter() - started)


# ------------------------------------------------------------------------------------ CLI
def add_arguments(p) -> None:
    """The ``sam`` subcommand's own options (the common ones:
    :func:`~quotient_manifolds.experiments.options.common_arguments`)."""
    full, quick = defaults(False), defaults(True)  # the values the help states
    vit, minilm = full["tasks"]["vit"], full["tasks"]["minilm"]
    g = p.add_argument_group("sam study")
    g.add_argument("--tasks", default=None, metavar="T1,T2",
                   help=f"tasks to run (default all: {','.join(TASKS)})")
    g.add_argument("--methods", default=None, metavar="M1,M2,...",
                   help=f"arms (default all: {','.join(METHODS)}; 'sam' is required as the cost "
                        f"reference)")
    g.add_argument("--seeds", type=positive_int, default=None,
                   help=f"seeds per arm at the selected ρ (default {full['seeds']}; quick {quick['seeds']})")
    g.add_argument("--sweep-seeds", type=positive_int, default=None,
                   help=f"seeds on which every ρ of the sweep runs (default {full['sweep_seeds']}; --sweep-seeds "
                        "equal to --seeds sweeps every seed)")
    g.add_argument("--vit-steps", type=positive_int, default=None,
                   help=f"optimizer updates per ViT run (default {vit['steps']}; base-2x runs twice that)")
    g.add_argument("--minilm-steps", type=positive_int, default=None,
                   help=f"optimizer updates per MiniLM run (default {minilm['steps']})")
    g.add_argument("--rho-factors", type=float_list, default=None, metavar="F1,F2,...",
                   help=f"multipliers of each arm's centre ρ in the sweep (default {shown(vit['rho_factors'])})")
    g.add_argument("--rho-centre", action="append", default=None, metavar="TASK:METHOD=RHO",
                   help="centre of an arm's ρ sweep (repeatable), e.g. vit:geodesic-mix=0.01 "
                        "(defaults in experiments/sam_study.py: matched loss increase in the "
                        "pilot)")


def config_from_args(args) -> Dict[str, Any]:
    """The configuration of a run: :func:`defaults` with the command-line overrides."""
    config = defaults(args.quick)
    if args.seed is not None:
        config["seed"] = args.seed
    if args.tasks:
        names = [t.strip() for t in args.tasks.split(",") if t.strip()]
        bad = [t for t in names if t not in TASKS]
        if bad or not names:
            raise ExperimentError(f"--tasks {args.tasks!r}: valid tasks are {', '.join(TASKS)}")
        config["tasks"] = {t: config["tasks"][t] for t in names}
    if args.methods:
        config["methods"] = [m.strip() for m in args.methods.split(",") if m.strip()]
    for key in ("seeds", "sweep_seeds"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    if args.sweep_seeds is None:
        config["sweep_seeds"] = min(config["sweep_seeds"], config["seeds"])
    for task in config["tasks"]:
        v = getattr(args, f"{task}_steps")
        if v is not None:
            config["tasks"][task]["steps"] = v
        if args.rho_factors is not None:
            config["tasks"][task]["rho_factors"] = list(args.rho_factors)
    for item in args.rho_centre or []:
        try:
            where, value = item.split("=")
            task, method = where.split(":")
            value = float(value)
        except ValueError:
            raise ExperimentError(f"--rho-centre {item!r}: expected TASK:METHOD=RHO, e.g. "
                                  f"vit:geodesic-mix=0.01") from None
        if task not in config["tasks"] or method not in SAM_METHODS or not value > 0:
            raise ExperimentError(f"--rho-centre {item!r}: task must be one of "
                                  f"{', '.join(config['tasks'])}, method one of "
                                  f"{', '.join(SAM_METHODS)}, ρ > 0")
        config["tasks"][task]["rho"][method] = value
    check_config(config)
    return config


def run(args, log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds sam``: the sweep phase, the selection, the seeds phase, the
    report (each phase resumes from results.jsonl)."""
    config = config_from_args(args)
    if not synthetic(config):  # fail early with the preparing command
        if "vit" in config["tasks"]:
            find_fashion_mnist(args.data_dir)
        if "minilm" in config["tasks"]:
            find_rt(args.data_dir)
            model_path()
    out = os.path.abspath(args.out or default_out(NAME, args))
    started = time.perf_counter()
    threads = set_threads(args.workers, args.threads)
    progress = not args.no_progress
    failed: List[int] = []
    with OutputDir(out, NAME, config, force_mix=args.force_mix) as od:
        log(f"sam: {len(plan(config))} possible jobs -> {od.path} (results.jsonl, rerun to resume)")
        common = dict(workers=args.workers, progress=progress, log=log, threads=threads)
        _, f1 = run_population(od, job, longest_first(config, sweep_ids(config)),
                               (config, args.data_dir, progress and args.workers <= 1),
                               desc="sam sweep", **common)
        selected = select_rho(load_current(od.path, od.hash), config)
        log("sam: selected ρ " + ", ".join(
            f"{t}/{m} {rho_grid(config['tasks'][t], m)[i]:g}" for (t, m), i in selected.items()
            if METHODS[m] is not None))
        _, f2 = run_population(od, job, longest_first(config, seed_ids(config, selected)),
                               (config, args.data_dir, progress and args.workers <= 1),
                               desc="sam seeds", **common)
        failed = f1 + f2
        records = load_current(od.path, od.hash)
        wall = time.perf_counter() - started
        summary = report(od.path, config, od.hash, records, wall_s=wall)
    for task, v in summary["verdicts"].items():
        log(v)
    log(f"sam: {len(records)} jobs done in {fmt_seconds(wall)} this run"
        + (f"; {len(failed)} FAILED (see {os.path.join(out, 'errors.jsonl')}; rerun retries "
           f"them)" if failed else "") + f"\n  summary: {os.path.join(out, 'summary.md')}")
    return 1 if failed else 0
