r"""Position terms that keep a GL symmetry of Q/K (the part of the structural screen of
:mod:`~quotient_manifolds.adapters.families.structure` that reads positions): :func:`position_terms`."""

from __future__ import annotations

from dataclasses import dataclass, field
import re
from typing import List, Mapping, Optional, Tuple

from torch import nn

from .structure import Projection, forward_args, linear_children

__all__ = ["SCORE_BIAS_ARGS", "SCORE_BIAS_FLAGS", "POSITION_PAIR_HINTS", "DISENTANGLED_TERMS", "DISENTANGLED_ARGS",
           "SINK_NAME", "PositionTerms", "attention_sinks", "sink_note", "position_terms"]



#: ``forward`` inputs that carry a bias added to the attention scores, computed from positions alone
#: (T5's ``position_bias``, Bloom's and Falcon's ``alibi``): a bias depends on neither q nor k, so
#: Q/K keeps the full GL(h).
SCORE_BIAS_ARGS: Tuple[str, ...] = ("position_bias", "alibi")

#: Boolean module attributes saying whether the module adds its own relative-position bias to the
#: scores (T5, UMT5, LongT5: from a table with one scalar per head and bucket; none when False)
SCORE_BIAS_FLAGS: Tuple[str, ...] = ("has_relative_attention_bias",)

#: Positional projections that pair with one side of the scores, by child name -> the factor they
#: join: ``"q"`` (a query-side projection of the positions, dotted with the keys: joins ``G``) or
#: ``"k"`` (a key-side projection, dotted with the queries: joins ``H``).  DeBERTa-v2/v3.
POSITION_PAIR_HINTS: Mapping[str, str] = {"pos_query_proj": "q", "pos_key_proj": "k"}

#: Disentangled score terms (module attribute ``pos_att_type``) -> the side the positions take:
#: ``c2p`` = content query · key-side positional projection, ``p2c`` = content key · query-side
#: positional projection.  With ``share_att_key`` the positions go through the content projection of
#: that side itself.
DISENTANGLED_TERMS: Mapping[str, str] = {"c2p": "k", "p2c": "q"}

#: ``forward`` inputs of a disentangled attention that carry the positions of its terms
DISENTANGLED_ARGS: Tuple[str, ...] = ("relative_pos", "rel_embeddings")

#: Names of attention-sink parameters: one learned logit per head appended to each row of scores
#: before the softmax and dropped after it (GPT-OSS, GraniteSWA, MiMo-V2 ... call it ``sinks``)
SINK_NAME = re.compile(r"(^|_)sinks?$", re.I)


def attention_sinks(mod: nn.Module, num_heads: Optional[int]) -> Tuple[List[str], set]:
    """The attention sinks of ``mod`` and the ids of their parameters: its own (not a child's)
    parameters named like :data:`SINK_NAME` with one entry per query head.

    A sink is a logit ``s_i`` appended to each row of head ``i``'s scores, ``softmax([x G Hᵀ yᵀ,
    s_i])`` with the sink's column dropped: it depends on none of q, k or v, so ``(G A, H A⁻ᵀ)``
    leaves the scores, hence the probabilities, unchanged, and the V/O action acts after them as
    without sinks: every group of the module is the one it has without its sinks (verification
    checks it on the model)."""
    if num_heads is None:
        return [], set()
    names, ids = [], set()
    for name, p in mod.named_parameters(recurse=False):
        if SINK_NAME.search(name) and tuple(p.shape) == (num_heads,):
            names.append(name)
            ids.add(id(p))
    return names, ids


def sink_note(source: str, names: List[str]) -> str:
    """A block's ``group_source`` with what it says about the sinks ``names`` appended (``source``
    itself when there are none)."""
    note = (f"attention sinks ({', '.join(names)}): a per-head logit appended to the scores depends on none of "
            "q, k, v: group unchanged") if names else ""
    return "; ".join(t for t in (source, note) if t)


@dataclass
class PositionTerms:
    """How positions enter a module's attention scores, where they keep a GL symmetry of Q/K.

    ``source``: the evidence, for ``GLBlock.group_source`` (empty: no position term modelled, the
    screen decides); ``q_pairs`` / ``k_pairs``: positional projections whose heads join ``G`` / ``H``
    of the Q/K block (the same per-head ``A`` acts on them: a taller factor); ``known``: ids of the
    parameters these terms explain (per-head bias tables, positional projections); ``modelled``:
    their submodule and ``forward`` argument names (for :func:`screen_module`); ``reject``: why Q/K has no
    candidate group although the terms were recognised."""

    source: str = ""
    q_pairs: List[Projection] = field(default_factory=list)
    k_pairs: List[Projection] = field(default_factory=list)
    known: set = field(default_factory=set)
    modelled: List[str] = field(default_factory=list)
    reject: str = ""


def position_terms(path: str, mod: nn.Module, num_heads: Optional[int], width: Optional[int]) -> PositionTerms:
    """The position terms of ``mod`` (at ``path``) that keep a GL symmetry of Q/K, from its
    attributes, children and ``forward`` arguments (never its source):

    * **disentangled** (attributes ``relative_attention`` and ``pos_att_type``): each term of
      :data:`DISENTANGLED_TERMS` dots one side's content projection with the other side's projection
      of the relative-position embeddings, head by head; ``(G A, H A⁻ᵀ)`` on ``G = [W_q; b_q;
      W_pq; b_pq]``, ``H = [W_k; b_k; W_pk; b_pk]`` keeps every term (:data:`POSITION_PAIR_HINTS`
      names the positional projections; with ``share_att_key`` they are the content ones);
    * **score bias** (a ``forward`` argument of :data:`SCORE_BIAS_ARGS` or a flag of
      :data:`SCORE_BIAS_FLAGS`): added to the scores, depends on neither q nor k; embedding tables
      with one column per head (T5's ``relative_attention_bias``: a per-head scalar per relative
      position) are the bias's own parameters.

    ``num_heads`` / ``width``: the module's head count and ``num_heads * head_dim`` (the width the
    positional projections must have)."""
    args = forward_args(mod)
    if isinstance(getattr(mod, "relative_attention", None), bool) and hasattr(mod, "pos_att_type"):
        terms = PositionTerms(modelled=[a for a in DISENTANGLED_ARGS if a in args])
        if not mod.relative_attention:
            terms.source = "config: relative_attention=False, no position term in the scores"
            return terms
        kinds = list(dict.fromkeys(mod.pos_att_type or ()))
        unknown = [t for t in kinds if t not in DISENTANGLED_TERMS]
        shared = getattr(mod, "share_att_key", False) is True
        children = linear_children(path, mod)
        pairs = {side: [n for n, s in POSITION_PAIR_HINTS.items() if s == side and n in children] for side in "qk"}
        missing, wrong = [], []
        for term in kinds:
            side = DISENTANGLED_TERMS.get(term)
            if side is None or shared:
                continue
            if not pairs[side]:
                missing.append(f"{term} needs a {side}-side positional projection "
                               f"({', '.join(n for n, s in POSITION_PAIR_HINTS.items() if s == side)})")
            for n in pairs[side]:
                lin = children[n]
                if width is not None and lin.out_features != width:
                    wrong.append(f"{n} has {lin.out_features} features, expected {width}")
                (terms.q_pairs if side == "q" else terms.k_pairs).append(lin)
                terms.known |= lin.param_ids()
                terms.modelled.append(n)
        if unknown or missing or wrong:
            terms.reject = "; ".join(
                ([f"pos_att_type has {unknown}: only {', '.join(DISENTANGLED_TERMS)} pair a content projection with "
                  "a positional one of the same head"] if unknown else []) + missing + wrong)
        joins = [f"{n} joins {'G' if side == 'q' else 'H'}" for side in "qk" for n in pairs[side]
                 if n in terms.modelled]
        shown = "the content projections themselves (share_att_key)" if shared else ", ".join(joins) or "none"
        terms.source = (f"config: disentangled attention (pos_att_type={kinds}): each position term pairs a query-side "
                        f"with a key-side projection of one head, full GL on both together; positional projections: "
                        f"{shown}")
        return terms
    bias_args = [a for a in SCORE_BIAS_ARGS if a in args]
    flag_names = [a for a in SCORE_BIAS_FLAGS if isinstance(getattr(mod, a, None), bool)]
    flags = [f"{a}={getattr(mod, a)}" for a in flag_names]
    tables = [n for n, sub in mod.named_children() if isinstance(sub, nn.Embedding)
              and num_heads is not None and sub.embedding_dim == num_heads]
    if not (bias_args or flags) or "position_embeddings" in args:
        return PositionTerms()
    terms = PositionTerms(modelled=bias_args + flag_names + tables)
    for n in tables:
        terms.known |= {id(p) for p in getattr(mod, n).parameters()}
    evidence = ", ".join(([f"forward takes {', '.join(bias_args)}"] if bias_args else []) + flags)
    per_head = f"; per-head tables {', '.join(tables)} (one scalar per head and position)" if tables else ""
    terms.source = f"structure: {evidence}: any bias added to the scores depends on neither q nor k: full GL{per_head}"
    return terms
