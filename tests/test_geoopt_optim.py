"""The geoopt optimisation path: :class:`quotient_manifolds.geoopt.RiemannianSGD` starts its
momentum buffer at the Riemannian gradient (geoopt 0.5.1 starts it at the Euclidean one, which
overshoots under the mix metric), and the README's geoopt example converges from 20 random starts
for both metrics with SGD (the README's learning rates) and with RiemannianAdam (the user guide's
rule: lr = ‖G₀H₀ᵀ‖_F under mix, 1 under inv)."""

from __future__ import annotations

import pathlib
import re

import geoopt
import pytest
import torch

from quotient_manifolds import GLQuotient
from quotient_manifolds.geoopt import RiemannianSGD

ROOT = pathlib.Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("single_thread")


def _large_point(M, seed):
    """A point whose Gram matrices have eigenvalues ~25, so that the Euclidean gradient and the
    mix Riemannian gradient differ by that factor."""
    gen = torch.Generator().manual_seed(seed)
    return 5 * M.random(M.n + M.m, M.h, dtype=torch.float64, generator=gen)


def _one_step(cls, M, x0, target, **kwargs):
    x = geoopt.ManifoldParameter(x0.clone(), manifold=M)
    opt = cls([x], **kwargs)
    G, H = M.split(x)
    (0.5 * ((G @ H.T - target) ** 2).sum()).backward()
    opt.step()
    return x.detach(), opt


@pytest.mark.parametrize("metric", ["mix", "inv"])
@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_first_momentum_step_is_the_riemannian_gradient_step(metric, dampening):
    """With the buffer started at rgrad, the first step equals plain SGD's −lr·rgrad step, and the
    buffer is rgrad transported to the new point; geoopt's own first step (Euclidean seed) is not,
    and under mix it is much longer."""
    M = GLQuotient(12, 9, 3, metric=metric)
    x0 = _large_point(M, 0)
    target = torch.randn(12, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lr = {"mix": 0.05, "inv": 2e-5}[metric]
    plain, _ = _one_step(geoopt.optim.RiemannianSGD, M, x0, target, lr=lr)
    ours, opt = _one_step(RiemannianSGD, M, x0, target, lr=lr, momentum=0.9, dampening=dampening)
    theirs, _ = _one_step(geoopt.optim.RiemannianSGD, M, x0, target, lr=lr, momentum=0.9,
                          dampening=dampening)
    assert torch.allclose(ours, plain, rtol=0, atol=1e-12)
    x = geoopt.ManifoldParameter(x0.clone(), manifold=M)
    G, H = M.split(x)
    (0.5 * ((G @ H.T - target) ** 2).sum()).backward()
    rgrad = M.egrad2rgrad(x0, x.grad)
    buffer = opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"]
    assert torch.allclose(buffer, M.transp(x0, ours, rgrad), rtol=0, atol=1e-10)
    step = lambda y: float(M.norm(x0, y - x0))  # noqa: E731
    if metric == "mix":
        assert step(theirs) > 5 * step(plain)   # the pitfall: the Euclidean seed overshoots
    else:
        assert not torch.allclose(theirs, plain, rtol=0, atol=1e-12)


def test_plain_parameters_and_no_momentum_are_geoopt():
    """For Euclidean parameters the seed gives torch SGD's first step too; momentum=0 is geoopt's
    step unchanged."""
    w0 = torch.randn(5, dtype=torch.float64)
    target = torch.randn(5, dtype=torch.float64)
    steps = {}
    for name, cls, kw in (("torch", torch.optim.SGD, dict(momentum=0.9)),
                          ("ours", RiemannianSGD, dict(momentum=0.9)),
                          ("ours-0", RiemannianSGD, {}), ("geoopt-0", geoopt.optim.RiemannianSGD, {})):
        w = torch.nn.Parameter(w0.clone())
        opt = cls([w], lr=0.1, **kw)
        for _ in range(3):
            opt.zero_grad()
            ((w - target) ** 2).sum().backward()
            opt.step()
        steps[name] = w.detach()
    assert torch.allclose(steps["ours"], steps["torch"], rtol=0, atol=1e-14)
    assert torch.equal(steps["ours-0"], steps["geoopt-0"])


def _readme_example():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (code,) = [b for b in blocks if "relative error on all entries" in b and "geoopt" in b]
    return code


def _readme_settings():
    code = _readme_example()
    lr = eval(re.search(r"^lr = (\{.*?\})\[metric\]", code, flags=re.M).group(1))  # noqa: S307
    momentum = float(re.search(r"momentum=([0-9.]+)", code).group(1))
    steps = int(re.search(r"for step in range\((\d+)\)", code).group(1))
    n, m, h = map(int, re.search(r"^n, m, h = (\d+), (\d+), (\d+)", code, flags=re.M).groups())
    optimizer = re.search(r"opt = (\S+)\(\[x\]", code).group(1)
    return lr, momentum, steps, (n, m, h), optimizer


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_readme_example_from_20_random_starts(metric, optimizer):
    """The README's problem (seed 0: target and mask) from 20 random starts at once (a batch of 20
    independent quotient points; both optimizers act on each point separately): every start
    reaches a relative error below 1e-5 on all entries in the README's number of steps."""
    lr, momentum, steps, (n, m, h), readme_optimizer = _readme_settings()
    torch.manual_seed(0)
    target = torch.randn(n, h) @ torch.randn(h, m)
    mask = torch.rand(n, m) < 0.6
    M = GLQuotient(n, m, h, metric=metric)
    x = geoopt.ManifoldParameter(M.random(20, n + m, h, dtype=torch.float64), manifold=M)
    if optimizer == "sgd":
        assert readme_optimizer == "RiemannianSGD"
        opt = RiemannianSGD([x], lr=lr[metric], momentum=momentum)
    else:
        G0, H0 = M.split(x.detach())
        # the user guide's rule: Adam's lr is a step length in the metric, ‖G₀H₀ᵀ‖_F under mix
        adam_lr = float((G0 @ H0.mT).flatten(1).norm(dim=1).mean()) if metric == "mix" else 1.0
        opt = geoopt.optim.RiemannianAdam([x], lr=adam_lr)
    for _ in range(steps):
        opt.zero_grad()
        G, H = M.split(x)
        (0.5 * ((G @ H.mT - target)[:, mask] ** 2).sum()).backward()
        opt.step()
    G, H = M.split(x.detach())
    errors = (G @ H.mT - target).flatten(1).norm(dim=1) / target.norm()
    assert float(errors.max()) < 1e-5, errors
