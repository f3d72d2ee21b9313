"""GL blocks: which slices of which parameters form the factors ``G`` and ``H`` of one attention block.

A :class:`GLBlock` is a list of :class:`FactorPiece` objects (one piece = one parameter slice, for all
heads at once) for ``G`` and for ``H``; blocks are read with :meth:`GLBlock.gather` and written back,
out of place and differentiably, with :meth:`GLBlock.scatter` (docs/maths.md §6.2).  Blocks name
parameters by their canonical name (:func:`canonical_names`: tied parameters get one name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from quotient_manifolds.core.groups import FULL_GL, Group, as_group
from quotient_manifolds.errors import InvalidArgument

__all__ = ["FactorPiece", "GLBlock", "PIECE_KINDS", "canonical_names"]

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

    ``parts`` > 1 makes each head's ``head_dim`` coordinates ``parts`` runs of ``head_dim // parts``
    consecutive features, run t starting ``t * part_stride`` after the head's start (differential
    attention: one gauge acts on two value heads that lie ``part_stride`` features apart).
    """

    param: str
    kind: str
    offset: int
    num_heads: int
    head_dim: int
    group_size: int = 1
    stride: Optional[int] = None
    parts: int = 1
    part_stride: Optional[int] = None

    def __post_init__(self):
        if self.kind not in PIECE_KINDS:
            raise InvalidArgument(f"FactorPiece.kind must be one of {PIECE_KINDS}, got {self.kind!r}")
        if self.offset < 0 or self.num_heads < 1 or self.head_dim < 1:
            raise InvalidArgument(f"invalid FactorPiece {self}: need offset >= 0, num_heads >= 1, head_dim >= 1")
        if self.group_size < 1 or self.num_heads % self.group_size:
            raise InvalidArgument(f"invalid FactorPiece {self}: group_size must divide num_heads "
                                  f"({self.num_heads} heads in groups of {self.group_size})")
        if self.parts > 1 and (self.head_dim % self.parts or self.part_stride is None
                               or self.part_stride < self.head_dim // self.parts):
            raise InvalidArgument(f"invalid FactorPiece {self}: parts must divide head_dim, with part_stride >= "
                                  "head_dim // parts so the runs of a head do not overlap")
        if self.parts > 1 and self._index(None).unique().numel() != self.num_heads * self.head_dim:
            raise InvalidArgument(f"invalid FactorPiece {self}: the runs of its heads overlap (stride "
                                  f"{self.head_stride}, part_stride {self.part_stride})")
        if self.parts == 1 and self.stride is not None and self.stride < self.head_dim:
            raise InvalidArgument(f"invalid FactorPiece {self}: stride {self.stride} < head_dim "
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
        run = self.head_dim // self.parts
        return (self.num_heads - 1) * self.head_stride + (self.parts - 1) * (self.part_stride or 0) + run

    @property
    def _contiguous(self) -> bool:
        """Whether the heads lie side by side from ``offset`` (one slice, no index)."""
        return self.parts == 1 and self.stride in (None, self.head_dim)

    def _index(self, device) -> Tensor:
        """Positions along the sliced dimension, head-major: ``(num_heads * head_dim,)``."""
        heads = torch.arange(self.num_heads, device=device) * self.head_stride
        run = self.head_dim // self.parts
        within = (torch.arange(self.parts, device=device)[:, None] * (self.part_stride or 0)
                  + torch.arange(run, device=device)).reshape(-1)
        return (self.offset + heads[:, None] + within).reshape(-1)

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
                raise InvalidArgument(f"{self}: kind {self.kind!r} needs a 2-D parameter, {self.param!r} has shape {shape}")
            dim = shape[0] if self.kind == "rows" else shape[1]
        else:
            dim = math.prod(shape)
        if self.offset + self.width > dim:
            raise InvalidArgument(
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
        if self._contiguous:
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
            raise InvalidArgument(f"{self}: value has shape {tuple(value.shape)}, expected {(self.block_heads, k, h)}")
        value = value.to(dtype=W.dtype, device=W.device).reshape(nh, k // self.group_size, h)
        # the heads in the weight's layout (views): rows (nh, h, in), cols (out, nh, h), flat (nh, 1, h)
        heads = (value.transpose(1, 2) if self.kind == "rows"
                 else value.permute(1, 0, 2) if self.kind == "cols" else value)
        dim = 1 if self.kind == "cols" else 0
        size = W.shape[dim] if self.kind in ("rows", "cols") else W.numel()
        if self.offset == 0 and self.width == size and self._contiguous:
            # the piece is the whole weight: one copy of the heads, never a view of ``value``
            return heads.clone(memory_format=torch.contiguous_format).reshape(W.shape)
        if self.kind == "rows":
            return self._put(W, 0, heads.reshape(nh * h, W.shape[1]))
        if self.kind == "cols":
            return self._put(W, 1, heads.reshape(W.shape[0], nh * h))
        return self._put(W.reshape(-1), 0, heads.reshape(nh * h)).reshape(W.shape)

    def _put(self, W: Tensor, dim: int, new: Tensor) -> Tensor:
        if self._contiguous:
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
        if self.parts > 1:
            grouped += f" ({self.parts} runs of {self.head_dim // self.parts}, {self.part_stride} apart)"
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
            raise InvalidArgument(f"block {self.name!r}: needs at least one G piece and one H piece")
        for p in self.pieces:
            if p.block_heads != self.num_heads or p.head_dim != self.head_dim:
                raise InvalidArgument(
                    f"block {self.name!r}: piece {p} gives {p.block_heads} block heads x {p.head_dim} "
                    f"({p.num_heads} heads in groups of {p.group_size}), block has "
                    f"{self.num_heads} x {self.head_dim}; with grouped-query attention give the "
                    f"query (QK) or output (VO) piece group_size = query heads per key/value head"
                )
        if self.head_dim > min(self.n, self.m):
            raise InvalidArgument(
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
            raise InvalidArgument(f"block {self.name!r}: x has shape {tuple(x.shape)}, expected {expected}")
        out = dict(params)
        for p, rows in zip(self.pieces, self.split_rows(x, out)):
            out[p.param] = p.write(out[p.param], rows)
        return out

    def split_rows(self, x: Tensor, params: Mapping[str, Any]) -> Tuple[Tensor, ...]:
        """The rows of ``x = [G; H]`` that each piece holds, in piece order (``params``: anything
        with the parameters' shapes). One split, whose backward is one concatenation, where a
        slice per piece would cost a zero-filled gradient of ``x``'s size each."""
        return torch.split(x, [p.rows_per_head(params[p.param].shape) for p in self.pieces], dim=-2)

    def validate(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Check parameter names, slice ranges and ``n``/``m`` against parameter shapes."""
        for p in self.pieces:
            if p.param not in shapes:
                raise InvalidArgument(f"block {self.name!r}: unknown parameter {p.param!r}")
            try:
                p.check_shape(shapes[p.param])
            except ValueError as err:
                raise InvalidArgument(f"block {self.name!r}: {err}") from None
        n = sum(p.rows_per_head(shapes[p.param]) for p in self.g_pieces)
        m = sum(p.rows_per_head(shapes[p.param]) for p in self.h_pieces)
        if (n, m) != (self.n, self.m):
            raise InvalidArgument(f"block {self.name!r}: declared n={self.n}, m={self.m} but the pieces give n={n}, m={m}")

    def describe(self, width: int = 96) -> str:
        """The block in a few lines of at most ``width`` characters (a longer slice name stays
        whole): its kind, heads and group (and where the group came from), then the slices that
        make ``G`` and those that make ``H``, one factor a line."""
        source = f"  [group: {self.group_source}]" if self.group_source else ""
        lines = [f"{self.kind}: {self.num_heads} heads x {self.group.describe(self.head_dim)}{source}"]
        for factor, rows, pieces in (("G", self.n, self.g_pieces), ("H", self.m, self.h_pieces)):
            line = f"    {factor} ({rows}, {self.head_dim}) ="
            for k, piece in enumerate(pieces):
                term = ("" if k == 0 else "+ ") + piece.describe(self.module)
                if k > 0 and len(line) + 1 + len(term) > width:
                    lines.append(line)
                    line = " " * (len(f"    {factor} ({rows}, {self.head_dim}) =") - 2)  # + under =
                line += " " + term
            lines.append(line)
        return "\n".join(lines)



def canonical_names(model: nn.Module) -> Tuple[Dict[int, str], Dict[str, str]]:
    """``id(param) -> canonical name`` and ``any name (incl. tied aliases) -> canonical name``: the
    names blocks use (``model.named_parameters()`` lists a tied parameter once, under its canonical name)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    # remove_duplicate=False can yield tensors that named_parameters() lists under no name of its own
    alias = {n: by_id.get(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    return by_id, alias

