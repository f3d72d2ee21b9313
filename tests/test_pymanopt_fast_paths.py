"""The pymanopt face's fast paths give the answers of the plain paths: frames of the points the
manifold returned are found by identity only while the arrays keep their values (a point changed in
place is recomputed), and tangent vectors passed as pairs without concatenation give the same
inner products, projections and gradients as stacked ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quotient_manifolds.pymanopt import GLQuotient
from quotient_manifolds.errors import InvalidArgument, StepTooLarge


@pytest.fixture
def manifold_and_point():
    np.random.seed(0)
    M = GLQuotient(7, 5, 2, metric="mix")
    x0 = M.random_point()
    step = M.random_tangent_vector(x0) * 0.1
    return M, M.retraction(x0, step)          # a point the manifold returned


def test_own_point_found_by_identity_and_refused_once_changed(manifold_and_point):
    M, x = manifold_and_point
    frame = M._frame(x)
    assert M._own_point_frame(x) is frame
    u, v = M.random_tangent_vector(x), M.random_tangent_vector(x)
    before = M.inner_product(x, u, v)
    x.G[0, 0] += 0.5                         # changed in place: the cached frame must not be used
    assert M._own_point_frame(x) is None
    fresh = GLQuotient(7, 5, 2, metric="mix")
    copy = (x.G.copy(), x.H.copy())
    assert M.inner_product(x, u, v) == pytest.approx(fresh.inner_product(copy, u, v), rel=1e-14)
    assert M.inner_product(x, u, v) != pytest.approx(before, rel=1e-6)


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_pairs_give_the_stacked_answers(metric):
    np.random.seed(1)
    M = GLQuotient(6, 4, 2, metric=metric)
    x = M.random_point()
    frame = M._frame(x)
    gen = torch.Generator().manual_seed(2)
    u = torch.randn(10, 2, dtype=torch.float64, generator=gen)
    v = torch.randn(10, 2, dtype=torch.float64, generator=gen)
    pair_u, pair_v = (u[:6].clone(), u[6:].clone()), (v[:6].clone(), v[6:].clone())
    assert torch.allclose(frame.inner(pair_u, pair_v), frame.inner(u, v), rtol=1e-14, atol=0)
    for method in ("project", "egrad2rgrad"):
        got = getattr(frame, method)(pair_u)
        assert isinstance(got, tuple)
        assert torch.allclose(torch.cat(got), getattr(frame, method)(u), rtol=0, atol=1e-13)
    # and through the face, with arrays as pymanopt passes them
    a = M.projection(x, (u[:6].numpy().copy(), u[6:].numpy().copy()))
    assert np.allclose(np.concatenate(a), frame.project(u).numpy(), rtol=0, atol=1e-13)


def test_non_finite_tangent_is_still_refused(manifold_and_point):
    M, x = manifold_and_point
    u = M.random_tangent_vector(x)
    bad = (u[0].copy(), u[1].copy())
    bad[1][0, 0] = np.nan
    with pytest.raises(InvalidArgument, match="non-finite"):
        M.inner_product(x, u, bad)
    with pytest.raises(StepTooLarge, match="step too large"):
        M.retraction(x, bad)
