"""The optimizer contracts a geoopt user relies on, for every manifold and metric: each geoopt
optimizer (and ours) steps with and without a closure, its state dict saves and loads mid-run and
the run goes on identically, a ``ManifoldParameter`` deep-copies with its manifold, and
``quotient_manifolds.geoopt.RiemannianSGD`` is the one momentum fix (the adapters' class is it)."""

from __future__ import annotations

import copy
import io

import geoopt
import pytest
import torch

from quotient_manifolds import adapters
from quotient_manifolds.geoopt import (GLQuotient, RescalingQuotient, RiemannianSGD,
                                       init_momentum_buffers)
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("single_thread")

MANIFOLDS = {
    "gl-mix": lambda: GLQuotient(6, 5, 2, metric="mix"),
    "gl-inv": lambda: GLQuotient(6, 5, 2, metric="inv"),
    "rescaling-mix": lambda: RescalingQuotient(4, metric="mix"),
    "rescaling-inv": lambda: RescalingQuotient(4, metric="inv"),
}


def _start(M, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = M.random(dtype=F64, generator=gen)
    if isinstance(M, RescalingQuotient):   # coordinates away from 0, where the metrics blow up
        x = torch.sign(x) * (0.5 + x.abs())
    return geoopt.ManifoldParameter(x, manifold=M)


def _loss(M, x):
    """An invariant loss: ‖G Hᵀ − T‖² (GL) or ‖u⊙v − β*‖² (rescaling), T and β* fixed."""
    if isinstance(M, RescalingQuotient):
        target = torch.linspace(0.5, 1.5, M.d, dtype=F64) * torch.sign(M.beta(x.detach()))
        return ((M.beta(x) - target) ** 2).sum()
    G, H = M.split(x)
    target = torch.arange(30, dtype=F64).reshape(6, 5).sin()
    return ((G @ H.T - target) ** 2).sum()


OPTIMIZERS = {
    "ours-sgd": lambda p: RiemannianSGD([p], lr=0.01),
    "ours-momentum": lambda p: RiemannianSGD([p], lr=0.01, momentum=0.9, dampening=0.1),
    "ours-nesterov": lambda p: RiemannianSGD([p], lr=0.01, momentum=0.9, nesterov=True),
    "geoopt-sgd": lambda p: geoopt.optim.RiemannianSGD([p], lr=0.01),
    "geoopt-adam": lambda p: geoopt.optim.RiemannianAdam([p], lr=0.01),
    "geoopt-amsgrad": lambda p: geoopt.optim.RiemannianAdam([p], lr=0.01, amsgrad=True),
}


def _run(M, make, steps, *, closure: bool, x=None, opt=None):
    x = _start(M) if x is None else x
    opt = make(x) if opt is None else opt
    losses = []
    for _ in range(steps):
        def evaluate():
            opt.zero_grad()
            loss = _loss(M, x)
            loss.backward()
            return loss

        if closure:
            losses.append(float(opt.step(evaluate).detach()))
        else:
            losses.append(float(evaluate().detach()))
            opt.step()
    return x, opt, losses


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("manifold", list(MANIFOLDS))
def test_step_with_and_without_closure_is_the_same_run(manifold, name):
    """``step(closure)`` returns the closure's loss and takes the step ``step()`` takes after a
    backward pass (geoopt's contract, torch's too); the loss falls and the point stays valid."""
    M = MANIFOLDS[manifold]()
    x_plain, _, plain = _run(M, OPTIMIZERS[name], 8, closure=False)
    x_closure, _, with_closure = _run(M, OPTIMIZERS[name], 8, closure=True)
    assert with_closure == pytest.approx(plain, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(x_closure.detach(), x_plain.detach(), rtol=1e-12, atol=1e-14)
    assert with_closure[-1] < with_closure[0]
    M.assert_check_point_on_manifold(x_closure.detach())


def test_closure_runs_with_autograd_under_no_grad():
    """The issue's case: a closure that calls backward() works, also when step() itself is called
    inside ``torch.no_grad()``; a non-callable closure is refused by name."""
    M = GLQuotient(6, 5, 3)
    x = geoopt.ManifoldParameter(M.random(dtype=F64), manifold=M)
    opt = RiemannianSGD([x], lr=1e-2, momentum=0.5)

    def closure():
        opt.zero_grad()
        G, H = M.split(x)
        loss = (G @ H.T).pow(2).sum()
        loss.backward()
        return loss

    first = float(opt.step(closure).detach())
    with torch.no_grad():
        second = float(opt.step(closure))
    assert second < first
    with pytest.raises(InvalidArgumentType, match="closure must be a callable"):
        opt.step(1.0)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("manifold", ["gl-mix", "rescaling-inv"])
def test_state_dict_round_trip_continues_the_run(manifold, name):
    """Saved (``torch.save`` of the optimizer's and the module's state dicts) after 3 steps and
    loaded into a fresh optimizer on a fresh parameter, 3 more steps give the very iterates of an
    uninterrupted 6-step run. Adam's to ~1e-7 only: torch's ``load_state_dict`` turns geoopt's
    integer ``state["step"]`` into a float32 tensor, and geoopt then forms the bias corrections
    β^step in float32 (geoopt 0.5.1 with torch ≥ 2; not this library's)."""
    M = MANIFOLDS[manifold]()
    x_full, _, _ = _run(M, OPTIMIZERS[name], 6, closure=False)
    x_half, opt_half, _ = _run(M, OPTIMIZERS[name], 3, closure=False)
    buffer = io.BytesIO()
    torch.save({"x": x_half.detach(), "opt": opt_half.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    x = geoopt.ManifoldParameter(saved["x"].clone(), manifold=M)
    opt = OPTIMIZERS[name](x)
    opt.load_state_dict(saved["opt"])
    if opt_half.state[x_half]:
        assert set(opt.state[x]) == set(opt_half.state[x_half])
    _run(M, OPTIMIZERS[name], 3, closure=False, x=x, opt=opt)
    tol = 1e-6 if "adam" in name or "amsgrad" in name else 1e-12
    torch.testing.assert_close(x.detach(), x_full.detach(), rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("manifold", list(MANIFOLDS))
def test_manifold_parameter_deepcopy_keeps_the_manifold(manifold):
    """``copy.deepcopy`` of a ``ManifoldParameter`` (and of a module holding one) is a new tensor on
    an equal manifold, with the same values, and training the copy leaves the original alone."""
    M = MANIFOLDS[manifold]()
    x = _start(M)
    module = torch.nn.Module()
    module.x = x
    for clone in (copy.deepcopy(x), copy.deepcopy(module).x):
        assert isinstance(clone, geoopt.ManifoldParameter)
        assert type(clone.manifold) is type(M) and repr(clone.manifold) == repr(M)
        assert clone.data_ptr() != x.data_ptr()
        torch.testing.assert_close(clone.detach(), x.detach(), rtol=0, atol=0)
    before = x.detach().clone()
    clone = copy.deepcopy(x)
    _run(clone.manifold, OPTIMIZERS["ours-momentum"], 2, closure=False, x=clone)
    assert torch.equal(x.detach(), before) and not torch.equal(clone.detach(), before)


# ------------------------------------------------------------------------------ the momentum fix
def _gradient_at(M, x0):
    x = geoopt.ManifoldParameter(x0.clone(), manifold=M)
    _loss(M, x).backward()
    return x.grad


@pytest.mark.parametrize("dampening", [0.0, 0.4])
@pytest.mark.parametrize("manifold", ["gl-mix", "rescaling-inv"])
def test_first_buffer_is_the_riemannian_gradient_with_a_closure(manifold, dampening):
    """torch SGD's start (buffer₁ = the gradient, whatever the dampening) with the Riemannian
    gradient, when the gradient comes from a closure (the buffer is created after it ran)."""
    M = MANIFOLDS[manifold]()
    x0 = _start(M).detach()
    x = geoopt.ManifoldParameter(x0.clone(), manifold=M)
    opt = RiemannianSGD([x], lr=1e-3, momentum=0.9, dampening=dampening)

    def closure():
        opt.zero_grad()
        loss = _loss(M, x)
        loss.backward()
        return loss

    opt.step(closure)
    rgrad = M.egrad2rgrad(x0, _gradient_at(M, x0))
    torch.testing.assert_close(opt.state[x]["momentum_buffer"], M.transp(x0, x.detach(), rgrad),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.detach(), M.retr(x0, -1e-3 * rgrad), rtol=1e-12, atol=1e-14)


def test_adapters_sgd_is_the_library_sgd():
    """One implementation: the adapters' optimizer is the library's (its buffer initialiser is
    quotient_manifolds.geoopt.init_momentum_buffers, served from there only)."""
    assert issubclass(adapters.InvariantRiemannianSGD, RiemannianSGD)
    # torch.optim.Optimizer wraps a class's step on its first instance (hooks, profiling), setting
    # the wrapper on that class: what the class runs is still the library's step
    own = [name for name, value in vars(adapters.InvariantRiemannianSGD).items()
           if callable(value) and getattr(value, "__qualname__", "").split(".")[0] == "InvariantRiemannianSGD"]
    assert own == []
    assert adapters.InvariantRiemannianSGD.step.__qualname__ == "RiemannianSGD.step"
    from quotient_manifolds.adapters import lora_training
    assert not hasattr(lora_training, "init_momentum_buffers")


@pytest.mark.parametrize("dampening", [0.0, 0.4])
def test_init_momentum_buffers_on_geoopt_sgd_gives_torch_start(dampening):
    """geoopt's own class with :func:`init_momentum_buffers` (after the first backward) takes the
    steps of ours; with dampening > 0 and no gradient yet it says to call it after backward()."""
    M = MANIFOLDS["gl-mix"]()
    make_geoopt = lambda p: geoopt.optim.RiemannianSGD([p], lr=0.01, momentum=0.9,  # noqa: E731
                                                       dampening=dampening)
    x = _start(M)
    opt = make_geoopt(x)
    if dampening:
        with pytest.raises(InvalidArgument, match="after the first backward"):
            init_momentum_buffers(opt)
    _loss(M, x).backward()
    init_momentum_buffers(opt)
    opt.step()
    _run(M, make_geoopt, 3, closure=False, x=x, opt=opt)
    ours, _, _ = _run(M, lambda p: RiemannianSGD([p], lr=0.01, momentum=0.9, dampening=dampening),
                      4, closure=False)
    torch.testing.assert_close(x.detach(), ours.detach(), rtol=1e-12, atol=1e-14)
    with pytest.raises(InvalidArgumentType, match="torch.optim.Optimizer"):
        init_momentum_buffers([x])


@pytest.mark.parametrize("manifold", ["gl-inv", "rescaling-mix"])
def test_manifold_parameter_torch_save_and_load(manifold):
    """``torch.save`` of a ``ManifoldParameter`` loads back (``weights_only=False``: the file
    holds the manifold object, so only for trusted files; torch's default ``weights_only=True``
    refuses geoopt's rebuild function) as a parameter on an equal manifold, which then works."""
    M = MANIFOLDS[manifold]()
    x = _start(M)
    M.proju(x.detach(), torch.ones_like(x))   # the manifold caches a frame: it must not matter
    buffer = io.BytesIO()
    torch.save(x, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, geoopt.ManifoldParameter) and repr(loaded.manifold) == repr(M)
    assert torch.equal(loaded.detach(), x.detach())
    torch.testing.assert_close(loaded.manifold.proju(loaded.detach(), torch.ones_like(x)),
                               M.proju(x.detach(), torch.ones_like(x)), rtol=0, atol=0)
