"""pymanopt's diagnostics with their default arguments on every manifold and metric
(``check_gradient`` slope 2, ``check_hessian`` slope 3, ``check_retraction`` slope 3 for the
second-order retraction and 2 for the first-order one), under
:func:`quotient_manifolds.pymanopt.patched_diagnostics` (pymanopt 2.2.1's slope finder fails on
numpy 2), and the derivative-free optimizers that need ``log``/``dist``/``pair_mean``."""

from __future__ import annotations

import contextlib
import io
import re

import numpy as np
import pymanopt
import pytest
from pymanopt.tools import diagnostics

from quotient_manifolds.pymanopt import GLQuotient, RescalingQuotient, patched_diagnostics
from quotient_manifolds.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("single_thread")

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def _problem(kind, metric):
    """An invariant least-squares cost with its Euclidean gradient and Hessian."""
    if kind == "gl":
        M = GLQuotient(4, 3, 2, metric=metric, exact_steps=16)
        T = np.sin(np.arange(12.0)).reshape(4, 3)

        @pymanopt.function.numpy(M)
        def cost(G, H):
            return 0.5 * np.sum((G @ H.T - T) ** 2)

        @pymanopt.function.numpy(M)
        def egrad(G, H):
            R = G @ H.T - T
            return R @ H, R.T @ G

        @pymanopt.function.numpy(M)
        def ehess(G, H, dG, dH):
            R, dR = G @ H.T - T, dG @ H.T + G @ dH.T
            return dR @ H + R @ dH, dR.T @ G + R.T @ dG
    else:
        M = RescalingQuotient(4, metric=metric)
        b = np.linspace(0.5, 2.0, 4)

        @pymanopt.function.numpy(M)
        def cost(u, v):
            return 0.5 * np.sum((u * v - b) ** 2)

        @pymanopt.function.numpy(M)
        def egrad(u, v):
            r = u * v - b
            return r * v, r * u

        @pymanopt.function.numpy(M)
        def ehess(u, v, du, dv):
            r, dr = u * v - b, du * v + u * dv
            return dr * v + r * dv, dr * u + r * du
    return pymanopt.Problem(M, cost, euclidean_gradient=egrad, euclidean_hessian=ehess)


@pytest.mark.parametrize("check, slope", [("check_gradient", 2.0), ("check_hessian", 3.0)])
@pytest.mark.parametrize("metric", ["mix", "inv"])
@pytest.mark.parametrize("kind", ["gl", "rescaling"])
def test_gradient_and_hessian_checks_with_defaults(monkeypatch, kind, metric, check, slope):
    """No point, no direction given: pymanopt draws them (on the mix rescaling quotient the unit
    direction used to leave the manifold before h = 1); the fitted slope is the one the check
    expects, and the tangent residual is ~0."""
    np.random.seed(3)
    problem = _problem(kind, metric)
    fits = []
    original = diagnostics.check_directional_derivative

    def spy(*args, **kwargs):
        fits.append(original(*args, **kwargs))
        return fits[-1]

    monkeypatch.setattr(diagnostics, "check_directional_derivative", spy)
    out = io.StringIO()
    with patched_diagnostics(), contextlib.redirect_stdout(out):
        getattr(diagnostics, check)(problem)
    matplotlib.pyplot.close("all")
    (_, error, _, poly), = fits
    if "model is exact" in out.getvalue():
        # β is linear along the mix geodesic of the rescaling quotient, so this cost is quadratic
        # in h and its second-order model exact: pymanopt says so instead of fitting a slope
        assert (kind, metric, check) == ("rescaling", "mix", "check_hessian")
        assert np.all(error < 1e-12)
    else:
        assert poly[0] == pytest.approx(slope, abs=0.05)
    residual = float(re.search(r"close to 0: ([0-9][0-9.e+-]*[0-9])", out.getvalue()).group(1))
    assert residual < 1e-10


@pytest.mark.parametrize("retraction, slope", [("second_order", 3.0), ("first_order", 2.0)])
@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_check_retraction_with_defaults(metric, retraction, slope):
    """``check_retraction(M)`` on the rescaling quotient (closed-form dist); its error curve reaches
    exact zeros at small steps, which the patched slope finder skips."""
    np.random.seed(0)
    M = RescalingQuotient(4, metric=metric, retraction=retraction)
    out = io.StringIO()
    with patched_diagnostics(), contextlib.redirect_stdout(out):
        diagnostics.check_retraction(M)
    found = float(re.search(r"the slope is: ([0-9][0-9.e+-]*[0-9]|nan)", out.getvalue()).group(1))
    assert found == pytest.approx(slope, abs=0.01)


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_gl_retraction_order_through_dist(metric):
    """What ``check_retraction`` measures on the GL quotient (its defaults take 70–120 s there: 251
    shooting solves), on 6 step sizes: dist(exp(x, hd), retr(x, hd)) falls like h³ for the
    second-order retraction and like h² for the first-order one."""
    np.random.seed(1)
    steps = np.logspace(-2.5, -1, 6)
    for retraction, slope in (("second_order", 3.0), ("first_order", 2.0)):
        M = GLQuotient(4, 3, 2, metric=metric, retraction=retraction)
        x = M.random_point()
        d = M.random_tangent_vector(x)
        errors = [M.dist(M.exp(x, h * d), M.retraction(x, h * d)) for h in steps]
        assert np.polyfit(np.log10(steps), np.log10(errors), 1)[0] == pytest.approx(slope, abs=0.1)


def test_random_tangent_vector_stays_on_the_mix_rescaling_quotient():
    """Unit norm, horizontal, and its exact geodesic and retraction reach t = 1, at 20 random
    points (an unconditioned unit vector often leaves: 1 + 2b ≤ 0)."""
    np.random.seed(4)
    M = RescalingQuotient(4, metric="mix")
    for _ in range(20):
        x = M.random_point()
        d = M.random_tangent_vector(x)
        assert M.norm(x, d) == pytest.approx(1.0)
        M.exp(x, d)
        M.retraction(x, d)


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_derivative_free_optimizers_in_one_component(metric):
    """ParticleSwarm and NelderMead (which needs ``pair_mean``) compare random points through
    ``log``/``dist``: with ``signs`` every random point lies in the component of the target."""
    from pymanopt.optimizers import NelderMead, ParticleSwarm

    b = np.array([0.7, -1.3])
    M = RescalingQuotient(2, metric=metric, signs=np.sign(b))

    @pymanopt.function.numpy(M)
    def cost(u, v):
        return float(np.sum((u * v - b) ** 2))

    problem = pymanopt.Problem(M, cost)
    np.random.seed(0)
    start = cost(*M.random_point())
    for optimizer, factor in ((ParticleSwarm(max_iterations=15, verbosity=0), 0.5),
                              (NelderMead(max_iterations=8, verbosity=0), 1.0)):
        result = optimizer.run(problem)
        assert result.cost < factor * start
        assert np.all(np.sign(result.point[0] * result.point[1]) == np.sign(b))
    with pytest.raises(InvalidArgument, match="signs must hold d = 2 entries"):
        RescalingQuotient(2, signs=[1, 0])
