"""Adapters from real models to the GL(h) quotient: the layout of a model's attention blocks
(``layout``, verified by ``Layout.verify`` and accepted by ``accept_layout``) and adaptive / geodesic
sharpness posed as Riemannian maximisation over a geodesic ball (``sharpness``), with the radius
calibrated (``calibrate_rho``), over many processes (``distributed_sharpness``), as a Hessian
(``riemannian_hessian``, needs curvlinops), as an optimizer (``GeodesicSAM``) and for LoRA training;
tracked during training (``SharpnessMonitor``; in the Hugging Face Trainer ``SharpnessCallback`` and
``GeodesicSAMTrainer``, needs transformers; in Lightning ``LightningSharpnessCallback``) and measured on a saved checkpoint
(``checkpoint_sharpness``);
and Petzka et al.'s relative flatness of one layer (``relative_flatness``), for comparison.

This namespace holds what a user calls. The extension API lives in the submodules: model families
(``adapters.families``: ``Family``, ``register_family``), blocks (``adapters.blocks``: ``GLBlock``,
``FactorPiece``), the solver (``adapters.solver``: ``auto_pgd``, ``average_case``, …), the ball's
components (``adapters.components``: ``ProductBall``, ``QuotientComponent``, …), the ball
(``adapters.ball.build_ball``), the check (``adapters.verify``), the gate from a model to its accepted
layout (``adapters.gate``): each name is imported from the module that defines it.  No public
function is named like a module, so ``import quotient_manifolds.adapters.<module>`` always gives
the module."""

from importlib.util import find_spec as _find_spec

from quotient_manifolds.errors import CheckpointError, SharpnessOutOfMemoryError, SymmetryError, UnsupportedModel

from .layouts import Layout
from .verify import VerifyReport
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
from .monitor import SharpnessMonitor
from .checkpoint import CheckpointSharpness, checkpoint_sharpness
from . import blocks, families, solver  # noqa: F401  (the extension API's modules, as attributes)

__all__ = [
    "layout", "Layout", "detect", "declare_block", "accept_layout", "VerifyReport",
    "sharpness", "sharpness_sweep", "SharpnessResult", "GEOMETRIES", "MEASURES", "next_token_loss",
    "calibrate_rho", "RhoCalibration", "distributed_sharpness", "GeodesicSAM", "SAM_GEOMETRIES",
    "InvariantRiemannianSGD", "lora_quotient_parameters", "merge_back", "SharpnessMonitor",
    "checkpoint_sharpness", "CheckpointSharpness", "relative_flatness", "RelativeFlatness",
    # the errors its calls raise that users catch (the whole family: quotient_manifolds.errors)
    "SymmetryError", "UnsupportedModel", "SharpnessOutOfMemoryError", "CheckpointError",
]

#: Names served by a module with an optional dependency, imported on first use (PEP 562) so that
#: ``from quotient_manifolds import adapters`` does not need it: adapters.hessian needs curvlinops.
_LAZY = {name: "hessian" for name in ("RiemannianHessian", "riemannian_hessian", "top_eigenvalues", "trace")}
if _find_spec("curvlinops") is not None:
    __all__ += list(_LAZY)
#: the Hugging Face Trainer integration (adapters.integrations) needs transformers (the hf extra)
_LAZY.update({name: "integrations" for name in ("SharpnessCallback", "GeodesicSAMTrainer")})
if _find_spec("transformers") is not None:
    __all__ += ["SharpnessCallback", "GeodesicSAMTrainer"]
#: the Lightning callback (adapters.lightning) needs lightning (the lightning extra)
_LAZY["LightningSharpnessCallback"] = "lightning"
if _find_spec("lightning") is not None:
    __all__ += ["LightningSharpnessCallback"]


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
