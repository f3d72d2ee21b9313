r"""The options of :func:`~quotient_manifolds.adapters.sharpness` (:class:`SharpnessOptions`), checked once
when built, and the radius ``rho`` (:func:`as_rho`)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from quotient_manifolds.core.gl import RETRACTIONS

from . import validation as check
from .ball import ADAPTIVE_DIRECTIONS, GEOMETRY_TABLE, Geometry, geometry_of, gram_eps_of
from .solver import MOMENTUM_FORMS, STEP_NORMALISATIONS

__all__ = ["MEASURES", "SharpnessOptions", "SHARPNESS_OPTION_NAMES", "sharpness_options", "as_rho"]

Tensor = torch.Tensor

MEASURES = ("worst", "average")


@dataclass(frozen=True)
class SharpnessOptions:
    """The options of :func:`sharpness` (every keyword but ``rho``), checked once when built: an
    unknown name or an out-of-range value is refused before any work, naming the option. The
    meaning of each is documented at :func:`sharpness`; :func:`sharpness_sweep`,
    :func:`~quotient_manifolds.adapters.calibrate_rho` and :func:`run_sharpness` take them as they are."""

    geometry: str = "geodesic-mix"
    n_iters: int = 20
    retraction: str = "second_order"
    loss_fn: Optional[Callable] = None
    measure: str = "worst"
    n_samples: int = 10
    gram_eps: float = 0.0
    use_metric_norm: bool = True
    momentum: str = "apgd"
    step_normalisation: str = "metric"
    adaptive_direction: str = "riemannian"
    elementwise_second_order: bool = False
    normalize_logits: bool = False
    step_size_mult: float = 1.0
    layout: Any = None
    allow_unsupported: bool = False
    unsafe: bool = False
    seed: int = 0
    progress: bool = False
    num_threads: Optional[int] = None
    include_frozen: bool = False
    check_retraction: bool = True
    retraction_tolerance: float = 0.1

    def __post_init__(self) -> None:
        geometry_of(self.geometry)
        check.choice("retraction", self.retraction, RETRACTIONS)
        check.choice("measure", self.measure, MEASURES)
        check.choice("momentum", self.momentum, MOMENTUM_FORMS)
        check.choice("step_normalisation", self.step_normalisation, STEP_NORMALISATIONS)
        check.choice("adaptive_direction", self.adaptive_direction, ADAPTIVE_DIRECTIONS)
        check.positive_finite("step_size_mult", self.step_size_mult)
        check.integer_at_least("n_iters", self.n_iters, 1)
        check.integer_at_least("n_samples", self.n_samples, 1)
        check.integer_at_least("seed", self.seed, -2 ** 63)
        check.non_negative_finite("gram_eps", self.gram_eps)
        check.positive_finite("retraction_tolerance", self.retraction_tolerance)
        if self.num_threads is not None:
            check.integer_at_least("num_threads", self.num_threads, 1)
        check.optional_callable("loss_fn", self.loss_fn, "loss_fn(outputs, targets) -> scalar tensor")
        for name in ("use_metric_norm", "elementwise_second_order", "normalize_logits", "allow_unsupported",
                     "unsafe", "progress", "include_frozen", "check_retraction"):
            check.flag(name, getattr(self, name))
        check.optional_layout("layout", self.layout)
        check.plain_numbers(self, ints=("n_iters", "n_samples", "seed", "num_threads"),
                            floats=("step_size_mult", "gram_eps", "retraction_tolerance"))
        if self.include_frozen and self.layout is not None and getattr(self.layout, "frozen", None):
            raise ValueError("include_frozen=True, but the layout= passed was built without frozen "
                             "parameters, so they would be in no part of the ball; rebuild it with "
                             "layout(model, include_frozen=True), or pass include_frozen=False")

    @classmethod
    def from_keywords(cls, options: Mapping[str, Any], *, stacklevel: int = 3) -> "SharpnessOptions":
        """The options given as keywords of :func:`sharpness` (``eps``, the former name of
        ``gram_eps``, is accepted with a DeprecationWarning issued ``stacklevel`` frames up)."""
        options = dict(options)
        if "eps" in options:
            options["gram_eps"] = gram_eps_of(options.get("gram_eps", 0.0), options.pop("eps"),
                                              stacklevel=stacklevel + 1)
        unknown = [k for k in options if k not in SHARPNESS_OPTION_NAMES]
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}: the options are "
                            f"those of adapters.sharpness (rho, {', '.join(SHARPNESS_OPTION_NAMES)})")
        return cls(**options)

    @property
    def spec(self) -> Geometry:
        """The entry of :data:`~quotient_manifolds.adapters.ball.GEOMETRY_TABLE` of ``geometry``."""
        return GEOMETRY_TABLE[self.geometry]

    def as_dict(self) -> Dict[str, Any]:
        """The options as a dict (name → value, in the order of :func:`sharpness`'s keywords)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: the names of :class:`SharpnessOptions`, in the order of :func:`sharpness`'s keywords
SHARPNESS_OPTION_NAMES: Tuple[str, ...] = tuple(f.name for f in fields(SharpnessOptions))

def sharpness_options(options: Mapping[str, Any], rho: Any = 1.0) -> Dict[str, Any]:
    """The keyword options of :func:`sharpness` (all but ``model``, ``batches``, ``rho``) with the
    defaults filled in (:meth:`SharpnessOptions.as_dict`), refused before any work if one, or ``rho``,
    is unknown or out of range."""
    as_rho(rho)
    return SharpnessOptions.from_keywords(options, stacklevel=3).as_dict()


def as_rho(rho: Any, name: str = "rho") -> float:
    """``rho`` (the argument ``name``) as a float: Python / numpy scalars and 0-d arrays or tensors;
    finite and > 0."""
    return check.radius(rho, name)
