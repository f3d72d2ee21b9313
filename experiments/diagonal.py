r"""Diagonal linear networks β = u⊙v (docs/maths.md §8, §11.2; paper §5.1).

Setup (the paper leaves n, X, the varied hyperparameters, the optimiser, ρ and sum-vs-mean
unstated, docs/maths.md §11.2; our choices):

* d = 200, n = 100 (overparameterised), X with i.i.d. N(0, 1) entries, β* with k = 20 non-zeros
  (90 % sparse) drawn N(0, 1), noiseless y = Xβ*; one fixed draw (``data_seed``) for all models;
* loss L(β) = (1/n)‖Xβ − y‖² (mean; the paper writes the sum, which only rescales L and the mix ρ);
* test loss = E_x (xᵀβ − xᵀβ*)² = ‖β − β*‖², the exact population risk for x ~ N(0, I);
* init u₀ = √2·α·1, v₀ = 0 (Pesme et al. 2021 for β = u⊙v; it is the w₊² − w₋² model with
  initialisation scale α). The init u = v = α·1 would keep u = v for ever (the updates of u and v
  are then identical), i.e. β = u² ≥ 0, which cannot fit a β* with negative entries;
* 50 models, model i draws from ``default_rng([seed, i])``: α log-uniform in [0.01, 1], batch size
  in {100 (GD), 50, 25}, step size lr = c·lr_max(batch) with c log-uniform in [0.2, 0.8] and
  lr_max(b) = 1 / (mean top eigenvalue of (2/b)X_bᵀX_b over batches × 2(α² + 1.5·max|β*|)), the
  step that the curvature at an interpolator allows; (S)GD until the full-batch training loss
  is ≤ 1e-5 (checked every 50 steps; diverged runs restart with half the step size).
  **α is what spreads the test loss**: it moves the implicit bias from ℓ1-like (α → 0, sparse,
  test loss ~1e-3) to ℓ2-like (α ~ 1, test loss ~5); lr and batch change it by a few % at most.

Sharpness, maximised by normalised projected gradient ascent with restarts (docs/maths.md §8.6),
batched over restarts and the ρ grid (``solver="pga"``), all through the closed-form geodesics of
the rescaling quotient (:func:`quotient_manifolds.core.beta_along_geodesic`; ``solver="apgd"``
runs the library's :func:`adapters.solver.auto_pgd` on a
:class:`~quotient_manifolds.core.RescalingGeometry` with the ``exact`` retraction instead):

* ``geodesic-inv``: max L(β₀⊙e^{2b}) − L(β₀) over ‖b‖ ≤ ρ/√2 (‖ξ‖²_inv = 2‖b‖²);
* ``geodesic-mix``: max L(β₀⊙(1+2b)) − L(β₀) over √2‖β₀⊙b‖ ≤ ρ, exactly as docs/maths.md §8.6, where
  β(1) is the polynomial continuation of the geodesic's β also where 1 + 2b ≤ 0;
* ``geodesic-mix-manifold`` (extra row): the same with 1 + 2bⁱ ≥ 10⁻³, i.e. only endpoints of
  geodesics that exist on the manifold (u√(1+2b), v√(1+2b)) — what the exact retraction allows;
* ``adaptive``: max over ‖(δ_u/|u|, δ_v/|v|)‖₂ ≤ ρ of L((u+δ_u)⊙(v+δ_v)) − L(u⊙v).

In coordinates b (inv), δ = β₀⊙b (mix) and (δ_u/u, δ_v/v) (adaptive) each ball is a Euclidean
ball (times √2), so the normalised Euclidean ascent there is the Riemannian one; the mix-manifold
feasible set is a ball ∩ box, projected onto exactly (bisection on the multiplier).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from .runner import check_parent_alive, config_hash, load_checkpoint, save_checkpoint

NAME = "diagonal"
PAPER_KEY = "diagonal"
MEASURES = ("adaptive", "geodesic-inv", "geodesic-mix", "geodesic-mix-manifold")
MAIN = ("adaptive", "geodesic-inv", "geodesic-mix")
FAMILY = {"adaptive": "adaptive", "geodesic-inv": "inv", "geodesic-mix": "mix",
          "geodesic-mix-manifold": "mix"}
MIX_MARGIN = 1e-3


def defaults(quick: bool) -> Dict[str, Any]:
    c: Dict[str, Any] = dict(
        d=200, n=100, k=20, data_seed=0, seed=0, noise=0.0, loss="mean",
        alpha_range=[0.01, 1.0], lr_factor_range=[0.2, 0.8], batch_choices=[100, 50, 25],
        target_loss=1e-5, max_steps=400000, check_every=50,
        rho=dict(adaptive=0.1, inv=0.1, mix=0.1), rho_sweep=[0.25, 0.5, 2.0, 5.0],
        measures=list(MEASURES), solver="pga", restarts=8, pga_iters=600, apgd_iters=100,
        models=50)
    if quick:
        c.update(alpha_range=[0.05, 1.0], target_loss=1e-4, restarts=3, pga_iters=60,
                 apgd_iters=10, rho_sweep=[2.0], models=6)
    return c


# ------------------------------------------------------------------------------------ data
def make_data(config: Dict[str, Any]):
    rng = np.random.default_rng(config["data_seed"])
    d, n, k = config["d"], config["n"], config["k"]
    X = rng.standard_normal((n, d))
    beta_star = np.zeros(d)
    support = rng.choice(d, size=k, replace=False)
    beta_star[support] = rng.standard_normal(k)
    y = X @ beta_star + config["noise"] * rng.standard_normal(n)
    return X, y, beta_star


def train_loss(beta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(1/n)‖Xβ − y‖², batched over leading dimensions of β."""
    r = beta @ X.T - y
    return (r * r).mean(-1)


def test_loss(beta: np.ndarray, beta_star: np.ndarray, noise: float = 0.0) -> float:
    """Population risk E(xᵀβ − y)² for x ~ N(0, I): ‖β − β*‖² + noise²."""
    return float(((beta - beta_star) ** 2).sum() + noise ** 2)


def hparams(config: Dict[str, Any], model_id: int) -> Dict[str, Any]:
    rng = np.random.default_rng([int(config["seed"]), int(model_id), 7])
    lo, hi = config["alpha_range"]
    clo, chi = config["lr_factor_range"]
    return dict(seed=int(rng.integers(0, 2 ** 31 - 1)),
                alpha=float(math.exp(rng.uniform(math.log(lo), math.log(hi)))),
                lr_factor=float(math.exp(rng.uniform(math.log(clo), math.log(chi)))),
                batch_size=int(rng.choice(config["batch_choices"])))


def lr_max(X: np.ndarray, beta_star: np.ndarray, alpha: float, batch: int, seed: int) -> float:
    n = X.shape[0]
    if batch >= n:
        lam = np.linalg.eigvalsh(2 * X.T @ X / n).max()
    else:
        rng = np.random.default_rng([seed, 3])
        lam = float(np.mean([np.linalg.eigvalsh(2 * X[j].T @ X[j] / batch).max()
                             for j in (rng.choice(n, batch, replace=False) for _ in range(20))]))
    scale = 2 * (alpha ** 2 + 1.5 * np.abs(beta_star).max())
    return 1.0 / (lam * scale)


def train(config: Dict[str, Any], hp: Dict[str, Any], X, y, beta_star, progress: bool = False):
    """(S)GD on (u, v) from u = √2α, v = 0 until L ≤ target. Returns (u, v, info)."""
    n, d = X.shape
    lr = hp["lr_factor"] * lr_max(X, beta_star, hp["alpha"], hp["batch_size"], hp["seed"])
    restarts = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=config["max_steps"], desc="train", unit="step", leave=False,
                   dynamic_ncols=True, mininterval=0.5)
    while True:
        rng = np.random.default_rng([hp["seed"], 4, restarts])
        u = np.full(d, math.sqrt(2) * hp["alpha"])
        v = np.zeros(d)
        b = hp["batch_size"]
        step, L, diverged = 0, float(train_loss(u * v, X, y)), False
        while step < config["max_steps"]:
            if b >= n:
                for _ in range(config["check_every"]):
                    g = (2.0 / n) * (X.T @ (X @ (u * v) - y))
                    u, v = u - lr * g * v, v - lr * g * u
            else:
                for _ in range(config["check_every"]):
                    j = rng.choice(n, b, replace=False)
                    Xj = X[j]
                    g = (2.0 / b) * (Xj.T @ (Xj @ (u * v) - y[j]))
                    u, v = u - lr * g * v, v - lr * g * u
            step += config["check_every"]
            L = float(train_loss(u * v, X, y))
            if bar is not None and step % 5000 == 0:
                bar.update(5000)
                bar.set_postfix(loss=f"{L:.2e}")
            if not math.isfinite(L) or L > 1e6:
                diverged = True
                break
            if L <= config["target_loss"]:
                break
            if step % 5000 == 0:
                check_parent_alive()
        if not diverged:
            break
        restarts += 1
        lr *= 0.5
        if restarts > 6:
            break
    if bar is not None:
        bar.close()
    info = dict(steps=step, lr=lr, restarts=restarts, train_loss=L,
                converged=bool(math.isfinite(L) and L <= config["target_loss"]))
    return u, v, info


def spread_note(records) -> str:
    """Which hyperparameters set the test loss: R² of least-squares fits of log test loss on
    log α alone and on (log α, log step factor, log batch), over the population's models."""
    if len(records) < 5:
        return "Too few models to say which hyperparameter sets the test loss."
    hp = [r["hparams"] for r in records]
    y = np.log([r["metrics"]["test_loss"] for r in records])
    log_alpha = np.log([h["alpha"] for h in hp])
    others = np.log([[h["lr_factor"], h["batch_size"]] for h in hp])

    def r2(*columns):
        A = np.column_stack([np.ones_like(y), *columns])
        resid = y - A @ np.linalg.lstsq(A, y, rcond=None)[0]
        total = float(((y - y.mean()) ** 2).sum())
        return 1 - float((resid ** 2).sum()) / total if total > 0 else float("nan")

    return (f"What spreads the test loss: log α alone explains R² = {r2(log_alpha):.3f} of the "
            f"variance of log test loss; with log step factor and log batch size R² = "
            f"{r2(log_alpha, others):.3f} (test loss {np.exp(y.min()):.3g} … {np.exp(y.max()):.3g}).")


# ------------------------------------------------------------------------------------ sharpness
def _project_ball(Z: np.ndarray, r: np.ndarray) -> np.ndarray:
    nrm = np.linalg.norm(Z, axis=1, keepdims=True)
    return Z * np.minimum(1.0, r / np.maximum(nrm, 1e-300))


def _project_ball_box(Z: np.ndarray, r: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Exact Euclidean projection onto {‖z‖ ≤ r} ∩ {z ≥ lo} (lo ≤ 0), row-wise.

    KKT: the minimiser is p(t) = max(t·z, lo) with the largest t ∈ (0, 1] such that ‖p(t)‖ ≤ r.
    ‖p(t)‖² = t²(S − A_k) + B_k is piecewise quadratic and increasing in t, with breakpoints
    t_i = lo_i/z_i (coordinates with z_i < lo_i clamp from t_i on); A_k, B_k are the sums of z_i²
    and lo_i² over the k coordinates clamped first. Sorting the breakpoints gives t in closed form.
    """
    lo = np.broadcast_to(lo, Z.shape)
    P = np.maximum(Z, lo)
    inside = (np.linalg.norm(P, axis=1, keepdims=True) <= r)[:, 0]
    if inside.all():
        return P
    z, low, rr = Z[~inside], lo[~inside], r[~inside]
    clamps = z < low
    with np.errstate(divide="ignore", invalid="ignore"):
        T = np.where(clamps, low / np.where(clamps, z, 1.0), np.inf)
    order = np.argsort(T, axis=1)
    Ts = np.take_along_axis(T, order, axis=1)
    z2 = np.take_along_axis(z * z, order, axis=1)
    l2 = np.take_along_axis(np.where(clamps, low * low, 0.0), order, axis=1)
    zeros = np.zeros((z.shape[0], 1))
    A = np.concatenate([zeros, np.cumsum(z2, axis=1)], axis=1)
    B = np.concatenate([zeros, np.cumsum(l2, axis=1)], axis=1)
    S = (z * z).sum(axis=1, keepdims=True)
    lower = np.concatenate([zeros, Ts], axis=1)
    upper = np.concatenate([Ts, np.full_like(zeros, np.inf)], axis=1)
    free = S - A
    with np.errstate(divide="ignore", invalid="ignore"):
        cand = np.sqrt(np.maximum(rr * rr - B, 0.0) / np.where(free > 0, free, 1.0))
    tol = 1e-12 * np.maximum(1.0, np.where(np.isfinite(upper), upper, 1.0))
    valid = (free > 0) & (cand >= lower - tol) & (cand <= upper + tol) & np.isfinite(cand)
    k = np.argmax(valid, axis=1)
    t = np.minimum(cand[np.arange(z.shape[0]), k], 1.0)[:, None]
    out = P.copy()
    proj = np.maximum(t * z, low)
    # guard against round-off: rescale radially if still (barely) outside
    nrm = np.linalg.norm(proj, axis=1, keepdims=True)
    proj = np.where(nrm > rr, np.maximum(proj * (rr / nrm), low), proj)
    out[~inside] = proj
    return out


def objective(measure: str, u: np.ndarray, v: np.ndarray, X: np.ndarray, y: np.ndarray):
    """(value_and_grad(Z) -> (values, grads), dim, radius factor, lower bound or None).

    Coordinates: inv b, mix δ = β₀⊙b (mix-manifold: s = sign(β₀)δ), adaptive (δ_u/|u|, δ_v/|v|);
    the ball in these coordinates has Euclidean radius ρ·factor."""
    from quotient_manifolds.core import beta_along_geodesic
    import torch

    n, d = X.shape
    beta0 = u * v
    L0 = float(train_loss(beta0, X, y))
    beta0_t = torch.from_numpy(beta0)

    def grad_beta(B):
        R = B @ X.T - y
        return (R * R).mean(1) - L0, (2.0 / n) * (R @ X)

    if measure == "geodesic-inv":
        def f(Z):
            B = beta_along_geodesic(beta0_t, torch.from_numpy(Z), "inv").numpy()
            val, g = grad_beta(B)
            return val, g * 2 * B
        return f, d, 1 / math.sqrt(2), None
    if measure == "geodesic-mix":
        def f(Z):  # δ = β₀⊙b: β = β₀⊙(1 + 2b) = β₀ + 2δ
            B = beta0 + 2 * Z
            val, g = grad_beta(B)
            return val, 2 * g
        return f, d, 1 / math.sqrt(2), None
    if measure == "geodesic-mix-manifold":
        sg = np.where(beta0 >= 0, 1.0, -1.0)
        lo = -(1 - MIX_MARGIN) * np.abs(beta0) / 2  # s = sign(β₀)δ ≥ −|β₀|(1−m)/2 ⇔ 1+2b ≥ m

        def f(Z):
            B = beta0 + 2 * sg * Z
            val, g = grad_beta(B)
            return val, 2 * sg * g
        return f, d, 1 / math.sqrt(2), lo
    if measure == "adaptive":
        au, av = np.abs(u), np.abs(v)

        def f(Z):
            A, C = Z[:, :d], Z[:, d:]
            U, V = u + A * au, v + C * av
            val, g = grad_beta(U * V)
            return val, np.concatenate([g * V * au, g * U * av], axis=1)
        return f, 2 * d, 1.0, None
    raise ValueError(f"unknown diagonal measure {measure!r}; valid: {', '.join(MEASURES)}")


def pga(f: Callable, dim: int, radii: Sequence[float], *, restarts: int, iters: int, seed: int,
        lower: Optional[np.ndarray] = None) -> np.ndarray:
    """Max of f over the ball of each radius (and the box z ≥ lower): normalised projected gradient
    ascent, batched over radii × restarts (restart 0 starts at 0, the others at random points of
    the ball), step r·100^{−t/T} (geometric decay), best value seen. Returns one max per radius."""
    rng = np.random.default_rng(seed)
    K = len(radii)
    r = np.repeat(np.asarray(radii, dtype=float), restarts)[:, None]
    Z = rng.standard_normal((K * restarts, dim))
    Z *= r * rng.uniform(0.2, 1.0, size=(K * restarts, 1)) / np.linalg.norm(Z, axis=1, keepdims=True)
    Z[::restarts] = 0.0

    def proj(W):
        return _project_ball(W, r) if lower is None else _project_ball_box(W, r, lower[None, :])

    Z = proj(Z)
    best = np.full(K * restarts, -np.inf)
    for t in range(iters + 1):
        val, g = f(Z)
        best = np.maximum(best, np.where(np.isfinite(val), val, -np.inf))
        if t == iters:
            break
        gn = np.linalg.norm(g, axis=1, keepdims=True)
        step = r * 100.0 ** (-t / max(1, iters))
        Z = proj(Z + step * g / np.maximum(gn, 1e-300))
    return best.reshape(K, restarts).max(axis=1)


def sharpness_apgd(measure: str, u: np.ndarray, v: np.ndarray, X, y, rho: float, n_iters: int):
    """The same maximisation through the library: :func:`adapters.solver.auto_pgd` over a
    :class:`~quotient_manifolds.core.RescalingGeometry` frame with the closed-form (exact) geodesic
    (inv, mix-manifold), or two elementwise components (adaptive). ``geodesic-mix`` (the polynomial
    continuation) has no manifold point where 1 + 2b ≤ 0, so it is run as mix-manifold here."""
    import torch

    from adapters.solver import ElementwiseComponent, ProductBall, QuotientComponent, auto_pgd
    from quotient_manifolds.core import RescalingGeometry

    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    ut, vt = torch.from_numpy(u), torch.from_numpy(v)

    def L(beta):
        r = Xt @ beta - yt
        return (r * r).mean()

    if measure == "adaptive":
        try:  # current API: one flattened component over several tensors
            comp = ElementwiseComponent({"u": ut, "v": vt})
            ball = ProductBall([comp])

            def closure(points):
                parts = comp.unflatten(points[0])
                return L(parts["u"] * parts["v"])
        except TypeError:  # earlier API: one component per tensor
            ball = ProductBall([ElementwiseComponent("u", ut), ElementwiseComponent("v", vt)])

            def closure(points):
                return L(points[0] * points[1])
    else:
        metric = "inv" if measure == "geodesic-inv" else "mix"
        geom = RescalingGeometry(X.shape[1], metric, retraction="exact")
        x0 = torch.stack([ut, vt])
        ball = ProductBall([QuotientComponent("uv", geom.frame(x0), x0, retraction="exact")])

        def closure(points):
            return L(geom.beta(points[0]))
    try:
        res = auto_pgd(ball, closure, rho, n_iters=n_iters)
    except ValueError:  # the mix geodesic left the manifold (1 + 2b ≤ 0)
        return float("nan")
    return res.sharpness


def measure_all(config: Dict[str, Any], u, v, X, y, seed: int) -> List[Dict[str, Any]]:
    out = []
    for m in config["measures"]:
        fam = FAMILY[m]
        base = config["rho"][fam]
        rhos = [base] + [base * s for s in config["rho_sweep"] if base * s != base]
        t0 = time.perf_counter()
        if config["solver"] == "pga":
            f, dim, factor, lower = objective(m, u, v, X, y)
            vals = pga(f, dim, [r * factor for r in rhos], restarts=config["restarts"],
                       iters=config["pga_iters"], seed=seed, lower=lower)
        else:
            vals = [sharpness_apgd(m, u, v, X, y, r, config["apgd_iters"]) for r in rhos]
        dt = (time.perf_counter() - t0) / len(rhos)
        for r, val in zip(rhos, vals):
            out.append(dict(measure=m, rho=float(r), value=float(val), time_s=dt))
    return out


# ------------------------------------------------------------------------------------ job
def train_hash(config: Dict[str, Any], hp: Dict[str, Any]) -> str:
    keys = ("d", "n", "k", "data_seed", "noise", "loss", "target_loss", "max_steps", "check_every")
    return config_hash({"study": NAME, **{k: config[k] for k in keys}, "hp": hp})


def job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
        progress: bool) -> Dict[str, Any]:
    import torch

    started = time.perf_counter()
    X, y, beta_star = make_data(config)
    hp = hparams(config, model_id)
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
    metrics = dict(train_loss=float(train_loss(beta, X, y)),
                   test_loss=test_loss(beta, beta_star, config["noise"]),
                   l1=float(np.abs(beta).sum()), l2=float(np.linalg.norm(beta)),
                   support_mass=float(np.abs(beta[beta_star != 0]).sum() / np.abs(beta).sum()),
                   converged=info["converged"], steps=info["steps"])
    t0 = time.perf_counter()
    sharp = measure_all(config, u, v, X, y, seed=hp["seed"])
    return dict(seed=hp["seed"], hparams=hp, study_config=config, metrics=metrics,
                sharpness=sharp, checkpoint=path, reused_checkpoint=reused, train_info=info,
                timing=dict(train_s=train_s, sharpness_s=time.perf_counter() - t0,
                            total_s=time.perf_counter() - started))
