"""``unknown``: the last family.  Claims every module that looks like attention but that no family
above recognised, and reports it unsupported (never silently adaptive).

Looks like attention: an ``nn.MultiheadAttention``, two or more q/k/v-named projections, or a packed
``qkv``-like projection; in the second detection pass also a class name containing
"Attention"/"Attn" with own weights, unless the module contains a module claimed in the first pass
(e.g. a pooling head around an ``nn.MultiheadAttention``).
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from torch import nn

from ._base import Context, Family, Match
from .structure import PACKED_NAMES, Projection, children_by_role, linear_children


def _attention_like(mod: nn.Module, children: Dict[str, Projection], roles: Dict[str, List[str]],
                    by_name: bool) -> Optional[str]:
    if isinstance(mod, nn.MultiheadAttention):
        return "nn.MultiheadAttention"
    qkv = [n for r in "qkv" for n in roles[r]]
    if len(qkv) >= 2:
        return f"linear projections {', '.join(qkv)}"
    packed = [n for n in children if n in PACKED_NAMES]
    if packed:
        return f"packed projection {', '.join(packed)}"
    if by_name and re.search(r"attention|attn", type(mod).__name__, re.I):
        if children or any(True for _ in mod.parameters(recurse=False)):
            return f"class name {type(mod).__name__}"
    return None


class UnknownAttention(Family):
    name = "unknown"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        children = linear_children(path, mod)
        roles = children_by_role(children)
        why = _attention_like(mod, children, roles, ctx.by_name)
        if why is None:
            return None
        res = Match(path, self.name, type(mod).__name__)
        ambiguous = {r: roles[r] for r in "qkvo" if len(roles[r]) > 1}
        if ambiguous:
            return res.reject(f"ambiguous projections {ambiguous}: declare the blocks")
        if any(n in PACKED_NAMES for n in children):
            return res.reject(f"{why}: the q/k/v order inside a packed projection is implementation-specific; "
                              "declare the blocks with offsets (declare_block(..., offsets=...)) or raw FactorPieces")
        return res.reject(f"attention-like ({why}) but not a recognised q/k/v/o structure: declare the blocks")
