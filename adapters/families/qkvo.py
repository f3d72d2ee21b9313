"""``qkvo``: a module with four projections playing q/k/v/o as children.

``q_proj/k_proj/v_proj/o_proj`` of HF ViT 5.x, ``q_proj/k_proj/v_proj/out_proj`` of HF CLIP, BART,
``q/k/v/o``, ``query/key/value/dense`` ... of plain PyTorch modules, with an int head-count attribute
(``num_heads``, ``num_attention_heads``, ``n_heads`` ...) or an HF ``config.num_attention_heads``.
Screened (``screen_module``): extra parameters, norms, gates or clipping make the module unsupported;
position encodings make its Q/K half unsupported and keep the V/O block, unless they are position
terms that keep GL (``position_terms``: T5's score bias, DeBERTa-v2's positional projections, which
join the Q/K factors); norms on the model-width stream (ALBERT's LayerNorm) are not extra.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from torch import nn

from ._base import Context, Family, Match
from .positions import attention_sinks, position_terms, sink_note
from .structure import (HEAD_DIM_ATTRS, HEADS_ATTRS, Projection, _verified_hf, attention_blocks, children_by_role,
                        int_attr, linear_children, num_heads_of, screen_module)


def _head_shapes(mod: nn.Module, lq: Projection, lk: Projection, lv: Projection,
                 lo: Projection) -> Tuple[Optional[int], Optional[int], List[str]]:
    """Head count, head dim and structural reasons against per-head GL blocks of a plain module."""
    reasons: List[str] = []
    nh = num_heads_of(mod)
    if nh is None:
        return None, None, [f"no head-count attribute ({', '.join(HEADS_ATTRS[:3])}, ...): declare the blocks"]
    h = int_attr(mod, HEAD_DIM_ATTRS)
    if h is None:
        if lq.out_features % nh:
            return nh, None, [f"q has {lq.out_features} features, not divisible by {nh} heads"]
        h = lq.out_features // nh
    if lq.out_features != nh * h:
        reasons.append(f"q has {lq.out_features} features, expected num_heads*head_dim = {nh}*{h}")
    if lk.out_features != lq.out_features or lv.out_features != lq.out_features:
        reasons.append(f"k/v have {lk.out_features}/{lv.out_features} features vs {lq.out_features} for q "
                       "(grouped-query / multi-query attention of an unverified class: which query heads "
                       "share a key/value head is implementation-specific; declare the blocks with "
                       "declare_block(..., num_kv_heads=...))")
    elif lo.in_features != lv.out_features:
        reasons.append(f"output projection takes {lo.in_features} features, v gives {lv.out_features}")
    return nh, h, reasons


def plain_attention_match(ctx: Context, match: Match, mod: nn.Module, q: Projection, k: Projection,
                          v: Projection, o: Projection, core: set) -> Match:
    """Blocks of a module with plain q/k/v/o projections (``qkvo`` and ``hf-bert``): the whole module
    is unsupported on structural problems; only its Q/K half when the screen sees position
    encodings that :func:`~.positions.position_terms` does not model (V/O is kept, and checked by
    ``Layout.verify`` like every block).  Norms on the model-width stream
    (:func:`~.structure.stream_norms`) and the parameters of modelled position terms are not extra
    parameters."""
    nh, h, shape_reasons = _head_shapes(mod, q, k, v, o)
    terms = position_terms(q.path.rpartition(".")[0], mod, nh, None if nh is None or h is None else nh * h)
    sinks, sink_ids = attention_sinks(mod, nh)
    screen = screen_module(mod, core | terms.known | sink_ids, source_scan=not _verified_hf(mod),
                           modelled=terms.modelled, stream_width=o.out_features)
    whole = screen.module + shape_reasons
    if whole:
        return match.reject("; ".join(whole + screen.qk + ([terms.reject] if terms.reject else [])))
    qk_reasons = screen.qk + ([terms.reject] if terms.reject else [])
    if qk_reasons:
        match.reject("; ".join(qk_reasons), part="qk")
    attention_blocks(ctx, match, q=q, k=k, v=v, o=o, num_heads=nh, head_dim=h, qk=not qk_reasons,
                     qk_source=sink_note(terms.source, sinks), vo_source=sink_note("", sinks),
                     q_pairs=terms.q_pairs, k_pairs=terms.k_pairs)
    return match


class PlainQKVO(Family):
    name = "qkvo"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        children = linear_children(path, mod)
        roles = children_by_role(children)
        if [len(roles[r]) for r in "qkvo"] != [1, 1, 1, 1]:
            return None
        q, k, v, o = (children[roles[r][0]] for r in "qkvo")
        core = q.param_ids() | k.param_ids() | v.param_ids() | o.param_ids()
        return plain_attention_match(ctx, Match(path, self.name, type(mod).__name__), mod, q, k, v, o, core)
