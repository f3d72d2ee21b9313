"""The errors of the geometry core that callers catch by type.

:class:`StepTooLarge` is the one error for "the step leaves the manifold", whatever moved along it:
an optimiser's retraction (a non-finite step, a new point with a factor that lost rank or a
collapsed coordinate) or the exact geodesic (:class:`GeodesicLeftManifold`). Line searches reject
such a trial step instead of failing (:class:`quotient_manifolds.geoopt.RiemannianLineSearch`).
:class:`LogNotFound` says that no geodesic joins two points (the logarithm and the distance).
"""

from __future__ import annotations

__all__ = ["StepTooLarge", "GeodesicLeftManifold", "LogNotFound"]


class StepTooLarge(ValueError):
    """A move left the manifold: the new point has non-finite values or a factor that lost
    rank. The step (the optimiser's learning rate times its direction) was too large.

    Example
    -------
    >>> import torch
    >>> from quotient_manifolds import RescalingQuotient, StepTooLarge
    >>> M = RescalingQuotient(1, metric="mix", retraction="exact")
    >>> x, u = torch.ones(2, 1, dtype=torch.float64), torch.full((2, 1), -0.6, dtype=torch.float64)
    >>> try:
    ...     M.retr(x, u)
    ... except StepTooLarge as err:
    ...     print(type(err).__name__)
    GeodesicLeftManifold
    """


class GeodesicLeftManifold(StepTooLarge):
    """The exact geodesic left the manifold (a factor lost full rank, or the closed form passed its
    end, as the incomplete mix geodesic does at 1 + 2b = 0) or diverged within the step asked for:
    the step is too long for this point."""


class LogNotFound(ValueError):
    """No geodesic from x to y was found: the logarithm log_x(y) (and so dist(x, y)) is not known.

    The points lie in different components of the quotient (the sign of β = u⊙v differs for the
    rescaling quotient), or the shooting method did not converge: y is too far from x, beyond where
    the geodesics from x stay on the manifold (the mix metric is incomplete). ``report`` is the
    :class:`~quotient_manifolds.core.logmap.LogResult` of the failed solve, or ``None``."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
