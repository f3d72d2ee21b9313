r"""The diagonal study's sharpness measures (:mod:`quotient_manifolds.experiments.diagonal`): the
measures (:data:`MEASURES`), each one's objective in ball coordinates (:func:`objective`), its
maximum by projected gradient ascent (:func:`pga`), exactly (:func:`mix_literal_exact`) or
through the library's Auto-PGD (:func:`sharpness_apgd`), and every measure of a net
(:func:`measure_all`)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from quotient_manifolds.adapters.components import ProductBall, QuotientComponent, ball_factor
from quotient_manifolds.adapters.elementwise import ElementwiseComponent
from quotient_manifolds.adapters.solver import auto_pgd
from quotient_manifolds.core import RescalingGeometry, mix_geodesic_scale

from .closed_forms import beta_along_geodesic, diagonal_trust_region

MAIN = ("adaptive", "geodesic-inv", "geodesic-mix")  # the paper's three measures: the headline
OWN = ("geodesic-mix-manifold",)  # this project's sign-preserving mix variant, labelled as such
#: the paper's Algorithm 1 (one 20-iteration Auto-PGD run from ξ = 0) on each MAIN objective
ALG1 = tuple(f"{m}-alg1" for m in MAIN)
MEASURES = MAIN + OWN + ALG1
FAMILY = {"adaptive": "adaptive", "geodesic-inv": "inv", "geodesic-mix": "mix",
          "geodesic-mix-manifold": "mix", "adaptive-alg1": "adaptive",
          "geodesic-inv-alg1": "inv", "geodesic-mix-alg1": "mix"}
MIX_MARGIN = 1e-3


def train_loss(beta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """‖Xβ − y‖²/(2n), batched over leading dimensions of β."""
    r = beta @ X.T - y
    return 0.5 * (r * r).mean(-1)



# ------------------------------------------------------------------------------------ sharpness
def _project_ball(Z: np.ndarray, r: np.ndarray) -> np.ndarray:
    return Z * ball_factor(np.linalg.norm(Z, axis=1, keepdims=True), r)


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
    proj = np.maximum(proj * ball_factor(np.linalg.norm(proj, axis=1, keepdims=True), rr), low)
    out[~inside] = proj
    return out


def objective(measure: str, u: np.ndarray, v: np.ndarray, X: np.ndarray, y: np.ndarray):
    """(value_and_grad(Z) -> (values, grads), dim, radius factor, lower bound or None).

    Coordinates: inv b, mix δ = β₀⊙b (mix-manifold: s = sign(β₀)δ), adaptive (δ_u/|u|, δ_v/|v|);
    the ball in these coordinates has Euclidean radius ρ·factor."""
    n, d = X.shape
    beta0 = u * v
    L0 = float(train_loss(beta0, X, y))
    beta0_t = torch.from_numpy(beta0)

    def grad_beta(B):
        R = B @ X.T - y
        return 0.5 * (R * R).mean(1) - L0, (R @ X) / n

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


def top_curvature_directions(f: Callable, dim: int, k: int, *, iters: int = 60,
                             eps: float = 1e-5, seed: int = 0) -> np.ndarray:
    """(k, dim) orthonormal directions of the largest eigenvalues of the Hessian of f at 0, by
    block power iteration on central-difference Hessian-vector products (H q ≈ (∇f(εq) −
    ∇f(−εq))/2ε) and a final Rayleigh–Ritz step. Near an interpolator f is nearly the convex
    quadratic ½zᵀHz, whose maximisers over a small ball lie along ±the top eigenvector: the
    starts that random restarts can miss when two signs or two directions compete."""
    rng = np.random.default_rng([seed, 11])
    Q = np.linalg.qr(rng.standard_normal((dim, k)))[0]

    def hvp(Q):
        _, g = f(np.concatenate([eps * Q.T, -eps * Q.T]))
        return ((g[:k] - g[k:]) / (2 * eps)).T

    for _ in range(iters):
        Q = np.linalg.qr(hvp(Q))[0]
    w, V = np.linalg.eigh(Q.T @ hvp(Q))
    return (Q @ V[:, ::-1]).T


def pga(f: Callable, dim: int, radii: Sequence[float], *, restarts: int, iters: int, seed: int,
        lower: Optional[np.ndarray] = None, eigen_starts: int = 0) -> np.ndarray:
    """Max of f over the ball of each radius (and the box z ≥ lower): normalised projected gradient
    ascent, batched over radii × restarts (restart 0 starts at 0, the others at random points of
    the ball), step r·100^{−t/T} (geometric decay), best value seen. ``eigen_starts`` = k adds 2k
    starts per radius at ±r times the top k curvature directions of f at 0
    (:func:`top_curvature_directions`), which random starts can miss. Returns one max per radius."""
    rng = np.random.default_rng(seed)
    K = len(radii)
    r = np.repeat(np.asarray(radii, dtype=float), restarts)[:, None]
    Z = rng.standard_normal((K * restarts, dim))
    Z *= r * rng.uniform(0.2, 1.0, size=(K * restarts, 1)) / np.linalg.norm(Z, axis=1, keepdims=True)
    Z[::restarts] = 0.0
    per = restarts
    if eigen_starts:
        V = top_curvature_directions(f, dim, int(eigen_starts), seed=seed)
        starts = np.concatenate([V, -V])  # 2k unit directions
        per = restarts + starts.shape[0]
        Z = np.concatenate([Z.reshape(K, restarts, dim),
                            np.asarray(radii, dtype=float)[:, None, None] * starts[None]],
                           axis=1).reshape(K * per, dim)
        r = np.repeat(np.asarray(radii, dtype=float), per)[:, None]

    def proj(W):
        return _project_ball(W, r) if lower is None else _project_ball_box(W, r, lower[None, :])

    Z = proj(Z)
    best = np.full(K * per, -np.inf)
    for t in range(iters + 1):
        val, g = f(Z)
        best = np.maximum(best, np.where(np.isfinite(val), val, -np.inf))
        if t == iters:
            break
        gn = np.linalg.norm(g, axis=1, keepdims=True)
        step = r * 100.0 ** (-t / max(1, iters))
        Z = proj(Z + step * g / np.maximum(gn, 1e-300))
    return best.reshape(K, per).max(axis=1)


def mix_literal_exact(u: np.ndarray, v: np.ndarray, X: np.ndarray, y: np.ndarray,
                      rhos: Sequence[float]) -> np.ndarray:
    """The literal ``geodesic-mix`` exactly: L(β₀ + 2δ) − L(β₀) = gᵀδ + δᵀAδ with g = (2/n)Xᵀr,
    A = (2/n)XᵀX is a convex quadratic, so its maximum over ‖δ‖ ≤ ρ/√2 is a trust-region problem,
    diagonal in the basis of X = U S Vᵀ: δ = Σᵢ cᵢvᵢ with c the maximiser of gᵀc + cᵀdiag(a)c
    (:func:`~quotient_manifolds.experiments.closed_forms.diagonal_trust_region`, through its secular equation). Exact to
    round-off, where the PGA's ~1e-7 relative error would swamp the O(ρ√L) differences that rank
    models of one draw."""
    n = X.shape[0]
    r = X @ (u * v) - y
    _, S, Vt = np.linalg.svd(X, full_matrices=False)
    a = 2.0 * S * S / n
    g = 2.0 * (Vt @ (X.T @ r)) / n
    out = []
    for rho in rhos:
        c = diagonal_trust_region(g, a, rho / math.sqrt(2))
        out.append(float(g @ c + (a * c * c).sum()))
    return np.array(out)


def sharpness_apgd(measure: str, u: np.ndarray, v: np.ndarray, X, y, rho: float, n_iters: int,
                   restarts: int = 1, seed: int = 0) -> float:
    """The same maximisation through the library: :func:`quotient_manifolds.adapters.solver.auto_pgd` over a
    :class:`~quotient_manifolds.core.RescalingGeometry` frame, or two elementwise components
    (adaptive). ``restarts`` > 1 adds runs warm-started at random points of the ball (the first
    run starts at ξ = 0, as auto_pgd alone does); the best value is returned.

    * inv: the closed-form (exact) geodesic; complete, nothing to guard.
    * mix-manifold: the exact mix geodesic exists only while 1 + 2bⁱ > 0 (docs/maths.md §8.3) and
      raises beyond (which is why this solver used to return nan). Every point evaluated is kept
      in the feasible set 1 + 2bⁱ ≥ 10⁻³: the ball point of ξ is the geodesic endpoint of b
      clamped to that box, which has the same maximum over the ball as the objective over
      ball ∩ box (see ``BoxedMixComponent``) and needs nothing from auto_pgd's internals.
    * mix (literal): the polynomial continuation β₀⊙(1 + 2b) of the geodesic's β, as the PGA uses:
      the ball point is the representative (u₀⊙(1 + 2b), v₀), whose product is that β.
    """
    Xt, yt = torch.tensor(X), torch.tensor(y)
    ut, vt = torch.tensor(u), torch.tensor(v)
    n = X.shape[0]

    def L(beta):
        r = Xt @ beta - yt
        return 0.5 * (r * r).sum() / n

    if measure == "adaptive":
        comp = ElementwiseComponent({"u": ut, "v": vt})
        ball = ProductBall([comp])

        def closure(points):
            parts = comp.unflatten(points[0])
            return L(parts["u"] * parts["v"])
    elif measure in ("geodesic-inv", "geodesic-mix-manifold", "geodesic-mix"):
        metric = "inv" if measure == "geodesic-inv" else "mix"
        geom = RescalingGeometry(X.shape[1], metric, retraction="exact")
        x0 = torch.stack([ut, vt])
        frame = geom.frame(x0)
        kind = {"geodesic-mix": PolynomialMixComponent, "geodesic-mix-manifold": BoxedMixComponent}.get(
            measure, QuotientComponent)
        ball = ProductBall([kind("uv", frame, x0, retraction="exact")])

        def closure(points):
            return L(geom.beta(points[0]))
    else:
        raise ValueError(f"unknown diagonal measure {measure!r}; valid: {', '.join(MEASURES)}")
    best = auto_pgd(ball, closure, rho, n_iters=n_iters).sharpness
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        loss0 = float(closure(ball.points(ball.zeros())))
    for _ in range(max(0, restarts - 1)):
        xi = ball.random(gen)
        frac = float(torch.empty(()).uniform_(0.2, 1.0, generator=gen))
        xi = [t * (frac * rho / float(ball.norm(xi))) for t in xi]
        xi = ball.project_ball(xi, rho, horizontal=True)
        best = max(best, auto_pgd(ball, closure, rho, n_iters=n_iters,
                                  start=(xi, loss0)).sharpness)
    return best


def _horizontal_b(xi, x0):
    """The coefficient b of a horizontal ξ = (b⊙u, b⊙v) (mean of both rows)."""
    return 0.5 * (xi[0] / x0[0] + xi[1] / x0[1])


class BoxedMixComponent(QuotientComponent):
    """The mix quotient with the exact geodesic, restricted to 1 + 2bⁱ ≥ margin: the ball point
    of ξ = (b⊙u₀, b⊙v₀) is the geodesic endpoint of b clamped to b ≥ −(1 − margin)/2. Clamping
    only shrinks |bⁱ|, so it maps the ball into ball ∩ box and is the identity there: the
    maximum over the ball is the maximum over ball ∩ box, and every point evaluated is the
    endpoint of a geodesic that exists (the exact retraction raises beyond 1 + 2b ≤ 0)."""

    margin = MIX_MARGIN

    def point(self, xi, retraction=None, exact_steps=None, *, out=None):
        b = torch.clamp(_horizontal_b(xi, self.x0), min=-(1 - self.margin) / 2)
        return super().point(self.x0 * b, retraction, exact_steps, out=out)


class PolynomialMixComponent(QuotientComponent):
    """The mix quotient's metric, projection and gradient, but the ball point of ξ is
    (u₀⊙(1 + 2b), v₀): β = β₀⊙(1 + 2b), the polynomial continuation past 1 + 2b ≤ 0."""

    def point(self, xi, retraction=None, exact_steps=None, *, out=None):
        b = _horizontal_b(xi, self.x0)
        moved = torch.stack([self.x0[0] * mix_geodesic_scale(b), self.x0[1]])
        return moved if out is None else out.copy_(moved)


def measure_all(config: Dict[str, Any], u, v, X, y, seed: int) -> List[Dict[str, Any]]:
    """Every measure of ``config["measures"]`` at its family's ρ and the sweep (the ``-alg1``
    measures at the main ρ only): a list of {measure, rho, value} (and time_s once per measure)."""
    out = []
    for m in config["measures"]:
        if m not in FAMILY:
            raise ValueError(f"unknown diagonal measure {m!r}; valid: {', '.join(MEASURES)}")
        fam = FAMILY[m]
        base = config["rho"][fam]
        rhos = [base] + ([] if m in ALG1 else [float(f"{base * s:.12g}") for s in config["rho_sweep"]
                                               if not math.isclose(base * s, base)])
        t0 = time.perf_counter()
        if m in ALG1:  # the paper's Algorithm 1: one Auto-PGD run from ξ = 0, no restarts
            vals = [sharpness_apgd(m[:-len("-alg1")], u, v, X, y, r, int(config["alg1_iters"]),
                                   restarts=1, seed=seed) for r in rhos]
        elif m == "geodesic-mix" and config.get("mix_literal") == "exact":
            vals = mix_literal_exact(u, v, X, y, rhos)
        elif config["solver"] == "pga":
            f, dim, factor, lower = objective(m, u, v, X, y)
            vals = pga(f, dim, [r * factor for r in rhos], restarts=config["restarts"],
                       iters=config["pga_iters"], seed=seed, lower=lower,
                       eigen_starts=config.get("eigen_starts", 0))
        else:
            vals = [sharpness_apgd(m, u, v, X, y, r, config["apgd_iters"],
                                   restarts=config["restarts"], seed=seed)
                    for r in rhos]
        dt = time.perf_counter() - t0
        for r, val in zip(rhos, vals):
            out.append(dict(measure=m, rho=float(r), value=float(val)))
        out[-1]["time_s"] = round(dt, 3)  # once per measure (all its ρ together)
    return out

