r"""pymanopt face of the elementwise rescaling quotient of diagonal networks (docs/maths.md §8).

Points are pairs (u, v) of numpy arrays of shape (d,) (``point_layout=2``: the cost is written
``def cost(u, v)``); tangent vectors are
:class:`~quotient_manifolds.pymanopt._tangent.RescalingTangentVector` pairs. Every formula lives in
:class:`~quotient_manifolds.core.rescaling.RescalingGeometry`; this class only converts and
delegates.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from ..core.rescaling import RescalingGeometry
from ..core.metrics import GLMetric
from ._base import CoreQuotientManifold
from ._tangent import PairConverter, RescalingPoint, RescalingTangentVector


class RescalingQuotient(CoreQuotientManifold):
    r"""(R∖{0})^d × (R∖{0})^d / (R∖{0})^d, (u, v) ~ (a⊙u, v/a), as a pymanopt manifold.

    Parameters as in the core :class:`~quotient_manifolds.core.rescaling.RescalingGeometry`
    (``metric`` ``"mix"`` | ``"inv"``, ``retraction``, ``eps``). Dimension d; ``typical_dist`` =
    10√d (d independent GL(1) quotients with Manopt's 10k, k = 1, combined like pymanopt's
    ``Product``). ``signs`` (d entries ±1, optional) makes :meth:`random_point` draw from the
    component where β = u⊙v has those signs: the quotient has one component per sign pattern, and
    optimizers that compare random points (``NelderMead``, ``ParticleSwarm``) need them in one.
    ``exp`` is the closed-form geodesic of docs/maths.md §8.3 (ε = 0; the mix one
    needs 1 + 2b > 0 and raises StepTooLarge otherwise); ``log`` and ``dist`` are in closed form
    for ε = 0 (:func:`~quotient_manifolds.core.logmap.log_map`).

    Points are :class:`RescalingPoint` (u, v) and tangent vectors :class:`RescalingTangentVector`
    (ξ_u, ξ_v) of 1-D numpy arrays.

    Parameters
    ----------
    d : number of coordinates.
    metric : ``"mix"`` (default), ``"inv"`` or a :class:`~quotient_manifolds.core.metrics.GLMetric`.
    retraction : ``"second_order"`` (default), ``"first_order"`` or ``"exact"``.
    eps : relaxation ε ≥ 0 (u² + ε in place of u²).
    exact_steps : RK4 steps of the exact retraction when ε > 0.
    signs : d entries ±1 or None (see above).

    Raises
    ------
    ValueError
        ``d`` is not a positive integer, ``eps`` < 0, ``metric`` or ``retraction`` is not one of
        the choices, or ``signs`` is not d entries ±1; a point with a zero entry (ε = 0).

    Examples
    --------
    >>> import numpy as np
    >>> from quotient_manifolds.pymanopt import RescalingPoint, RescalingQuotient
    >>> M = RescalingQuotient(2, metric="inv")
    >>> x = RescalingPoint(np.array([1.0, 2.0]), np.array([1.0, 0.5]))
    >>> u = M.projection(x, (np.array([1.0, 0.0]), np.array([0.0, 1.0])))
    >>> type(u).__name__, round(float(M.norm(x, u)), 6)
    ('RescalingTangentVector', 1.581139)
    >>> M.random_point().u.shape
    (2,)
    """

    _point_cls = RescalingPoint
    _tangent_cls = RescalingTangentVector
    _group = "(R∖{0})^d"

    def __init__(self, d: int, metric: "str | GLMetric" = "mix", retraction: str = "second_order",
                 eps: float = 0.0, exact_steps: int = 32, signs: Optional[Sequence[int]] = None):
        self.geometry = RescalingGeometry(d, metric, retraction=retraction, eps=eps,
                                          exact_steps=exact_steps)
        d = self.geometry.d  # a Python int, as checked there
        self._signs = None
        if signs is not None:   # checked by a draw: the core says what is wrong
            self._signs = torch.as_tensor(np.asarray(signs, dtype=np.float64))
            self.geometry.random_point(dtype=torch.float64, signs=self._signs)
        self._d = d
        self._conv = PairConverter(((d,), (d,)), ("u", "v"))
        name = (f"rescaling quotient of (R*^{d})^2 by (R*)^{d} "
                f"(metric={self.geometry.metric!r}, retraction={retraction!r}, eps={eps})")
        super().__init__(name, self.geometry.dim, point_layout=2)

    @property
    def typical_dist(self) -> float:
        return 10 * math.sqrt(self._d)

    def random_point(self):
        """Core ``geometry.random_point`` (float64, seeded from numpy's global RNG), in the component
        of ``signs`` if given."""
        return self._point(self.geometry.random_point(dtype=torch.float64, signs=self._signs,
                                                      generator=self._generator()))

    #: draws of :meth:`random_tangent_vector` at most before it returns one that leaves
    _DRAWS = 100

    def random_tangent_vector(self, point):
        """A unit-norm horizontal Gaussian vector whose exact geodesic and retraction stay on the
        manifold up to t = 1 (redrawn, at most 100 times, until they do).

        pymanopt's diagnostics step along it with t up to 1, and the mix metric is incomplete: its
        geodesic ends where 1 + 2b reaches 0 for a coordinate (b = ξ_u/u), so an unconditioned unit
        vector at a point with a small β = u⊙v often leaves the manifold before t = 1 (every
        default ``check_gradient`` did, on three seeds of a 4-coordinate problem). For the inv
        metric the geodesic is complete and the first draw is returned."""
        frame = self._frame(point)
        for _ in range(self._DRAWS):
            vector = super().random_tangent_vector(point)
            step = self._tv(vector, "tangent_vector")
            try:
                for method in ("exact", None):
                    self.geometry.frame(frame.retract(step, method))   # validates the new point
            except ValueError:   # StepTooLarge, or a zero coordinate at the new point
                continue
            return vector
        return vector
