r"""``peft-lora``: one GL(r) block per adapter of a peft LoRA layer.

A LoRA layer computes ``base(x) + s · B A x`` (``A = lora_A[name].weight`` (r × in),
``B = lora_B[name].weight`` (out × r)); only the product ``B A`` enters, and
``(B M)(M⁻¹ A) = B A`` for every ``M`` in GL(r).  In the block convention ``f(G Hᵀ)``,
``G = B`` (``FactorPiece(B, "cols", 0, 1, r)``) and ``H = Aᵀ`` (``FactorPiece(A, "rows", 0, 1, r)``),
and ``(G M, H M⁻ᵀ)`` is exactly that action.  ``lora_B``'s optional bias is added after the
product and stays adaptive.

Recognised by structure (``base_layer`` and ModuleDicts ``lora_A``/``lora_B``; an instance of peft's
``BaseTunerLayer`` when peft is loaded), so adapters import without peft.  Nested: LoRA layers are
found inside attention modules, whose own blocks over the adapted (frozen) base weights are left
out.  Skipped with a note: LoRA on layers other than ``nn.Linear``/``Conv1D`` (embeddings,
convolutions, ``nn.MultiheadAttention``), adapters merged into the base weights, and adapters with
a LoRA variant (DoRA's magnitude vector, ...), which this family does not model.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ._base import Context, Family, Match
from .structure import (Projection, in_projection_pieces, lora_base, lora_layer, make_block, out_projection_pieces,
                        projection)


class PeftLoRA(Family):
    name = "peft-lora"
    nested = True

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        if not lora_layer(mod):
            return None
        res = Match(path, self.name, type(mod).__name__)
        base = lora_base(mod)
        if projection(path, base) is None:
            res.notes.append(f"{path}: LoRA on {type(base).__name__} is not modelled (GL(r) blocks only for LoRA "
                             "on nn.Linear / Conv1D): its adapter weights are treated elementwise (adaptive)")
            return res
        if getattr(mod, "merged", False):
            res.notes.append(f"{path}: LoRA adapters are merged into the base weights and do not enter the "
                             "forward pass: no GL(r) block")
            return res
        variants = dict(getattr(mod, "lora_variant", None) or {})
        magnitude = getattr(mod, "lora_magnitude_vector", None)
        for adapter in mod.lora_A.keys():
            A, B = mod.lora_A[adapter], mod.lora_B[adapter] if adapter in mod.lora_B else None
            why = None
            if (isinstance(magnitude, nn.ModuleDict) and adapter in magnitude) or adapter in variants:
                kind = type(variants[adapter]).__name__ if adapter in variants else "DoRA"
                why = f"uses a LoRA variant ({kind}), which the GL(r) block does not model"
            elif not (isinstance(A, nn.Linear) and isinstance(B, nn.Linear)) or B.in_features != A.out_features:
                why = "has lora_A/lora_B that are not a pair of nn.Linear of matching rank"
            elif A.out_features > min(A.in_features, B.out_features):
                why = (f"has rank {A.out_features} above its input ({A.in_features}) or output "
                       f"({B.out_features}) features, so no GL(r) quotient (factors of rank < r)")
            if why:
                res.notes.append(f"{path}: adapter {adapter!r} {why}: its factors are treated elementwise (adaptive)")
                continue
            r = A.out_features
            g = out_projection_pieces(ctx, Projection(f"{path}.lora_B.{adapter}", B, False), 1, r)
            h = in_projection_pieces(ctx, Projection(f"{path}.lora_A.{adapter}", A, False), 1, r)
            res.blocks.append(make_block(path, "lora", self.name, g, h, ctx.shapes, name=f"{path}/lora[{adapter}]"))
        return res
