r"""pymanopt face of the elementwise rescaling quotient of diagonal networks (docs/maths.md §8).

Points are pairs (u, v) of numpy arrays of shape (d,) (``point_layout=2``: the cost is written
``def cost(u, v)``); tangent vectors are
:class:`~quotient_manifolds.pymanopt._tangent.RescalingTangentVector` pairs. Every formula lives in
:class:`~quotient_manifolds.core.rescaling.RescalingGeometry`; this class only converts and
delegates.
"""

from __future__ import annotations

import math

from ..core.rescaling import RescalingGeometry
from ..core.metrics import GLMetric
from ._base import CoreQuotientManifold
from ._tangent import PairConverter, RescalingPoint, RescalingTangentVector


class RescalingQuotient(CoreQuotientManifold):
    r"""(R∖{0})^d × (R∖{0})^d / (R∖{0})^d, (u, v) ~ (a⊙u, v/a), as a pymanopt manifold.

    Parameters as in the core :class:`~quotient_manifolds.core.rescaling.RescalingGeometry`
    (``metric`` ``"mix"`` | ``"inv"``, ``retraction``, ``eps``). Dimension d; ``typical_dist`` =
    10√d (d independent GL(1) quotients with Manopt's 10k, k = 1, combined like pymanopt's
    ``Product``). ``exp`` is the closed-form geodesic of docs/maths.md §8.3 (ε = 0; the mix one
    needs 1 + 2b > 0 and raises StepTooLarge otherwise); ``log`` and ``dist`` are in closed form
    for ε = 0 (:func:`~quotient_manifolds.core.logmap.log_map`).
    """

    _point_cls = RescalingPoint
    _tangent_cls = RescalingTangentVector
    _group = "(R∖{0})^d"

    def __init__(self, d: int, metric: "str | GLMetric" = "mix", retraction: str = "second_order",
                 eps: float = 0.0, exact_steps: int = 32):
        self.geometry = RescalingGeometry(d, metric, retraction=retraction, eps=eps,
                                          exact_steps=exact_steps)
        d = self.geometry.d  # a Python int, as checked there
        self._d = d
        self._conv = PairConverter(((d,), (d,)), ("u", "v"))
        name = (f"rescaling quotient of (R*^{d})^2 by (R*)^{d} "
                f"(metric={self.geometry.metric!r}, retraction={retraction!r}, eps={eps})")
        super().__init__(name, self.geometry.dim, point_layout=2)

    @property
    def typical_dist(self) -> float:
        return 10 * math.sqrt(self._d)
