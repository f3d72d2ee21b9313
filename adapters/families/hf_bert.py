"""``hf-bert``: q/k/v projections in one module, the output projection in a sibling ``output.dense``.

``BertAttention`` = ``self`` (``query``/``key``/``value``) + ``output`` (``dense``, LayerNorm): BERT,
RoBERTa, MiniLM, ELECTRA, ViT/DeiT of transformers 4.x; DeBERTa-v2's ``self`` also holds the
positional projections ``pos_query_proj`` / ``pos_key_proj``, which join the Q/K factors.  The block
module is the parent, which must hold nothing else with parameters.  Screened like ``qkvo``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ._base import Context, Family, Match
from .qkvo import plain_attention_match
from .structure import children_by_role, join_path, linear_children, projection


class HFBertSelfAttention(Family):
    name = "hf-bert"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        children = linear_children(path, mod)
        roles = children_by_role(children)
        if [len(roles[r]) for r in "qkvo"] != [1, 1, 1, 0]:
            return None
        q, k, v = (children[roles[r][0]] for r in "qkv")
        parent_path, _, own = path.rpartition(".")
        parent = ctx.modules.get(parent_path) if path else None
        out = getattr(parent, "output", None) if parent is not None else None
        dense = projection(join_path(parent_path, "output.dense"),
                           getattr(out, "dense", None) if isinstance(out, nn.Module) else None)
        if parent is None or dense is None or getattr(parent, own, None) is not mod:
            return Match(path, self.name, type(mod).__name__).reject(
                "has q/k/v projections but no output projection (neither a child o_proj/out_proj/dense/... nor "
                "a sibling output.dense): declare the VO block")
        res = Match(parent_path, self.name, type(mod).__name__)
        others = [n for n, c in parent.named_children() if c is not mod and c is not out
                  and any(True for _ in c.parameters())]
        if others:
            return res.reject(f"parent {parent_path} has other parametrised children ({', '.join(others)})")
        core = q.param_ids() | k.param_ids() | v.param_ids()
        return plain_attention_match(ctx, res, mod, q, k, v, dense, core)
