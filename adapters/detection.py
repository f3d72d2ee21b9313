r"""Find the GL blocks of a model by module type and structure, and build its :class:`Layout`.

Detection walks the registry of model families (``adapters.families``: one file per family, user
families via ``register_family``).  Every attention module gives, per gauge, a Q/K block and a V/O
block (``GLBlock``: ``f(G Hᵀ)`` invariant under ``(G A, H A⁻ᵀ)`` for ``A`` in the block's group)::

    QK:  G = [W_qᵀ ; b_q]   H = [W_kᵀ ; b_k]        scores  x G Hᵀ yᵀ
    VO:  G = [W_vᵀ ; b_v]   H = W_o[:, head]         output  Σ_heads P (y G) Hᵀ

Families
--------
``torch-mha``   ``nn.MultiheadAttention`` (packed or separate in-projections, ``add_bias_kv``).
``peft-lora``   peft LoRA layers: one GL(r) block per adapter (nested inside attention modules).
``hf-gpt2``     ``GPT2Attention`` (``Conv1D``, packed ``c_attn``, cross-attention ``q_attn``).
``hf-rotary``   HF rotary decoders, by class allowlist: Llama, Mistral, Qwen2, Qwen3, Gemma,
                Gemma 2, Gemma 3, Phi, Phi-3 (packed ``qkv_proj``), GPT-NeoX (``query_key_value``
                interleaved per head); grouped-query attention, partial rotary, QK-norm.
``latent``      multi-head latent attention (DeepSeek-V2/V3): ``kv_a_proj_with_mqa``, ``kv_b_proj``.
``differential`` differential attention (DiffLlama): ``lambda_*`` parameters, a norm of head pairs.
``structural``  any HF attention by structure + config (packed, grouped-query, rotary probed,
                NoPE layers, sinks, QK-norm).
``qkvo``        four q/k/v/o projection children (HF ViT 5.x, CLIP, BART, plain PyTorch ...).
``hf-bert``     q/k/v children and a sibling ``output.dense`` (BERT, RoBERTa, ELECTRA, MiniLM,
                ViT/DeiT 4.x).
``unknown``     anything else that looks like attention: reported unsupported.

Groups
------
*Plain attention*: the score of head i is ``x G_i H_iᵀ yᵀ`` and ``G A (H A⁻ᵀ)ᵀ = G Hᵀ``: the
full GL(h) per head, for Q/K and for V/O.

*Rotary positions (RoPE)*: the score becomes ``x G R(θ_x − θ_y) Hᵀ yᵀ``, with ``R(θ)`` turning each
frequency pair of coordinates by its own angle.  ``G A R(θ) A⁻¹ Hᵀ = G R(θ) Hᵀ`` for all θ iff A
commutes with every ``R(θ)``.  On a pair ``(p, q)`` with frequency ω ≠ 0 the rotations span
``{a I + b J}`` (``J`` the quarter turn), whose commutant in GL(2) is ``{a I + b J}`` itself ≅ GL(1, ℂ)
(a rotation-scaling); pairs with distinct frequencies have distinct eigenvalues ``e^{±iωθ}``, so A
cannot mix them; the ``h − r`` coordinates that are not rotated (partial rotary, ``r`` =
``rotary_dim``) see ``R = I`` and may be mixed freely among themselves, but not with rotated ones.
Hence ``RotaryGroup(pairing, r)`` = GL(1, ℂ)^{r/2} × GL(h − r) on Q/K (HF ``rotate_half`` pairs
``(i, i + r/2)``); V/O is untouched by the rotation and keeps GL(h).

*Grouped-query attention*: with ``n_kv < n_q`` key/value heads, query head ``i`` reads key/value
head ``j = i // (n_q / n_kv)`` (``repeat_kv``).  The key slice ``H_j`` is shared by all query heads
of its group, so one A per key/value head must act on all of them: ``G_i A (H_j A⁻ᵀ)ᵀ = G_i H_jᵀ``
for each i in the group.  Q/K: ``G`` = the group's query slices stacked (``FactorPiece(...,
group_size=n_q/n_kv)``), ``H`` = the key slice; V/O: ``G`` = the value slice, ``H`` = the group's
output-projection slices stacked.  One gauge per key/value head, ``num_heads = n_kv``.

*QK-norm* (Qwen3, Gemma 3, Phi with ``qk_layernorm``): the score becomes ``N_q(u) N_k(v)ᵀ`` with
``u = x G``, ``v = y H`` and ``N(u) = u D / rms(u)`` per head (``D`` the learned diagonal weights).
For ``(G A, H A⁻ᵀ)`` to keep it for all u, v the ratio ``rms(u A) / rms(u)`` must be constant,
so ``A = c O`` with O orthogonal, and then ``O D_q D_k Oᵀ = D_q D_k``: for generic learned weights
only sign flips remain besides the scale, and the scale acts on q and k separately anyway
(``N(c u) = N(u)``).  At most a positive scale per head of q and of k (LayerNorm also a shift along
the all-ones direction) survives, no continuous gauge shared by the pair: the Q/K weights of these
modules are treated elementwise (adaptive), deliberately, and the layout says so in
``layout.notes`` (not as unsupported).  V/O is unaffected and keeps GL(h).

*The attention of 2025* (``adapters.families.latent``, ``differential``, ``qk_norm``): attention
sinks (a per-head logit appended to the scores) change no group; a NoPE layer (``use_rope`` = 0)
has plain scores, full GL on Q/K; a weightless q/k norm after (or before) the rotary map keeps
only the orthogonal A that commute with it, a rotation per frequency pair (ε > 0 forbids the
scale); multi-head latent attention has three blocks, GL(qk_nope_head_dim) per head between the
no-rope query and key rows, the rotary commutant on the rope part with one gauge for all heads
(their rotary key is shared) and GL(v_head_dim) per head on V/O; differential attention keeps
Q/K's group and has SO(2h) on each value pair normalised together.

*Position terms that keep GL* (``families.structure.position_terms``, docs/maths.md §13.7): a bias
added to the scores (a ``forward`` input ``position_bias`` or ``alibi``, with T5's per-head
``relative_attention_bias`` table) depends on neither q nor k, so Q/K keeps GL(h).  DeBERTa-v2's
disentangled terms (``pos_att_type``: c2p = q · key-side positional projection, p2c = k ·
query-side positional projection) pair a query-side with a key-side vector of the same head: the
positional projections named in ``POSITION_PAIR_HINTS`` are stacked under ``G`` (``pos_query_proj``)
and ``H`` (``pos_key_proj``) of the Q/K block, which keeps GL(h) on the taller factors.  Norms whose
parameters have the model width (ALBERT's residual LayerNorm inside the attention module) act on
the stream, not on a head's q/k/v, and are not extra parameters.

*LoRA*: a LoRA layer computes ``base(x) + s B A x``; only ``B A`` enters, and
``(B M)(M⁻¹ A) = B A`` for every M in GL(r): block ``G = B`` (out × r), ``H = Aᵀ`` (in × r),
the action ``(G M, H M⁻ᵀ)``.  The base weight of an adapted projection is frozen and, with the
delta added, no longer carries the attention gauge: attention blocks over adapted projections are
left out (with a note), the adapters' GL(r) blocks are used instead.

Screening
---------
Families other than the allowlisted ones screen each candidate.  Parameters besides the
projections (relative-position tables, norms, gates ...), norm/gate-named submodules, clipping of
q/k/v in the source, k/v narrower than q (grouped-query attention of an unverified class: the head
grouping is implementation-specific), inconsistent head sizes or an unrecognised structure make
the *whole module* unsupported.  Evidence of position encodings (rotary/relative-named
submodules or buffers, a non-absolute ``position_embedding_type``, a forward() taking positional
inputs such as ``position_embeddings``/``position_ids``, or, for classes that are not verified HF
classes, a forward() whose source mentions rotary/relative/alibi) makes only the *Q/K half*
unsupported: the V/O block is kept (position encodings act between q and k) and reported as
``Unsupported("<module>/qk", ...)``.  ``layout()`` raises on any unsupported module or part unless
``allow_unsupported=True`` or user-declared blocks cover it.  ``Layout.verify`` checks every block
numerically, whatever found it.

Checked to work: BERT, RoBERTa, ELECTRA, MiniLM, DistilBERT, ViT (4.x and 5.x structure), DeiT,
CLIP, SigLIP vision (incl. its MHA pooling head), BART, GPT-2, ``nn.MultiheadAttention`` /
``nn.TransformerEncoder``, Llama (MHA, GQA, MQA), Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3,
Phi (incl. ``qk_layernorm``), Phi-3, GPT-NeoX, T5 and UMT5 (encoder, decoder and cross-attention),
DeBERTa-v2 (c2p, p2c, ``share_att_key``), ALBERT, MPT, GPT-OSS (sinks), SmolLM3 (NoPE layers),
Llama 4 (interleaved complex rotary, weightless QK norm, NoPE layers), DeepSeek-V3 (latent
attention), DiffLlama (differential attention), and peft LoRA on BERT, GPT-2 and Llama.  Not
covered (reported unsupported, declare by hand if symmetric): timm-style packed ``qkv`` Linear,
Swin (relative position bias table as a bare parameter), rotary classes outside the allowlist
(their V/O block is kept, Q/K is unsupported), grouped-query attention of unverified classes, DoRA
and other LoRA variants.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Container, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from quotient_manifolds._validation import flag
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UnsupportedModel

from . import validation as check
from .families import FAMILIES, Context, Family
from .blocks import FactorPiece, GLBlock, canonical_names
from .layouts import Layout, Unsupported, head_structure

__all__ = ["layout", "detect", "resolve_layout", "Detection"]


@dataclass
class Detection:
    blocks: List[GLBlock]
    unsupported: List[Unsupported]
    seen: List[Tuple[str, str, str]]   # (module path, class name, family or "unsupported")
    notes: List[str] = field(default_factory=list)


def _split_part(name: str, modules: Container[str]) -> Tuple[str, str]:
    """``"<module>/qk"`` -> ``("<module>", "qk")``; a whole module -> ``(module, "")``."""
    module, sep, part = name.rpartition("/")
    return (module, part) if sep and name not in modules and module in modules else (name, "")


def detect(model: nn.Module, *, families: Optional[Sequence[Family]] = None) -> Detection:
    """Detected GL blocks, unsupported attention-like modules (or parts ``"<module>/qk"``) and
    notes of ``model``, using ``families`` (default: the registry ``adapters.families.FAMILIES``).
    Nothing is modified.

    Parameters
    ----------
    model:
        The model (any ``nn.Module``).
    families:
        The families to try, in order (default: the registry).

    Returns
    -------
    Detection
        ``blocks`` (the GL blocks found), ``unsupported`` (attention-like modules no family maps),
        ``seen`` (each attention-like module with its family) and ``notes``.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> found = adapters.detect(model)
    >>> [block.name for block in found.blocks], found.unsupported
    (['self_attn/qk', 'self_attn/vo'], [])
    >>> found.seen
    [('self_attn', 'MultiheadAttention', 'torch-mha')]
    """
    if not isinstance(model, nn.Module):       # refused with the message of every entry point
        check.module("model", model)
    ctx, _ = _context(model)
    return _detected(ctx, families)


def _context(model: nn.Module) -> Tuple[Context, Dict[str, str]]:
    """The model as the families see it, and its names of tied parameters (any name -> canonical
    name, :func:`canonical_names`)."""
    canonical, alias = canonical_names(model)
    return Context(model, canonical, {n: tuple(p.shape) for n, p in model.named_parameters()},
                   dict(model.named_modules())), alias


def _detected(ctx: Context, families: Optional[Sequence[Family]]) -> Detection:
    """:func:`detect` on the model of ``ctx``."""
    families = list(FAMILIES if families is None else families)
    claimed: List[Tuple[str, bool]] = []          # (module path, claimed by a nested family)
    blocks: List[GLBlock] = []
    unsupported: List[Unsupported] = []
    seen: List[Tuple[str, str, str]] = []
    notes: List[str] = []

    def inside(p: str) -> bool:
        return any(c == "" or p == c or p.startswith(c + ".") for c, _ in claimed)

    def contains_claimed(p: str) -> bool:
        return any(not nested and (p == "" or c.startswith(p + ".")) for c, nested in claimed)

    # pass 1: structural matches; pass 2: also modules that look like attention only by class name,
    # if they neither lie inside nor contain a module claimed before (e.g. a pooling head around an MHA)
    for by_name in (False, True):
        ctx.by_name = by_name
        for path, mod in ctx.modules.items():
            in_claimed = inside(path)
            if by_name and (in_claimed or contains_claimed(path)):
                continue
            for fam in families:
                if in_claimed and not fam.nested:
                    continue
                res = fam.match(ctx, path, mod)
                if res is None:
                    continue
                claimed.append((res.module, fam.nested))
                notes.extend(res.notes)
                for part, reason in res.unsupported:
                    unsupported.append(Unsupported(f"{res.module}/{part}" if part else res.module, res.cls, reason))
                if res.whole_module_unsupported:
                    seen.append((res.module, res.cls, "unsupported"))
                else:
                    blocks.extend(res.blocks)
                    seen.append((res.module, res.cls, res.family))
                break
    order = {p: i for i, p in enumerate(ctx.modules)}
    blocks.sort(key=lambda b: order.get(b.module, len(order)))      # stable: qk before vo
    unsupported.sort(key=lambda u: order.get(_split_part(u.module, order)[0], len(order)))
    seen.sort(key=lambda s: order.get(s[0], len(order)))
    return Detection(blocks, unsupported, seen, notes)


def _flatten(blocks) -> List[GLBlock]:
    if blocks is None:
        return []
    if isinstance(blocks, GLBlock):
        return [blocks]
    if isinstance(blocks, (str, bytes, torch.Tensor)) or not isinstance(blocks, Iterable):
        raise InvalidArgumentType(f"blocks= must be a GLBlock (see declare_block), a list of them, or None, got "
                                  f"{blocks!r} ({type(blocks).__name__})")
    out = []
    for b in blocks:
        out.extend(_flatten(b))
    return out


def _overlaps(pieces: Iterable[FactorPiece], masks: Dict[str, torch.Tensor], params) -> bool:
    return any(p.param in masks and bool((masks[p.param] & p.mask(params[p.param])).any()) for p in pieces)


def layout(model: nn.Module, *, blocks: Union[None, GLBlock, Sequence] = None, allow_unsupported: bool = False,
           detect_blocks: bool = True, include_frozen: bool = False) -> Layout:
    """Build the :class:`Layout` of ``model`` (never modifies or wraps it).

    GL blocks are detected by module type/structure (see the module docstring); ``blocks=`` adds
    user-declared blocks (:func:`declare_block`), which take precedence over detected blocks they
    overlap and resolve unsupported modules whose parameters they use.  ``detect_blocks=False`` uses
    only the declared blocks.  Raises ``ValueError`` when attention-like modules cannot be mapped, or no
    block is found at all, unless ``allow_unsupported=True`` (their parameters are then adaptive).
    Detected blocks touching frozen (``requires_grad=False``) parameters are dropped (noted in
    ``layout.notes``) and frozen parameters stay out of the ball (e.g. the base weights of a LoRA
    model); a declared block touching them is an error. ``include_frozen=True`` treats frozen
    parameters as trainable (pass it to ``sharpness`` too).

    Parameters
    ----------
    model:
        The model (any ``nn.Module``).
    blocks:
        A :class:`~quotient_manifolds.adapters.blocks.GLBlock` or a list of them
        (:func:`declare_block`).
    allow_unsupported:
        Treat the parameters of attention-like modules that cannot be mapped as adaptive instead
        of raising.
    detect_blocks:
        Detect blocks (False: only the declared ones).
    include_frozen:
        Treat frozen parameters as trainable.

    Returns
    -------
    Layout
        The blocks, the adaptive and frozen parameters, and what could not be mapped. Check it
        with :meth:`Layout.verify <quotient_manifolds.adapters.Layout.verify>` before trusting a
        number computed on it.

    Raises
    ------
    TypeError
        ``blocks`` is not a GLBlock or a list of them.
    ValueError
        Attention-like modules cannot be mapped or no block is found (without
        ``allow_unsupported``), declared blocks overlap or share a name, or a declared block
        touches frozen parameters.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> lay = adapters.layout(model)
    >>> lay
    Layout(model='TransformerEncoderLayer', blocks=2, gl_scalars=76, adaptive=9, frozen=0, unsupported=0)
    >>> [(block.name, block.num_heads, block.head_dim) for block in lay.blocks]
    [('self_attn/qk', 2, 2), ('self_attn/vo', 2, 2)]
    """

    if not isinstance(model, nn.Module):       # refused with the message of every entry point
        check.module("model", model)
    for name, value in (("allow_unsupported", allow_unsupported), ("detect_blocks", detect_blocks),
                        ("include_frozen", include_frozen)):
        flag(name, value)
    return _layout(model, blocks, allow_unsupported, detect_blocks, include_frozen)


def resolve_layout(model: nn.Module, layout: Optional[Layout], *, what: str, allow_unsupported: bool = False,
                   include_frozen: bool = False) -> Layout:
    """The layout a geodesic entry point uses: ``layout`` once it is checked to belong to ``model``
    (:meth:`~quotient_manifolds.adapters.Layout.check_model`: parameter names and shapes, head counts of every
    block's module), or, when ``None``, the layout detected from ``model`` (``allow_unsupported`` and
    ``include_frozen`` as in :func:`layout`).  ``what`` names the caller in messages."""
    if layout is None:
        return _layout(model, None, allow_unsupported, True, include_frozen)
    if not isinstance(layout, Layout):
        raise InvalidArgumentType(f"{what}: layout= must be a Layout (e.g. adapters.layout(model)), got "
                                  f"{type(layout).__name__}")
    layout.check_model(model, what=f"{what} (layout=)")
    return layout


def _layout(model: nn.Module, blocks: Union[None, GLBlock, Sequence], allow_unsupported: bool,
            detect_blocks: bool, include_frozen: bool) -> Layout:
    """:func:`layout` on checked arguments."""
    params = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    frozen = [n for n, p in params.items() if not p.requires_grad]
    ctx, alias = _context(model)
    det = _detected(ctx, None) if detect_blocks else Detection([], [], [])
    notes: List[str] = list(det.notes)
    user = _declared(alias, blocks, shapes)
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    kept, unsupported = _yield_to_declared(det, user, params, order, notes)

    kind_order = {"qk": 0, "qk_rope": 1, "vo": 2}
    all_blocks = sorted(kept + user, key=lambda b: (order.get(b.module, len(order)), kind_order.get(b.kind, 2)))
    names = [b.name for b in all_blocks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InvalidArgument(f"duplicate block names {dup}: pass name= to declare_block")
    frozen_set = set() if include_frozen else set(frozen)
    final = _without_frozen(all_blocks, {id(b) for b in user}, frozen_set, notes)
    gl_masks = _gl_masks(final, params)
    _refuse_unmapped(type(model).__name__, unsupported, final, det, notes, allow_unsupported)

    adaptive = [n for n in params if n not in frozen_set and (n not in gl_masks or not bool(gl_masks[n].all()))]
    if include_frozen:
        frozen = []
    return Layout(blocks=final, adaptive=adaptive, gl_masks=gl_masks, frozen=frozen, unsupported=unsupported,
                  param_shapes=shapes, model_name=type(model).__name__, notes=notes,
                  head_structure=head_structure(model, [b.module for b in final]))


def _declared(alias: Dict[str, str], blocks: Union[None, GLBlock, Sequence], shapes: Dict[str, tuple]) -> List[GLBlock]:
    """The user-declared ``blocks=`` of :func:`layout`, with the canonical names of tied parameters
    (``alias``: any name -> canonical name; everything else, grouping, stride and group, kept), each
    checked against ``shapes``."""
    user: List[GLBlock] = []
    for b in _flatten(blocks):
        if not isinstance(b, GLBlock):
            raise InvalidArgumentType(f"blocks= must contain GLBlock objects (see declare_block), got {type(b).__name__}")
        canon_b = replace(b, g_pieces=tuple(replace(p, param=alias.get(p.param, p.param)) for p in b.g_pieces),
                          h_pieces=tuple(replace(p, param=alias.get(p.param, p.param)) for p in b.h_pieces))
        canon_b.validate(shapes)
        user.append(canon_b)
    return user


def _yield_to_declared(det: Detection, user: List[GLBlock], params: Dict[str, torch.Tensor],
                       order: Dict[str, int], notes: List[str]) -> Tuple[List[GLBlock], List[Unsupported]]:
    """``(detected blocks kept, unsupported modules left)``: declared blocks replace the detected
    blocks they overlap, and cover an unsupported module (or part ``"<module>/qk"``) when they touch
    its parameters other than those of its own detected blocks (a declared V/O block does not cover
    an unsupported Q/K).  What was replaced or covered is noted in ``notes``."""
    user_masks: Dict[str, torch.Tensor] = {}
    for b in user:
        for p in b.pieces:
            mk = p.mask(params[p.param])
            user_masks[p.param] = user_masks[p.param] | mk if p.param in user_masks else mk
    kept = []
    for b in det.blocks:
        if _overlaps(b.pieces, user_masks, params):
            notes.append(f"detected block {b.name} replaced by user-declared blocks")
        else:
            kept.append(b)
    detected_params: Dict[str, set] = {}
    for b in det.blocks:
        detected_params.setdefault(b.module, set()).update(b.params)
    unsupported = []
    for u in det.unsupported:
        module, part = _split_part(u.module, order)
        prefix = module + "." if module else ""
        own = detected_params.get(module, set())
        if any(p.param.startswith(prefix) and p.param not in own for b in user for p in b.pieces):
            what = f"part {part} of module {module}" if part else f"module {module}"
            notes.append(f"unsupported {what} [{u.cls}] covered by user-declared blocks")
        else:
            unsupported.append(u)
    return kept, unsupported


def _without_frozen(blocks: List[GLBlock], declared: Container[int], frozen: Container[str],
                    notes: List[str]) -> List[GLBlock]:
    """``blocks`` less the detected ones touching a ``frozen`` parameter (noted); a declared one
    (``id`` in ``declared``) touching one is refused."""
    final = []
    for b in blocks:
        fz = [p for p in b.params if p in frozen]
        if fz and id(b) in declared:
            raise InvalidArgument(
                f"declared block {b.name} touches frozen parameter(s) {', '.join(fz)} "
                "(requires_grad=False), which sharpness never perturbs: unfreeze them, or pass "
                "include_frozen=True to layout() and sharpness() to put frozen weights in the ball")
        if fz:
            notes.append(f"block {b.name} dropped: it touches frozen parameter(s) {', '.join(fz)}")
        else:
            final.append(b)
    return final


def _gl_masks(blocks: List[GLBlock], params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Per parameter, the entries some block covers; blocks that overlap are refused."""
    gl_masks: Dict[str, torch.Tensor] = {}
    owner: Dict[str, List[str]] = {}
    for b in blocks:
        for p in b.pieces:
            mk = p.mask(params[p.param])
            if p.param in gl_masks:
                if bool((gl_masks[p.param] & mk).any()):
                    raise InvalidArgument(f"blocks {owner[p.param]} and {b.name} overlap on parameter {p.param!r}")
                gl_masks[p.param] = gl_masks[p.param] | mk
            else:
                gl_masks[p.param] = mk
            owner.setdefault(p.param, []).append(b.name)
    return gl_masks


def _refuse_unmapped(model_name: str, unsupported: List[Unsupported], final: List[GLBlock], det: Detection,
                     notes: List[str], allow_unsupported: bool) -> None:
    """Unless ``allow_unsupported``: refuse attention-like modules left unmapped, then a layout
    without any block, saying what was seen and how to declare blocks."""
    if allow_unsupported:
        return
    if unsupported:
        lines = [f"layout(): {len(unsupported)} attention-like module(s) or Q/K part(s) ('<module>/qk') of "
                 f"{model_name} cannot be mapped to GL blocks:"]
        lines += [f"  - {u.module} [{u.cls}]: {u.reason}" for u in unsupported]
        lines.append(
            "To proceed, either declare their blocks by hand and check them, e.g.\n"
            "    blocks = [adapters.declare_block(model, q='<path>.q_proj', k='<path>.k_proj', num_heads=H),\n"
            "              adapters.declare_block(model, v='<path>.v_proj', o='<path>.o_proj', num_heads=H)]\n"
            "    lay = adapters.layout(model, blocks=blocks); lay.verify(model, example_inputs)\n"
            "(rotary Q/K: group=RotaryGroup(pairing, rotary_dim); grouped-query attention: num_kv_heads=...),\n"
            "or pass allow_unsupported=True to treat their parameters adaptively (elementwise)."
        )
        raise UnsupportedModel("\n".join(lines))
    if not final:
        seen = [f"  - {p} [{c}]: {f}" for p, c, f in det.seen]
        dropped = [n for n in notes if "dropped" in n]
        msg = [f"layout(): no GL block found in {model_name}."]
        msg += (["Attention-like modules seen:"] + seen) if seen else ["No attention-like module was seen."]
        msg += dropped
        msg.append("Declare blocks with blocks=[adapters.declare_block(model, ...)], or pass "
                   "allow_unsupported=True for a purely adaptive layout.")
        raise UnsupportedModel("\n".join(msg))
