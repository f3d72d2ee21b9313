"""The one geometry core: pure torch, batched, device-agnostic. The geoopt and pymanopt classes are
thin faces over these objects."""

from .gl import METRICS, RETRACTIONS, GLFrame, GLQuotientGeometry, as_metric, group_action
from .metrics import GLMetric, InvMetric, MixMetric, mix_geodesic_scale
from .algebra import AlgebraDerivation, GroupDerivation, derive_algebra, derive_group, recognise_algebra
from .groups import FULL_GL, GLGroup, RotaryGroup, SymmetryGroup, as_group, sym
from .subalgebra import (
    OrthogonalGroup,
    ScalarGroup,
    ScaledOrthogonalGroup,
    SubalgebraGroup,
    TrivialGroup,
)
from .errors import GeodesicLeftManifold, LogNotFound
from .logmap import LogResult, distance, log_map
from .rescaling import RescalingFrame, RescalingGeometry

__all__ = [
    "METRICS", "RETRACTIONS", "GLFrame", "GLQuotientGeometry", "GLMetric", "InvMetric", "MixMetric",
    "as_metric", "group_action", "sym", "FULL_GL",
    "GLGroup", "RotaryGroup", "SymmetryGroup", "as_group", "SubalgebraGroup", "TrivialGroup",
    "ScalarGroup", "OrthogonalGroup", "ScaledOrthogonalGroup", "AlgebraDerivation",
    "GroupDerivation", "derive_algebra", "derive_group", "recognise_algebra", "RescalingFrame",
    "RescalingGeometry", "mix_geodesic_scale",
    "GeodesicLeftManifold", "LogNotFound", "LogResult", "log_map", "distance",
]
