r"""The LoRA study's training runs (:mod:`quotient_manifolds.experiments.lora`): the model
(:func:`build_model`: MiniLM with peft LoRA), each arm's optimizers (:func:`make_optimizers`),
one fine-tune (:func:`train_run`) and the interleaved timing of every arm (:func:`timing_run`)."""

from __future__ import annotations

import itertools
import math
import platform
import time
from typing import Any, Dict, List, Optional, Tuple

import geoopt
import numpy as np
import torch
import torch.nn.functional as F

from quotient_manifolds import adapters

from . import text_model
from .lora_plan import ARMS, STEPS_TO_LEVELS, steps_to
from .runner import ExperimentError, check_parent_alive, progress_bar
from .stats import error_and_loss
from .training import schedule_factor, train_steps


def _text_config(c: Dict[str, Any], task: str) -> Dict[str, Any]:
    """The :mod:`quotient_manifolds.experiments.text` configuration keys its loader and model builder read."""
    return dict(data="synthetic" if c["synthetic"] else task, split_seed=c["split_seed"],
                train_size=c["train_size"] + c["val_size"], test_size=c["test_size"],
                max_length=c["max_length"], layers=c["layers"], head=c["head"],
                train_embeddings=False)


def load_data(c: Dict[str, Any], task: str, data_dir: Optional[str]) -> Dict[str, Any]:
    """Tokenised fixed splits (:func:`quotient_manifolds.experiments.text_model.load_data`, cached per process) with the
    last ``val_size`` sentences of the shuffled train part split off as validation."""
    d = dict(text_model.load_data(_text_config(c, task), data_dir))
    tr = d["train"]
    d["train"], d["val"] = tr[: c["train_size"]], tr[c["train_size"]:]
    return d


def build_model(c: Dict[str, Any], task: str, rank: int, seed: int):
    """Frozen MiniLM (or, quick, the tiny SYNTHETIC BERT) with the mean-pool head, wrapped by peft
    LoRA of rank ``rank`` on ``target_modules``; the head is trainable (``modules_to_save``).
    The head's and LoRA's initialisations depend on ``seed`` only."""
    from peft import LoraConfig, get_peft_model  # lazily: see make_optimizers

    base = text_model.build_model(_text_config(c, task), seed)
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
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lora = [p for n, p in named if _is_lora(n)]
    head = [p for n, p in named if not _is_lora(n)]
    if not lora:
        raise ExperimentError("the model has no trainable LoRA parameters")
    head_opt = torch.optim.AdamW(head, lr=c["head_lr"], weight_decay=c["head_weight_decay"])
    if arm == "adamw":
        return torch.optim.AdamW(lora, lr=lr, weight_decay=0.0), head_opt
    if arm == "peft-riemannian":
        # peft (the optional [lora] extra) is imported when a run needs it: the study's module is
        # imported by `quotient-manifolds --help`, which must work without it
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
    return text_model.batch_stream(data, data["train"], c["batch_size"], seed)


def evaluate(model, data: Dict[str, Any], split: str) -> Tuple[float, float]:
    """(accuracy, mean cross-entropy) on a split, eval mode (then back to train mode)."""
    idx = data[split]
    err, loss = error_and_loss(text_model.predict(model, data, idx), data["labels"][idx])
    model.train()
    return 1.0 - err, loss



def versions() -> Dict[str, str]:
    import peft  # lazily: see make_optimizers
    import transformers  # lazily: seconds to import (see text_model._mean_pool_classifier)
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
        bar = progress_bar(total=c["steps"], desc=f"{spec['arm']} r={spec['rank']}", unit="step",
                           leave=False)
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

