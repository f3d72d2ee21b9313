"""Layouts: which parameter slices of a model form the GL(h) blocks of its attention layers.

A :class:`Layout` is plain data built from a model without modifying or wrapping it
(docs/maths.md §6.2; §13 for rotary, grouped-query and LoRA blocks):

* every attention layer and every head ``i`` gives two GL(d_head) blocks, with ``r_i = i*dh:(i+1)*dh``
  and PyTorch ``Linear.weight`` of shape ``(out, in)``::

      QK:  G = [W_q[r_i,:]^T ; b_q[r_i]]  (d+1, dh)     H = [W_k[r_i,:]^T ; b_k[r_i]]  (d+1, dh)
      VO:  G = [W_v[r_i,:]^T ; b_v[r_i]]  (d+1, dh)     H = W_o[:, r_i]               (d, dh)

  biases are an extra row because the input is ``[X 1]``; ``b_o`` is not in any block;
* everything else (and the part of a parameter no block covers) is *adaptive* (elementwise).

A block is a list of :class:`FactorPiece` objects (one piece = one parameter slice, for all heads at
once) for ``G`` and for ``H``; blocks are read with :meth:`GLBlock.gather` and written back, out of
place and differentiably, with :meth:`GLBlock.scatter`.  The GL action used throughout is
``(G, H) -> (G A, H A^{-T})`` (docs/maths.md §1; the paper's ``(G A^{-1}, H A^T)`` is the same
action with ``A -> A^{-1}``).

:meth:`Layout.verify` checks numerically that the declared/detected blocks really are symmetries of
the model (random ill-conditioned per-head actions, model output unchanged), and names the block that
is not.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union)

import torch
from torch import Tensor, nn

from quotient_manifolds.core.gl import group_action
from quotient_manifolds.core.groups import FULL_GL, Group, as_group

__all__ = [
    "FactorPiece", "GLBlock", "Layout", "Unsupported", "VerifyReport", "BlockCheck", "SymmetryError",
    "declare_block", "default_tolerance", "primary_output", "head_structure", "PIECE_KINDS",
]

PIECE_KINDS = ("rows", "cols", "bias")


# --------------------------------------------------------------------------------------------------
# FactorPiece
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FactorPiece:
    """One piece of a GL factor read from one parameter, for all heads at once.

    ``kind``:

    * ``"rows"``: ``W[s_i : s_i + h, :]^T`` -> ``(heads, in, h)``
      (q/k/v weights in ``(out, in)`` layout; also the output projection of a ``Conv1D``);
    * ``"cols"``: ``W[:, s_i : s_i + h]`` -> ``(heads, out, h)``
      (output projection in ``(out, in)`` layout; also q/k/v of a ``Conv1D`` in ``(in, out)`` layout);
    * ``"bias"``: ``b.flatten()[s_i : s_i + h]`` -> ``(heads, 1, h)`` (a bias row; the parameter may
      have any shape, e.g. ``nn.MultiheadAttention.bias_k`` is ``(1, 1, E)``),

    with head ``i`` starting at ``s_i = offset + i * stride`` (``stride`` defaults to ``head_dim``:
    heads side by side; GPT-NeoX's packed ``query_key_value`` interleaves q, k, v per head, stride
    ``3 * head_dim``).

    ``group_size`` > 1 stacks consecutive heads into one block head (grouped-query attention: the
    ``group_size`` query heads that share one key/value head share one gauge): :meth:`read` then
    gives ``(num_heads // group_size, group_size * k, head_dim)``.
    """

    param: str
    kind: str
    offset: int
    num_heads: int
    head_dim: int
    group_size: int = 1
    stride: Optional[int] = None

    def __post_init__(self):
        if self.kind not in PIECE_KINDS:
            raise ValueError(f"FactorPiece.kind must be one of {PIECE_KINDS}, got {self.kind!r}")
        if self.offset < 0 or self.num_heads < 1 or self.head_dim < 1:
            raise ValueError(f"invalid FactorPiece {self}: need offset >= 0, num_heads >= 1, head_dim >= 1")
        if self.group_size < 1 or self.num_heads % self.group_size:
            raise ValueError(f"invalid FactorPiece {self}: group_size must divide num_heads "
                             f"({self.num_heads} heads in groups of {self.group_size})")
        if self.stride is not None and self.stride < self.head_dim:
            raise ValueError(f"invalid FactorPiece {self}: stride {self.stride} < head_dim "
                             f"{self.head_dim} would make heads overlap")

    @property
    def head_stride(self) -> int:
        return self.head_dim if self.stride is None else self.stride

    @property
    def block_heads(self) -> int:
        """Number of block heads (gauges): ``num_heads // group_size``."""
        return self.num_heads // self.group_size

    @property
    def width(self) -> int:
        """Extent of the sliced dimension from ``offset`` to the end of the last head."""
        return (self.num_heads - 1) * self.head_stride + self.head_dim

    def _index(self, device) -> Tensor:
        """Positions along the sliced dimension, head-major: ``(num_heads * head_dim,)``."""
        heads = torch.arange(self.num_heads, device=device) * self.head_stride
        return (self.offset + heads[:, None] + torch.arange(self.head_dim, device=device)).reshape(-1)

    def rows_per_head(self, shape: Sequence[int]) -> int:
        """Rows this piece contributes to the factor per block head (``group_size * k``)."""
        self.check_shape(shape)
        if self.kind == "rows":
            k = int(shape[1])
        elif self.kind == "cols":
            k = int(shape[0])
        else:
            k = 1
        return self.group_size * k

    def check_shape(self, shape: Sequence[int]) -> None:
        """Raise ``ValueError`` if the piece does not fit into a parameter of this shape."""
        shape = tuple(int(s) for s in shape)
        if self.kind in ("rows", "cols"):
            if len(shape) != 2:
                raise ValueError(f"{self}: kind {self.kind!r} needs a 2-D parameter, {self.param!r} has shape {shape}")
            dim = shape[0] if self.kind == "rows" else shape[1]
        else:
            dim = math.prod(shape)
        if self.offset + self.width > dim:
            raise ValueError(
                f"{self}: {self.num_heads} heads of {self.head_dim} from offset {self.offset} (stride "
                f"{self.head_stride}) need [{self.offset}:{self.offset + self.width}], out of range for "
                f"parameter {self.param!r} of shape {shape} (kind {self.kind!r} slices a dimension of size "
                f"{dim}); check num_heads / head_dim / offsets"
            )

    # -- reading / writing -------------------------------------------------------------------------

    def read(self, params: Mapping[str, Tensor]) -> Tensor:
        """``(block_heads, group_size * k, head_dim)`` view of ``params[self.param]`` (differentiable)."""
        return self.read_from(params[self.param])

    def read_from(self, W: Tensor) -> Tensor:
        nh, h = self.num_heads, self.head_dim
        if self.kind == "rows":
            sl = self._slice(W, 0)
            per_head = sl.reshape(nh, h, W.shape[1]).transpose(1, 2)
        elif self.kind == "cols":
            sl = self._slice(W, 1)
            per_head = sl.reshape(W.shape[0], nh, h).permute(1, 0, 2)
        else:
            per_head = self._slice(W.reshape(-1), 0).reshape(nh, 1, h)
        return per_head.reshape(self.block_heads, -1, h)

    def _slice(self, W: Tensor, dim: int) -> Tensor:
        if self.stride is None or self.stride == self.head_dim:
            return W.narrow(dim, self.offset, self.width)
        return W.index_select(dim, self._index(W.device))

    def write(self, param_value: Tensor, value: Tensor) -> Tensor:
        """New full parameter equal to ``param_value`` except this piece, which becomes ``value``.

        Out of place and differentiable in both arguments.  ``value`` is cast to the dtype/device of
        ``param_value`` (so a block can be acted on in float64 and written back into float32 weights).
        """
        W = param_value
        nh, h = self.num_heads, self.head_dim
        k = self.rows_per_head(W.shape)
        if tuple(value.shape) != (self.block_heads, k, h):
            raise ValueError(f"{self}: value has shape {tuple(value.shape)}, expected {(self.block_heads, k, h)}")
        value = value.to(dtype=W.dtype, device=W.device).reshape(nh, k // self.group_size, h)
        if self.kind == "rows":
            return self._put(W, 0, value.transpose(1, 2).reshape(nh * h, W.shape[1]))
        if self.kind == "cols":
            return self._put(W, 1, value.permute(1, 0, 2).reshape(W.shape[0], nh * h))
        return self._put(W.reshape(-1), 0, value.reshape(nh * h)).reshape(W.shape)

    def _put(self, W: Tensor, dim: int, new: Tensor) -> Tensor:
        if self.stride is None or self.stride == self.head_dim:
            o, w = self.offset, self.width
            return torch.cat([W.narrow(dim, 0, o), new, W.narrow(dim, o + w, W.shape[dim] - o - w)], dim=dim)
        return W.index_copy(dim, self._index(W.device), new)

    def mask(self, param_value: Tensor) -> Tensor:
        """Boolean tensor of the parameter's shape, True on the entries of this piece: a read-only
        broadcast view of the mask along the sliced dimension (no full-size allocation; on the CPU
        for a parameter on the meta device, so models built without weights get real layouts)."""
        W = param_value
        self.check_shape(W.shape)
        device = torch.device("cpu") if W.is_meta else W.device
        idx = self._index(device)
        if self.kind == "bias":
            m = torch.zeros(W.numel(), dtype=torch.bool, device=device)
            m[idx] = True
            return m.view(W.shape)
        along = torch.zeros(W.shape[0 if self.kind == "rows" else 1], dtype=torch.bool, device=device)
        along[idx] = True
        return (along[:, None] if self.kind == "rows" else along[None, :]).expand(W.shape)

    def describe(self, strip: str = "") -> str:
        name = self.param[len(strip) + 1:] if strip and self.param.startswith(strip + ".") else self.param
        end = self.offset + self.width
        sl = f"{self.offset}:{end}" + (f" step {self.head_stride}" if self.head_stride != self.head_dim else "")
        grouped = f" (x{self.group_size} heads per gauge)" if self.group_size > 1 else ""
        if self.kind == "rows":
            return f"{name}[{sl}]ᵀ{grouped}"
        if self.kind == "cols":
            return f"{name}[:, {sl}]{grouped}"
        return f"{name}[{sl}]{grouped}"


# --------------------------------------------------------------------------------------------------
# GLBlock
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GLBlock:
    """One gauge per block head: ``f(G, H) = g(G Hᵀ)`` invariant under ``(G A, H A⁻ᵀ)`` for every
    ``A`` in ``group`` (the full GL(head_dim) by default; the rotary commutant for RoPE Q/K blocks).

    ``G = cat([p.read(params) for p in g_pieces], dim=-2)`` has shape ``(num_heads, n, head_dim)``,
    ``H`` likewise ``(num_heads, m, head_dim)``; ``num_heads`` counts block heads (gauges): with
    grouped-query attention one per key/value head, its query (QK) or output (VO) slices stacked
    (pieces with ``group_size`` > 1).
    """

    name: str
    kind: str
    module: str
    g_pieces: Tuple[FactorPiece, ...]
    h_pieces: Tuple[FactorPiece, ...]
    num_heads: int
    head_dim: int
    n: int
    m: int
    family: str = "declared"
    group: Group = FULL_GL
    #: How ``group`` was found, for users reading a layout: e.g. ``"family hf-rotary"``,
    #: ``"structure: plain attention"``, ``"config: rotary_dim=32 interleaved"``, ``"declared"``,
    #: or ``"derived: ..."`` (the Lie algebra that leaves the module's output unchanged, see
    #: :mod:`quotient_manifolds.adapters.derive`); empty when not recorded.
    group_source: str = field(default="", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "g_pieces", tuple(self.g_pieces))
        object.__setattr__(self, "h_pieces", tuple(self.h_pieces))
        object.__setattr__(self, "group", as_group(self.group))
        if not self.g_pieces or not self.h_pieces:
            raise ValueError(f"block {self.name!r}: needs at least one G piece and one H piece")
        for p in self.pieces:
            if p.block_heads != self.num_heads or p.head_dim != self.head_dim:
                raise ValueError(
                    f"block {self.name!r}: piece {p} gives {p.block_heads} block heads x {p.head_dim} "
                    f"({p.num_heads} heads in groups of {p.group_size}), block has "
                    f"{self.num_heads} x {self.head_dim}; with grouped-query attention give the "
                    f"query (QK) or output (VO) piece group_size = query heads per key/value head"
                )
        if self.head_dim > min(self.n, self.m):
            raise ValueError(
                f"block {self.name!r}: head_dim {self.head_dim} exceeds the rows of G ({self.n}, "
                f"{self.head_dim}) or H ({self.m}, {self.head_dim}) per head: such factors cannot have "
                f"full column rank, so GL({self.head_dim}) does not act freely and the block has no "
                f"quotient. Check num_heads / head_dim (a head larger than the projection's input "
                f"features?), or leave this block out (its weights are then adaptive)")
        self.group.check(self.head_dim)

    @property
    def pieces(self) -> Tuple[FactorPiece, ...]:
        return self.g_pieces + self.h_pieces

    @property
    def params(self) -> Tuple[str, ...]:
        """Names of the parameters this block touches (in order of first appearance)."""
        return tuple(dict.fromkeys(p.param for p in self.pieces))

    @property
    def num_scalars(self) -> int:
        return self.num_heads * (self.n + self.m) * self.head_dim

    def gather(self, params: Mapping[str, Tensor]) -> Tensor:
        """``x = [G; H]`` of shape ``(num_heads, n + m, head_dim)``."""
        return torch.cat([p.read(params) for p in self.pieces], dim=-2)

    def split(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """``(G, H)`` from ``x = [G; H]``."""
        return x[..., : self.n, :], x[..., self.n:, :]

    def scatter(self, params: Mapping[str, Tensor], x: Tensor) -> Dict[str, Tensor]:
        """New dict (shallow copy of ``params``) with the touched parameters replaced so that
        ``gather(result) == x``.  Differentiable w.r.t. ``x``; pieces of several blocks that share one
        parameter (packed ``in_proj_weight``) compose, because each write starts from the current value."""
        expected = (self.num_heads, self.n + self.m, self.head_dim)
        if tuple(x.shape) != expected:
            raise ValueError(f"block {self.name!r}: x has shape {tuple(x.shape)}, expected {expected}")
        out = dict(params)
        start = 0
        for p in self.pieces:
            k = p.rows_per_head(out[p.param].shape)
            out[p.param] = p.write(out[p.param], x[:, start:start + k, :])
            start += k
        return out

    def validate(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Check parameter names, slice ranges and ``n``/``m`` against parameter shapes."""
        for p in self.pieces:
            if p.param not in shapes:
                raise ValueError(f"block {self.name!r}: unknown parameter {p.param!r}")
            try:
                p.check_shape(shapes[p.param])
            except ValueError as err:
                raise ValueError(f"block {self.name!r}: {err}") from None
        n = sum(p.rows_per_head(shapes[p.param]) for p in self.g_pieces)
        m = sum(p.rows_per_head(shapes[p.param]) for p in self.h_pieces)
        if (n, m) != (self.n, self.m):
            raise ValueError(f"block {self.name!r}: declared n={self.n}, m={self.m} but the pieces give n={n}, m={m}")

    def describe(self) -> str:
        g = " + ".join(p.describe(self.module) for p in self.g_pieces)
        h = " + ".join(p.describe(self.module) for p in self.h_pieces)
        # where the group came from goes last: the slices stay where a reader (and old output) has them
        source = f"  [group: {self.group_source}]" if self.group_source else ""
        return (f"{self.kind}: {self.num_heads} heads x {self.group.describe(self.head_dim)}  "
                f"G ({self.n}, {self.head_dim}) = {g}  |  H ({self.m}, {self.head_dim}) = {h}{source}")


def _apply_action(block: GLBlock, params: Mapping[str, Tensor], A: Tensor) -> Dict[str, Tensor]:
    x = block.gather(params)
    ct = torch.promote_types(x.dtype, A.dtype)
    x = x.to(ct)
    A = A.to(dtype=ct, device=x.device)
    if tuple(A.shape) != (block.num_heads, block.head_dim, block.head_dim):
        raise ValueError(
            f"action for block {block.name!r} has shape {tuple(A.shape)}, expected "
            f"{(block.num_heads, block.head_dim, block.head_dim)}"
        )
    return block.scatter(params, torch.cat(group_action(*block.split(x), A), dim=-2))


# --------------------------------------------------------------------------------------------------
# verification report
# --------------------------------------------------------------------------------------------------


class SymmetryError(AssertionError):
    """A declared or detected GL block is not a symmetry of the model; ``.report`` has the details."""

    def __init__(self, message: str, report: "VerifyReport"):
        super().__init__(message)
        self.report = report


@dataclass
class BlockCheck:
    name: str
    kind: str
    module: str
    per_scale: Dict[float, float]
    max_rel_dev: float
    passed: bool


@dataclass
class VerifyReport:
    """Result of :meth:`Layout.verify`.  Deviations are ``max|y' - y| / max|y|`` of the model output."""

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
                lines.append(f"  {b.name:<{w}}  max rel dev {b.max_rel_dev:.2e}  {'ok' if b.passed else 'FAIL'}")
        elif not self.per_block_checked:
            lines.append("  (blocks not checked one by one)")
        return "\n".join(lines)


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
    symmetry deviates by ``1e-2 .. 1`` (rotary QK, mis-declared heads, swapped k/v, missing bias_k).  Half-precision models are checked in float32 (see ``verify``).
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


# --------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------


class Unsupported(NamedTuple):
    """An attention-like module that could not be mapped to GL blocks."""

    module: str
    cls: str
    reason: str


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def map_tensors(fn: Callable[[Tensor], Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, also inside dicts, tuples and lists (a
    batch's inputs or targets); anything else is returned as it is."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if type(obj) in (tuple, list):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``with eval_mode(model):`` runs the block with ``model`` in eval mode, then restores every
    submodule's own ``training`` flag (a plain ``model.train(flag)`` afterwards would overwrite
    submodules deliberately kept in eval mode), also when the block raises."""
    flags = {name: mod.training for name, mod in model.named_modules(remove_duplicate=False)}
    try:
        model.eval()
        yield model
    finally:
        for name, mod in model.named_modules(remove_duplicate=False):
            if name in flags:
                mod.training = flags[name]


def split_inputs(example_inputs, model: nn.Module) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of ``model``, with every tensor on the model's device: inputs
    prepared on the CPU work on a model moved to a GPU."""
    device = next((t.device for t in itertools.chain(model.parameters(), model.buffers())
                   if not t.is_meta), None)

    def moved(x):
        return x if device is None else map_tensors(lambda t: t.to(device), x)

    if isinstance(example_inputs, Mapping):
        return (), moved(dict(example_inputs))
    if isinstance(example_inputs, (tuple, list)):
        return moved(tuple(example_inputs)), {}
    return (moved(example_inputs),), {}


def primary_output(out) -> Tensor:
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
                except TypeError:
                    pass
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, Tensor):
                return v
        for v in out:
            try:
                return primary_output(v)
            except TypeError:
                pass
    raise TypeError(f"cannot find an output tensor in a {type(out).__name__}; pass output_fn=")


def _head_attrs() -> Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]]:
    """Attribute names of head counts, key/value head counts and head sizes, as detection reads them."""
    from .families._structure import HEAD_DIM_ATTRS, HEADS_ATTRS  # families import this module
    from .families.structural import KV_HEADS_ATTRS

    return HEADS_ATTRS, KV_HEADS_ATTRS + ("num_key_value_groups",), HEAD_DIM_ATTRS


def _head_count_text(attr: str, value: int) -> str:
    """``"4 heads"``, ``"2 key/value heads"``, ``"head size 8"`` ... for a :func:`head_structure` entry."""
    heads, kv_heads, _ = _head_attrs()
    name = attr.rsplit(".", 1)[-1]
    if name == "num_key_value_groups":
        return f"{value} query heads per key/value head"
    if name in heads:
        return f"{value} heads"
    return f"{value} key/value heads" if name in kv_heads else f"head size {value}"


def head_structure(model: nn.Module, modules: Iterable[str]) -> Dict[str, Dict[str, int]]:
    """Per module path (missing paths are left out): the integer head counts and head sizes that the
    module, its submodules and their Hugging Face ``config`` declare, keyed by relative attribute
    path, e.g. ``{"encoder.layer.0.attention": {"self.num_attention_heads": 4,
    "self.attention_head_size": 2, "self.config.num_attention_heads": 4}}``.  Weight shapes do not
    fix the heads (4 heads of 2 and 2 heads of 4 have the same projections); these attributes do."""
    heads, kv_heads, dims = _head_attrs()
    names = heads + kv_heads + dims
    out: Dict[str, Dict[str, int]] = {}
    for path in dict.fromkeys(modules):
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        found: Dict[str, int] = {}
        for rel, sub in mod.named_modules():
            prefix = f"{rel}." if rel else ""
            for holder, where in ((sub, prefix), (getattr(sub, "config", None), f"{prefix}config.")):
                if holder is None:
                    continue
                for attr in names:
                    value = getattr(holder, attr, None)
                    if isinstance(value, int) and not isinstance(value, bool):
                        found[where + attr] = value
        out[path] = found
    return out


@dataclass(eq=False)
class Layout:
    """The GL blocks and elementwise (adaptive) parameters of a model.  Pure data: it holds parameter
    names and slices, never the model or its tensors (only the boolean ``gl_masks``).

    It also records which model it belongs to (``param_shapes``, ``head_structure``): every measure
    that takes ``layout=`` (``sharpness``, ``sharpness_sweep``, ``distributed_sharpness``,
    ``GeodesicSAM``, ``riemannian_hessian``) and :meth:`verify` refuse it for a model with other
    parameters or other head counts (:meth:`check_model`), since its blocks would then not be
    that model's symmetry group."""

    blocks: List[GLBlock]
    adaptive: List[str]
    gl_masks: Dict[str, Tensor]
    frozen: List[str]
    unsupported: List[Unsupported]
    param_shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    model_name: str = ""
    notes: List[str] = field(default_factory=list)
    #: blocks that failed the last :meth:`verify` (all blocks if the joint check failed and no single
    #: block was named); ``sharpness()`` refuses such a layout unless ``unsafe=True``
    verify_failed: List[str] = field(default_factory=list)
    #: the head structure of the model the layout was built for (see :func:`head_structure`): per
    #: block module, its head counts and head sizes as the model declares them; with
    #: ``param_shapes`` the identity :meth:`check_model` compares. ``None``: not recorded (a layout
    #: built by hand), then only parameter names and shapes are compared.
    head_structure: Optional[Dict[str, Dict[str, int]]] = None

    # -- identity ----------------------------------------------------------------------------------

    def check_model(self, model: nn.Module, *, what: str = "layout") -> None:
        """Raise ``ValueError`` unless ``model`` is the model this layout was built for: the same
        parameter names and shapes (``param_shapes``), the same head counts and head sizes of every
        block's module (``head_structure``), and every block's slices in range.  A layout of a
        4-head attention used on a 2-head one with the same weight shapes would act with a smaller
        group than the model's symmetry (its geodesic sharpness is then not invariant), and a layout
        of another architecture would fail on a missing parameter; both are refused here, naming
        what differs.  ``what`` names the argument in the message."""
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        problems: List[str] = []
        if self.head_structure:
            now = head_structure(model, self.head_structure)
            for path, attrs in self.head_structure.items():
                where = f"block {path or '<root>'}"
                if path not in now:
                    problems.append(f"{where}: this model has no module {path!r}")
                    continue
                differs: Dict[Tuple[str, str], List[str]] = {}   # (built, has) -> attributes
                for attr, built in attrs.items():
                    has = now[path].get(attr)
                    if has != built:
                        has_text = _head_count_text(attr, has) if has is not None else f"no {attr}"
                        differs.setdefault((_head_count_text(attr, built), has_text), []).append(attr)
                problems += [f"{where}: built for {built}, this model has {has} ({', '.join(attrs_)})"
                             for (built, has), attrs_ in differs.items()]
        recorded = {n: tuple(s) for n, s in self.param_shapes.items()}
        used_by: Dict[str, List[str]] = {}
        for b in self.blocks:
            for name in b.params:
                used_by.setdefault(name, []).append(b.name)
        for n in dict.fromkeys([*recorded, *used_by]):
            if n not in shapes:
                users = f" (used by block {', '.join(used_by[n])})" if n in used_by else ""
                problems.append(f"parameter {n!r}{users} is missing from this model")
        if recorded:
            problems += [f"parameter {n!r}: built for shape {recorded[n]}, this model has {shapes[n]}"
                         for n in recorded if n in shapes and recorded[n] != shapes[n]]
            problems += [f"parameter {n!r} of this model is not in the layout (added after the layout "
                         f"was built?)" for n in shapes if n not in recorded]
        if not problems:
            for b in self.blocks:
                try:
                    b.validate(shapes)
                except ValueError as err:
                    problems.append(str(err))
        if problems:
            shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
            built_for = f" of {self.model_name}" if self.model_name else ""
            raise ValueError(
                f"{what}: the layout{built_for} was built for another model than this "
                f"{type(model).__name__}:\n" + "\n".join(f"  - {p}" for p in shown) + "\n"
                "Build the layout from this model (adapters.layout(model), declaring blocks with "
                "quotient_manifolds.adapters.declare_block(model, ...) on this model), or pass the model it was built for.")

    # -- lookup ------------------------------------------------------------------------------------

    def block(self, name: str) -> GLBlock:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(name)

    @property
    def block_names(self) -> List[str]:
        return [b.name for b in self.blocks]

    @property
    def gl_params(self) -> List[str]:
        """Parameters touched by at least one block (keys of ``gl_masks``)."""
        return list(self.gl_masks)

    def counts(self) -> Dict[str, int]:
        """Numbers of scalars: ``gl``, ``adaptive``, ``frozen``, ``total`` (parameters whose shape is
        unknown, i.e. missing from ``param_shapes`` and ``gl_masks``, count as 0)."""
        def numel(n: str) -> int:
            if n in self.param_shapes:
                return math.prod(self.param_shapes[n])
            return int(self.gl_masks[n].numel()) if n in self.gl_masks else 0

        gl = sum(int(m.sum()) for m in self.gl_masks.values())
        frozen = sum(numel(n) for n in self.frozen)
        adaptive = sum(int((~self.gl_masks[n]).sum()) if n in self.gl_masks else numel(n) for n in self.adaptive)
        names = set(self.param_shapes) | set(self.gl_masks) | set(self.adaptive) | set(self.frozen)
        total = sum(numel(n) for n in names)
        return {"gl": gl, "adaptive": adaptive, "frozen": frozen, "total": total}

    # -- printing ----------------------------------------------------------------------------------

    def __str__(self) -> str:
        modules: Dict[str, List[GLBlock]] = {}
        for b in self.blocks:
            modules.setdefault(b.module, []).append(b)
        head = f"Layout of {self.model_name}" if self.model_name else "Layout"
        lines = [f"{head}: {len(self.blocks)} GL blocks in {len(modules)} modules"]
        for mod, bl in modules.items():
            fam = ", ".join(dict.fromkeys(b.family for b in bl))
            lines.append(f"  {mod or '<root>'}  [{fam}]")
            for b in bl:
                lines.append(f"      {b.describe()}")
        c = self.counts()
        partial = [n for n in self.adaptive if n in self.gl_masks]
        n_gl_params = len(self.gl_masks)
        lines.append(
            f"Scalars: total {_fmt_int(c['total'])} | GL {_fmt_int(c['gl'])} (in {n_gl_params} parameters) | "
            f"adaptive {_fmt_int(c['adaptive'])} (in {len(self.adaptive)} parameters, {len(partial)} of them "
            f"partly GL) | frozen {_fmt_int(c['frozen'])} (in {len(self.frozen)} parameters)"
        )
        if partial:
            shown = ", ".join(partial[:6]) + (", ..." if len(partial) > 6 else "")
            lines.append(f"Partly GL parameters (rest adaptive): {shown}")
        if self.unsupported:
            lines.append(f"Unsupported attention-like modules (treated adaptively): {len(self.unsupported)}")
            for u in self.unsupported:
                lines.append(f"  {u.module} [{u.cls}]: {u.reason}")
        else:
            lines.append("Unsupported attention-like modules: none")
        for note in self.notes:
            lines.append(f"Note: {note}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        c = self.counts()
        return (f"Layout(model={self.model_name!r}, blocks={len(self.blocks)}, gl_scalars={c['gl']}, "
                f"adaptive={len(self.adaptive)}, frozen={len(self.frozen)}, unsupported={len(self.unsupported)})")

    # -- actions -----------------------------------------------------------------------------------

    def act(self, params: Mapping[str, Tensor], actions: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """Apply per-block per-head GL actions ``A`` (``(heads, h, h)``, keyed by block name):
        ``(G, H) -> (G A, H A^{-T})``.  Blocks without an entry are left alone.  Computed in the
        promoted dtype of the parameters and ``A`` (pass float64 ``A`` for an accurate action on float32
        weights); written back in the parameters' dtype.  Returns a new dict."""
        unknown = set(actions) - {b.name for b in self.blocks}
        if unknown:
            raise KeyError(f"actions for unknown blocks: {sorted(unknown)}")
        out = dict(params)
        for b in self.blocks:
            A = actions.get(b.name)
            if A is not None:
                out = _apply_action(b, out, A)
        return out

    def reparametrised(self, model: nn.Module, actions: Mapping[str, Tensor]) -> nn.Module:
        """A copy of ``model`` whose blocks are acted on by ``actions`` (as in :meth:`act`): the same
        function, another representative of its point on the quotient. ``model`` is left alone; the
        copy is a ``copy.deepcopy`` with new parameter values, so buffers, hooks and train/eval
        flags come along. With :meth:`random_actions` this is the invariance check's
        reparametrisation."""
        params = {name: p.detach() for name, p in model.named_parameters()}
        new = self.act(params, actions)
        clone = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in clone.named_parameters():
                p.copy_(new[name])
        return clone

    def random_actions(self, params: Optional[Mapping[str, Tensor]] = None, *, scale: float,
                       cond: Optional[float] = 1e2, generator: Optional[torch.Generator] = None,
                       dtype: torch.dtype = torch.float64) -> Dict[str, Tensor]:
        """Per block a ``(heads, h, h)`` element of the block's group, times ``scale``: for the full
        GL(h) ``U diag(s) Vᵀ`` with Haar-random orthogonal ``U, V`` and singular values ``s``
        log-spaced in ``[cond^{-1/2}, cond^{1/2}]`` (condition number exactly ``cond``), or ``N(0, 1)``
        entries when ``cond is None`` (the paper's §6.2 check); for the rotary group a random
        rotation-scaling per frequency pair (moduli spread over the same range) and such a matrix on
        the non-rotated block (see ``Group.random_element``).
        Sampled on the CPU with ``generator`` (reproducible), returned on the parameters' device."""
        out: Dict[str, Tensor] = {}
        for b in self.blocks:
            device = params[b.g_pieces[0].param].device if params is not None else torch.device("cpu")
            # a group without the positive scalars (orthogonal) is sampled at scale 1: its
            # elements times another scale are not in it
            s = scale if getattr(b.group, "has_scalars", True) else 1.0
            A = b.group.random_element(b.head_dim, (b.num_heads,), scale=s, cond=cond,
                                       generator=generator)
            out[b.name] = A.to(dtype=dtype, device=device)
        return out

    # -- symmetry self-check -----------------------------------------------------------------------

    def verify(self, model: nn.Module, example_inputs, *, scales: Sequence[float] = (1e-2, 1e-1, 1.0, 1e1, 1e2),
               cond: Optional[float] = 1e2, rtol: Optional[float] = None, atol: Optional[float] = None,
               seed: int = 0, per_block: Union[bool, str] = True, raise_on_failure: bool = True,
               output_fn: Optional[Callable[[Any], Tensor]] = None,
               compute_dtype: Optional[torch.dtype] = None) -> VerifyReport:
        """Check that every block is a symmetry of ``model``: the output must not change under random
        per-head GL actions (see :meth:`random_actions`; ``cond=None`` for Gaussian actions) at each of
        ``scales``.

        The model is never modified: the acted parameters go through ``torch.func.functional_call``;
        the model is put in eval mode for the check (every submodule's ``training`` flag is restored
        afterwards) and no gradients are recorded.  The actions are computed in float64 and written
        back in the compute dtype, which is the model's dtype, or float32 for float16/bfloat16 models
        (whose own rounding, ~1e-2, would hide a broken block); ``compute_dtype=`` overrides it (all
        floating parameters, buffers and inputs are then cast for the check).

        ``example_inputs``: a tensor, a tuple/list of positional arguments, or a dict of keyword
        arguments.  The compared tensor is ``output_fn(output)`` or :func:`primary_output` (``logits``,
        ``last_hidden_state`` or the first tensor).

        Deviation ``max|y' - y| / max|y|``; a check passes when ``max|y' - y| <= atol + rtol * max|y|``.
        Defaults: ``rtol = default_tolerance(compute_dtype, cond)`` (with ``cond=None`` the largest
        condition number of the sampled actions), ``atol = 0``.  All blocks are acted on together; with
        ``per_block=True`` (default) each block is also checked on its own, with ``per_block="auto"``
        only when the joint check fails; this is what names the culprit.  Raises
        :class:`SymmetryError` naming the failing block(s) unless ``raise_on_failure=False``.
        """
        from torch.func import functional_call

        from . import validation as check
        from .validation import positive_finite, positive_finite_sequence

        check.module("model", model)
        for name, tol in (("rtol", rtol), ("atol", atol)):
            if tol is not None:
                check.non_negative_finite(name, tol)
        check.integer_at_least("seed", seed, -2 ** 63)
        if not isinstance(per_block, (bool, str)) or per_block not in (True, False, "auto"):
            raise ValueError(f"per_block must be True, False or 'auto', got {per_block!r}")
        check.flag("raise_on_failure", raise_on_failure)
        check.optional_callable("output_fn", output_fn, "output_fn(model output) -> tensor")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise TypeError(f"compute_dtype must be a floating torch.dtype (e.g. torch.float64) or None "
                            f"for the model's, got {compute_dtype!r}")
        check.materialised(model, "verify()")
        self.check_model(model, what="verify()")
        fn = output_fn or primary_output
        args, kwargs = split_inputs(example_inputs, model)
        scales = positive_finite_sequence("scales", scales)
        if cond is not None and positive_finite("cond", cond) < 1:
            raise ValueError(f"cond must be a condition number >= 1 (or None for Gaussian actions), "
                             f"got {cond!r}")
        with eval_mode(model):
            with torch.no_grad():
                params = {n: p.detach() for n, p in model.named_parameters()}
                bad = [n for n, p in params.items() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
                if bad:
                    shown = ", ".join(bad[:5]) + (", ..." if len(bad) > 5 else "")
                    raise ValueError(f"verify(): the model's weights are not finite (nan or inf in {shown}); "
                                     "the symmetry cannot be checked at such weights: load or train finite weights")
                fdt = [p.dtype for p in params.values() if p.is_floating_point()]
                model_dtype = fdt[0] if fdt else torch.get_default_dtype()
                cdt = compute_dtype or (torch.float32 if model_dtype in (torch.float16, torch.bfloat16) else model_dtype)
                extra: Dict[str, Tensor] = {}
                if any(p.is_floating_point() and p.dtype != cdt for p in params.values()):
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

                    args, kwargs = cast(args), cast(kwargs)

                def run(p):
                    return fn(functional_call(model, {**p, **extra}, args, kwargs)).detach()

                y0 = run(params)
                if not bool(torch.isfinite(y0).all()):
                    raise ValueError("verify(): the model's output at its own weights is not finite (nan or inf); "
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
                    actions = self.random_actions(params, scale=s, cond=cond, generator=gen)
                    actions_by_scale[s] = actions
                    eff = cond if cond is not None else _max_cond(actions)
                    tols[s] = default_tolerance(cdt, eff) if rtol is None else float(rtol)
                    joint[s] = dev(self.act(params, actions)) if self.blocks else 0.0

                def ok(d: float, s: float) -> bool:
                    return d * denom <= tol_a + tols[s] * ymax

                joint_passed = all(ok(d, s) for s, d in joint.items())
                check_blocks = per_block is True or (per_block == "auto" and not joint_passed)
                checks: List[BlockCheck] = []
                if check_blocks:
                    for b in self.blocks:
                        per = {s: dev(self.act(params, {b.name: actions_by_scale[s][b.name]})) for s in scales}
                        mx = max(per.values()) if per else 0.0
                        checks.append(BlockCheck(b.name, b.kind, b.module, per, mx,
                                                 all(ok(d, s) for s, d in per.items())))
        tol_r = max(tols.values()) if tols else (float(rtol) if rtol is not None else default_tolerance(cdt, cond))
        report = VerifyReport(joint=joint, joint_passed=joint_passed, blocks=checks, rtol=tol_r, atol=tol_a,
                              dtype=cdt, cond=cond, scales=scales, output_scale=ymax,
                              per_block_checked=check_blocks)
        self.verify_failed = [] if report.passed else (report.failing or [b.name for b in self.blocks])
        from .accept import record_verification  # accept imports this module
        record_verification(model, self, report.passed)
        if raise_on_failure and not report.passed:
            failing = report.failing
            if failing:
                worst = {b.name: b.max_rel_dev for b in report.blocks if not b.passed}
                what = "; ".join(f"{n} (max rel dev {d:.2e})" for n, d in worst.items())
                msg = f"GL symmetry broken by block(s): {what}"
            elif not report.per_block_checked:
                msg = "GL symmetry broken when all blocks act together (blocks not checked one by one)"
            else:
                msg = ("GL symmetry broken when all blocks act together, although no single block fails "
                       "on its own (blocks interact: overlapping or coupled parameters?)")
            raise SymmetryError(f"{msg}; tolerance rel {tol_r:.1e}.\n{report}", report)
        return report


# --------------------------------------------------------------------------------------------------
# user-declared blocks
# --------------------------------------------------------------------------------------------------


def _canonical_names(model: nn.Module) -> Tuple[Dict[int, str], Dict[str, str]]:
    """``id(param) -> canonical name`` and ``any name (incl. tied aliases) -> canonical name``."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    # remove_duplicate=False can yield tensors that named_parameters() lists under no name of its own
    alias = {n: by_id.get(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    return by_id, alias


def _get(model: nn.Module, path: str):
    """Submodule or parameter at ``path`` ("" is the model itself)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        pass
    try:
        return model.get_parameter(path)
    except AttributeError:
        raise ValueError(f"{path!r} is neither a submodule nor a parameter of {type(model).__name__}") from None


def _common_prefix(paths: Iterable[str]) -> str:
    split = [p.split(".") for p in paths]
    if not split:
        return ""
    out = []
    for parts in zip(*split):
        if all(x == parts[0] for x in parts):
            out.append(parts[0])
        else:
            break
    return ".".join(out)


def _proj_pieces(model: nn.Module, path: str, role: str, num_heads: int, head_dim: int, offset: int,
                 bias: bool, group_size: int = 1) -> Tuple[List[FactorPiece], str]:
    """Pieces for a projection given by a module path (``nn.Linear`` or HF ``Conv1D``) or a weight
    parameter path.  ``role`` is ``"in"`` (q/k/v: heads along the output features) or ``"out"``
    (output projection: heads along the input features); ``group_size`` heads share one gauge.
    Returns pieces and the module path."""
    piece = functools.partial(FactorPiece, offset=offset, num_heads=num_heads, head_dim=head_dim,
                              group_size=group_size)
    by_id, _ = _canonical_names(model)
    obj = _get(model, path)
    if isinstance(obj, nn.Parameter) or isinstance(obj, Tensor):
        if id(obj) not in by_id:
            raise ValueError(f"{path!r} is not a parameter of the model")
        if obj.dim() != 2:
            raise ValueError(f"{path!r} must be a 2-D (out, in) weight, has shape {tuple(obj.shape)}")
        kind = "rows" if role == "in" else "cols"
        return [piece(by_id[id(obj)], kind)], path.rsplit(".", 1)[0] if "." in path else ""
    if not isinstance(obj, nn.Module):
        raise ValueError(f"{path!r} is neither a module nor a parameter")
    W = getattr(obj, "weight", None)
    if not isinstance(W, Tensor) or W.dim() != 2 or id(W) not in by_id:
        raise ValueError(f"{path!r} ({type(obj).__name__}) has no 2-D weight parameter")
    transposed = type(obj).__name__ == "Conv1D" and not isinstance(obj, nn.Linear)  # HF Conv1D: (in, out)
    if role == "in":
        kind = "cols" if transposed else "rows"
    else:
        kind = "rows" if transposed else "cols"
    pieces = [piece(by_id[id(W)], kind)]
    b = getattr(obj, "bias", None)
    if role == "in" and bias and isinstance(b, Tensor) and id(b) in by_id:
        pieces.append(piece(by_id[id(b)], "bias"))
    return pieces, path


def _out_features(model: nn.Module, path: str, role: str) -> int:
    obj = _get(model, path)
    W = obj if isinstance(obj, Tensor) else obj.weight
    transposed = isinstance(obj, nn.Module) and type(obj).__name__ == "Conv1D" and not isinstance(obj, nn.Linear)
    if role == "in":
        return int(W.shape[1] if transposed else W.shape[0])
    return int(W.shape[0] if transposed else W.shape[1])


def _refuse_full_gl_on_rotary(model: nn.Module, module_path: str, num_heads: int, params: Sequence[str]) -> None:
    """A Q/K block declared with the full GL(h) on a module whose forward applies position
    encodings between the projections (RoPE, relative positions) is not a symmetry: say so now
    rather than let ``verify`` reject it later.  Position terms that keep GL (a bias added to the
    scores; positional projections that pair with q or k, when the block holds them: ``params``,
    the block's parameter names) are not refused."""
    from .families._structure import _screen, position_terms  # families import this module

    try:
        mod = model.get_submodule(module_path)
    except AttributeError:
        return
    terms = position_terms(module_path, mod, num_heads, None)
    prefix = module_path + "." if module_path else ""
    outside = [lin.path[len(prefix):] for lin in terms.q_pairs + terms.k_pairs
               if not {n for n, p in model.named_parameters() if id(p) in lin.param_ids()} <= set(params)]
    if outside:
        raise ValueError(
            f"declare_block: the Q/K block of {module_path or '<root>'} ({type(mod).__name__}) leaves out the "
            f"positional projection(s) {', '.join(outside)}, whose scores pair them with q or k ({terms.source}): "
            "without them Q/K has no GL symmetry.  Use the detected layout (adapters.layout(model)), or declare the "
            "block with g=/h= FactorPieces that stack the query-side positional projection under q and the "
            "key-side one under k, then check it with layout.verify(model, inputs).")
    reasons = _screen(mod, {id(p) for p in mod.parameters()}, source_scan=True, modelled=terms.modelled).qk
    if reasons:
        raise ValueError(
            f"declare_block: the Q/K block of {module_path or '<root>'} ({type(mod).__name__}) would use the "
            f"full GL(head_dim), but {'; '.join(reasons)}. Rotary attention keeps only the rotations' "
            "commutant: pass group='rope' (Hugging Face rotate_half pairing, all coordinates rotated) or "
            "group=RotaryGroup(pairing='half'|'interleaved', rotary_dim=r) for partial rotary, then check "
            "it with layout.verify(model, inputs); a position term that mixes q or k alone leaves Q/K no GL "
            "symmetry (leave Q/K adaptive and declare only the V/O block).")


def declare_block(model: nn.Module, *, q: Optional[str] = None, k: Optional[str] = None,
                  v: Optional[str] = None, o: Optional[str] = None, num_heads: Optional[int] = None,
                  head_dim: Optional[int] = None, bias: bool = True, offsets: Optional[Mapping[str, int]] = None,
                  g: Optional[Sequence[FactorPiece]] = None, h: Optional[Sequence[FactorPiece]] = None,
                  kind: Optional[str] = None, name: Optional[str] = None, module: Optional[str] = None,
                  num_kv_heads: Optional[int] = None, group: Union[None, str, Group] = None) -> GLBlock:
    """Declare a GL block by hand.

    * ``declare_block(model, q="path.q_linear", k="path.k_linear", num_heads=4)`` -> QK block
      ``G = [W_qᵀ; b_q]``, ``H = [W_kᵀ; b_k]`` per head (biases appended when present and ``bias=True``);
    * ``declare_block(model, v=..., o=..., num_heads=4)`` -> VO block ``G = [W_vᵀ; b_v]``,
      ``H = W_o[:, r_i]`` (the output bias is never in the block);
    * paths name an ``nn.Linear`` (weight ``(out, in)``), an HF ``Conv1D`` (weight ``(in, out)``) or a 2-D
      weight parameter (``(out, in)``, no bias); ``offsets={"k": 64}`` selects rows (q/k/v) or columns
      (o) of a packed projection, e.g. ``q="attn.qkv", k="attn.qkv", offsets={"k": d}``;
    * ``declare_block(model, g=[FactorPiece(...), ...], h=[...], kind="qk", name=...)`` from raw pieces;
    * grouped-query attention: ``num_kv_heads=`` the number of key/value heads; query head ``i`` uses
      key/value head ``i // (num_heads // num_kv_heads)`` (Hugging Face ``repeat_kv``), so each
      key/value head carries one gauge shared by its query heads (QK: ``G`` stacks the group's query
      slices; VO: ``H`` stacks the group's output slices);
    * ``group=``: the symmetry group of the block (default the full GL(head_dim)); Q/K blocks of
      rotary attention need ``group="rope"`` or ``RotaryGroup(pairing, rotary_dim)``: RoPE leaves
      only the rotations' commutant, and ``Layout.verify`` rejects a full-GL rotary Q/K block.

    ``head_dim`` defaults to (output features of q or v) // ``num_heads`` (input features of ``o`` for
    VO); give it explicitly for packed projections.  ``name`` defaults to ``"<module>/<kind>"`` with
    ``module`` the deepest module containing all given paths.
    """
    by_id, alias = _canonical_names(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    offsets = dict(offsets or {})
    bad = set(offsets) - {"q", "k", "v", "o"}
    if bad:
        raise ValueError(f"offsets keys must be among q, k, v, o; got {sorted(bad)}")
    if g is not None or h is not None:
        if g is None or h is None or any(x is not None for x in (q, k, v, o)):
            raise ValueError("give either both g= and h= (raw FactorPieces) or q/k or v/o paths")
        g = tuple(replace(p, param=alias.get(p.param, p.param)) for p in g)
        h = tuple(replace(p, param=alias.get(p.param, p.param)) for p in h)
        nh, hd = g[0].block_heads, g[0].head_dim
        kind = kind or "declared"
        mod = module if module is not None else _common_prefix([p.param.rsplit(".", 1)[0] for p in g + h])
        pieces_g, pieces_h = list(g), list(h)
    else:
        if num_heads is None:
            raise ValueError("num_heads is required")
        from .validation import integer_at_least
        integer_at_least("num_heads", num_heads, 1)
        for arg, value in (("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
            if value is not None:
                integer_at_least(arg, value, 1)
        if q is not None and k is not None and v is None and o is None:
            kind = kind or "qk"
            (ga, gr, go), (ha, hr, ho) = (q, "in", offsets.get("q", 0)), (k, "in", offsets.get("k", 0))
        elif v is not None and o is not None and q is None and k is None:
            kind = kind or "vo"
            (ga, gr, go), (ha, hr, ho) = (v, "in", offsets.get("v", 0)), (o, "out", offsets.get("o", 0))
        else:
            raise ValueError("declare either q= and k= (QK block) or v= and o= (VO block)")
        # the block's name as it will be, for messages before the block exists
        label = f"block {name or (module if module is not None else _common_prefix([ga, ha])) + '/' + kind!r}"
        if head_dim is None:
            if ga == ha:
                raise ValueError(f"declare_block: {label}: head_dim is required when G and H come from the "
                                 f"same (packed) projection {ga!r}")
            heads_path, role, offset = (ga, gr, go) if kind == "qk" else (ha, hr, ho)
            width = _out_features(model, heads_path, role) - offset
            if width < 1 or width % num_heads:
                raise ValueError(
                    f"declare_block: {label}: cannot infer head_dim: {heads_path!r} gives {width} features "
                    f"(from offset {offset}), not a multiple of num_heads={num_heads}; pass head_dim= "
                    f"(and offsets= for a packed projection) so that num_heads * head_dim features are used")
            head_dim = width // num_heads
        nq, hd = int(num_heads), int(head_dim)
        nkv = nq if num_kv_heads is None else int(num_kv_heads)
        if nkv < 1 or nq % nkv:
            raise ValueError(f"declare_block: {label}: num_kv_heads={num_kv_heads} must divide "
                             f"num_heads={num_heads}")
        kv_path, kv_role, kv_offset = (ha, hr, ho) if kind == "qk" else (ga, gr, go)
        kv_width = _out_features(model, kv_path, kv_role) - kv_offset
        if num_kv_heads is None and kv_width < nq * hd:
            advice = (f"for grouped-query / multi-query attention pass num_kv_heads={kv_width // hd}"
                      if kv_width >= hd else f"a head of {hd} does not fit: check num_heads / head_dim")
            raise ValueError(
                f"declare_block: {label}: {kv_path!r} gives {kv_width} features but {nq} heads x {hd} "
                f"need {nq * hd}: {advice}")
        rep = nq // nkv
        # the query (QK, G) or output (VO, H) projection has num_heads heads, `rep` per gauge
        g_heads, h_heads = (nq, nkv) if kind == "qk" else (nkv, nq)
        pieces_g, mg = _proj_pieces(model, ga, gr, g_heads, hd, go, bias, rep if kind == "qk" else 1)
        pieces_h, mh = _proj_pieces(model, ha, hr, h_heads, hd, ho, bias, 1 if kind == "qk" else rep)
        nh = nkv
        mod = module if module is not None else _common_prefix([mg, mh])
    if kind == "qk" and group is None:
        _refuse_full_gl_on_rotary(model, mod, pieces_g[0].num_heads, [p.param for p in (*pieces_g, *pieces_h)])
    n = sum(p.rows_per_head(shapes[p.param]) for p in pieces_g if p.param in shapes)
    m = sum(p.rows_per_head(shapes[p.param]) for p in pieces_h if p.param in shapes)
    block = GLBlock(name=name or f"{mod}/{kind}", kind=kind, module=mod, g_pieces=tuple(pieces_g),
                    h_pieces=tuple(pieces_h), num_heads=nh, head_dim=hd, n=n, m=m, family="declared",
                    group=as_group(group))
    block.validate(shapes)
    return block
