"""The one geometry core: pure torch, batched, device-agnostic. The geoopt and pymanopt classes are
thin faces over these objects."""

from .gl import METRICS, RETRACTIONS, GLFrame, GLQuotientGeometry, group_action, sym
from .rescaling import (
    RescalingFrame,
    RescalingGeometry,
    beta_along_geodesic,
    sharpness_inv_orthonormal_second_order,
    sharpness_mix_orthonormal,
)

__all__ = [
    "METRICS", "RETRACTIONS", "GLFrame", "GLQuotientGeometry", "group_action", "sym", "RescalingFrame",
    "RescalingGeometry", "beta_along_geodesic", "sharpness_inv_orthonormal_second_order",
    "sharpness_mix_orthonormal",
]
