"""The one geometry core: pure torch, batched, device-agnostic. The geoopt and pymanopt classes are
thin faces over these objects."""

from .gl import METRICS, RETRACTIONS, GLFrame, GLQuotientGeometry, group_action
from .groups import FULL_GL, GLGroup, RotaryGroup, as_group, sym
from .rescaling import (
    RescalingFrame,
    RescalingGeometry,
    beta_along_geodesic,
    sharpness_inv_orthonormal_second_order,
    sharpness_mix_orthonormal,
)

__all__ = [
    "METRICS", "RETRACTIONS", "GLFrame", "GLQuotientGeometry", "group_action", "sym", "FULL_GL",
    "GLGroup", "RotaryGroup", "as_group", "RescalingFrame",
    "RescalingGeometry", "beta_along_geodesic", "sharpness_inv_orthonormal_second_order",
    "sharpness_mix_orthonormal",
]
