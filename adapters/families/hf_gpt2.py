"""``hf-gpt2``: ``GPT2Attention`` (HF ``Conv1D`` weights in ``(in, out)`` layout).

Self-attention: packed ``c_attn`` (columns ``[0:E]`` q, ``[E:2E]`` k, ``[2E:3E]`` v); cross-attention:
``q_attn`` for q and ``c_attn`` for k, v.  ``c_proj`` rows per head form H of VO.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ._base import Context, Family, Match
from .structure import (Heads, attention_blocks, int_attr, linear_children, num_heads_of, screen_module,
                        transformers_class)


class HFGPT2Attention(Family):
    name = "hf-gpt2"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        if transformers_class(mod, ("GPT2Attention",)) is None:
            return None
        res = Match(path, self.name, type(mod).__name__)
        children = linear_children(path, mod)
        ca, cp, qa = children.get("c_attn"), children.get("c_proj"), children.get("q_attn")
        nh, h = num_heads_of(mod), int_attr(mod, ("head_dim",))
        E = getattr(mod, "embed_dim", None)
        if ca is None or cp is None or nh is None or h is None or E != nh * h:
            return res.reject("GPT2Attention without the expected c_attn/c_proj/num_heads/head_dim structure")
        core = ca.param_ids() | cp.param_ids() | (qa.param_ids() if qa is not None else set())
        reasons = screen_module(mod, core, source_scan=False).module
        if qa is None:
            if ca.out_features != 3 * E:
                reasons.append(f"c_attn has {ca.out_features} outputs, expected 3*{E}")
            q, k, v = Heads(ca, 0), Heads(ca, E), Heads(ca, 2 * E)
        else:
            if ca.out_features != 2 * E or qa.out_features != E:
                reasons.append("cross-attention c_attn/q_attn of unexpected size")
            q, k, v = Heads(qa, 0), Heads(ca, 0), Heads(ca, E)
        if cp.in_features != E:
            reasons.append(f"c_proj takes {cp.in_features} features, expected {E}")
        if reasons:
            return res.reject("; ".join(reasons))
        attention_blocks(ctx, res, q=q, k=k, v=v, o=cp, num_heads=nh, head_dim=h)
        return res
