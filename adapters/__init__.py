"""Adapters from real models to the GL(h) quotient: the layout of a model's attention blocks
(``layout``, verified by ``Layout.verify`` and accepted by ``accept_layout``) and adaptive / geodesic
sharpness posed as Riemannian maximisation over a geodesic ball (``sharpness``), with the radius
calibrated (``calibrate_rho``), over many processes (``distributed_sharpness``), as a Hessian
(``riemannian_hessian``, needs curvlinops), as an optimizer (``GeodesicSAM``) and for LoRA training;
and Petzka et al.'s relative flatness of one layer (``relative_flatness``), for comparison.

This namespace holds what a user calls. The extension API lives in the submodules: model families
(``adapters.families``: ``Family``, ``register_family``), blocks (``adapters.blocks``: ``GLBlock``,
``FactorPiece``), the solver (``adapters.solver``: ``auto_pgd``, ``ProductBall``, …), the ball
(``adapters.ball.build_ball``), the check (``adapters.verify``), the gate from a model to its accepted
layout (``adapters.gate``).  Those names are still served here with a ``DeprecationWarning``.  No
public function is named like a module, so ``import quotient_manifolds.adapters.<module>`` always
gives the module."""

import warnings as _warnings
from importlib.util import find_spec as _find_spec

from .layouts import Layout
from .verify import SymmetryError, VerifyReport
from .declare import declare_block
from .detection import detect, layout
from .accept import accept_layout
from .losses import next_token_loss
from .options import MEASURES
from .ball import GEOMETRIES
from .worst_case import SharpnessResult, sharpness, sharpness_sweep
from .calibration import RhoCalibration, calibrate_rho
from .distributed import distributed_sharpness
from .flatness import RelativeFlatness, relative_flatness
from .lora_training import InvariantRiemannianSGD, lora_quotient_parameters, merge_back
from .sam import SAM_GEOMETRIES, GeodesicSAM
from . import blocks, families, solver  # noqa: F401  (the extension API's modules, as attributes)

__all__ = [
    "layout", "Layout", "detect", "declare_block", "accept_layout", "VerifyReport", "SymmetryError",
    "sharpness", "sharpness_sweep", "SharpnessResult", "GEOMETRIES", "MEASURES", "next_token_loss",
    "calibrate_rho", "RhoCalibration", "distributed_sharpness", "GeodesicSAM", "SAM_GEOMETRIES",
    "InvariantRiemannianSGD", "lora_quotient_parameters", "merge_back", "relative_flatness",
    "RelativeFlatness",
]

#: Names served by a module with an optional dependency, imported on first use (PEP 562) so that
#: ``from quotient_manifolds import adapters`` does not need it: adapters.hessian needs curvlinops.
_LAZY = {name: "hessian" for name in ("RiemannianHessian", "riemannian_hessian", "top_eigenvalues", "trace")}
if _find_spec("curvlinops") is not None:
    __all__ += list(_LAZY)

#: The extension API's former top-level names (0.x), by the submodule that defines them: served
#: with a DeprecationWarning, to be removed in the next minor release.
_MOVED = {
    "Detection": "detection", "Family": "families", "Match": "families", "register_family": "families",
    "unregister_family": "families", "FactorPiece": "blocks", "GLBlock": "blocks", "Unsupported": "layouts",
    "BlockCheck": "verify", "default_tolerance": "verify", "primary_output": "verify", "build_ball": "ball",
    "auto_pgd": "solver", "average_case": "solver", "apgd_checkpoints": "solver", "APGDResult": "solver",
    "ProductBall": "solver", "QuotientComponent": "solver", "ElementwiseComponent": "solver",
    "lora_quotient_points": "lora_training", "LoRAQuotientPoint": "lora_training",
    "init_momentum_buffers": "lora_training", "elementwise_rhess": "hessian",
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _MOVED:
        module = f"{__name__}.{_MOVED[name]}"
        _warnings.warn(f"{__name__}.{name} is deprecated (the extension API moved to the submodules): use "
                       f"{module}.{name}; the top-level name will be removed in the next minor release",
                       DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
