"""Adapters from real models to the GL(h) quotient: layouts of attention blocks (``layout``, module
``detection``; ``blocks``, ``layouts``, ``verify``, ``declare``) and adaptive / geodesic sharpness posed as
Riemannian maximisation over a geodesic ball (``sharpness``, module ``worst_case``, on top of the generic
solver ``auto_pgd`` of ``solver``).  No public function is named like a module, so
``import quotient_manifolds.adapters.<module>`` always gives the module."""

from importlib.util import find_spec as _find_spec

from .blocks import FactorPiece, GLBlock
from .layouts import Layout, Unsupported
from .verify import BlockCheck, SymmetryError, VerifyReport, default_tolerance, primary_output
from .declare import declare_block
from .detection import Detection, detect, layout
from .accept import accept_layout
from .families import Family, Match, register_family, unregister_family
from .ball import GEOMETRIES, build_ball
from .losses import next_token_loss
from .options import MEASURES
from .worst_case import SharpnessResult, sharpness, sharpness_sweep
from .calibration import RhoCalibration, calibrate_rho
from .distributed import distributed_sharpness
from .lora_training import (
    InvariantRiemannianSGD,
    LoRAQuotientPoint,
    init_momentum_buffers,
    lora_quotient_parameters,
    lora_quotient_points,
    merge_back,
)
from .sam import SAM_GEOMETRIES, GeodesicSAM
from .solver import (
    APGDResult,
    ElementwiseComponent,
    ProductBall,
    QuotientComponent,
    apgd_checkpoints,
    auto_pgd,
    average_case,
)

__all__ = [
    "layout", "accept_layout", "detect", "Detection", "Family", "Match", "register_family", "unregister_family", "declare_block", "FactorPiece", "GLBlock", "Layout", "Unsupported",
    "VerifyReport", "BlockCheck", "SymmetryError", "default_tolerance", "primary_output",
    "sharpness", "sharpness_sweep", "calibrate_rho", "RhoCalibration", "distributed_sharpness", "next_token_loss", "SharpnessResult", "GEOMETRIES", "MEASURES", "build_ball", "auto_pgd",
    "average_case", "apgd_checkpoints", "APGDResult", "ProductBall", "QuotientComponent",
    "ElementwiseComponent", "GeodesicSAM", "SAM_GEOMETRIES", "lora_quotient_parameters", "lora_quotient_points",
    "merge_back", "LoRAQuotientPoint", "InvariantRiemannianSGD", "init_momentum_buffers",
]

#: Names served by a module with an optional dependency, imported on first use (PEP 562) so that
#: ``from quotient_manifolds import adapters`` does not need it: adapters.hessian needs curvlinops.
_LAZY = {name: "hessian" for name in
         ("RiemannianHessian", "elementwise_rhess", "riemannian_hessian", "top_eigenvalues", "trace")}
if _find_spec("curvlinops") is not None:
    __all__ += list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
