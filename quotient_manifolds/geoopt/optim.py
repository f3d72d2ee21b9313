r"""geoopt's RiemannianSGD with its momentum buffer started at the Riemannian gradient.

geoopt 0.5.1's ``RiemannianSGD(momentum > 0)`` creates the momentum buffer on the first step as a
copy of the *Euclidean* gradient, before converting the gradient to a Riemannian one; the first
step then moves along lr·(momentum·∇f + rgrad f). The Euclidean gradient is not a tangent vector of
the quotient: under ``metric="mix"`` it is larger than the Riemannian gradient by the Gram matrices
of the factors (rgrad = (∇_G (HᵀH)⁻¹, ∇_H (GᵀG)⁻¹)), so a learning rate chosen for the Riemannian
gradient overshoots, in a completion run from a relative error of 1.41 to 2·10⁵. Under
``metric="inv"`` it is smaller by the same factors, and the first step is mostly the plain gradient
step.

:class:`RiemannianSGD` starts the buffer as torch's SGD does, at the first (Riemannian) gradient:
buffer₁ = rgrad₁, so every step moves along the metric's own directions with both metrics. It is a
drop-in replacement; everything else is geoopt's.
"""

from __future__ import annotations

import torch
from geoopt.optim import RiemannianSGD as _GeooptRiemannianSGD
from geoopt.tensor import ManifoldParameter, ManifoldTensor

__all__ = ["RiemannianSGD"]


class RiemannianSGD(_GeooptRiemannianSGD):
    r"""``geoopt.optim.RiemannianSGD`` whose momentum buffer starts at the Riemannian gradient.

    geoopt seeds the buffer with the Euclidean gradient, so its first step is
    −lr·(momentum·∇f + rgrad f) instead of torch SGD's −lr·rgrad f; under the mix metric that
    overshoots by the Gram matrices of the factors. Here the buffer of a parameter is created before
    geoopt's step as (dampening / momentum)·rgrad f (zero for ``dampening=0``), so that geoopt's
    update buffer ← momentum·buffer + (1 − dampening)·rgrad f gives buffer₁ = rgrad f, as in
    ``torch.optim.SGD``. Later steps are geoopt's (buffer transported by the manifold's
    ``retr_transp``). Same arguments as geoopt's.
    """

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            momentum, dampening = group["momentum"], group["dampening"]
            if momentum <= 0:
                continue
            for point in group["params"]:
                if point.grad is None or len(self.state[point]) != 0:
                    continue
                self.state[point]["momentum_buffer"] = self._initial_buffer(point, group)
        return super().step(closure)

    def _initial_buffer(self, point, group) -> torch.Tensor:
        """(dampening / momentum)·rgrad f at ``point`` (rgrad of the gradient with weight decay,
        as geoopt's step computes it)."""
        if not group["dampening"]:
            return torch.zeros_like(point)
        manifold = (point.manifold if isinstance(point, (ManifoldParameter, ManifoldTensor))
                    else self._default_manifold)
        grad = point.grad.add(point, alpha=group["weight_decay"])
        return manifold.egrad2rgrad(point, grad).mul_(group["dampening"] / group["momentum"])
