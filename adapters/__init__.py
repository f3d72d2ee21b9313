"""Adapters from real models to the GL(h) quotient: layouts of attention blocks (``layout``) and
adaptive / geodesic sharpness posed as Riemannian maximisation over a geodesic ball
(``sharpness``, on top of the generic solver ``auto_pgd``)."""

from .layout import (
    BlockCheck,
    FactorPiece,
    GLBlock,
    Layout,
    SymmetryError,
    Unsupported,
    VerifyReport,
    declare_block,
    default_tolerance,
    primary_output,
)
from .detect import Detection, detect, layout
from .families import Family, Match, register_family, unregister_family
from .sharpness import (
    GEOMETRIES,
    MEASURES,
    SharpnessResult,
    build_ball,
    next_token_loss,
    sharpness,
    sharpness_sweep,
)
from .distributed import distributed_sharpness
from .hessian import RiemannianHessian, elementwise_rhess, riemannian_hessian, top_eigenvalues, trace
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
    "layout", "detect", "Detection", "Family", "Match", "register_family", "unregister_family", "declare_block", "FactorPiece", "GLBlock", "Layout", "Unsupported",
    "VerifyReport", "BlockCheck", "SymmetryError", "default_tolerance", "primary_output",
    "sharpness", "sharpness_sweep", "distributed_sharpness", "next_token_loss", "SharpnessResult", "GEOMETRIES", "MEASURES", "build_ball", "auto_pgd",
    "average_case", "apgd_checkpoints", "APGDResult", "ProductBall", "QuotientComponent",
    "ElementwiseComponent", "GeodesicSAM", "SAM_GEOMETRIES", "riemannian_hessian", "RiemannianHessian",
    "elementwise_rhess", "trace", "top_eigenvalues", "lora_quotient_parameters", "lora_quotient_points",
    "merge_back", "LoRAQuotientPoint", "InvariantRiemannianSGD", "init_momentum_buffers",
]

