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
)
from .distributed import distributed_sharpness
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
    "sharpness", "distributed_sharpness", "SharpnessResult", "GEOMETRIES", "MEASURES", "build_ball", "auto_pgd",
    "average_case", "apgd_checkpoints", "APGDResult", "ProductBall", "QuotientComponent",
    "ElementwiseComponent",
]
