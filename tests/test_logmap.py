"""The logarithm and the distance of both quotients, both metrics (core ``log_map``/``distance``
and the faces' ``logmap``/``dist``/``log``): dist(x, expmap(x, v)) = ‖v‖, expmap(x, logmap(x, y))
is y on the quotient, the closed form of the rescaling quotient against the shooting method on the
same quotient as d copies of GL(1), and the errors where no geodesic exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quotient_manifolds.core import (GLQuotientGeometry, LogNotFound, RescalingGeometry, distance,
                                     log_map)
from quotient_manifolds.core.logmap import _gl_invariant, _shoot
from quotient_manifolds.geoopt import GLQuotient, RescalingQuotient
from quotient_manifolds.errors import InvalidArgument, NotSupported

F64 = torch.float64
METRICS = ("mix", "inv")

pytestmark = pytest.mark.usefixtures("single_thread")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rescaling_point(geometry, *batch, seed=0):
    x = geometry.random_point(*batch, dtype=F64, generator=_gen(seed))
    return torch.sign(x) * (0.5 + x.abs())   # coordinates away from 0: steps of length ~1 fit


@pytest.mark.parametrize("metric", METRICS)
def test_gl_shooting_inverts_the_exact_geodesic(metric):
    """log_x(Exp_x(v)) = v and dist = ‖v‖ for horizontal v of lengths 0.3 and 1.5; a representative
    y·A of the same quotient point has the same logarithm; Exp_x(log_x(y)) has y's G Hᵀ for a y
    that is not built from x."""
    g = GLQuotientGeometry(4, 3, 2, metric, exact_steps=8)
    x = g.random_point(dtype=F64, generator=_gen(0))
    for length in (0.3, 1.5):
        v = length * g.random_horizontal(x, generator=_gen(1))
        y = g.retract(x, v, "exact")
        result = log_map(g, x, y)
        assert result.converged and result.method == "shooting" and result.iterations <= 8
        torch.testing.assert_close(result.vector, v, rtol=0, atol=1e-8)
        assert float(distance(g, x, y)) == pytest.approx(length, rel=1e-9)
    A = torch.tensor([[2.0, 1.0], [0.5, 1.5]], dtype=F64)
    torch.testing.assert_close(log_map(g, x, g.act(y, A)).vector, v, rtol=0, atol=1e-8)
    other = x + 0.2 * torch.randn(x.shape, dtype=F64, generator=_gen(5))
    end = g.retract(x, log_map(g, x, other).vector, "exact")
    invariant = _gl_invariant(g)
    torch.testing.assert_close(invariant(end), invariant(other), rtol=0, atol=1e-9)


@pytest.mark.parametrize("metric", METRICS)
def test_rescaling_closed_form_matches_shooting(metric):
    """The closed form (ε = 0) against shooting on the same quotient written as d copies of GL(1)
    (integrated geodesic + Gauss–Newton, an independent method); dist(x, expmap(x, v)) = ‖v‖ and
    expmap(x, logmap(x, y)) has y's β, on a batch of points. (128 RK4 steps for the shooting: its
    geodesic is the integrated one, within 4e-6 of the closed form with the default 32.)"""
    g = RescalingGeometry(2, metric, exact_steps=128)
    x = _rescaling_point(g, 2, seed=0)
    y = _rescaling_point(g, 2, seed=1).abs() * torch.sign(x)   # the signs of x: one component
    closed = log_map(g, x, y)
    assert closed.method == "closed form" and closed.iterations == 0
    shot = _shoot(g.gl, g.to_gl(x), g.to_gl(y), _gl_invariant(g.gl), 1e-12, 30)
    assert shot.converged
    torch.testing.assert_close(closed.vector, g.from_gl(shot.vector), rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(g.beta(g.retract(x, closed.vector, "exact")), g.beta(y),
                               rtol=1e-12, atol=1e-12)
    v = 0.4 * g.random_horizontal(x, generator=_gen(2))
    torch.testing.assert_close(distance(g, x, g.retract(x, v, "exact")), g.norm(x, v),
                               rtol=1e-12, atol=0)


@pytest.mark.parametrize("metric", METRICS)
def test_rescaling_relaxed_uses_shooting(metric):
    """With ε > 0 there is no closed form: the log is shot along the integrated geodesic."""
    g = RescalingGeometry(2, metric, eps=1e-3, exact_steps=8)
    x = _rescaling_point(g, seed=3)
    v = 0.5 * g.random_horizontal(x, generator=_gen(4))
    result = log_map(g, x, g.retract(x, v, "exact"))
    assert result.method == "shooting" and result.converged
    torch.testing.assert_close(result.vector, v, rtol=0, atol=1e-8)


def test_no_geodesic_is_a_clear_error():
    """Different components of the rescaling quotient: LogNotFound naming the coordinate, dist = ∞
    there (finite for the other batch element). A GL point beyond the end of the mix geodesics from
    x: LogNotFound with the convergence report; strict=False returns the report instead."""
    g = RescalingGeometry(2, "mix")
    x = torch.ones(2, 2, 2, dtype=F64)
    y = x.clone()
    y[0, 0, 1] = -3.0
    with pytest.raises(LogNotFound, match=r"opposite signs at index \[0, 1\]"):
        log_map(g, x, y)
    d = distance(g, x, y)
    assert d[0] == float("inf") and d[1] == 0
    gl = GLQuotientGeometry(2, 2, 1, "mix", exact_steps=8)
    a = torch.tensor([[1.0], [0.0], [1.0], [0.0]], dtype=F64)
    b = torch.tensor([[-1.0], [0.0], [1.0], [0.0]], dtype=F64)   # G Hᵀ from +1 to −1: rank 0 between
    with pytest.raises(LogNotFound, match="no geodesic from x to y") as info:
        log_map(gl, a, b, max_iter=5)
    assert info.value.report is not None and not info.value.report.converged
    report = log_map(gl, a, b, max_iter=5, strict=False)
    assert not report.converged and report.residual > 0.1
    rope = GLQuotientGeometry(4, 4, 2, "mix", group="rope")
    point = rope.random_point(dtype=F64, generator=_gen(0))
    with pytest.raises(NotSupported, match="all of GL"):
        log_map(rope, point, point)
    with pytest.raises(InvalidArgument, match="same shape"):
        log_map(g, x, x[0])


@pytest.mark.parametrize("metric", METRICS)
def test_faces_logmap_and_dist(metric):
    """geoopt: logmap/dist/dist2 with batch dimensions and keepdim; pymanopt: log/dist, the
    rescaling quotient in closed form and the GL quotient by shooting."""
    from quotient_manifolds.pymanopt import GLQuotient as PGLQuotient
    from quotient_manifolds.pymanopt import RescalingQuotient as PRescaling

    M = RescalingQuotient(3, metric=metric)
    x = _rescaling_point(M.geometry, 4, seed=6)
    v = 0.3 * M.geometry.random_horizontal(x, generator=_gen(7))
    y = M.expmap(x, v)
    torch.testing.assert_close(M.logmap(x, y), v, rtol=1e-10, atol=1e-12)
    assert M.dist(x, y).shape == (4,) and M.dist(x, y, keepdim=True).shape == (4, 1, 1)
    torch.testing.assert_close(M.dist2(x, y), M.norm(x, v) ** 2, rtol=1e-10, atol=0)
    G = GLQuotient(3, 3, 1, metric=metric, exact_steps=8)
    p = G.random(dtype=F64, generator=_gen(8))
    u = 0.5 * G.geometry.random_horizontal(p, generator=_gen(9))
    torch.testing.assert_close(G.logmap(p, G.expmap(p, u)), u, rtol=0, atol=1e-8)

    np.random.seed(0)
    P = PRescaling(3, metric=metric)
    a = P.random_point()
    a = type(a)(np.sign(a[0]) * (0.5 + np.abs(a[0])), np.sign(a[1]) * (0.5 + np.abs(a[1])))
    w = 0.3 * P.random_tangent_vector(a)
    b = P.exp(a, w)
    assert P.dist(a, b) == pytest.approx(0.3, rel=1e-10)
    np.testing.assert_allclose(np.concatenate(P.log(a, b)), np.concatenate(w), atol=1e-12)
    Q = PGLQuotient(3, 3, 1, metric=metric, exact_steps=8)
    c = Q.random_point()
    z = 0.5 * Q.random_tangent_vector(c)
    assert Q.dist(c, Q.exp(c, z)) == pytest.approx(0.5, rel=1e-8)
