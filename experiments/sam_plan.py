r"""The SAM study's configuration and its jobs (:mod:`quotient_manifolds.experiments.sam_study`):
the defaults (:func:`defaults`), the plan of every job (:func:`plan`), the sweep and seed phases
(:func:`sweep_ids`, :func:`seed_ids`) and the selection of each arm's ρ (:func:`select_rho`)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from .runner import ExperimentError
from .sam_training import METHODS, SAM_METHODS, STEP_FACTOR, TASKS

NAME = "sam"


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
        c["quick"] = True  # a smoke test: every output says so (reporting.SMOKE_TEST)
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

