r"""The LoRA study's configuration and its jobs (:mod:`quotient_manifolds.experiments.lora`): the
arms and defaults (:func:`defaults`), every job in a fixed order (:func:`run_specs`), the lr
picked on the grid (:func:`pick_lrs`) and the steps to an accuracy (:func:`steps_to`)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .runner import ExperimentError

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
        c["quick"] = True  # a smoke test: every output says so (reporting.SMOKE_TEST)
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


def cell_name(task: str, rank: int, arm: str) -> str:
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
        cell = cell_name(rec["task"], rec["rank"], rec["arm"])
        if cell not in best or key > best[cell][0]:
            best[cell] = (key, rec)
    return {cell: rec for cell, (_, rec) in best.items()}


def steps_to(curve_steps: Sequence[int], accs: Sequence[float], level: float) -> Optional[int]:
    """The first eval step whose accuracy is ≥ ``level`` (None if never)."""
    for s, a in zip(curve_steps, accs):
        if math.isfinite(a) and a >= level:
            return int(s)
    return None

