"""The closed-form backward of the second-order retraction y = x + u − ½Γ_x(u, u) (the core's
``_SecondOrderRetraction`` / ``second_order_retraction_vjp``): exact against finite differences
(gradcheck, and gradgradcheck for a double backward) and equal to autograd through the paper's
polarised Christoffel formula, for both metrics, ε = 0 and > 0, n = m (one batched product for G and
H) and n ≠ m, batched heads, every group the frame supports (the retraction does not depend on it),
broadcast tangents and float32 tangents."""

from __future__ import annotations

import itertools

import pytest
import torch

from quotient_manifolds.core import GLQuotientGeometry
from quotient_manifolds.core.gl import second_order_retraction_vjp

GROUPS = ["gl", "rope"]


pytestmark = pytest.mark.usefixtures("single_thread")


def polarised_retraction(frame, u):
    """x + u − ½Γ(u, u) with Γ from the two-argument (polarised) formula of each metric, which the
    closed form does not use: autograd through it is the reference."""
    uc = u.to(frame.cdtype)
    uG, uH = frame.geometry.split(uc)
    gamma = torch.cat(frame.gl_metric.christoffel(frame, uG, uH, uG, uH), dim=-2)
    return frame.x + uc - 0.5 * gamma


CASES = list(itertools.product(["inv", "mix"], [(6, 6), (7, 5)], [0.0, 0.3], GROUPS, [(), (3,)]))


@pytest.mark.parametrize("metric,shape,eps,group,batch", CASES,
                         ids=[f"{c[0]}-{c[1][0]}x{c[1][1]}-eps{c[2]}-{c[3]}-b{len(c[4])}" for c in CASES])
def test_closed_form_backward_matches_autograd_and_finite_differences(metric, shape, eps, group, batch):
    n, m = shape
    geometry = GLQuotientGeometry(n, m, 4, metric, eps=eps, group=group)
    gen = torch.Generator().manual_seed(CASES.index((metric, shape, eps, group, batch)))
    x = geometry.random_point(*batch, dtype=torch.float64, generator=gen)
    frame = geometry.frame(x)
    u = 0.3 * torch.randn(x.shape, dtype=torch.float64, generator=gen)
    y_bar = torch.randn(x.shape, dtype=torch.float64, generator=gen)

    closed = u.clone().requires_grad_()
    y = frame.retract(closed)
    assert y.grad_fn is not None and "SecondOrderRetraction" in type(y.grad_fn).__name__
    (g_closed,) = torch.autograd.grad(y, closed, y_bar)
    ref = u.clone().requires_grad_()
    y_ref = polarised_retraction(frame, ref)
    (g_ref,) = torch.autograd.grad(y_ref, ref, y_bar)
    assert (y - y_ref).abs().max() <= 1e-12 * y_ref.abs().max()
    assert (g_closed - g_ref).abs().max() <= 1e-12 * g_ref.abs().max()
    # the same product, called directly, with and without the forward's coefficient
    assert torch.allclose(second_order_retraction_vjp(frame, u, y_bar), g_ref, rtol=0, atol=1e-12)

    leaf = u.clone().requires_grad_()
    assert torch.autograd.gradcheck(frame.retract, (leaf,))
    assert torch.autograd.gradgradcheck(frame.retract, (leaf,))


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_broadcast_and_float32_tangents(metric):
    """A tangent shared by all heads gets the summed gradient; a float32 tangent at a float32 point
    gets a float32 gradient (the work is in float64 either way)."""
    geometry = GLQuotientGeometry(5, 5, 2, metric)
    gen = torch.Generator().manual_seed(3)
    x = geometry.random_point(4, dtype=torch.float64, generator=gen)
    frame = geometry.frame(x)
    u = 0.2 * torch.randn(10, 2, dtype=torch.float64, generator=gen)
    y_bar = torch.randn(4, 10, 2, dtype=torch.float64, generator=gen)
    shared = u.clone().requires_grad_()
    (g,) = torch.autograd.grad(frame.retract(shared), shared, y_bar)
    per_head = u.expand(4, 10, 2).clone().requires_grad_()
    (g_heads,) = torch.autograd.grad(polarised_retraction(frame, per_head), per_head, y_bar)
    assert g.shape == u.shape and torch.allclose(g, g_heads.sum(0), rtol=0, atol=1e-12)

    frame32 = geometry.frame(x.float())
    u32 = u.float().expand(4, 10, 2).clone().requires_grad_()
    y32 = frame32.retract(u32)
    (g32,) = torch.autograd.grad(y32, u32, y_bar.float())
    assert y32.dtype == torch.float32 and g32.dtype == torch.float32
    assert torch.allclose(g32.double(), g_heads, rtol=1e-5, atol=1e-5)


def test_point_with_gradient_keeps_autograd():
    """When the point itself needs a gradient, autograd records the forward (the closed form
    treats x as fixed) and both gradients are right."""
    geometry = GLQuotientGeometry(5, 4, 2, "mix")
    gen = torch.Generator().manual_seed(4)
    x = geometry.random_point(dtype=torch.float64, generator=gen).requires_grad_()
    u = (0.2 * torch.randn(x.shape, dtype=torch.float64, generator=gen)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: geometry.frame(a).retract(b), (x, u))


@pytest.mark.parametrize("metric,shape,eps,group,batch", CASES,
                         ids=[f"{c[0]}-{c[1][0]}x{c[1][1]}-eps{c[2]}-{c[3]}-b{len(c[4])}" for c in CASES])
def test_closed_form_riemannian_gradient_is_the_projected_metric_gradient_of_the_vjp(
        metric, shape, eps, group, batch):
    """``second_order_riemannian_gradient`` (the gradient without forming the VJP, the projection
    from h×h products) equals egrad2rgrad of the autograd gradient of ξ ↦ ⟨ȳ, R(ξ)⟩ through the
    polarised formula, with the forward's Gram products and without; ``second_order_step`` is
    the retraction; ``inners`` are the metric's inner products, and so are the two that
    ``second_order_gradient_and_inners`` forms from h×h matrices."""
    from quotient_manifolds.core.gl import (second_order_gradient_and_inners,
                                            second_order_riemannian_gradient, second_order_step)

    n, m = shape
    geometry = GLQuotientGeometry(n, m, 4, metric, eps=eps, group=group)
    gen = torch.Generator().manual_seed(100 + CASES.index((metric, shape, eps, group, batch)))
    x = geometry.random_point(*batch, dtype=torch.float64, generator=gen)
    frame = geometry.frame(x)
    u = frame.project(0.3 * torch.randn(x.shape, dtype=torch.float64, generator=gen))
    y_bar = torch.randn(x.shape, dtype=torch.float64, generator=gen)
    ref = u.clone().requires_grad_()
    (egrad,) = torch.autograd.grad(polarised_retraction(frame, ref), ref, y_bar)
    want = frame.egrad2rgrad(egrad)

    y, grams = second_order_step(frame, u)
    assert (y - frame.retract(u)).abs().max() <= 1e-13 * y.abs().max()
    for given in (grams, None):
        got = second_order_riemannian_gradient(frame, u, y_bar, given)
        assert (got - want).abs().max() <= 1e-11 * want.abs().max()
    assert frame.horizontal_residual(got).max() < 1e-10
    g, sq, dot = second_order_gradient_and_inners(frame, u, y_bar, grams)
    assert torch.equal(g, second_order_riemannian_gradient(frame, u, y_bar, grams))
    scale = float(frame.inner(g, g).abs().max())
    assert torch.allclose(sq, frame.inner(g, g), rtol=1e-11, atol=0)
    assert torch.allclose(dot, frame.inner(g, u), rtol=1e-10, atol=1e-11 * scale)
    v = torch.randn(x.shape, dtype=torch.float64, generator=gen)
    both = frame.inners(got, got, v)
    assert torch.allclose(both[0], frame.inner(got, got), rtol=1e-13, atol=0)
    assert torch.allclose(both[1], frame.inner(got, v), rtol=1e-12, atol=1e-12 * float(both[0].abs().max()))


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("shape", [(6, 6), (7, 5)], ids=["paired", "unpaired"])
def test_a_frame_that_keeps_the_weights_dtype_gives_the_float64_frames_numbers(metric, shape):
    """A ``keep_dtype`` frame (the sharpness engine's: a float32 point, promoted where it is
    used) gives the step, its Gram products, the gradient, its inner products and ‖u‖² of a frame
    at the same point in float64, to rounding."""
    from quotient_manifolds.core.gl import (second_order_gradient_and_inners,
                                            second_order_riemannian_gradient, second_order_step)

    n, m = shape
    geometry = GLQuotientGeometry(n, m, 3, metric)
    gen = torch.Generator().manual_seed(7)
    x = geometry.random_point(4, dtype=torch.float32, generator=gen)
    kept, wide = geometry.frame(x, keep_dtype=True), geometry.frame(x.double())
    assert kept.x.dtype == torch.float64 and kept._x.dtype == torch.float32
    u = kept.project(0.2 * torch.randn(x.shape, generator=gen)).float()
    y_bar = torch.randn(x.shape, generator=gen)

    def close(a, b):
        assert a.dtype == b.dtype == torch.float64
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), (a - b).abs().max()

    y, grams = second_order_step(kept, u)
    y_want, grams_want = second_order_step(wide, u.double())
    close(y, y_want)
    for a, b in zip(grams, grams_want):
        close(a, b)
    for given in (grams, None):
        close(second_order_riemannian_gradient(kept, u, y_bar, given),
              second_order_riemannian_gradient(wide, u.double(), y_bar.double(), given))
        for a, b in zip(second_order_gradient_and_inners(kept, u, y_bar, given),
                        second_order_gradient_and_inners(wide, u.double(), y_bar.double(), given)):
            close(a, b)
    (sq, grams), (sq_want, grams_want) = kept.norm_sq_and_grams(u), wide.norm_sq_and_grams(u.double())
    close(sq, sq_want)
    for a, b in zip(grams, grams_want):
        close(a, b)
    close(kept.retract(u.double(), "second_order"), wide.retract(u.double(), "second_order"))
