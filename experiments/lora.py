r"""LoRA optimizer study: AdamW vs peft's Riemannian-preconditioned AdamW vs the GL(r)-invariant
optimizers on the quotient, fine-tuning all-MiniLM-L6-v2 with LoRA on Rotten Tomatoes.

A LoRA update ``ΔW = s·B A`` (``s = lora_alpha / r``) is unchanged by ``(B, A) ↦ (B M, M⁻¹ A)``,
M ∈ GL(r). Plain AdamW on (A, B) is not invariant, nor is peft's ``create_riemannian_optimizer``
(g_A ← (BᵀB + δI)⁻¹ g_A, g_B ← g_B (AAᵀ + δI)⁻¹, then AdamW's per-coordinate second moment);
:func:`quotient_manifolds.adapters.lora_quotient_parameters` makes each pair one point ``[B; Aᵀ]`` of the GL(r)
quotient, trained by ``geoopt.optim.RiemannianAdam`` (one second-moment scalar per point) or
:class:`quotient_manifolds.adapters.InvariantRiemannianSGD` (maths: ``adapters/lora_training.py``). The question is
practical: which trains the classifier better and faster, and at what cost per step.

Protocol (defaults; ``quotient-manifolds lora --help`` for the overrides)
----------------------------------------------------------------------------
* data: Rotten Tomatoes snippets (``prepare-data --rt``; ``--tasks rt,mr`` adds MR), one fixed
  seeded class-balanced split (:func:`quotient_manifolds.experiments.data.balanced_as_possible_split`): ``train_size``
  2,000 training sentences, ``val_size`` 400 validation sentences (the last 400 of the shuffled
  2,400-sentence train part; used only to pick the learning rates) and ``test_size`` 800 test
  sentences; max 64 tokens.
* model: the real all-MiniLM-L6-v2 (all 6 layers, :func:`quotient_manifolds.experiments.text_model.build_model`: masked
  mean pooling + linear head, the pooling the model was trained with), frozen; peft LoRA on
  ``query`` and ``value`` of every layer, rank r ∈ {4, 16}, ``lora_alpha = 2 r`` (s = 2), no
  LoRA dropout, peft's initialisation (A Kaiming-uniform, B = 0); the head is peft's
  ``modules_to_save`` copy.
* arms (LoRA factors only; the head always trains with its own AdamW, lr 1e-3, weight decay
  0.01, identical in every arm):

  - ``adamw``: ``torch.optim.AdamW`` on every lora_A / lora_B, weight decay 0 (‖A‖² + ‖B‖² is
    not a function of ΔW; 0 is also the HF Trainer default);
  - ``peft-riemannian``: ``peft.optimizers.create_riemannian_optimizer(model, AdamW, lr,
    reg=1e-2)`` (peft's default damping δ), weight decay 0; the head is hidden from it
    (``requires_grad`` off while it is built) so that it gets the shared head optimizer;
  - ``ours-adam``: ``lora_quotient_parameters(model, metric="mix", gram_eps=1e-3)`` +
    ``geoopt.optim.RiemannianAdam``. ε > 0 because peft starts at B = 0 (metric BᵀB + εI,
    AAᵀ + εI: invariant up to O(ε / eigenvalues of the Gram matrices)); 1e-3 (a tenth of peft's
    δ) from the pilot: with ε = 1e-6 and lr 3e-2 the loss rose to 1.08 within 10 steps and the
    100-step run stayed at chance, with ε = 1e-3 the same lr reached 0.75 test accuracy after 60
    steps (likely cause, not verified: while B ≈ 0 the metric (BᵀB + εI) lets A take huge steps
    in the directions where B is tiny, and the cross term ξ_B ξ_A of the first-order retraction
    then changes B A far more than the step's metric length);
  - ``ours-sgd``: the same points + :class:`quotient_manifolds.adapters.InvariantRiemannianSGD` (momentum 0.9).

* training: ``steps`` (250) steps of ``batch_size`` (16) sentences (2 epochs of the 2,000),
  length-bucketed batches (:func:`quotient_manifolds.experiments.text.bucketed_batches`), dropout on, linear
  warm-up over 10 % of the steps then linear decay to 0 (both optimizers), no gradient clipping
  (clipping by the Euclidean gradient norm is not GL-invariant). Data order, head and LoRA
  initialisation and dropout come from the seed and are identical across arms.
* curves: test accuracy at ``eval_steps`` (25, 50, 100, 150, 200, 250) on the whole test
  split; the training loss at every step.
* learning rates: each arm's lr is picked on seed 0 from its grid ``lr_grid`` (3 values, a factor
  √10 apart, centred by the pilot) per task and rank, by the final validation accuracy (ties:
  validation loss). The seed-0 run at the picked lr is then seed 0 of the comparison, and
  seeds 1, 2 run at that lr (test accuracy never enters the choice).
* steps-to-accuracy: target = ``target_fraction`` (0.95) × the best final mean test accuracy over
  the arms at that (task, r); steps to target = the first eval step whose test accuracy reaches it
  (runs that never do are counted and left out of the mean). Each record also holds the steps to
  fixed accuracies 0.60…0.85 (``steps_to``).
* cost: every run records its median step time (forward, backward, both optimizer steps; ms) and
  the optimizer-step part alone. Because runs in different processes see different loads, the
  ratio vs AdamW is taken from one timing run per (task, r): all arms built in one process, their
  steps interleaved on the same batches (``timing_steps`` each, the first 2 discarded).

``--quick``: a SYNTHETIC smoke test (tiny random BERT, synthetic tokens, ranks 2 and 4, two seeds,
one or two lrs per arm, 24 steps): seconds; every output says SYNTHETIC.

Pilot (one thread, the 2-core machine busy with two other jobs): see experiments/README.md, section
"LoRA optimizers", for the measured step times and the wall-time estimate of the full study.
"""

from __future__ import annotations
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .data import find_mr, find_rt
from .lora_plan import (ARM_LABEL, ARMS, LR_GRID, NAME, TASKS, cell_name, check_config, defaults, ids_of,
                        pick_lrs, run_specs, steps_to)
from .lora_report import print_summary, report, summarise
from .lora_runs import load_data, timing_run, train_run
from .options import float_list, int_list, positive_int, seed_list, shown
from .population import default_out, log_line, set_threads
from .runner import ExperimentError, OutputDir, fmt_seconds, run_population
from .text_model import model_path

__all__ = ["NAME", "ARMS", "TASKS", "ARM_LABEL", "LR_GRID", "defaults", "run_specs", "ids_of", "pick_lrs",
           "steps_to", "summarise", "job", "report", "add_arguments", "config_from_args", "run"]


def job(model_id: int, config: Dict[str, Any], picked: Dict[str, float],
        data_dir: Optional[str], progress: bool) -> Dict[str, Any]:
    """Job ``model_id`` of :func:`run_specs` (in a worker process). ``picked``: the lr chosen per
    ``task/r<rank>/arm`` on the grid (needed by the seed and timing jobs)."""
    spec = dict(run_specs(config)[model_id])
    data = load_data(config, spec["task"], data_dir)
    torch.manual_seed(spec["seed"])
    if spec["kind"] == "timing":
        lrs = {a: picked[cell_name(spec["task"], spec["rank"], a)] for a in config["arms"]}
        rec = timing_run(config, spec, data, lrs)
    else:
        if spec["kind"] == "seed":
            spec["lr"] = picked[cell_name(spec["task"], spec["rank"], spec["arm"])]
        rec = train_run(config, spec, data, progress)
    rec["study_config"] = config
    return rec


# ------------------------------------------------------------------------------------ CLI
def add_arguments(p) -> None:
    """The study's own options (``quotient-manifolds lora --help``)."""
    full, quick = defaults(False), defaults(True)  # the values the help states
    for action in p._actions:  # the common --seed: here it only seeds the data split
        if action.dest == "seed":
            action.help = f"seed of the fixed train/validation/test split (default {full['split_seed']})"
    g = p.add_argument_group("lora study")
    g.add_argument("--tasks", type=lambda s: [t.strip() for t in s.split(",") if t.strip()],
                   default=None, metavar="T1,...", help="rt (default) and/or mr")
    g.add_argument("--ranks", type=int_list, default=None, metavar="R1,...",
                   help=f"LoRA ranks (default {shown(full['ranks'])}; quick {shown(quick['ranks'])})")
    g.add_argument("--seeds", type=seed_list, default=None, metavar="S1,...",
                   help=f"seeds; the first picks the lrs (default {shown(full['seeds'])}; quick "
                        f"{shown(quick['seeds'])})")
    g.add_argument("--arms", type=lambda s: [t.strip() for t in s.split(",") if t.strip()],
                   default=None, metavar="A1,...", help=f"optimizers (default {','.join(ARMS)})")
    for a in ARMS:
        g.add_argument(f"--lr-grid-{a}", type=float_list, default=None, metavar="LR1,...",
                       help=f"lr grid of {a} (default {shown(LR_GRID[a])})")
    g.add_argument("--steps", type=positive_int, default=None, help=f"training steps (default {full['steps']})")
    g.add_argument("--eval-steps", type=int_list, default=None, metavar="S1,...",
                   help=f"steps with a test evaluation, ending at --steps (default "
                        f"{shown(full['eval_steps'])}; with only --steps: 6 evenly spaced)")
    for key in ("batch_size", "train_size", "val_size", "test_size"):
        g.add_argument(f"--{key.replace('_', '-')}", type=positive_int, default=None, help=f"default {full[key]}")
    g.add_argument("--timing-steps", type=positive_int, default=None,
                   help=f"steps per arm of the interleaved timing run (default {full['timing_steps']})")


def config_from_args(args) -> Dict[str, Any]:
    c = defaults(args.quick)
    if getattr(args, "seed", None) is not None:  # the common --seed: the data split's seed
        c["split_seed"] = args.seed
    for key in ("tasks", "ranks", "seeds", "arms", "steps", "batch_size", "train_size", "val_size",
                "test_size", "timing_steps"):
        v = getattr(args, key, None)
        if v is not None:
            c[key] = v
    for a in ARMS:
        v = getattr(args, f"lr_grid_{a.replace('-', '_')}", None)
        if v is not None:
            c["lr_grid"][a] = v
    c["lr_grid"] = {a: c["lr_grid"][a] for a in c["arms"] if a in c["lr_grid"]}
    if args.eval_steps is not None:
        c["eval_steps"] = args.eval_steps
    elif args.steps is not None:
        n = min(6, c["steps"])
        c["eval_steps"] = sorted({int(round(c["steps"] * (k + 1) / n)) for k in range(n)})
    check_config(c)
    return c


def run(args, log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds lora``: the grid runs, the lr choice, the other seeds, the timing
    runs, the report; resumable (finished runs are skipped)."""
    c = config_from_args(args)
    if not c["synthetic"]:  # fail early with the preparing command
        for task in c["tasks"]:
            (find_rt if task == "rt" else find_mr)(args.data_dir)
        model_path()
    out = os.path.abspath(args.out or default_out(NAME, args))
    started = time.perf_counter()
    specs = run_specs(c)
    log(f"lora: {len(specs)} jobs ({len(ids_of(c, 'grid'))} lr-grid runs, "
        f"{len(ids_of(c, 'seed'))} seed runs, {len(ids_of(c, 'timing'))} timing runs) -> {out}\n"
        f"  results: {os.path.join(out, 'results.jsonl')} (one line per finished run; rerun to "
        f"resume)\n  report: {os.path.join(out, 'summary.md')}, fig_lora_accuracy.png")
    threads = set_threads(args.workers, args.threads)
    failed: List[int] = []
    with OutputDir(out, NAME, c, force_mix=args.force_mix) as od:
        common = dict(workers=args.workers, progress=not args.no_progress, log=log,
                      threads=threads)
        inner = not args.no_progress and args.workers <= 1
        records, bad = run_population(od, job, ids_of(c, "grid"), (c, {}, args.data_dir, inner),
                                      desc="lora lr grid", **common)
        failed += bad
        picked = {cell: rec["lr"] for cell, rec in pick_lrs(records).items()}
        for cell, lr in sorted(picked.items()):
            log(f"  picked lr {cell}: {lr:g}")
        missing = [cell_name(s["task"], s["rank"], s["arm"]) for s in specs if s["kind"] == "seed"
                   and cell_name(s["task"], s["rank"], s["arm"]) not in picked]
        if missing:
            raise ExperimentError(f"no finished lr-grid run for {sorted(set(missing))}: see "
                                  f"{od.file('errors.jsonl')}; rerun to retry")
        more, bad = run_population(od, job, ids_of(c, "seed") + ids_of(c, "timing"),
                                   (c, picked, args.data_dir, inner), desc="lora seeds+timing",
                                   **common)
        failed += bad
        records = sorted(records + more, key=lambda r: r["model_id"])
        summary = report(od.path, c, od.hash, records, wall_s=time.perf_counter() - started)
    print_summary(summary, log)
    log(f"lora: {len(records)} jobs done in {fmt_seconds(time.perf_counter() - started)} this run"
        + (f"; {len(failed)} FAILED (see {os.path.join(out, 'errors.jsonl')}; rerun retries them)"
           if failed else "") + f"\n  summary: {os.path.join(out, 'summary.md')}")
    return 1 if failed else 0
