"""Riemannian geometry on the quotient spaces of neural-network symmetries ("Hide & Seek",
arXiv 2505.05409): the GL(h) quotient of attention weights and the rescaling quotient of diagonal
networks.

* :mod:`quotient_manifolds.core`: the one geometry core, pure torch and batched.
* :mod:`quotient_manifolds.geoopt`: geoopt manifolds (:class:`GLQuotient`,
  :class:`RescalingQuotient`), re-exported here.
* :mod:`quotient_manifolds.pymanopt`: pymanopt manifolds; imported lazily (``import
  quotient_manifolds.pymanopt`` or attribute access), so importing this package does not import
  pymanopt.
"""

import importlib

from .core import (
    METRICS,
    RETRACTIONS,
    GLFrame,
    GLQuotientGeometry,
    GLGroup,
    OrthogonalGroup,
    RescalingFrame,
    RescalingGeometry,
    RotaryGroup,
    ScalarGroup,
    ScaledOrthogonalGroup,
    SubalgebraGroup,
    TrivialGroup,
    derive_algebra,
    recognise_algebra,
    beta_along_geodesic,
    sharpness_inv_orthonormal_second_order,
    sharpness_mix_orthonormal,
)
from ._runtime import StepTooLarge
from .geoopt import GLQuotient, RescalingQuotient

__version__ = "0.1.0"

__all__ = [
    "METRICS", "RETRACTIONS", "GLFrame", "GLQuotientGeometry", "GLGroup", "RotaryGroup", "SubalgebraGroup",
    "TrivialGroup", "ScalarGroup", "OrthogonalGroup", "ScaledOrthogonalGroup", "derive_algebra",
    "recognise_algebra", "RescalingFrame",
    "RescalingGeometry", "beta_along_geodesic", "sharpness_inv_orthonormal_second_order",
    "sharpness_mix_orthonormal", "GLQuotient", "RescalingQuotient", "StepTooLarge", "__version__",
]


def __getattr__(name):
    if name == "pymanopt":
        return importlib.import_module(".pymanopt", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
