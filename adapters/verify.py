"""The symmetry self-check of a layout (:meth:`Layout.verify <quotient_manifolds.adapters.Layout.verify>`):
random ill-conditioned per-head actions of every block must leave the model's output unchanged; the
report (:class:`VerifyReport`) names the block that is not a symmetry.

And the record of the checks: which layouts passed on which model, in the model's current state
(:func:`record`, :func:`is_verified`), so that a layout verified once is not verified again by the
geodesic entry points (:func:`verify_once`).  The record is a ``WeakKeyDictionary`` model -> set of
signatures, so it never keeps a model alive.  A signature (:func:`signature`) is what a check depends
on: the layout's blocks (by value: a layout detected again from the same model needs no new check)
and, for every parameter a block touches, its shape, dtype, device and storage address (training
updates parameters in place, so it keeps them; replacing a parameter tensor or changing the blocks
does not)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call

from quotient_manifolds._validation import flag, integer_at_least
from quotient_manifolds.errors import OutputNotFound, SymmetryError
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

from . import validation as check
from .blocks import GLBlock
from .evaluation import device_of, split_inputs
from .modes import eval_mode
from .validation import positive_finite, positive_finite_sequence

__all__ = ["VerifyReport", "BlockCheck", "default_tolerance", "primary_output", "verify_layout",
           "verify_once", "symmetry_report", "record", "is_verified", "record_verification", "signature",
           "DEFAULT_SCALES", "TOLERANCE_FACTOR", "Checkable", "verified_before_sharding"]


class Checkable(Protocol):
    """What the check needs of a layout (a :class:`~quotient_manifolds.adapters.Layout` is one, whose
    ``verify`` calls :func:`verify_layout`): its blocks, random elements of their groups and their
    action, and the check that it belongs to the model."""

    blocks: List[GLBlock]

    def check_model(self, model: nn.Module, *, what: str = "layout") -> None: ...

    def random_actions(self, params: Optional[Mapping[str, Tensor]] = None, *, scale: float,
                       cond: Optional[float] = 1e2, generator: Optional[torch.Generator] = None,
                       dtype: torch.dtype = torch.float64) -> Dict[str, Tensor]: ...

    def act(self, params: Mapping[str, Tensor], actions: Mapping[str, Tensor]) -> Dict[str, Tensor]: ...


@dataclass
class BlockCheck:
    """The check of one block: its output deviation per scale, its largest, and whether it passed.
    ``group_size`` > 1: the block passed acting together with ``group_size − 1`` other blocks (the
    bisection of :func:`verify_layout` with ``per_block="auto"`` stops at a group that passes), and
    the deviations are those of the group."""

    name: str
    kind: str
    module: str
    per_scale: Dict[float, float]
    max_rel_dev: float
    passed: bool
    group_size: int = 1


@dataclass
class VerifyReport:
    """Result of :meth:`Layout.verify`.  Deviations are ``max|y' - y| / max|y|`` of the model output.

    Attributes
    ----------
    joint:
        Per scale, the deviation with every block acted on at once.
    joint_passed:
        Whether every joint deviation is within the tolerance.
    blocks:
        Per block, a :class:`BlockCheck` (its largest deviation and verdict).
    rtol, atol, dtype, cond, scales:
        The tolerance, compute dtype, condition number and scales of the check.
    output_scale:
        max|y| of the output at the model's own weights.
    per_block_checked:
        Whether the blocks were checked one by one.

    ``passed`` (property) is the verdict, ``failing`` the failing blocks' names, ``max_rel_dev``
    the largest deviation; ``str(report)`` prints them with the next step. A failing report
    reaches the caller of :meth:`Layout.verify` as ``err.report`` of the SymmetryError it raises.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> report = adapters.layout(model).verify(model, torch.randn(3, 5, 4, dtype=torch.float64))
    >>> print(report)                                   # doctest: +ELLIPSIS
    GL symmetry check PASSED: compute dtype float64, ...
      all blocks at once: 0.01: ...
      self_attn/qk  max rel dev ...  ok (with 1 other blocks)
      self_attn/vo  max rel dev ...  ok (with 1 other blocks)
    next: adapters.sharpness(model, batches, rho=..., layout=layout) uses these blocks as they are (no new check)
    """

    joint: Dict[float, float]
    joint_passed: bool
    blocks: List[BlockCheck]
    rtol: float
    atol: float
    dtype: torch.dtype
    cond: Optional[float]
    scales: Tuple[float, ...]
    output_scale: float
    per_block_checked: bool

    @property
    def passed(self) -> bool:
        return self.joint_passed and all(b.passed for b in self.blocks)

    @property
    def failing(self) -> List[str]:
        return [b.name for b in self.blocks if not b.passed]

    @property
    def max_rel_dev(self) -> float:
        vals = list(self.joint.values()) + [b.max_rel_dev for b in self.blocks]
        return max(vals) if vals else 0.0

    def __str__(self) -> str:
        status = "PASSED" if self.passed else "FAILED"
        thr = self.rtol + self.atol / max(self.output_scale, 1e-300)
        lines = [
            f"GL symmetry check {status}: compute dtype {str(self.dtype).replace('torch.', '')}, "
            f"|y|max = {self.output_scale:.3g}, cond(A) = {self.cond}, "
            f"scales {', '.join(f'{s:g}' for s in self.scales)}; tolerance rel {thr:.2e} "
            f"(rtol {self.rtol:.1e}, atol {self.atol:.1e})",
            "  all blocks at once: " + ", ".join(f"{s:g}: {d:.2e}" for s, d in self.joint.items())
            + ("" if self.joint_passed else "   <-- FAIL"),
        ]
        if self.blocks:
            w = max(len(b.name) for b in self.blocks)
            for b in self.blocks:
                together = f" (with {b.group_size - 1} other blocks)" if b.group_size > 1 else ""
                lines.append(f"  {b.name:<{w}}  max rel dev {b.max_rel_dev:.2e}  "
                             f"{'ok' if b.passed else 'FAIL'}{together}")
        elif not self.per_block_checked:
            lines.append("  (blocks not checked one by one)")
        lines.append(self.next_step)
        return "\n".join(lines)

    @property
    def next_step(self) -> str:
        """One line: what to call next with the layout this report is about."""
        if self.passed:
            return ("next: adapters.sharpness(model, batches, rho=..., layout=layout) uses these blocks "
                    "as they are (no new check)")
        return ("next: adapters.accept_layout(model, layout, inputs) derives the groups of the failing blocks "
                "(sharpness(..., layout=layout) does so on its first batch); print its layout to see them")


TOLERANCE_FACTOR = 30.0


def default_tolerance(dtype: torch.dtype, cond: Optional[float] = 1e2) -> float:
    """Default relative tolerance of :meth:`Layout.verify`: ``30 * eps(dtype) * max(cond, 10)``.

    The action is computed in float64, so what remains is rounding: writing the acted factors back
    in the model dtype perturbs the recomposed ``G Hᵀ`` by about ``eps * cond(A)`` relative to
    ``|G||H|``, and the forward pass rounds in the amplified products ``(x G A)(x H A^{-T})ᵀ`` likewise.
    Measured ``max|y' - y| / max|y|`` (real MiniLM-L6, 6 layers, 12 heads; tiny BERT/ViT/CLIP/GPT-2/MHA)
    is about ``0.5 * eps * cond``: float32 ``3e-6`` at ``cond = 1e2``, ``3e-5`` at ``1e3``,
    ``1.3e-4`` at ``1e4``; float64 ``5e-15`` at ``1e2``; the scale ``1e-2 .. 1e2`` does not matter
    (the scalar part of ``A`` cancels exactly up to rounding).  So the default keeps a margin of about
    100x (float32: ``3.6e-4`` at ``cond = 1e2``; float64: ``6.7e-13``), while a block that is not a
    symmetry deviates by ``1e-2 .. 1`` (rotary QK, mis-declared heads, swapped k/v, missing bias_k).
    Half-precision models are checked in float32 (see ``verify``).
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    c = 10.0 if cond is None else max(10.0, float(cond))
    return TOLERANCE_FACTOR * eps * c


def _max_cond(actions: Mapping[str, Tensor]) -> float:
    worst = 1.0
    for A in actions.values():
        s = torch.linalg.svdvals(A.to(torch.float64))
        c = float((s[..., 0] / s[..., -1]).max())
        worst = max(worst, c if math.isfinite(c) else math.inf)
    return worst

def primary_output(out: Any) -> Tensor:
    """The tensor compared by :meth:`Layout.verify`: the tensor itself, or ``logits`` /
    ``last_hidden_state`` / the first tensor field of a (HF ``ModelOutput``) mapping / tuple."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping):
        for key in ("logits", "last_hidden_state"):
            v = out.get(key, None)
            if isinstance(v, Tensor):
                return v
        for v in out.values():
            if isinstance(v, Tensor):
                return v
            if isinstance(v, (tuple, list, Mapping)):
                try:
                    return primary_output(v)
                except OutputNotFound:
                    pass
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, Tensor):
                return v
        for v in out:
            try:
                return primary_output(v)
            except OutputNotFound:
                pass
    raise OutputNotFound(f"cannot find an output tensor in a {type(out).__name__}; pass output_fn=")


#: The scales of the random actions of a check (their spread around the identity)
DEFAULT_SCALES = (1e-2, 1e-1, 1.0, 1e1, 1e2)


def verify_layout(layout: Checkable, model: nn.Module, example_inputs, *,
                  scales: Sequence[float] = DEFAULT_SCALES, cond: Optional[float] = 1e2,
                  rtol: Optional[float] = None, atol: Optional[float] = None, seed: int = 0,
                  per_block: Union[bool, str] = True, raise_on_failure: bool = True,
                  output_fn: Optional[Callable[[Any], Tensor]] = None,
                  compute_dtype: Optional[torch.dtype] = None) -> VerifyReport:
    """The check of :meth:`Layout.verify <quotient_manifolds.adapters.Layout.verify>` (arguments and
    result as there), its arguments checked first. This function mutates nothing: it returns the
    :class:`VerifyReport`, or raises :class:`SymmetryError` (carrying it) when a block fails and
    ``raise_on_failure``; :func:`record` remembers the outcome."""
    args, kwargs, scales = _checked_arguments(layout, model, example_inputs, scales=scales, cond=cond, rtol=rtol,
                                              atol=atol, seed=seed, per_block=per_block,
                                              raise_on_failure=raise_on_failure, output_fn=output_fn,
                                              compute_dtype=compute_dtype)
    return symmetry_report(layout, model, args, kwargs, scales=scales, cond=cond, rtol=rtol, atol=atol, seed=seed,
                           per_block=per_block, raise_on_failure=raise_on_failure, output_fn=output_fn,
                           compute_dtype=compute_dtype)


def verify_once(layout: Checkable, model: nn.Module, example_inputs: Any, *, rtol: float,
                on_reference: Optional[Callable[[Any], None]] = None) -> Optional[VerifyReport]:
    """The check the geodesic entry points run before they use a layout: ``None`` when ``layout``
    (or one with equal blocks) already passed on ``model`` in its current state (:func:`is_verified`);
    otherwise the report of :func:`verify_layout` with the default scales and ``per_block="auto"``,
    never raising on a failing block, its outcome recorded (:func:`record`).  The layout must
    belong to the model (checked by the caller); ``on_reference`` is called with the model's output
    at its own weights (the first forward pass), e.g. to check the targets of the batch."""
    if not layout.blocks or is_verified(model, layout):
        return None
    args, kwargs = split_inputs(example_inputs, model_device(model))
    report = symmetry_report(layout, model, args, kwargs, scales=DEFAULT_SCALES, cond=1e2, rtol=rtol, atol=None,
                             seed=0, per_block="auto", raise_on_failure=False, output_fn=None, compute_dtype=None,
                             on_reference=on_reference)
    record(model, layout, report)
    # the check leaves float32 copies of the weights in reference cycles (exceptions caught while
    # bisecting keep their frames): freed here, before a solver allocates. Only where a check ran:
    # a full collection costs ~0.2 s in a process that imported transformers
    gc.collect()
    return report


def symmetry_report(layout: Checkable, model: nn.Module, args: tuple, kwargs: dict, *, scales: Sequence[float],
                    cond: Optional[float], rtol: Optional[float], atol: Optional[float], seed: int,
                    per_block: Union[bool, str], raise_on_failure: bool,
                    output_fn: Optional[Callable[[Any], Tensor]], compute_dtype: Optional[torch.dtype],
                    on_reference: Optional[Callable[[Any], None]] = None) -> VerifyReport:
    """The check of :func:`verify_layout` on checked arguments: the model called with ``args`` and
    ``kwargs`` (on its device) at its own weights and under the random actions of every scale. In
    eval mode (unless the model is in eval mode already), no gradient recorded."""
    fn = output_fn or primary_output
    # inside a sharpness run the model is in eval mode already
    training = any(m.training for m in model.modules())
    with eval_mode(model) if training else contextlib.nullcontext(), torch.no_grad():
        params = _finite_parameters(model)
        cdt, params, extra, args, kwargs = _in_compute_dtype(model, params, args, kwargs, compute_dtype)

        def run(p, reference: Optional[Callable[[Any], None]] = None):
            out = functional_call(model, {**p, **extra}, args, kwargs)
            if reference is not None:
                reference(out)
            y = fn(out)
            if not isinstance(y, Tensor):
                raise InvalidArgumentType(f"verify(): output_fn returned a {type(y).__name__}, not a tensor: it must "
                                          f"pick the tensor to compare from the model's output, e.g. "
                                          f"output_fn=lambda out: out.logits")
            return y.detach()

        y0 = run(params, on_reference)
        if not y0.numel():
            raise InvalidArgument("verify(): the model's output on example_inputs is empty (an empty batch?): a "
                                  "check on no output proves nothing; pass inputs with at least one example")
        if not bool(torch.isfinite(y0).all()):
            raise InvalidArgument("verify(): the model's output at its own weights is not finite (nan or inf); "
                                  "check example_inputs (and attention masks) before checking the symmetry")
        ymax = float(y0.abs().max()) if y0.numel() else 0.0
        tol_a = 0.0 if atol is None else float(atol)
        denom = ymax if ymax > 0 else 1.0

        def dev(p) -> float:
            y = run(p)
            if y.shape != y0.shape:
                return math.inf
            if not y.numel():
                return 0.0
            d = float((y.to(torch.float64) - y0.to(torch.float64)).abs().max())
            return math.inf if not math.isfinite(d) else d / denom

        gen = torch.Generator().manual_seed(seed)
        joint: Dict[float, float] = {}
        tols: Dict[float, float] = {}
        actions_by_scale = {}
        for s in scales:
            actions = layout.random_actions(params, scale=s, cond=cond, generator=gen)
            actions_by_scale[s] = actions
            eff = cond if cond is not None else _max_cond(actions)
            tols[s] = default_tolerance(cdt, eff) if rtol is None else float(rtol)
            joint[s] = dev(layout.act(params, actions)) if layout.blocks else 0.0

        def ok(d: float, s: float) -> bool:
            return d * denom <= tol_a + tols[s] * ymax

        joint_passed = all(ok(d, s) for s, d in joint.items())

        def group_dev(group, stop_at_failure: bool) -> Dict[float, float]:
            """Deviation per scale with the blocks of ``group`` acting together (up to the first
            failing scale when ``stop_at_failure``: a failing group is split anyway)."""
            per = {}
            for s in scales:
                per[s] = dev(layout.act(params, {b.name: actions_by_scale[s][b.name] for b in group}))
                if stop_at_failure and not ok(per[s], s):
                    break
            return per

        def bisect(group, per) -> List[BlockCheck]:
            """The checks of ``group`` whose joint deviations are ``per``: all passed at once, else
            each half checked in turn, down to the single blocks that fail."""
            if all(ok(d, s) for s, d in per.items()) or len(group) == 1:
                if len(group) == 1 and len(per) < len(scales):
                    per = group_dev(group, stop_at_failure=False)
                mx = max(per.values()) if per else 0.0
                passed = all(ok(d, s) for s, d in per.items())
                return [BlockCheck(b.name, b.kind, b.module, dict(per), mx, passed, len(group)) for b in group]
            half = len(group) // 2
            return [c for part in (group[:half], group[half:])
                    for c in bisect(part, group_dev(part, stop_at_failure=len(part) > 1))]

        check_blocks = per_block is True or (per_block == "auto" and bool(layout.blocks))
        checks: List[BlockCheck] = []
        if per_block is True:
            for b in layout.blocks:
                per = group_dev([b], stop_at_failure=False)
                mx = max(per.values()) if per else 0.0
                checks.append(BlockCheck(b.name, b.kind, b.module, per, mx, all(ok(d, s) for s, d in per.items())))
        elif check_blocks:
            checks = bisect(list(layout.blocks), joint)
    tol_r = max(tols.values()) if tols else (float(rtol) if rtol is not None else default_tolerance(cdt, cond))
    report = VerifyReport(joint=joint, joint_passed=joint_passed, blocks=checks, rtol=tol_r, atol=tol_a,
                          dtype=cdt, cond=cond, scales=scales, output_scale=ymax,
                          per_block_checked=check_blocks)
    if raise_on_failure and not report.passed:
        raise SymmetryError(f"{_failure(report)}; tolerance rel {tol_r:.1e}.\n{report}", report)
    return report


def _checked_arguments(layout: Checkable, model: nn.Module, example_inputs, *, scales, cond, rtol, atol, seed,
                       per_block, raise_on_failure, output_fn, compute_dtype) -> Tuple[tuple, dict, Tuple[float, ...]]:
    """The arguments of :func:`verify_layout` checked, in the order of its parameters (the layout
    against the model after the options): ``(args, kwargs, scales)``."""
    check.module("model", model)
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if tol is not None:
            check.non_negative_finite(name, tol)
    integer_at_least("seed", seed, -2 ** 63)
    if not isinstance(per_block, (bool, str)) or per_block not in (True, False, "auto"):
        raise InvalidArgument(f"per_block must be True, False or 'auto', got {per_block!r}")
    flag("raise_on_failure", raise_on_failure)
    check.optional_callable("output_fn", output_fn, "output_fn(model output) -> tensor")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                          and compute_dtype.is_floating_point):
        raise InvalidArgumentType(f"compute_dtype must be a floating torch.dtype (e.g. torch.float64) or None "
                                  f"for the model's, got {compute_dtype!r}")
    check.materialised(model, "verify()")
    layout.check_model(model, what="verify()")
    refuse_empty_inputs(example_inputs, "verify()")
    args, kwargs = split_inputs(example_inputs, model_device(model))
    scales = positive_finite_sequence("scales", scales)
    if cond is not None and positive_finite("cond", cond) < 1:
        raise InvalidArgument(f"cond must be a condition number >= 1 (or None for Gaussian actions), "
                              f"got {cond!r}")
    return args, kwargs, scales


def refuse_empty_inputs(example_inputs: Any, what: str) -> None:
    """Refuse example inputs whose tensors are all empty (``x[:0]``): a symmetry check on them compares
    nothing and would pass whatever the blocks."""
    tensors: List[Tensor] = []

    def collect(x):
        if isinstance(x, Tensor):
            tensors.append(x)
        elif isinstance(x, Mapping):
            for v in x.values():
                collect(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                collect(v)

    collect(example_inputs)
    if tensors and all(t.numel() == 0 for t in tensors):
        raise InvalidArgument(f"{what}: example_inputs hold no data (empty tensors of shapes "
                              f"{[tuple(t.shape) for t in tensors][:3]}): a verification on an empty batch proves "
                              f"nothing; pass inputs with at least one example, e.g. the first batch")


def model_device(model: nn.Module) -> Optional[torch.device]:
    """The device of the model's weights (of its first parameter or buffer not on the meta device)."""
    return device_of(itertools.chain(model.parameters(), model.buffers()))


def _finite_parameters(model: nn.Module) -> Dict[str, Tensor]:
    """The model's parameters (detached), refused when one is not finite."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    bad = [n for n, p in params.items() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        shown = ", ".join(bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise InvalidArgument(f"verify(): the model's weights are not finite (nan or inf in {shown}); "
                              "the symmetry cannot be checked at such weights: load or train finite weights")
    return params


def _in_compute_dtype(model: nn.Module, params: Dict[str, Tensor], args: tuple, kwargs: dict,
                      compute_dtype: Optional[torch.dtype]) -> Tuple[torch.dtype, Dict[str, Tensor],
                                                                     Dict[str, Tensor], tuple, dict]:
    """``(dtype, params, buffers, args, kwargs)`` of the check: the compute dtype (``compute_dtype``,
    else the model's, float32 for a half-precision model) and, where the model has floating weights
    of another dtype, the floating parameters, buffers and inputs cast to it (buffers empty when
    nothing is cast)."""
    fdt = [p.dtype for p in params.values() if p.is_floating_point()]
    if compute_dtype is None and fdt and not any(d in (torch.float16, torch.bfloat16) for d in fdt):
        # float32 and float64 weights mixed on purpose (a float64 head over a float32 body): the
        # model runs as it is, judged at the precision of its least precise weights
        return max(set(fdt), key=lambda d: torch.finfo(d).eps), params, {}, args, kwargs
    model_dtype = fdt[0] if fdt else torch.get_default_dtype()
    cdt = compute_dtype or (torch.float32 if model_dtype in (torch.float16, torch.bfloat16) else model_dtype)
    if not any(p.is_floating_point() and p.dtype != cdt for p in params.values()):
        return cdt, params, {}, args, kwargs
    params = {n: p.to(cdt) if p.is_floating_point() else p for n, p in params.items()}
    extra = {n: b.to(cdt) for n, b in model.named_buffers() if b.is_floating_point()}

    def cast(x):
        if isinstance(x, Tensor):
            return x.to(cdt) if x.is_floating_point() else x
        if isinstance(x, (tuple, list)):
            return type(x)(cast(v) for v in x)
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x

    return cdt, params, extra, cast(args), cast(kwargs)


def _failure(report: VerifyReport) -> str:
    """What broke the symmetry, for the :class:`SymmetryError` of a failed report."""
    if report.failing:
        worst = {b.name: b.max_rel_dev for b in report.blocks if not b.passed}
        what = "; ".join(f"{n} (max rel dev {d:.2e})" for n, d in worst.items())
        return f"GL symmetry broken by block(s): {what}"
    if not report.per_block_checked:
        return "GL symmetry broken when all blocks act together (blocks not checked one by one)"
    return ("GL symmetry broken when all blocks act together, although no single block fails "
            "on its own (blocks interact: overlapping or coupled parameters?)")


# ----------------------------------------------------------------------------- the record of checks
#: model -> signatures of the layouts that passed verification on it
_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()


def _block_key(block: GLBlock) -> Any:
    try:                                   # frozen dataclasses compare by value: a re-detected
        hash(block)                        # layout with the same blocks counts as verified
        return block
    except TypeError:                      # a group holding tensors: by identity
        return id(block)


def signature(model: nn.Module, layout: Checkable) -> Tuple:
    """What a verification of ``layout`` on ``model`` depends on: its blocks (by value where they are
    hashable, else by identity) and ``(name, shape, dtype, device, storage address)`` of every
    parameter they touch (``(name, None)`` for one the model lacks)."""
    params = dict(model.named_parameters())
    touched = sorted({p for b in layout.blocks for p in b.params})
    state = tuple((n, tuple(params[n].shape), params[n].dtype, str(params[n].device), _address(params[n]))
                  if n in params else (n, None) for n in touched)
    return tuple(_block_key(b) for b in layout.blocks), state


def _address(p: Tensor) -> int:
    """The storage address of a parameter (of this rank's shard for a DTensor, whose own is 0)."""
    local = getattr(p, "to_local", None)
    return (local() if local is not None else p).data_ptr()


def record_verification(model: nn.Module, layout: Checkable, passed: bool) -> None:
    """Remember (``passed=True``) or forget that ``layout`` passed verification on ``model`` (called
    by :meth:`Layout.verify <quotient_manifolds.adapters.Layout.verify>`)."""
    try:
        done = _VERIFIED.setdefault(model, set())
    except TypeError:                       # a model that cannot be weakly referenced: no record
        return
    sig = signature(model, layout)
    if passed:
        done.add(sig)
    else:
        done.discard(sig)


def is_verified(model: nn.Module, layout: Checkable) -> bool:
    """Whether ``layout`` (or a layout with equal blocks) passed :meth:`Layout.verify
    <quotient_manifolds.adapters.Layout.verify>` on ``model`` in its current state (same parameter
    tensors)."""
    try:
        done = _VERIFIED.get(model)
    except TypeError:
        return False
    return bool(done) and signature(model, layout) in done


def record(model: nn.Module, layout: Checkable, report: VerifyReport) -> None:
    """Remember the outcome of a check of ``layout`` on ``model``: ``layout.verify_failed`` lists the
    failing blocks (all blocks when only the joint check failed; empty when it passed), and a layout
    that passed is marked verified for the model in its current state (:func:`record_verification`)."""
    layout.verify_failed = [] if report.passed else (report.failing or [b.name for b in layout.blocks])
    record_verification(model, layout, report.passed)


def verified_before_sharding(model: nn.Module, layout) -> bool:
    """Whether ``layout`` (its blocks, by value) passed :meth:`Layout.verify` on ``model`` while its
    parameters had the same names, shapes and dtypes, i.e. on the whole model before ``fully_shard``
    replaced them by DTensors (same global shapes, new storage)."""
    try:
        done = _VERIFIED.get(model) or ()
    except TypeError:
        return False
    blocks, state = signature(model, layout)
    now = tuple(entry[:3] for entry in state)
    return any(sig[0] == blocks and tuple(entry[:3] for entry in sig[1]) == now for sig in done)
