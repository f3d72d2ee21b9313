"""``torch-mha``: every ``torch.nn.MultiheadAttention`` (open_clip, OpenAI CLIP, ``nn.TransformerEncoder``).

Packed ``in_proj_weight`` (rows ``[0:E]`` q, ``[E:2E]`` k, ``[2E:3E]`` v) or separate
``{q,k,v}_proj_weight`` (``kdim``/``vdim`` != ``embed_dim``), ``in_proj_bias`` split the same way;
``out_proj`` columns per head form H of VO (``out_proj.bias`` stays adaptive).  ``add_bias_kv``: the
learned extra key ``bias_k`` is an extra row of H (QK) and ``bias_v`` an extra row of G (VO): the
extra token has input ``[0 .. 0 1]``, so the blocks keep the form ``g(G Hᵀ)``; ``add_zero_attn``
appends zero keys/values, which every linear action leaves at zero.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..blocks import FactorPiece
from ._base import Context, Family, Match
from .structure import add_block


class TorchMultiheadAttention(Family):
    name = "torch-mha"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        if not isinstance(mod, nn.MultiheadAttention):
            return None
        res = Match(path, self.name, type(mod).__name__)
        if type(mod).forward is not nn.MultiheadAttention.forward:
            return res.reject("subclass of nn.MultiheadAttention with its own forward(): cannot prove the GL symmetry")
        E, nh = int(mod.embed_dim), int(mod.num_heads)
        h = int(getattr(mod, "head_dim", E // nh))
        if nh * h != E:
            return res.reject(f"embed_dim {E} is not num_heads {nh} x head_dim {h}")
        if mod._qkv_same_embed_dim:
            W = mod.in_proj_weight
            qkv = [(W, 0), (W, E), (W, 2 * E)]
        else:
            qkv = [(mod.q_proj_weight, 0), (mod.k_proj_weight, 0), (mod.v_proj_weight, 0)]
        if any(w is None for w, _ in qkv) or mod.out_proj.weight is None:
            return res.reject("missing projection weights")
        g_qk, h_qk, g_vo = ([FactorPiece(ctx.name(w), "rows", off, nh, h)] for w, off in qkv)
        if mod.in_proj_bias is not None:
            for i, pieces in enumerate((g_qk, h_qk, g_vo)):
                pieces.append(FactorPiece(ctx.name(mod.in_proj_bias), "bias", i * E, nh, h))
        # add_bias_kv: the extra key/value token is, after projection, bias_k / bias_v: an input row
        # [0 ... 0 1], i.e. an extra row of H (keys) and of G (values)
        if getattr(mod, "bias_k", None) is not None:
            h_qk.append(FactorPiece(ctx.name(mod.bias_k), "bias", 0, nh, h))
        if getattr(mod, "bias_v", None) is not None:
            g_vo.append(FactorPiece(ctx.name(mod.bias_v), "bias", 0, nh, h))
        h_vo = [FactorPiece(ctx.name(mod.out_proj.weight), "cols", 0, nh, h)]
        add_block(res, "qk", g_qk, h_qk, ctx.shapes)
        add_block(res, "vo", g_vo, h_vo, ctx.shapes)
        return res
