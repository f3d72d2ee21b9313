r"""``structural``: attention proposed from structure and configuration, whatever its class.

A module is proposed when its head count is known (an attribute such as ``num_heads``, else its
``config.num_attention_heads``) and it has either

* one packed input projection (a child named like ``query_key_value``, ``Wqkv``, ``qkv_proj`` or an
  ``nn.Linear`` ``c_attn``) and an output projection taking ``num_heads * head_dim`` features, or
* separate q/k/v/o projections and position or grouped-query evidence that the plain ``qkvo``
  family does not model (``forward`` takes ``position_embeddings`` or ``alibi``; k/v narrower than q).

Which rows of a packed projection belong to which head is read from the module's attributes and a
table of packing hints (:data:`PACKING_HINTS`), never from its ``forward``:

================== ================================ =========================================
packing            rows                             evidence
================== ================================ =========================================
``stacked``        ``[q | k | v]`` (k, v with       ``Wqkv``, ``qkv_proj``; ``multi_query``
                   ``num_kv_heads`` heads)          (one key/value head: Falcon, GPTBigCode)
``per_head``       ``[q_i k_i v_i]`` per head       ``query_key_value`` (Bloom, Falcon,
                                                    GPT-NeoX), ``nn.Linear`` ``c_attn``
                                                    (GPTBigCode without multi-query)
``per_group``      ``[q … q k v]`` per key/value    ``new_decoder_architecture`` (Falcon)
                   group
================== ================================ =========================================

The candidate group of each half comes from configuration evidence (``GLBlock.group_source`` says
which): V/O always full GL(h); Q/K full GL(h) without positions or with ALiBi or another bias added
to the scores (``forward`` takes ``alibi`` or ``position_bias``, as MPT: it depends on neither q nor
k; see ``position_terms``) or in a NoPE layer (a per-layer switch of :data:`ROPE_SWITCHES`, such as
``use_rope`` = 0, turns its rotary map off); the rotary commutant ``RotaryGroup`` when ``forward``
takes ``position_embeddings``, with the pairing (half, interleaved) and ``rotary_dim`` read by
running the module's rotary function (:mod:`~quotient_manifolds.adapters.families.rotary_probe`);
only where that cannot run, from the configuration (``partial_rotary_factor`` / ``rotary_pct`` /
``rotary_ndims``; ``rotate_half`` pairing, interleaved when the class's module defines GPT-J's
``rotate_every_two``).  Attention sinks (one learned logit per head appended to the scores,
:func:`~quotient_manifolds.adapters.families.positions.attention_sinks`) change no group.  Q/K
with q/k normalisation (``q_norm``, ``k_norm``, ``qk_norm``) has a smaller group: a weightless
norm that commutes with rotations (probed, :mod:`~quotient_manifolds.adapters.families.qk_norm`:
Llama 4) keeps the orthogonal part of the group above, a rotation per frequency pair; a norm with
a learned gain is proposed with the group it would have without the normalisation as a candidate,
which fails verification, and its true group is derived when the layout is accepted on inputs
(:func:`quotient_manifolds.adapters.accept.accept_layout`, automatic in ``sharpness`` and the other
geodesic entry points).  ``clip_qkv`` (module attribute or config) refuses the module; norms on the
model-width stream are not extra parameters.  Every proposed block is a candidate: ``Layout.verify`` checks it on the model.
"""

from __future__ import annotations

import sys
from typing import Dict, Mapping, Optional, Sequence, Tuple

from torch import nn

from quotient_manifolds.core.groups import FULL_GL, Group

from ._base import Context, Family, Match
from .positions import attention_sinks, position_terms, sink_note
from .structure import (ROLE_NAMES, Heads, Projection, add_block, forward_args, in_projection_pieces, int_attr,
                        linear_children, out_projection_pieces, screen_module)
from .hf_rotary import QK_NORM_NAMES, config_rotary_dim, rotary_group
from .qk_norm import normalised_rotary_group, probe_weightless_norm
from .rotary_probe import probe_rotary

#: Packing of a packed projection by child name (module attributes ``new_decoder_architecture`` and
#: ``multi_query`` override it, see the module docstring).
PACKING_HINTS: Mapping[str, str] = {"query_key_value": "per_head", "c_attn": "per_head", "Wqkv": "stacked",
                                    "qkv_proj": "stacked", "qkv": "stacked", "in_proj": "stacked"}
#: Module attributes that switch one layer's rotary map on or off (NoPE layers: SmolLM3 and Llama 4
#: set ``use_rope`` per layer from ``config.no_rope_layers``): name -> the value that means "rotary
#: on".  A layer with its rotary map off has plain scores: full GL on Q/K.  Add a model's own switch
#: here; ``Layout.verify`` checks the group it gives.
ROPE_SWITCHES: Dict[str, bool] = {"use_rope": True}
OUT_NAMES: Tuple[str, ...] = ROLE_NAMES["o"] + ("Wo",)
KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "num_kv")


def _config(mod: nn.Module):
    return getattr(mod, "config", None)


def head_counts(mod: nn.Module) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """Query heads, key/value heads and head dim from the module, then its config."""
    cfg = _config(mod)
    n_q = int_attr(mod, ("num_heads", "num_attention_heads", "n_head", "n_heads")) or int_attr(
        cfg, ("num_attention_heads", "n_head"))
    if n_q is None:
        return None, None, None
    if getattr(mod, "multi_query", False) is True and getattr(mod, "new_decoder_architecture", False) is not True:
        n_kv = 1                                       # Falcon keeps multi_query=True beside the new layout
    else:
        n_kv = int_attr(mod, KV_HEADS_ATTRS) or int_attr(cfg, KV_HEADS_ATTRS) or n_q
    h = int_attr(mod, ("head_dim", "head_size"))
    if h is None:
        hidden = int_attr(cfg, ("hidden_size", "n_embd"))
        h = hidden // n_q if hidden and hidden % n_q == 0 else None
    return n_q, n_kv, h


def _rope_switched_off(mod: nn.Module) -> str:
    """``"<attribute>=<value>"`` when an attribute of :data:`ROPE_SWITCHES` (a bool, or an int 0/1)
    says the module's rotary map is off, else ``""``."""
    for name, on in ROPE_SWITCHES.items():
        v = getattr(mod, name, None)
        if (isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))) and bool(v) != on:
            return f"{name}={v!r}"
    return ""


def candidate_qk_group(mod: nn.Module, h: int, bias_source: str = "", model: Optional[nn.Module] = None
                       ) -> Tuple[Optional[Group], str]:
    """Candidate Q/K group and how it was found (None: no candidate, the string says why);
    ``bias_source``: the evidence of a bias added to the scores (:func:`position_terms`), if any.
    The rotary pairing and dimension are read by running the module's rotary function
    (:func:`~quotient_manifolds.adapters.families.rotary_probe.probe_rotary`, with ``model``'s rotary
    embedding), and from the configuration only where that cannot run."""
    cfg = _config(mod)
    args = forward_args(mod)
    if getattr(cfg, "alibi", False) is True or ("alibi" in args and "position_embeddings" not in args):
        return FULL_GL, "config: ALiBi bias added to the scores (depends on neither q nor k): full GL"
    switch = _rope_switched_off(mod)
    if switch:
        return FULL_GL, f"structure: {switch}: a NoPE layer (its rotary map is switched off), plain scores: full GL"
    rotary_attr = int_attr(mod, ("rotary_ndims", "rotary_dim"))
    if "position_embeddings" not in args and rotary_attr is None:
        return FULL_GL, bias_source or "structure: plain attention (no position inputs)"
    probed = probe_rotary(model, mod, h)
    if probed is not None:
        pairing, r, fn = probed
        return rotary_group(pairing, r, h), f"probed {fn}: rotary_dim={r} {pairing}"
    if rotary_attr is not None:
        r = rotary_attr
    elif getattr(cfg, "rotary_pct", None) is not None:
        r = int(h * float(cfg.rotary_pct))
    else:
        r = config_rotary_dim(mod, h)
    pairing = "interleaved" if hasattr(sys.modules.get(type(mod).__module__), "rotate_every_two") else "half"
    if r % 2 or not 0 <= r <= h:
        return None, f"rotary dimension {r} is not an even number in [0, head_dim={h}]"
    return rotary_group(pairing, r, h), f"config: rotary_dim={r} {pairing}"


def _normalised_qk_group(mod: nn.Module, norms: Sequence[str], group: Group, source: str, h: int
                         ) -> Tuple[Group, str]:
    """The Q/K group under the q/k norms ``norms`` of ``mod``, from ``group``, the one without them:
    weightless norms that commute with rotations (probed, :mod:`.qk_norm`) keep the orthogonal
    part of ``group``; otherwise ``group`` stays as a candidate, which fails verification, and the
    true group is derived when the layout is accepted on inputs."""
    kinds = [probe_weightless_norm(getattr(mod, n), h) for n in norms]
    smaller = None if None in kinds else normalised_rotary_group(group, h, scalars=all(kinds))
    names = ", ".join(norms)
    if smaller is None:
        return group, (f"q/k normalisation ({names}): candidate {group.describe(h)} ({source}); the true group "
                       "is smaller and is derived when the layout is accepted on inputs")
    eps = "ε = 0: the scale is kept" if all(kinds) else "its ε forbids the scale"
    return smaller, (f"weightless q/k norm ({names}, probed: commutes with rotations; {eps}): {group.describe(h)} "
                     f"({source}) intersected with the orthogonal group")


def _packed(lin: Projection, packing: str, n_q: int, n_kv: int, h: int):
    """q, k, v projections (lists of per-key/value-head :class:`Heads` for q under ``per_group``)."""
    if packing == "stacked":
        return [Heads(lin, 0)], Heads(lin, n_q * h), Heads(lin, (n_q + n_kv) * h), (n_q + 2 * n_kv) * h
    if packing == "per_head":
        return [Heads(lin, 0, 3 * h)], Heads(lin, h, 3 * h), Heads(lin, 2 * h, 3 * h), 3 * n_q * h
    rep = n_q // n_kv       # per_group: [q_1 … q_rep k v] per key/value head
    stride = (rep + 2) * h
    return ([Heads(lin, j * h, stride) for j in range(rep)], Heads(lin, rep * h, stride),
            Heads(lin, (rep + 1) * h, stride), n_kv * stride)


class StructuralAttention(Family):
    name = "structural"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        children = linear_children(path, mod)
        packed = [n for n in children if n in PACKING_HINTS
                  and not (n == "c_attn" and children[n].transposed)]          # GPT-2's Conv1D: hf-gpt2
        roles = {r: [n for n in children if n in (OUT_NAMES if r == "o" else ROLE_NAMES[r])] for r in "qkvo"}
        args = forward_args(mod)
        n_q, n_kv, h = head_counts(mod)
        if n_q is None or h is None or len(roles["o"]) != 1:
            return None
        separate = all(len(roles[r]) == 1 for r in "qkv")
        if len(packed) == 1 and not separate:
            lin = children[packed[0]]
            if getattr(mod, "new_decoder_architecture", False) is True:
                packing = "per_group"
            elif getattr(mod, "multi_query", False) is True:
                packing = "stacked"
            else:
                packing = PACKING_HINTS[packed[0]]
        elif separate and not packed:
            lins = {r: children[roles[r][0]] for r in "qkv"}
            evidence = ({"position_embeddings", "alibi"} & args or lins["k"].out_features != lins["q"].out_features
                        or int_attr(mod, ("rotary_dim", "rotary_ndims")) is not None)
            if not evidence:
                return None                                                     # the plain qkvo family's
            packing = "separate"
        else:
            return None
        res = Match(path, self.name, type(mod).__name__)
        o = children[roles["o"][0]]
        if n_q % n_kv:
            return res.reject(f"{n_q} query heads cannot share {n_kv} key/value heads evenly")
        rep = n_q // n_kv
        if packing == "separate":
            qs, k, v = [Heads(lins["q"])], Heads(lins["k"]), Heads(lins["v"])
            widths = {roles[r][0]: (lins[r].out_features, (n_q if r == "q" else n_kv) * h) for r in "qkv"}
            proj_ids = set().union(*(lin.param_ids() for lin in lins.values()))
        else:
            qs, k, v, width = _packed(lin, packing, n_q, n_kv, h)
            widths = {packed[0]: (lin.out_features, width)}
            proj_ids = lin.param_ids()
        widths[roles["o"][0]] = (o.in_features, n_q * h)
        wrong = [f"{n} has {got} features, expected {want} for {n_q} query / {n_kv} key-value heads of size {h} "
                 f"({packing} packing)" for n, (got, want) in widths.items() if got != want]
        norms = [n for n in QK_NORM_NAMES if isinstance(getattr(mod, n, None), nn.Module)]
        terms = position_terms(path, mod, n_q, n_q * h)
        sinks, sink_ids = attention_sinks(mod, n_q)
        core = (proj_ids | o.param_ids() | {id(p) for n in norms for p in getattr(mod, n).parameters()} | terms.known
                | sink_ids)
        reasons = wrong + screen_module(mod, core, source_scan=False, known=norms, positions=False,
                                  stream_width=o.out_features).module
        clip = [f"{where}clip_qkv={v}" for where, v in (("", getattr(mod, "clip_qkv", None)),
                                                         ("config.", getattr(_config(mod), "clip_qkv", None)))
                if v is not None and v is not False]
        if clip:
            reasons.append(f"{clip[0]}: clipping q/k/v breaks every GL symmetry")
        if reasons:
            return res.reject("; ".join(reasons))
        if any(p.lin.adapted for p in qs + [k, v]) or o.adapted:
            return None                                                         # LoRA: the nested family's blocks

        if terms.reject or terms.q_pairs or terms.k_pairs:
            group, source = None, terms.reject or "positional projections beside packed or grouped projections: " \
                "not modelled, declare the blocks"
        else:
            group, source = candidate_qk_group(mod, h, terms.source, ctx.model)
        if norms and group is not None:
            group, source = _normalised_qk_group(mod, norms, group, source, h)
        per_group = len(qs) > 1        # query heads of one key/value group are separate pieces
        q_pieces = [pc for q in qs for pc in in_projection_pieces(ctx, q, n_kv if per_group else n_q, h,
                                                         1 if per_group else rep)]
        if group is None:
            res.reject(source, part="qk")
        else:
            add_block(res, "qk", q_pieces, in_projection_pieces(ctx, k, n_kv, h), ctx.shapes, group,
                      group_source=sink_note(source, sinks))
        o_pieces = ([pc for j in range(rep) for pc in out_projection_pieces(ctx, Heads(o, j * h, rep * h), n_kv, h)]
                    if per_group else out_projection_pieces(ctx, o, n_q, h, rep))
        add_block(res, "vo", in_projection_pieces(ctx, v, n_kv, h), o_pieces, ctx.shapes, FULL_GL,
                  group_source=sink_note(f"structure: {packing} projections, V/O full GL", sinks))
        return res
