r"""``differential``: differential attention (Ye et al. 2024, Hugging Face ``DiffLlama`` layout), found
by structure.

Two softmax maps are subtracted, ``(P_j − λ P_j') V``, and each head's result is normalised before
the output projection.  In the layout of ``DiffLlama`` (transformers 5.x): query heads j and
``j' = j + n_q/2`` (each with its own key head, grouped-query as usual) form the differential pair
j < n_q/2; the value of pair j is the concatenation ``[V_a V_b]`` (2h features) of key/value heads
``a = j // rep`` and ``b = a + n_kv/2`` (``rep = n_q / n_kv``); the output of pair j,

    z_j = N((P_j − λ P_j') [V_a V_b]),

goes through a norm ``N`` without gain over its 2h features and then through columns ``j·2h …
(j+1)·2h`` of the output projection.  λ is computed from parameters of its own (``lambda_*``) and
depends on none of q, k, v.  Hence:

* Q/K: each query head's scores are those of plain (rotary, grouped-query) attention, so Q/K has
  the group it has without the differential combination (the rotary commutant per key/value head);
* V/O: one gauge per value pair ``(a, b)``: ``G = [W_v[a]ᵀ W_v[b]ᵀ]`` (two runs of h rows, n_kv/2 ·
  h apart: ``FactorPiece(parts=2)``), ``H`` the output columns of the ``rep`` pairs that read it.
  ``N(z Q) = N(z) Q`` for orthogonal Q and no other A (``rms(z A) = rms(z)`` for all z forces A
  orthogonal; the norm's ε, or the 1/c that ``H A⁻ᵀ`` keeps after a scale-invariant norm, forbids
  the scale): the group is SO(2h), an orthogonal group shared by the two differential heads.

The head pairing is this implementation's: the reference implementation's layout (adjacent heads,
values already 2h wide) is proposed the same way and fails verification; declare its blocks.  A
norm with a learned gain leaves no continuous V/O group for generic gains: refused.
"""

from __future__ import annotations

import re
from typing import List, Optional

from torch import nn

from quotient_manifolds.core.subalgebra import OrthogonalGroup

from ..blocks import FactorPiece
from ._base import Context, Family, Match
from .qk_norm import probe_weightless_norm
from .structural import head_counts, candidate_qk_group
from .structure import (Heads, add_block, children_by_role, in_projection_pieces, linear_children,
                        out_projection_pieces, screen_module)

#: names of the parameters that make the differential weight λ
LAMBDA_NAME = re.compile(r"^lambda(_|$)", re.I)


def _lambda_params(mod: nn.Module) -> List[str]:
    return [n for n, _ in mod.named_parameters(recurse=False) if LAMBDA_NAME.search(n)]


def _pair_norm(mod: nn.Module, width: int) -> Optional[str]:
    """A direct child without parameters that normalises ``width`` features and commutes with
    rotations (probed), or None."""
    for name, sub in mod.named_children():
        if not list(sub.parameters()) and probe_weightless_norm(sub, width) is not None:
            return name
    return None


class DifferentialAttention(Family):
    name = "differential"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        children = linear_children(path, mod)
        roles = children_by_role(children)
        lambdas = _lambda_params(mod)
        if [len(roles[r]) for r in "qkvo"] != [1, 1, 1, 1] or not lambdas:
            return None
        n_q, n_kv, h = head_counts(mod)
        if n_q is None or h is None:
            return None
        q, k, v, o = (children[roles[r][0]] for r in "qkvo")
        res = Match(path, self.name, type(mod).__name__)
        norm = _pair_norm(mod, 2 * h)
        if n_q % 2 or n_kv % 2 or n_q % n_kv:
            return res.reject(f"differential attention needs even head counts with num_heads a multiple of "
                              f"num_key_value_heads, got {n_q} and {n_kv}")
        widths = {"q": (q.out_features, n_q * h), "k": (k.out_features, n_kv * h), "v": (v.out_features, n_kv * h),
                  "o": (o.in_features, n_q * h)}
        wrong = [f"{r} has {got} features, expected {want}" for r, (got, want) in widths.items() if got != want]
        if norm is None:
            wrong.append(f"differential attention (parameters {', '.join(lambdas)}) without a norm of the "
                         f"{2 * h} features of a head pair that has no gain: a learned gain leaves the value "
                         "pair no continuous group")
        core = q.param_ids() | k.param_ids() | v.param_ids() | o.param_ids() | {
            id(p) for n, p in mod.named_parameters(recurse=False) if n in lambdas}
        reasons = wrong + screen_module(mod, core, source_scan=False, known=[norm] if norm else [],
                                        positions=False, stream_width=o.out_features).module
        if reasons:
            return res.reject("; ".join(reasons))
        if any(p.adapted for p in (q, k, v, o)):
            return None                                                         # LoRA: the nested family's blocks
        rep = n_q // n_kv
        group, source = candidate_qk_group(mod, h, "", ctx.model)
        if group is None:
            res.reject(source, part="qk")
        else:
            add_block(res, "qk", in_projection_pieces(ctx, q, n_q, h, rep), in_projection_pieces(ctx, k, n_kv, h),
                      ctx.shapes, group, group_source=f"{source}; differential weights ({', '.join(lambdas)}) "
                                                      "depend on none of q, k, v")
        pairs = n_kv // 2
        g = [FactorPiece(ctx.name(v.weight), "cols" if v.transposed else "rows", 0, pairs, 2 * h, stride=h,
                         parts=2, part_stride=pairs * h)]
        if v.bias is not None:
            g.append(FactorPiece(ctx.name(v.bias), "bias", 0, pairs, 2 * h, stride=h, parts=2,
                                 part_stride=pairs * h))
        add_block(res, "vo", g, out_projection_pieces(ctx, Heads(o), n_q // 2, 2 * h, rep), ctx.shapes,
                  OrthogonalGroup(), group_source=f"structure: differential attention, values of key/value heads "
                  f"a and a + {pairs} normalised together ({norm}, no gain): SO({2 * h}) per pair")
        return res
