"""Find the GL blocks of a model by module type and structure, and build its :class:`Layout`.

Families (``geodesic-sharpness-math.md`` §6.2, ``offline-assets.md`` §2/§4):

``torch-mha``
    any ``torch.nn.MultiheadAttention`` (open_clip, OpenAI CLIP, ``nn.TransformerEncoder``): packed
    ``in_proj_weight`` (rows ``[0:E]`` q, ``[E:2E]`` k, ``[2E:3E]`` v) or separate
    ``{q,k,v}_proj_weight`` (``kdim``/``vdim`` != ``embed_dim``), ``in_proj_bias`` split the same way,
    ``out_proj`` columns per head form H of VO (``out_proj.bias`` adaptive).  ``add_bias_kv``: the
    learned extra key ``bias_k`` is an extra row of H (QK) and ``bias_v`` an extra row of G (VO): the
    extra token has input ``[0 .. 0 1]``, so the blocks stay of the form ``g(G Hᵀ)``; ``add_zero_attn``
    appends zero keys/values, which every linear action leaves at zero.  Both checked by ``verify``.
``hf-bert``
    a module with ``nn.Linear`` children q/k/v (``query``/``key``/``value`` in BERT, RoBERTa, MiniLM,
    ELECTRA, ViT/DeiT of transformers 4.x) and no output projection of its own, whose parent has the
    output projection as ``output.dense`` (``BertAttention`` = ``self`` + ``output``).  Block module =
    the parent.
``qkvo``
    a module with four ``nn.Linear`` children playing q/k/v/o (``q_proj/k_proj/v_proj/o_proj`` of HF
    ViT 5.x, ``q_proj/k_proj/v_proj/out_proj`` of HF CLIP vision/text, ``q/k/v/o``,
    ``query/key/value/dense`` ... of plain PyTorch modules) and an int head-count attribute
    (``num_heads``, ``num_attention_heads``, ``n_heads`` ...) or an HF ``config.num_attention_heads``.
``hf-gpt2``
    ``GPT2Attention`` (HF ``Conv1D`` weights in ``(in, out)`` layout, packed ``c_attn``).

Every candidate is screened; any of the following makes it *unsupported* (with the reason), never
silently adaptive: parameters besides the q/k/v/o projections (relative-position tables, q/k norms,
gates ...), submodules/buffers named like rotary/relative position encodings or q/k norms, a
non-absolute ``position_embedding_type``, a forward() taking positional inputs
(``position_embeddings``, ``position_ids``, ``freqs_cis`` ... as in HF Llama), k/v with fewer features
than q (grouped-/multi-query attention), inconsistent head sizes, and, for classes that are not one of
the verified HF classes, a forward() whose source mentions rotary/relative/alibi/q_norm.  Modules that
look like attention (two or more q/k/v-named linear children, or a packed ``qkv``-like projection;
in a second pass, a class name containing "Attention"/"Attn" with own weights, unless the module
contains an attention module found in the first pass, e.g. a pooling head around an
``nn.MultiheadAttention``) but match no family are unsupported too.

Not covered (reported unsupported, declare by hand if they are symmetric): ALBERT (LayerNorm inside the
attention module), GPT-NeoX / timm-style packed ``qkv`` Linear, T5 / Swin (relative position bias),
Llama / Qwen / rotary models, grouped-query attention.  Checked to work: BERT, RoBERTa, ELECTRA,
MiniLM, DistilBERT, ViT (4.x and 5.x structure), DeiT, CLIP (vision, text, full), SigLIP vision (incl.
its MHA pooling head), BART, GPT-2, ``nn.MultiheadAttention`` / ``nn.TransformerEncoder``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .layout import FactorPiece, GLBlock, Layout, Unsupported, _canonical_names

__all__ = ["layout", "detect", "Detection", "ROLE_NAMES", "PACKED_NAMES"]

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
                 "relative_position_bias", "pos_emb", "pos_bias", "rotary_pos_embedding")
_SUSPICIOUS_NAME = re.compile(
    r"rotary|(^|_)rope($|_)|rel_pos|relative|distance_embedding|alibi|pos_bias|position_bias|(^|_)q_?norm$|"
    r"(^|_)k_?norm$|qk_?norm|query_norm|key_norm|inv_freq|freqs|cos_cached|sin_cached|(^|_)gate($|_)",
    re.I,
)
_SUSPICIOUS_SOURCE = re.compile(
    r"rotary|^rope$|^rope_|_rope$|_rope_|apply_rot|alibi|relative|rel_pos|position_bias|freqs_cis|^q_norm$|"
    r"^k_norm$|qk_norm|^position_embeddings$|^position_ids$",
    re.I,
)
# Attention classes whose forward() we have read and verified (transformers 5.x; the 4.x BERT/ViT/CLIP
# classes have the same structure, their relative-position variants carry extra parameters that the
# screen catches).  For these the source scan is skipped (4.x BertSelfAttention mentions
# "relative_key" in dead branches); every other check still applies.
_VERIFIED_HF = {
    "BertSelfAttention", "BertSdpaSelfAttention", "BertCrossAttention", "RobertaSelfAttention",
    "RobertaSdpaSelfAttention", "RobertaCrossAttention", "XLMRobertaSelfAttention", "XLMRobertaSdpaSelfAttention",
    "CamembertSelfAttention", "ElectraSelfAttention", "ViTSelfAttention", "ViTSdpaSelfAttention",
    "ViTAttention", "DeiTSelfAttention", "DeiTSdpaSelfAttention", "DeiTAttention", "CLIPAttention",
    "CLIPSdpaAttention", "CLIPFlashAttention2", "GPT2Attention", "GPT2SdpaAttention", "GPT2FlashAttention2",
}


def _verified_hf(mod: nn.Module) -> bool:
    return any(c.__name__ in _VERIFIED_HF and c.__module__.startswith("transformers.") for c in type(mod).__mro__)


# --------------------------------------------------------------------------------------------------
# structure helpers
# --------------------------------------------------------------------------------------------------


@dataclass
class _Lin:
    """A linear projection: ``nn.Linear`` (weight ``(out, in)``) or HF ``Conv1D`` (weight ``(in, out)``)."""

    path: str
    module: nn.Module
    transposed: bool

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        b = getattr(self.module, "bias", None)
        return b if isinstance(b, torch.Tensor) else None

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[0] if self.transposed else self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[1] if self.transposed else self.weight.shape[0])

    def param_ids(self) -> set:
        return {id(p) for p in (self.weight, self.bias) if p is not None}


def _lin(path: str, mod: nn.Module) -> Optional[_Lin]:
    W = getattr(mod, "weight", None)
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        return None
    if isinstance(mod, nn.Linear):
        return _Lin(path, mod, False)
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"):
        return _Lin(path, mod, True)
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _linear_children(path: str, mod: nn.Module) -> Dict[str, _Lin]:
    out = {}
    for name, child in mod.named_children():
        info = _lin(_join(path, name), child)
        if info is not None:
            out[name] = info
    return out


def _roles(children: Dict[str, _Lin]) -> Dict[str, List[str]]:
    return {r: [n for n in children if n in names] for r, names in ROLE_NAMES.items()}


def _int_attr(mod: nn.Module, names: Sequence[str]) -> Optional[int]:
    for a in names:
        v = getattr(mod, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _num_heads(mod: nn.Module) -> Optional[int]:
    v = _int_attr(mod, HEADS_ATTRS)
    if v is None:
        cfg = getattr(mod, "config", None)
        if cfg is not None:
            v = _int_attr(cfg, ("num_attention_heads",))
    return v


def _in_pieces(canon: Dict[int, str], lin: _Lin, offset: int, nh: int, h: int) -> List[FactorPiece]:
    pieces = [FactorPiece(canon[id(lin.weight)], "cols" if lin.transposed else "rows", offset, nh, h)]
    if lin.bias is not None:
        pieces.append(FactorPiece(canon[id(lin.bias)], "bias", offset, nh, h))
    return pieces


def _out_pieces(canon: Dict[int, str], lin: _Lin, offset: int, nh: int, h: int) -> List[FactorPiece]:
    return [FactorPiece(canon[id(lin.weight)], "rows" if lin.transposed else "cols", offset, nh, h)]


def _rows(pieces: Sequence[FactorPiece], shapes: Dict[str, tuple]) -> int:
    return sum(p.rows_per_head(shapes[p.param]) for p in pieces)


def _make_block(module: str, kind: str, family: str, g: List[FactorPiece], h: List[FactorPiece],
                shapes: Dict[str, tuple]) -> GLBlock:
    b = GLBlock(name=f"{module}/{kind}", kind=kind, module=module, g_pieces=tuple(g), h_pieces=tuple(h),
                num_heads=g[0].num_heads, head_dim=g[0].head_dim, n=_rows(g, shapes), m=_rows(h, shapes),
                family=family)
    b.validate(shapes)
    return b


def _screen(mod: nn.Module, core_ids: set, *, source_scan: bool) -> List[str]:
    """Reasons why a q/k/v/o-shaped module might not have the plain GL symmetry."""
    reasons = []
    extra = [n for n, p in mod.named_parameters() if id(p) not in core_ids]
    if extra:
        shown = ", ".join(extra[:4]) + (", ..." if len(extra) > 4 else "")
        reasons.append(f"parameters besides the q/k/v/o projections ({shown}): relative-position tables, "
                       "q/k norms or gates would break the GL symmetry")
    sus = [n for n, _ in mod.named_modules() if n and _SUSPICIOUS_NAME.search(n.rsplit(".", 1)[-1])]
    sus += [n for n, _ in mod.named_buffers() if _SUSPICIOUS_NAME.search(n.rsplit(".", 1)[-1])]
    for a in ("rotary_emb", "rotary", "rope", "rotary_ndims", "rotary_dim", "rotary_embedding"):
        if getattr(mod, a, None) is not None and a not in sus:
            sus.append(a)
    if sus:
        reasons.append(f"submodules/buffers/attributes {', '.join(sus[:4])} look like rotary or relative "
                       "position encodings or q/k normalisation")
    pet = getattr(mod, "position_embedding_type", None)
    if isinstance(pet, str) and pet != "absolute":
        reasons.append(f"position_embedding_type={pet!r}: relative/rotary positions break the QK symmetry")
    try:
        sig_args = set(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        sig_args = set()
    pos = [a for a in POSITION_ARGS if a in sig_args]
    if pos:
        reasons.append(f"forward() takes positional inputs ({', '.join(pos)}): rotary/relative position "
                       "encodings act between the projections and break the GL symmetry")
    if source_scan:
        try:
            src = inspect.getsource(type(mod).forward)
        except (OSError, TypeError):
            src = ""
        hits = sorted({w for w in re.findall(r"[A-Za-z_]\w*", src) if _SUSPICIOUS_SOURCE.search(w)})
        if hits:
            reasons.append(f"forward() source mentions {', '.join(hits)}: cannot prove the GL symmetry")
    return reasons


# --------------------------------------------------------------------------------------------------
# family matchers
# --------------------------------------------------------------------------------------------------


@dataclass
class _Match:
    module: str                      # path of the attention module (blocks' .module)
    family: str
    blocks: List[GLBlock] = field(default_factory=list)
    reasons: List[str] = field(default_factory=list)
    cls: str = ""


def _match_mha(path: str, mod: nn.MultiheadAttention, canon, shapes) -> _Match:
    res = _Match(path, "torch-mha", cls=type(mod).__name__)
    if type(mod).forward is not nn.MultiheadAttention.forward:
        res.reasons.append("subclass of nn.MultiheadAttention with its own forward(): cannot prove the GL symmetry")
        return res
    E, nh = int(mod.embed_dim), int(mod.num_heads)
    h = int(getattr(mod, "head_dim", E // nh))
    if nh * h != E:
        res.reasons.append(f"embed_dim {E} is not num_heads {nh} x head_dim {h}")
        return res
    if mod._qkv_same_embed_dim:
        W = mod.in_proj_weight
        qkv = [(W, 0), (W, E), (W, 2 * E)]
    else:
        qkv = [(mod.q_proj_weight, 0), (mod.k_proj_weight, 0), (mod.v_proj_weight, 0)]
    if any(w is None for w, _ in qkv) or mod.out_proj.weight is None:
        res.reasons.append("missing projection weights")
        return res
    rows = [FactorPiece(canon[id(w)], "rows", off, nh, h) for w, off in qkv]
    b = mod.in_proj_bias
    bias = [FactorPiece(canon[id(b)], "bias", i * E, nh, h) for i in range(3)] if b is not None else [None] * 3
    g_qk, h_qk, g_vo = [rows[0]], [rows[1]], [rows[2]]
    for lst, piece in ((g_qk, bias[0]), (h_qk, bias[1]), (g_vo, bias[2])):
        if piece is not None:
            lst.append(piece)
    # add_bias_kv: the learned extra key/value token is (after projection) bias_k / bias_v, i.e. an extra
    # input row [0 ... 0 1] -> an extra row of H (keys) and of G (values).
    if getattr(mod, "bias_k", None) is not None:
        h_qk.append(FactorPiece(canon[id(mod.bias_k)], "bias", 0, nh, h))
    if getattr(mod, "bias_v", None) is not None:
        g_vo.append(FactorPiece(canon[id(mod.bias_v)], "bias", 0, nh, h))
    h_vo = [FactorPiece(canon[id(mod.out_proj.weight)], "cols", 0, nh, h)]
    res.blocks = [_make_block(path, "qk", res.family, g_qk, h_qk, shapes),
                  _make_block(path, "vo", res.family, g_vo, h_vo, shapes)]
    return res


def _qkvo_shapes(mod: nn.Module, lq: _Lin, lk: _Lin, lv: _Lin, lo: _Lin) -> Tuple[Optional[int], Optional[int], List[str]]:
    """Head count, head dim and structural reasons against a per-head GL block."""
    reasons: List[str] = []
    nh = _num_heads(mod)
    if nh is None:
        return None, None, [f"no head-count attribute ({', '.join(HEADS_ATTRS[:3])}, ...): declare the blocks"]
    h = _int_attr(mod, HEAD_DIM_ATTRS)
    if h is None:
        if lq.out_features % nh:
            return nh, None, [f"q has {lq.out_features} features, not divisible by {nh} heads"]
        h = lq.out_features // nh
    if lq.out_features != nh * h:
        reasons.append(f"q has {lq.out_features} features, expected num_heads*head_dim = {nh}*{h}")
    if lk.out_features != lq.out_features or lv.out_features != lq.out_features:
        reasons.append(f"k/v have {lk.out_features}/{lv.out_features} features vs {lq.out_features} for q "
                       "(grouped-query / multi-query attention is not a per-head GL block)")
    elif lo.in_features != lv.out_features:
        reasons.append(f"output projection takes {lo.in_features} features, v gives {lv.out_features}")
    return nh, h, reasons


def _qkvo_match(res: _Match, mod: nn.Module, lq: _Lin, lk: _Lin, lv: _Lin, lo: _Lin, core: set, canon, shapes) -> _Match:
    res.reasons += _screen(mod, core, source_scan=not _verified_hf(mod))
    nh, h, why = _qkvo_shapes(mod, lq, lk, lv, lo)
    res.reasons += why
    if not res.reasons:
        res.blocks = [
            _make_block(res.module, "qk", res.family, _in_pieces(canon, lq, 0, nh, h), _in_pieces(canon, lk, 0, nh, h), shapes),
            _make_block(res.module, "vo", res.family, _in_pieces(canon, lv, 0, nh, h), _out_pieces(canon, lo, 0, nh, h), shapes),
        ]
    return res


def _match_gpt2(path: str, mod: nn.Module, children: Dict[str, _Lin], canon, shapes) -> _Match:
    res = _Match(path, "hf-gpt2", cls=type(mod).__name__)
    ca, cp, qa = children.get("c_attn"), children.get("c_proj"), children.get("q_attn")
    nh, h = _num_heads(mod), _int_attr(mod, ("head_dim",))
    E = getattr(mod, "embed_dim", None)
    if ca is None or cp is None or nh is None or h is None or E != nh * h:
        res.reasons.append("GPT2Attention without the expected c_attn/c_proj/num_heads/head_dim structure")
        return res
    core = ca.param_ids() | cp.param_ids() | (qa.param_ids() if qa is not None else set())
    res.reasons += _screen(mod, core, source_scan=False)
    if qa is None:
        if ca.out_features != 3 * E:
            res.reasons.append(f"c_attn has {ca.out_features} outputs, expected 3*{E}")
        q, k, v = (ca, 0), (ca, E), (ca, 2 * E)
    else:
        if ca.out_features != 2 * E or qa.out_features != E:
            res.reasons.append("cross-attention c_attn/q_attn of unexpected size")
        q, k, v = (qa, 0), (ca, 0), (ca, E)
    if cp.in_features != E:
        res.reasons.append(f"c_proj takes {cp.in_features} features, expected {E}")
    if res.reasons:
        return res
    res.blocks = [
        _make_block(path, "qk", res.family, _in_pieces(canon, q[0], q[1], nh, h), _in_pieces(canon, k[0], k[1], nh, h), shapes),
        _make_block(path, "vo", res.family, _in_pieces(canon, v[0], v[1], nh, h), _out_pieces(canon, cp, 0, nh, h), shapes),
    ]
    return res


def _attention_like(mod: nn.Module, children: Dict[str, _Lin], roles: Dict[str, List[str]]) -> Optional[str]:
    if isinstance(mod, nn.MultiheadAttention):
        return "nn.MultiheadAttention"
    qkv = [n for r in "qkv" for n in roles[r]]
    if len(qkv) >= 2:
        return f"linear projections {', '.join(qkv)}"
    packed = [n for n in children if n in PACKED_NAMES]
    if packed:
        return f"packed projection {', '.join(packed)}"
    if re.search(r"attention|attn", type(mod).__name__, re.I):
        if children or any(True for _ in mod.parameters(recurse=False)):
            return f"class name {type(mod).__name__}"
    return None


def _match(model: nn.Module, path: str, mod: nn.Module, modules: Dict[str, nn.Module], canon, shapes,
           by_name: bool = False) -> Optional[_Match]:
    """Match one module.  ``by_name=False``: structural candidates only (MHA, q/k/v children, packed
    projections); ``by_name=True``: also modules that look like attention only by their class name."""
    cls = type(mod).__name__
    if isinstance(mod, nn.MultiheadAttention):
        return _match_mha(path, mod, canon, shapes)
    children = _linear_children(path, mod)
    roles = _roles(children)
    why = _attention_like(mod, children, roles)
    if why is None or (why.startswith("class name") and not by_name):
        return None
    if any(c.__name__ == "GPT2Attention" and c.__module__.startswith("transformers.") for c in type(mod).__mro__):
        return _match_gpt2(path, mod, children, canon, shapes)
    has = {r: len(v) for r, v in roles.items()}
    if has["q"] == 1 and has["k"] == 1 and has["v"] == 1 and has["o"] <= 1:
        lq, lk, lv = (children[roles[r][0]] for r in "qkv")
        if has["o"] == 1:
            # qkvo: all four projections in this module
            res = _Match(path, "qkvo", cls=cls)
            lo = children[roles["o"][0]]
            core = lq.param_ids() | lk.param_ids() | lv.param_ids() | lo.param_ids()
            return _qkvo_match(res, mod, lq, lk, lv, lo, core, canon, shapes)
        # hf-bert: output projection is the sibling `output.dense` under the parent
        parent_path, _, own = path.rpartition(".")
        parent = modules.get(parent_path) if path else None
        out = getattr(parent, "output", None) if parent is not None else None
        dense = _lin(_join(parent_path, "output.dense"), getattr(out, "dense", None)) if isinstance(out, nn.Module) and isinstance(getattr(out, "dense", None), nn.Module) else None
        if parent is None or dense is None or getattr(parent, own, None) is not mod:
            res = _Match(path, "hf-bert", cls=cls)
            res.reasons.append("has q/k/v projections but no output projection (neither a child o_proj/out_proj/"
                               "dense/... nor a sibling output.dense): declare the VO block")
            return res
        res = _Match(parent_path, "hf-bert", cls=cls)
        core = lq.param_ids() | lk.param_ids() | lv.param_ids()
        # the parent must hold nothing but this module and the output block
        others = [n for n, c in parent.named_children() if c is not mod and c is not out
                  and any(True for _ in c.parameters())]
        if others:
            res.reasons.append(f"parent {parent_path} has other parametrised children ({', '.join(others)})")
        return _qkvo_match(res, mod, lq, lk, lv, dense, core, canon, shapes)
    res = _Match(path, "unknown", cls=cls)
    if any(v > 1 for v in has.values()):
        amb = {r: roles[r] for r in "qkvo" if has[r] > 1}
        res.reasons.append(f"ambiguous projections {amb}: declare the blocks")
    elif any(n in PACKED_NAMES for n in children):
        res.reasons.append(f"{why}: the q/k/v order inside a packed projection is implementation-specific; "
                           "declare the blocks with offsets (declare_block(..., offsets=...)) or raw FactorPieces")
    else:
        res.reasons.append(f"attention-like ({why}) but not a recognised q/k/v/o structure: declare the blocks")
    return res


# --------------------------------------------------------------------------------------------------
# detection and layout()
# --------------------------------------------------------------------------------------------------


@dataclass
class Detection:
    blocks: List[GLBlock]
    unsupported: List[Unsupported]
    seen: List[Tuple[str, str, str]]   # (module path, class name, family or "unsupported")


def detect(model: nn.Module) -> Detection:
    """Detected GL blocks and unsupported attention-like modules of ``model`` (nothing is modified)."""
    canon, _ = _canonical_names(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    claimed: List[str] = []
    blocks: List[GLBlock] = []
    unsupported: List[Unsupported] = []
    seen: List[Tuple[str, str, str]] = []

    def inside(p: str) -> bool:
        return any(c == "" or p == c or p.startswith(c + ".") for c in claimed)

    def contains_claimed(p: str) -> bool:
        return any(p == "" or c.startswith(p + ".") for c in claimed)

    # pass 1: structural candidates; pass 2: modules that look like attention only by class name and
    # neither lie inside nor contain a module handled in pass 1 (e.g. a pooling head around an MHA)
    for by_name in (False, True):
        for path, mod in modules.items():
            if inside(path) or (by_name and contains_claimed(path)):
                continue
            res = _match(model, path, mod, modules, canon, shapes, by_name=by_name)
            if res is None:
                continue
            claimed.append(res.module)
            if res.reasons or not res.blocks:
                reason = "; ".join(res.reasons) or "no blocks could be formed"
                unsupported.append(Unsupported(res.module, res.cls, reason))
                seen.append((res.module, res.cls, "unsupported"))
            else:
                blocks.extend(res.blocks)
                seen.append((res.module, res.cls, res.family))
    order = {p: i for i, p in enumerate(modules)}
    blocks.sort(key=lambda b: order.get(b.module, len(order)))      # stable: qk before vo
    unsupported.sort(key=lambda u: order.get(u.module, len(order)))
    seen.sort(key=lambda s: order.get(s[0], len(order)))
    return Detection(blocks, unsupported, seen)


def _flatten(blocks) -> List[GLBlock]:
    if blocks is None:
        return []
    if isinstance(blocks, GLBlock):
        return [blocks]
    out = []
    for b in blocks:
        out.extend(_flatten(b))
    return out


def _overlaps(pieces: Iterable[FactorPiece], masks: Dict[str, torch.Tensor], params) -> bool:
    return any(p.param in masks and bool((masks[p.param] & p.mask(params[p.param])).any()) for p in pieces)


def layout(model: nn.Module, *, blocks: Union[None, GLBlock, Sequence] = None, allow_unsupported: bool = False,
           detect_blocks: bool = True) -> Layout:
    """Build the :class:`Layout` of ``model`` (never modifies or wraps it).

    GL blocks are detected by module type/structure (see the module docstring); ``blocks=`` adds
    user-declared blocks (:func:`declare_block`), which take precedence over detected blocks they
    overlap and resolve unsupported modules whose parameters they use.  ``detect_blocks=False`` uses
    only the declared blocks.  Raises ``ValueError`` when attention-like modules cannot be mapped, or no
    block is found at all, unless ``allow_unsupported=True`` (their parameters are then adaptive).
    Blocks touching frozen (``requires_grad=False``) parameters are dropped (noted in ``layout.notes``).
    """
    params = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    _, alias = _canonical_names(model)
    frozen = [n for n, p in params.items() if not p.requires_grad]
    det = detect(model) if detect_blocks else Detection([], [], [])
    notes: List[str] = []

    user: List[GLBlock] = []
    for b in _flatten(blocks):
        if not isinstance(b, GLBlock):
            raise TypeError(f"blocks= must contain GLBlock objects (see declare_block), got {type(b).__name__}")
        canon_b = GLBlock(name=b.name, kind=b.kind, module=b.module,
                          g_pieces=tuple(FactorPiece(alias.get(p.param, p.param), p.kind, p.offset, p.num_heads, p.head_dim) for p in b.g_pieces),
                          h_pieces=tuple(FactorPiece(alias.get(p.param, p.param), p.kind, p.offset, p.num_heads, p.head_dim) for p in b.h_pieces),
                          num_heads=b.num_heads, head_dim=b.head_dim, n=b.n, m=b.m, family=b.family)
        canon_b.validate(shapes)
        user.append(canon_b)

    user_masks: Dict[str, torch.Tensor] = {}
    for b in user:
        for p in b.pieces:
            mk = p.mask(params[p.param])
            user_masks[p.param] = user_masks[p.param] | mk if p.param in user_masks else mk
    kept = []
    for b in det.blocks:
        if _overlaps(b.pieces, user_masks, params):
            notes.append(f"detected block {b.name} replaced by user-declared blocks")
        else:
            kept.append(b)
    unsupported = []
    for u in det.unsupported:
        prefix = u.module + "." if u.module else ""
        if any(p.param.startswith(prefix) for b in user for p in b.pieces):
            notes.append(f"unsupported module {u.module} [{u.cls}] covered by user-declared blocks")
        else:
            unsupported.append(u)

    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    kind_order = {"qk": 0, "vo": 1}
    all_blocks = sorted(kept + user, key=lambda b: (order.get(b.module, len(order)), kind_order.get(b.kind, 2)))
    names = [b.name for b in all_blocks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate block names {dup}: pass name= to declare_block")
    frozen_set = set(frozen)
    final = []
    for b in all_blocks:
        fz = [p for p in b.params if p in frozen_set]
        if fz:
            notes.append(f"block {b.name} dropped: it touches frozen parameter(s) {', '.join(fz)}")
        else:
            final.append(b)

    gl_masks: Dict[str, torch.Tensor] = {}
    owner: Dict[str, List[str]] = {}
    for b in final:
        for p in b.pieces:
            mk = p.mask(params[p.param])
            if p.param in gl_masks:
                if bool((gl_masks[p.param] & mk).any()):
                    raise ValueError(f"blocks {owner[p.param]} and {b.name} overlap on parameter {p.param!r}")
                gl_masks[p.param] = gl_masks[p.param] | mk
            else:
                gl_masks[p.param] = mk
            owner.setdefault(p.param, []).append(b.name)

    if unsupported and not allow_unsupported:
        lines = [f"layout(): {len(unsupported)} attention-like module(s) of {type(model).__name__} cannot be "
                 "mapped to GL blocks:"]
        lines += [f"  - {u.module} [{u.cls}]: {u.reason}" for u in unsupported]
        lines.append(
            "To proceed, either declare their blocks by hand and check them, e.g.\n"
            "    blocks = [adapters.declare_block(model, q='<path>.q_proj', k='<path>.k_proj', num_heads=H),\n"
            "              adapters.declare_block(model, v='<path>.v_proj', o='<path>.o_proj', num_heads=H)]\n"
            "    lay = adapters.layout(model, blocks=blocks); lay.verify(model, example_inputs)\n"
            "or pass allow_unsupported=True to treat their parameters adaptively (elementwise)."
        )
        raise ValueError("\n".join(lines))
    if not final and not allow_unsupported:
        seen = [f"  - {p} [{c}]: {f}" for p, c, f in det.seen]
        dropped = [n for n in notes if "dropped" in n]
        msg = [f"layout(): no GL block found in {type(model).__name__}."]
        msg += (["Attention-like modules seen:"] + seen) if seen else ["No attention-like module was seen."]
        msg += dropped
        msg.append("Declare blocks with blocks=[adapters.declare_block(model, ...)], or pass "
                   "allow_unsupported=True for a purely adaptive layout.")
        raise ValueError("\n".join(msg))

    adaptive = [n for n in params if n not in frozen_set and (n not in gl_masks or not bool(gl_masks[n].all()))]
    return Layout(blocks=final, adaptive=adaptive, gl_masks=gl_masks, frozen=frozen, unsupported=unsupported,
                  param_shapes=shapes, model_name=type(model).__name__, notes=notes)
