r"""The rescaling quotient of diagonal networks (`quotient_manifolds.core.rescaling`, spec §8).

* metric, projection and Christoffel map against the per-coordinate formulas of spec §8.1–8.2, written
  out here (extended to the ε-relaxed metric u² + ε, and checked against autograd brute force);
* the closed-form geodesics (§8.3) against `scipy.integrate.solve_ivp` on the 2-D per-coordinate
  geodesic ODE built from those Christoffels (not from the library);
* `beta_along_geodesic`, the exact norms of §8.4 and the errors of the mix geodesic;
* the diagonal-net sharpness formulas of §8.5 (XᵀX = I) against numerical maximisation, and against
  the reference numbers of spec §8.5 / `verify/diag_out.txt` (same random data, regenerated here).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp
from scipy.optimize import minimize

from quotient_manifolds.core import RETRACTIONS, RescalingGeometry
# the closed forms of the diagonal study live with it
from quotient_manifolds.experiments.closed_forms import (
    beta_along_geodesic,
    sharpness_inv_orthonormal_second_order,
    sharpness_mix_orthonormal,
)
from quotient_manifolds.errors import GeodesicLeftManifold, InvalidArgument

F64 = torch.float64
DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["f64", "f32"]
RTOL = {torch.float64: 1e-12, torch.float32: 2e-6}
METRICS = ("inv", "mix")
D_COORD = 6


pytestmark = pytest.mark.usefixtures("single_thread")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def point(d, seed, batch=()):
    """(u, v) with entries of modulus in [0.4, 2] and random signs (away from the singular set)."""
    g = gen(seed)
    mag = 0.4 + 1.6 * torch.rand(batch + (2, d), dtype=F64, generator=g)
    sign = torch.where(torch.rand(batch + (2, d), dtype=F64, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(F64)


def randn(shape, seed):
    return torch.randn(shape, dtype=F64, generator=gen(seed))


def rounded(t, dtype):
    return t.to(dtype).to(F64)


def rel(a, b):
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    return float((a - b).abs().max() / b.abs().max())


# ------------------------------------------------------------------- explicit per-coordinate formulas
def weights(metric, x, eps):
    """Diagonal metric weights (m_u, m_v) per coordinate: spec §8.1 with u² → u² + ε."""
    u, v = x[..., 0, :], x[..., 1, :]
    if metric == "inv":
        return 1 / (u ** 2 + eps), 1 / (v ** 2 + eps)
    return v ** 2 + eps, u ** 2 + eps


def metric_ref(metric, x, p, q, eps=0.0):
    mu, mv = weights(metric, x, eps)
    return (mu * p[..., 0, :] * q[..., 0, :] + mv * p[..., 1, :] * q[..., 1, :]).sum(-1)


def project_ref(metric, x, p, eps=0.0):
    """Remove the metric-orthogonal component along the vertical direction (u, −v):
    λ = (m_u u ξ_u − m_v v ξ_v)/(m_u u² + m_v v²), P ξ = ξ − λ(u, −v). For ε = 0 this is
    ξ_u/u = ξ_v/v = ½(ξ_u/u + ξ_v/v) (spec §8.1, both metrics)."""
    u, v = x[..., 0, :], x[..., 1, :]
    mu, mv = weights(metric, x, eps)
    lam = (mu * u * p[..., 0, :] - mv * v * p[..., 1, :]) / (mu * u ** 2 + mv * v ** 2)
    return torch.stack((p[..., 0, :] - lam * u, p[..., 1, :] + lam * v), dim=-2)


def gamma_ref(metric, x, p, q, eps=0.0):
    """Γ(p, q) per coordinate from the Christoffels of spec §8.2 (ε-relaxed):
    inv: Γ^u_uu = −u/(u²+ε), Γ^v_vv = −v/(v²+ε);
    mix: Γ^u_uv = v/(v²+ε), Γ^u_vv = −u/(v²+ε), Γ^v_uv = u/(u²+ε), Γ^v_uu = −v/(u²+ε)."""
    u, v = x[..., 0, :], x[..., 1, :]
    pu, pv, qu, qv = p[..., 0, :], p[..., 1, :], q[..., 0, :], q[..., 1, :]
    if metric == "inv":
        gu = -u / (u ** 2 + eps) * pu * qu
        gv = -v / (v ** 2 + eps) * pv * qv
    else:
        cross = pu * qv + pv * qu
        gu = v / (v ** 2 + eps) * cross - u / (v ** 2 + eps) * pv * qv
        gv = u / (u ** 2 + eps) * cross - v / (u ** 2 + eps) * pu * qu
    return torch.stack((gu, gv), dim=-2)


def accel_spec(metric, u, v, du, dv):
    """γ̈ = −Γ(γ̇, γ̇) for one coordinate pair, ε = 0 (spec §8.2)."""
    if metric == "inv":
        return du ** 2 / u, dv ** 2 / v
    return (-2 * du * dv / v + u * dv ** 2 / v ** 2, -2 * du * dv / u + v * du ** 2 / u ** 2)


def ode_endpoint(metric, x, xi, t, eps=0.0):
    """solve_ivp (DOP853, tight tolerances) on the per-coordinate geodesic ODE."""
    x, xi = x.numpy(), xi.numpy()
    d = x.shape[-1]

    def rhs(_t, s):
        u, v, du, dv = s[:d], s[d:2 * d], s[2 * d:3 * d], s[3 * d:]
        if eps == 0:
            au, av = accel_spec(metric, u, v, du, dv)
        else:
            g = -gamma_ref(metric, torch.from_numpy(np.stack((u, v))),
                           torch.from_numpy(np.stack((du, dv))),
                           torch.from_numpy(np.stack((du, dv))), eps).numpy()
            au, av = g[0], g[1]
        return np.concatenate((du, dv, au, av))

    s0 = np.concatenate((x[0], x[1], xi[0], xi[1]))
    sol = solve_ivp(rhs, (0.0, t), s0, method="DOP853", rtol=1e-12, atol=1e-13)
    assert sol.success
    return torch.from_numpy(np.stack((sol.y[:d, -1], sol.y[d:2 * d, -1])))


# ------------------------------------------------------------------- metric / projection / Γ
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_metric_projection_christoffel_match_coordinate_formulas(metric, eps, dtype):
    geom = RescalingGeometry(D_COORD, metric, eps=eps)
    x = rounded(point(D_COORD, 1), dtype)
    p, q = rounded(randn(x.shape, 2), dtype), rounded(randn(x.shape, 3), dtype)
    f = geom.frame(x.to(dtype))
    tol = RTOL[dtype]
    assert rel(f.inner(p.to(dtype), q.to(dtype)), metric_ref(metric, x, p, q, eps)) < tol
    assert rel(f.norm(p.to(dtype)) ** 2, metric_ref(metric, x, p, p, eps)) < 3 * tol
    proj = f.project(p.to(dtype))
    assert proj.dtype == dtype and proj.shape == p.shape
    assert rel(proj, project_ref(metric, x, p, eps)) < 10 * tol
    assert rel(f.christoffel(p.to(dtype), q.to(dtype)), gamma_ref(metric, x, p, q, eps)) < 10 * tol
    assert rel(f.christoffel(p.to(dtype)), gamma_ref(metric, x, p, p, eps)) < 10 * tol
    if eps == 0:  # horizontal: ξ_u/u = ξ_v/v
        P = proj.to(F64)
        assert rel(P[0] / x[0], P[1] / x[1]) < 10 * tol


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_coordinate_christoffels_are_levi_civita(metric, eps):
    """The test's own per-coordinate Christoffels (and so the library's) agree with
    Γ^i_kl = ½ g^{im}(∂_l g_mk + ∂_k g_ml − ∂_m g_kl) of the 2×2 metric, autograd in float64."""
    x0 = point(1, 5)[:, 0]  # one coordinate pair (u, v)

    def g(z):
        mu, mv = weights(metric, z.reshape(2, 1), eps)
        return torch.diag(torch.cat((mu, mv)))

    dg = torch.autograd.functional.jacobian(g, x0)
    ginv = torch.linalg.inv(g(x0))
    Gam = 0.5 * (torch.einsum("im,mkl->ikl", ginv, dg) + torch.einsum("im,mlk->ikl", ginv, dg)
                 - torch.einsum("im,klm->ikl", ginv, dg))
    p, q = randn((2,), 6), randn((2,), 7)
    brute = torch.einsum("ikl,k,l->i", Gam, p, q)
    geom = RescalingGeometry(1, metric, eps=eps)
    lib = geom.christoffel(x0.reshape(2, 1), p.reshape(2, 1), q.reshape(2, 1)).reshape(2)
    ref = gamma_ref(metric, x0.reshape(2, 1), p.reshape(2, 1), q.reshape(2, 1), eps).reshape(2)
    assert rel(ref, brute) < 1e-13
    assert rel(lib, brute) < 1e-13


@pytest.mark.parametrize("metric", METRICS)
def test_metric_invariant_under_rescaling_action(metric):
    geom = RescalingGeometry(D_COORD, metric)
    x = point(D_COORD, 8)
    p, q = randn(x.shape, 9), randn(x.shape, 10)
    for scale in (1e-2, 1.0, 1e2):
        a = scale * (0.5 + torch.rand(D_COORD, dtype=F64, generator=gen(11)))
        g0 = geom.inner(x, p, q)
        g1 = geom.inner(geom.act(x, a), geom.act(p, a), geom.act(q, a))
        assert abs(float(g1 - g0)) < 1e-12 * float(geom.norm(x, p) * geom.norm(x, q))
        e0, e1 = (p * q).sum(), (geom.act(p, a) * geom.act(q, a)).sum()
        assert abs(float(e1 - e0)) > 1e-3 * abs(float(e0))
        assert rel(geom.beta(geom.act(x, a)), geom.beta(x)) < 1e-14


@pytest.mark.parametrize("metric", METRICS)
def test_exact_norms_of_horizontal_vectors(metric):
    """Spec §8.4: ‖(b⊙u, b⊙v)‖² = 2‖b‖² (inv) and 2‖β₀⊙b‖² (mix)."""
    geom = RescalingGeometry(D_COORD, metric)
    x = point(D_COORD, 12)
    b = randn((D_COORD,), 13)
    f = geom.frame(x)
    xi = f.horizontal_lift(b)
    expected = 2 * (b ** 2).sum() if metric == "inv" else 2 * ((geom.beta(x) * b) ** 2).sum()
    assert rel(f.inner(xi, xi), expected) < 1e-13
    assert rel(f.project(xi), xi) < 1e-13
    assert rel(f.horizontal_coefficient(xi), b) < 1e-14


# ------------------------------------------------------------------- geodesics
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("t", [0.4, 1.0])
def test_closed_form_geodesic_matches_ode(metric, t):
    """inv: any ξ; mix: horizontal ξ = (b⊙u, b⊙v) with 1 + 2bt > 0."""
    geom = RescalingGeometry(D_COORD, metric)
    x = point(D_COORD, 21)
    if metric == "inv":
        xi = 0.7 * randn(x.shape, 22)  # not horizontal
    else:
        b = -0.4 + 0.9 * torch.rand(D_COORD, dtype=F64, generator=gen(22))
        xi = x * b
    closed = geom.exact_geodesic(x, xi, t)
    ode = ode_endpoint(metric, x, xi, t)
    assert rel(closed, ode) < 1e-10
    # the exact retraction uses the closed form at t = 1
    if t == 1.0:
        assert rel(geom.retract(x, xi, "exact"), ode) < 1e-10
    # the geodesic really curves (the check would fail for the straight line x + tξ)
    assert rel(x + t * xi, ode) > 1e-3


@pytest.mark.parametrize("metric", METRICS)
def test_relaxed_exact_retraction_matches_ode(metric):
    """ε > 0: the exact retraction integrates the relaxed geodesic (no closed form)."""
    eps = 0.1
    geom = RescalingGeometry(D_COORD, metric, eps=eps, retraction="exact", exact_steps=200)
    x = point(D_COORD, 23)
    xi = 0.5 * randn(x.shape, 24)
    ode = ode_endpoint(metric, x, xi, 1.0, eps)
    assert rel(geom.retract(x, xi), ode) < 1e-9
    assert rel(ode_endpoint(metric, x, xi, 1.0), ode) > 1e-4  # ε really changes the geodesic


@pytest.mark.parametrize("metric", METRICS)
def test_beta_along_geodesic(metric):
    geom = RescalingGeometry(D_COORD, metric)
    x = point(D_COORD, 31)
    b = -0.3 + 0.7 * torch.rand(D_COORD, dtype=F64, generator=gen(32))
    xi = x * b
    beta0 = geom.beta(x)
    for t in (0.25, 0.5, 1.0):
        along = geom.beta(geom.exact_geodesic(x, xi, t))
        assert rel(beta_along_geodesic(beta0, b, metric, t), along) < 1e-14
        assert rel(beta_along_geodesic(beta0, b, metric, t), geom.beta(ode_endpoint(metric, x, xi, t))) < 1e-10
    # the mix β(t) is the polynomial β₀(1 + 2bt), also past the end of the geodesic
    if metric == "mix":
        assert rel(beta_along_geodesic(beta0, b, "mix", 10.0), beta0 * (1 + 20 * b)) < 1e-15
    with pytest.raises(InvalidArgument, match="metric must be one of 'inv', 'mix', got 'adaptive'"):
        beta_along_geodesic(beta0, b, "adaptive")


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("method", RETRACTIONS)
def test_rescaling_retractions_equivariant(metric, method):
    geom = RescalingGeometry(D_COORD, metric, retraction=method)
    x = point(D_COORD, 33)
    xi = 0.3 * geom.random_horizontal(x, generator=gen(34))
    a = 10 ** (4 * torch.rand(D_COORD, dtype=F64, generator=gen(35)) - 2)  # scales 1e-2 … 1e2
    y = geom.retract(x, xi)
    ya = geom.retract(geom.act(x, a), geom.act(xi, a))
    assert rel(ya, geom.act(y, a)) < 1e-12
    assert rel(geom.beta(ya), geom.beta(y)) < 1e-12


def test_mix_geodesic_errors():
    geom = RescalingGeometry(D_COORD, "mix")
    x = point(D_COORD, 41)
    b = 0.2 * torch.ones(D_COORD, dtype=F64)
    with pytest.raises(InvalidArgument, match="needs a horizontal tangent vector.*project"):
        geom.exact_geodesic(x, x * b + 0.1 * randn(x.shape, 42))
    bad = b.clone()
    bad[2] = -0.6  # 1 + 2b = −0.2
    with pytest.raises(GeodesicLeftManifold, match=re.escape("1 + 2b ≤ 0")):
        geom.exact_geodesic(x, x * bad)
    with pytest.raises(GeodesicLeftManifold, match=re.escape("1 + 2b ≤ 0")):
        geom.retract(x, x * bad, "exact")
    # inside the domain at a shorter time is fine
    assert bool(torch.isfinite(geom.exact_geodesic(x, x * bad, t=0.5)).all())


def test_rescaling_input_errors():
    geom = RescalingGeometry(D_COORD, "inv")
    with pytest.raises(InvalidArgument, match=re.escape("expected (..., 2, d) = (..., 2, 6)")):
        geom.frame(torch.ones(3, D_COORD, dtype=F64))
    x = point(D_COORD, 43)
    x[1, 3] = 0.0
    with pytest.raises(InvalidArgument, match=r"zero entry at index \[1, 3\].*pass eps > 0"):
        geom.frame(x)
    assert bool(torch.isfinite(RescalingGeometry(D_COORD, "inv", eps=1e-3).frame(x).project(x)).all())
    x[1, 3] = float("nan")
    with pytest.raises(InvalidArgument, match="non-finite"):
        geom.frame(x)
    with pytest.raises(InvalidArgument, match="metric must be one of 'inv', 'mix', got 'euclid'"):
        RescalingGeometry(D_COORD, "euclid")
    with pytest.raises(InvalidArgument, match="must be one of 'first_order', 'second_order', 'exact'"):
        RescalingGeometry(D_COORD, retraction="newton")
    with pytest.raises(InvalidArgument, match="positive integer"):
        RescalingGeometry(0)


@pytest.mark.parametrize("metric", METRICS)
def test_rescaling_batched_equals_per_element(metric):
    geom = RescalingGeometry(D_COORD, metric)
    X = point(D_COORD, 51, batch=(3,))
    P = randn(X.shape, 52)
    fb = geom.frame(X)
    XiH = 0.2 * fb.project(P)
    out = {"inner": fb.inner(P), "project": fb.project(P), "gamma": fb.christoffel(P),
           **{m: fb.retract(XiH, m) for m in RETRACTIONS}}
    for i in range(3):
        f = geom.frame(X[i])
        single = {"inner": f.inner(P[i]), "project": f.project(P[i]), "gamma": f.christoffel(P[i]),
                  **{m: f.retract(XiH[i], m) for m in RETRACTIONS}}
        for k, v in single.items():
            assert rel(out[k][i], v) < 1e-13, k


# ------------------------------------------------------------------- sharpness, XᵀX = I
def spec_instance():
    """The data of `verify/verify_diag.py` (check_diag_sharpness), regenerated with the same RNG
    calls: d = 20, n = 40, orthonormal X (QR), β* 90%-sparse, β₀ = β* + 0.05 noise."""
    rng = np.random.default_rng(1)
    d, n = 20, 40
    X, _ = np.linalg.qr(rng.standard_normal((n, d)))
    beta_star = np.zeros(d)
    beta_star[:2] = rng.standard_normal(2) * 2
    y = X @ beta_star + 0.0 * rng.standard_normal(n)
    bstar = X.T @ y
    beta0 = bstar + 0.05 * rng.standard_normal(d)
    return X, y, bstar, beta0


def other_instance(seed=7, d=30, n=50):
    rng = np.random.default_rng(seed)
    X, _ = np.linalg.qr(rng.standard_normal((n, d)))
    beta_star = np.zeros(d)
    beta_star[rng.choice(d, d // 10, replace=False)] = 2 * rng.standard_normal(d // 10)
    y = X @ beta_star + 0.1 * rng.standard_normal(n)
    bstar = X.T @ y  # least-squares solution (XᵀX = I)
    beta0 = bstar + 0.1 * rng.standard_normal(d)
    return X, y, bstar, beta0


def maximise_on_ball(F, J, d, R, seed=0, restarts=16, iters=600, starts=()):
    """max F(z) over ‖z‖ ≤ R: normalised projected gradient ascent from random starts (vectorised
    over restarts, step halving), then an SLSQP polish of the best candidates (bounds keep it in the
    box, so exponentials cannot overflow)."""
    rng = np.random.default_rng(seed)
    Z = rng.standard_normal((restarts, d))
    Z *= R / np.linalg.norm(Z, axis=1, keepdims=True)
    if len(starts):
        Z = np.concatenate((Z, np.asarray(starts).reshape(-1, d)))
    step = R
    best_vals = np.full(len(Z), -np.inf)
    best_pts = Z.copy()
    for it in range(iters):
        vals = np.array([F(z) for z in Z])
        better = vals > best_vals
        best_vals[better], best_pts[better] = vals[better], Z[better]
        G = np.stack([J(z) for z in Z])
        Z = Z + step * G / (np.linalg.norm(G, axis=1, keepdims=True) + 1e-300)
        nz = np.linalg.norm(Z, axis=1, keepdims=True)
        Z = np.where(nz > R, Z * R / nz, Z)
        if it % 60 == 59:
            step *= 0.5
    best = best_vals.max()
    for z0 in best_pts[np.argsort(best_vals)[-3:]]:
        out = minimize(lambda z: -F(z), z0, jac=lambda z: -J(z), method="SLSQP",
                       bounds=[(-R, R)] * d,
                       constraints=[{"type": "ineq", "fun": lambda z: R ** 2 - z @ z,
                                     "jac": lambda z: -2 * z}],
                       options={"ftol": 1e-15, "maxiter": 300})
        if out.x @ out.x <= R ** 2 * (1 + 1e-9):
            best = max(best, -out.fun)
    return float(best)


def loss(X, y, beta):
    r = X @ beta - y
    return float(r @ r)


def numerical_mix_sharpness(X, y, beta0, rho):
    """max L(β₀⊙(1+2b)) − L(β₀) over √2‖β₀⊙b‖ ≤ ρ, in the variable δ = β₀⊙b (b = δ/β₀)."""
    L0 = loss(X, y, beta0)

    def F(delta):
        return loss(X, y, beta0 * (1 + 2 * delta / beta0)) - L0

    def J(delta):
        return 4 * X.T @ (X @ (beta0 * (1 + 2 * delta / beta0)) - y)

    return maximise_on_ball(F, J, len(beta0), rho / math.sqrt(2))


def numerical_trs(beta0, bstar, rho):
    """max 4bᵀr + 4bᵀDb over ‖b‖ ≤ ρ/√2 (spec §8.5, paper Eq. 26)."""
    r = beta0 * (beta0 - bstar)
    D = beta0 * (2 * beta0 - bstar)
    return maximise_on_ball(lambda b: 4 * b @ r + 4 * b @ (D * b), lambda b: 4 * r + 8 * D * b,
                            len(beta0), rho / math.sqrt(2))


def exact_inv_objective(beta0, bstar):
    def F(b):
        return float(np.sum(beta0 ** 2 * np.expm1(4 * b) - 2 * beta0 * bstar * np.expm1(2 * b)))

    def J(b):
        return 4 * beta0 ** 2 * np.exp(4 * b) - 4 * beta0 * bstar * np.exp(2 * b)

    return F, J


def numerical_inv_sharpness(beta0, bstar, rho):
    F, J = exact_inv_objective(beta0, bstar)
    return maximise_on_ball(F, J, len(beta0), rho / math.sqrt(2))


def as_t(a):
    return torch.as_tensor(a, dtype=F64)


def test_sharpness_reproduces_spec_table():
    """Spec §8.5 / verify/diag_out.txt [D2], [D3] (printed to 7 significant digits)."""
    X, y, bstar, beta0 = spec_instance()
    assert np.allclose(X.T @ X, np.eye(20), atol=1e-13)
    table_trs = {0.01: 1.183469e-03, 0.03: 4.945390e-03, 0.10: 4.238723e-02}
    table_mix = {0.01: 8.253025e-03, 0.03: 2.595907e-02, 0.10: 1.005302e-01}
    for rho in (0.01, 0.03, 0.1):
        assert abs(float(sharpness_inv_orthonormal_second_order(as_t(beta0), as_t(bstar), rho))
                   / table_trs[rho] - 1) < 1e-6
        assert abs(float(sharpness_mix_orthonormal(as_t(beta0), as_t(bstar), rho)) / table_mix[rho] - 1) < 1e-6
    # r = 0 (β₀ = β*): 2ρ² max β₀² (hard case of the trust-region problem)
    assert abs(float(sharpness_inv_orthonormal_second_order(as_t(bstar), as_t(bstar), 0.01))
               / 3.891792e-04 - 1) < 1e-6


@pytest.mark.parametrize("instance", ["spec", "other"])
def test_mix_sharpness_closed_form_vs_numerical(instance):
    X, y, bstar, beta0 = spec_instance() if instance == "spec" else other_instance()
    for rho in (0.01, 0.1, 0.5):
        cf = float(sharpness_mix_orthonormal(as_t(beta0), as_t(bstar), rho))
        num = numerical_mix_sharpness(X, y, beta0, rho)
        assert abs(cf - num) <= 1e-4 * abs(num), (rho, cf, num)
    # batched over leading dims
    two = sharpness_mix_orthonormal(as_t(np.stack((beta0, bstar))), as_t(bstar), 0.1)
    assert two.shape == (2,) and abs(float(two[1]) - 2 * 0.1 ** 2) < 1e-15


@pytest.mark.parametrize("instance", ["spec", "other", "at_optimum", "concave"])
def test_inv_second_order_sharpness_vs_numerical_trs(instance):
    if instance == "concave":
        # dense β* and β₀ = 0.2 β*: D < 0 everywhere, so for large ρ the maximiser is interior
        rng = np.random.default_rng(3)
        bstar = 1 + 0.1 * rng.standard_normal(5)
        beta0 = 0.2 * bstar
        rhos = (0.5, 3.0)
    else:
        _, _, bstar, beta0 = spec_instance() if instance != "other" else other_instance()
        if instance == "at_optimum":
            beta0 = bstar.copy()  # r = 0: hard case
        rhos = (0.01, 0.1, 0.5)
    for rho in rhos:
        got = float(sharpness_inv_orthonormal_second_order(as_t(beta0), as_t(bstar), rho))
        num = numerical_trs(beta0, bstar, rho)
        assert abs(got - num) <= 1e-6 * abs(num), (rho, got, num)


def test_exact_inv_sharpness_approaches_second_order():
    """The exact inv sharpness max Σβ₀²(e^{4b}−1) − 2β₀β*(e^{2b}−1) approaches the second-order
    (trust-region) value as ρ → 0, and matches spec §8.5's numerical values."""
    X, y, bstar, beta0 = spec_instance()
    F, _ = exact_inv_objective(beta0, bstar)
    # the objective is L(β₀⊙e^{2b}) − L(β₀) for this data (XᵀX = I, β* = Xᵀy)
    b = 0.05 * np.random.default_rng(0).standard_normal(20)
    assert abs(F(b) - (loss(X, y, beta0 * np.exp(2 * b)) - loss(X, y, beta0))) < 1e-12
    table_exact = {0.1: 4.827898e-02, 0.03: 5.058907e-03, 0.01: 1.184069e-03}
    gaps = []
    for rho in (0.1, 0.03, 0.01, 0.003):
        exact = numerical_inv_sharpness(beta0, bstar, rho)
        second = float(sharpness_inv_orthonormal_second_order(as_t(beta0), as_t(bstar), rho))
        if rho in table_exact:
            assert abs(exact / table_exact[rho] - 1) < 1e-4, (rho, exact)
        gaps.append(abs(exact - second) / exact)
    assert all(g1 > 2 * g2 for g1, g2 in zip(gaps, gaps[1:])), gaps  # shrinks as ρ → 0
    assert gaps[-1] < 1e-4 and gaps[0] > 0.05, gaps  # close at small ρ, clearly different at ρ = 0.1
