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

from typing import Optional

from torch import nn

from ._base import Context, Family, Match
from .structure import children_by_role, linear_children, plain_attention_match


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
