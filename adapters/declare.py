"""Blocks declared by hand (:func:`declare_block`): a Q/K or V/O block from projection paths, or from
raw :class:`~quotient_manifolds.adapters.blocks.FactorPiece` objects, for attention that detection does not know."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from torch import Tensor, nn

from quotient_manifolds._validation import integer_at_least
from quotient_manifolds.core.groups import Group, as_group
from quotient_manifolds.errors import InvalidArgument

from .blocks import FactorPiece, GLBlock, canonical_names
from .families.positions import position_terms
from .families.structure import screen_module

__all__ = ["declare_block"]


def _get(model: nn.Module, path: str):
    """Submodule or parameter at ``path`` ("" is the model itself)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        pass
    try:
        return model.get_parameter(path)
    except AttributeError:
        raise InvalidArgument(f"{path!r} is neither a submodule nor a parameter of {type(model).__name__}") from None


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
    by_id, _ = canonical_names(model)
    obj = _get(model, path)
    if isinstance(obj, nn.Parameter) or isinstance(obj, Tensor):
        if id(obj) not in by_id:
            raise InvalidArgument(f"{path!r} is not a parameter of the model")
        if obj.dim() != 2:
            raise InvalidArgument(f"{path!r} must be a 2-D (out, in) weight, has shape {tuple(obj.shape)}")
        kind = "rows" if role == "in" else "cols"
        return [piece(by_id[id(obj)], kind)], path.rsplit(".", 1)[0] if "." in path else ""
    if not isinstance(obj, nn.Module):
        raise InvalidArgument(f"{path!r} is neither a module nor a parameter")
    W = getattr(obj, "weight", None)
    if not isinstance(W, Tensor) or W.dim() != 2 or id(W) not in by_id:
        raise InvalidArgument(f"{path!r} ({type(obj).__name__}) has no 2-D weight parameter")
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
    try:
        mod = model.get_submodule(module_path)
    except AttributeError:
        return
    terms = position_terms(module_path, mod, num_heads, None)
    prefix = module_path + "." if module_path else ""
    outside = [lin.path[len(prefix):] for lin in terms.q_pairs + terms.k_pairs
               if not {n for n, p in model.named_parameters() if id(p) in lin.param_ids()} <= set(params)]
    if outside:
        raise InvalidArgument(
            f"declare_block: the Q/K block of {module_path or '<root>'} ({type(mod).__name__}) leaves out the "
            f"positional projection(s) {', '.join(outside)}, whose scores pair them with q or k ({terms.source}): "
            "without them Q/K has no GL symmetry.  Use the detected layout (adapters.layout(model)), or declare the "
            "block with g=/h= FactorPieces that stack the query-side positional projection under q and the "
            "key-side one under k, then check it with layout.verify(model, inputs).")
    reasons = screen_module(mod, {id(p) for p in mod.parameters()}, source_scan=True, modelled=terms.modelled).qk
    if reasons:
        raise InvalidArgument(
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

    Parameters
    ----------
    model:
        The model whose parameters the paths name.
    q, k, v, o:
        Paths of the projections (q and k for a QK block, v and o for a VO block).
    num_heads, head_dim, num_kv_heads:
        The head structure (see above).
    bias:
        Append the q/k/v biases to G and H where the projections have them.
    offsets:
        Row (q/k/v) or column (o) offsets into packed projections, keyed by ``"q"``, ``"k"``,
        ``"v"``, ``"o"``.
    g, h, kind:
        Raw :class:`~quotient_manifolds.adapters.blocks.FactorPiece` lists and the block's kind,
        instead of paths.
    name, module:
        The block's name and the module it belongs to.
    group:
        The block's symmetry group (None: all of GL(head_dim)).

    Returns
    -------
    GLBlock
        The block; pass it to :func:`layout` as ``blocks=``.

    Raises
    ------
    ValueError
        A path names no module or parameter, a weight is not 2-D, the head structure does not
        divide the projection, unknown ``offsets`` keys, or neither (q, k), (v, o) nor (g, h) is
        given.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> model = torch.nn.ModuleDict({"q": torch.nn.Linear(4, 4), "k": torch.nn.Linear(4, 4)})
    >>> block = adapters.declare_block(model, q="q", k="k", num_heads=2, name="attn/qk")
    >>> block.kind, block.num_heads, block.head_dim, block.n, block.m   # G, H of (4 + 1) × 2
    ('qk', 2, 2, 5, 5)
    """
    _, alias = canonical_names(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    offsets = dict(offsets or {})
    bad = set(offsets) - {"q", "k", "v", "o"}
    if bad:
        raise InvalidArgument(f"offsets keys must be among q, k, v, o; got {sorted(bad)}")
    if g is not None or h is not None:
        if g is None or h is None or any(x is not None for x in (q, k, v, o)):
            raise InvalidArgument("give either both g= and h= (raw FactorPieces) or q/k or v/o paths")
        g = tuple(replace(p, param=alias.get(p.param, p.param)) for p in g)
        h = tuple(replace(p, param=alias.get(p.param, p.param)) for p in h)
        nh, hd = g[0].block_heads, g[0].head_dim
        kind = kind or "declared"
        mod = module if module is not None else _common_prefix([p.param.rsplit(".", 1)[0] for p in g + h])
        pieces_g, pieces_h = list(g), list(h)
    else:
        kind, pieces_g, pieces_h, nh, hd, paths = _from_paths(model, dict(q=q, k=k, v=v, o=o), offsets, kind,
                                                              num_heads, head_dim, num_kv_heads, bias, name, module)
        mod = module if module is not None else _common_prefix(paths)
    if kind == "qk" and group is None:
        _refuse_full_gl_on_rotary(model, mod, pieces_g[0].num_heads, [p.param for p in (*pieces_g, *pieces_h)])
    n = sum(p.rows_per_head(shapes[p.param]) for p in pieces_g if p.param in shapes)
    m = sum(p.rows_per_head(shapes[p.param]) for p in pieces_h if p.param in shapes)
    block = GLBlock(name=name or f"{mod}/{kind}", kind=kind, module=mod, g_pieces=tuple(pieces_g),
                    h_pieces=tuple(pieces_h), num_heads=nh, head_dim=hd, n=n, m=m, family="declared",
                    group=as_group(group))
    block.validate(shapes)
    return block


@dataclass(frozen=True)
class _Side:
    """One factor of a declared block: the projection at ``path``, its ``role`` (``"in"``: q/k/v,
    heads along the output features; ``"out"``: the output projection) and the ``offset`` of its heads."""

    path: str
    role: str
    offset: int


@dataclass(frozen=True)
class _Sides:
    """The block kind (``"qk"`` / ``"vo"``, or the caller's ``kind=``) and its ``G`` and ``H`` sides."""

    kind: str
    g: _Side
    h: _Side

    @classmethod
    def of(cls, q: Optional[str], k: Optional[str], v: Optional[str], o: Optional[str],
           offsets: Mapping[str, int], kind: Optional[str]) -> "_Sides":
        if q is not None and k is not None and v is None and o is None:
            return cls(kind or "qk", _Side(q, "in", offsets.get("q", 0)), _Side(k, "in", offsets.get("k", 0)))
        if v is not None and o is not None and q is None and k is None:
            return cls(kind or "vo", _Side(v, "in", offsets.get("v", 0)), _Side(o, "out", offsets.get("o", 0)))
        raise InvalidArgument("declare either q= and k= (QK block) or v= and o= (VO block)")

    @property
    def heads(self) -> _Side:
        """The side whose features give ``head_dim``: the queries (QK) or the values (VO)."""
        return self.g if self.kind == "qk" else self.h

    @property
    def kv(self) -> _Side:
        """The side with one head per key/value head: the keys (QK) or the values (VO)."""
        return self.h if self.kind == "qk" else self.g


def _from_paths(model: nn.Module, paths: Mapping[str, Optional[str]], offsets: Mapping[str, int],
                kind: Optional[str], num_heads: Optional[int], head_dim: Optional[int], num_kv_heads: Optional[int],
                bias: bool, name: Optional[str], module: Optional[str]
                ) -> Tuple[str, List[FactorPiece], List[FactorPiece], int, int, Tuple[str, str]]:
    """``(kind, G pieces, H pieces, gauges per block, head_dim, (G module, H module))`` of a block
    declared by projection ``paths`` (``q``, ``k``, ``v``, ``o`` of :func:`declare_block`), head
    counts checked against the projections' features."""
    if num_heads is None:
        raise InvalidArgument("num_heads is required")
    integer_at_least("num_heads", num_heads, 1)
    for arg, value in (("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
        if value is not None:
            integer_at_least(arg, value, 1)
    sides = _Sides.of(**paths, offsets=offsets, kind=kind)
    kind, g, h = sides.kind, sides.g, sides.h
    # the block's name as it will be, for messages before the block exists
    label = f"block {name or (module if module is not None else _common_prefix([g.path, h.path])) + '/' + kind!r}"
    if head_dim is None:
        if g.path == h.path:
            raise InvalidArgument(f"declare_block: {label}: head_dim is required when G and H come from the "
                                  f"same (packed) projection {g.path!r}")
        heads = sides.heads
        width = _out_features(model, heads.path, heads.role) - heads.offset
        if width < 1 or width % num_heads:
            raise InvalidArgument(
                f"declare_block: {label}: cannot infer head_dim: {heads.path!r} gives {width} features "
                f"(from offset {heads.offset}), not a multiple of num_heads={num_heads}; pass head_dim= "
                f"(and offsets= for a packed projection) so that num_heads * head_dim features are used")
        head_dim = width // num_heads
    nq, hd = int(num_heads), int(head_dim)
    nkv = nq if num_kv_heads is None else int(num_kv_heads)
    if nkv < 1 or nq % nkv:
        raise InvalidArgument(f"declare_block: {label}: num_kv_heads={num_kv_heads} must divide "
                              f"num_heads={num_heads}")
    kv = sides.kv
    kv_width = _out_features(model, kv.path, kv.role) - kv.offset
    if num_kv_heads is None and kv_width < nq * hd:
        advice = (f"for grouped-query / multi-query attention pass num_kv_heads={kv_width // hd}"
                  if kv_width >= hd else f"a head of {hd} does not fit: check num_heads / head_dim")
        raise InvalidArgument(
            f"declare_block: {label}: {kv.path!r} gives {kv_width} features but {nq} heads x {hd} "
            f"need {nq * hd}: {advice}")
    rep = nq // nkv
    # the query (QK, G) or output (VO, H) projection has num_heads heads, `rep` per gauge
    g_heads, h_heads = (nq, nkv) if kind == "qk" else (nkv, nq)
    pieces_g, mg = _proj_pieces(model, g.path, g.role, g_heads, hd, g.offset, bias, rep if kind == "qk" else 1)
    pieces_h, mh = _proj_pieces(model, h.path, h.role, h_heads, hd, h.offset, bias, 1 if kind == "qk" else rep)
    return kind, pieces_g, pieces_h, nkv, hd, (mg, mh)
