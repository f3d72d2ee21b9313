"""With n = m the core works on G and H as one batch of blocks (``(..., 2, n, h)``, one batched
product for both); it must give what the blockwise formulas give (the same methods called with the
pair (u_G, u_H), which take the blockwise path), for both metrics, ε = 0 and > 0, the groups the
frame supports, batched heads and tangents broadcast against the point."""

from __future__ import annotations

import itertools

import pytest
import torch

from quotient_manifolds.core import GLQuotientGeometry

CASES = list(itertools.product(["inv", "mix"], [0.0, 0.3], ["gl", "rope"]))


@pytest.mark.parametrize("metric,eps,group", CASES, ids=[f"{m}-eps{e}-{g}" for m, e, g in CASES])
def test_paired_blocks_equal_blockwise(metric, eps, group):
    geometry = GLQuotientGeometry(6, 6, 4, metric, eps=eps, group=group)
    gen = torch.Generator().manual_seed(CASES.index((metric, eps, group)))
    x = geometry.random_point(3, dtype=torch.float64, generator=gen)
    frame = geometry.frame(x)
    u = torch.randn(2, 3, 12, 4, dtype=torch.float64, generator=gen)   # broadcast over 2 × 3 heads
    v = torch.randn(2, 3, 12, 4, dtype=torch.float64, generator=gen)
    pair = lambda t: (t[..., :6, :].clone(), t[..., 6:, :].clone())  # noqa: E731
    close = lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-12 * float(b.abs().max()))  # noqa: E731
    assert close(frame.inner(u, v), frame.inner(pair(u), pair(v)))
    for method in ("project", "egrad2rgrad"):
        assert close(getattr(frame, method)(u), torch.cat(getattr(frame, method)(pair(u)), dim=-2))
    # and what the projection must be: idempotent, horizontal
    p = frame.project(u)
    assert close(frame.project(p), p)
    assert float(frame.horizontal_residual(p).max()) < 1e-10
