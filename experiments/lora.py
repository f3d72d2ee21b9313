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
* model: the real all-MiniLM-L6-v2 (all 6 layers, :func:`quotient_manifolds.experiments.text.build_model`: masked
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

import itertools
import math
import os
import platform
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .options import float_list, int_list, positive_int, seed_list, shown
from .population import default_out, log_line, set_threads
from .runner import ExperimentError, check_parent_alive
from .stats import mean_std
from .training import schedule_factor, train_steps

NAME = "lora"
ARMS = ("adamw", "peft-riemannian", "ours-adam", "ours-sgd")
TASKS = ("rt", "mr")
ARM_LABEL = {"adamw": "AdamW", "peft-riemannian": "peft Riemannian (AdamW)",
             "ours-adam": "ours: RiemannianAdam", "ours-sgd": "ours: InvariantRiemannianSGD"}
#: lr grids per arm (picked on seed 0 by validation accuracy); centred by the pilot
LR_GRID: Dict[str, List[float]] = {
    "adamw": [3e-4, 1e-3, 3e-3],
    "peft-riemannian": [3e-4, 1e-3, 3e-3],
    "ours-adam": [1e-2, 3e-2, 1e-1],
    "ours-sgd": [3e-3, 1e-2, 3e-2],
}
STEPS_TO_LEVELS = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85)


def defaults(quick: bool) -> Dict[str, Any]:
    """The study's configuration (module docstring). ``quick``: the SYNTHETIC smoke test."""
    c: Dict[str, Any] = dict(
        synthetic=False, tasks=["rt"], split_seed=0, train_size=2000, val_size=400, test_size=800,
        max_length=64, layers=6, head="mean", ranks=[4, 16], alpha_over_r=2.0,
        target_modules=["query", "value"], seeds=[0, 1, 2], arms=list(ARMS),
        lr_grid={a: list(v) for a, v in LR_GRID.items()}, steps=250, batch_size=16,
        eval_steps=[25, 50, 100, 150, 200, 250], warmup=0.1, head_lr=1e-3,
        head_weight_decay=0.01, peft_reg=1e-2, metric="mix", eps=1e-3, sgd_momentum=0.9,
        timing_steps=30, target_fraction=0.95)
    if quick:
        c.update(synthetic=True, train_size=192, val_size=64, test_size=96, max_length=16,
                 layers=2, ranks=[2, 4], seeds=[0, 1], steps=24, eval_steps=[8, 16, 24],
                 head_lr=3e-3, timing_steps=4,
                 lr_grid={"adamw": [3e-3, 1e-2], "peft-riemannian": [1e-2],
                          "ours-adam": [3e-2, 1e-1], "ours-sgd": [3e-2]})
    return c


def check_config(c: Dict[str, Any]) -> None:
    """Errors a user can act on, before anything runs."""
    bad = [a for a in c["arms"] if a not in ARMS]
    if bad or not c["arms"]:
        raise ExperimentError(f"unknown arms {bad}; valid: {', '.join(ARMS)}")
    bad = [t for t in c["tasks"] if t not in TASKS]
    if bad or not c["tasks"]:
        raise ExperimentError(f"unknown tasks {bad}; valid: {', '.join(TASKS)}")
    if len(set(c["seeds"])) != len(c["seeds"]):
        raise ExperimentError(f"--seeds has repeated seeds: {c['seeds']}")
    for a in c["arms"]:
        grid = c["lr_grid"].get(a)
        if not grid or any(not (math.isfinite(v) and v > 0) for v in grid):
            raise ExperimentError(f"arm {a}: the lr grid must be positive numbers, got {grid}")
    ev = c["eval_steps"]
    if sorted(set(ev)) != list(ev) or ev[0] < 1 or ev[-1] != c["steps"]:
        raise ExperimentError(f"--eval-steps must be increasing and end at --steps {c['steps']}, "
                              f"got {ev}")
    if c["timing_steps"] < 3:
        raise ExperimentError("timing_steps must be ≥ 3 (the first 2 are discarded)")


# ------------------------------------------------------------------------------------ run specs
def run_specs(c: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every job of the study in a fixed order; a job's ``model_id`` is its index. ``grid``: seed 0
    at every lr of the arm's grid; ``seed``: the other seeds at the lr picked on the grid;
    ``timing``: one interleaved timing run per (task, r)."""
    specs: List[Dict[str, Any]] = []
    for task in c["tasks"]:
        for r in c["ranks"]:
            for arm in c["arms"]:
                for lr in c["lr_grid"][arm]:
                    specs.append(dict(kind="grid", task=task, rank=r, arm=arm, lr=float(lr),
                                      seed=int(c["seeds"][0])))
    for task in c["tasks"]:
        for r in c["ranks"]:
            for arm in c["arms"]:
                for seed in c["seeds"][1:]:
                    specs.append(dict(kind="seed", task=task, rank=r, arm=arm, seed=int(seed)))
    for task in c["tasks"]:
        for r in c["ranks"]:
            specs.append(dict(kind="timing", task=task, rank=r, seed=int(c["seeds"][0])))
    return specs


def ids_of(c: Dict[str, Any], kind: str) -> List[int]:
    return [i for i, s in enumerate(run_specs(c)) if s["kind"] == kind]


def _cell(task: str, rank: int, arm: str) -> str:
    return f"{task}/r{rank}/{arm}"


def pick_lrs(records: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per ``task/r<rank>/arm`` the grid record with the highest final validation accuracy (ties:
    lower validation loss, then the smaller lr); diverged runs rank last."""
    best: Dict[str, Tuple[Tuple[float, float, float], Dict[str, Any]]] = {}
    for rec in records:
        if rec.get("kind") != "grid":
            continue
        acc, loss = rec["val_acc"], rec["val_loss"]
        key = (acc if math.isfinite(acc) else -1.0, -loss if math.isfinite(loss) else -math.inf,
               -rec["lr"])
        cell = _cell(rec["task"], rec["rank"], rec["arm"])
        if cell not in best or key > best[cell][0]:
            best[cell] = (key, rec)
    return {cell: rec for cell, (_, rec) in best.items()}


# ------------------------------------------------------------------------------------ data/model
def _text_config(c: Dict[str, Any], task: str) -> Dict[str, Any]:
    """The :mod:`quotient_manifolds.experiments.text` configuration keys its loader and model builder read."""
    return dict(data="synthetic" if c["synthetic"] else task, split_seed=c["split_seed"],
                train_size=c["train_size"] + c["val_size"], test_size=c["test_size"],
                max_length=c["max_length"], layers=c["layers"], head=c["head"],
                train_embeddings=False)


def load_data(c: Dict[str, Any], task: str, data_dir: Optional[str]) -> Dict[str, Any]:
    """Tokenised fixed splits (:func:`quotient_manifolds.experiments.text.load_data`, cached per process) with the
    last ``val_size`` sentences of the shuffled train part split off as validation."""
    from . import text as T
    d = dict(T.load_data(_text_config(c, task), data_dir))
    tr = d["train"]
    d["train"], d["val"] = tr[: c["train_size"]], tr[c["train_size"]:]
    return d


def build_model(c: Dict[str, Any], task: str, rank: int, seed: int):
    """Frozen MiniLM (or, quick, the tiny SYNTHETIC BERT) with the mean-pool head, wrapped by peft
    LoRA of rank ``rank`` on ``target_modules``; the head is trainable (``modules_to_save``).
    The head's and LoRA's initialisations depend on ``seed`` only."""
    import torch
    from peft import LoraConfig, get_peft_model

    from . import text as T
    base = T.build_model(_text_config(c, task), seed)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=c["alpha_over_r"] * rank, lora_dropout=0.0,
                     target_modules=list(c["target_modules"]), modules_to_save=["classifier"])
    return get_peft_model(base, cfg)


def _is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def make_optimizers(model, arm: str, lr: float, c: Dict[str, Any]):
    """``(LoRA optimizer, head optimizer)`` of ``arm`` (module docstring). The head AdamW is the
    same in every arm; it must be built on the head parameters collected before the LoRA pairs are
    re-pointed (``ours-*``)."""
    import geoopt
    import torch

    from quotient_manifolds import adapters
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lora = [p for n, p in named if _is_lora(n)]
    head = [p for n, p in named if not _is_lora(n)]
    if not lora:
        raise ExperimentError("the model has no trainable LoRA parameters")
    head_opt = torch.optim.AdamW(head, lr=c["head_lr"], weight_decay=c["head_weight_decay"])
    if arm == "adamw":
        return torch.optim.AdamW(lora, lr=lr, weight_decay=0.0), head_opt
    if arm == "peft-riemannian":
        from peft.optimizers import create_riemannian_optimizer
        # peft puts every trainable parameter into its optimizer; hide the head while it is built
        for p in head:
            p.requires_grad_(False)
        try:
            opt = create_riemannian_optimizer(model, torch.optim.AdamW, lr=lr, reg=c["peft_reg"],
                                              weight_decay=0.0)
        finally:
            for p in head:
                p.requires_grad_(True)
        return opt, head_opt
    if arm in ("ours-adam", "ours-sgd"):
        groups = adapters.lora_quotient_parameters(model, metric=c["metric"], gram_eps=c["eps"])
        others = {id(p) for g in groups[1:] for p in g["params"]}
        if others != {id(p) for p in head}:
            raise ExperimentError("lora_quotient_parameters left other trainable parameters than "
                                  "the head outside the points")
        if arm == "ours-adam":
            return geoopt.optim.RiemannianAdam(groups[:1], lr=lr), head_opt
        return adapters.InvariantRiemannianSGD(groups[:1], lr=lr,
                                               momentum=c["sgd_momentum"]), head_opt
    raise ExperimentError(f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")


class _Trainer:
    """One arm's model, optimizers and schedules; :meth:`step` is one timed training step."""

    def __init__(self, c: Dict[str, Any], task: str, rank: int, arm: str, lr: float, seed: int):
        import torch
        self.model = build_model(c, task, rank, seed)
        self.n_lora = int(sum(p.numel() for n, p in self.model.named_parameters()
                              if p.requires_grad and _is_lora(n)))
        self.opts = make_optimizers(self.model, arm, lr, c)
        # TrainingLoop's "linear" schedule, on both optimizers; TrainingLoop itself drives one
        # optimizer and clips the Euclidean gradient norm, which is not GL-invariant
        factor = schedule_factor(c["steps"], c["warmup"], "linear")
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.opts]
        self.model.train()

    def step(self, inputs, labels) -> Tuple[float, float, float]:
        """(loss, step seconds, optimizer-step seconds): forward, backward, both optimizers."""
        import torch.nn.functional as F
        started = time.perf_counter()
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(**inputs).logits, labels)
        loss.backward()
        opt_started = time.perf_counter()
        for o in self.opts:
            o.step()
        for s in self.scheds:
            s.step()
        now = time.perf_counter()
        return float(loss.detach()), now - started, now - opt_started


def _batches(c: Dict[str, Any], data: Dict[str, Any], seed: int):
    """An endless stream of length-bucketed training batches (epochs reshuffled), from the seed."""
    from .text import batch_stream
    return batch_stream(data, data["train"], c["batch_size"], seed)


def evaluate(model, data: Dict[str, Any], split: str) -> Tuple[float, float]:
    """(accuracy, mean cross-entropy) on a split, eval mode (then back to train mode)."""
    from . import text as T
    from .stats import error_and_loss
    idx = data[split]
    err, loss = error_and_loss(T.predict(model, data, idx), data["labels"][idx])
    model.train()
    return 1.0 - err, loss


def steps_to(curve_steps: Sequence[int], accs: Sequence[float], level: float) -> Optional[int]:
    """The first eval step whose accuracy is ≥ ``level`` (None if never)."""
    for s, a in zip(curve_steps, accs):
        if math.isfinite(a) and a >= level:
            return int(s)
    return None


def versions() -> Dict[str, str]:
    import geoopt
    import peft
    import torch
    import transformers
    return dict(python=platform.python_version(), torch=torch.__version__, peft=peft.__version__,
                geoopt=geoopt.__version__, transformers=transformers.__version__,
                threads=str(torch.get_num_threads()))


def train_run(c: Dict[str, Any], spec: Dict[str, Any], data: Dict[str, Any],
              progress: bool = False) -> Dict[str, Any]:
    """One (task, r, arm, lr, seed) fine-tune: the curves, final test / validation accuracy and
    loss, steps to fixed accuracies, median step times. A non-finite loss stops the run
    (``diverged``; its accuracies are NaN)."""
    trainer = _Trainer(c, spec["task"], spec["rank"], spec["arm"], spec["lr"], spec["seed"])
    batches = _batches(c, data, spec["seed"])
    losses: List[float] = []
    step_s: List[float] = []
    opt_s: List[float] = []
    curve: List[float] = []
    curve_loss: List[float] = []
    evals = set(c["eval_steps"])
    diverged = False
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=c["steps"], desc=f"{spec['arm']} r={spec['rank']}", unit="step",
                   leave=False, dynamic_ncols=True)
    started = time.perf_counter()
    eval_s = 0.0

    def after(step: int, out: Tuple[float, float, float]) -> bool:
        nonlocal diverged, eval_s
        loss, s, o = out
        losses.append(loss)
        step_s.append(s)
        opt_s.append(o)
        if bar is not None:
            bar.update(1)
        if not math.isfinite(loss):
            diverged = True
            return True
        if step in evals:
            t = time.perf_counter()
            acc, tl = evaluate(trainer.model, data, "test")
            curve.append(acc)
            curve_loss.append(tl)
            eval_s += time.perf_counter() - t
        return False

    train_steps(lambda batch: trainer.step(*batch), itertools.islice(batches, c["steps"]), after)
    if bar is not None:
        bar.close()
    nan = float("nan")
    if diverged:
        curve += [nan] * (len(c["eval_steps"]) - len(curve))
        curve_loss += [nan] * (len(c["eval_steps"]) - len(curve_loss))
        val_acc = val_loss = nan
    else:
        t = time.perf_counter()
        val_acc, val_loss = evaluate(trainer.model, data, "val")
        eval_s += time.perf_counter() - t
    timed = step_s[2:] or step_s  # the first steps allocate buffers
    return dict(
        kind=spec["kind"], task=spec["task"], rank=spec["rank"], arm=spec["arm"], lr=spec["lr"],
        seed=spec["seed"], eval_steps=list(c["eval_steps"]), test_acc_curve=curve,
        test_loss_curve=curve_loss, train_loss=losses, final_test_acc=curve[-1],
        final_test_loss=curve_loss[-1], val_acc=val_acc, val_loss=val_loss, diverged=diverged,
        steps_to={f"{lv:g}": steps_to(c["eval_steps"], curve, lv) for lv in STEPS_TO_LEVELS},
        median_step_ms=1e3 * float(np.median(timed)),
        median_opt_step_ms=1e3 * float(np.median(opt_s[2:] or opt_s)),
        n_lora_params=trainer.n_lora, train_s=time.perf_counter() - started - eval_s,
        eval_s=eval_s, versions=versions())


def timing_run(c: Dict[str, Any], spec: Dict[str, Any], data: Dict[str, Any],
               lrs: Dict[str, float]) -> Dict[str, Any]:
    """All arms of one (task, r) in this process, one step of each in turn on the same batch
    (the order rotated every step), ``timing_steps`` steps each; the first 2 are discarded.
    Interleaving puts every arm under the same machine load, which separate runs do not."""
    arms = list(c["arms"])
    trainers = {a: _Trainer(c, spec["task"], spec["rank"], a, lrs[a], spec["seed"]) for a in arms}
    batches = _batches(c, data, spec["seed"])
    step_s: Dict[str, List[float]] = {a: [] for a in arms}
    opt_s: Dict[str, List[float]] = {a: [] for a in arms}
    for k in range(c["timing_steps"]):
        check_parent_alive()
        inputs, labels = next(batches)
        for a in arms[k % len(arms):] + arms[: k % len(arms)]:
            _, s, o = trainers[a].step(inputs, labels)
            step_s[a].append(s)
            opt_s[a].append(o)
    med = {a: 1e3 * float(np.median(v[2:])) for a, v in step_s.items()}
    med_opt = {a: 1e3 * float(np.median(v[2:])) for a, v in opt_s.items()}
    ref = med.get("adamw")
    return dict(kind="timing", task=spec["task"], rank=spec["rank"], seed=spec["seed"],
                arms=arms, lrs=lrs, timing_steps=c["timing_steps"], median_step_ms=med,
                median_opt_step_ms=med_opt,
                ratio_vs_adamw={a: (m / ref if ref else float("nan")) for a, m in med.items()},
                step_ms={a: [1e3 * x for x in v] for a, v in step_s.items()},
                versions=versions())


def job(model_id: int, config: Dict[str, Any], picked: Dict[str, float],
        data_dir: Optional[str], progress: bool) -> Dict[str, Any]:
    """Job ``model_id`` of :func:`run_specs` (in a worker process). ``picked``: the lr chosen per
    ``task/r<rank>/arm`` on the grid (needed by the seed and timing jobs)."""
    import torch
    spec = dict(run_specs(config)[model_id])
    data = load_data(config, spec["task"], data_dir)
    torch.manual_seed(spec["seed"])
    if spec["kind"] == "timing":
        lrs = {a: picked[_cell(spec["task"], spec["rank"], a)] for a in config["arms"]}
        rec = timing_run(config, spec, data, lrs)
    else:
        if spec["kind"] == "seed":
            spec["lr"] = picked[_cell(spec["task"], spec["rank"], spec["arm"])]
        rec = train_run(config, spec, data, progress)
    rec["study_config"] = config
    return rec


# ------------------------------------------------------------------------------------ report
def comparison_runs(records: Sequence[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """Per ``task/r<rank>/arm``: the seed-0 grid run at the picked lr and the other seeds' runs."""
    picked = pick_lrs(records)
    out: Dict[str, List[Dict[str, Any]]] = {cell: [rec] for cell, rec in picked.items()}
    for rec in records:
        if rec.get("kind") == "seed":
            cell = _cell(rec["task"], rec["rank"], rec["arm"])
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
            here = {a: runs.get(_cell(task, rank, a), []) for a in config["arms"]}
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
                cells[_cell(task, rank, a)] = dict(
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
            verdicts[tkey] = _verdict(task, rank, {a: cells[_cell(task, rank, a)]
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = comparison_runs(records)
    panels = [(t, r) for t in config["tasks"] for r in config["ranks"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.8 * len(panels), 3.0), squeeze=False)
    colors = {"adamw": "#7f7f7f", "peft-riemannian": "#ff7f0e", "ours-adam": "#1f77b4",
              "ours-sgd": "#2ca02c"}
    for ax, (task, rank) in zip(axes[0], panels):
        for a in config["arms"]:
            rs = runs.get(_cell(task, rank, a), [])
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
    import datetime as _dt
    import json

    from .runner import atomic_write_bytes
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
    atomic_write_bytes(os.path.join(out_dir, "summary.md"), ("\n".join(lines) + "\n").encode())
    atomic_write_bytes(os.path.join(out_dir, "summary.json"),
                       (json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n").encode())
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
    from .runner import OutputDir, fmt_seconds, run_population

    c = config_from_args(args)
    if not c["synthetic"]:  # fail early with the preparing command
        from . import text as T
        from .data import find_mr, find_rt
        for task in c["tasks"]:
            (find_rt if task == "rt" else find_mr)(args.data_dir)
        T.model_path()
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
        missing = [_cell(s["task"], s["rank"], s["arm"]) for s in specs if s["kind"] == "seed"
                   and _cell(s["task"], s["rank"], s["arm"]) not in picked]
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
