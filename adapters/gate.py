r"""The gate from a model to what an evaluation at its weights needs before its first batch: the
weights it varies, the fixed tensors, the compute dtype (:func:`pre_run_checks`) and, for a geodesic
geometry, the layout verified and accepted on the first inputs (:class:`Gate`).

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

import warnings
from typing import Any, Dict, NamedTuple, Optional

import torch
from torch import nn

from .ball import geometry_of
from .evaluation import HALF_DTYPES, all_finite, as_compute
from .streaming import LazyWeight

__all__ = ["Gate", "PreRun", "pre_run_checks"]

Tensor = torch.Tensor


class Gate:
    """The layout a geodesic run uses, from ``(model, layout or None, geometry)``: checked to belong to
    the model when built (:func:`~quotient_manifolds.adapters.accept.resolve_layout`), verified and accepted
    on the first inputs by :meth:`accept` (module docstring).  For a geometry that is not geodesic the
    gate passes ``layout`` through and never verifies.

    ``what`` names the caller in messages, ``consequence`` says what a failing block would do to its
    result."""

    def __init__(self, model: nn.Module, layout: Any, *, geometry: str, what: str, consequence: str,
                 unsafe: bool = False, allow_unsupported: bool = False, include_frozen: bool = False):
        from .accept import resolve_layout

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
        from .accept import is_verified

        layout = self.layout
        return bool(self.geodesic and layout.blocks and not is_verified(self.model, layout)
                    and not (self.unsafe and layout.verify_failed))

    def accept(self, example_inputs: Any, *, stacklevel: int = 2) -> Any:
        """The layout to use, verified on ``example_inputs`` (the first batch's inputs: a tensor, a
        tuple of positional arguments or a dict of keyword arguments) when :attr:`pending`; failing
        blocks get derived groups (module docstring).  ``stacklevel``: of the warnings, the value the
        caller would pass to ``warnings.warn`` itself."""
        from .accept import accept_layout, refuse_failed_blocks

        layout = self.layout
        if not self.geodesic:
            return layout
        if not self.pending:
            refuse_failed_blocks(layout, unsafe=self.unsafe, what=self.what, consequence=self.consequence,
                                 stacklevel=stacklevel + 2)
            return layout
        accepted, report = accept_layout(self.model, layout, example_inputs, what=self.what,
                                         stacklevel=stacklevel + 2)
        self.report = report
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
        raise ValueError(f"the model has no trainable parameter (all {len(all_params)} have "
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
            raise ValueError(f"parameter {name!r} contains non-finite values; {undefined} is "
                             f"undefined at such weights")
    frozen = {n: as_compute(p.detach(), upcast) if copy_half or not (upcast and p.dtype in HALF_DTYPES)
              else LazyWeight(p.detach().float) for n, p in all_params.items() if n not in params0}
    buffers = {**{n: as_compute(b, upcast) for n, b in model.named_buffers()}, **frozen}
    return PreRun(params0, buffers, upcast, layout, detected, gate)
