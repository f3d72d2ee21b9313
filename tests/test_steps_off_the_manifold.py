"""One error for "the step leaves the manifold" (:class:`quotient_manifolds.StepTooLarge`, the exact
geodesic's ``GeodesicLeftManifold`` among them), and line searches that reject such a trial step
instead of failing (:class:`quotient_manifolds.geoopt.RiemannianLineSearch`)."""

from __future__ import annotations

import geoopt
import pytest
import torch

from quotient_manifolds import StepTooLarge
from quotient_manifolds.core.errors import GeodesicLeftManifold
from quotient_manifolds.geoopt import GLQuotient, RescalingQuotient, RiemannianLineSearch
from quotient_manifolds.errors import InvalidArgument

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_issue_case_is_a_step_too_large():
    """The exact mix geodesic of the rescaling quotient ends at 1 + 2b = 0: retr and expmap past it
    raise StepTooLarge (as GeodesicLeftManifold), saying what to change."""
    M = RescalingQuotient(1, metric="mix", retraction="exact")
    x, u = torch.ones(2, 1, dtype=F64), torch.full((2, 1), -0.6, dtype=F64)
    for move in (M.retr, M.expmap):
        with pytest.raises(StepTooLarge, match="step too large(.|\n)*learning rate") as info:
            move(x, u)
        assert isinstance(info.value, GeodesicLeftManifold)
    assert issubclass(GeodesicLeftManifold, StepTooLarge) and issubclass(StepTooLarge, ValueError)


def test_integrated_geodesic_that_diverges_is_a_step_too_large():
    """The integrated (RK4) geodesic of the GL quotient past the end of the mix geodesic (here
    G = H = e₁ moved along −0.6·x: the closed form is x·√(1 − 1.2t), which ends at t = 5/6) is a
    StepTooLarge too, found by the speed the integration failed to keep (it returned a finite point
    of size 1e19 before); just short of the end it is the closed form. The pymanopt face adds its
    own advice."""
    from quotient_manifolds.pymanopt import RescalingQuotient as PymanoptRescaling

    M = GLQuotient(3, 3, 1, metric="mix")
    x = M.origin(dtype=F64)
    with pytest.raises(StepTooLarge, match="step too large(.|\n)*speed"):
        M.expmap(x, -0.6 * x)
    torch.testing.assert_close(M.expmap(x, -0.3 * x), x * 0.4 ** 0.5, rtol=1e-8, atol=1e-10)
    P = PymanoptRescaling(1, metric="mix")
    point = (torch.ones(1, dtype=F64).numpy(), torch.ones(1, dtype=F64).numpy())
    with pytest.raises(StepTooLarge, match="line_searcher"):
        P.exp(point, P.projection(point, (-0.6 * point[0], -0.6 * point[1])))


def _descend(cls, method, retraction="exact", steps=20):
    M = RescalingQuotient(1, metric="mix", retraction=retraction)
    x = geoopt.ManifoldParameter(torch.full((2, 1), 2.0, dtype=F64), manifold=M)
    opt = cls([x], line_search_method=method)

    def closure():
        opt.zero_grad()
        loss = (M.beta(x) - 0.01).pow(2).sum()   # β from 4 to 0.01: the first trial, α = 1,
        loss.backward()                          # passes the end of the mix geodesic
        return loss.item()

    losses = []
    for _ in range(steps):
        losses.append(opt.step(closure))
        if opt.last_step_size is None or losses[-1] < 1e-20:
            break
    return opt, x, losses


@pytest.mark.parametrize("method", ["armijo", "wolfe"])
def test_line_search_rejects_a_trial_step_off_the_manifold(method):
    """geoopt's search fails at its first trial; ours rejects it, halves, and converges to the
    target in a few steps, the point staying on the manifold."""
    with pytest.raises(StepTooLarge):
        _descend(geoopt.optim.RiemannianLineSearch, method)
    opt, x, losses = _descend(RiemannianLineSearch, method)
    assert opt.rejected_step_sizes and opt.rejected_step_sizes[0] == 1.0
    assert losses[-1] < 1e-20 and len(losses) <= 8
    x.manifold.assert_check_point_on_manifold(x.detach())


def test_rejected_trial_puts_back_every_parameter():
    """geoopt moves the parameters one by one; when a later one leaves the manifold, the ones
    already moved are put back before the next trial (a plain parameter first, then the point)."""
    M = RescalingQuotient(1, metric="mix", retraction="exact")
    w = torch.nn.Parameter(torch.tensor([3.0], dtype=F64))
    x = geoopt.ManifoldParameter(torch.full((2, 1), 2.0, dtype=F64), manifold=M)
    opt = RiemannianLineSearch([w, x], line_search_method="armijo")

    def closure():
        opt.zero_grad()
        loss = (M.beta(x) - 0.01).pow(2).sum() + (w ** 2).sum()
        loss.backward()
        return loss.item()

    opt.closure = closure
    opt._init_loss()
    w0, x0 = w.detach().clone(), x.detach().clone()
    value = opt._phi(1.0)
    assert opt.rejected_step_sizes == [1.0] and value > closure()
    assert torch.equal(w.detach(), w0) and torch.equal(x.detach(), x0)


def test_collapsed_coordinate_is_refused_before_nan():
    """A coordinate whose β = u⊙v underflows when squared (Adam at lr = 1 with amsgrad on the inv
    rescaling quotient drives one there geometrically: u, v ~ 1e-77 after 1680 steps, and the
    projection's products then gave NaN) is refused by name; reached by a step, it is a
    StepTooLarge. Just above the limit the point is accepted."""
    M = RescalingQuotient(3, metric="inv")
    x = torch.tensor([[0.5, 1e-78, 2.0], [1.0, -1e-78, 1.0]], dtype=F64)
    with pytest.raises(InvalidArgument, match=r"β = u⊙v = -1e-156 at index \[1\](.|\n)*collapsed"):
        M.inner(x, torch.zeros_like(x))
    fine = x.clone()
    fine[:, 1] = torch.tensor([1e-76, -1e-76], dtype=F64)
    assert float(M.inner(fine, M.proju(fine, torch.ones_like(fine)))) > 0
    start = fine.clone()
    start[:, 1] = torch.tensor([1e-70, -1e-70], dtype=F64)
    b = torch.zeros_like(start[0])
    b[1] = -8 * torch.log(torch.tensor(10.0, dtype=F64))   # u e^b, v e^b: β × 1e-16
    step = start * b   # horizontal: (b u, b v)
    with pytest.raises(StepTooLarge, match=r"index \[1\]"):
        RescalingQuotient(3, metric="inv", retraction="exact").retr(start, step)


@pytest.mark.parametrize("retraction", ["second_order", "first_order"])
def test_line_search_slope_is_the_derivative_along_the_retraction(retraction):
    """φ'(α) of the Wolfe search equals the finite-difference slope of φ(α) = f(R_x(αη)): with the
    differential of the retraction (η − αΓ(η, η) for the second-order one). geoopt's projected η
    misses the Γ term: its slope is off by far more than the finite-difference error."""
    torch.manual_seed(0)
    M = GLQuotient(6, 5, 2, metric="mix", retraction=retraction)
    target = torch.randn(6, 5, dtype=F64)
    slopes = {}
    for name, cls in (("ours", RiemannianLineSearch), ("geoopt", geoopt.optim.RiemannianLineSearch)):
        x = geoopt.ManifoldParameter(M.random(dtype=F64, generator=torch.Generator().manual_seed(1)),
                                     manifold=M)
        opt = cls([x], line_search_method="wolfe")

        def closure():
            opt.zero_grad()
            G, H = M.split(x)
            loss = ((G @ H.T - target) ** 2).sum()
            loss.backward()
            return loss.item()

        opt.closure = closure
        opt._init_loss()
        alpha, h = 0.3 / M.norm(x, opt.state[x]["search_direction"]).item(), 1e-6
        fd = (opt._phi(alpha * (1 + h)) - opt._phi(alpha * (1 - h))) / (2 * alpha * h)
        opt._phi(alpha)
        slopes[name] = (opt._derphi(alpha), fd)
    derphi, fd = slopes["ours"]
    assert derphi == pytest.approx(fd, rel=1e-6)
    derphi, fd = slopes["geoopt"]
    if retraction == "second_order":
        assert abs(derphi - fd) > 1e-3 * abs(fd)
    else:
        assert derphi == pytest.approx(fd, rel=1e-6)
