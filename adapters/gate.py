r"""The gate from a model to what an evaluation at its weights needs before its first batch: the
weights it varies, the fixed tensors, the compute dtype and, for a geodesic geometry, the checked
layout (:func:`pre_run_checks`)."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import torch

from .ball import geometry_of
from .evaluation import HALF_DTYPES, as_compute

__all__ = ["PreRun", "pre_run_checks"]

Tensor = torch.Tensor


class PreRun(NamedTuple):
    """What :func:`pre_run_checks` found: the weights an evaluation varies and the fixed tensors, in
    the compute dtype, and the layout (``None`` for adaptive)."""

    params0: Dict[str, Tensor]
    buffers: Dict[str, Tensor]
    upcast: bool
    layout: Any
    #: whether the layout was detected here (``layout=None``): failing blocks then get derived groups
    detected: bool


def pre_run_checks(model: torch.nn.Module, layout: Any, *, geometry: str, what: str, consequence: str,
                   unsafe: bool, allow_unsupported: bool, include_frozen: bool = False, undefined: str,
                   no_params: str, stacklevel: int = 3) -> PreRun:
    """The checks of an evaluation at the model's weights (sharpness, the Hessian) before its first
    batch, and its set-up:

    * the weights it varies: the trainable ones (and with ``include_frozen`` the frozen floating
      ones); none is refused (``no_params`` says what to do);
    * for a geodesic geometry, the layout (:func:`~quotient_manifolds.adapters.accept.checked_layout`:
      a failure known from its last verification is refused before any work; ``what`` names the
      caller, ``consequence`` what a failing block would do to the result);
    * the weights refused when not finite (``undefined`` names what is undefined there);
    * ``buffers``: the model's buffers and its other parameters (fixed); ``upcast``: whether any
      parameter or buffer is in half precision, in which case all of them are float32 copies.

    ``stacklevel`` is that of the warnings as if the caller issued them."""
    from .accept import checked_layout

    all_params = dict(model.named_parameters())
    params0 = {n: p.detach() for n, p in all_params.items()
               if p.requires_grad or (include_frozen and p.is_floating_point())}
    if not params0:
        raise ValueError(f"the model has no trainable parameter (all {len(all_params)} have "
                         f"requires_grad=False): {no_params}")
    geodesic = geometry_of(geometry).geodesic
    detected = geodesic and layout is None
    if geodesic:
        layout = checked_layout(model, layout, what=what, consequence=consequence, unsafe=unsafe,
                                allow_unsupported=allow_unsupported, include_frozen=include_frozen,
                                stacklevel=stacklevel + 1)
    # half-precision tensors are evaluated as float32 copies (module docstring)
    upcast = any(t.dtype in HALF_DTYPES for t in (*all_params.values(), *model.buffers()))
    params0 = {n: as_compute(p, upcast) for n, p in params0.items()}
    for name, p in params0.items():
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"parameter {name!r} contains non-finite values; {undefined} is "
                             f"undefined at such weights")
    frozen = {n: as_compute(p.detach(), upcast) for n, p in all_params.items() if n not in params0}
    buffers = {**{n: as_compute(b, upcast) for n, b in model.named_buffers()}, **frozen}
    return PreRun(params0, buffers, upcast, layout, detected)
