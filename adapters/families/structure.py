"""Structural helpers shared by the families, and the toolkit for writing your own
(:class:`~quotient_manifolds.adapters.families.Family`, see the ``adapters.families`` package docstring).

* projections: :func:`projection` reads an ``nn.Linear`` / HF ``Conv1D`` child (seeing through peft
  LoRA wrappers) as a :class:`Projection`; :class:`Heads` selects its heads inside a packed one;
  :func:`linear_children`, :func:`children_by_role` (names of :data:`ROLE_NAMES`), :func:`join_path`;
* head counts: :func:`num_heads_of`, :func:`int_attr`;
* blocks: :func:`attention_blocks` assembles the Q/K and V/O blocks of an attention module (the one
  place that does, grouped-query attention included); :func:`in_projection_pieces`,
  :func:`out_projection_pieces`, :func:`make_block` and :func:`add_block` build other blocks
  (LoRA pairs);
* the screen for position encodings and extra parameters (:func:`screen_module`,
  :func:`stream_norms`, :func:`forward_args`; the position terms that keep GL are read by
  :func:`~quotient_manifolds.adapters.families.positions.position_terms`)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from quotient_manifolds.core.groups import FULL_GL, Group
from quotient_manifolds.errors import InvalidArgument

from ..blocks import FactorPiece, GLBlock
from ._base import Context, Match

ROLE_NAMES: Dict[str, Tuple[str, ...]] = {
    "q": ("q_proj", "query", "q", "q_lin", "to_q", "wq", "W_q", "query_proj", "q_linear", "linear_q"),
    "k": ("k_proj", "key", "k", "k_lin", "to_k", "wk", "W_k", "key_proj", "k_linear", "linear_k"),
    "v": ("v_proj", "value", "v", "v_lin", "to_v", "wv", "W_v", "value_proj", "v_linear", "linear_v"),
    "o": ("o_proj", "out_proj", "o", "out", "out_lin", "proj", "dense", "wo", "W_o", "c_proj", "output_proj",
          "o_linear", "out_linear", "proj_out", "linear_out", "linear_o"),
}
PACKED_NAMES = ("qkv", "c_attn", "in_proj", "Wqkv", "query_key_value", "qkv_proj", "to_qkv", "W_pack",
                "qkv_linear", "qkv_lin", "c_qkv", "qkv_net", "kv", "kv_proj")
HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads", "nhead", "num_head")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "d_head", "head_size", "dim_head", "d_k")
POSITION_ARGS = ("position_embeddings", "position_ids", "rotary_pos_emb", "freqs_cis", "position_bias",
                 "rel_pos", "rel_pos_bias", "alibi", "cos", "sin", "rope", "rotary_emb", "relative_position",
                 "relative_position_bias", "pos_emb", "pos_bias", "rotary_pos_embedding", "sinusoidal_pos")
POSITION_ATTRS = ("rotary_emb", "rotary", "rope", "rotary_ndims", "rotary_dim", "rotary_embedding")
# names of submodules / buffers / source words.  Position encodings act between the q and k
# projections (only the Q/K block is affected); norms, gates and clipping act on q, k or v
# themselves (the whole module is affected).
_POSITION_NAME = re.compile(r"rotary|(^|_)rope($|_)|rel_pos|relative|distance_embedding|alibi|pos_bias|"
                            r"position_bias|inv_freq|freqs|cos_cached|sin_cached", re.I)
_NORM_OR_GATE_NAME = re.compile(r"(^|_)q_?norm$|(^|_)k_?norm$|qk_?norm|query_norm|key_norm|(^|_)q_layernorm$|"
                                r"(^|_)k_layernorm$|(^|_)gate($|_)", re.I)
_POSITION_SOURCE = re.compile(r"rotary|^rope$|^rope_|_rope$|_rope_|apply_rot|alibi|relative|rel_pos|position_bias|"
                              r"freqs_cis|^position_embeddings$|^position_ids$|sinusoidal_pos", re.I)
_NORM_OR_CLIP_SOURCE = re.compile(r"^q_norm$|^k_norm$|qk_norm|^clamp_?$|clip_qkv", re.I)

# Attention classes whose forward() has been read and verified (transformers 5.x; the 4.x BERT/ViT/CLIP
# classes have the same structure, their relative-position variants carry extra parameters that the
# screen catches).  For these the source scan is skipped (4.x BertSelfAttention mentions
# "relative_key" in dead branches); every other check still applies.
VERIFIED_HF = frozenset({
    "BertSelfAttention", "BertSdpaSelfAttention", "BertCrossAttention", "RobertaSelfAttention",
    "RobertaSdpaSelfAttention", "RobertaCrossAttention", "XLMRobertaSelfAttention", "XLMRobertaSdpaSelfAttention",
    "CamembertSelfAttention", "ElectraSelfAttention", "ViTSelfAttention", "ViTSdpaSelfAttention",
    "ViTAttention", "DeiTSelfAttention", "DeiTSdpaSelfAttention", "DeiTAttention", "CLIPAttention",
    "CLIPSdpaAttention", "CLIPFlashAttention2", "GPT2Attention", "GPT2SdpaAttention", "GPT2FlashAttention2",
})


# --------------------------------------------------------------------------------------------------
# classes
# --------------------------------------------------------------------------------------------------


def transformers_class(mod: nn.Module, names: Iterable[str]) -> Optional[str]:
    """Name of the first class in ``type(mod).__mro__`` that is one of ``names`` and comes from
    ``transformers``, else None."""
    names = set(names)
    for c in type(mod).__mro__:
        if c.__name__ in names and c.__module__.startswith("transformers."):
            return c.__name__
    return None


def forward_owner(mod: nn.Module) -> type:
    """The class whose ``forward`` the module runs (the first in the MRO defining it)."""
    return next(c for c in type(mod).__mro__ if "forward" in vars(c))


def _verified_hf(mod: nn.Module) -> bool:
    return transformers_class(mod, VERIFIED_HF) is not None


# --------------------------------------------------------------------------------------------------
# projections
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def peft_tuner_layer() -> Optional[type]:
    """peft's ``BaseTunerLayer`` when peft is installed, else None (imported on first use only)."""
    if importlib.util.find_spec("peft") is None:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer
    return BaseTunerLayer


def lora_layer(mod: nn.Module) -> bool:
    """Whether ``mod`` is a peft LoRA layer: by structure a ``base_layer`` and ModuleDicts ``lora_A``,
    ``lora_B``, and, where peft is installed, an instance of its ``BaseTunerLayer`` (so adapters
    never needs peft, and a look-alike is not taken for peft's layer where peft exists)."""
    if not (isinstance(getattr(mod, "base_layer", None), nn.Module)
            and isinstance(getattr(mod, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(mod, "lora_B", None), nn.ModuleDict)):
        return False
    base = peft_tuner_layer()
    return base is None or isinstance(mod, base)


def lora_base(mod: nn.Module) -> nn.Module:
    """The wrapped layer of a LoRA layer (through nested wrappers)."""
    get = getattr(mod, "get_base_layer", None)
    base = get() if callable(get) else mod.base_layer
    return base if isinstance(base, nn.Module) else mod.base_layer


@dataclass
class Projection:
    """A linear projection found in a model (built by :func:`projection`): ``nn.Linear`` (weight
    ``(out, in)``) or HF ``Conv1D`` (weight ``(in, out)``, ``transposed``).

    ``module`` holds the weight; ``wrapper`` is the module found in the model (the peft LoRA layer
    around ``module``, or ``module`` itself)."""

    path: str
    module: nn.Module
    transposed: bool
    wrapper: Optional[nn.Module] = None

    def __post_init__(self):
        if self.wrapper is None:
            self.wrapper = self.module

    @property
    def adapted(self) -> bool:
        """Whether the projection carries LoRA adapters (its effective weight is base + s·B·A)."""
        return self.wrapper is not self.module

    @property
    def weight(self) -> torch.Tensor:
        """The weight the blocks slice (of the base layer under LoRA)."""
        return self.module.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        """The bias, or None."""
        b = getattr(self.module, "bias", None)
        return b if isinstance(b, torch.Tensor) else None

    @property
    def in_features(self) -> int:
        """Width of the input ``x``."""
        return int(self.weight.shape[0] if self.transposed else self.weight.shape[1])

    @property
    def out_features(self) -> int:
        """Width of the output ``y``."""
        return int(self.weight.shape[1] if self.transposed else self.weight.shape[0])

    def param_ids(self) -> set:
        """Ids of every parameter of the projection, adapters included."""
        return {id(p) for p in self.wrapper.parameters()}


def projection(path: str, mod: Optional[nn.Module]) -> Optional[Projection]:
    """``mod`` (found at ``path`` in the model) as a :class:`Projection`, or None when it is no
    linear map: an ``nn.Linear`` (``y = x Wᵀ + b``), an HF ``Conv1D`` (``y = x W + b``, so
    ``transposed``), or a peft LoRA layer around one of these (``wrapper`` is then the LoRA layer,
    ``module`` the base layer whose weight the blocks slice)."""
    if isinstance(mod, nn.Module) and lora_layer(mod):
        inner = projection(path, lora_base(mod))
        return None if inner is None else Projection(path, inner.module, inner.transposed, wrapper=mod)
    W = getattr(mod, "weight", None)
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        return None
    if isinstance(mod, nn.Linear):
        return Projection(path, mod, False)
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"):
        return Projection(path, mod, True)
    return None


def join_path(prefix: str, name: str) -> str:
    """The module path of child ``name`` of the module at ``prefix`` (``""``: the model itself)."""
    return f"{prefix}.{name}" if prefix else name


def linear_children(path: str, mod: nn.Module) -> Dict[str, Projection]:
    """The direct children of ``mod`` (at ``path``) that are projections (:func:`projection`), by
    child name."""
    out = {}
    for name, child in mod.named_children():
        info = projection(join_path(path, name), child)
        if info is not None:
            out[name] = info
    return out


def children_by_role(children: Dict[str, Projection]) -> Dict[str, List[str]]:
    """Per role ``"q"``, ``"k"``, ``"v"``, ``"o"``: the names among ``children`` that
    :data:`ROLE_NAMES` gives that role (e.g. ``{"q": ["q_proj"], "k": ["k_proj"], ...}``)."""
    return {r: [n for n in children if n in names] for r, names in ROLE_NAMES.items()}


def int_attr(obj: Any, names: Sequence[str]) -> Optional[int]:
    """The first attribute of ``obj`` among ``names`` that is a positive int (not a bool), else None."""
    for a in names:
        v = getattr(obj, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def num_heads_of(mod: nn.Module) -> Optional[int]:
    """The head count of an attention module: an attribute of :data:`HEADS_ATTRS`, else its HF
    ``config.num_attention_heads``; None when neither is there."""
    v = int_attr(mod, HEADS_ATTRS)
    if v is None:
        cfg = getattr(mod, "config", None)
        if cfg is not None:
            v = int_attr(cfg, ("num_attention_heads",))
    return v


# --------------------------------------------------------------------------------------------------
# pieces and blocks
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Heads:
    """Heads of a projection: head ``i`` is features ``offset + i * stride ...`` (``stride`` None:
    heads side by side), e.g. ``Heads(c_attn, offset=E)`` for the keys of GPT-2's packed ``c_attn``."""

    lin: Projection
    offset: int = 0
    stride: Optional[int] = None


#: A projection, or some heads of one (``q=``, ``k=``, ... of :func:`attention_blocks`).
ProjectionLike = Union[Projection, Heads]


def _as_heads(p: ProjectionLike) -> Heads:
    return p if isinstance(p, Heads) else Heads(p)


def in_projection_pieces(ctx: Context, proj: ProjectionLike, num_heads: int, head_dim: int,
                         group_size: int = 1) -> List[FactorPiece]:
    """The factor pieces ``[Wᵀ ; b]`` per head of a q/k/v projection (heads along its output
    features; the bias is a row because the input is ``[x 1]``).  ``group_size`` query heads share
    one key/value head's gauge (grouped-query attention)."""
    p = _as_heads(proj)
    kw = dict(offset=p.offset, num_heads=num_heads, head_dim=head_dim, group_size=group_size, stride=p.stride)
    pieces = [FactorPiece(ctx.name(p.lin.weight), "cols" if p.lin.transposed else "rows", **kw)]
    if p.lin.bias is not None:
        pieces.append(FactorPiece(ctx.name(p.lin.bias), "bias", **kw))
    return pieces


def out_projection_pieces(ctx: Context, proj: ProjectionLike, num_heads: int, head_dim: int,
                          group_size: int = 1) -> List[FactorPiece]:
    """The factor pieces ``W[:, head]`` of an output projection (heads along its input features; its
    bias is in no block).  ``group_size`` as in :func:`in_projection_pieces`."""
    p = _as_heads(proj)
    return [FactorPiece(ctx.name(p.lin.weight), "rows" if p.lin.transposed else "cols", p.offset, num_heads,
                        head_dim, group_size=group_size, stride=p.stride)]


def _rows(pieces: Sequence[FactorPiece], shapes: Dict[str, tuple]) -> int:
    return sum(p.rows_per_head(shapes[p.param]) for p in pieces)


def make_block(module: str, kind: str, family: str, g: List[FactorPiece], h: List[FactorPiece],
               shapes: Dict[str, tuple], group: Group = FULL_GL, name: Optional[str] = None,
               group_source: str = "") -> GLBlock:
    """The :class:`~quotient_manifolds.adapters.blocks.GLBlock` ``(G, H)`` of ``module`` with factor pieces
    ``g`` and ``h``, acted on by ``(G A, H A⁻ᵀ)`` with ``A`` in ``group`` per head; ``n`` and ``m`` are
    the rows per head of the pieces at parameter ``shapes``.  Named ``<module>/<kind>`` unless
    ``name``; checked against ``shapes`` (``GLBlock.validate``)."""
    b = GLBlock(name=name or f"{module}/{kind}", kind=kind, module=module, g_pieces=tuple(g), h_pieces=tuple(h),
                num_heads=g[0].block_heads, head_dim=g[0].head_dim, n=_rows(g, shapes), m=_rows(h, shapes),
                family=family, group=group, group_source=group_source or f"family {family}")
    b.validate(shapes)
    return b


def add_block(match: Match, kind: str, g: List[FactorPiece], h: List[FactorPiece], shapes: Dict[str, tuple],
              group: Group = FULL_GL, group_source: str = "") -> None:
    """Append the ``kind`` block of ``match.module`` to ``match``, or reject that part when its heads are
    larger than its factors: ``G`` (n x head_dim) and ``H`` (m x head_dim) per head cannot have full
    column rank when head_dim > min(n, m) (e.g. ``nn.MultiheadAttention`` with ``vdim`` < head_dim),
    and GL(head_dim) then has no quotient (``GLBlock`` refuses it)."""
    n, m, head_dim = _rows(g, shapes), _rows(h, shapes), g[0].head_dim
    if head_dim > min(n, m):
        match.reject(f"head_dim {head_dim} exceeds the rows of the {kind.upper()} factors per head "
                     f"(G {n}, H {m}): they cannot have full column rank, so GL({head_dim}) has no "
                     f"quotient there (its weights can only be treated adaptively)", part=kind)
        return
    match.blocks.append(make_block(match.module, kind, match.family, g, h, shapes, group,
                                    group_source=group_source))


LORA_NOTE = "projections carry LoRA adapters: their GL(r) blocks are used instead"


def attention_blocks(ctx: Context, match: Match, *, q: ProjectionLike, k: ProjectionLike, v: ProjectionLike,
                     o: ProjectionLike, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                     qk_group: Group = FULL_GL, qk: bool = True, vo: bool = True, qk_source: str = "",
                     vo_source: str = "", q_pairs: Sequence[ProjectionLike] = (),
                     k_pairs: Sequence[ProjectionLike] = ()) -> None:
    """Append the Q/K and V/O blocks of one attention module to ``match``.

    ``num_heads`` query heads, ``num_kv_heads`` (default ``num_heads``) key/value heads; query head
    ``i`` reads key/value head ``i // (num_heads // num_kv_heads)`` (HF ``repeat_kv``), so each
    key/value head is one gauge: QK ``G`` stacks its query slices, ``H`` is its key slice; VO ``G``
    is its value slice, ``H`` stacks its output-projection slices.  ``qk_group`` is the group of the
    Q/K block (the rotary commutant for RoPE); V/O always has the full GL(head_dim).
    ``q_pairs`` / ``k_pairs``: positional projections split into heads like q / k whose scores pair
    them with the other side (:func:`~.positions.position_terms`): their slices are stacked under
    ``G`` / ``H`` of the Q/K block, so the same per-head ``A`` acts on them.  A block whose
    projections carry LoRA adapters is left out (with a note): acting on frozen base weights is no
    symmetry once a low-rank delta is added to them.
    """
    n_kv = num_kv_heads or num_heads
    if num_heads % n_kv:
        raise InvalidArgument(f"{match.module}: {num_heads} query heads cannot share {n_kv} key/value heads evenly; "
                              "num_kv_heads must divide num_heads")
    rep = num_heads // n_kv
    q, k, v, o = (_as_heads(p) for p in (q, k, v, o))
    adapted: List[str] = []
    wanted = []
    if qk:
        q_side = [q, *(_as_heads(p) for p in q_pairs)]
        k_side = [k, *(_as_heads(p) for p in k_pairs)]
        wanted.append(("qk", [pc for p in q_side for pc in in_projection_pieces(ctx, p, num_heads, head_dim, rep)],
                       [pc for p in k_side for pc in in_projection_pieces(ctx, p, n_kv, head_dim)], qk_group,
                       (*q_side, *k_side), qk_source))
    if vo:
        wanted.append(("vo", in_projection_pieces(ctx, v, n_kv, head_dim),
                       out_projection_pieces(ctx, o, num_heads, head_dim, rep), FULL_GL, (v, o), vo_source))
    for kind, g, h, group, projs, source in wanted:
        lora = [p.lin.path.rsplit(".", 1)[-1] for p in projs if p.lin.adapted]
        if lora:
            adapted.append(f"{kind} ({', '.join(dict.fromkeys(lora))})")
            continue
        add_block(match, kind, g, h, ctx.shapes, group, group_source=source)
    if adapted:
        match.notes.append(f"{match.module}: no GL block over the base weights of {', '.join(adapted)}: the "
                           f"{LORA_NOTE} (a GL action on frozen base weights is no symmetry once a low-rank "
                           "delta is added to them)")


# --------------------------------------------------------------------------------------------------
# screening
# --------------------------------------------------------------------------------------------------


@dataclass
class Screen:
    """Reasons against the plain GL symmetry: ``module`` for the whole module (extra parameters,
    norms, gates, clipping), ``qk`` for the Q/K half only (position encodings act between the q and
    k projections and leave V/O alone)."""

    module: List[str] = field(default_factory=list)
    qk: List[str] = field(default_factory=list)


_NORM_CLASS = re.compile(r"norm", re.I)


def stream_norms(mod: nn.Module, width: Optional[int]) -> Tuple[List[str], set]:
    """Norm submodules of ``mod`` on the model-width stream and the ids of their parameters.

    A norm whose parameters are all vectors of the model width (``width``) and whose name is not a
    q/k norm's acts on the module's input or on its output projection's output (ALBERT keeps the
    residual ``LayerNorm`` inside its attention module), never on one head's q, k or v: per-head
    actions on Q/K and V/O leave its input, hence its output, unchanged.  A norm on the concatenated
    heads before the output projection would look the same when ``width = num_heads * head_dim``:
    verification (``Layout.verify``) is what rules that out."""
    if width is None:
        return [], set()
    names, ids = [], set()
    for name, sub in mod.named_modules():
        params = list(sub.parameters(recurse=False))
        if (name and params and _NORM_CLASS.search(type(sub).__name__)
                and not _NORM_OR_GATE_NAME.search(name.rsplit(".", 1)[-1])
                and all(p.dim() == 1 and p.shape[0] == width for p in params)):
            names.append(name)
            ids |= {id(p) for p in params}
    return names, ids


def forward_args(mod: nn.Module) -> set:
    """Names of the parameters of ``mod.forward`` (empty when its signature cannot be read)."""
    try:
        return set(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def screen_module(mod: nn.Module, core_ids: set, *, source_scan: bool, known: Sequence[str] = (),
            positions: bool = True, modelled: Sequence[str] = (), stream_width: Optional[int] = None) -> Screen:
    """Screen a q/k/v/o-shaped module.  ``core_ids``: parameters whose role is understood;
    ``known``: submodule names whose role is understood (e.g. QK norms handled by the family);
    ``positions=False`` skips the position-encoding checks (families that model them);
    ``modelled``: submodule and ``forward`` argument names of position terms the family models
    (:func:`~.positions.position_terms`): left out of the position checks, and the source scan's
    position words (which cannot be attributed to one term) are not used; ``stream_width``: the
    model width, whose norms (:func:`stream_norms`) are not extra parameters."""
    out = Screen()
    core_ids = core_ids | stream_norms(mod, stream_width)[1]
    extra = [n for n, p in mod.named_parameters() if id(p) not in core_ids]
    if extra:
        out.module.append(f"parameters besides the q/k/v/o projections ({_shown(extra)}): relative-position "
                          "tables, q/k norms or gates would break the GL symmetry")
    names = [n for n, _ in mod.named_modules() if n and n.split(".")[0] not in known]
    names += [n for n, _ in mod.named_buffers()]
    last = [n.rsplit(".", 1)[-1] for n in names]
    other = [n for n, s in zip(names, last) if _NORM_OR_GATE_NAME.search(s)]
    if other:
        out.module.append(f"submodules/buffers {_shown(other)} look like q/k normalisation or gates")
    if getattr(mod, "rotary_value", False) is True:
        out.module.append("rotary_value=True: the rotary encoding also turns the values, which breaks the V/O "
                          "symmetry too")
    if positions:
        pos = [n for n, s in zip(names, last) if _POSITION_NAME.search(s) and n.split(".")[0] not in modelled]
        pos += [a for a in POSITION_ATTRS if getattr(mod, a, None) is not None and a not in pos]
        if pos:
            out.qk.append(f"submodules/buffers/attributes {_shown(pos)} look like rotary or relative position "
                          "encodings")
        pet = getattr(mod, "position_embedding_type", None)
        if isinstance(pet, str) and pet != "absolute":
            out.qk.append(f"position_embedding_type={pet!r}: relative/rotary positions break the QK symmetry")
        sig_args = forward_args(mod)
        args = [a for a in POSITION_ARGS if a in sig_args and a not in modelled]
        if args:
            out.qk.append(f"forward() takes positional inputs ({', '.join(args)}): rotary/relative position "
                          "encodings act between the projections and break the GL symmetry")
    if source_scan:
        try:
            src = inspect.getsource(forward_owner(mod).forward)
        except (OSError, TypeError):
            src = ""
        words = sorted(set(re.findall(r"[A-Za-z_]\w*", src)))
        clip = [w for w in words if _NORM_OR_CLIP_SOURCE.search(w)]
        if clip:
            out.module.append(f"forward() source mentions {', '.join(clip)}: norms or clipping of q/k/v "
                              "break the GL symmetry")
        hits = [w for w in words if positions and not modelled and _POSITION_SOURCE.search(w)]
        if hits:
            out.qk.append(f"forward() source mentions {', '.join(hits)}: cannot prove the GL symmetry of Q/K")
    return out
