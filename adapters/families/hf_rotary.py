r"""``hf-rotary``: Hugging Face decoder attention with rotary positions (RoPE), grouped-query
attention and, for some classes, QK-norm.

Matched by an allowlist of transformers classes whose ``forward`` has been read (transformers 5.x):
the module must run that class's own ``forward`` (a subclass overriding it falls through to the
generic families).  All of them rotate with HF ``rotate_half``: coordinates ``(i, i + r/2)`` of the
first ``r`` (``rotary_dim``) coordinates of each head turn together, so the Q/K block gets
``RotaryGroup("half", r)`` = GL(1, ℂ)^{r/2} × GL(h − r) and the V/O block the full GL(h).

================== ============================== ================ ==================================
class              projections                    rotary_dim       QK-norm
================== ============================== ================ ==================================
LlamaAttention     q_proj, k_proj, v_proj, o_proj config (*)       no
MistralAttention   same                           config           no
Qwen2Attention     same (q/k/v biases)            config           no
Qwen3Attention     same                           config           q_norm, k_norm (RMSNorm per head)
GemmaAttention     same                           config           no
Gemma2Attention    same (+ logit soft-capping)    config           no
Gemma3Attention    same                           config           q_norm, k_norm
PhiAttention       q_proj, k_proj, v_proj, dense  ``rotary_ndims`` q_layernorm, k_layernorm if
                                                                   ``config.qk_layernorm``
Phi3Attention      packed qkv_proj = [q | k | v]  config           no
GPTNeoXAttention   query_key_value, per head      ``rotary_ndims`` no
                   [q_i k_i v_i] (stride 3h),
                   dense
================== ============================== ================ ==================================

(*) ``head_dim × rope_parameters["partial_rotary_factor"]`` (the entry of the layer's
``layer_type`` when the parameters are given per layer type), ``head_dim`` when absent.

Soft-capping ``tanh(s/c)·c`` (Gemma 2), sliding windows and masks act on the scores
``g(x G R Hᵀ y)`` and keep every symmetry; the attention interface (eager, sdpa, flash, flex) only
changes how the same scores are computed (sdpa's ``enable_gqa`` = ``repeat_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from torch import nn

from quotient_manifolds.core.groups import FULL_GL, Group, RotaryGroup

from ._base import Context, Family, Match
from .structure import Heads, attention_blocks, forward_owner, int_attr, projection, screen_module

QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "qk_norm")


@dataclass(frozen=True)
class RotaryClass:
    """How one verified class lays out its projections and rotary encoding.

    ``projections``: ``"separate"`` (``q_proj``, ``k_proj``, ``v_proj``), ``"packed"`` (``qkv_proj``
    rows ``[q | k | v]``, Phi-3) or ``"neox"`` (``query_key_value`` rows ``[q_i k_i v_i]`` per head).
    ``out``: name of the output projection.  ``rotary_dim_attr``: attribute holding the number of
    rotated coordinates per head (else read from the config).  ``pairing``: which coordinates turn
    together (see ``RotaryGroup``)."""

    projections: str = "separate"
    out: str = "o_proj"
    rotary_dim_attr: Optional[str] = None
    pairing: str = "half"

    @property
    def projection_names(self) -> Tuple[str, ...]:
        """Child names of the input projections, then the output projection."""
        inputs = {"separate": ("q_proj", "k_proj", "v_proj"), "packed": ("qkv_proj",),
                  "neox": ("query_key_value",)}[self.projections]
        return inputs + (self.out,)


ROTARY_CLASSES: Mapping[str, RotaryClass] = {
    "LlamaAttention": RotaryClass(),
    "MistralAttention": RotaryClass(),
    "Qwen2Attention": RotaryClass(),
    "Qwen3Attention": RotaryClass(),
    "GemmaAttention": RotaryClass(),
    "Gemma2Attention": RotaryClass(),
    "Gemma3Attention": RotaryClass(),
    "PhiAttention": RotaryClass(out="dense", rotary_dim_attr="rotary_ndims"),
    "Phi3Attention": RotaryClass(projections="packed"),
    "GPTNeoXAttention": RotaryClass(projections="neox", out="dense", rotary_dim_attr="rotary_ndims"),
}


def config_rotary_dim(mod: nn.Module, head_dim: int) -> int:
    """The rotary dimension ``r = head_dim * partial_rotary_factor`` of a module's HF config (the
    module's layer type's ``rope_parameters`` first, then the config's; no factor: ``r = head_dim``)."""
    cfg = getattr(mod, "config", None)
    params = getattr(cfg, "rope_parameters", None)
    params = params if isinstance(params, Mapping) else {}
    per_layer = params.get(getattr(mod, "layer_type", None))
    if isinstance(per_layer, Mapping):
        params = per_layer
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    return int(head_dim * (1.0 if factor is None else float(factor)))


def rotary_group(pairing: str, rotary_dim: int, head_dim: int) -> Group:
    """The commutant of the rotations: full GL when nothing turns, else ``RotaryGroup``."""
    if rotary_dim == 0:
        return FULL_GL
    return RotaryGroup(pairing, None if rotary_dim == head_dim else rotary_dim)


def qk_norm_note(path: str, norms: Sequence[nn.Module], names: Sequence[str]) -> str:
    shift = " (and, for LayerNorm, a shift along the all-ones direction)" if any(
        isinstance(n, nn.LayerNorm) for n in norms) else ""
    return (f"{path}: Q/K weights treated elementwise (adaptive): QK-norm ({', '.join(names)}) normalises each "
            f"head's query and key separately, which leaves at most a positive scale per head of q and of k{shift}, "
            "no GL gauge shared by the pair")


class HFRotaryAttention(Family):
    name = "hf-rotary"

    def match(self, ctx: Context, path: str, mod: nn.Module) -> Optional[Match]:
        owner = forward_owner(mod)
        spec = ROTARY_CLASSES.get(owner.__name__)
        if spec is None or not owner.__module__.startswith("transformers."):
            return None
        res = Match(path, self.name, type(mod).__name__)
        cfg = getattr(mod, "config", None)
        h = int_attr(mod, ("head_dim", "head_size"))
        n_q = int_attr(cfg, ("num_attention_heads",))
        n_kv = int_attr(cfg, ("num_key_value_heads",)) or n_q
        lins = {n: projection(f"{path}.{n}", getattr(mod, n, None)) for n in spec.projection_names}
        missing = [n for n, lin in lins.items() if lin is None]
        if missing or h is None or n_q is None:
            return res.reject(f"{owner.__name__} without the expected structure (projections {', '.join(lins)}, "
                              f"head_dim, config.num_attention_heads); missing: {', '.join(missing) or 'head counts'}")
        if n_q % n_kv or getattr(mod, "num_key_value_groups", n_q // n_kv) != n_q // n_kv:
            return res.reject(f"{n_q} query heads do not split into groups over {n_kv} key/value heads "
                              f"(num_key_value_groups={getattr(mod, 'num_key_value_groups', None)})")
        o = lins[spec.out]
        if spec.projections == "separate":
            q, k, v = (Heads(lins[n]) for n in ("q_proj", "k_proj", "v_proj"))
            widths = {"q_proj": (q.lin.out_features, n_q * h), "k_proj": (k.lin.out_features, n_kv * h),
                      "v_proj": (v.lin.out_features, n_kv * h)}
        elif spec.projections == "packed":
            qkv = lins["qkv_proj"]
            q, k, v = Heads(qkv, 0), Heads(qkv, n_q * h), Heads(qkv, (n_q + n_kv) * h)
            widths = {"qkv_proj": (qkv.out_features, (n_q + 2 * n_kv) * h)}
        else:
            qkv = lins["query_key_value"]
            q, k, v = Heads(qkv, 0, 3 * h), Heads(qkv, h, 3 * h), Heads(qkv, 2 * h, 3 * h)
            widths = {"query_key_value": (qkv.out_features, 3 * n_q * h)}
            if n_kv != n_q:
                return res.reject("GPT-NeoX packs one key/value head per query head; num_key_value_heads differs")
        widths[spec.out] = (o.in_features, n_q * h)
        wrong = [f"{n} has {got} features, expected {want}" for n, (got, want) in widths.items() if got != want]
        norms = [n for n in QK_NORM_NAMES if isinstance(getattr(mod, n, None), nn.Module)]
        core = set().union(*(lin.param_ids() for lin in lins.values()),
                           *({id(p) for p in getattr(mod, n).parameters()} for n in norms))
        reasons = wrong + screen_module(mod, core, source_scan=False, known=norms, positions=False).module
        if reasons:
            return res.reject("; ".join(reasons))

        r = int(getattr(mod, spec.rotary_dim_attr)) if spec.rotary_dim_attr else config_rotary_dim(mod, h)
        qk = not norms
        group: Group = FULL_GL
        if norms:
            res.notes.append(qk_norm_note(path, [getattr(mod, n) for n in norms], norms))
        elif r % 2 or not 0 <= r <= h:
            qk = False
            res.reject(f"rotary dimension {r} is not an even number in [0, head_dim={h}]", part="qk")
        else:
            group = rotary_group(spec.pairing, r, h)
        attention_blocks(ctx, res, q=q, k=k, v=v, o=o, num_heads=n_q, num_kv_heads=n_kv, head_dim=h,
                         qk_group=group, qk=qk)
        return res
