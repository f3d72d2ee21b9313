r"""The options of :func:`~quotient_manifolds.adapters.sharpness` (:class:`SharpnessOptions`), checked once
when built, their types for static tools (:class:`SharpnessKwargs`, :class:`PerGeometryKwargs`) and
the radius ``rho`` (:func:`as_rho`).

The dataclass is the run-time definition of the options (defaults, checks); the ``TypedDict``\ s
give their names and types to type checkers and editors through ``**options: Unpack[...]``
(PEP 692), so that a misspelt option is flagged before the call runs. A test checks that the two
list the same names with the same types."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Literal, Mapping, Optional, Tuple, TypeVar, get_args, get_type_hints

import torch
from typing_extensions import TypedDict   # the one PEP 692's Unpack takes, on every Python

from quotient_manifolds._validation import choice, flag, integer_at_least
from quotient_manifolds.core.gl import RETRACTIONS
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

from . import validation as check
from .ball import GEOMETRY_TABLE, Geometry, geometry_of
from .elementwise import ADAPTIVE_DIRECTIONS
from .solver import MOMENTUM_FORMS, STEP_NORMALIZATIONS, check_solver_dtype

__all__ = ["MEASURES", "SharpnessOptions", "SharpnessKwargs", "PerGeometryKwargs",
           "GeometryName", "RetractionName", "MeasureName", "MomentumForm", "StepNormalization",
           "AdaptiveDirection", "SHARPNESS_OPTION_NAMES", "RENAMED_OPTIONS", "renamed_options", "OPTION_DOCS",
           "document_options", "sharpness_options", "as_rho"]

Tensor = torch.Tensor

# The values of the choice-valued options, as types; tests check each against the run-time tuple
# its option is validated with (``GEOMETRIES``, ``RETRACTIONS``, ``MOMENTUM_FORMS`` …).
#: ``geometry=`` (:data:`~quotient_manifolds.adapters.GEOMETRIES`)
GeometryName = Literal["adaptive", "geodesic-inv", "geodesic-mix"]
#: ``retraction=`` (:data:`~quotient_manifolds.core.gl.RETRACTIONS`)
RetractionName = Literal["first_order", "second_order", "exact"]
#: ``measure=`` (:data:`MEASURES`)
MeasureName = Literal["worst", "average"]
#: ``momentum=`` (:data:`~quotient_manifolds.adapters.solver.MOMENTUM_FORMS`)
MomentumForm = Literal["apgd", "andriushchenko", "none"]
#: ``step_normalization=`` (:data:`~quotient_manifolds.adapters.solver.STEP_NORMALIZATIONS`)
StepNormalization = Literal["metric", "none"]
#: ``adaptive_direction=`` (:data:`~quotient_manifolds.adapters.elementwise.ADAPTIVE_DIRECTIONS`)
AdaptiveDirection = Literal["riemannian", "andriushchenko"]

#: the values of ``measure=``
MEASURES: Tuple[str, ...] = get_args(MeasureName)

#: a function decorated by :func:`document_options` (returned as it is, so static tools see its type)
EntryPoint = TypeVar("EntryPoint", bound=Callable[..., Any])

#: former spellings of options → their names now; the former is accepted, with a
#: ``DeprecationWarning``, until the next release (one spelling: American "-ize", as torch's)
RENAMED_OPTIONS: Dict[str, str] = {"step_normalisation": "step_normalization"}


@dataclass(frozen=True)
class SharpnessOptions:
    """The options of :func:`sharpness` (every keyword but ``rho``), checked once when built: an
    unknown name or an out-of-range value is refused before any work, naming the option. The
    meaning of each is documented at :func:`sharpness`; :func:`sharpness_sweep`,
    :func:`~quotient_manifolds.adapters.calibrate_rho` and :func:`run_sharpness` take them as they are."""

    geometry: GeometryName = "geodesic-mix"
    n_iters: int = 20
    retraction: RetractionName = "second_order"
    loss_fn: Optional[Callable] = None
    measure: MeasureName = "worst"
    n_samples: int = 10
    gram_eps: float = 0.0
    use_metric_norm: bool = True
    momentum: MomentumForm = "apgd"
    step_normalization: StepNormalization = "metric"
    adaptive_direction: AdaptiveDirection = "riemannian"
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
    keep_worst_gradient: Optional[bool] = None
    solver_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        geometry_of(self.geometry)
        choice("retraction", self.retraction, RETRACTIONS)
        choice("measure", self.measure, MEASURES)
        choice("momentum", self.momentum, MOMENTUM_FORMS)
        choice("step_normalization", self.step_normalization, STEP_NORMALIZATIONS)
        choice("adaptive_direction", self.adaptive_direction, ADAPTIVE_DIRECTIONS)
        check.positive_finite("step_size_mult", self.step_size_mult)
        integer_at_least("n_iters", self.n_iters, 1)
        integer_at_least("n_samples", self.n_samples, 1)
        integer_at_least("seed", self.seed, -2 ** 63)
        check.non_negative_finite("gram_eps", self.gram_eps)
        check.positive_finite("retraction_tolerance", self.retraction_tolerance)
        if self.num_threads is not None:
            integer_at_least("num_threads", self.num_threads, 1)
        check.optional_callable("loss_fn", self.loss_fn, "loss_fn(outputs, targets) -> scalar tensor")
        for name in ("use_metric_norm", "elementwise_second_order", "normalize_logits", "allow_unsupported",
                     "unsafe", "progress", "include_frozen", "check_retraction"):
            flag(name, getattr(self, name))
        check.optional_layout("layout", self.layout)
        if self.keep_worst_gradient is not None:
            flag("keep_worst_gradient", self.keep_worst_gradient)
        check_solver_dtype(self.solver_dtype)
        check.plain_numbers(self, ints=("n_iters", "n_samples", "seed", "num_threads"),
                            floats=("step_size_mult", "gram_eps", "retraction_tolerance"))
        if self.include_frozen and self.layout is not None and getattr(self.layout, "frozen", None):
            raise InvalidArgument("include_frozen=True, but the layout= passed was built without frozen "
                                  "parameters, so they would be in no part of the ball; rebuild it with "
                                  "layout(model, include_frozen=True), or pass include_frozen=False")

    @classmethod
    def from_keywords(cls, options: Mapping[str, Any], *, stacklevel: int = 3) -> "SharpnessOptions":
        """The options given as keywords of :func:`sharpness`: an unknown keyword is refused, a
        former spelling (:data:`RENAMED_OPTIONS`) taken with a ``DeprecationWarning`` issued
        ``stacklevel`` frames up from here (3: the caller of the function that called this)."""
        return cls(**renamed_options(options, stacklevel=stacklevel))

    @property
    def spec(self) -> Geometry:
        """The entry of :data:`~quotient_manifolds.adapters.ball.GEOMETRY_TABLE` of ``geometry``."""
        return GEOMETRY_TABLE[self.geometry]

    def as_dict(self) -> Dict[str, Any]:
        """The options as a dict (name → value, in the order of :func:`sharpness`'s keywords)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: the names of :class:`SharpnessOptions`, in the order of :func:`sharpness`'s keywords
SHARPNESS_OPTION_NAMES: Tuple[str, ...] = tuple(f.name for f in fields(SharpnessOptions))


def renamed_options(options: Mapping[str, Any], *, stacklevel: int = 2) -> Dict[str, Any]:
    """``options`` (keywords of :func:`sharpness`) with each former spelling of :data:`RENAMED_OPTIONS`
    replaced by the name now, with a ``DeprecationWarning`` issued ``stacklevel`` frames up from the
    caller (2: the caller's caller); an unknown name is refused (:class:`~quotient_manifolds.errors.InvalidArgumentType` naming it)."""
    out = dict(options)
    for old, new in RENAMED_OPTIONS.items():
        if old in out:
            if new in out:
                raise InvalidArgumentType(f"{old}= and {new}= are one option ({old} is its former "
                                          f"spelling): pass only {new}=")
            warnings.warn(f"the option {old}= is now spelt {new}= (one spelling, as torch's); the "
                          f"former spelling is accepted until the next release", DeprecationWarning,
                          stacklevel=stacklevel + 1)
            out[new] = out.pop(old)
    unknown = [k for k in out if k not in SHARPNESS_OPTION_NAMES]
    if unknown:
        raise InvalidArgumentType(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}: the "
                                  f"options are those of adapters.sharpness (rho, "
                                  f"{', '.join(SHARPNESS_OPTION_NAMES)})")
    return out


class PerGeometryKwargs(TypedDict, total=False):
    """The options of :func:`~quotient_manifolds.adapters.sharpness` but ``geometry`` and ``measure``,
    typed for static tools: the ``**options`` of the entry points that choose the geometry
    themselves (:func:`~quotient_manifolds.adapters.calibrate_rho`,
    :class:`~quotient_manifolds.adapters.SharpnessMonitor` and the training-loop callbacks). The
    meaning and default of each is documented at :func:`~quotient_manifolds.adapters.sharpness`.

    Example::

        def measure(model, batches, **options: Unpack[PerGeometryKwargs]) -> float:
            return adapters.sharpness(model, batches, rho=0.1, **options).value
    """

    n_iters: int
    retraction: RetractionName
    loss_fn: Optional[Callable]
    n_samples: int
    gram_eps: float
    use_metric_norm: bool
    momentum: MomentumForm
    step_normalization: StepNormalization
    adaptive_direction: AdaptiveDirection
    elementwise_second_order: bool
    normalize_logits: bool
    step_size_mult: float
    layout: Any
    allow_unsupported: bool
    unsafe: bool
    seed: int
    progress: bool
    num_threads: Optional[int]
    include_frozen: bool
    check_retraction: bool
    retraction_tolerance: float
    keep_worst_gradient: Optional[bool]
    solver_dtype: Optional[torch.dtype]


class SharpnessKwargs(PerGeometryKwargs, total=False):
    """Every option of :func:`~quotient_manifolds.adapters.sharpness` (its keywords but ``rho``),
    typed for static tools: ``sharpness(model, batches, *, rho, **options: Unpack[SharpnessKwargs])``
    (PEP 692), so that mypy, pyright and editors complete the names and flag a misspelt one or a
    value outside a choice (``geometry="mix"``). At run time the same names and values are checked
    by :class:`SharpnessOptions`, of which these are the fields (a test keeps the two equal).

    Example::

        options: SharpnessKwargs = {"geometry": "geodesic-inv", "n_iters": 10}
        adapters.sharpness(model, batches, rho=0.1, **options)
    """

    geometry: GeometryName
    measure: MeasureName


def sharpness_options(options: Mapping[str, Any], rho: Any = 1.0) -> Dict[str, Any]:
    """The keyword options of :func:`sharpness` (all but ``model``, ``batches``, ``rho``) with the
    defaults filled in (:meth:`SharpnessOptions.as_dict`), refused before any work if one, or ``rho``,
    is unknown or out of range."""
    as_rho(rho)
    return SharpnessOptions.from_keywords(options).as_dict()


def as_rho(rho: Any, name: str = "rho") -> float:
    """``rho`` (the argument ``name``) as a float: Python / numpy scalars and 0-d arrays or tensors;
    finite and > 0."""
    return check.radius(rho, name)


#: The documentation of each option of :func:`~quotient_manifolds.adapters.sharpness`: the one source of
#: its docstring's entries (:func:`document_options`) and of the dataclass's fields' order.
OPTION_DOCS: Dict[str, str] = {
    'geometry': (
        '``"geodesic-mix"`` (default), ``"geodesic-inv"`` (attention blocks on the GL(h)\n'
        'quotient with that metric, everything else adaptive) or ``"adaptive"`` (elementwise\n'
        'c = |w| everywhere, Andriushchenko et al. / Kwon et al.).'),
    'n_iters': (
        'Auto-PGD iterations (one forward + one backward each).'),
    'retraction': (
        '``"second_order"`` (x + ξ − ½Γ(ξ,ξ), default), ``"first_order"`` (x + ξ: the\n'
        'ablation "no second-order correction"), or ``"exact"`` (geodesic ODE).'),
    'loss_fn': (
        '``loss_fn(outputs, targets)``; default mean cross-entropy on the logits for\n'
        "``(inputs, targets)`` batches, the model's ``outputs.loss`` for dict batches."),
    'measure': (
        '``"worst"`` (Auto-PGD) or ``"average"`` (mean over ``n_samples`` random horizontal\n'
        'directions on the sphere of radius rho; seeded by ``seed``).'),
    'n_samples': (
        'random directions of ``measure="average"`` (default 10).'),
    'gram_eps': (
        'Gram relaxation GᵀG + εI of the quotient metrics (docs/maths.md §6.4).'),
    'use_metric_norm': (
        'False = ablation "no corrected norm": the GL blocks are measured with the\n'
        'elementwise adaptive norm (docs/maths.md §7.3).'),
    'momentum': (
        '``"apgd"`` (paper Alg. 1), ``"andriushchenko"`` (their code), ``"none"``.'),
    'step_normalization': (
        '``"metric"`` (step of metric length η) or ``"none"``.'),
    'adaptive_direction': (
        '``"riemannian"`` (∇⊙w², paper Alg. 1 line 12) or ``"andriushchenko"``\n'
        '(∇⊙|w|, their code).'),
    'elementwise_second_order': (
        'also move the non-attention weights along the second-order geodesic\n'
        'w + ξ + ξ²/(2w) of the elementwise metric (docs/maths.md §12.10; default off: w + ξ).'),
    'normalize_logits': (
        "apply Andriushchenko et al.'s logit normalization before the loss."),
    'step_size_mult': (
        "multiplies Auto-PGD's initial step size (default 1)."),
    'layout': (
        'a precomputed :class:`~quotient_manifolds.adapters.Layout` of this model (one built for another model —\n'
        'other parameters, shapes or head counts — is refused), or detected from the model (default).\n'
        'Either way it is accepted on the first batch (:class:`~quotient_manifolds.adapters.gate.Gate`): a\n'
        'layout that passed ``verify`` is used as it is; blocks whose group fails verification get the\n'
        'group derived from the model (e.g. R₊·SO(h) for L2-normalised q and k; a warning says so for\n'
        'a layout passed in), what still fails is treated elementwise, with a warning; a layout passed\n'
        'in of which no block verifies is refused.'),
    'allow_unsupported': (
        'run even if the layout reports unsupported attention modules (they are\n'
        'then treated adaptively) or none at all.'),
    'unsafe': (
        "run a geodesic geometry even if the layout's last ``verify`` found blocks that are not\n"
        'symmetries of the model (``layout.verify_failed``); the value is then not meaningful.'),
    'seed': (
        'seed of the random directions of ``measure="average"``.'),
    'progress': (
        'show a progress bar over the Auto-PGD iterations (samples for ``"average"``) of all\n'
        'batches.'),
    'num_threads': (
        "at most this many intra-op threads during the run; torch's setting is restored\n"
        'afterwards (default: 1 for models with at most ``SMALL_MODEL_PARAMS`` parameters, whose tiny\n'
        'ops lose more to thread synchronisation than they gain, 60x so on a loaded machine;\n'
        "torch's setting otherwise)."),
    'include_frozen': (
        'also perturb parameters with ``requires_grad=False`` (e.g. the base weights of\n'
        'a LoRA model; default: frozen weights stay fixed and out of the ball).'),
    'check_retraction': (
        'with ``retraction="second_order"``, evaluate the loss once more at the exact\n'
        'geodesic of the worst perturbation and record the relative gap of the two sharpness values\n'
        '(``result.retraction_gaps``); warn when it exceeds ``retraction_tolerance`` (the\n'
        'second-order step is then outside its range of validity: at large rho, especially for the\n'
        'mix metric where GᵀG or HᵀH have small singular values; use ``retraction="exact"`` or a\n'
        'smaller rho). One forward pass per batch, and the geodesic integrated with 1, 2, 4 or 8\n'
        'RK4 steps: the fewest whose endpoint agrees with the previous one (on trained weights,\n'
        'two integrations of 1 and 2 steps).'),
    'retraction_tolerance': (
        'relative gap beyond which ``check_retraction`` warns (default 0.1).'),
    'keep_worst_gradient': (
        "keep the gradient at Auto-PGD's worst point, which saves a forward and backward at each\n"
        'restart from it, for one more vector of the ball (4 bytes per weight, 2 with\n'
        '``solver_dtype=torch.bfloat16``). ``None`` (default): kept where the device still holds it\n'
        'after the first forward and backward (with 5 % of its memory to spare); ``False``: never\n'
        '(the least memory); ``True``: always.'),
    'solver_dtype': (
        "``None`` (default): the solver's vectors in float32 (14 bytes per perturbed weight beyond\n"
        'the model and one forward and backward). ``torch.bfloat16``: the compact solver, which keeps\n'
        'the iterate, the worst point, the gradient and the last step of every weight outside the GL\n'
        'blocks in bfloat16 (8 bytes per weight, 10 with the worst point\'s gradient): each step is\n'
        'formed in float32 and rounded once, the GL blocks keep theirs unrounded (the value stays invariant\n'
        'under the symmetries); it moves the value far less than its spread over batches (see the\n'
        "benchmarks' Memory section)."),
}


def document_options(fn: EntryPoint) -> EntryPoint:
    """Decorator of an entry point whose options go straight into :class:`SharpnessOptions`, typed
    ``**options: Unpack[SharpnessKwargs]`` (or :class:`PerGeometryKwargs`): its signature
    (``inspect.signature``, ``help``, the API docs) lists each option of that ``TypedDict`` with its
    type and default (``geometry`` before ``rho`` where both are there), and a line ``{options}``
    of its docstring becomes their entries (:data:`OPTION_DOCS`). Nothing is written twice: the
    defaults and types are the dataclass's."""
    signature = inspect.signature(fn)
    fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    named = {p.name for p in fixed}
    var_keyword = next(p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD)
    annotation = fn.__annotations__[var_keyword]   # "Unpack[SharpnessKwargs]" (postponed evaluation)
    unpacked = eval(annotation, fn.__globals__) if isinstance(annotation, str) else annotation  # noqa: S307
    kwargs_type = get_args(unpacked)[0]
    shown = [name for name in SHARPNESS_OPTION_NAMES if name in get_type_hints(kwargs_type) and name not in named]
    hints, defaults = get_type_hints(SharpnessOptions), SharpnessOptions()
    options = {name: inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, name),
                                       annotation=hints[name]) for name in shown}
    if "geometry" in options:   # the order sharpness's keywords were written in: geometry, then rho
        radius = [p for p in fixed if p.name == "rho"]
        fixed = [p for p in fixed if p.name != "rho"] + [options.pop("geometry")] + radius
    fn.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=fixed + list(options.values()))
    entries = "\n".join(f"    {name}: " + OPTION_DOCS[name].replace("\n", "\n        ") for name in shown)
    fn.__doc__ = (fn.__doc__ or "").replace("    {options}", entries)
    return fn
