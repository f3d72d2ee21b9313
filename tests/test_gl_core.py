r"""The GL(h) quotient core (`quotient_manifolds.core.gl`) against brute force and independent numerics.

Every closed form of spec ``geodesic-sharpness-math.md`` §1–§5, §6.4 is checked against something
computed another way: the metric against its definition under the group action, the projection
against `scipy.linalg.solve_sylvester` and against a dense solve over a basis of the vertical space,
the Riemannian gradient against finite differences of the loss, the Christoffel map against
Γ^i_kl = ½ g^{im}(∂_l g_mk + ∂_k g_ml − ∂_m g_kl) from the dense metric tensor (autograd), the
Riemannian Hessian against finite differences of the gradient and second derivatives of the loss along
the exact geodesic, and the retractions against the exact geodesic (orders 2 and 3).

Convention for the dtype parametrisation: test data are drawn in float64, rounded to the dtype under
test and the rounded values are used (upcast) for every float64 reference, so the tolerance only has
to cover the core's float32 output rounding (the core computes in float64 internally).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import scipy.linalg
import torch

from quotient_manifolds.core import (
    METRICS,
    RETRACTIONS,
    GLMetric,
    GLQuotientGeometry,
    InvMetric,
    MixMetric,
    as_metric,
)
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

F64 = torch.float64
DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["f64", "f32"]
# tolerance for results of the core relative to the scale of the quantity (output rounding + a margin)
RTOL = {torch.float64: 1e-10, torch.float32: 2e-6}
EPS_VALUES = [0.0, 0.3]  # 0.3 is large on purpose: with it the relaxed formulas differ visibly

N, M, H = 7, 5, 3


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------- helpers
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, dtype=F64, generator=gen(seed))


def rounded(t: torch.Tensor, dtype) -> torch.Tensor:
    """t rounded to dtype and returned in float64 (exactly representable in dtype)."""
    return t.to(dtype).to(F64)


def well_conditioned_point(n, m, h, seed, batch=()):
    """[G; H] with singular values of G and H in [0.5, 2] (random orientation)."""
    g = gen(seed)

    def factor(rows):
        Q, _ = torch.linalg.qr(torch.randn(batch + (rows, h), dtype=F64, generator=g))
        V, _ = torch.linalg.qr(torch.randn(batch + (h, h), dtype=F64, generator=g))
        s = 0.5 + 1.5 * torch.rand(batch + (h,), dtype=F64, generator=g)
        return Q @ (s[..., :, None] * V)

    return torch.cat((factor(n), factor(m)), dim=-2)


def ill_conditioned(h, cond, seed):
    """A = U diag(s) Vᵀ with s log-spaced from 1 to 1/cond (condition number cond)."""
    g = gen(seed)
    U, _ = torch.linalg.qr(torch.randn(h, h, dtype=F64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(h, h, dtype=F64, generator=g))
    s = torch.logspace(0, -math.log10(cond), h, dtype=F64)
    return U @ torch.diag(s) @ V.T


def gaussian_gl(h, seed):
    return randn((h, h), seed) + 0.5 * torch.eye(h, dtype=F64)


def rel(a, b, scale=None):
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    s = b.abs().max() if scale is None else torch.as_tensor(scale, dtype=F64)
    return float((a - b).abs().max() / s)


def fro_rel(a, b):
    a, b = a.to(F64), b.to(F64)
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


class InvariantLoss:
    """f(G, H) = Σ W ⊙ tanh(S) + 0.1‖S‖², S = X G Hᵀ Y: depends on G Hᵀ only (GL-invariant)."""

    def __init__(self, n, m, seed, weight_decay=0.0):
        self.n = n
        self.X = randn((5, n), seed)
        self.Y = randn((m, 4), seed + 1)
        self.W = randn((5, 4), seed + 2)
        self.wd = weight_decay

    def __call__(self, x):
        G, H = x[..., : self.n, :], x[..., self.n:, :]
        S = self.X @ G @ H.mT @ self.Y
        out = (torch.tanh(S) * self.W).sum((-1, -2)) + 0.1 * (S ** 2).sum((-1, -2))
        if self.wd:
            out = out + 0.5 * self.wd * (x ** 2).sum((-1, -2))
        return out

    def egrad(self, x):
        x = x.detach().to(F64).requires_grad_(True)
        (g,) = torch.autograd.grad(self(x).sum(), x)
        return g

    def ehess(self, x, u):
        _, hv = torch.autograd.functional.hvp(lambda z: self(z).sum(), x.to(F64), u.to(F64))
        return hv

    def directional(self, x, u, step=1e-5):
        """Central finite difference of f along u (independent of autograd)."""
        return (self(x + step * u) - self(x - step * u)) / (2 * step)


def dense(fn, shape):
    """Matrix of the linear map fn in flattened coordinates: columns are fn(basis vector)."""
    D = int(np.prod(shape))
    E = torch.eye(D, dtype=F64).reshape((D,) + tuple(shape))
    return fn(E).reshape(D, D).T


def geometry(metric, eps=0.0, n=N, m=M, h=H, **kw):
    return GLQuotientGeometry(n, m, h, metric, eps=eps, **kw)


# ---------------------------------------------------------------------------------------------- metric
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("kind", ["gaussian", "cond1e4"])
def test_metric_invariant_euclidean_not(metric, dtype, kind):
    """g_{x·A}(u·A, v·A) = g_x(u, v) for A and a·A, a ∈ {1e-2 … 1e2}; ⟨u·A, v·A⟩_F changes."""
    geom = geometry(metric)
    x = rounded(geom.random_point(generator=gen(1), dtype=F64), dtype)
    u, v = rounded(randn(x.shape, 2), dtype), rounded(randn(x.shape, 3), dtype)
    uh = rounded(geom.project(x, randn(x.shape, 4)), dtype)  # also a horizontal vector
    base = ill_conditioned(H, 1e4, 5) if kind == "cond1e4" else gaussian_gl(H, 5)
    # the action is computed in `dtype`; an ill-conditioned A amplifies its rounding (measured
    # max 7e-10 in float64 and 6e-5 in float32 for cond(A) = 1e4)
    tol = {torch.float64: 1e-7, torch.float32: 1e-3}[dtype] if kind == "cond1e4" else \
        {torch.float64: 1e-11, torch.float32: 1e-5}[dtype]
    f0 = geom.frame(x.to(dtype))
    for a in (1e-2, 1e-1, 1.0, 1e1, 1e2):
        A = (a * base).to(dtype)
        xa = geom.act(x.to(dtype), A)
        f1 = geom.frame(xa)
        for p, q in ((u, v), (uh, v), (u, u)):
            p_, q_ = p.to(dtype), q.to(dtype)
            g0 = f0.inner(p_, q_).to(F64)
            g1 = f1.inner(geom.act(p_, A), geom.act(q_, A)).to(F64)
            scale = f0.norm(p_).to(F64) * f0.norm(q_).to(F64)  # Cauchy–Schwarz scale of g0
            assert abs(float(g1 - g0)) <= tol * float(scale), (a, float(g0), float(g1))
        # the Euclidean inner product of the same vectors is not invariant
        e0 = float((u * v).sum())
        e1 = float((geom.act(u.to(dtype), A).to(F64) * geom.act(v.to(dtype), A).to(F64)).sum())
        assert abs(e1 - e0) > 1e-2 * abs(e0), (a, e0, e1)
        # and the invariant G Hᵀ is preserved by the action itself
        G0, H0 = geom.split(x)
        G1, H1 = geom.split(xa.to(F64))
        assert rel(G1 @ H1.mT, G0 @ H0.mT) < tol


@pytest.mark.parametrize("metric", METRICS)
def test_relaxed_metric_only_approximately_invariant(metric):
    """Spec §6.4: with ε > 0 the metric changes under the action by O(ε) (and ε is really used)."""
    x = well_conditioned_point(N, M, H, 11)
    u, v = randn(x.shape, 12), randn(x.shape, 13)
    A = gaussian_gl(H, 14)
    changes = []
    for eps in (1e-6, 1e-3):
        geom = geometry(metric, eps)
        f0, f1 = geom.frame(x), geom.frame(geom.act(x, A))
        g0, g1 = f0.inner(u, v), f1.inner(geom.act(u, A), geom.act(v, A))
        changes.append(abs(float(g1 - g0)) / float(f0.norm(u) * f0.norm(v)))
    assert 1e-12 < changes[0] < 1e-4
    assert 1e-9 < changes[1] < 1e-1
    assert 100 < changes[1] / changes[0] < 1e5  # grows with ε


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_metric_matches_trace_formula(metric, eps, dtype):
    """g(u, v) against the trace formulas of spec §2 (with P_ε, Q_ε), written out here."""
    geom = geometry(metric, eps)
    x = rounded(well_conditioned_point(N, M, H, 21), dtype)
    u, v = rounded(randn(x.shape, 22), dtype), rounded(randn(x.shape, 23), dtype)
    G, Hm = geom.split(x)
    uG, uH = geom.split(u)
    vG, vH = geom.split(v)
    I = torch.eye(H, dtype=F64)
    P, Q = G.T @ G + eps * I, Hm.T @ Hm + eps * I
    if metric == "inv":
        ref = torch.trace(torch.linalg.solve(P, uG.T @ vG)) + torch.trace(torch.linalg.solve(Q, uH.T @ vH))
    else:
        ref = torch.trace(Q @ uG.T @ vG) + torch.trace(P @ uH.T @ vH)
    got = geom.inner(x.to(dtype), u.to(dtype), v.to(dtype))
    assert got.dtype == dtype
    assert rel(got, ref) < RTOL[dtype]
    assert rel(geom.norm(x.to(dtype), u.to(dtype)) ** 2, geom.inner(x, u, u)) < RTOL[dtype]


# ---------------------------------------------------------------------------------------------- projection
def vertical_basis(frame, h):
    return [frame.vertical(E.reshape(h, h)) for E in torch.eye(h * h, dtype=F64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_projection_orthogonal_idempotent_pythagoras(metric, eps, dtype):
    """P_h ξ ⟂ every vertical vector (in the metric, relaxed when ε > 0), ξ − P_h ξ is vertical
    (d(G Hᵀ)[ξ − P_h ξ] = 0), P_h is idempotent, Pythagoras holds and the horizontal equations of
    spec §3.1 are satisfied."""
    geom = geometry(metric, eps)
    x = rounded(geom.random_point(generator=gen(31), dtype=F64), dtype)
    xi = rounded(randn(x.shape, 32), dtype)
    f = geom.frame(x.to(dtype))
    f64 = geom.frame(x)
    p = f.project(xi.to(dtype))
    assert p.dtype == dtype and p.shape == xi.shape
    p = p.to(F64)
    tol = RTOL[dtype]
    # metric-orthogonal to the vertical space, measured with the float64 frame
    nrm = f64.norm(p)
    for V in vertical_basis(f64, H):
        assert abs(float(f64.inner(p, V))) <= tol * float(nrm * f64.norm(V))
    # the removed part is vertical: it does not move G Hᵀ to first order
    w = xi - p
    G, Hm = geom.split(x)
    wG, wH = geom.split(w)
    assert rel(wG @ Hm.T + G @ wH.T, 0 * G @ Hm.T, scale=torch.linalg.norm(w) * torch.linalg.norm(x)) < tol
    # idempotent
    assert rel(f.project(p.to(dtype)), p, scale=p.abs().max()) < 10 * tol
    # Pythagoras
    lhs = f64.inner(xi, xi)
    rhs = f64.inner(p, p) + f64.inner(w, w)
    assert rel(rhs, lhs) < tol
    # horizontal residual (spec §3.1 identities); a raw Gaussian vector is far from horizontal
    assert float(f.horizontal_residual(p.to(dtype))) < 10 * tol
    assert float(f.horizontal_residual(xi.to(dtype))) > 1e-2


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_projector_rank_and_self_adjoint(metric, eps):
    """As a dense matrix the projector has rank (n+m)h − h², is idempotent and metric-self-adjoint."""
    n, m, h = 9, 6, 4
    geom = geometry(metric, eps, n, m, h)
    x = geom.random_point(generator=gen(41), dtype=F64)
    f = geom.frame(x)
    Pm = dense(f.project, x.shape)  # (D, D)
    D = (n + m) * h
    E = torch.eye(D, dtype=F64).reshape(D, n + m, h)
    Mt = f.inner(E[:, None], E[None, :])  # dense metric tensor
    sv = torch.linalg.svdvals(Pm)
    rank = int((sv > 1e-9 * sv[0]).sum())
    assert rank == geom.dim == (n + m) * h - h * h
    assert rel(Pm @ Pm, Pm) < 1e-10
    # metric-orthogonal projector ⇔ M P is symmetric
    MP = Mt @ Pm
    assert rel(MP, MP.T) < 1e-10
    # kernel = vertical space: P kills every vertical vector
    for V in vertical_basis(f, h):
        assert float(f.project(V).abs().max()) < 1e-10 * float(V.abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_inv_projection_matches_scipy_sylvester(seed, dtype):
    """Spec §3.2: A X + X A = B, A = PQ, B = P Hᵀξ_H − ξ_GᵀG Q, Λ = Xᵀ, P_h ξ = (ξ_G + GΛ, ξ_H − HΛᵀ)."""
    geom = geometry("inv")
    x = rounded(geom.random_point(generator=gen(50 + seed), dtype=F64), dtype)
    xi = rounded(randn(x.shape, 60 + seed), dtype)
    G, Hm = (t.numpy() for t in geom.split(x))
    xG, xH = (t.numpy() for t in geom.split(xi))
    P, Q = G.T @ G, Hm.T @ Hm
    A = P @ Q
    B = P @ Hm.T @ xH - xG.T @ G @ Q
    X = scipy.linalg.solve_sylvester(A, A, B)
    Lam = X.T
    ref = np.concatenate((xG + G @ Lam, xH - Hm @ Lam.T), axis=0)
    got = geom.project(x.to(dtype), xi.to(dtype))
    assert rel(got, torch.from_numpy(ref)) < 10 * RTOL[dtype]
    # the printed (misprinted) form A Λ + Λ Aᵀ = B does not give the projection: the test is sharp
    Lw = scipy.linalg.solve_sylvester(A, A.T, B)
    wrong = np.concatenate((xG + G @ Lw, xH - Hm @ Lw.T), axis=0)
    assert rel(torch.from_numpy(wrong), torch.from_numpy(ref)) > 1e-3


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_vertical_generator_matches_dense_solve(metric, eps):
    """Λ from the closed form / eigen-solver against the normal equations over the vertical basis:
    minimise ‖ξ − V(Λ)‖_g, i.e. K λ = r with K_ab = g(V(E_a), V(E_b)), r_a = g(ξ, V(E_a))."""
    geom = geometry(metric, eps)
    x = geom.random_point(generator=gen(71), dtype=F64)
    xi = randn(x.shape, 72)
    f = geom.frame(x)
    basis = vertical_basis(f, H)
    K = torch.stack([torch.stack([f.inner(a, b) for b in basis]) for a in basis])
    r = torch.stack([f.inner(xi, a) for a in basis])
    lam = torch.linalg.solve(K, r).reshape(H, H)
    assert rel(f.vertical_generator(xi), lam) < 1e-9
    assert rel(f.project(xi), xi - f.vertical(lam)) < 1e-10
    if metric == "mix" and eps == 0:
        # closed form of spec §3.2 (code sign: P_h ξ = ξ − (GΛ, −HΛᵀ))
        G, Hm = geom.split(x)
        xG, xH = geom.split(xi)
        lam_cf = 0.5 * (torch.linalg.solve(G.T @ G, G.T @ xG) - xH.T @ Hm @ torch.linalg.inv(Hm.T @ Hm))
        assert rel(lam, lam_cf) < 1e-10


# ---------------------------------------------------------------------------------------------- gradient
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.7], ids=["invariant", "weight_decay"])
def test_rgrad_directional_derivative_and_horizontal(metric, eps, dtype, weight_decay):
    """g(rgrad, ξ) = Df[ξ] (central finite differences of f) for horizontal ξ; rgrad is horizontal,
    for GL-invariant losses and for a non-invariant loss (weight decay) alike."""
    geom = geometry(metric, eps)
    loss = InvariantLoss(N, M, 81, weight_decay)
    x = rounded(geom.random_point(generator=gen(82), dtype=F64), dtype)
    eg = rounded(loss.egrad(x), dtype)
    f = geom.frame(x.to(dtype))
    rg = f.egrad2rgrad(eg.to(dtype))
    assert rg.dtype == dtype
    rg = rg.to(F64)
    f64 = geom.frame(x)
    tol = max(RTOL[dtype], 1e-7)  # finite differences: ~1e-9 relative
    for s in range(3):
        xi = geom.project(x, randn(x.shape, 83 + s))
        lhs = f64.inner(rg, xi)
        fd = loss.directional(x, xi)
        assert abs(float(lhs - fd)) <= tol * float(f64.norm(rg) * f64.norm(xi)), (float(lhs), float(fd))
    assert float(f64.horizontal_residual(rg)) < 10 * RTOL[dtype]


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_rgrad_of_invariant_loss_is_horizontal_before_projection(metric, eps):
    """Spec §4: for an invariant loss Gᵀ∇_G − ∇_HᵀH = 0, the raw lift (∇_G N_G, ∇_H N_H)
    (inv: N = P, Q; mix: N = Q⁻¹, P⁻¹) is already horizontal and equals egrad2rgrad; with weight
    decay the identity and the horizontality of the raw lift fail (so the projection matters)."""
    geom = geometry(metric, eps)
    x = geom.random_point(generator=gen(91), dtype=F64)
    G, Hm = geom.split(x)
    I = torch.eye(H, dtype=F64)
    P, Q = G.T @ G + eps * I, Hm.T @ Hm + eps * I
    NG, NH = (P, Q) if metric == "inv" else (torch.linalg.inv(Q), torch.linalg.inv(P))
    f = geom.frame(x)
    for wd in (0.0, 0.7):
        loss = InvariantLoss(N, M, 92, wd)
        eg = loss.egrad(x)
        gG, gH = geom.split(eg)
        ident = G.T @ gG - gH.T @ Hm
        raw = geom.pack(gG @ NG, gH @ NH)
        rg = f.egrad2rgrad(eg)
        if wd == 0:
            assert float(ident.abs().max()) < 1e-12 * float((G.T @ gG).abs().max())
            assert float(f.horizontal_residual(raw)) < 1e-12
            assert rel(rg, raw) < 1e-12
        else:
            assert float(ident.abs().max()) > 1e-2 * float((G.T @ gG).abs().max())
            assert float(f.horizontal_residual(raw)) > 1e-3
            assert rel(rg, raw) > 1e-3
            assert float(f.horizontal_residual(rg)) < 1e-12


@pytest.mark.parametrize("metric", METRICS)
def test_rgrad_norm_invariant_along_orbit(metric):
    """‖rgrad‖_g of an invariant loss is the same at x and x·A (spec §4), Euclidean norm is not."""
    geom = geometry(metric)
    loss = InvariantLoss(N, M, 101)
    x = geom.random_point(generator=gen(102), dtype=F64)
    A = gaussian_gl(H, 103)
    xa = geom.act(x, A)
    n0 = geom.norm(x, geom.egrad2rgrad(x, loss.egrad(x)))
    n1 = geom.norm(xa, geom.egrad2rgrad(xa, loss.egrad(xa)))
    assert rel(n1, n0) < 1e-10
    e0, e1 = torch.linalg.norm(loss.egrad(x)), torch.linalg.norm(loss.egrad(xa))
    assert rel(e1, e0) > 1e-2


# ---------------------------------------------------------------------------------------------- Christoffel
_BRUTE_CACHE = {}


def brute_force_christoffel(metric, eps, x):
    """Γ^i_kl = ½ g^{im}(∂_l g_mk + ∂_k g_ml − ∂_m g_kl) in flattened coordinates; the metric
    tensor is built densely from `frame.inner` on basis vectors and differentiated by autograd."""
    key = (metric, eps, tuple(x.shape), x.sum().item())
    if key in _BRUTE_CACHE:
        return _BRUTE_CACHE[key]
    geom = GLQuotientGeometry(3, 3, 2, metric, eps=eps)
    shape = x.shape
    D = x.numel()
    E = torch.eye(D, dtype=F64).reshape((D,) + tuple(shape))

    def metric_tensor(z):
        f = geom.frame(z.reshape(shape))
        return f.inner(E[:, None], E[None, :])

    z0 = x.reshape(-1).clone()
    g = metric_tensor(z0)
    dg = torch.autograd.functional.jacobian(metric_tensor, z0)  # dg[a, b, l] = ∂_l g_ab
    ginv = torch.linalg.inv(g)
    Gam = 0.5 * (torch.einsum("im,mkl->ikl", ginv, dg) + torch.einsum("im,mlk->ikl", ginv, dg)
                 - torch.einsum("im,klm->ikl", ginv, dg))
    _BRUTE_CACHE[key] = (g, Gam)
    return g, Gam


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_christoffel_against_brute_force(metric, eps, dtype):
    n, m, h = 3, 3, 2
    geom = GLQuotientGeometry(n, m, h, metric, eps=eps)
    x = rounded(geom.random_point(generator=gen(111), dtype=F64), dtype)
    g, Gam = brute_force_christoffel(metric, eps, x)
    # the dense metric tensor is the one of spec §2: block weights M_G ⊗ I etc. (sanity)
    assert rel(g, g.T) < 1e-14
    f = geom.frame(x.to(dtype))
    for s in range(3):
        u = rounded(randn(x.shape, 112 + s), dtype)
        v = rounded(randn(x.shape, 122 + s), dtype)
        ref_uv = torch.einsum("ikl,k,l->i", Gam, u.reshape(-1), v.reshape(-1)).reshape(x.shape)
        ref_uu = torch.einsum("ikl,k,l->i", Gam, u.reshape(-1), u.reshape(-1)).reshape(x.shape)
        got_uv = f.christoffel(u.to(dtype), v.to(dtype))
        got_uu = f.christoffel(u.to(dtype))
        assert got_uu.dtype == dtype
        assert rel(got_uv, ref_uv) < 1e-9 + RTOL[dtype], rel(got_uv, ref_uv)
        assert rel(got_uu, ref_uu) < 1e-9 + RTOL[dtype], rel(got_uu, ref_uu)
    # the brute-force Γ is not trivially reproduced by a wrong metric: with ε changed it differs
    if eps == 0:
        _, Gam_eps = brute_force_christoffel(metric, 0.3, x)
        assert rel(Gam_eps, Gam) > 1e-3


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_christoffel_symmetry_and_polarisation(metric, eps):
    geom = geometry(metric, eps)
    x = geom.random_point(generator=gen(131), dtype=F64)
    u, v = randn(x.shape, 132), randn(x.shape, 133)
    f = geom.frame(x)
    Guv, Gvu = f.christoffel(u, v), f.christoffel(v, u)
    assert rel(Guv, Gvu) < 1e-13
    pol = 0.25 * (f.christoffel(u + v) - f.christoffel(u - v))
    assert rel(Guv, pol) < 1e-12
    assert rel(f.christoffel(u), f.christoffel(u, u)) < 1e-13
    # bilinear and quadratic: Γ(2u, 3v) = 6Γ(u, v), Γ(−u) = Γ(u)
    assert rel(f.christoffel(2 * u, 3 * v), 6 * Guv) < 1e-13
    assert rel(f.christoffel(-u), f.christoffel(u)) < 1e-14


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_christoffel_metric_compatibility(metric, eps):
    """Levi-Civita: D_u g(v, w) = g(Γ(u, v), w) + g(v, Γ(u, w)) for constant fields v, w (checked
    with central differences of the metric), an independent identity from the brute force."""
    geom = geometry(metric, eps)
    x = geom.random_point(generator=gen(141), dtype=F64)
    u, v, w = randn(x.shape, 142), randn(x.shape, 143), randn(x.shape, 144)
    t = 1e-5
    dg = (geom.inner(x + t * u, v, w) - geom.inner(x - t * u, v, w)) / (2 * t)
    f = geom.frame(x)
    rhs = f.inner(f.christoffel(u, v), w) + f.inner(v, f.christoffel(u, w))
    assert abs(float(dg - rhs)) < 1e-7 * float(f.norm(u) * f.norm(v) * f.norm(w))


# ---------------------------------------------------------------------------------------------- Hessian
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_ehess2rhess_against_covariant_derivative_of_rgrad(metric, eps):
    """Hess f[u] = P_h(∇_u grad f) with ∇_u grad = D grad[u] + Γ(grad, u): D grad[u] by central
    differences of `egrad2rgrad` (invariant loss, so grad is horizontal everywhere)."""
    geom = geometry(metric, eps)
    loss = InvariantLoss(N, M, 151)
    x = geom.random_point(generator=gen(152), dtype=F64)
    u = geom.random_horizontal(x, generator=gen(153))
    f = geom.frame(x)
    t = 1e-5
    dgrad = (geom.egrad2rgrad(x + t * u, loss.egrad(x + t * u))
             - geom.egrad2rgrad(x - t * u, loss.egrad(x - t * u))) / (2 * t)
    rg = f.egrad2rgrad(loss.egrad(x))
    ref = f.project(dgrad + f.christoffel(rg, u))
    got = f.ehess2rhess(loss.egrad(x), loss.ehess(x, u), u)
    assert rel(got, ref) < 1e-7


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.7], ids=["invariant", "weight_decay"])
def test_ehess2rhess_second_derivative_along_exact_geodesic(metric, eps, weight_decay):
    """d²/dt² f(γ(t)) at 0 = g(Hess f[u], u) along the exact geodesic γ̇(0) = u (any smooth f),
    and g(Hess f[u], v) = g(u, Hess f[v]) for horizontal u, v."""
    geom = geometry(metric, eps)
    loss = InvariantLoss(N, M, 161, weight_decay)
    x = geom.random_point(generator=gen(162), dtype=F64)
    f = geom.frame(x)
    eg = loss.egrad(x)
    u = geom.random_horizontal(x, generator=gen(163))
    v = geom.random_horizontal(x, generator=gen(164))
    t = 1e-3
    yp, _ = geom.integrate_geodesic(x, u, t, steps=8)
    ym, _ = geom.integrate_geodesic(x, -u, t, steps=8)
    second = (loss(yp) - 2 * loss(x) + loss(ym)) / t ** 2
    Hu = f.ehess2rhess(eg, loss.ehess(x, u), u)
    Hv = f.ehess2rhess(eg, loss.ehess(x, v), v)
    quad = f.inner(Hu, u)
    scale = float(f.norm(Hu)) + abs(float(second))
    assert abs(float(second - quad)) < 1e-5 * scale, (float(second), float(quad))
    # along the straight line x + tu (not a geodesic) the second derivative is different
    lin = (loss(x + t * u) - 2 * loss(x) + loss(x - t * u)) / t ** 2
    assert abs(float(lin - quad)) > 1e-3 * scale
    assert abs(float(f.inner(Hu, v) - f.inner(u, Hv))) < 1e-10 * float(f.norm(Hu) + f.norm(Hv))
    assert float(f.horizontal_residual(Hu)) < 1e-10


# ---------------------------------------------------------------------------------------------- retractions
def loglog_slope(ts, errs):
    return float(np.polyfit(np.log(ts), np.log(errs), 1)[0])


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.05])
def test_retraction_orders_against_exact_geodesic(metric, eps):
    """‖R(tξ) − γ(t)‖ ~ t³ for second_order and ~ t² for first_order (horizontal unit ξ)."""
    n, m, h = 8, 6, 3
    # t ≤ 0.2 in 100 RK4 steps: a global error ~(t/100)⁴, far below the t³ second-order error
    geom = GLQuotientGeometry(n, m, h, metric, eps=eps, retraction="exact", exact_steps=100)
    x = geom.random_point(generator=gen(171), dtype=F64)
    xi = geom.random_horizontal(x, generator=gen(172))
    f = geom.frame(x)
    ts = np.array([0.2, 0.1, 0.05, 0.025])
    e1, e2, e1p, e2p = [], [], [], []
    for t in ts:
        exact = f.retract(t * xi)  # default method of this geometry: "exact", 100 RK4 steps
        first = f.retract(t * xi, "first_order")
        second = f.retract(t * xi, "second_order")
        e1.append(float(torch.linalg.norm(first - exact)))
        e2.append(float(torch.linalg.norm(second - exact)))
        prod = lambda y: geom.split(y)[0] @ geom.split(y)[1].mT  # noqa: E731
        e1p.append(float(torch.linalg.norm(prod(first) - prod(exact))))
        e2p.append(float(torch.linalg.norm(prod(second) - prod(exact))))
    s1, s2 = loglog_slope(ts, e1), loglog_slope(ts, e2)
    assert abs(s2 - 3) < 0.1, (s2, e2)
    assert abs(s1 - 2) < 0.1, (s1, e1)
    # the same orders on the invariant G Hᵀ
    assert abs(loglog_slope(ts, e2p) - 3) < 0.1
    assert abs(loglog_slope(ts, e1p) - 2) < 0.1
    # the exact retraction is converged: halving its step count changes nothing visible
    half, _ = geom.integrate_geodesic(x, ts[-1] * xi, steps=50)
    assert float(torch.linalg.norm(half - f.retract(ts[-1] * xi))) < 1e-3 * e2[-1]


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_exact_geodesic_speed_constant_and_horizontal(metric, eps):
    """Along γ̈ + Γ(γ̇, γ̇) = 0: ‖γ̇‖_g is constant (any ε); a horizontal start stays horizontal
    (ε = 0: vertical fields are Killing fields of an invariant metric)."""
    geom = geometry(metric, eps)
    x = geom.random_point(generator=gen(181), dtype=F64)
    u = 0.6 * geom.random_horizontal(x, generator=gen(182))
    speed0 = float(geom.norm(x, u))
    residuals = []
    for t in (0.25, 0.5, 1.0):
        y, vel = geom.integrate_geodesic(x, u, t, steps=int(200 * t))
        fy = geom.frame(y)
        assert abs(float(fy.norm(vel)) - speed0) < 1e-9 * speed0
        residuals.append(float(fy.horizontal_residual(vel)))
        # the end point differs from x + tu: the ODE does something
        assert float(torch.linalg.norm(y - (x + t * u))) > 1e-4
    if eps == 0:
        assert max(residuals) < 1e-10
    else:
        # with the relaxed (non-invariant) metric horizontality is not conserved: the check is sharp
        assert max(residuals) > 1e-6


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("method", RETRACTIONS)
@pytest.mark.parametrize("kind", ["gaussian", "cond1e4"])
def test_retractions_equivariant(metric, method, kind):
    """retract(x·A, u·A) = retract(x, u)·A, so the loss at the perturbed point is invariant."""
    geom = geometry(metric, retraction=method)
    loss = InvariantLoss(N, M, 191)
    x = well_conditioned_point(N, M, H, 192)
    u = 0.3 * geom.random_horizontal(x, generator=gen(193))
    y = geom.retract(x, u)
    base = ill_conditioned(H, 1e4, 194) if kind == "cond1e4" else gaussian_gl(H, 194)
    tol = 1e-7 if kind == "cond1e4" else 1e-11
    for a in (1e-2, 1.0, 1e2):
        A = a * base
        ya = geom.retract(geom.act(x, A), geom.act(u, A))
        ref = geom.act(y, A)
        Gr, Hr = geom.split(ref)
        Ga, Ha = geom.split(ya)
        assert fro_rel(Ga, Gr) < tol and fro_rel(Ha, Hr) < tol, (a, fro_rel(Ga, Gr), fro_rel(Ha, Hr))
        assert rel(loss(ya), loss(y)) < tol
    assert rel(loss(y), loss(x)) > 1e-4  # the step moved the loss


# ---------------------------------------------------------------------------------------------- balance
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_balance(dtype):
    geom = geometry("inv")
    x = rounded(geom.random_point(4, generator=gen(201), dtype=F64), dtype)
    # make it unbalanced
    x = geom.act(x, torch.diag(torch.tensor([10.0, 1.0, 0.1], dtype=F64))).to(dtype)
    xb, A = geom.balance(x)
    assert xb.shape == x.shape and A.shape == (4, H, H)
    xb, A, x64 = xb.to(F64), A.to(F64), x.to(F64)
    G, Hm = geom.split(xb)
    G0, H0 = geom.split(x64)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    assert rel(G.mT @ G, Hm.mT @ Hm) < tol
    assert rel(G @ Hm.mT, G0 @ H0.mT) < tol
    assert rel(geom.act(x64, A), xb) < tol
    # x was not balanced before
    assert rel(G0.mT @ G0, H0.mT @ H0) > 1e-1


# ---------------------------------------------------------------------------------------------- errors
def test_errors_shapes_and_dimensions():
    geom = geometry("mix")
    expected = re.escape("(..., n+m, h) = (..., 12, 3)")
    with pytest.raises(InvalidArgument, match=expected):
        geom.frame(torch.randn(11, 3, dtype=F64))
    with pytest.raises(InvalidArgument, match=expected):
        geom.frame(torch.randn(12, 4, dtype=F64))
    with pytest.raises(InvalidArgument, match=expected):
        geom.frame(torch.randn(12, dtype=F64))
    x = geom.random_point(dtype=F64)
    f = geom.frame(x)
    for bad in (torch.randn(13, 3, dtype=F64), torch.randn(12, 2, dtype=F64)):
        for call in (f.project, f.inner, f.christoffel, f.retract, f.egrad2rgrad, f.horizontal_residual):
            with pytest.raises(InvalidArgument, match=expected):
                call(bad)
    with pytest.raises(InvalidArgument, match="h = 4 exceeds n = 3"):
        GLQuotientGeometry(3, 5, 4)
    with pytest.raises(InvalidArgument, match="h = 4 exceeds n = 5 or m = 3"):
        GLQuotientGeometry(5, 3, 4)
    for bad_int in (0, -1, 2.0):
        with pytest.raises(InvalidArgument, match="positive integer"):
            GLQuotientGeometry(5, 5, bad_int)
    for bad_eps in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="eps must be a finite number"):
            GLQuotientGeometry(5, 5, 2, eps=bad_eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("which", ["G", "H"])
def test_errors_rank_deficient_needs_eps(which, dtype):
    geom = geometry("inv")
    for construction in ("duplicate_column", "low_rank_product"):
        x = geom.random_point(generator=gen(211), dtype=F64)
        G, Hm = geom.split(x.clone())
        target = G if which == "G" else Hm
        if construction == "duplicate_column":
            target[:, 1] = target[:, 0]
        else:  # exactly rank h−1 in float64, then rounded to dtype
            target.copy_(randn((target.shape[0], H - 1), 212) @ randn((H - 1, H), 213))
        bad = geom.pack(G, Hm).to(dtype)
        with pytest.raises(InvalidArgument, match=f"{which} is rank-deficient.*pass a relaxation eps > 0"):
            geom.frame(bad)
        # the advice works: with eps > 0 the frame is built and projection is finite
        ok = geometry("inv", eps=1e-6).frame(bad)
        assert bool(torch.isfinite(ok.project(torch.ones_like(bad))).all())
    # batch index reported
    xb = geom.random_point(3, generator=gen(214), dtype=F64)
    xb[2, :, 1] = xb[2, :, 0]
    with pytest.raises(InvalidArgument, match=re.escape("at batch index (2,)")):
        geom.frame(xb.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ill_conditioned_but_full_rank_point_is_accepted(dtype):
    """cond(G) ≈ 1e4·cond(G₀) is far from rank-deficient at float32 precision (1/eps ≈ 8e6); the
    core computes in float64, so such a point must be accepted (regression: float32 was rejected)."""
    geom = geometry("inv")
    x = geom.act(well_conditioned_point(N, M, H, 215), ill_conditioned(H, 1e4, 216)).to(dtype)
    f = geom.frame(x)
    u = f.project(randn(x.shape, 217).to(dtype))
    # float32 storage of a vector with entries up to ~5e7: 0.8e-4 here, 1.0e-4 with torch 2.11's BLAS
    assert float(f.horizontal_residual(u)) < 3e-4


def test_errors_nonfinite_and_unknown_names():
    geom = geometry("inv")
    x = geom.random_point(dtype=F64)
    for val in (float("nan"), float("inf")):
        y = x.clone()
        y[0, 0] = val
        with pytest.raises(InvalidArgument, match="non-finite"):
            geom.frame(y)
    with pytest.raises(InvalidArgument, match="metric must be one of 'inv', 'mix', got 'euclid'"):
        GLQuotientGeometry(5, 5, 2, "euclid")
    msg = "retraction must be one of 'first_order', 'second_order', 'exact', got 'cayley'"
    with pytest.raises(InvalidArgument, match=msg):
        GLQuotientGeometry(5, 5, 2, retraction="cayley")
    with pytest.raises(InvalidArgument, match=msg):
        geom.retract(x, torch.zeros_like(x), "cayley")
    with pytest.raises(InvalidArgument, match="floating point"):
        geom.frame(torch.ones(12, 3, dtype=torch.int64))


@pytest.mark.parametrize("metric", METRICS)
def test_metric_object_is_the_metric_of_its_name(metric):
    """metric= takes the name or the object; the geometry keeps the name in ``metric`` and the object
    in ``gl_metric``, and both give the same numbers, bit for bit."""
    obj = as_metric(metric)
    assert isinstance(obj, GLMetric) and obj.name == metric and as_metric(obj) is obj
    assert type(obj) is {"inv": InvMetric, "mix": MixMetric}[metric]
    by_name, by_object = GLQuotientGeometry(N, M, H, metric, eps=0.3), GLQuotientGeometry(N, M, H, obj, eps=0.3)
    assert by_object.metric == metric and by_object.gl_metric is obj and repr(by_object) == repr(by_name)
    x = by_name.random_point(2, dtype=F64, generator=gen(230))
    u, v = randn(x.shape, 231), randn(x.shape, 232)
    f, g = by_name.frame(x), by_object.frame(x)
    assert f.metric == metric and f.gl_metric is obj
    for name, args in (("inner", (u, v)), ("project", (u,)), ("egrad2rgrad", (u,)), ("christoffel", (u, v)),
                       ("ehess2rhess", (u, v, f.project(u))), ("retract", (0.1 * f.project(u),))):
        assert torch.equal(getattr(f, name)(*args), getattr(g, name)(*args)), name


# ---------------------------------------------------------------------------------------------- batching
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", EPS_VALUES)
def test_batched_equals_per_element(metric, eps):
    geom = geometry(metric, eps)
    loss = InvariantLoss(N, M, 221, weight_decay=0.3)
    X = geom.random_point(4, generator=gen(222), dtype=F64)
    U, V = randn(X.shape, 223), randn(X.shape, 224)
    fb = geom.frame(X)
    EG = loss.egrad(X)
    UH = fb.project(U)
    EH = loss.ehess(X, UH)
    batched = {
        "inner": fb.inner(U, V), "project": fb.project(U), "christoffel": fb.christoffel(U, V),
        "christoffel_uu": fb.christoffel(U), "lam": fb.vertical_generator(U),
        "rgrad": fb.egrad2rgrad(EG), "rhess": fb.ehess2rhess(EG, EH, UH),
        "hres": fb.horizontal_residual(U), "balance": geom.balance(X)[0],
        **{m_: fb.retract(0.3 * UH, m_) for m_ in RETRACTIONS},
    }
    for i in range(4):
        f = geom.frame(X[i])
        single = {
            "inner": f.inner(U[i], V[i]), "project": f.project(U[i]),
            "christoffel": f.christoffel(U[i], V[i]), "christoffel_uu": f.christoffel(U[i]),
            "lam": f.vertical_generator(U[i]), "rgrad": f.egrad2rgrad(EG[i]),
            "rhess": f.ehess2rhess(EG[i], EH[i], UH[i]), "hres": f.horizontal_residual(U[i]),
            "balance": geom.balance(X[i])[0],
            **{m_: f.retract(0.3 * UH[i], m_) for m_ in RETRACTIONS},
        }
        for k, val in single.items():
            assert batched[k][i].shape == val.shape, k
            assert rel(batched[k][i], val, scale=val.abs().max() + 1e-300) < 1e-12, k
    # a single point broadcast against a stack of tangent vectors
    f0 = geom.frame(X[0])
    assert rel(f0.project(U)[3], f0.project(U[3])) < 1e-12


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frame_keeping_the_point_in_its_dtype_gives_the_same_numbers(metric, dtype):
    """``keep_dtype=True`` stores x in its own dtype and promotes it where used: every method gives
    the numbers of a frame built on the float64 copy of the same point, bit for bit (promotion is
    exact), and the frame holds no float64 copy of x."""
    gen = torch.Generator().manual_seed(3)
    geom = GLQuotientGeometry(6, 5, 2, metric)
    x = torch.randn(4, 11, 2, generator=gen).to(dtype)
    lean, full = geom.frame(x, keep_dtype=True), geom.frame(x.double())
    assert lean._x.dtype == dtype and lean._x.data_ptr() == x.data_ptr()
    u = torch.randn(4, 11, 2, dtype=torch.float64, generator=gen)
    e = torch.randn(4, 11, 2, dtype=torch.float64, generator=gen)
    h = full.project(u)
    assert torch.equal(lean.x, full.x) and torch.equal(lean.G, full.G) and torch.equal(lean.H, full.H)
    assert torch.equal(lean.project(u), h)
    assert torch.equal(lean.egrad2rgrad(e), full.egrad2rgrad(e))
    assert torch.equal(lean.inner(h, h), full.inner(h, h))
    assert torch.equal(lean.christoffel(h), full.christoffel(h))
    for method in ("first_order", "second_order", "exact"):
        assert torch.equal(lean.retract(0.1 * h, method), full.retract(0.1 * h, method))
    u32 = (0.1 * h).float().requires_grad_()
    y = lean.retract(u32)  # the engine's case: float32 iterates, the point in the weights' dtype
    assert y.dtype == torch.promote_types(dtype, torch.float32)
    (g,) = torch.autograd.grad(y.double().square().sum(), u32)
    (want,) = torch.autograd.grad(full.retract(u32).double().square().sum(), u32)
    torch.testing.assert_close(g, want.to(g.dtype), rtol=1e-5, atol=1e-7)  # y rounded to float32
    with pytest.raises(InvalidArgumentType, match="keep_dtype must be True or False"):
        geom.frame(x, keep_dtype="yes")
