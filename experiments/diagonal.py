r"""Diagonal linear networks β = u⊙v (docs/maths.md §8, §11.2; paper §5.1).

Protocol (close to the sparse-regression setup of Andriushchenko et al., "SGD with large step
sizes learns sparse features", ICML 2023, whose code the paper group builds on; the paper itself
leaves n, X, the varied hyperparameters, the optimiser and ρ unstated, docs/maths.md §11.2):

* data, one draw per ``data_seed`` (default 5 draws, 0…4): n = 80, d = 200, X with i.i.d. N(0, 1)
  entries, β* with k = 20 non-zeros |N(0, 1)| scaled to ‖β*‖ = 1, noiseless y = Xβ*;
* loss L(β) = ‖Xβ − y‖²/(2n); test loss = E_x (xᵀβ − xᵀβ*)² = ‖β − β*‖², the exact population
  risk for x ~ N(0, I);
* init u₀ = α·1, v₀ = 0. This does *not* freeze β: ∂L/∂v = u⊙∇_βL ≠ 0, so v (and β) move at
  the first step, and gradient flow conserves u² − v² = α² per coordinate (β = uv can take
  either sign; it is the w₊² − w₋² model with w± = (u ± v)/√2). What would freeze the sign is
  u₀ = v₀ (then u = v for ever and β = u² ≥ 0); with β* ≥ 0 that would even fit, but it is not the
  rescaling-quotient model of the paper, so the issue's u₀ = α·1, v₀ = 0 is used as written;
* 50 nets per draw, model j of draw s draws from ``default_rng([seed, s, j, 7])``, all knobs
  together: α log-uniform in [0.02, 0.3]; batch size from {1, 10, 80} (80 = full-batch GD; SGD
  batches are epochs of a random permutation); step η = c·η_stab with c log-uniform in
  [0.25, 1], where η_stab = 2/λ and λ is the mean over batches of the top eigenvalue of the batch
  loss's Hessian in (u, v) at the interpolator the flow from α reaches when it recovers β*
  (u² + v² = √(α⁴ + 4β*²); λ = λ_max(diag(√w) X_bᵀX_b diag(√w))/b), i.e. the largest stable step
  there; a large-step phase of E epochs (E log-uniform in [5, 200]) at η, then η/5 until the
  full-batch training loss is ≤ 1e-5 (checked every 50 steps; a diverging run restarts with half
  the step, and the step factor actually used is recorded); then polishing by full-batch GD at
  half its local stability limit (η = 1/λ_max(X diag(u²+v²) Xᵀ/n), refreshed every 1000 steps)
  until L ≤ 1e-10, so that where a run stopped cannot rank the models. α sets most of the test
  loss, the batch size (SGD noise; with c ≈ 1 and batch 1 the interpolators are sparser than α
  alone predicts, the sparse-features effect) comes next, c and E matter little on their own;
  the report gives R² of log test loss per knob, and τ partial given α and given c.

Sharpness, maximised by normalised projected gradient ascent with restarts (docs/maths.md §8.6),
batched over restarts and the ρ grid (``solver="pga"``), all through the closed-form geodesics of
the rescaling quotient (:func:`quotient_manifolds.experiments.closed_forms.beta_along_geodesic`); ``solver="apgd"``
runs the library's :func:`quotient_manifolds.adapters.solver.auto_pgd` on a
:class:`~quotient_manifolds.core.RescalingGeometry` instead (exact retraction, see
:func:`sharpness_apgd`). ρ default 0.1 for every family, swept over 0.01, 0.1 and 1:

* ``adaptive``: max over ‖(δ_u/|u|, δ_v/|v|)‖₂ ≤ ρ of L((u+δ_u)⊙(v+δ_v)) − L(u⊙v);
* ``geodesic-inv``: max L(β₀⊙e^{2b}) − L(β₀) over ‖b‖ ≤ ρ/√2 (‖ξ‖²_inv = 2‖b‖²). With
  s = log((u+δ_u)/u) = log((v+δ_v)/v) adaptive maximises the same objective L(β₀⊙e^{2s}) − L(β₀)
  over Σ(e^{sⁱ} − 1)² ≤ ρ²/2 (the cheapest (δ_u, δ_v) for a given product scales u and v alike):
  the two balls agree to first order, so the exact maxima agree to O(ρ³) and rank nets alike;
* ``geodesic-mix`` (the paper's mix measure, docs/maths.md §8.6 verbatim): max L(β₀⊙(1+2b)) −
  L(β₀) over √2‖β₀⊙b‖ ≤ ρ, where β(1) is the polynomial continuation of the geodesic's β also
  where 1 + 2b ≤ 0. At an interpolator it is ≈ (ρ²/n)λ_max(XᵀX) + O(ρ√L) for every model of a
  draw, so only the final training residual can rank models of one draw. Being a convex quadratic
  in δ, it is solved exactly (trust-region secular equation, :func:`mix_literal_exact`;
  ``mix_literal="solver"`` uses the chosen solver, whose ~1e-6 relative error exceeds the O(ρ√L)
  differences);
* ``geodesic-mix-manifold`` (this project's own variant, not the paper's): the same over
  √2‖β₀⊙b‖ ≤ ρ and 1 + 2bⁱ ≥ 10⁻³, i.e. endpoints (u√(1+2b), v√(1+2b)) of geodesics that exist on
  the manifold;
* ``adaptive-alg1``, ``geodesic-inv-alg1``, ``geodesic-mix-alg1``: the same three objectives
  maximised as the paper's Algorithm 1 does, one Auto-PGD run of ``alg1_iters`` (20) iterations
  started at ξ = 0 (:func:`sharpness_apgd`, no restarts), at the main ρ only: the size of the
  solver's noise against the exact maxima above.

Stopping rule: the paper stops training at loss 1e-5; this study polishes to ``polish_loss``
(1e-10) by default. ``polish_loss`` ≥ ``target_loss`` (``--polish-loss 1e-5``) skips polishing
and measures the nets where the paper's rule stops them.

In coordinates b (inv), δ = β₀⊙b (mix) and (δ_u/u, δ_v/v) (adaptive) each ball is a Euclidean
ball (times √2), so the normalised Euclidean ascent there is the Riemannian one; the mix-manifold
feasible set is a ball ∩ box, projected onto exactly (closed form after sorting the breakpoints).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

# the measures are part of the study's interface: diagonal_summary reads them from this module
from .diagonal_sharpness import ALG1, FAMILY, MAIN, MEASURES, OWN, measure_all, train_loss  # noqa: F401
from .options import (defaults_of, int_list, positive_float, positive_int, seed_list, sharpness_arguments,
                      value_range)
from .population import apply_sharp_overrides, log_line, run_population_study
from .diagonal_summary import diagonal_report
from .checkpoints import load_checkpoint, save_checkpoint
from .runner import ExperimentError, check_parent_alive, keys_hash, progress_bar

NAME = "diagonal"
PAPER_KEY = "diagonal"


def defaults(quick: bool) -> Dict[str, Any]:
    c: Dict[str, Any] = dict(
        d=200, n=80, k=20, draws=[0, 1, 2, 3, 4], seed=0, noise=0.0, loss="half-mean",
        beta_star="abs-normal-unit",
        alpha_range=[0.02, 0.3], lr_factor_range=[0.25, 1.0], batch_choices=[1, 10, 80],
        phase_epochs_range=[5.0, 200.0], lr_decay=5.0,
        target_loss=1e-5, polish_loss=1e-10, polish_factor=0.5,
        max_steps=2_000_000, max_polish_steps=1_000_000, check_every=50,
        rho=dict(adaptive=0.1, inv=0.1, mix=0.1), rho_sweep=[0.1, 10.0],
        measures=list(MEASURES), solver="pga", mix_literal="exact", restarts=8, pga_iters=600,
        eigen_starts=3, apgd_iters=100, alg1_iters=20, models=50)
    if quick:
        c["quick"] = True  # a smoke test: every output says so (reporting.SMOKE_TEST)
        c.update(draws=[0], alpha_range=[0.1, 0.3], phase_epochs_range=[2.0, 10.0],
                 restarts=3, pga_iters=60, apgd_iters=10, rho_sweep=[10.0], models=6)
    return c


# ------------------------------------------------------------------------------------ data
@functools.lru_cache(maxsize=8)
def _data(n: int, d: int, k: int, noise: float, data_seed: int):
    rng = np.random.default_rng(data_seed)
    X = rng.standard_normal((n, d))
    beta_star = np.zeros(d)
    support = rng.choice(d, size=k, replace=False)
    beta_star[support] = np.abs(rng.standard_normal(k))
    beta_star /= np.linalg.norm(beta_star)
    y = X @ beta_star + noise * rng.standard_normal(n)
    for a in (X, y, beta_star):
        a.setflags(write=False)
    return X, y, beta_star


def make_data(config: Dict[str, Any], data_seed: Optional[int] = None):
    """(X, y, β*) of one draw (``data_seed``, default the first of ``config["draws"]``)."""
    if data_seed is None:
        data_seed = config["draws"][0]
    return _data(int(config["n"]), int(config["d"]), int(config["k"]), float(config["noise"]),
                 int(data_seed))



def test_loss(beta: np.ndarray, beta_star: np.ndarray, noise: float = 0.0) -> float:
    """Population risk E(xᵀβ − y)² for x ~ N(0, I): ‖β − β*‖² + noise²."""
    return float(((beta - beta_star) ** 2).sum() + noise ** 2)


def draw_of(config: Dict[str, Any], model_id: int) -> Tuple[int, int]:
    """(data seed, index within the draw) of a model: ids are interleaved over the draws, so
    ``--models`` (per draw) can grow without renumbering."""
    draws = config["draws"]
    return int(draws[model_id % len(draws)]), int(model_id // len(draws))


def _log_uniform(rng, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def hparams(config: Dict[str, Any], model_id: int) -> Dict[str, Any]:
    data_seed, index = draw_of(config, model_id)
    rng = np.random.default_rng([int(config["seed"]), data_seed, index, 7])
    return dict(seed=int(rng.integers(0, 2 ** 31 - 1)), data_seed=data_seed, index=index,
                alpha=_log_uniform(rng, *config["alpha_range"]),
                lr_factor=_log_uniform(rng, *config["lr_factor_range"]),
                batch_size=int(rng.choice(config["batch_choices"])),
                phase_epochs=_log_uniform(rng, *config["phase_epochs_range"]))


def stability_step(X: np.ndarray, beta_star: np.ndarray, alpha: float, batch: int,
                   data_seed: int = 0) -> float:
    """η_stab = 2/λ: λ the mean over batches of the top eigenvalue of the batch loss's Hessian in
    (u, v) at the interpolator reached from init scale α when the flow recovers β*.

    There u² − v² = α² and uv = β*, so u² + v² = w = √(α⁴ + 4β*²), and the Hessian
    [diag(v); diag(u)] (X_bᵀX_b/b) [diag(v), diag(u)] has the non-zero spectrum of
    diag(√w) X_bᵀX_b diag(√w)/b (docs/maths.md §8.1). Batch 1: the exact mean over samples;
    batch ≥ n: the full batch; otherwise 64 random batches (deterministic in the draw)."""
    n = X.shape[0]
    Z = X * np.sqrt(np.sqrt(alpha ** 4 + 4 * beta_star ** 2))
    if batch >= n:
        lam = float(np.linalg.eigvalsh(Z @ Z.T / n).max())
    elif batch == 1:
        lam = float((Z * Z).sum(1).mean())
    else:
        rng = np.random.default_rng([data_seed, batch, 5])
        lam = float(np.mean([np.linalg.eigvalsh(Z[j] @ Z[j].T / batch).max()
                             for j in (rng.choice(n, batch, replace=False) for _ in range(64))]))
    return 2.0 / lam


def _polish(u, v, X, y, config) -> Tuple[np.ndarray, np.ndarray, int, bool]:
    """Full-batch GD at ``polish_factor`` × its local stability limit until L ≤ polish_loss."""
    n = X.shape[0]
    steps = 0
    target, cap = config["polish_loss"], config["max_polish_steps"]
    while float(train_loss(u * v, X, y)) > target and steps < cap:
        Z = X * np.sqrt(u * u + v * v)
        lr = config["polish_factor"] * 2.0 / float(np.linalg.eigvalsh(Z @ Z.T / n).max())
        for _ in range(10):
            for _ in range(100):
                g = X.T @ (X @ (u * v) - y) / n
                u, v = u - lr * g * v, v - lr * g * u
            steps += 100
            if float(train_loss(u * v, X, y)) <= target:
                break
        if steps % 20000 == 0:
            check_parent_alive()
    return u, v, steps, bool(float(train_loss(u * v, X, y)) <= target)


def train(config: Dict[str, Any], hp: Dict[str, Any], X, y, beta_star, progress: bool = False):
    """(S)GD on (u, v) from u = α, v = 0: a large-step phase, the decayed step until L ≤ target,
    then full-batch polishing to L ≤ polish_loss. Returns (u, v, info)."""
    n, d = X.shape
    b = min(int(hp["batch_size"]), n)
    base = stability_step(X, beta_star, hp["alpha"], b, hp["data_seed"])
    factor = hp["lr_factor"]
    phase_steps = max(1, int(round(hp["phase_epochs"] * n / b)))
    per_epoch = n // b
    every = config["check_every"]
    restarts = 0
    bar = None
    if progress:
        bar = progress_bar(total=config["max_steps"], desc="train", unit="step", leave=False,
                           mininterval=0.5)
    while True:
        rng = np.random.default_rng([hp["seed"], 4, restarts])
        lr = factor * base
        u = np.full(d, float(hp["alpha"]))
        v = np.zeros(d)
        step, L, diverged = 0, float(train_loss(u * v, X, y)), False
        order = rng.permutation(n)
        while step < config["max_steps"]:
            for _ in range(every):
                eta = lr if step < phase_steps else lr / config["lr_decay"]
                if b >= n:
                    g = X.T @ (X @ (u * v) - y) / n
                else:
                    pos = step % per_epoch
                    if pos == 0 and step:
                        order = rng.permutation(n)
                    j = order[pos * b:(pos + 1) * b]
                    Xj = X[j]
                    g = Xj.T @ (Xj @ (u * v) - y[j]) / b
                u, v = u - eta * g * v, v - eta * g * u
                step += 1
            with np.errstate(over="ignore", invalid="ignore"):
                L = float(train_loss(u * v, X, y))
            if bar is not None and step % 5000 == 0:
                bar.update(5000)
                bar.set_postfix(loss=f"{L:.2e}")
            if not math.isfinite(L) or L > 1e6:
                diverged = True
                break
            if L <= config["target_loss"] and step >= phase_steps:
                break
            if step % 5000 == 0:
                check_parent_alive()
        if not diverged or restarts >= 6:
            break
        restarts += 1
        factor *= 0.5
    if bar is not None:
        bar.close()
    reached = bool(math.isfinite(L) and L <= config["target_loss"])
    info = dict(steps=step, lr=lr, lr_stab=base, lr_factor_used=factor, restarts=restarts,
                phase_steps=phase_steps, train_loss_stop=L, reached_target=reached)
    if reached:
        info["test_loss_stop"] = test_loss(u * v, beta_star, config["noise"])
        u, v, psteps, polished = _polish(u, v, X, y, config)
    else:
        psteps, polished = 0, False
    info.update(polish_steps=psteps, train_loss=float(train_loss(u * v, X, y)),
                converged=bool(reached and polished))
    return u, v, info


# ------------------------------------------------------------------------------------ job
TRAIN_KEYS = ("d", "n", "k", "noise", "loss", "beta_star", "lr_decay", "target_loss",
              "polish_loss", "polish_factor", "max_steps", "max_polish_steps", "check_every")


def train_hash(config: Dict[str, Any], hp: Dict[str, Any]) -> str:
    """The training hash of the net with hyperparameters ``hp`` (its checkpoint's name)."""
    return keys_hash(NAME, config, TRAIN_KEYS, protocol=2, hp=hp)


def job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
        progress: bool) -> Dict[str, Any]:
    started = time.perf_counter()
    hp = hparams(config, model_id)
    X, y, beta_star = make_data(config, hp["data_seed"])
    th = train_hash(config, hp)
    path = os.path.join(ckpt_dir, f"{NAME}-{model_id:04d}-{th[:12]}.safetensors")
    loaded = load_checkpoint(path, th)
    if loaded is not None:
        tensors, meta = loaded
        u, v = tensors["u"].numpy().astype(np.float64), tensors["v"].numpy().astype(np.float64)
        info, reused = meta["train"], True
        train_s = 0.0
    else:
        t0 = time.perf_counter()
        u, v, info = train(config, hp, X, y, beta_star, progress)
        train_s = time.perf_counter() - t0
        save_checkpoint(path, {"u": torch.from_numpy(u), "v": torch.from_numpy(v)},
                        {"train_hash": th, "hp": hp, "train": info, "study": NAME,
                         "model_id": model_id})
        reused = False
    beta = u * v
    on = beta_star != 0
    metrics = dict(train_loss=float(train_loss(beta, X, y)),
                   test_loss=test_loss(beta, beta_star, config["noise"]),
                   train_loss_stop=info.get("train_loss_stop"),
                   test_loss_stop=info.get("test_loss_stop"),
                   l1=float(np.abs(beta).sum()), l2=float(np.linalg.norm(beta)),
                   support_mass=float(np.abs(beta[on]).sum() / np.abs(beta).sum()),
                   converged=info["converged"], steps=info["steps"],
                   polish_steps=info["polish_steps"])
    t0 = time.perf_counter()
    sharp = measure_all(config, u, v, X, y, seed=hp["seed"])
    return dict(seed=hp["seed"], hparams=hp, study_config=config, metrics=metrics,
                sharpness=sharp, checkpoint=os.path.basename(path), reused_checkpoint=reused,
                train_info=info,
                timing=dict(train_s=round(train_s, 3),
                            sharpness_s=round(time.perf_counter() - t0, 3),
                            total_s=round(time.perf_counter() - started, 3)))


def exclusions(records: Sequence[Dict[str, Any]]) -> Dict[int, str]:
    """Models left out of the report: training never reached the target, or polishing did not."""
    out = {}
    for r in records:
        m = r["metrics"]
        if not m.get("converged", True):
            out[r["model_id"]] = (f"not converged (train loss {m['train_loss']:.2e}, stopped at "
                                  f"{m.get('train_loss_stop') or float('nan'):.2e})")
    return out


# ------------------------------------------------------------------------------------ CLI
def add_arguments(p) -> None:
    """The study's options (``quotient-manifolds diagonal --help``)."""
    sharpness_arguments(p, transformer=False)
    full, quick = defaults(False), defaults(True)

    default = defaults_of(full, quick)
    g = p.add_argument_group("diagonal nets")
    g.add_argument("--d", type=positive_int, default=None, help=f"dimension {default('d')}")
    g.add_argument("--n", type=positive_int, default=None, help=f"training points {default('n')}")
    g.add_argument("--k", type=positive_int, default=None, help=f"non-zeros of β* {default('k')}")
    g.add_argument("--draws", type=seed_list, default=None, metavar="S1,...",
                   help=f"data seeds, one draw each {default('draws')}")
    g.add_argument("--restarts", type=positive_int, default=None,
                   help=f"restarts per model, measure, ρ {default('restarts')}")
    g.add_argument("--pga-iters", type=positive_int, default=None,
                   help=f"PGA iterations {default('pga_iters')}")
    g.add_argument("--apgd-iters", type=positive_int, default=None,
                   help=f"auto_pgd iterations, --solver apgd {default('apgd_iters')}")
    g.add_argument("--solver", choices=("pga", "apgd"), default=None,
                   help="batched PGA (default) or the library's auto_pgd")
    g.add_argument("--mix-literal", choices=("exact", "solver"), default=None,
                   help="literal mix: exact (default) or the --solver")
    g.add_argument("--alpha-range", type=value_range, default=None, metavar="LO,HI",
                   help=f"init scale α, log-uniform {default('alpha_range')}")
    g.add_argument("--lr-factor-range", type=value_range, default=None, metavar="LO,HI",
                   help=f"step / stability limit, log-uniform {default('lr_factor_range')}")
    g.add_argument("--batch-sizes", type=int_list, default=None, metavar="B1,...",
                   help=f"SGD batch sizes {default('batch_choices')}")
    g.add_argument("--phase-epochs-range", type=value_range, default=None, metavar="LO,HI",
                   help=f"large-step phase in epochs {default('phase_epochs_range')}")
    g.add_argument("--lr-decay", type=positive_float, default=None,
                   help=f"step divisor after that phase {default('lr_decay')}")
    g.add_argument("--polish-loss", type=positive_float, default=None,
                   help=f"polish to this training loss {default('polish_loss')}; 1e-5 (the loss "
                        "that ends training) measures the nets where the paper stops, unpolished")
    g.add_argument("--alg1-iters", type=positive_int, default=None,
                   help=f"iterations of the *-alg1 measures (Auto-PGD from 0) {default('alg1_iters')}")


def run(args, log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds diagonal``: the nets of every data draw and the report."""
    config = defaults(args.quick)
    if args.seed is not None:
        config["seed"] = args.seed
    for key in ("d", "n", "k", "draws", "restarts", "pga_iters", "apgd_iters", "solver",
                "mix_literal", "alpha_range", "lr_factor_range", "phase_epochs_range", "lr_decay",
                "polish_loss", "alg1_iters"):
        v = getattr(args, key)
        if v is not None:
            config[key] = v
    if args.batch_sizes is not None:
        config["batch_choices"] = args.batch_sizes
    apply_sharp_overrides(config, args)
    if config["k"] > config["d"]:
        raise ExperimentError(f"--k {config['k']} exceeds --d {config['d']}")
    if len(set(config["draws"])) != len(config["draws"]):
        raise ExperimentError(f"--draws has repeated seeds: {config['draws']}")
    # --models counts nets per draw; model ids are interleaved over the draws
    args.models = (args.models or config["models"]) * len(config["draws"])
    if args.threads is None:  # tiny dense algebra: one thread each (several stall on a busy box)
        args.threads = 1
    return run_population_study(sys.modules[__name__], config, args, log=log, report_kwargs=dict(
        report_fn=diagonal_report, exclude_fn=exclusions))

