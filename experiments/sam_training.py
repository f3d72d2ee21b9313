r"""The SAM study's arms and training (:mod:`quotient_manifolds.experiments.sam_study`): the arms
(:data:`METHODS`), a task's data and model (:class:`Task`), one optimizer update of an arm
(:class:`Updater`), one training run (:func:`train_run`) and the same-process timing of every arm
(:func:`timing_run`)."""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from quotient_manifolds import adapters

from . import text_model, vision
from .runner import ExperimentError, canonical_json, check_parent_alive
from .stats import error_and_loss
from .training import TrainingLoop, adamw, train_steps

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
        c = self.cfg
        n, v = int(c["train_size"]), int(c["val_size"])
        data = vision.load_data(dict(data=c["data"], split_seed=c["split_seed"], pool_size=n + v,
                                     test_size=c["test_size"]), data_dir)
        self.x = {"train": data["x"][:n], "val": data["x"][n:n + v], "test": data["x_test"]}
        self.y = {"train": data["y"][:n], "val": data["y"][n:n + v], "test": data["y_test"]}

    # ---- MiniLM on Rotten Tomatoes
    def _init_minilm(self, data_dir):
        c = self.cfg
        n, v = int(c["train_size"]), int(c["val_size"])
        self.tconf = dict(data=c["data"], split_seed=c["split_seed"], train_size=n + v,
                          test_size=c["test_size"], max_length=c["max_length"], head=c["head"],
                          layers=c["layers"], train_embeddings=c["train_embeddings"])
        self.data = text_model.load_data(self.tconf, data_dir)
        tr = self.data["train"]
        self.idx = {"train": tr[:n], "val": tr[n:n + v], "test": self.data["test"]}

    def build(self, seed: int):
        if self.name == "vit":
            return vision.build_model(dict(arch=self.cfg["arch"]), seed)
        return text_model.build_model(self.tconf, seed)

    def batches(self, seed: int) -> Iterator[Any]:
        """Epochs of shuffled batches, forever (the order depends on ``seed`` only)."""
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
            yield from text_model.batch_stream(self.data, self.idx["train"], bs, seed)

    def loss(self, model, batch):
        inputs, y = batch
        out = model(inputs) if self.name == "vit" else model(**inputs).logits
        return F.cross_entropy(out, y)

    def logits(self, model, split: str) -> np.ndarray:
        if self.name == "vit":
            return vision.predict(model, self.x[split]).numpy()
        return text_model.predict(model, self.data, self.idx[split])

    def labels(self, split: str) -> np.ndarray:
        if self.name == "vit":
            return self.y[split].numpy()
        return self.data["labels"][self.idx[split]]

    def evaluate(self, model, split: str) -> Tuple[float, float]:
        """(accuracy, mean cross-entropy) on ``split``, eval mode; the model is left in train
        mode."""
        err, loss = error_and_loss(self.logits(model, split), self.labels(split))
        model.train()
        return 1.0 - err, loss


_TASKS: Dict[str, Task] = {}


def get_task(name: str, cfg: Dict[str, Any], data_dir: Optional[str]) -> Task:
    """The task's data, loaded once per process."""
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
    return opt, adapters.GeodesicSAM(model, opt, rho=rho, **kwargs)


class Updater:
    """One optimizer update of an arm on a batch (forward/backward, the SAM ascent if any, clip,
    base step, schedule step); records the training loss at w and, for SAM arms, at w_adv."""

    def __init__(self, task: Task, model, opt, sam, schedule=None):
        self.task, self.model, self.opt, self.sam, self.schedule = task, model, opt, sam, schedule
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.loss_adv: Optional[float] = None

    def __call__(self, batch) -> float:
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

