"""pymanopt faces of the quotient geometries: ``pymanopt.manifolds.manifold.Manifold`` subclasses
with ``point_layout=2`` that convert numpy ↔ torch and delegate to :mod:`quotient_manifolds.core`
(docs/maths.md §A.5–§A.8). Importing this subpackage imports pymanopt."""

from ._tangent import GLPoint, GLTangentVector, RescalingPoint, RescalingTangentVector
from .diagnostics import patched_diagnostics
from .gl_quotient import GLQuotient
from .rescaling import RescalingQuotient

__all__ = [
    "GLQuotient", "RescalingQuotient", "GLPoint", "GLTangentVector", "RescalingPoint",
    "RescalingTangentVector", "patched_diagnostics",
]
