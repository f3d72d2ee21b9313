"""Riemannian geometry on the quotient spaces of neural-network symmetries ("Hide & Seek",
arXiv 2505.05409): the GL(h) quotient of attention weights and the rescaling quotient of diagonal
networks.

* :mod:`quotient_manifolds.core`: the one geometry core, pure torch and batched.
* :mod:`quotient_manifolds.geoopt`: geoopt manifolds (:class:`GLQuotient`,
  :class:`RescalingQuotient`), re-exported here.
* :mod:`quotient_manifolds.pymanopt`: pymanopt manifolds; imported lazily (``import
  quotient_manifolds.pymanopt`` or attribute access), so importing this package does not import
  pymanopt.
* :mod:`quotient_manifolds.errors`: the errors the library raises, one family under
  :class:`QuotientManifoldsError`, re-exported here.
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
)
from .errors import (
    CheckpointError,
    GeodesicLeftManifold,
    InvalidArgument,
    InvalidArgumentType,
    LogNotFound,
    NonFiniteLoss,
    NotSupported,
    OutputNotFound,
    QuotientManifoldsError,
    SharpnessOutOfMemoryError,
    StepTooLarge,
    SymmetryError,
    UnknownName,
    UnsupportedModel,
    UsageError,
)
from .geoopt import GLQuotient, RescalingQuotient

__version__ = "0.1.0"

__all__ = [
    "METRICS", "RETRACTIONS", "GLFrame", "GLQuotientGeometry", "GLGroup", "RotaryGroup", "SubalgebraGroup",
    "TrivialGroup", "ScalarGroup", "OrthogonalGroup", "ScaledOrthogonalGroup", "derive_algebra",
    "recognise_algebra", "RescalingFrame",
    "RescalingGeometry", "GLQuotient", "RescalingQuotient", "__version__",
    # the errors (quotient_manifolds.errors)
    "QuotientManifoldsError", "InvalidArgument", "InvalidArgumentType", "UnknownName", "StepTooLarge",
    "GeodesicLeftManifold", "LogNotFound", "SymmetryError", "UnsupportedModel", "OutputNotFound",
    "NotSupported", "SharpnessOutOfMemoryError", "NonFiniteLoss", "UsageError", "CheckpointError",
]


def __getattr__(name):
    if name == "pymanopt":
        return importlib.import_module(".pymanopt", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
