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
  :func:`quotient_manifolds.experiments.text.build_model`) fine-tuned on Rotten Tomatoes snippets
  (:func:`quotient_manifolds.experiments.text.load_data`: one fixed class-balanced seeded split; the last
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

import copy
import itertools
import math
import os
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .options import float_list, positive_int, shown
from .population import default_out, log_line, set_threads
from .runner import ExperimentError, check_parent_alive
from .stats import mean_std
from .training import TrainingLoop, adamw, train_steps

NAME = "sam"
TASKS = ("vit", "minilm")
#: arm → GeodesicSAM keyword arguments (None: the base optimizer alone)
METHODS: Dict[str, Optional[Dict[str, str]]] = {
    "base": None,
    "base-2x": None,
    "sam": dict(geometry="sam"),
    "asam": dict(geometry="adaptive", retraction="first_order"),
    "geodesic-inv": dict(geometry="geodesic-inv", retraction="second_order"),
    "geodesic-mix": dict(geometry="geodesic-mix", retraction="second_order"),
}
SAM_METHODS = tuple(m for m, kw in METHODS.items() if kw is not None)
#: updates of each arm relative to the task's ``steps`` (equal gradient evaluations for base-2x)
STEP_FACTOR = {"base-2x": 2}


def defaults(quick: bool) -> Dict[str, Any]:
    """The study's configuration (module docstring; sizes and steps from the pilot in
    experiments/README.md). ``quick``: SYNTHETIC data, tiny models, a few updates."""
    vit: Dict[str, Any] = dict(
        data="fashion-mnist", split_seed=0, train_size=6000, val_size=2000, test_size=10000,
        arch=dict(width=64, depth=4, heads=4, patch=7, mlp_ratio=2.0),
        optimizer="adamw", lr=1e-3, weight_decay=0.05, batch_size=128, steps=1000,
        warmup=0.05, decay="cosine", evals=5,
        rho={"sam": 0.05, "asam": 0.75, "geodesic-inv": 0.25, "geodesic-mix": 0.025},
        rho_factors=[0.25, 1.0, 4.0])
    minilm: Dict[str, Any] = dict(
        data="rt", split_seed=0, train_size=1000, val_size=500, test_size=2000, layers=6,
        max_length=64, head="mean", train_embeddings=False,
        optimizer="adamw", lr=1e-4, weight_decay=0.01, batch_size=32, steps=80,
        warmup=0.1, decay="linear", evals=4,
        rho={"sam": 0.05, "asam": 0.8, "geodesic-inv": 0.07, "geodesic-mix": 0.08},
        rho_factors=[0.25, 1.0, 4.0])
    c: Dict[str, Any] = dict(seed=0, seeds=3, sweep_seeds=1, methods=list(METHODS),
                             tasks=dict(vit=vit, minilm=minilm),
                             timing=dict(updates=5, warmup=1, rounds=2))
    if quick:
        vit.update(data="synthetic", train_size=256, val_size=128, test_size=128,
                   arch=dict(width=16, depth=1, heads=2, patch=7, mlp_ratio=2.0),
                   batch_size=32, steps=8, evals=2, lr=3e-3)
        minilm.update(data="synthetic", train_size=128, val_size=64, test_size=64, layers=1,
                      max_length=16, batch_size=16, steps=6, evals=2, lr=3e-3)
        c.update(seeds=2, timing=dict(updates=2, warmup=1, rounds=1))
    return c


def synthetic(config: Dict[str, Any]) -> bool:
    return any(t["data"] == "synthetic" for t in config["tasks"].values())


def tasks_of(config: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """(name, task configuration) in the fixed order of ``TASKS``: a configuration read back from
    JSON has its keys sorted, and the job ids of :func:`plan` must not depend on that."""
    return [(name, config["tasks"][name]) for name in TASKS if name in config["tasks"]]


def rho_grid(task_cfg: Dict[str, Any], method: str) -> List[float]:
    """The ρ values of ``method`` on a task: its centre times each of ``rho_factors`` (no ρ for
    the base arms)."""
    if METHODS[method] is None:
        return [0.0]
    return [float(task_cfg["rho"][method]) * float(f) for f in task_cfg["rho_factors"]]


def check_config(config: Dict[str, Any]) -> None:
    """Errors a user can act on (unknown names, too few seeds, missing ρ centres)."""
    unknown = [m for m in config["methods"] if m not in METHODS]
    if unknown:
        raise ExperimentError(f"unknown method(s) {unknown}; valid: {', '.join(METHODS)}")
    if "sam" not in config["methods"] and any(m in SAM_METHODS for m in config["methods"]):
        raise ExperimentError("the cost of every arm is reported relative to SAM: keep 'sam' in "
                              "--methods")
    if not 1 <= config["sweep_seeds"] <= config["seeds"]:
        raise ExperimentError(f"--sweep-seeds {config['sweep_seeds']} must be between 1 and "
                              f"--seeds {config['seeds']}")
    for name, t in config["tasks"].items():
        if name not in TASKS:
            raise ExperimentError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
        missing = [m for m in config["methods"] if m in SAM_METHODS and m not in t["rho"]]
        if missing:
            raise ExperimentError(f"task {name}: no ρ centre for {missing}; set it with "
                                  f"--rho-centre {name}:{missing[0]}=VALUE")
        if t["steps"] < t["evals"]:
            raise ExperimentError(f"task {name}: {t['steps']} steps < {t['evals']} eval points")


# ------------------------------------------------------------------------------------ job plan
def plan(config: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every job of the study, its position in this list being its ``model_id``: per task one
    timing job, then (method, ρ index, seed) for every ρ of the grid and every seed. Which of them
    run is decided by :func:`sweep_ids` and :func:`seed_ids`."""
    jobs: List[Dict[str, Any]] = []
    for task, t in tasks_of(config):
        jobs.append(dict(kind="timing", task=task))
        for method in config["methods"]:
            for ri, rho in enumerate(rho_grid(t, method)):
                for seed in range(config["seeds"]):
                    jobs.append(dict(kind="train", task=task, method=method, rho=rho,
                                     rho_index=ri, seed=seed))
    return jobs


def sweep_ids(config: Dict[str, Any]) -> List[int]:
    """Phase 1: the timing jobs, every ρ of every SAM arm on the sweep seeds, the base arms on
    every seed."""
    out = []
    for i, j in enumerate(plan(config)):
        if j["kind"] == "timing" or METHODS[j["method"]] is None \
                or j["seed"] < config["sweep_seeds"]:
            out.append(i)
    return out


def select_rho(records: Sequence[Dict[str, Any]], config: Dict[str, Any]
               ) -> Dict[Tuple[str, str], int]:
    """(task, method) → index of the ρ with the highest mean validation accuracy over the sweep
    seeds (ties: the index nearest the grid's centre). Base arms: index 0."""
    out: Dict[Tuple[str, str], int] = {}
    for task, t in tasks_of(config):
        centre = (len(t["rho_factors"]) - 1) / 2
        for method in config["methods"]:
            if METHODS[method] is None:
                out[(task, method)] = 0
                continue
            scores = {}
            for r in records:
                if r.get("kind") == "train" and r["task"] == task and r["method"] == method \
                        and r["seed"] < config["sweep_seeds"]:
                    scores.setdefault(r["rho_index"], []).append(r["metrics"]["val_acc"])
            complete = {i: float(np.mean(v)) for i, v in scores.items()
                        if len(v) == config["sweep_seeds"] and all(math.isfinite(x) for x in v)}
            if complete:
                out[(task, method)] = max(complete, key=lambda i: (complete[i],
                                                                   -abs(i - centre)))
    return out


def seed_ids(config: Dict[str, Any], selected: Dict[Tuple[str, str], int]) -> List[int]:
    """Phase 2: the other seeds of each SAM arm at its selected ρ."""
    return [i for i, j in enumerate(plan(config))
            if j["kind"] == "train" and METHODS[j["method"]] is not None
            and j["seed"] >= config["sweep_seeds"]
            and selected.get((j["task"], j["method"])) == j["rho_index"]]


#: rough seconds per gradient evaluation (pilot, 1 thread), only to start the longest jobs first
_COST_PER_GRADIENT = {"vit": 0.06, "minilm": 1.5}


def longest_first(config: Dict[str, Any], ids: Sequence[int]) -> List[int]:
    """``ids`` ordered by estimated cost, longest first, so that two workers finish together
    (the MiniLM runs take minutes, the ViT runs fill the gaps)."""
    jobs = plan(config)

    def cost(i: int) -> float:
        j, t = jobs[i], config["tasks"][jobs[i]["task"]]
        if j["kind"] == "timing":
            return _COST_PER_GRADIENT[j["task"]] * 10 * int(config["timing"]["updates"])
        grads = 1 if METHODS[j["method"]] is None else 2
        return _COST_PER_GRADIENT[j["task"]] * t["steps"] * STEP_FACTOR.get(j["method"], 1) \
            * grads

    return sorted(ids, key=lambda i: (-cost(i), i))


def run_seed(config: Dict[str, Any], seed: int) -> int:
    """The torch / numpy seed of seed index ``seed`` (init, data order, dropout): the same for
    every arm, so arms are compared on paired runs."""
    return int(np.random.default_rng([int(config["seed"]), int(seed), 41]).integers(0, 2 ** 31 - 1))


# ------------------------------------------------------------------------------------ tasks
class Task:
    """A task's data and model: ``build(seed)``, an endless stream of training batches,
    ``loss(model, batch)`` and ``logits(model, split)`` for split ∈ train / val / test."""

    def __init__(self, name: str, cfg: Dict[str, Any], data_dir: Optional[str]):
        self.name, self.cfg = name, cfg
        if name == "vit":
            self._init_vit(data_dir)
        elif name == "minilm":
            self._init_minilm(data_dir)
        else:
            raise ExperimentError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")

    # ---- ViT on Fashion-MNIST
    def _init_vit(self, data_dir):
        from . import vision
        c = self.cfg
        n, v = int(c["train_size"]), int(c["val_size"])
        data = vision.load_data(dict(data=c["data"], split_seed=c["split_seed"], pool_size=n + v,
                                     test_size=c["test_size"]), data_dir)
        self.x = {"train": data["x"][:n], "val": data["x"][n:n + v], "test": data["x_test"]}
        self.y = {"train": data["y"][:n], "val": data["y"][n:n + v], "test": data["y_test"]}

    # ---- MiniLM on Rotten Tomatoes
    def _init_minilm(self, data_dir):
        from . import text
        c = self.cfg
        n, v = int(c["train_size"]), int(c["val_size"])
        self.tconf = dict(data=c["data"], split_seed=c["split_seed"], train_size=n + v,
                          test_size=c["test_size"], max_length=c["max_length"], head=c["head"],
                          layers=c["layers"], train_embeddings=c["train_embeddings"])
        self.data = text.load_data(self.tconf, data_dir)
        tr = self.data["train"]
        self.idx = {"train": tr[:n], "val": tr[n:n + v], "test": self.data["test"]}

    def build(self, seed: int):
        if self.name == "vit":
            from .vision import build_model
            return build_model(dict(arch=self.cfg["arch"]), seed)
        from .text import build_model
        return build_model(self.tconf, seed)

    def batches(self, seed: int) -> Iterator[Any]:
        """Epochs of shuffled batches, forever (the order depends on ``seed`` only)."""
        import torch
        bs = int(self.cfg["batch_size"])
        if self.name == "vit":
            gen = torch.Generator().manual_seed(seed)
            x, y = self.x["train"], self.y["train"]
            while True:
                perm = torch.randperm(x.shape[0], generator=gen)
                for s in range(0, x.shape[0] - bs + 1, bs):  # full batches only
                    b = perm[s:s + bs]
                    yield x[b], y[b]
        else:
            from .text import batch_stream
            yield from batch_stream(self.data, self.idx["train"], bs, seed)

    def loss(self, model, batch):
        import torch.nn.functional as F
        inputs, y = batch
        out = model(inputs) if self.name == "vit" else model(**inputs).logits
        return F.cross_entropy(out, y)

    def logits(self, model, split: str) -> np.ndarray:
        if self.name == "vit":
            from .vision import predict
            return predict(model, self.x[split]).numpy()
        from .text import predict
        return predict(model, self.data, self.idx[split])

    def labels(self, split: str) -> np.ndarray:
        if self.name == "vit":
            return self.y[split].numpy()
        return self.data["labels"][self.idx[split]]

    def evaluate(self, model, split: str) -> Tuple[float, float]:
        """(accuracy, mean cross-entropy) on ``split``, eval mode; the model is left in train
        mode."""
        from .stats import error_and_loss
        err, loss = error_and_loss(self.logits(model, split), self.labels(split))
        model.train()
        return 1.0 - err, loss


_TASKS: Dict[str, Task] = {}


def get_task(name: str, cfg: Dict[str, Any], data_dir: Optional[str]) -> Task:
    """The task's data, loaded once per process."""
    from .runner import canonical_json
    key = canonical_json([name, cfg, data_dir])
    if key not in _TASKS:
        _TASKS[key] = Task(name, cfg, data_dir)
    return _TASKS[key]


# ------------------------------------------------------------------------------------ training
def make_optimizer(model, cfg: Dict[str, Any], method: str, rho: float):
    """AdamW on the trainable weights (weight decay on matrices only; fused CPU kernel where
    available), wrapped in :class:`quotient_manifolds.adapters.GeodesicSAM` for the SAM arms. Returns
    ``(base optimizer, SAM wrapper or None)``."""
    if cfg["optimizer"] != "adamw":
        raise ExperimentError(f"optimizer {cfg['optimizer']!r}: only 'adamw' is implemented")
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=cfg["lr"],
                weight_decay=cfg["weight_decay"], fused=True)
    kwargs = METHODS[method]
    if kwargs is None:
        return opt, None
    from quotient_manifolds import adapters
    return opt, adapters.GeodesicSAM(model, opt, rho=rho, **kwargs)


class Updater:
    """One optimizer update of an arm on a batch (forward/backward, the SAM ascent if any, clip,
    base step, schedule step); records the training loss at w and, for SAM arms, at w_adv."""

    def __init__(self, task: Task, model, opt, sam, schedule=None):
        self.task, self.model, self.opt, self.sam, self.schedule = task, model, opt, sam, schedule
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.loss_adv: Optional[float] = None

    def __call__(self, batch) -> float:
        import torch

        if self.sam is None:
            self.opt.zero_grad(set_to_none=True)
            loss = self.task.loss(self.model, batch)
            loss.backward()
        else:
            # both passes draw the same dropout mask: the ascent perturbs the weights only
            rng = torch.get_rng_state()
            self.sam.zero_grad(set_to_none=True)
            loss = self.task.loss(self.model, batch)
            loss.backward()
            self.sam.first_step(zero_grad=True)
            torch.set_rng_state(rng)
            adv = self.task.loss(self.model, batch)
            adv.backward()
            self.loss_adv = float(adv.detach())
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        if self.sam is None:
            self.opt.step()
        else:
            self.sam.second_step(zero_grad=True)
        if self.schedule is not None:
            self.schedule.step()
        return float(loss.detach())


def eval_points(steps: int, evals: int) -> List[int]:
    """The updates after which the validation curve is recorded (equally spaced, the last one)."""
    return sorted({max(1, int(round(steps * (k + 1) / evals))) for k in range(evals)})


def train_run(task: Task, cfg: Dict[str, Any], method: str, rho: float, seed: int,
              progress: bool = False) -> Dict[str, Any]:
    """Train one arm from the seed's initialisation for ``steps × STEP_FACTOR`` updates; evaluate
    on the curve points and at the end."""
    import torch

    torch.manual_seed(seed)
    model = task.build(seed)
    model.train()
    opt, sam = make_optimizer(model, cfg, method, rho)
    steps = int(cfg["steps"]) * STEP_FACTOR.get(method, 1)
    # TrainingLoop only for its warm-up + decay schedule and progress bar (the update is ours)
    loop = TrainingLoop(opt, [p for p in model.parameters() if p.requires_grad],
                        steps_per_epoch=steps, epochs=1, warmup=cfg["warmup"],
                        decay=cfg["decay"], progress=progress)
    update = Updater(task, model, opt, sam, loop.sched)
    at = set(eval_points(steps, int(cfg["evals"])))
    stream = task.batches(seed)
    torch.manual_seed(seed)  # dropout
    times, cpu, losses, adv, curve = [], [], [], [], []
    eval_s = 0.0

    def timed(batch) -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = update(batch)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        return loss

    def after(k: int, loss: float) -> bool:
        nonlocal eval_s
        losses.append(loss)
        if update.loss_adv is not None:
            adv.append(update.loss_adv - loss)
        if loop.bar is not None:
            loop.bar.update(1)
        if not math.isfinite(loss):
            raise FloatingPointError(f"{task.name}/{method} ρ={rho:g}: training loss {loss} "
                                     f"at update {k}; lower the lr or ρ")
        if k in at:
            t0 = time.perf_counter()
            acc, vloss = task.evaluate(model, "val")
            tail = losses[-max(1, steps // int(cfg["evals"])):]
            curve.append(dict(update=k, val_acc=acc, val_loss=vloss,
                              running_train_loss=float(np.mean(tail))))
            eval_s += time.perf_counter() - t0
        return False

    started = time.perf_counter()
    train_steps(timed, itertools.islice(stream, steps), after)
    train_s = time.perf_counter() - started - eval_s
    if loop.bar is not None:
        loop.bar.close()
    t0 = time.perf_counter()
    tr_acc, tr_loss = task.evaluate(model, "train")
    te_acc, te_loss = task.evaluate(model, "test")
    metrics = dict(train_acc=tr_acc, train_loss=tr_loss, val_acc=curve[-1]["val_acc"],
                   val_loss=curve[-1]["val_loss"], test_acc=te_acc, test_loss=te_loss)
    return dict(metrics=metrics, curve=curve,
                timing=dict(update_median_s=float(statistics.median(times)),
                            update_mean_s=float(np.mean(times)),
                            update_cpu_median_s=float(statistics.median(cpu)), train_s=train_s,
                            eval_s=eval_s + time.perf_counter() - t0,
                            threads=torch.get_num_threads()),
                updates=steps, grad_evals=steps * (1 if sam is None else 2),
                ascent=dict(median_loss_increase=float(np.median(adv)) if adv else None,
                            last_grad_norm=None if sam is None else sam.grad_norm))


def timing_run(task: Task, cfg: Dict[str, Any], methods: Sequence[str], seed: int,
               timing: Dict[str, Any]) -> Dict[str, Any]:
    """Seconds per update of every arm in ONE process: each arm its own optimizer on a copy of the
    same initial model, the same batches, arms interleaved over ``rounds`` of ``updates`` timed
    updates (the first ``warmup`` updates of each arm untimed: layout detection, first calls).
    Also the loss increase L(w_adv) − L(w) at each arm's centre ρ (its matched strength)."""
    import torch

    torch.manual_seed(seed)
    model0 = task.build(seed)
    arms = [m for m in methods if m != "base-2x"]  # base-2x costs what base costs per update
    stream = task.batches(seed)
    n_batches = int(timing["warmup"]) + int(timing["updates"])
    batches = [next(stream) for _ in range(n_batches)]
    state = {}
    for m in arms:
        model = copy.deepcopy(model0).train()
        opt, sam = make_optimizer(model, cfg, m, float(cfg["rho"].get(m, 0.0)))
        state[m] = dict(update=Updater(task, model, opt, sam), times=[], cpu=[], increase=[],
                        grad_norm=[])
    for r in range(int(timing["rounds"])):
        for m in arms:
            s = state[m]
            torch.manual_seed(seed + r)
            for k, batch in enumerate(batches):
                check_parent_alive()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = s["update"](batch)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if r > 0 or k >= int(timing["warmup"]):
                    s["times"].append(dt)
                    s["cpu"].append(dc)
                if s["update"].loss_adv is not None:
                    s["increase"].append(s["update"].loss_adv - loss)
                    s["grad_norm"].append(s["update"].sam.grad_norm)
    med = {m: float(statistics.median(state[m]["times"])) for m in arms}
    cpu = {m: float(statistics.median(state[m]["cpu"])) for m in arms}
    return dict(update_median_s=med, update_cpu_median_s=cpu,
                ratio_to_sam={m: v / med["sam"] for m, v in med.items()} if "sam" in med else {},
                cpu_ratio_to_sam=({m: v / cpu["sam"] for m, v in cpu.items()}
                                  if "sam" in cpu else {}),
                loss_increase={m: float(np.median(state[m]["increase"]))
                               for m in arms if state[m]["increase"]},
                grad_norm={m: float(np.median(state[m]["grad_norm"]))
                           for m in arms if state[m]["grad_norm"]},
                rho={m: float(cfg["rho"][m]) for m in arms if m in cfg["rho"]},
                timed_updates=len(next(iter(state.values()))["times"]),
                threads=torch.get_num_threads())


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


# ------------------------------------------------------------------------------------ report
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
    import datetime as _dt

    from .reporting import write_summary
    from .runner import display_path
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
    write_summary(out_dir, lines, summary)
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .reporting import finish_figure
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .reporting import finish_figure
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
    from .runner import OutputDir, fmt_seconds, load_current, run_population

    config = config_from_args(args)
    if not synthetic(config):  # fail early with the preparing command
        from .data import find_fashion_mnist, find_rt
        from .text import model_path
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
