"""Tests of the geoopt faces ``quotient_manifolds.geoopt.{GLQuotient, RescalingQuotient}``.

Modelled on geoopt's ``tests/test_manifold_basic.py`` (UnaryCase, every case also under
``geoopt.Scaled(M, 2)``), ``test_rsgd.py`` and ``test_adam.py`` (convergence, judged here on the
invariant G Hᵀ against the best rank-h approximation, then an optimizer state-dict round trip).
"""

import collections
import itertools

import geoopt
import pytest
import torch
from torch.testing import assert_close

import quotient_manifolds
from quotient_manifolds import GLQuotient, RescalingQuotient
from quotient_manifolds.core import METRICS, RETRACTIONS
from quotient_manifolds.errors import InvalidArgument

F64 = torch.float64
GL_SHAPE = (5, 4, 2)  # n, m, h
RESCALING_D = 5

UnaryCase = collections.namedtuple("UnaryCase", "shape,x,ex,v,ev,manifold")


pytestmark = pytest.mark.usefixtures("single_thread")


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


def _make_manifold(kind, metric="mix", retraction="second_order", **kw):
    if kind == "gl":
        return GLQuotient(*GL_SHAPE, metric=metric, retraction=retraction, **kw)
    return RescalingQuotient(RESCALING_D, metric=metric, retraction=retraction, **kw)


def _point_shape(kind):
    n, m, h = GL_SHAPE
    return (n + m, h) if kind == "gl" else (2, RESCALING_D)


def _random_point(manifold, *batch, dtype=F64, seed=0):
    """A random point; for the rescaling quotient with entries |uⁱ|, |vⁱ| ≥ 0.5, so that the
    test vectors below have moderate coefficients b = ξ_u/u (the mix geodesic needs 1 + 2b > 0)."""
    if isinstance(manifold, geoopt.Scaled):
        manifold = manifold.base
    kind = "gl" if isinstance(manifold, GLQuotient) else "rescaling"
    x = manifold.random(*batch, *_point_shape(kind), dtype=dtype, generator=_generator(seed))
    if kind == "rescaling":
        x = geoopt.ManifoldTensor(torch.sign(x) * (0.5 + x.abs()), manifold=manifold)
    return x


def _random_vector(manifold, x, seed=1, scale=0.1):
    """A small horizontal vector (small so that every retraction, including the closed-form mix
    geodesic of the rescaling quotient, stays on the manifold)."""
    ev = scale * torch.randn(x.shape, dtype=x.dtype, generator=_generator(seed))
    return manifold.proju(x, ev)


def _unary_cases():
    for kind, metric, retraction in itertools.product(("gl", "rescaling"), METRICS, RETRACTIONS):
        manifold = _make_manifold(kind, metric, retraction)
        shape = _point_shape(kind)
        x = _random_point(manifold)
        ev = 0.1 * torch.randn(shape, dtype=F64, generator=_generator(7))
        v = manifold.proju(x, ev)
        yield UnaryCase(shape, geoopt.ManifoldTensor(x, manifold=manifold), x.clone(), v, ev,
                        manifold)


def _case_id(case):
    g = case.manifold.geometry
    return f"{type(case.manifold).__name__}-{g.metric}-{g.retraction}"


@pytest.fixture(params=list(_unary_cases()), ids=_case_id)
def unary_case_base(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["plain", "scaled"])
def unary_case(request, unary_case_base):
    if request.param:
        return unary_case_base._replace(manifold=geoopt.Scaled(unary_case_base.manifold, 2.0))
    return unary_case_base


def _stack(manifold, seed=3, scale=0.1):
    """4 different points and 4 horizontal vectors at them."""
    X = _random_point(manifold, 4, seed=seed)
    U = manifold.proju(X, scale * torch.randn(X.shape, dtype=F64, generator=_generator(seed + 1)))
    V = manifold.proju(X, torch.randn(X.shape, dtype=F64, generator=_generator(seed + 2)))
    return X, U, V


# ---------------------------------------------------------------------------- geoopt basics
def test_projection_identity(unary_case):
    px = unary_case.manifold.projx(unary_case.x)
    assert_close(px, unary_case.x, check_dtype=True, atol=0, rtol=0)


def test_projection_via_assert(unary_case):
    px = unary_case.manifold.projx(unary_case.ex)
    unary_case.manifold.assert_check_point_on_manifold(px)
    assert_close(px, unary_case.x.as_subclass(torch.Tensor), atol=0, rtol=0)


def test_vector_projection_via_assert(unary_case):
    M, x = unary_case.manifold, unary_case.x
    pv = M.proju(x, unary_case.ev)
    M.assert_check_vector_on_tangent(x, pv)
    assert_close(pv, unary_case.v, atol=1e-12, rtol=1e-10)
    assert_close(M.proju(x, pv), pv, atol=1e-12, rtol=1e-10)  # idempotent
    assert type(pv) is torch.Tensor  # no ManifoldTensor promotion


def test_broadcast_projx(unary_case):
    X, _, _ = _stack(unary_case.manifold)
    pX = unary_case.manifold.projx(X)
    unary_case.manifold.assert_check_point_on_manifold(pX)
    for x, px in zip(X, pX):
        unary_case.manifold.assert_check_point_on_manifold(px)
        assert_close(px, unary_case.manifold.projx(x))


def test_broadcast_proju(unary_case):
    M = unary_case.manifold
    X, _, _ = _stack(M)
    E = torch.randn(X.shape, dtype=F64, generator=_generator(11))
    pU = M.proju(X, E)
    M.assert_check_vector_on_tangent(X, pU)
    for x, e, pu in zip(X, E, pU):
        M.assert_check_vector_on_tangent(x, pu)
        assert_close(pu, M.proju(x, e), atol=1e-12, rtol=1e-10)
    # one point, a batch of vectors
    pU1 = M.proju(X[0], E)
    for e, pu in zip(E, pU1):
        assert_close(pu, M.proju(X[0], e), atol=1e-12, rtol=1e-10)


def test_broadcast_egrad2rgrad(unary_case):
    M = unary_case.manifold
    X, _, _ = _stack(M)
    E = torch.randn(X.shape, dtype=F64, generator=_generator(12))
    R = M.egrad2rgrad(X, E)
    M.assert_check_vector_on_tangent(X, R)
    for x, e, r in zip(X, E, R):
        assert_close(r, M.egrad2rgrad(x, e), atol=1e-12, rtol=1e-10)


def test_broadcast_retr(unary_case):
    M = unary_case.manifold
    X, U, _ = _stack(M)
    Y = M.retr(X, U)
    M.assert_check_point_on_manifold(Y)
    for x, u, y in zip(X, U, Y):
        M.assert_check_point_on_manifold(y)
        assert_close(y, M.retr(x, u), atol=1e-12, rtol=1e-10)


def test_broadcast_transp(unary_case):
    M = unary_case.manifold
    X, U, V = _stack(M)
    Y = M.retr(X, U)
    Q = M.transp_follow_retr(X, U, V)
    M.assert_check_vector_on_tangent(Y, Q)
    for x, u, v, y, q in zip(X, U, V, Y, Q):
        M.assert_check_vector_on_tangent(y, q)
        assert_close(q, M.transp_follow_retr(x, u, v), atol=1e-12, rtol=1e-10)
        assert_close(q, M.transp(x, y, v), atol=1e-12, rtol=1e-10)


def test_broadcast_inner(unary_case):
    M = unary_case.manifold
    X, U, V = _stack(M)
    inner = M.inner(X, U, V)
    assert inner.shape == (4,)
    assert M.inner(X, U, V, keepdim=True).shape == (4, 1, 1)
    assert M.component_inner(X, U).shape == (4, 1, 1)
    assert M.norm(X, U, keepdim=True).shape == (4, 1, 1)
    for x, u, v, val in zip(X, U, V, inner):
        assert_close(val, M.inner(x, u, v), atol=1e-12, rtol=1e-10)
        assert_close(M.inner(x, u), M.norm(x, u) ** 2, atol=1e-12, rtol=1e-10)
    assert_close(M.inner(X, U, V), M.inner(X, V, U))
    assert bool((M.inner(X, U) > 0).all())


def test_combined_moves_are_consistent(unary_case):
    M = unary_case.manifold
    X, U, V = _stack(M)
    y, vt = M.retr_transp(X, U, V)
    assert_close(y, M.retr(X, U))
    assert_close(vt, M.proju(y, V))
    y, vt = M.expmap_transp(X, U, V)
    assert_close(y, M.expmap(X, U))
    assert_close(vt, M.proju(y, V))
    assert_close(M.transp_follow_expmap(X, U, V), vt)
    M.assert_check_point_on_manifold(y)


def test_reversibility(unary_case):
    assert unary_case.manifold.reversible is False  # samplers refuse non-reversible manifolds


def test_expmap_logmap_dist_consistency(unary_case):
    """geoopt's logmap/expmap/dist contract (the rescaling cases, closed form; the GL ones by
    shooting in tests/test_logmap.py): logmap(x, expmap(x, v)) = v, dist = ‖v‖, also scaled."""
    M, x, v = unary_case.manifold, unary_case.x, unary_case.v
    base = M.base if isinstance(M, geoopt.Scaled) else M
    if not isinstance(base, RescalingQuotient):
        pytest.skip("GL: shooting, tested in tests/test_logmap.py")
    y = M.expmap(x, v)
    assert_close(M.logmap(x, y), v)
    assert_close(M.dist(x, y), M.norm(x, v))
    assert_close(M.dist2(x, y), M.norm(x, v) ** 2)


# ---------------------------------------------------------------------------- float32, expmap
@pytest.mark.parametrize("kind", ["gl", "rescaling"])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("retraction", RETRACTIONS)
def test_float32_matches_float64(kind, metric, retraction):
    M = _make_manifold(kind, metric, retraction)
    x = _random_point(M)
    u = _random_vector(M, x)
    e = torch.randn(x.shape, dtype=F64, generator=_generator(5))
    x32, u32, e32 = x.float(), u.float(), e.float()
    for out32, out64 in [
        (M.proju(x32, e32), M.proju(x, e)),
        (M.egrad2rgrad(x32, e32), M.egrad2rgrad(x, e)),
        (M.inner(x32, u32), M.inner(x, u)),
        (M.retr(x32, u32), M.retr(x, u)),
        (M.expmap(x32, u32), M.expmap(x, u)),
        (M.transp(x32, x32, e32), M.transp(x, x, e)),
    ]:
        assert out32.dtype == torch.float32
        assert_close(out32, out64.float(), atol=1e-5, rtol=1e-4)
    M.assert_check_vector_on_tangent(x32, M.proju(x32, e32))


@pytest.mark.parametrize("kind", ["gl", "rescaling"])
@pytest.mark.parametrize("metric", METRICS)
def test_second_order_retraction_agrees_with_expmap(kind, metric):
    M = _make_manifold(kind, metric, "second_order")
    x = _random_point(M)
    u = _random_vector(M, x, scale=1.0)
    u = u / M.norm(x, u)
    errs = [float((M.retr(x, t * u) - M.expmap(x, t * u)).abs().max()) for t in (0.04, 0.02)]
    assert errs[1] < 0.2 * errs[0]  # O(t³): ratio 1/8 per halving
    assert_close(M.expmap(x, torch.zeros_like(x)), x)


# ---------------------------------------------------------------------------- random, origin
@pytest.mark.parametrize("kind", ["gl", "rescaling"])
def test_random_and_origin(kind):
    M = _make_manifold(kind)
    shape = _point_shape(kind)
    r = M.random(3, *shape, dtype=F64)
    assert isinstance(r, geoopt.ManifoldTensor) and r.manifold is M
    assert r.shape == (3, *shape) and r.dtype == F64
    M.assert_check_point_on_manifold(r)
    assert M.random().shape == shape
    o1, o2 = M.origin(2, *shape), M.origin(2, *shape)
    assert isinstance(o1, geoopt.ManifoldTensor)
    assert_close(o1, o2, atol=0, rtol=0)
    M.assert_check_point_on_manifold(o1)
    if kind == "gl":
        G, H = M.split(o1[0])
        n, m, h = GL_SHAPE
        assert_close(G[:h], torch.eye(h))
        assert_close(H[:h], torch.eye(h))
        assert float(G[h:].abs().max()) == 0.0
    else:
        assert_close(o1, torch.ones(2, *shape))
    assert_close(M.pack_point(*M.unpack_tensor(r)), r.as_subclass(torch.Tensor))
    with pytest.raises(ValueError, match="expected"):
        M.random(3, 7, 7)


def test_repr_and_top_level_exports():
    M = GLQuotient(5, 4, 2, metric="inv", retraction="exact", eps=1e-3)
    assert "n=5, m=4, h=2, metric='inv', retraction='exact', eps=0.001" in repr(M)
    assert "d=3" in repr(RescalingQuotient(3))
    assert M.dim == (5 + 4) * 2 - 4 and RescalingQuotient(3).dim == 3
    assert quotient_manifolds.__version__ == "0.1.0"
    for name in ("GLQuotientGeometry", "RescalingGeometry", "METRICS", "RETRACTIONS",
                 "GLQuotient", "RescalingQuotient", "QuotientManifoldsError", "StepTooLarge"):
        assert hasattr(quotient_manifolds, name)
    # the closed forms of the diagonal study live with it, not at the package root
    for name in ("sharpness_mix_orthonormal", "sharpness_inv_orthonormal_second_order", "beta_along_geodesic"):
        assert not hasattr(quotient_manifolds, name) and not hasattr(quotient_manifolds.core, name)
    assert quotient_manifolds.pymanopt.GLQuotient(5, 4, 2).dim == 14


# ---------------------------------------------------------------------------- checks
@pytest.mark.parametrize("kind", ["gl", "rescaling"])
def test_wrong_shape_is_reported(kind):
    M = _make_manifold(kind)
    bad = torch.ones(3, 7, 7, dtype=F64)
    ok, reason = M.check_point(bad, explain=True)
    assert not ok and "expected" in reason and "(3, 7, 7)" in reason
    ok, reason = M.check_point_on_manifold(bad, explain=True)
    assert not ok and "expected" in reason
    with pytest.raises(ValueError, match="expected"):
        geoopt.ManifoldTensor(bad, manifold=M)
    with pytest.raises(ValueError, match="expected"):
        geoopt.ManifoldParameter(bad, manifold=M)
    with pytest.raises(InvalidArgument, match="expected"):
        M.proju(bad, bad)
    assert M.check_point(torch.ones(2, *_point_shape(kind)))


def _rank_deficient_gl():
    n, m, h = GL_SHAPE
    x = GLQuotient(*GL_SHAPE).random(n + m, h, dtype=F64, generator=_generator(2))
    x[:n, 1] = 2 * x[:n, 0]  # G has rank 1 < h
    return x


def test_rank_deficient_point_is_rejected_and_eps_is_suggested():
    M = GLQuotient(*GL_SHAPE)
    x = _rank_deficient_gl()
    assert M.check_point(x)  # the shape is fine
    ok, reason = M.check_point_on_manifold(x, explain=True)
    assert not ok and "rank-deficient" in reason and "eps" in reason
    with pytest.raises(ValueError, match="eps"):
        M.assert_check_point_on_manifold(x)
    with pytest.raises(InvalidArgument, match="rank-deficient"):
        M.proju(x, torch.ones_like(x))
    # a batch: the offending element is named
    X = torch.stack([_random_point(M), x])
    with pytest.raises(InvalidArgument, match=r"batch index \(1,\)"):
        M.egrad2rgrad(X, torch.ones_like(X))
    # with a relaxation the point is usable
    Me = GLQuotient(*GL_SHAPE, eps=1e-3)
    Me.assert_check_point_on_manifold(x)
    u = Me.proju(x, torch.randn(x.shape, dtype=F64, generator=_generator(4)))
    assert bool(torch.isfinite(Me.retr(x, 0.1 * u)).all())


def test_rescaling_zero_entry_is_rejected():
    M = RescalingQuotient(RESCALING_D)
    x = _random_point(M)
    x[1, 2] = 0.0
    ok, reason = M.check_point_on_manifold(x, explain=True)
    assert not ok and "zero entry" in reason and "eps" in reason
    RescalingQuotient(RESCALING_D, eps=1e-3).assert_check_point_on_manifold(x)


@pytest.mark.parametrize("kind", ["gl", "rescaling"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_point_is_rejected(kind, value):
    M = _make_manifold(kind)
    x = _random_point(M)
    x[0, 0] = value
    ok, reason = M.check_point_on_manifold(x, explain=True)
    assert not ok and "non-finite" in reason
    with pytest.raises(InvalidArgument, match="non-finite"):
        M.inner(x, x)
    y = _random_point(M)
    u = torch.zeros_like(y)
    u[0, 0] = value
    ok, reason = M.check_vector_on_tangent(y, u, explain=True)
    assert not ok and "non-finite" in reason


@pytest.mark.parametrize("kind", ["gl", "rescaling"])
def test_vertical_vector_is_not_tangent(kind):
    M = _make_manifold(kind)
    x = _random_point(M)
    if kind == "gl":
        lam = torch.randn(GL_SHAPE[2], GL_SHAPE[2], dtype=F64, generator=_generator(9))
        G, H = M.split(x)
        vertical = M.pack(G @ lam, -H @ lam.mT)  # tangent to the orbit
    else:
        a = torch.randn(RESCALING_D, dtype=F64, generator=_generator(9))
        vertical = M.pack(x[0] * a, -x[1] * a)
    assert_close(M.proju(x, vertical), torch.zeros_like(x), atol=1e-12, rtol=0)
    ok, reason = M.check_vector_on_tangent(x, vertical, explain=True)
    assert not ok and "not horizontal" in reason
    with pytest.raises(ValueError, match="not horizontal"):
        M.assert_check_vector_on_tangent(x, vertical)


@pytest.mark.parametrize("cls, args", [(GLQuotient, GL_SHAPE), (RescalingQuotient, (4,))])
def test_unknown_names_list_valid_choices(cls, args):
    with pytest.raises(quotient_manifolds.InvalidArgument, match="metric must be one of 'inv', 'mix', got 'euclidean'"):
        cls(*args, metric="euclidean")
    with pytest.raises(InvalidArgument, match="'first_order', 'second_order', 'exact'"):
        cls(*args, retraction="cayley")
    with pytest.raises(InvalidArgument, match="eps"):
        cls(*args, eps=-1.0)


def test_bad_dimensions():
    with pytest.raises(InvalidArgument, match="h = 5 exceeds"):
        GLQuotient(4, 6, 5)
    with pytest.raises(InvalidArgument, match="positive integer"):
        RescalingQuotient(0)


# ---------------------------------------------------------------------------- optimizers
N, M_, H_ = 8, 6, 2
_SPECTRUM = (2.0, 1.5, 0.3, 0.2, 0.1, 0.05)


def _target(seed=0, n=N, m=M_, h=H_, spectrum=_SPECTRUM):
    """T with known SVD; returns T, its best rank-h approximation and the optimal loss."""
    g = _generator(seed)
    U, _ = torch.linalg.qr(torch.randn(n, n, dtype=F64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(m, m, dtype=F64, generator=g))
    s = torch.tensor(spectrum, dtype=F64)
    k = len(spectrum)
    T = (U[:, :k] * s) @ V[:, :k].T
    T_best = (U[:, :h] * s[:h]) @ V[:, :h].T
    return T, T_best, float((s[h:] ** 2).sum())


def _best_rank_h(T, h):
    U, S, Vh = torch.linalg.svd(T)
    return (U[..., :, :h] * S[..., None, :h]) @ Vh[..., :h, :], (S[..., h:] ** 2).sum(-1)


# (metric, name) -> (optimizer class, kwargs, steps)
_OPTIMIZERS = {
    "sgd": (geoopt.optim.RiemannianSGD, {"mix": dict(lr=0.1), "inv": dict(lr=0.02)}, 300),
    "momentum": (geoopt.optim.RiemannianSGD, {"mix": dict(lr=0.05, momentum=0.9),
                                              "inv": dict(lr=0.01, momentum=0.9)}, 400),
    "nesterov": (geoopt.optim.RiemannianSGD,
                 {"mix": dict(lr=0.05, momentum=0.9, nesterov=True),
                  "inv": dict(lr=0.01, momentum=0.9, nesterov=True)}, 400),
    "adam": (geoopt.optim.RiemannianAdam, {"mix": dict(lr=0.05, betas=(0.9, 0.99)),
                                           "inv": dict(lr=0.05, betas=(0.9, 0.99))}, 600),
    "amsgrad": (geoopt.optim.RiemannianAdam,
                {"mix": dict(lr=0.1, betas=(0.9, 0.99), amsgrad=True),
                 "inv": dict(lr=0.1, betas=(0.9, 0.99), amsgrad=True)}, 600),
}


def _parameter(M, *shape, seed, dtype=F64):
    """ManifoldParameter at a random point scaled so that G Hᵀ starts at the size of the target
    (a large first step with the inv metric, whose step scales with σ(GHᵀ)², can lose rank)."""
    torch.manual_seed(seed)
    return geoopt.ManifoldParameter(0.5 * M.random(*shape, dtype=dtype), manifold=M)


def _assert_full_rank(M, p, tol=1e-3):
    M.assert_check_point_on_manifold(p.detach())
    for factor in M.split(p.detach()):
        assert float(torch.linalg.svdvals(factor).min()) > tol


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
@pytest.mark.parametrize("metric", METRICS)
def test_optimizer_reaches_svd_optimum(metric, name):
    cls, kwargs, steps = _OPTIMIZERS[name]
    T, T_best, best = _target()
    M = GLQuotient(N, M_, H_, metric=metric)
    p = _parameter(M, N + M_, H_, seed=1)
    optim = cls([p], **kwargs[metric])

    def closure():
        optim.zero_grad()
        G, H = M.split(p)
        loss = ((G @ H.T - T) ** 2).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        optim.step(closure)
    assert p.is_contiguous() and isinstance(p, geoopt.ManifoldParameter)
    G, H = M.split(p.detach())
    assert_close(G @ H.T, T_best, atol=1e-6, rtol=0)
    assert float(closure().detach()) == pytest.approx(best, abs=1e-10)
    _assert_full_rank(M, p)
    # the SVD reference computed independently agrees with the constructed one
    assert_close(_best_rank_h(T, H_)[0], T_best)

    optim.load_state_dict(optim.state_dict())
    optim.step(closure)
    G, H = M.split(p.detach())
    assert_close(G @ H.T, T_best, atol=1e-6, rtol=0)
    _assert_full_rank(M, p)


@pytest.mark.parametrize("retraction", ["first_order", "exact"])
def test_sgd_with_other_retractions(retraction):
    T, T_best, _ = _target()
    M = GLQuotient(N, M_, H_, metric="mix", retraction=retraction, exact_steps=4)
    p = _parameter(M, N + M_, H_, seed=2)
    optim = geoopt.optim.RiemannianSGD([p], lr=0.1)
    for _ in range(150):
        optim.zero_grad()
        G, H = M.split(p)
        ((G @ H.T - T) ** 2).sum().backward()
        optim.step()
    G, H = M.split(p.detach())
    assert_close(G @ H.T, T_best, atol=1e-6, rtol=0)


@pytest.mark.parametrize("metric", METRICS)
def test_sgd_weight_decay(metric):
    """Weight decay (not GL-invariant) is made horizontal by egrad2rgrad; the limit is within O(wd)
    of the SVD optimum and stays full rank."""
    wd = 1e-3
    T, T_best, best = _target()
    M = GLQuotient(N, M_, H_, metric=metric)
    p = _parameter(M, N + M_, H_, seed=0)
    optim = geoopt.optim.RiemannianSGD([p], lr={"mix": 0.05, "inv": 0.02}[metric],
                                       momentum=0.5, weight_decay=wd)
    for _ in range(400):
        optim.zero_grad()
        G, H = M.split(p)
        loss = ((G @ H.T - T) ** 2).sum()
        loss.backward()
        optim.step()
    G, H = M.split(p.detach())
    assert float((G @ H.T - T_best).abs().max()) < 2 * wd
    assert float(loss.detach()) < best + 10 * wd
    _assert_full_rank(M, p)


@pytest.mark.parametrize("metric, lr", [("mix", 0.05), ("inv", 0.003)])
def test_masked_matrix_completion(metric, lr):
    n, m, h = 10, 8, 2
    g = _generator(0)
    T = torch.randn(n, h, dtype=F64, generator=g) @ torch.randn(m, h, dtype=F64, generator=g).T / 2
    mask = (torch.rand(n, m, dtype=F64, generator=g) < 0.75).to(F64)
    M = GLQuotient(n, m, h, metric=metric)
    torch.manual_seed(0)
    p = geoopt.ManifoldParameter(M.random(n + m, h, dtype=F64), manifold=M)
    optim = geoopt.optim.RiemannianSGD([p], lr=lr, momentum=0.9)
    for _ in range(600):
        optim.zero_grad()
        G, H = M.split(p)
        loss = (((G @ H.T - T) * mask) ** 2).sum()
        loss.backward()
        optim.step()
    G, H = M.split(p.detach())
    assert float(loss.detach()) < 1e-12
    assert_close(G @ H.T, T, atol=1e-6, rtol=0)  # unobserved entries recovered too
    _assert_full_rank(M, p)


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_batch_of_heads(name):
    heads, n, m, h = 3, N, M_, H_
    targets = torch.stack([_target(seed)[0] for seed in range(heads)])
    T_best, best = _best_rank_h(targets, h)
    M = GLQuotient(n, m, h, metric="mix")
    p = _parameter(M, heads, n + m, h, seed=3)
    cls, kwargs, steps = _OPTIMIZERS[name]
    optim = cls([p], **kwargs["mix"])

    def closure():
        optim.zero_grad()
        G, H = M.split(p)
        loss = ((G @ H.mT - targets) ** 2).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        optim.step(closure)
    if name == "adam":  # one second moment per head (scalar component_inner), broadcast
        sq = optim.state[p]["exp_avg_sq"]
        assert_close(sq, sq[:, :1, :1].expand_as(sq), atol=0, rtol=0)
        assert float(sq[0, 0, 0]) != float(sq[1, 0, 0])
    G, H = M.split(p.detach())
    assert_close(G @ H.mT, T_best, atol=1e-6, rtol=0)
    assert float(closure().detach()) == pytest.approx(float(best.sum()), abs=1e-10)
    _assert_full_rank(M, p)
    optim.load_state_dict(optim.state_dict())
    optim.step(closure)
    assert_close(M.split(p.detach())[0] @ M.split(p.detach())[1].mT, T_best, atol=1e-6, rtol=0)


def test_float32_parameter_training():
    T, T_best, _ = _target()
    M = GLQuotient(N, M_, H_, metric="mix")
    p = _parameter(M, N + M_, H_, seed=4, dtype=torch.float32)
    optim = geoopt.optim.RiemannianSGD([p], lr=0.05, momentum=0.9)
    for _ in range(300):
        optim.zero_grad()
        G, H = M.split(p)
        ((G @ H.T - T.float()) ** 2).sum().backward()
        optim.step()
    assert p.dtype == torch.float32
    G, H = M.split(p.detach())
    assert_close(G @ H.T, T_best.float(), atol=1e-4, rtol=0)


def test_module_state_dict_round_trip():
    M = GLQuotient(N, M_, H_)
    module = torch.nn.Module()
    module.weight = geoopt.ManifoldParameter(M.random(N + M_, H_, dtype=F64), manifold=M)
    other = torch.nn.Module()
    other.weight = geoopt.ManifoldParameter(M.origin(N + M_, H_, dtype=F64), manifold=M)
    other.load_state_dict(module.state_dict())
    assert isinstance(other.weight, geoopt.ManifoldParameter)
    assert_close(other.weight.detach(), module.weight.detach())


@pytest.mark.parametrize("name", ["momentum", "adam"])
@pytest.mark.parametrize("metric", METRICS)
def test_rescaling_quotient_optimizers(metric, name):
    """Diagonal linear regression with XᵀX = I: β = u⊙v → β* (signs chosen reachable, since β
    cannot cross 0 on the quotient)."""
    d = RESCALING_D
    M = RescalingQuotient(d, metric=metric)
    torch.manual_seed(5)
    p = geoopt.ManifoldParameter(M.random(2, d, dtype=F64), manifold=M)
    beta_star = torch.sign(M.beta(p.detach())) * torch.linspace(0.5, 2.0, d, dtype=F64)
    cls = {"momentum": geoopt.optim.RiemannianSGD, "adam": geoopt.optim.RiemannianAdam}[name]
    kwargs = {"momentum": dict(lr=0.02, momentum=0.9),
              "adam": dict(lr=0.05, betas=(0.9, 0.99))}[name]
    optim = cls([p], **kwargs)
    for _ in range(600):
        optim.zero_grad()
        ((M.beta(p) - beta_star) ** 2).sum().backward()
        optim.step()
    assert_close(M.beta(p.detach()), beta_star, atol=1e-6, rtol=0)
    M.assert_check_point_on_manifold(p.detach())


@pytest.mark.parametrize("metric,lr", [("inv", 0.5), ("mix", 50.0)])
def test_a_step_off_the_manifold_says_step_too_large(metric, lr):
    """An absurd learning rate in the README's completion problem: the optimiser's retraction
    leaves the manifold (non-finite or rank-deficient point) and the error says so and what to do,
    with the inv metric's scale explained; a user's rank-deficient point still says rank-deficient."""
    torch.manual_seed(0)
    n, m, h = 60, 40, 4
    target = torch.randn(n, h) @ torch.randn(h, m)
    mask = torch.rand(n, m) < 0.6
    M = GLQuotient(n, m, h, metric=metric)
    x = geoopt.ManifoldParameter(M.random(dtype=torch.float64), manifold=M)
    opt = geoopt.optim.RiemannianSGD([x], lr=lr, momentum=0.5)
    with pytest.raises(quotient_manifolds.StepTooLarge, match="step too large") as info:
        for _ in range(50):
            opt.zero_grad()
            G, H = M.split(x)
            (0.5 * ((G @ H.T - target)[mask] ** 2).sum()).backward()
            opt.step()
    assert "learning rate" in str(info.value)
    assert ("metric='mix'" in str(info.value)) == (metric == "inv")
    bad = M.random(dtype=torch.float64)
    bad[:n, 1] = bad[:n, 0]
    with pytest.raises(InvalidArgument, match="rank-deficient") as plain:
        M.egrad2rgrad(bad, torch.ones_like(bad))
    assert not isinstance(plain.value, quotient_manifolds.StepTooLarge)


def test_pymanopt_retraction_off_the_manifold_says_step_too_large():
    from quotient_manifolds.pymanopt import GLQuotient as PymanoptGLQuotient

    M = PymanoptGLQuotient(6, 5, 2, metric="inv")
    point = M.random_point()
    away = M.random_tangent_vector(point)
    with pytest.raises(quotient_manifolds.StepTooLarge, match="step too large"):
        M.retraction(point, away * float("inf"))
