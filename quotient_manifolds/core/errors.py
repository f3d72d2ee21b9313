"""The errors of the geometry core that callers catch by type.

:class:`StepTooLarge` is the one error for "the step leaves the manifold", whatever moved along it:
an optimiser's retraction (a non-finite step, a new point with a factor that lost rank or a zero
coordinate), the exact geodesic (:class:`GeodesicLeftManifold`), or a log map asked for a point
too far to reach. Line searches reject such a trial step instead of failing
(:class:`quotient_manifolds.geoopt.RiemannianLineSearch`).
"""

from __future__ import annotations

__all__ = ["StepTooLarge", "GeodesicLeftManifold"]


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
