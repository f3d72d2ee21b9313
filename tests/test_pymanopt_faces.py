"""Tests of the pymanopt faces ``quotient_manifolds.pymanopt.{GLQuotient, RescalingQuotient}``.

Modelled on pymanopt's ``tests/manifolds`` (dim, typical_dist, inner, projection, norm, random,
transport, exp) and Manopt's ``Test_fixedrank_2factors.m`` (derivative checks, then optimizers).
The derivative checks use pymanopt's diagnostics with the numpy-2 patch of toolkit-apis §2.7,
installed per test through ``monkeypatch`` (``tests/_pymanopt_patch.py``).
"""

import importlib.util
import subprocess
import sys

import numpy as np
import pymanopt
import pytest
import torch
from pymanopt.optimizers import ConjugateGradient, SteepestDescent, TrustRegions
from torch.testing import assert_close

from _pymanopt_patch import patch_diagnostics
from quotient_manifolds.core import METRICS
from quotient_manifolds.pymanopt import (
    GLQuotient,
    GLTangentVector,
    RescalingQuotient,
    RescalingTangentVector,
)
from quotient_manifolds.errors import InvalidArgument

N, M_, H_ = 8, 6, 2
D_ = 5
_SPECTRUM = np.array([2.0, 1.5, 0.3, 0.2, 0.1, 0.05])
HAS_AUTOGRAD = importlib.util.find_spec("autograd") is not None
BACKENDS = ["pytorch", pytest.param("autograd", marks=pytest.mark.skipif(
    not HAS_AUTOGRAD, reason="autograd is not installed"))]


pytestmark = pytest.mark.usefixtures("single_thread")


def _t(a):
    return torch.as_tensor(np.asarray(a))


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(42)
    torch.manual_seed(42)


def _target(seed=0):
    rng = np.random.default_rng(seed)
    U, _ = np.linalg.qr(rng.normal(size=(N, N)))
    V, _ = np.linalg.qr(rng.normal(size=(M_, M_)))
    k = len(_SPECTRUM)
    T = (U[:, :k] * _SPECTRUM) @ V[:, :k].T
    T_best = (U[:, :H_] * _SPECTRUM[:H_]) @ V[:, :H_].T
    return T, T_best, float((_SPECTRUM[H_:] ** 2).sum())


def _factorisation_cost(manifold, T, backend):
    if backend == "pytorch":
        T_t = torch.from_numpy(T)

        @pymanopt.function.pytorch(manifold)
        def cost(G, H):
            return ((G @ H.T - T_t) ** 2).sum()
    else:
        anp = pytest.importorskip("autograd.numpy")

        @pymanopt.function.autograd(manifold)
        def cost(G, H):
            return anp.sum((G @ H.T - T) ** 2)
    return cost


def _gl_point(manifold, seed=0):
    np.random.seed(seed)
    return manifold.random_point()


def _rescaling_point(seed=0):
    rng = np.random.default_rng(seed)
    # entries bounded away from 0, so that the closed-form mix geodesic stays defined for the
    # unit-norm directions of the diagnostics (needs 1 + 2b > 0, spec §8.3)
    return tuple(np.sign(a) * (1.0 + np.abs(a)) for a in rng.normal(size=(2, D_)))


def _manifold_and_point(kind, metric="mix", retraction="second_order", **kw):
    if kind == "gl":
        M = GLQuotient(N, M_, H_, metric=metric, retraction=retraction, **kw)
        return M, _gl_point(M)
    M = RescalingQuotient(D_, metric=metric, retraction=retraction, **kw)
    return M, _rescaling_point()


# ---------------------------------------------------------------------------- manifold API
@pytest.mark.parametrize("kind", ["gl", "rescaling"])
@pytest.mark.parametrize("metric", METRICS)
def test_basic_geometry(kind, metric):
    M, x = _manifold_and_point(kind, metric)
    assert M.point_layout == 2 and M.num_values == 2
    if kind == "gl":
        assert M.dim == (N + M_) * H_ - H_ ** 2
        assert M.typical_dist == 10 * H_
    else:
        assert M.dim == D_
        assert M.typical_dist == pytest.approx(10 * np.sqrt(D_))
    vec_cls = GLTangentVector if kind == "gl" else RescalingTangentVector
    u, v = M.random_tangent_vector(x), M.random_tangent_vector(x)
    assert isinstance(u, vec_cls)
    assert M.norm(x, u) == pytest.approx(1.0)
    assert isinstance(M.inner_product(x, u, v), float)
    assert M.inner_product(x, u, v) == pytest.approx(M.inner_product(x, v, u))
    assert M.inner_product(x, u, u) == pytest.approx(M.norm(x, u) ** 2)
    # projection: horizontal, idempotent, linear; to_tangent_space is the same map
    e = tuple(np.random.normal(size=np.shape(a)) for a in x)
    pe = M.projection(x, e)
    for a, b in zip(M.projection(x, pe), pe):
        assert_close(_t(a), _t(b), atol=1e-12, rtol=1e-10)
    for a, b in zip(M.to_tangent_space(x, e), pe):
        assert_close(_t(a), _t(b))
    lin = M.projection(x, 2.0 * u + (-3.0) * v)
    for a, b in zip(lin, 2.0 * u - 3.0 * v):
        assert_close(_t(a), _t(b), atol=1e-12, rtol=1e-10)
    # the residual of the projection is metric-orthogonal to horizontal vectors
    assert abs(M.inner_product(x, pe - e, u)) < 1e-10
    # zero vector, transport, retraction, exp
    z = M.zero_vector(x)
    assert isinstance(z, vec_cls) and all(float(np.abs(a).max()) == 0.0 for a in z)
    y = M.retraction(x, 0.1 * u)
    assert [np.shape(a) for a in y] == [np.shape(a) for a in x]
    w = M.transport(x, y, v)
    for a, b in zip(M.projection(y, w), w):
        assert_close(_t(a), _t(b), atol=1e-12, rtol=1e-10)
    ye = M.exp(x, 0.1 * u)
    for a, b in zip(ye, y):  # second-order retraction ≈ geodesic, error O(0.1³)
        assert_close(_t(a), _t(b), atol=5e-3, rtol=0)
    for a, b in zip(M.exp(x, z), x):
        assert_close(_t(a), _t(b))
    # random points are valid
    p = M.random_point()
    assert [np.shape(a) for a in p] == [np.shape(a) for a in x]
    assert all(np.asarray(a).dtype == np.float64 for a in p)


def test_random_draws_follow_numpy_seed():
    M = GLQuotient(N, M_, H_)
    np.random.seed(3)
    a = M.random_point()
    np.random.seed(3)
    b = M.random_point()
    for p, q in zip(a, b):
        assert_close(_t(p), _t(q), atol=0, rtol=0)


def test_tangent_vector_arithmetic():
    M, x = _manifold_and_point("gl")
    u, v = M.random_tangent_vector(x), M.random_tangent_vector(x)
    for result, expected in [
        (u + v, [u.G + v.G, u.H + v.H]),
        (u - v, [u.G - v.G, u.H - v.H]),
        (2.0 * u, [2 * u.G, 2 * u.H]),
        (u * np.float64(2.0), [2 * u.G, 2 * u.H]),
        (np.float64(2.0) * u, [2 * u.G, 2 * u.H]),
        (u / 4, [u.G / 4, u.H / 4]),
        (-u, [-u.G, -u.H]),
        (+u, [u.G, u.H]),
    ]:
        assert isinstance(result, GLTangentVector)
        for a, b in zip(result, expected):
            assert_close(_t(a), _t(b))
    r = RescalingQuotient(D_).random_tangent_vector(_rescaling_point())
    assert isinstance(np.float64(0.5) * r - r, RescalingTangentVector)


@pytest.mark.parametrize("kind", ["gl", "rescaling"])
def test_dist_and_log_invert_exp(kind):
    M, x = _manifold_and_point(kind)
    v = 0.1 * M.random_tangent_vector(x)
    y = M.exp(x, v)
    assert M.dist(x, y) == pytest.approx(M.norm(x, v), rel=1e-8)
    assert M.norm(x, M.log(x, y) - v) < 1e-8


def test_invalid_inputs():
    with pytest.raises(InvalidArgument, match="'inv', 'mix'"):
        GLQuotient(N, M_, H_, metric="euclidean")
    with pytest.raises(InvalidArgument, match="'first_order', 'second_order', 'exact'"):
        RescalingQuotient(D_, retraction="polar")
    M, x = _manifold_and_point("gl")
    with pytest.raises(InvalidArgument, match="shape"):
        M.projection(x, (np.ones((N, H_ + 1)), np.ones((M_, H_ + 1))))
    G, H = x
    G = G.copy()
    G[:, 1] = G[:, 0]
    with pytest.raises(InvalidArgument, match="eps"):
        M.norm((G, H), M.zero_vector(x))


def test_readonly_and_strided_inputs_are_accepted():
    M, x = _manifold_and_point("gl")
    G, H = (np.array(a) for a in x)
    G.setflags(write=False)
    Hf = np.asfortranarray(H)[::1]
    Gr = G[::-1][::-1]  # negative strides twice → positive, still read-only view
    u = M.random_tangent_vector(x)
    ref = M.inner_product(x, u, u)
    assert M.inner_product((Gr, Hf), u, u) == pytest.approx(ref)
    neg = (x[0][::-1], x[1])  # a genuinely negative-strided array (a different point)
    assert np.isfinite(M.norm(neg, M.projection(neg, u)))


def test_top_level_import_is_lazy_about_pymanopt():
    code = ("import sys, quotient_manifolds as q; assert 'pymanopt' not in sys.modules; "
            "assert q.pymanopt.GLQuotient(3, 3, 1).dim == 5; assert 'pymanopt' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------- derivative checks
def _slopes(monkeypatch, problem, x, d):
    D = patch_diagnostics(monkeypatch)
    *_, poly_grad = D.check_directional_derivative(problem, x, d)
    h, err, _, poly_hess = D.check_directional_derivative(problem, x, d, use_quadratic_model=True)
    return poly_grad[0], poly_hess[0], err


def _without_exp(monkeypatch, manifold):
    """Make the diagnostics fall back on the retraction (they use ``exp`` when it exists)."""
    def no_exp(point, tangent_vector):
        raise NotImplementedError
    monkeypatch.setattr(manifold, "exp", no_exp)


@pytest.mark.parametrize("curve", ["exp", "retraction"])
@pytest.mark.parametrize("metric", METRICS)
def test_gl_gradient_and_hessian_checks(monkeypatch, metric, curve):
    M = GLQuotient(N, M_, H_, metric=metric, exact_steps=8)
    if curve == "retraction":
        _without_exp(monkeypatch, M)
    T = np.random.default_rng(1).normal(size=(N, M_))
    problem = pymanopt.Problem(M, _factorisation_cost(M, T, "pytorch"))
    x = _gl_point(M)
    d = M.random_tangent_vector(x)
    slope_grad, slope_hess, _ = _slopes(monkeypatch, problem, x, d)
    assert slope_grad == pytest.approx(2.0, abs=0.1)
    assert slope_hess == pytest.approx(3.0, abs=0.1)
    # gradient and Hessian are horizontal; the Hessian is symmetric
    g = problem.riemannian_gradient(x)
    assert M.norm(x, g - M.to_tangent_space(x, g)) < 1e-10 * M.norm(x, g)
    e = M.random_tangent_vector(x)
    hd, he = problem.riemannian_hessian(x, d), problem.riemannian_hessian(x, e)
    assert M.norm(x, hd - M.to_tangent_space(x, hd)) < 1e-10 * M.norm(x, hd)
    assert M.inner_product(x, hd, e) == pytest.approx(M.inner_product(x, d, he), rel=1e-8)


@pytest.mark.parametrize("curve", ["exp", "retraction"])
@pytest.mark.parametrize("metric", METRICS)
def test_rescaling_gradient_and_hessian_checks(monkeypatch, metric, curve):
    M = RescalingQuotient(D_, metric=metric)
    if curve == "retraction":
        _without_exp(monkeypatch, M)
    beta_star = torch.from_numpy(np.random.default_rng(2).normal(size=D_))

    @pymanopt.function.pytorch(M)
    def cost(u, v):
        return ((u * v - beta_star) ** 2).sum()

    problem = pymanopt.Problem(M, cost)
    x = _rescaling_point()
    d = M.random_tangent_vector(x)
    slope_grad, slope_hess, err = _slopes(monkeypatch, problem, x, d)
    assert slope_grad == pytest.approx(2.0, abs=0.1)
    if metric == "mix" and curve == "exp":
        # β = β₀(1 + 2bt) is linear along mix geodesics (spec §8.3): the quadratic model is exact
        assert float(np.max(err)) < 1e-10
    else:
        assert slope_hess == pytest.approx(3.0, abs=0.1)


# ---------------------------------------------------------------------------- optimizers
_OPTIMIZERS = {
    "SteepestDescent": lambda: SteepestDescent(verbosity=0),
    "ConjugateGradient": lambda: ConjugateGradient(verbosity=0),
    "TrustRegions": lambda: TrustRegions(verbosity=0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
@pytest.mark.parametrize("metric", METRICS)
def test_optimizers_reach_svd_optimum(metric, optimizer, backend):
    T, T_best, best = _target()
    M = GLQuotient(N, M_, H_, metric=metric)
    problem = pymanopt.Problem(M, _factorisation_cost(M, T, backend))
    result = _OPTIMIZERS[optimizer]().run(problem, initial_point=_gl_point(M, seed=1))
    assert "min grad norm" in result.stopping_criterion
    G, H = result.point
    assert result.cost == pytest.approx(best, abs=1e-10)
    assert_close(_t(G @ H.T), _t(T_best), atol=1e-5, rtol=0)
    assert min(np.linalg.svd(G, compute_uv=False).min(),
               np.linalg.svd(H, compute_uv=False).min()) > 1e-3


@pytest.mark.parametrize("retraction", ["first_order", "exact"])
def test_other_retractions_converge(retraction):
    """TrustRegions with the first-order or the exact (RK4, 32 steps) retraction. Few RK4 steps
    are not enough here: TR tries long steps early, where a coarse integration of the mix
    geodesic runs into a singular Gram matrix."""
    T, T_best, best = _target()
    M = GLQuotient(N, M_, H_, metric="mix", retraction=retraction)
    problem = pymanopt.Problem(M, _factorisation_cost(M, T, "pytorch"))
    result = TrustRegions(verbosity=0).run(problem, initial_point=_gl_point(M, seed=2))
    G, H = result.point
    assert_close(_t(G @ H.T), _t(T_best), atol=1e-5, rtol=0)


@pytest.mark.parametrize("metric", METRICS)
def test_rescaling_trust_regions(metric):
    M = RescalingQuotient(D_, metric=metric)
    x0 = _rescaling_point(seed=3)
    # reachable target: β cannot change sign on the quotient
    beta_star = np.sign(x0[0] * x0[1]) * np.linspace(0.5, 2.0, D_)
    beta_t = torch.from_numpy(beta_star)

    @pymanopt.function.pytorch(M)
    def cost(u, v):
        return ((u * v - beta_t) ** 2).sum()

    result = TrustRegions(verbosity=0).run(pymanopt.Problem(M, cost), initial_point=x0)
    u, v = result.point
    assert_close(_t(u * v), _t(beta_star), atol=1e-6, rtol=0)
    assert result.cost < 1e-12
