r"""Derive each block's symmetry group from its module's output, numerically.

A block is a pair of factors ``(G_j, H_j)`` per gauge ``j``.  Its group is the set of ``A`` with
``f(G_j A, H_j A⁻ᵀ) = f(G_j, H_j)`` for the attention module's output ``f``; its Lie algebra is the
null space of the linearised condition ``Λ ↦ d/dt f(G_j e^{tΛ}, H_j e^{-tΛᵀ})|₀`` over the module's
inputs (:func:`quotient_manifolds.core.algebra.derive_algebra`), and
:func:`~quotient_manifolds.core.algebra.recognise_algebra` names it (GL(h), the rotary commutant,
scalars, orthogonal, scaled orthogonal, trivial, or the group of the basis itself).

Design
------
* **Inputs.**  A module's output depends on its inputs (hidden states, masks, position
  embeddings), which only a forward pass of the model produces: :func:`~quotient_manifolds.adapters.evaluation.capture_module_inputs`
  records the real inputs of each attention module with forward pre-hooks during one forward pass
  of the model on ``example_inputs`` (the first batch, as for :meth:`~quotient_manifolds.adapters.Layout.verify`).
* **The output as a function of one gauge.**  ``output_of(G, H)`` is the module's first output
  tensor, computed with ``torch.func.functional_call`` on a float64 copy of *that module's*
  parameters and buffers (and of its captured inputs) in which gauge ``j`` of the block is replaced
  (``GLBlock.gather`` / ``scatter``); the block's other gauges and the module's frozen parameters
  stay as they are, its other trainable parameters are moved to a generic nearby point
  (:data:`GENERIC_SHIFT`): sharpness perturbs them too, so the group must hold on a neighbourhood
  of them, not only at their current values (QK-norm gains that are all ones admit rotations that
  any other gains break: with trainable gains the Q/K half has no continuous symmetry, with frozen
  gains it keeps the rotations).  The user's model is never modified or cast; eval mode is set
  for the passes and every submodule's flag is restored.
* **One derivation per module signature.**  Results are cached per (module class, its parameter
  names, shapes and trainable flags, its scalar attributes, its config, the values of its small
  parameters that no block touches — e.g. frozen QK-norm gains, which decide the group —, the
  block's kind, heads, pieces and
  sizes): the 32 identical layers of a decoder derive once.  Gauge 0 is derived; a second gauge
  (the last) is derived too when the head size is at most :data:`SECOND_GAUGE_MAX_HEAD_DIM` or the
  first was cheap (:data:`SECOND_GAUGE_MAX_EVALUATIONS`), and must give the same group.
* **How.**  :func:`~quotient_manifolds.core.algebra.derive_group`: the closed forms are screened
  with two random directions each and the largest that passes is certified maximal with one
  directional derivative per irreducible component of its complement; otherwise the null space.
* **What is used.**  A group found so (a certified closed form, or a null space that is closed
  under the bracket and separated from the rest of the spectrum by a clear gap) replaces the
  block's candidate group (``group_source`` says ``"derived: <group>, dim, gap, method, number of
  directional derivatives"``).  A trivial algebra (dimension 0) means the block carries no continuous
  symmetry: the block is removed and its half reported in ``layout.unsupported`` with the reason;
  its parameters are then treated elementwise.  An inconclusive derivation (not closed, small gap,
  different spans on two gauges) keeps the candidate group, says so in ``group_source`` and
  ``layout.notes``, and leaves the decision to verification (:mod:`quotient_manifolds.adapters.accept`).
  Meta-device modules cannot be evaluated: the candidate group is kept, marked
  ``"not derived (meta device)"``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from typing import Any, Container, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from quotient_manifolds.core.algebra import GroupDerivation, derive_group
from quotient_manifolds.errors import InvalidArgumentType

from .blocks import GLBlock
from .evaluation import capture_module_inputs
from .layouts import Layout, Unsupported
from .modes import eval_mode

__all__ = ["BlockDerivation", "derive_block", "derive_groups", "with_blocks", "clear_cache",
           "SECOND_GAUGE_MAX_HEAD_DIM"]

#: derive a second gauge (and compare the groups) for heads at most this wide, or when the first
#: gauge took at most SECOND_GAUGE_MAX_EVALUATIONS × h directional derivatives (a screened closed
#: form: GL, the orthogonal groups); the full null space costs h² of them and O(h⁶) algebra
SECOND_GAUGE_MAX_HEAD_DIM = 32
SECOND_GAUGE_MAX_EVALUATIONS = 16
#: the module's other trainable weights are moved by this fraction of their RMS (Gaussian) for the
#: derivation: a generic nearby point, where the group found holds on a neighbourhood
GENERIC_SHIFT = 0.1
#: parameters of the attention module outside its linear projections with at most this many
#: entries enter the cache key by value (norm gains, scalars): they can change the group
SMALL_PARAM_NUMEL = 1 << 16
_CACHE: Dict[Tuple, "BlockDerivation"] = {}
_CACHE_SIZE = 512


@dataclass(frozen=True)
class BlockDerivation:
    """How a block's group was found.  ``status``: ``"derived"`` (the group is used),
    ``"trivial"`` (no continuous symmetry: the block is removed, its half reported),
    ``"inconclusive"`` (the candidate group is kept), ``"not derived"`` (meta device, no inputs)."""

    block: str
    status: str
    group: Any
    dim: Optional[int]
    gap: Optional[float]
    closed: Optional[bool]
    source: str
    seconds: float
    cached: bool = False


def clear_cache() -> None:
    """Forget all cached derivations."""
    _CACHE.clear()


# ------------------------------------------------------------------------------------ inputs
def _to_float64(x):
    if isinstance(x, Tensor):
        return x.to(torch.float64) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_to_float64(v) for v in x)
    if isinstance(x, Mapping):
        return {k: _to_float64(v) for k, v in x.items()}
    return x


# ------------------------------------------------------------------------------------ output_of
def _first_tensor(out) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, Tensor):
                return v
    if isinstance(out, Mapping):
        for v in out.values():
            if isinstance(v, Tensor):
                return v
    raise InvalidArgumentType(f"the attention module returned a {type(out).__name__} without a tensor")


def _module_output_fn(model: nn.Module, block: GLBlock, inputs: Tuple[tuple, dict], gauge: int):
    """``(output_of, G_j, H_j)`` for gauge ``j`` of ``block`` (module docstring)."""
    from torch.func import functional_call

    mod = model.get_submodule(block.module)
    prefix = block.module + "." if block.module else ""
    full = {prefix + n: p.detach().to(torch.float64) if p.is_floating_point() else p.detach()
            for n, p in mod.named_parameters()}
    # the group must hold for every nearby value of the module's other trainable weights, which
    # sharpness perturbs too: they are moved to a generic nearby point (a QK-norm gain vector of
    # ones admits rotations that any other gain vector breaks); frozen weights stay as they are
    gen = torch.Generator().manual_seed(0)
    own = set(block.params)
    rms = lambda v: float(v.pow(2).mean().sqrt()) if v.numel() else 0.0  # noqa: E731
    typical = rms(torch.cat([v.reshape(-1) for v in full.values() if v.is_floating_point()] or [torch.zeros(1)]))
    for n, p in mod.named_parameters():
        if prefix + n not in own and p.requires_grad and p.is_floating_point():
            v = full[prefix + n]
            noise = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(v.device)
            full[prefix + n] = v + GENERIC_SHIFT * (rms(v) or typical or 1.0) * noise   # zeros: the module's scale
    buffers = {n: b.to(torch.float64) if b.is_floating_point() else b for n, b in mod.named_buffers()}
    args, kwargs = _to_float64(inputs[0]), _to_float64(inputs[1])
    x0 = block.gather(full)

    def output_of(G: Tensor, H: Tensor) -> Tensor:
        x = torch.cat([x0[:gauge], torch.cat([G, H], dim=-2).unsqueeze(0), x0[gauge + 1:]], dim=0)
        new = block.scatter(full, x)
        local = {n[len(prefix):]: v for n, v in new.items()}
        return _first_tensor(functional_call(mod, {**local, **buffers}, args, kwargs))

    G0, H0 = block.split(x0[gauge])
    return output_of, G0, H0


# ------------------------------------------------------------------------------------ cache key
def _digest(t: Tensor) -> str:
    return hashlib.sha1(t.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()).hexdigest()


def _cache_key(model: nn.Module, block: GLBlock) -> Tuple:
    mod = model.get_submodule(block.module)
    prefix = block.module + "." if block.module else ""
    touched = set(block.params)
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in mod.named_parameters())
    # values of small parameters outside the projections (norm gains, scalars) can decide the group
    projections = {f"{sub}.{n}" if sub else n for sub, m in mod.named_modules()
                   if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
                   for n, _ in m.named_parameters(recurse=False)}
    small = tuple((n, _digest(p)) for n, p in mod.named_parameters()
                  if n not in projections and prefix + n not in touched and p.numel() <= SMALL_PARAM_NUMEL
                  and p.is_floating_point() and p.device.type != "meta")
    attrs = tuple(sorted((k, v) for k, v in vars(mod).items()      # the layer's index does not matter
                         if not k.startswith("_") and k not in ("layer_idx", "layer_id", "layer_number")
                         and isinstance(v, (int, float, bool, str, type(None)))))
    config = getattr(mod, "config", None)
    cfg = None
    if config is not None and hasattr(config, "to_dict"):
        cfg = hashlib.sha1(repr(sorted(config.to_dict().items(), key=lambda kv: kv[0])).encode()).hexdigest()
    pieces = tuple(replace(p, param=p.param[len(prefix):]) for p in block.pieces)
    return (type(mod), params, small, attrs, cfg, block.kind, block.num_heads, block.head_dim,
            block.n, block.m, pieces)


# ------------------------------------------------------------------------------------ derivation
def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.1e}"


#: relative step of the finite differences that replace forward-mode AD where functorch cannot
#: run the module: the fourth-order stencil's error (step⁴ ≈ 1e-12) and rounding (eps/step ≈ 1e-13)
#: stay below the derivation's threshold (NULL_RTOL = 1e-8), whose floor is measured anyway
FINITE_DIFFERENCE_STEP = 1e-3


def finite_difference_jvp(fn, primals, tangents):
    """``(fn(*primals), derivative along tangents)`` like ``torch.func.jvp``, the derivative by the
    fourth-order central difference (−f(x + 2tv) + 8f(x + tv) − 8f(x − tv) + f(x − 2tv)) / 12t, t =
    :data:`FINITE_DIFFERENCE_STEP`: for modules that functorch transforms cannot run (a custom
    ``torch.autograd.Function`` without a ``jvp`` rule, non-functional code)."""
    t = FINITE_DIFFERENCE_STEP
    at = lambda c: fn(*(x + c * t * v for x, v in zip(primals, tangents)))  # noqa: E731
    with torch.no_grad():
        return fn(*primals), (-at(2.0) + 8.0 * at(1.0) - 8.0 * at(-1.0) + at(-2.0)) / (12.0 * t)


def _derive_one(model: nn.Module, block: GLBlock, inputs: Tuple[tuple, dict], gauge: int,
                rtol: Optional[float]) -> GroupDerivation:
    """The derivation of one gauge: forward-mode AD, else (functorch cannot run the module) finite
    differences under the same thresholds; a module neither can run is reported, never raised."""
    output_of, G, H = _module_output_fn(model, block, inputs, gauge)
    options = {} if rtol is None else {"rtol": rtol}
    try:
        return derive_group(output_of, G, H, **options)
    except ValueError as err:          # too few outputs for the null space
        return GroupDerivation(None, 0, 0.0, False, "null space", 0, str(err).split(":")[0])
    except (RuntimeError, NotImplementedError) as err:      # functorch cannot transform the module
        why = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    try:
        d = derive_group(output_of, G, H, jvp=finite_difference_jvp, **options)
    except Exception as err:           # cannot be evaluated off its weights at all: recorded as the reason
        name = type(model.get_submodule(block.module)).__name__
        return GroupDerivation(None, 0, 0.0, False, "not derived", 0,
                               f"{name} at {block.module or 'the model'} cannot be differentiated (functorch: "
                               f"{why}; finite differences: {type(err).__name__}: {str(err).splitlines()[0][:160]})")
    return replace(d, method=f"{d.method}, finite differences (functorch: {why.split(':')[0]})")


def derive_block(model: nn.Module, block: GLBlock, inputs: Optional[Tuple[tuple, dict]], *,
                 rtol: Optional[float] = None, use_cache: bool = True) -> BlockDerivation:
    """Derive the group of ``block`` from its module's output at ``inputs`` (the module's captured
    ``(args, kwargs)``, see :func:`~quotient_manifolds.adapters.evaluation.capture_module_inputs`) with
    :func:`~quotient_manifolds.core.algebra.derive_group`.  See the module docstring."""
    started = time.perf_counter()
    mod = model.get_submodule(block.module)
    if any(p.device.type == "meta" for p in mod.parameters()):
        return BlockDerivation(block.name, "not derived", block.group, None, None, None,
                               _kept(block, "not derived (meta device)"), 0.0)
    if inputs is None:
        return BlockDerivation(block.name, "not derived", block.group, None, None, None,
                               _kept(block, "not derived (module not called on the example inputs)"), 0.0)
    key = _cache_key(model, block) if use_cache else None
    if key is not None and key in _CACHE:
        hit = _CACHE[key]
        return replace(hit, block=block.name, cached=True,
                       source=hit.source if hit.status in ("derived", "trivial") else _kept(block, hit.source))
    # forward-mode AD: the fused CPU/GPU attention kernels have no jvp, the math kernel does
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h = block.head_dim
    with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):
        d = _derive_one(model, block, inputs, 0, rtol)
        agree = True
        if d.group is not None and block.num_heads > 1 and (
                h <= SECOND_GAUGE_MAX_HEAD_DIM or d.evaluations <= SECOND_GAUGE_MAX_EVALUATIONS * h):
            d1 = _derive_one(model, block, inputs, block.num_heads - 1, rtol)
            agree = d1.group is not None and d1.group == d.group
    elapsed = time.perf_counter() - started
    facts = f"dim {d.dim}, gap {_fmt(d.gap)}, {d.method}, {d.evaluations} directional derivatives"
    if d.group is None or not agree:
        why = d.reason if d.group is None else "two gauges give different groups"
        res = BlockDerivation(block.name, "inconclusive", None, d.dim, d.gap, d.closed,
                              f"derivation inconclusive ({why}; {facts})", elapsed)
    elif d.dim == 0:
        res = BlockDerivation(block.name, "trivial", None, 0, d.gap, d.closed,
                              f"no continuous symmetry: the derived Lie algebra is trivial ({facts})", elapsed)
    else:
        named = d.group.describe(h)
        res = BlockDerivation(block.name, "derived", d.group, d.dim, d.gap, d.closed,
                              f"derived: {named}, {facts.split(', ', 1)[1] if 'dim' in named else facts}", elapsed)
    if key is not None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = res
    if res.status in ("inconclusive",):
        res = replace(res, source=_kept(block, res.source))
    return res


def _kept(block: GLBlock, why: str) -> str:
    was = block.group_source or "candidate"
    return f"{was}; {why}: candidate group kept"


def derive_groups(model: nn.Module, layout: Layout, example_inputs: Any, *, rtol: Optional[float] = None,
                  use_cache: bool = True, only: Optional[Container[str]] = None
                  ) -> Tuple[Layout, List[BlockDerivation]]:
    """A new :class:`Layout` whose blocks carry their derived groups, and one
    :class:`BlockDerivation` per derived block (module docstring).  ``only``: names of the blocks to
    derive (default: all); the others are kept as they are.  Blocks whose derived algebra is trivial
    are removed and reported in ``layout.unsupported`` (``"<module>/<kind>"``) with the reason; their
    parameters become adaptive.  ``layout`` and ``model`` are not modified."""
    layout.check_model(model, what="derive_groups()")
    chosen = [b for b in layout.blocks if only is None or b.name in only]
    meta = any(p.device.type == "meta" for p in model.parameters())
    inputs = {} if meta else capture_module_inputs(model, [b.module for b in chosen], example_inputs)
    results: Dict[str, BlockDerivation] = {}
    with eval_mode(model):
        for b in chosen:
            results[b.name] = derive_block(model, b, inputs.get(b.module), rtol=rtol, use_cache=use_cache)
    blocks: List[GLBlock] = []
    unsupported = list(layout.unsupported)
    notes = list(layout.notes)
    for b in layout.blocks:
        r = results.get(b.name)
        if r is None:
            blocks.append(b)
        elif r.status == "derived":
            blocks.append(replace(b, group=r.group, group_source=r.source))
        elif r.status == "trivial":
            cls = type(model.get_submodule(b.module)).__name__
            unsupported.append(Unsupported(f"{b.module}/{b.kind}", cls, r.source))
        else:
            blocks.append(replace(b, group_source=r.source))
            if r.status == "inconclusive":
                notes.append(f"block {b.name}: {r.source}")
    return with_blocks(layout, blocks, unsupported, notes), list(results.values())


def with_blocks(layout: Layout, blocks: List[GLBlock], unsupported: List[Unsupported],
                 notes: List[str]) -> Layout:
    """``layout`` with another block list: GL masks and the adaptive list recomputed."""
    gl_masks: Dict[str, Tensor] = {}
    for b in blocks:
        for p in b.pieces:
            shape = layout.param_shapes.get(p.param) or tuple(layout.gl_masks[p.param].shape)
            mk = p.mask(torch.zeros(shape, dtype=torch.bool))
            gl_masks[p.param] = gl_masks[p.param] | mk if p.param in gl_masks else mk
    frozen = set(layout.frozen)
    names = list(dict.fromkeys([*layout.param_shapes, *layout.adaptive, *layout.gl_masks]))
    adaptive = [n for n in names if n not in frozen and (n not in gl_masks or not bool(gl_masks[n].all()))]
    return replace(layout, blocks=blocks, adaptive=adaptive, gl_masks=gl_masks, unsupported=unsupported,
                   notes=notes, verify_failed=[])
