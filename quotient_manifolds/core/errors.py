"""The errors of the geometry core that callers catch by type (defined with the library's whole
error family in :mod:`quotient_manifolds.errors`).

:class:`StepTooLarge` is the one error for "the step leaves the manifold", whatever moved along it:
an optimiser's retraction (a non-finite step, a new point with a factor that lost rank or a
collapsed coordinate) or the exact geodesic (:class:`GeodesicLeftManifold`). Line searches reject
such a trial step instead of failing (:class:`quotient_manifolds.geoopt.RiemannianLineSearch`).
:class:`LogNotFound` says that no geodesic joins two points (the logarithm and the distance).
"""

from __future__ import annotations

from ..errors import GeodesicLeftManifold, LogNotFound, StepTooLarge

__all__ = ["StepTooLarge", "GeodesicLeftManifold", "LogNotFound"]
