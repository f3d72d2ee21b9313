r"""geoopt's RiemannianSGD with its momentum buffer started as ``torch.optim.SGD`` starts it.

geoopt 0.5.1's ``RiemannianSGD(momentum > 0)`` creates the momentum buffer on the first step as a
copy of the *Euclidean* gradient, before converting the gradient to a Riemannian one; the first
step then moves along lr·(momentum·∇f + rgrad f). The Euclidean gradient is not a tangent vector of
the quotient: under ``metric="mix"`` it is larger than the Riemannian gradient by the Gram matrices
of the factors (rgrad = (∇_G (HᵀH)⁻¹, ∇_H (GᵀG)⁻¹)), so a learning rate chosen for the Riemannian
gradient overshoots, in a completion run from a relative error of 1.41 to 2·10⁵. Under
``metric="inv"`` it is smaller by the same factors, and the first step is mostly the plain gradient
step. The Euclidean seed also breaks the GL invariance of the iterates (it is a covector).

:class:`RiemannianSGD` starts the buffer as torch's SGD does, at the first (Riemannian) gradient,
buffer₁ = rgrad₁, so that every step moves along the metric's own directions with both metrics;
:func:`init_momentum_buffers` does the same for an optimizer built from geoopt's class. This module
is the one implementation of that fix (``quotient_manifolds.adapters.InvariantRiemannianSGD`` is
this class).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from geoopt.optim import RiemannianLineSearch as _GeooptRiemannianLineSearch
from geoopt.optim import RiemannianSGD as _GeooptRiemannianSGD
from geoopt.tensor import ManifoldParameter, ManifoldTensor

from ..errors import InvalidArgument, InvalidArgumentType
from ..core.errors import StepTooLarge
from ._base import CoreQuotientManifold

__all__ = ["RiemannianSGD", "RiemannianLineSearch", "init_momentum_buffers"]


def _initial_buffer(optimizer: torch.optim.Optimizer, point: torch.Tensor, group: dict
                    ) -> Optional[torch.Tensor]:
    """The buffer that geoopt's update buffer ← momentum·buffer + (1 − dampening)·rgrad turns into
    rgrad at the first step: 0 for ``dampening = 0``, else (dampening / momentum)·rgrad f with the
    gradient (plus weight decay) as geoopt's step forms it; ``None`` when that needs a gradient the
    point does not have yet."""
    dampening = group["dampening"]
    if not dampening:
        return torch.zeros_like(point)
    if point.grad is None:
        return None
    manifold = (point.manifold if isinstance(point, (ManifoldParameter, ManifoldTensor))
                else optimizer._default_manifold)
    grad = point.grad.add(point, alpha=group["weight_decay"])
    return manifold.egrad2rgrad(point, grad).mul_(dampening / group["momentum"])


def _start_buffers(optimizer: torch.optim.Optimizer, *, strict: bool) -> None:
    """Create the missing momentum buffers of ``optimizer`` (:func:`_initial_buffer`); a point that
    needs a gradient it lacks is skipped, or refused with ``strict``."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            if group.get("momentum", 0) <= 0:
                continue
            for point in group["params"]:
                state = optimizer.state[point]
                if "momentum_buffer" in state:
                    continue
                buffer = _initial_buffer(optimizer, point, group)
                if buffer is not None:
                    state["momentum_buffer"] = buffer
                elif strict:
                    raise InvalidArgument(
                        "init_momentum_buffers: with dampening > 0 the first buffer is "
                        "(dampening / momentum)·rgrad f, so every parameter needs its gradient: call "
                        "it after the first backward(), before the first step(), or use "
                        "quotient_manifolds.geoopt.RiemannianSGD, which does it at each step")


def init_momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    r"""Start the momentum buffers of a ``geoopt.optim.RiemannianSGD`` as ``torch.optim.SGD`` does.

    geoopt's update is buffer ← momentum·buffer + (1 − dampening)·rgrad f, and geoopt creates a
    missing buffer as the Euclidean gradient. This sets every missing buffer to the value that makes
    the first buffer rgrad f: 0 when ``dampening = 0`` (possible before any gradient exists), else
    (dampening / momentum)·rgrad f (needs the gradients: call it after the first ``backward()``).
    Existing buffers are left alone; groups without momentum are skipped.
    :class:`RiemannianSGD` calls this at every step, so it needs no call.

    Parameters
    ----------
    optimizer : a ``geoopt.optim.RiemannianSGD`` (any optimizer whose groups have ``momentum``,
        ``dampening`` and ``weight_decay``).

    Raises
    ------
    TypeError
        ``optimizer`` is not a ``torch.optim.Optimizer``.
    ValueError
        ``dampening > 0`` and a parameter has no gradient yet.

    Examples
    --------
    >>> import geoopt, torch
    >>> from quotient_manifolds.geoopt import GLQuotient, init_momentum_buffers
    >>> M = GLQuotient(4, 3, 2)
    >>> x = geoopt.ManifoldParameter(M.random(dtype=torch.float64), manifold=M)
    >>> opt = geoopt.optim.RiemannianSGD([x], lr=0.1, momentum=0.9)
    >>> init_momentum_buffers(opt)
    >>> float(opt.state[x]["momentum_buffer"].abs().sum())
    0.0
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentType(f"optimizer must be a torch.optim.Optimizer (a geoopt.optim.RiemannianSGD), "
                                  f"got {type(optimizer).__name__}")
    _start_buffers(optimizer, strict=True)


class RiemannianSGD(_GeooptRiemannianSGD):
    r"""``geoopt.optim.RiemannianSGD`` whose momentum buffer starts at the Riemannian gradient.

    geoopt seeds the buffer with the Euclidean gradient, so its first step is
    −lr·(momentum·∇f + rgrad f) instead of torch SGD's −lr·rgrad f; under the mix metric that
    overshoots by the Gram matrices of the factors. Here every step first runs the closure (if any,
    with autograd on), then creates the missing buffers (:func:`init_momentum_buffers`:
    buffer₀ = (dampening / momentum)·rgrad f, zero for ``dampening = 0``), so that geoopt's update
    buffer ← momentum·buffer + (1 − dampening)·rgrad f gives buffer₁ = rgrad f, as in
    ``torch.optim.SGD``. Later steps are geoopt's (buffer transported by the manifold's
    ``retr_transp``). Same arguments as geoopt's; with a GL-invariant metric the iterates are
    exactly equivariant: started at x·A they are the iterates from x, moved by A.

    Parameters
    ----------
    params : parameters or parameter groups (``geoopt.ManifoldParameter`` s on a manifold; plain
        parameters are Euclidean).
    lr, momentum, dampening, weight_decay, nesterov, stabilize : as ``geoopt.optim.RiemannianSGD``.

    Raises
    ------
    ValueError
        A negative ``lr``, ``momentum`` or ``weight_decay``, or ``nesterov`` without momentum
        (geoopt's checks); a point that leaves the manifold raises
        :class:`~quotient_manifolds.StepTooLarge` from :meth:`step`.
    TypeError
        ``step`` is given a ``closure`` that is not callable.

    Examples
    --------
    >>> import geoopt, torch
    >>> from quotient_manifolds.geoopt import GLQuotient, RiemannianSGD
    >>> M = GLQuotient(6, 5, 3)
    >>> x = geoopt.ManifoldParameter(M.random(dtype=torch.float64), manifold=M)
    >>> opt = RiemannianSGD([x], lr=1e-2, momentum=0.9)
    >>> def closure():
    ...     opt.zero_grad()
    ...     G, H = M.split(x)
    ...     loss = (G @ H.T).pow(2).sum()
    ...     loss.backward()
    ...     return loss
    >>> first = opt.step(closure).item()
    >>> opt.step(closure).item() < first
    True
    """

    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """One step; ``closure`` (optional) re-evaluates the loss with gradients (it should call
        ``zero_grad()`` and ``backward()``) and its value is returned."""
        if closure is not None and not callable(closure):
            raise InvalidArgumentType(f"closure must be a callable that computes the loss (or None), got "
                                      f"{type(closure).__name__}")
        loss = None
        if closure is not None:
            with torch.enable_grad():   # step() may be called under no_grad; the closure needs autograd
                loss = closure()
        _start_buffers(self, strict=False)   # after the closure: the buffer needs its gradient
        super().step()
        return loss


class RiemannianLineSearch(_GeooptRiemannianLineSearch):
    r"""``geoopt.optim.RiemannianLineSearch`` for which a trial step that leaves the manifold is a
    rejected trial, not an error.

    The search evaluates φ(α) = f(R_x(α η)) at trial step sizes α; on a quotient, R_x(α η) leaves
    the manifold for α too large (a factor loses rank, the incomplete mix geodesic ends), and
    geoopt's search then fails with :class:`~quotient_manifolds.StepTooLarge` at its first trial
    (α = 1). Here such a trial is valued just above φ(0) (the next float): no decrease, so Armijo's
    and Wolfe's sufficient decrease conditions reject it, and the interpolation of both searches
    (the quadratic through φ(0), φ'(0) and φ(α) ≈ φ(0)) tries about α/2 next. The parameters are
    left at x; the step sizes so rejected are in :attr:`rejected_step_sizes`. A forced step
    (``step(closure, force_step=True)`` when no step size was found) that leaves the manifold
    still raises.

    The Wolfe search's slope φ'(α) is taken with the differential of the retraction,
    ⟨grad f(y), DR_x(αη)[η]⟩ (geoopt projects η at y, which misses the −αΓ(η, η) of the
    second-order retraction's velocity). Everything else, arguments included, is geoopt's; the
    closure returns a number (``loss.item()``), as scipy's searches need.

    Parameters
    ----------
    params : parameters or parameter groups (``geoopt.ManifoldParameter`` s on a manifold).
    line_search_method, line_search_params, cg_method, cg_kwargs, compute_derphi,
    transport_grad, transport_search_direction, fallback_stepsize, stabilize : as
        ``geoopt.optim.RiemannianLineSearch`` (``"armijo"`` or ``"wolfe"`` search, steepest descent
        or a conjugate-gradient direction).

    Raises
    ------
    ValueError
        An unknown ``line_search_method`` or ``cg_method`` (geoopt's checks).
    StepTooLarge
        A forced step (``force_step=True``) that leaves the manifold.

    Examples
    --------
    >>> import geoopt, torch
    >>> from quotient_manifolds.geoopt import RescalingQuotient, RiemannianLineSearch
    >>> M = RescalingQuotient(1, metric="mix", retraction="exact")
    >>> x = geoopt.ManifoldParameter(torch.full((2, 1), 2.0, dtype=torch.float64), manifold=M)
    >>> opt = RiemannianLineSearch([x], line_search_method="armijo")
    >>> def closure():
    ...     opt.zero_grad()
    ...     loss = (M.beta(x) - 0.01).pow(2).sum()   # β = u·v from 4 to 0.01: α = 1 crosses 0
    ...     loss.backward()
    ...     return loss.item()
    >>> for _ in range(10):
    ...     loss = opt.step(closure)
    >>> loss < 1e-12, len(opt.rejected_step_sizes) > 0
    (True, True)
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: the trial step sizes whose retraction left the manifold (valued at φ(0), rejected)
        self.rejected_step_sizes: list = []
        self._phi_at_zero = None

    def _init_loss(self, recompute_gradients=False):
        loss, derphi0 = super()._init_loss(recompute_gradients=recompute_gradients)
        self._phi_at_zero = loss
        return loss, derphi0

    def _phi(self, step_size):
        if step_size in self._step_size_dic:
            return self._step_size_dic[step_size]
        start = [point.detach().clone() for point in self._params]
        try:
            value = super()._phi(step_size)
        except StepTooLarge:
            # geoopt moves the parameters one by one: put back those it already moved
            with torch.no_grad():
                for point, saved in zip(self._params, start):
                    point.copy_(saved)
            self.rejected_step_sizes.append(step_size)
            # just above φ(0): rejected even where α·φ'(0) is below φ(0)'s last digit
            value = math.nextafter(float(self._phi_at_zero), math.inf)
            self._step_size_dic[step_size] = value
            return value
        if self.compute_derphi:
            self._exact_derphi(step_size, start)
        return value

    def _exact_derphi(self, step_size, start) -> None:
        """φ'(α) = ⟨grad f(y), DR_x(αη)[η]⟩_y with the differential of the retraction (core
        ``retraction_differential``), replacing geoopt's ⟨grad f(y), P_y(η)⟩: for the second-order
        retraction x + αη − ½α²Γ(η, η) the curve's velocity is η − αΓ(η, η), and the projected η
        missed the −αΓ term, so Wolfe's curvature condition judged the wrong slope."""
        for point, x in zip(self._params, start):
            manifold = getattr(point, "manifold", None)
            state = self.state[point]
            if not isinstance(manifold, CoreQuotientManifold) or "new_grad" not in state:
                continue
            direction = state["search_direction"]
            transported = manifold._frame(x).retraction_differential(step_size * direction, direction)
            state["search_transported"] = transported
            state["der_phi"] = torch.sum(
                manifold.inner(state["new_point"], state["new_grad"], transported)).item()
