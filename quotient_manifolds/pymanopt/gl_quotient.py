r"""pymanopt face of the GL(h) two-factor quotient (docs/maths.md §A.5–§A.7).

Points are pairs (G, H) of numpy arrays of shapes (n, h) and (m, h) (``point_layout=2``: a
``@pymanopt.function.*`` cost is written ``def cost(G, H)``); tangent vectors are
:class:`~quotient_manifolds.pymanopt._tangent.GLTangentVector` pairs with arithmetic. Every formula
lives in :class:`~quotient_manifolds.core.gl.GLQuotientGeometry`; this class only converts and
delegates (see :mod:`quotient_manifolds.pymanopt._base`).
"""

from __future__ import annotations

from ..core.gl import GLQuotientGeometry
from ..core.groups import Group
from ..core.metrics import GLMetric
from ._base import CoreQuotientManifold
from ._tangent import GLPoint, GLTangentVector, PairConverter


class GLQuotient(CoreQuotientManifold):
    r"""The quotient :math:`\mathbb{R}_*^{n\times h}\times\mathbb{R}_*^{m\times h}\,/\,\mathrm{GL}(h)`,
    :math:`(G, H) \sim (G A, H A^{-\top})`, as a pymanopt manifold.

    Parameters as in the core :class:`~quotient_manifolds.core.gl.GLQuotientGeometry`: ``metric``
    ``"mix"`` (Manopt ``fixedrankfactory_2factors_preconditioned``) or ``"inv"``
    (``fixedrankfactory_2factors``); ``retraction`` ``"second_order"`` (default),
    ``"first_order"`` or ``"exact"``; ``eps`` the Gram relaxation (docs/maths.md §6.4); ``group``
    ``"gl"`` (default), ``"rope"`` (rotary commutant) or a group object
    (:mod:`quotient_manifolds.core.groups`).

    Dimension (n+m)h − dim(group) ((n+m)h − h² for GL(h)), ``typical_dist`` = 10h (Manopt's ``typicaldist = 10k``).
    ``exp`` is the exact (numerically integrated) geodesic, ``transport`` the projection at the
    target point; ``log`` shoots along that geodesic to the orbit of the second point and
    ``dist`` is its length (group GL(h) only; :func:`~quotient_manifolds.core.logmap.log_map`).

    Points are :class:`GLPoint` (G, H) and tangent vectors :class:`GLTangentVector` (ξ_G, ξ_H) of
    numpy arrays.

    Parameters
    ----------
    n, m, h : shapes of G (n×h) and H (m×h), h ≤ min(n, m).
    metric : ``"mix"`` (default), ``"inv"`` or a :class:`~quotient_manifolds.core.metrics.GLMetric`.
    retraction : ``"second_order"`` (default), ``"first_order"`` or ``"exact"``.
    eps : Gram relaxation ε ≥ 0.
    exact_steps : RK4 steps of the integrated geodesic.
    group : ``"gl"`` (default), ``"rope"`` or a group object.

    Raises
    ------
    ValueError
        A size is not a positive integer, h > min(n, m), ``eps`` < 0, or ``metric``,
        ``retraction`` or ``group`` is not one of the choices; a point of the wrong shape or with
        a rank-deficient factor.

    Examples
    --------
    >>> import pymanopt
    >>> from quotient_manifolds.pymanopt import GLQuotient
    >>> M = GLQuotient(4, 3, 2)
    >>> M.dim                                           # (4 + 3)·2 − 2²
    10
    >>> x = M.random_point()
    >>> u = M.random_tangent_vector(x)                  # unit norm, horizontal
    >>> round(float(M.norm(x, u)), 6)
    1.0
    >>> y = M.retraction(x, 0.1 * u)
    >>> type(y).__name__, y.G.shape, y.H.shape
    ('GLPoint', (4, 2), (3, 2))
    """

    _point_cls = GLPoint
    _tangent_cls = GLTangentVector
    _group = "GL(h)"
    _pairs = True

    def __init__(self, n: int, m: int, h: int, metric: "str | GLMetric" = "mix",
                 retraction: str = "second_order", eps: float = 0.0, exact_steps: int = 32,
                 group: "str | Group | None" = None):
        self.geometry = GLQuotientGeometry(n, m, h, metric, retraction=retraction, eps=eps,
                                           exact_steps=exact_steps, group=group)
        n, m, h = self.geometry.n, self.geometry.m, self.geometry.h  # Python ints, as checked there
        self._group = self.geometry.group.describe(h)
        self._n, self._m, self._h = n, m, h
        self._conv = PairConverter(((n, h), (m, h)))
        name = (f"{self._group} quotient of R*^({n}x{h}) x R*^({m}x{h}) "
                f"(metric={self.geometry.metric!r}, retraction={retraction!r}, eps={eps})")
        super().__init__(name, self.geometry.dim, point_layout=2)

    @property
    def typical_dist(self) -> float:
        return 10 * self._h
