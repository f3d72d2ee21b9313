r"""``latent``: multi-head latent attention (DeepSeek-V2/V3 style), found by structure.

The queries come from ``q_proj``, or from a low-rank pair ``q_a_proj`` → norm → ``q_b_proj``; keys
and values from a shared latent: ``kv_a_proj_with_mqa`` gives ``kv_lora_rank`` latent features (then
a norm) and ``qk_rope_head_dim`` features of one rotary key shared by all heads; ``kv_b_proj``
expands the normalised latent per head into the no-rope key part and the value
(``[k_nope_i v_i]``, ``qk_nope_head_dim + v_head_dim`` rows per head); each query head is
``[q_nope_i q_rope_i]`` (``qk_nope_head_dim + qk_rope_head_dim`` rows of ``q_b_proj``).  With
``c_q`` and ``c_kv`` the normalised latents, head i's score is

    q_nope_i k_nope_iᵀ + R(q_rope_i) R(k_rope)ᵀ,   q_nope_i = c_q G_i,  k_nope_i = c_kv H_i,

so three groups keep the module (the norms act on the latents, before any factor below):

* ``qk``: GL(qk_nope_head_dim) per head on ``(G_i, H_i)`` = (``q_b_proj``'s no-rope rows of head
  i, ``kv_b_proj``'s key rows of head i): the no-rope scores see only ``G_i H_iᵀ``;
* ``qk_rope``: the rotary commutant on ``qk_rope_head_dim``, one gauge for all heads: the rotary key
  is shared, so one A acts on every head's rotary query rows (stacked under ``G``, as grouped-query
  attention with one key/value head) and on the key rows of ``kv_a_proj_with_mqa`` (``H``); the
  pairing is probed (:mod:`~quotient_manifolds.adapters.families.rotary_probe`);
* ``vo``: GL(v_head_dim) per head on (``kv_b_proj``'s value rows of head i, ``o_proj``'s columns of
  head i).

Sizes come from the module's attributes, else its config (``num_heads`` / ``num_attention_heads``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``kv_lora_rank``, ``q_lora_rank``);
every projection's width must match them.  Norms on the latents (``q_a_layernorm``,
``kv_a_layernorm``: vectors of the latent width) are not extra parameters; anything else is.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

from torch import nn

from quotient_manifolds.core.groups import FULL_GL

from ._base import Context, Family, Match
from .hf_rotary import config_rotary_dim, rotary_group
from .rotary_probe import probe_rotary
from .structure import (ROLE_NAMES, Heads, Projection, add_block, in_projection_pieces, int_attr, linear_children,
                        out_projection_pieces, screen_module)

#: child names of the projections, by role (the first present wins)
LATENT_NAMES: Dict[str, Tuple[str, ...]] = {
    "q": ("q_proj",), "q_a": ("q_a_proj",), "q_b": ("q_b_proj",),
    "kv_a": ("kv_a_proj_with_mqa", "kv_a_proj"), "kv_b": ("kv_b_proj",), "o": ROLE_NAMES["o"],
}
SIZE_ATTRS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
_NORM_CLASS = re.compile(r"norm", re.I)


def _sizes(mod: nn.Module) -> Optional[Dict[str, int]]:
    """Heads and the sizes of :data:`SIZE_ATTRS` from the module, then its config; None if any is missing."""
    cfg = getattr(mod, "config", None)
    out = {"heads": int_attr(mod, ("num_heads", "num_attention_heads")) or int_attr(cfg, ("num_attention_heads",))}
    for a in SIZE_ATTRS:
        out[a] = int_attr(mod, (a,)) or int_attr(cfg, (a,))
    return None if any(v is None for v in out.values()) else out


def _child(children: Dict[str, Projection], role: str) -> Optional[Projection]:
    return next((children[n] for n in LATENT_NAMES[role] if n in children), None)


def _latent_norms(mod: nn.Module, widths: Tuple[int, ...]) -> List[str]:
    """Direct children that are norms (class name) whose parameters are vectors of a latent width."""
    return [n for n, sub in mod.named_children()
            if _NORM_CLASS.search(type(sub).__name__) and list(sub.parameters())
            and all(p.dim() == 1 and p.shape[0] in widths for p in sub.parameters())]


class LatentAttention(Family):
    name = "latent"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        children = linear_children(path, mod)
        kv_a, kv_b, o = _child(children, "kv_a"), _child(children, "kv_b"), _child(children, "o")
        q = _child(children, "q_b") or _child(children, "q")
        if kv_a is None or kv_b is None or o is None or q is None:
            return None
        res = Match(path, self.name, type(mod).__name__)
        sizes = _sizes(mod)
        if sizes is None:
            return res.reject(f"latent attention (kv_a/kv_b projections) without the sizes "
                              f"{', '.join(('num_heads',) + SIZE_ATTRS)} as attributes or in its config")
        n, nope, rope, v, rank = (sizes[k] for k in ("heads",) + SIZE_ATTRS)
        widths = {q.path: (q.out_features, n * (nope + rope)), kv_a.path: (kv_a.out_features, rank + rope),
                  kv_b.path: ((kv_b.in_features, kv_b.out_features), (rank, n * (nope + v))),
                  o.path: (o.in_features, n * v)}
        wrong = [f"{p.rsplit('.', 1)[-1]} has {got} features, expected {want}" for p, (got, want) in widths.items()
                 if got != want]
        q_a = _child(children, "q_a")
        latent = (rank,) + ((q_a.out_features,) if q_a is not None else ())
        norms = _latent_norms(mod, latent)
        core = set().union(*(p.param_ids() for p in children.values()),
                           *({id(p) for p in getattr(mod, nm).parameters()} for nm in norms))
        reasons = wrong + screen_module(mod, core, source_scan=False, known=norms, positions=False,
                                        stream_width=o.out_features).module
        if reasons:
            return res.reject("; ".join(reasons))
        if any(p.adapted for p in (q, kv_a, kv_b, o)):
            return None                                                         # LoRA: the nested family's blocks

        stride_q, stride_kv = nope + rope, nope + v
        latent_note = f"; latent norms {', '.join(norms)} act before every factor" if norms else ""
        add_block(res, "qk", in_projection_pieces(ctx, Heads(q, 0, stride_q), n, nope),
                  in_projection_pieces(ctx, Heads(kv_b, 0, stride_kv), n, nope), ctx.shapes, FULL_GL,
                  group_source=f"structure: latent attention, no-rope query and key rows of each head: "
                               f"full GL{latent_note}")
        probed = probe_rotary(ctx.model, mod, rope)
        if probed is not None:
            pairing, r, fn = probed
            source = f"probed {fn}: rotary_dim={r} {pairing}"
        else:
            pairing, r = ("interleaved" if getattr(getattr(mod, "config", None), "rope_interleave", False) is True
                          else "half"), config_rotary_dim(mod, rope)
            source = f"config: rotary_dim={r} {pairing}"
        if r % 2 or not 0 <= r <= rope:
            res.reject(f"rotary dimension {r} is not an even number in [0, qk_rope_head_dim={rope}]", part="qk_rope")
        else:
            add_block(res, "qk_rope", in_projection_pieces(ctx, Heads(q, nope, stride_q), n, rope, group_size=n),
                      in_projection_pieces(ctx, Heads(kv_a, rank), 1, rope), ctx.shapes,
                      rotary_group(pairing, r, rope),
                      group_source=f"{source}; one rotary key shared by all heads: one gauge for all")
        add_block(res, "vo", in_projection_pieces(ctx, Heads(kv_b, nope, stride_kv), n, v),
                  out_projection_pieces(ctx, o, n, v), ctx.shapes, FULL_GL,
                  group_source=f"structure: latent attention, value rows of each head and its output columns: "
                               f"full GL{latent_note}")
        return res
