r"""geoopt face of the elementwise rescaling quotient of diagonal networks (docs/maths.md §8).

A point is ONE tensor ``x = [u; v]`` of shape ``(..., 2, d)`` with every uⁱ, vⁱ ≠ 0; the group
(R∖{0})^d acts by (u, v) ↦ (a⊙u, v/a) and β = u⊙v is the invariant. Every formula lives in
:class:`~quotient_manifolds.core.rescaling.RescalingGeometry`; this class only delegates.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..core.rescaling import RescalingGeometry
from ..core.metrics import GLMetric
from ._base import CoreQuotientManifold

Tensor = torch.Tensor


class RescalingQuotient(CoreQuotientManifold):
    r"""(R∖{0})^d × (R∖{0})^d / (R∖{0})^d as a geoopt manifold (d copies of GL(1),
    docs/maths.md §8).

    The parameters are passed on to the core :class:`~quotient_manifolds.core.rescaling.RescalingGeometry`.

    Parameters
    ----------
    d : number of coordinates.
    metric : ``"mix"`` Σ ξ_uη_u v² + ξ_vη_v u² (default) or ``"inv"`` Σ ξ_uη_u/u² + ξ_vη_v/v²
        (docs/maths.md §8.1), or a :class:`~quotient_manifolds.core.metrics.GLMetric`.
    retraction : ``"second_order"`` (default), ``"first_order"`` or ``"exact"`` (the closed-form
        geodesic of docs/maths.md §8.3 when ε = 0) — used by :meth:`retr`.
    eps : relaxation ε ≥ 0 (u² + ε in place of u²); needed if a coordinate can be 0.

    ``expmap`` is the exact geodesic (closed form for ε = 0; the mix one needs a horizontal vector
    and 1 + 2b > 0), ``transp`` the projection at the new point, ``projx`` the identity,
    ``logmap``/``dist`` in closed form for ε = 0 (b = ½ log(β₁/β₀) for inv, (β₁/β₀ − 1)/2 for mix;
    dist = ∞ between points whose β differ in sign).

    A point is one tensor ``x = [u; v]`` of shape (..., 2, d), β = u⊙v.

    Raises
    ------
    ValueError
        ``d`` is not a positive integer, ``eps`` < 0, or ``metric`` or ``retraction`` is not one of
        the choices; a point with a zero entry (with ``eps`` = 0) or the wrong shape, where one is
        checked.

    Examples
    --------
    >>> import geoopt, torch
    >>> from quotient_manifolds.geoopt import RescalingQuotient
    >>> M = RescalingQuotient(2, metric="inv", retraction="exact")
    >>> x = torch.tensor([[1.0, 2.0], [1.0, 0.5]], dtype=torch.float64)
    >>> u = M.proju(x, torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64))
    >>> y = M.retr(x, u)
    >>> torch.allclose(M.dist(x, y), M.norm(x, u))      # the exact geodesic: length ‖u‖
    True
    >>> p = geoopt.ManifoldParameter(x.clone(), manifold=M)   # for geoopt's optimizers
    """

    name = "RescalingQuotient"
    _group = "(R∖{0})^d"

    def __init__(self, d: int, metric: "str | GLMetric" = "mix", retraction: str = "second_order",
                 eps: float = 0.0, exact_steps: int = 32):
        super().__init__()
        self.geometry = RescalingGeometry(d, metric, retraction=retraction, eps=eps,
                                          exact_steps=exact_steps)
        self.d = self.geometry.d  # a Python int, as checked there

    @property
    def _point_shape(self) -> Tuple[int, int]:
        return (2, self.d)

    def split(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Views (u, v) of x = [u; v]."""
        return x[..., 0, :], x[..., 1, :]

    def pack(self, u: Tensor, v: Tensor) -> Tensor:
        """x = [u; v]."""
        return torch.stack((u, v), dim=-2)

    def beta(self, x: Tensor) -> Tensor:
        """The invariant β = u⊙v (core ``geometry.beta``)."""
        return self.geometry.beta(x)

    def _origin_point(self, dtype, device) -> Tensor:
        """u = v = 1."""
        return torch.ones(2, self.d, dtype=dtype, device=device)

    def extra_repr(self) -> str:
        g = self.geometry
        return f"d={g.d}, metric={g.metric!r}, retraction={g.retraction!r}, eps={g.eps}"
