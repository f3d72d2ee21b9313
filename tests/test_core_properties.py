"""Property-based tests (hypothesis) of the GL(h) quotient core over random small shapes, seeds,
metrics and relaxations: the projection is idempotent and horizontal, the metric is invariant under
the group action, and the Riemannian gradient of an invariant loss is horizontal."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotient_manifolds.core import METRICS, GLQuotientGeometry

F64 = torch.float64
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("single_thread")


@st.composite
def problems(draw, with_eps=True):
    h = draw(st.integers(1, 4))
    n = draw(st.integers(h, 7))
    m = draw(st.integers(h, 7))
    metric = draw(st.sampled_from(METRICS))
    eps = draw(st.sampled_from([0.0, 1e-3, 0.5])) if with_eps else 0.0
    seed = draw(st.integers(0, 2 ** 31 - 1))
    batch = draw(st.sampled_from([(), (2,)]))
    return GLQuotientGeometry(n, m, h, metric, eps=eps), seed, batch


def conditioned_point(geom, g, batch, lo=0.3, hi=3.0):
    """[G; H] with singular values in [lo, hi] and random orientation."""
    h = geom.h

    def factor(rows):
        Q, _ = torch.linalg.qr(torch.randn(batch + (rows, h), dtype=F64, generator=g))
        V, _ = torch.linalg.qr(torch.randn(batch + (h, h), dtype=F64, generator=g))
        s = lo + (hi - lo) * torch.rand(batch + (h,), dtype=F64, generator=g)
        return Q @ (s[..., :, None] * V)

    return torch.cat((factor(geom.n), factor(geom.m)), dim=-2)


def random_gl(h, g, scale):
    Q1, _ = torch.linalg.qr(torch.randn(h, h, dtype=F64, generator=g))
    Q2, _ = torch.linalg.qr(torch.randn(h, h, dtype=F64, generator=g))
    s = 10 ** (2 * torch.rand(h, dtype=F64, generator=g) - 1)  # condition number ≤ 100
    return scale * Q1 @ torch.diag(s) @ Q2.T


@SETTINGS
@given(problems())
def test_projection_idempotent_and_horizontal(problem):
    geom, seed, batch = problem
    g = torch.Generator().manual_seed(seed)
    x = conditioned_point(geom, g, batch)
    f = geom.frame(x)
    xi = torch.randn(x.shape, dtype=F64, generator=g)
    p = f.project(xi)
    scale = float(p.abs().max()) + 1e-300
    assert float((f.project(p) - p).abs().max()) <= 1e-10 * scale
    assert float(f.horizontal_residual(p).max()) < 1e-10
    # metric-orthogonal to the vertical space
    for E in torch.eye(geom.h * geom.h, dtype=F64):
        V = f.vertical(E.reshape(geom.h, geom.h))
        assert float(f.inner(p, V).abs().max()) <= 1e-10 * float((f.norm(p) * f.norm(V)).max()) + 1e-300


@SETTINGS
@given(problems(with_eps=False), st.sampled_from([1e-2, 1.0, 1e2]))
def test_metric_invariance(problem, scale):
    geom, seed, batch = problem
    g = torch.Generator().manual_seed(seed)
    x = conditioned_point(geom, g, batch)
    u = torch.randn(x.shape, dtype=F64, generator=g)
    v = torch.randn(x.shape, dtype=F64, generator=g)
    A = random_gl(geom.h, g, scale)
    g0 = geom.inner(x, u, v)
    g1 = geom.inner(geom.act(x, A), geom.act(u, A), geom.act(v, A))
    bound = 1e-9 * geom.norm(x, u) * geom.norm(x, v)
    assert bool(((g1 - g0).abs() <= bound).all())


@SETTINGS
@given(problems())
def test_rgrad_of_invariant_loss_is_horizontal(problem):
    geom, seed, batch = problem
    g = torch.Generator().manual_seed(seed)
    x = conditioned_point(geom, g, batch).requires_grad_(True)
    Xl = torch.randn(3, geom.n, dtype=F64, generator=g)
    Yr = torch.randn(geom.m, 2, dtype=F64, generator=g)
    G, H = geom.split(x)
    S = Xl @ G @ H.mT @ Yr
    loss = (torch.sin(S) + S ** 2).sum()
    (eg,) = torch.autograd.grad(loss, x)
    x = x.detach()
    G, H = geom.split(x)
    gG, gH = geom.split(eg)
    # invariance identity Gᵀ∇_G = ∇_HᵀH
    ident = G.mT @ gG - gH.mT @ H
    assert float(ident.abs().max()) <= 1e-10 * (float((G.mT @ gG).abs().max()) + 1e-300)
    f = geom.frame(x)
    rg = f.egrad2rgrad(eg)
    assert float(f.horizontal_residual(rg).max()) < 1e-10
    # and the projection inside egrad2rgrad changed nothing (the raw lift is already horizontal)
    NG, NH = f.inverse_metric_weights
    raw = geom.pack(gG @ NG, gH @ NH)
    assert float((rg - raw).abs().max()) <= 1e-10 * (float(raw.abs().max()) + 1e-300)
