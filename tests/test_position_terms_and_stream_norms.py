"""Attention with position terms that keep a GL symmetry (T5's and UMT5's relative position bias,
MPT's ALiBi given as ``position_bias``, DeBERTa-v2's disentangled attention) and with a norm on the
model-width stream inside the attention module (ALBERT): both halves are detected, each is a symmetry, sharpness on the quotient does not see it,
while elementwise (adaptive) sharpness does, and the Lie algebra derived from the module's output
is the hand-derived one.

Each family is a tiny model from config in float64 with head_dim 4.  The symmetry action is written
here, independently of the detector, by editing the rows/columns that the family's own ``forward``
reads as head ``i``: per head a random ill-conditioned ``A`` (Q/K) and ``B`` (V/O) of GL(4),
``W_q ← Aᵀ W_q``, ``W_k ← A⁻¹ W_k``, ``W_v ← Bᵀ W_v``, ``W_o[:, head] ← W_o[:, head] B⁻ᵀ`` (biases
like their weights).  DeBERTa-v2's query-side positional projection moves with ``W_q`` and its
key-side one with ``W_k``: the c2p term ``q · pos_k`` and the p2c term ``k · pos_q`` pair one side
with the other.  T5's bias table and ALBERT's LayerNorm are not touched.
"""

from __future__ import annotations

import copy

import pytest
import torch

from quotient_manifolds import adapters
from quotient_manifolds.adapters.derive import derive_groups
from quotient_manifolds.core import FULL_GL
from quotient_manifolds.errors import InvalidArgument

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, E, HEADS, H = 48, 8, 16, 4, 4        # head_dim 4: GL(4) has dimension 16


def _gl(gen: torch.Generator) -> torch.Tensor:
    """Random element of GL(H) with condition number 1e2."""
    u, _ = torch.linalg.qr(torch.randn(H, H, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(H, H, generator=gen, dtype=torch.float64))
    return u @ torch.diag(torch.logspace(-1, 1, H, dtype=torch.float64)) @ v


def _left(lin: torch.nn.Linear, rows: slice, M: torch.Tensor) -> None:
    """The head's output features of ``lin`` (weight rows and bias) multiplied by ``M`` on the left."""
    lin.weight[rows] = M @ lin.weight[rows]
    if lin.bias is not None:
        lin.bias[rows] = M @ lin.bias[rows]


def _act(model, attentions, seed=0):
    """A copy of ``model`` acted on.  ``attentions(model)`` yields per attention module
    ``(q_side, k_side, v, o)``: lists of linear maps whose heads take ``Aᵀ`` (query side) or
    ``A⁻¹`` (key side), the value projection and the output projection; a linear map given as
    ``(lin, offset)`` has its heads from output feature ``offset`` on (a packed projection)."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    at = lambda p: p if isinstance(p, tuple) else (p, 0)                           # noqa: E731
    with torch.no_grad():
        for q_side, k_side, v, o in attentions(new):
            for i in range(HEADS):
                A, B = _gl(gen), _gl(gen)
                for lin, start in map(at, q_side):
                    _left(lin, slice(start + i * H, start + (i + 1) * H), A.T)
                for lin, start in map(at, k_side):
                    _left(lin, slice(start + i * H, start + (i + 1) * H), torch.linalg.inv(A))
                lin, start = at(v)
                _left(lin, slice(start + i * H, start + (i + 1) * H), B.T)
                cols = slice(i * H, (i + 1) * H)
                o.weight[:, cols] = o.weight[:, cols] @ torch.linalg.inv(B).T
    return new


def _ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(out, targets):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))


def _check(model, acted, inputs, expected_blocks):
    """The action is a symmetry; the detected blocks are ``expected_blocks`` (kind -> (n, m) per
    module, full GL); geodesic sharpness is invariant; the derived algebras have dimension h²."""
    change = (acted(**inputs).logits - model(**inputs).logits).abs().max().item()
    assert change < 1e-10, f"the test's action is not a symmetry: output change {change:.2e}"
    layout = adapters.layout(model)
    assert not layout.unsupported, layout
    got = sorted((b.kind, b.n, b.m) for b in layout.blocks)
    assert got == sorted(expected_blocks), layout
    assert all(b.group == FULL_GL and b.num_heads == HEADS and b.head_dim == H for b in layout.blocks)

    batch = [(inputs, inputs["input_ids"])]
    for geometry in ("geodesic-inv", "geodesic-mix", "adaptive"):
        kw = dict(geometry=geometry, rho=0.01, n_iters=2, loss_fn=_loss, layout=layout, check_retraction=False)
        base = adapters.sharpness(model, batch, **kw).value
        moved = adapters.sharpness(acted, batch, **kw).value
        if geometry == "adaptive":        # elementwise sharpness sees the action: the check can fail
            assert abs(moved / base - 1) > 1e-2, (geometry, base, moved)
        else:
            assert abs(moved / base - 1) < 1e-6, (geometry, base, moved)

    derived, results = derive_groups(model, layout, inputs, use_cache=False)
    assert [(r.status, r.dim) for r in results] == [("derived", H * H)] * len(layout.blocks), results
    assert all(b.group == FULL_GL and b.group_source.startswith("derived: ") for b in derived.blocks)
    return layout


# ---------------------------------------------------------------------------------------------- T5
@pytest.mark.parametrize("name", ["T5", "UMT5"])
def test_t5_relative_position_bias_keeps_full_gl_on_qk(name):
    """T5 adds a learned bias per head and relative position to the scores: it depends on neither q
    nor k, so Q/K keeps GL(h) in the encoder self-attention, the decoder self-attention and the
    cross-attention (which gets the zero bias).  T5 passes the bias between layers (``forward``
    takes ``position_bias``); UMT5 computes it in every self-attention from its own table."""
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(vocab_size=VOCAB, d_model=E, d_kv=H, d_ff=32, num_layers=1,
                                                 num_decoder_layers=1, num_heads=HEADS,
                                                 relative_attention_num_buckets=8, relative_attention_max_distance=16)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(cfg).double().eval()

    def attentions(m):
        for stack in (m.encoder, m.decoder):
            for layer in stack.block[0].layer[:-1]:                       # the last one is the feed-forward
                a = getattr(layer, "SelfAttention", None) or layer.EncDecAttention
                yield [a.q], [a.k], a.v, a.o

    ids = _ids()
    inputs = {"input_ids": ids, "decoder_input_ids": ids.flip(1)}
    layout = _check(model, _act(model, attentions), inputs, [("qk", E, E), ("vo", E, E)] * 3)
    sources = [b.group_source for b in layout.blocks if b.kind == "qk"]
    assert all("depends on neither q nor k" in s for s in sources), sources
    assert sum("per-head tables relative_attention_bias" in s for s in sources) == 2, sources


def test_mpt_packed_projection_with_alibi_as_position_bias():
    """MPT packs ``[q | k | v]`` in ``Wqkv`` and receives its ALiBi bias as ``position_bias``: the
    structural family proposes both halves, Q/K with full GL; ``clip_qkv`` refuses the module."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, d_model=E, n_heads=HEADS, n_layers=2, max_seq_len=32)
    model = transformers.MptForCausalLM(transformers.MptConfig(**cfg)).double().eval()

    def attentions(m):
        for block in m.transformer.blocks:
            a = block.attn
            yield [(a.Wqkv, 0)], [(a.Wqkv, E)], (a.Wqkv, 2 * E), a.out_proj

    layout = _check(model, _act(model, attentions), {"input_ids": _ids()}, [("qk", E, E), ("vo", E, E)] * 2)
    assert all("position_bias" in b.group_source for b in layout.blocks if b.kind == "qk")
    clipped = transformers.MptForCausalLM(transformers.MptConfig(**cfg, attn_config={"clip_qkv": 2.0}))
    lay = adapters.layout(clipped, allow_unsupported=True)
    assert not lay.blocks and all("clip_qkv=2.0" in u.reason for u in lay.unsupported) and lay.unsupported


# ------------------------------------------------------------------------------------------ DeBERTa
def _deberta(**cfg):
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=E, num_hidden_layers=1,
                                          num_attention_heads=HEADS, intermediate_size=32,
                                          max_position_embeddings=32, relative_attention=True, position_buckets=8,
                                          initializer_range=0.2, **cfg)     # attention far from uniform
    return transformers.DebertaV2ForMaskedLM(config).double().eval()


@pytest.mark.parametrize("variant", ["c2p+p2c", "c2p", "shared"])
def test_deberta_v2_disentangled_positional_projections_join_the_qk_factors(variant):
    """c2p dots q with the key-side projection of the relative positions, p2c k with the query-side
    one: (P, P⁻ᵀ) on [content; positional] projections together keeps every term.  With
    share_att_key the positions go through the content projections themselves."""
    terms = {"c2p+p2c": ["c2p", "p2c"], "c2p": ["c2p"], "shared": ["c2p", "p2c"]}[variant]
    model = _deberta(pos_att_type=terms, share_att_key=variant == "shared")

    def attentions(m):
        for layer in m.deberta.encoder.layer:
            s = layer.attention.self
            q_side = [s.query_proj] + ([s.pos_query_proj] if hasattr(s, "pos_query_proj") else [])
            k_side = [s.key_proj] + ([s.pos_key_proj] if hasattr(s, "pos_key_proj") else [])
            yield q_side, k_side, s.value_proj, layer.attention.output.dense

    rows = E + 1                                               # weight rows and bias row per head
    n, m = {"c2p+p2c": (2 * rows, 2 * rows), "c2p": (rows, 2 * rows), "shared": (rows, rows)}[variant]
    layout = _check(model, _act(model, attentions), {"input_ids": _ids()}, [("qk", n, m), ("vo", rows, E)])
    qk = next(b for b in layout.blocks if b.kind == "qk")
    assert "disentangled" in qk.group_source


def test_deberta_v2_qk_without_its_positional_projections_has_no_symmetry():
    """The content projections alone are not a block: the c2p / p2c terms mix each of them with a
    positional projection outside it, so the derived algebra is trivial and the half is reported
    with the reason; V/O keeps GL(h)."""
    model = _deberta(pos_att_type=["c2p", "p2c"])
    a = "deberta.encoder.layer.0.attention"
    blocks = [adapters.declare_block(model, q=f"{a}.self.query_proj", k=f"{a}.self.key_proj", num_heads=HEADS,
                                     group="gl"),
              adapters.declare_block(model, v=f"{a}.self.value_proj", o=f"{a}.output.dense", num_heads=HEADS)]
    lay = adapters.layout(model, blocks=blocks, detect_blocks=False)
    inputs = {"input_ids": _ids()}
    derived, results = derive_groups(model, lay, inputs, use_cache=False)
    assert {r.block.rsplit("/", 1)[1]: (r.status, r.dim) for r in results} == {"qk": ("trivial", 0),
                                                                                "vo": ("derived", H * H)}
    (u,) = derived.unsupported
    assert u.module == f"{a}.self/qk" and "no continuous symmetry" in u.reason
    assert [b.kind for b in derived.blocks] == ["vo"]
    assert not lay.verify(model, inputs, raise_on_failure=False).passed     # the pair alone is no symmetry
    derived.verify(model, inputs)


def test_deberta_v2_unknown_position_term_reports_qk_and_keeps_vo():
    """A score term the pairing table does not know leaves Q/K without a candidate group (reported
    with the reason); V/O is kept."""
    model = _deberta(pos_att_type=["c2p", "p2c"])
    model.deberta.encoder.layer[0].attention.self.pos_att_type = ["c2p", "p2c", "p2p"]
    layout = adapters.layout(model, allow_unsupported=True)
    assert [b.kind for b in layout.blocks] == ["vo"]
    (u,) = layout.unsupported
    assert u.module.endswith("attention/qk") and "p2p" in u.reason


# ------------------------------------------------------------------------------------------- ALBERT
def test_albert_layernorm_inside_the_attention_module_keeps_both_halves():
    """ALBERT's attention module holds q/k/v, the output projection and the residual LayerNorm; the
    norm acts on the model-width stream after the output projection, so both halves keep GL(h).
    The layer is shared by both layers of the model: one action on the shared weights."""
    torch.manual_seed(0)
    cfg = transformers.AlbertConfig(vocab_size=VOCAB, embedding_size=8, hidden_size=E, num_hidden_layers=2,
                                    num_attention_heads=HEADS, intermediate_size=32, max_position_embeddings=32,
                                    initializer_range=0.2)
    model = transformers.AlbertForMaskedLM(cfg).double().eval()

    def attentions(m):
        a = m.albert.encoder.albert_layer_groups[0].albert_layers[0].attention
        yield [a.query], [a.key], a.value, a.dense

    layout = _check(model, _act(model, attentions), {"input_ids": _ids()}, [("qk", E + 1, E + 1), ("vo", E + 1, E)])
    assert all(not n.endswith("LayerNorm.weight") or n in layout.adaptive for n in layout.param_shapes)


def test_declare_block_accepts_t5_qk_and_refuses_deberta_qk_without_its_positional_projections():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=E, d_kv=H, d_ff=32, num_layers=1, num_decoder_layers=1,
                                num_heads=HEADS, relative_attention_num_buckets=8)
    t5 = transformers.T5ForConditionalGeneration(cfg).double()
    a = "encoder.block.0.layer.0.SelfAttention"
    assert adapters.declare_block(t5, q=f"{a}.q", k=f"{a}.k", num_heads=HEADS).group == FULL_GL
    deberta = _deberta(pos_att_type=["c2p", "p2c"])
    a = "deberta.encoder.layer.0.attention.self"
    with pytest.raises(InvalidArgument, match=r"(?s)leaves out the positional projection\(s\) pos_query_proj, "
                                         r"pos_key_proj.*g=/h= FactorPieces"):
        adapters.declare_block(deberta, q=f"{a}.query_proj", k=f"{a}.key_proj", num_heads=HEADS)
