r"""The gate from a model to what an evaluation at its weights needs before its first batch: the
weights it varies, the fixed tensors, the compute dtype (:func:`pre_run_checks`) and, for a geodesic
geometry, the layout verified and accepted on the first inputs (:class:`Gate`); for a sharpness run
all of it, with its first batch read, in one call (:func:`prepare_run`).

Every geodesic entry point (:func:`~quotient_manifolds.adapters.sharpness`, ``sharpness_sweep``,
``calibrate_rho``, ``distributed_sharpness``, :func:`~quotient_manifolds.adapters.hessian.riemannian_hessian`,
:class:`~quotient_manifolds.adapters.sam.GeodesicSAM`) goes through one :class:`Gate`, so the documented
workflow (``lay = layout(model)``, ``lay.verify(model, inputs)``, ``sharpness(..., layout=lay)``) and the
one-call path (``layout=None``) use the same layout:

* a layout that already passed verification on this model is used as it is, at no extra cost;
* otherwise it is verified on the first inputs; the blocks that fail get the group derived from the
  model (:func:`~quotient_manifolds.adapters.accept.accept_layout`), whether the layout was passed in or
  detected, and a warning says which groups were derived; blocks with no group under which the
  model is unchanged are treated elementwise, with a warning;
* a layout passed in of which no block verifies (candidate or derived) is refused
  (:class:`~quotient_manifolds.adapters.SymmetryError`); ``unsafe=True`` runs a layout whose last
  verification failed as it is, with a warning.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, NamedTuple, Optional

import torch
from torch import nn

from quotient_manifolds.errors import InvalidArgument

from .accept import accept_layout, refuse_failed_blocks
from .ball import geometry_of
from .detection import resolve_layout
from .evaluation import all_finite, as_compute, class_targets_check, raise_explained, split_batch
from .losses import HALF_DTYPES
from .streaming import LazyWeight
from .validation import TokenInputs
from .verify import is_verified

__all__ = ["Gate", "PreRun", "pre_run_checks", "Prepared", "prepare_run", "SMALL_MODEL_PARAMS"]

Tensor = torch.Tensor


class Gate:
    """The layout a geodesic run uses, from ``(model, layout or None, geometry)``: checked to belong to
    the model when built (:func:`~quotient_manifolds.adapters.detection.resolve_layout`), verified and
    accepted on the first inputs by :meth:`accept` (module docstring).  For a geometry that is not
    geodesic the gate passes ``layout`` through and never verifies.

    ``what`` names the caller in messages, ``consequence`` says what a failing block would do to its
    result."""

    def __init__(self, model: nn.Module, layout: Any, *, geometry: str, what: str, consequence: str,
                 unsafe: bool = False, allow_unsupported: bool = False, include_frozen: bool = False):
        self.model, self.what, self.consequence, self.unsafe = model, what, consequence, unsafe
        self.geodesic = geometry_of(geometry).geodesic
        #: whether the layout was detected here (``layout=None``) rather than passed in
        self.detected = self.geodesic and layout is None
        self.layout = (resolve_layout(model, layout, what=what, allow_unsupported=allow_unsupported,
                                      include_frozen=include_frozen) if self.geodesic else layout)
        #: the verification report of :meth:`accept` (None when nothing had to run)
        self.report = None
        #: ``block name → how its group was found`` for the blocks :meth:`accept` derived
        self.derived: Dict[str, str] = {}

    @property
    def pending(self) -> bool:
        """Whether :meth:`accept` still has to verify the layout on inputs: a geodesic layout with
        blocks, not verified on this model yet (a layout whose last verification failed is run as
        it is with ``unsafe=True``)."""
        layout = self.layout
        return bool(self.geodesic and layout.blocks and not is_verified(self.model, layout)
                    and not (self.unsafe and layout.verify_failed))

    def accept(self, example_inputs: Any, *, on_reference: Optional[Callable[[Any], None]] = None,
               stacklevel: int = 2) -> Any:
        """The layout to use, verified on ``example_inputs`` (the first batch's inputs: a tensor, a
        tuple of positional arguments or a dict of keyword arguments) when :attr:`pending`; failing
        blocks get derived groups (module docstring).  ``on_reference`` is called with the model's
        output at its own weights when the check runs (e.g. to refuse the batch's targets at once).
        ``stacklevel``: of the warnings, the value the caller would pass to ``warnings.warn`` itself."""
        layout = self.layout
        if not self.geodesic:
            return layout
        if self.unsafe and layout.verify_failed:       # run as it is (with a warning)
            refuse_failed_blocks(layout, unsafe=True, what=self.what, consequence=self.consequence,
                                 stacklevel=stacklevel + 2)
            return layout
        # a layout that passes (now, or on this model before), or has no block, comes back as it is
        accepted, report = accept_layout(self.model, layout, example_inputs, what=self.what,
                                         stacklevel=stacklevel + 2, on_reference=on_reference)
        return self.settle(accepted, report, stacklevel=stacklevel + 1)

    def settle(self, accepted: Any, report: Any, *, stacklevel: int = 2) -> Any:
        """The layout to use once the checks of :meth:`accept` gave ``accepted`` (the layout with
        its failing blocks' groups derived, or removed) and their ``report``: a layout passed in of
        which no block verifies is refused, groups derived for a layout passed in are named in a
        warning. A placement that checks the blocks elsewhere (module by module on a sharded model)
        ends here too. ``stacklevel``: of the warnings, as in :meth:`accept`."""
        layout = self.layout
        if report is not None:
            self.report = report
        if accepted is layout:
            return layout
        candidates = {b.name: b.group_source for b in layout.blocks}
        self.derived = {b.name: b.group_source for b in accepted.blocks
                        if b.name in layout.verify_failed and b.group_source != candidates.get(b.name)}
        if not self.detected and layout.blocks and not accepted.blocks:
            refuse_failed_blocks(layout, unsafe=self.unsafe, what=self.what, consequence=self.consequence,
                                 report=report, stacklevel=stacklevel + 2)
            return layout                              # unsafe=True: the layout as it was passed
        if self.derived and not self.detected:
            lines = "; ".join(f"{name}: {source}" for name, source in self.derived.items())
            warnings.warn(f"{self.what}: block(s) {sorted(self.derived)} of layout= are not symmetries of "
                          f"the model with their group; the groups derived from the model are used "
                          f"instead ({lines}). adapters.accept_layout(model, layout, inputs) returns this "
                          f"layout", UserWarning, stacklevel=stacklevel + 1)
        self.layout = accepted
        return accepted


class PreRun(NamedTuple):
    """What :func:`pre_run_checks` found: the weights an evaluation varies and the fixed tensors, in
    the compute dtype, and the layout (``None`` for adaptive)."""

    params0: Dict[str, Tensor]
    buffers: Dict[str, Tensor]
    upcast: bool
    layout: Any
    #: whether the layout was detected here (``layout=None``)
    detected: bool
    #: the gate that verifies and accepts the layout on the first inputs (:meth:`Gate.accept`)
    gate: Gate


def pre_run_checks(model: torch.nn.Module, layout: Any, *, geometry: str, what: str, consequence: str,
                   unsafe: bool, allow_unsupported: bool, include_frozen: bool = False, undefined: str,
                   no_params: str, stacklevel: int = 3, copy_half: bool = True) -> PreRun:
    """The checks of an evaluation at the model's weights (sharpness, the Hessian) before its first
    batch, and its set-up:

    * the weights it varies: the trainable ones (and with ``include_frozen`` the frozen floating
      ones); none is refused (``no_params`` says what to do);
    * for a geodesic geometry, the layout, checked to belong to the model, and the :class:`Gate` that
      accepts it on the first inputs (``what`` names the caller, ``consequence`` what a failing
      block would do to the result);
    * the weights refused when not finite (``undefined`` names what is undefined there);
    * ``buffers``: the model's buffers and its other parameters (fixed); ``upcast``: whether any
      parameter or buffer is in half precision, in which case all of them are float32 copies
      (``copy_half=False``: the weights stay the model's own, to be read in float32 by the ball
      and by :class:`~quotient_manifolds.adapters.streaming.LazyWeight` recipes for the frozen
      ones; the buffers are still copied).

    ``stacklevel`` is that of the warnings as if the caller issued them."""
    all_params = dict(model.named_parameters())
    params0 = {n: p.detach() for n, p in all_params.items()
               if p.requires_grad or (include_frozen and p.is_floating_point())}
    if not params0:
        raise InvalidArgument(f"the model has no trainable parameter (all {len(all_params)} have "
                              f"requires_grad=False): {no_params}")
    gate = Gate(model, layout, geometry=geometry, what=what, consequence=consequence, unsafe=unsafe,
                allow_unsupported=allow_unsupported, include_frozen=include_frozen)
    layout, detected = gate.layout, gate.detected
    # half-precision tensors are evaluated as float32 copies (module docstring)
    upcast = any(t.dtype in HALF_DTYPES for t in (*all_params.values(), *model.buffers()))
    if copy_half:
        params0 = {n: as_compute(p, upcast) for n, p in params0.items()}
    for name, p in params0.items():
        if not all_finite(p):
            raise InvalidArgument(f"parameter {name!r} contains non-finite values; {undefined} is "
                                  f"undefined at such weights")
    frozen = {n: as_compute(p.detach(), upcast) if copy_half or not (upcast and p.dtype in HALF_DTYPES)
              else LazyWeight(p.detach().float) for n, p in all_params.items() if n not in params0}
    buffers = {**{n: as_compute(b, upcast) for n, b in model.named_buffers()}, **frozen}
    return PreRun(params0, buffers, upcast, layout, detected, gate)


#: Models with at most this many parameters run on one thread (see ``num_threads``).
SMALL_MODEL_PARAMS = 2 ** 20
#: marks an empty iterable of batches (reported after the set-up, as before)
_NO_BATCH = object()


class Prepared(NamedTuple):
    """The set-up of a sharpness run before its first batch (:func:`prepare_run`)."""

    params0: Dict[str, Tensor]
    buffers: Dict[str, Tensor]
    upcast: bool
    layout: Any
    batches: Iterator[Any]
    n_batches: Optional[int]
    #: the attention weights of an adaptive run (for ``attention_norm_shares``), else None
    covered: Optional[Dict[str, Tensor]]
    device: torch.device
    num_threads: Optional[int]


#: how a placement accepts a layout on the first inputs: ``accept(gate, inputs, on_reference,
#: stacklevel) -> layout`` (:meth:`Gate.accept` for a model in one process)
Accept = Callable[[Gate, Any, Optional[Callable[[Any], None]], int], Any]


def _accept_here(gate: Gate, inputs: Any, on_reference: Optional[Callable[[Any], None]],
                 stacklevel: int) -> Any:
    return gate.accept(inputs, on_reference=on_reference, stacklevel=stacklevel + 1)


def prepare_run(model: nn.Module, batches: Iterable[Any], options: Any, tokens: TokenInputs,
                stacklevel: int, accept: Accept = _accept_here) -> Prepared:
    """The set-up of a sharpness run with ``options`` (:class:`~quotient_manifolds.adapters.options.SharpnessOptions`):
    the weights and fixed tensors (:func:`pre_run_checks`), the layout accepted on the first batch
    for a geodesic geometry (its inputs checked with ``tokens``, its class targets refused at the
    check's first forward pass when the default loss cannot take them), and the batches (the first
    one read already). ``accept``: how the placement verifies and accepts the layout on the first
    inputs (:meth:`Gate.accept` in one process;
    :func:`~quotient_manifolds.adapters.sharded_gate.accept_on_shards` on a sharded model)."""
    geodesic = options.spec.geodesic
    what = f"{options.geometry} sharpness"
    params0, buffers, upcast, layout, detected, gate = pre_run_checks(
        model, options.layout, geometry=options.geometry, what=what, consequence="the value would be meaningless",
        unsafe=options.unsafe, allow_unsupported=options.allow_unsupported, include_frozen=options.include_frozen,
        undefined="sharpness",
        no_params=("sharpness perturbs the trainable weights, the frozen ones stay fixed. Set requires_grad=True "
                   "on the weights to perturb (e.g. model.requires_grad_(True), or only the adapter weights of "
                   "a PEFT model)"), stacklevel=stacklevel + 1, copy_half=False)
    try:
        n_batches: Optional[int] = len(batches)  # type: ignore[arg-type]
    except TypeError:  # a generator, an IterableDataset loader
        n_batches = None
    batches = iter(batches)
    first = next(batches, _NO_BATCH)
    if first is not _NO_BATCH:
        batches = itertools.chain([first], batches)
    if first is not _NO_BATCH and geodesic:
        # a geodesic number never comes from an unverified block (module docstring)
        inputs, targets, own_loss = split_batch(tokens, first, 0, options.loss_fn, options.normalize_logits)
        check_targets = None if options.loss_fn is not None or own_loss else class_targets_check(targets, 0)
        try:
            layout = accept(gate, inputs, check_targets, stacklevel)
        except RuntimeError as err:   # the run's first forward: inputs the model cannot take
            raise_explained(err, model, 0)
    if geodesic and not layout.blocks:
        warnings.warn(f"the layout has no GL block (unsupported attention modules: "
                      f"{[u[0] for u in layout.unsupported] or 'none'}); every weight is treated "
                      f"adaptively, so this {options.geometry} value is adaptive sharpness with the "
                      f"geodesic settings", UserWarning, stacklevel=stacklevel)
    # the attention weights, for attention_norm_shares: a geodesic ball holds them in its GL
    # components (the share is the GL share); an adaptive one finds them in the detected layout
    covered = None if geodesic else _attention_masks(model, layout, options.include_frozen)
    num_threads = options.num_threads
    if num_threads is None and sum(p.numel() for p in model.parameters()) <= SMALL_MODEL_PARAMS:
        num_threads = 1
    return Prepared(params0, buffers, upcast, layout, batches, n_batches, covered,
                    next(iter(params0.values())).device, num_threads)


def _attention_masks(model: nn.Module, layout: Any, include_frozen: bool) -> Optional[Dict[str, Tensor]]:
    """The entries of the GL blocks of ``layout``, or of the layout detected from ``model`` (only
    which weights its blocks hold is used: nothing is run or verified), as parameter name → boolean
    mask; ``None`` where detection finds no block (the share is then not recorded)."""
    if layout is None:
        try:
            with warnings.catch_warnings():  # adaptive sharpness did not ask for a layout
                warnings.simplefilter("ignore")
                layout = resolve_layout(model, None, what="adaptive sharpness", allow_unsupported=True,
                                        include_frozen=include_frozen)
        except (ValueError, TypeError, NotImplementedError, RuntimeError):
            return None  # a model detection cannot read: where the perturbation lives is unknown
    return dict(layout.gl_masks) if getattr(layout, "gl_masks", None) else None
