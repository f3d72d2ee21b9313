"""Layouts (issue 3 §1): detection of GL blocks by module type/structure, FactorPiece/GLBlock
bookkeeping (spec §6.2), masks, printing, the symmetry self-check ``Layout.verify`` (and that it
catches broken declarations), error paths, and that the model is never modified."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from quotient_manifolds import adapters
from quotient_manifolds.core import FULL_GL
from quotient_manifolds.adapters import Layout, SymmetryError, declare_block
from quotient_manifolds.adapters.blocks import FactorPiece, GLBlock
from quotient_manifolds.adapters.verify import default_tolerance
from quotient_manifolds.errors import InvalidArgument, UnknownName, UnsupportedModel
from conftest import PlainAttention, PlainViT


# ------------------------------------------------------------------------------ helpers
def snapshot(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()},
            {n: m.training for n, m in model.named_modules()},
            {n: p.requires_grad for n, p in model.named_parameters()})


def assert_unchanged(model, snap):
    params, buffers, flags, rg = snap
    now = dict(model.named_parameters())
    assert now.keys() == params.keys()
    for n, p in now.items():
        assert torch.equal(p.detach(), params[n]), n
        assert p.requires_grad == rg[n], n
        assert p.grad is None, n
    nb = dict(model.named_buffers())
    assert nb.keys() == buffers.keys()
    for n, b in nb.items():
        assert torch.equal(b, buffers[n]), n
    assert {n: m.training for n, m in model.named_modules()} == flags


def params_of(model):
    return {n: p.detach() for n, p in model.named_parameters()}


FAST = dict(scales=(1e-2, 1.0, 1e2))


# ------------------------------------------------------------------------ FactorPiece / GLBlock
@pytest.mark.parametrize("offset, heads", [(4, 2), (0, 4)])   # (0, 4): the whole weight
@pytest.mark.parametrize("kind", ["rows", "cols", "bias"])
def test_factor_piece_read_write_mask(kind, offset, heads):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(12, 12, generator=g, dtype=torch.float64) if kind != "bias" else torch.randn(1, 1, 12, generator=g, dtype=torch.float64)
    p = FactorPiece("w", kind, offset=offset, num_heads=heads, head_dim=3)
    x = p.read({"w": W})
    o = offset
    if kind == "rows":
        ref = torch.stack([W[o + 3 * i: o + 3 + 3 * i, :].T for i in range(heads)])
    elif kind == "cols":
        ref = torch.stack([W[:, o + 3 * i: o + 3 + 3 * i] for i in range(heads)])
    else:
        ref = torch.stack([W.reshape(-1)[o + 3 * i: o + 3 + 3 * i][None] for i in range(heads)])
    assert torch.equal(x, ref)
    new_val = torch.randn(x.shape, generator=g, dtype=torch.float64)
    W2 = p.write(W, new_val)
    assert W2.shape == W.shape and torch.equal(p.read({"w": W2}), new_val)
    # a new tensor, also where the piece is the whole weight: changing the value later leaves it
    W_in, value_in = W.clone(), new_val.clone()
    W3 = p.write(W_in, value_in)
    W_in.add_(1.0)
    value_in.add_(1.0)
    assert torch.equal(W3, W2)
    # functorch transforms run through it (the group derivation's forward-mode AD does)
    tangent = torch.randn(x.shape, generator=g, dtype=torch.float64)
    out, d_out = torch.func.jvp(lambda v: p.write(W, v), (new_val,), (tangent,))
    assert torch.equal(out, W2) and torch.equal(d_out, p.write(torch.zeros_like(W), tangent))
    mask = p.mask(W)
    assert torch.equal(W2[~mask], W[~mask]) and int(mask.sum()) == x.numel()
    # differentiable in both arguments, no in-place modification of the inputs
    Wr, vr = W.clone().requires_grad_(), new_val.clone().requires_grad_()
    weights = torch.randn(W.shape, generator=g, dtype=torch.float64)
    (p.write(Wr, vr) * weights).sum().backward()
    assert torch.equal(vr.grad, p.read({"w": weights}))
    assert torch.equal(torch.zeros_like(W) if Wr.grad is None else Wr.grad, weights * (~mask))
    with pytest.raises(InvalidArgument):
        FactorPiece("w", "diag", 0, 1, 1)
    with pytest.raises(InvalidArgument, match="out of range"):
        FactorPiece("w", kind, offset=8, num_heads=2, head_dim=3).check_shape(W.shape)


def test_gather_scatter_round_trip_exact_and_differentiable(tiny_bert):
    model, _ = tiny_bert
    lay = adapters.layout(model)
    params = params_of(model)
    for b in lay.blocks:
        x = b.gather(params)
        assert x.shape == (b.num_heads, b.n + b.m, b.head_dim)
        back = b.scatter(params, x)
        assert back is not params and set(back) == set(params)
        for n in params:
            assert torch.equal(back[n], params[n]), n
        # a modified x is written exactly and read back exactly
        x2 = torch.randn_like(x)
        new = b.scatter(params, x2)
        assert torch.equal(b.gather(new), x2)
        untouched = set(params) - set(b.params)
        assert all(new[n] is params[n] for n in untouched)
        # gradient w.r.t. x is the gathered upstream gradient
        xr = x.clone().requires_grad_()
        w = {n: torch.randn_like(params[n]) for n in b.params}
        sum((b.scatter(params, xr)[n] * w[n]).sum() for n in b.params).backward()
        assert torch.allclose(xr.grad, b.gather(w))


def test_the_backward_of_a_scatter_is_one_concatenation_per_block(tiny_bert):
    """The gradient of the heads from the written weights is one concatenation of the pieces'
    gradients per block: no zero-filled tensor of the heads' size per piece, summed (what a
    slice per piece costs), and no concatenation where a piece is the whole weight."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    model, _ = tiny_bert
    params = params_of(model)
    block = adapters.layout(model).blocks[0]
    assert len(block.pieces) > 2
    x = block.gather(params).clone().requires_grad_()
    w = {n: torch.randn_like(params[n]) for n in block.params}
    with Ops() as forward:
        new = block.scatter(params, x)
    loss = sum((new[n] * w[n]).sum() for n in block.params)
    with Ops() as backward:
        loss.backward()
    assert "cat" not in forward.names
    assert backward.names.count("cat") == 1 and "slice_backward" not in backward.names
    assert torch.equal(x.grad, block.gather(w))


def test_scatter_composes_on_packed_in_proj():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    lay = adapters.layout(mha)
    qk, vo = lay.blocks
    params = params_of(mha)
    assert qk.params == ("in_proj_weight", "in_proj_bias") and vo.params == ("in_proj_weight", "in_proj_bias", "out_proj.weight")
    xq, xv = torch.randn_like(qk.gather(params)), torch.randn_like(vo.gather(params))
    new = vo.scatter(qk.scatter(params, xq), xv)
    assert torch.equal(qk.gather(new), xq) and torch.equal(vo.gather(new), xv)
    assert torch.equal(new["out_proj.bias"], params["out_proj.bias"])


def test_act_preserves_every_head_product_and_random_actions_condition():
    torch.manual_seed(0)
    model = PlainViT().double()
    lay = adapters.layout(model)
    params = params_of(model)
    g = torch.Generator().manual_seed(1)
    acts = lay.random_actions(params, scale=10.0, cond=1e3, generator=g)
    for b in lay.blocks:
        A = acts[b.name]
        assert A.shape == (b.num_heads, b.head_dim, b.head_dim) and A.dtype == torch.float64
        s = torch.linalg.svdvals(A)
        assert torch.allclose(s[:, 0] / s[:, -1], torch.full((b.num_heads,), 1e3, dtype=torch.float64))
        assert torch.allclose(s.log().mean(-1).exp(), torch.full((b.num_heads,), 10.0, dtype=torch.float64))
    new = lay.act(params, acts)
    for b in lay.blocks:
        G, H = b.split(b.gather(params))
        G2, H2 = b.split(b.gather(new))
        assert torch.allclose(G2 @ H2.transpose(-1, -2), G @ H.transpose(-1, -2), rtol=1e-10, atol=1e-12)
        assert not torch.allclose(G2, G)
    gauss = lay.random_actions(params, scale=0.5, cond=None, generator=g)
    assert set(gauss) == set(lay.block_names)
    with pytest.raises(UnknownName):
        lay.act(params, {"nope": acts[lay.blocks[0].name]})


# ------------------------------------------------------------------------------ detection
def test_bert_from_config(tiny_bert):
    model, inputs = tiny_bert
    snap = snapshot(model)
    lay = adapters.layout(model)
    assert isinstance(lay, Layout) and all(isinstance(b, GLBlock) for b in lay.blocks)
    assert lay.block_names == [f"bert.encoder.layer.{i}.attention/{k}" for i in range(2) for k in ("qk", "vo")]
    qk, vo = lay.blocks[:2]
    assert (qk.family, qk.num_heads, qk.head_dim, qk.n, qk.m) == ("hf-bert", 2, 16, 33, 33)
    assert (vo.n, vo.m) == (33, 32)
    assert [p.param for p in qk.g_pieces] == ["bert.encoder.layer.0.attention.self.query.weight",
                                              "bert.encoder.layer.0.attention.self.query.bias"]
    assert vo.h_pieces == (FactorPiece("bert.encoder.layer.0.attention.output.dense.weight", "cols", 0, 2, 16),)
    # GL parameters fully covered; output bias, LayerNorms, embeddings, classifier adaptive
    for n in qk.params + vo.params:
        assert bool(lay.gl_masks[n].all()) and n not in lay.adaptive
    assert "bert.encoder.layer.0.attention.output.dense.bias" in lay.adaptive
    assert "bert.encoder.layer.0.attention.output.dense.bias" not in lay.gl_masks
    assert "classifier.weight" in lay.adaptive and lay.frozen == [] and lay.unsupported == []
    report = lay.verify(model, inputs)
    assert report.passed and len(report.blocks) == 4 and report.max_rel_dev < 1e-5
    assert_unchanged(model, snap)


def test_real_minilm_two_layers(minilm):
    model, inputs = minilm
    snap = snapshot(model)
    lay = adapters.layout(model)
    assert len(lay.blocks) == 4
    for b in lay.blocks:
        assert (b.num_heads, b.head_dim) == (12, 32)
        assert (b.n, b.m) == ((385, 385) if b.kind == "qk" else (385, 384))
    c = lay.counts()
    assert c["gl"] == 2 * (4 * 384 * 384 + 3 * 384) and c["gl"] + c["adaptive"] == c["total"]
    report = lay.verify(model, inputs, per_block="auto")
    assert report.passed and report.max_rel_dev < 1e-4
    assert_unchanged(model, snap)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_hf_vit_5x_with_and_without_bias(qkv_bias):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, qkv_bias=qkv_bias, initializer_range=0.3)
    model = T.ViTModel(cfg).eval()
    lay = adapters.layout(model)
    assert lay.block_names == [f"layers.{i}.attention/{k}" for i in range(2) for k in ("qk", "vo")]
    qk, vo = lay.blocks[:2]
    assert qk.family == "qkvo" and (qk.n, qk.m, vo.n, vo.m) == ((33, 33, 33, 32) if qkv_bias else (32, 32, 32, 32))
    assert lay.verify(model, torch.randn(2, 3, 16, 16), **FAST).passed


def test_hf_vit_for_classification(tiny_vit):
    model, inputs = tiny_vit
    lay = adapters.layout(model)
    assert [b.module for b in lay.blocks] == ["vit.layers.0.attention"] * 2 + ["vit.layers.1.attention"] * 2
    assert "vit.layers.0.attention.o_proj.bias" in lay.adaptive
    assert lay.verify(model, inputs).passed


def test_clip_vision_and_text(tiny_clip_vision, tiny_clip_text):
    for model, inputs in (tiny_clip_vision, tiny_clip_text):
        snap = snapshot(model)
        lay = adapters.layout(model)
        mods = [b.module for b in lay.blocks]
        assert [m.split(".")[-3:] for m in mods] == [["layers", str(i), "self_attn"] for i in (0, 0, 1, 1)]
        assert all(model.get_submodule(m).__class__.__name__ == "CLIPAttention" for m in mods)
        assert all(b.family == "qkvo" for b in lay.blocks)
        assert lay.blocks[1].h_pieces[0].param.endswith("self_attn.out_proj.weight")
        assert lay.verify(model, inputs).passed
        assert_unchanged(model, snap)


def test_clip_full_model_both_towers():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.CLIPConfig(
        text_config=dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2),
        vision_config=dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=64), projection_dim=16)
    model = T.CLIPModel(cfg).eval()
    lay = adapters.layout(model)
    assert sorted({b.module for b in lay.blocks}) == ["text_model.encoder.layers.0.self_attn",
                                                      "vision_model.encoder.layers.0.self_attn"]
    inputs = {"input_ids": torch.randint(3, 100, (2, 5)), "pixel_values": torch.randn(2, 3, 16, 16)}
    assert lay.verify(model, inputs, **FAST).passed


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_packed_mha(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=batch_first)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()
    snap = snapshot(model)
    lay = adapters.layout(model)
    assert lay.block_names == [f"layers.{i}.self_attn/{k}" for i in range(2) for k in ("qk", "vo")]
    qk, vo = lay.blocks[:2]
    assert qk.family == "torch-mha" and (qk.num_heads, qk.head_dim, qk.n, qk.m, vo.n, vo.m) == (4, 4, 17, 17, 17, 16)
    assert [(p.param, p.kind, p.offset) for p in vo.g_pieces] == [
        ("layers.0.self_attn.in_proj_weight", "rows", 32), ("layers.0.self_attn.in_proj_bias", "bias", 32)]
    # packed in_proj fully covered by the two blocks; out_proj.bias adaptive
    for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight"):
        assert bool(lay.gl_masks[f"layers.0.self_attn.{n}"].all())
    assert "layers.0.self_attn.out_proj.bias" in lay.adaptive
    assert not any("in_proj" in n for n in lay.adaptive)
    x = torch.randn((2, 5, 16) if batch_first else (5, 2, 16))
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:] = True
    assert lay.verify(model, {"src": x, "src_key_padding_mask": mask}).passed
    assert_unchanged(model, snap)  # training flag restored (was train mode)


def test_mha_separate_qkv_weights_kdim():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, kdim=10, vdim=12, batch_first=True)
    lay = adapters.layout(mha)
    qk, vo = lay.blocks
    assert [p.param for p in qk.pieces] == ["q_proj_weight", "in_proj_bias", "k_proj_weight", "in_proj_bias"]
    assert (qk.n, qk.m, vo.n, vo.m) == (17, 11, 13, 16)
    assert [p.offset for p in qk.pieces] == [0, 0, 0, 16] and vo.g_pieces[1].offset == 32
    assert all(bool(m.all()) for m in lay.gl_masks.values()) and lay.adaptive == ["out_proj.bias"]
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, 5, 10), torch.randn(2, 5, 12)
    assert lay.verify(mha, (q, k, v)).passed
    # vdim 6 < head_dim 8: G = [W_vᵀ; b_v] is 7 x 8 per head, of rank < 8, so GL(8) has no
    # quotient there: the V/O part is reported (it was accepted, then refused by the measures)
    narrow = nn.MultiheadAttention(16, 2, kdim=10, vdim=6, batch_first=True)
    with pytest.raises(UnsupportedModel, match=r"- /vo \[MultiheadAttention\]: head_dim 8 exceeds the rows"):
        adapters.layout(narrow)
    assert [b.kind for b in adapters.layout(narrow, allow_unsupported=True).blocks] == ["qk"]


def test_mha_bias_kv_and_zero_attn_are_covered():
    """add_bias_kv: bias_k / bias_v are an extra key / value token, i.e. an extra input row [0..0 1]:
    they must be an extra row of H (QK) and of G (VO).  Leaving bias_k out breaks the symmetry, which
    verify catches; add_zero_attn appends zeros, invariant under any linear action."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 3, add_bias_kv=True, add_zero_attn=True, batch_first=True)
    with torch.no_grad():
        mha.bias_k.normal_()
        mha.bias_v.normal_()
    lay = adapters.layout(mha)
    qk, vo = lay.blocks
    assert qk.h_pieces[-1] == FactorPiece("bias_k", "bias", 0, 3, 4) and (qk.n, qk.m) == (13, 14)
    assert vo.g_pieces[-1] == FactorPiece("bias_v", "bias", 0, 3, 4) and (vo.n, vo.m) == (14, 12)
    assert bool(lay.gl_masks["bias_k"].all()) and "bias_k" not in lay.adaptive
    x = torch.randn(2, 4, 12)
    assert lay.verify(mha, (x, x, x)).passed
    bad = declare_block(mha, g=qk.g_pieces, h=qk.h_pieces[:-1], kind="qk", name="qk_without_bias_k")
    bad_lay = adapters.layout(mha, blocks=[bad, vo], detect_blocks=False)
    with pytest.raises(SymmetryError, match="qk_without_bias_k") as err:
        bad_lay.verify(mha, (x, x, x))
    assert err.value.report.failing == ["qk_without_bias_k"]


class ViTSelfAttention(nn.Module):
    """Structure of transformers 4.x ``ViTSelfAttention`` (``attention.attention.{query,key,value}``)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.num_attention_heads, self.attention_head_size = heads, dim // heads
        self.all_head_size = dim
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        B, T, _ = x.shape
        sh = lambda t: t.view(B, T, self.num_attention_heads, self.attention_head_size).transpose(1, 2)  # noqa: E731
        q, k, v = sh(self.query(x)), sh(self.key(x)), sh(self.value(x))
        probs = self.dropout(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.attention_head_size), -1))
        return (probs @ v).transpose(1, 2).reshape(B, T, self.all_head_size)


class ViTSelfOutput(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dense = nn.Linear(dim, dim)

    def forward(self, x):
        return self.dense(x)


class ViTAttention4x(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention = ViTSelfAttention(dim, heads)
        self.output = ViTSelfOutput(dim)

    def forward(self, x):
        return self.output(self.attention(x))


class ViT4xLike(nn.Module):
    def __init__(self, dim=16, heads=2, depth=2):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(nn.ModuleDict({"attention": ViTAttention4x(dim, heads),
                                                          "layernorm": nn.LayerNorm(dim)}) for _ in range(depth))

    def forward(self, x):
        for blk in self.encoder.layer:
            x = blk["layernorm"](x + blk["attention"](x))
        return x


def test_vit_4x_structure_hand_built():
    torch.manual_seed(0)
    model = ViT4xLike().eval()
    lay = adapters.layout(model)
    assert lay.block_names == [f"encoder.layer.{i}.attention/{k}" for i in range(2) for k in ("qk", "vo")]
    assert lay.blocks[0].family == "hf-bert"
    assert lay.blocks[1].h_pieces[0].param == "encoder.layer.0.attention.output.dense.weight"
    assert lay.verify(model, torch.randn(2, 5, 16)).passed


def test_plain_pytorch_vit_fallback(plain_vit):
    model, inputs = plain_vit
    snap = snapshot(model)
    lay = adapters.layout(model)
    assert lay.block_names == [f"blocks.{i}.attn/{k}" for i in range(2) for k in ("qk", "vo")]
    assert all(b.family == "qkvo" for b in lay.blocks)
    assert "blocks.0.attn.o.bias" in lay.adaptive and "pos" in lay.adaptive and "patch.weight" in lay.adaptive
    assert lay.verify(model, inputs).passed
    assert_unchanged(model, snap)


def test_gpt2_conv1d_layout():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                           bos_token_id=0, eos_token_id=0)).eval()
    lay = adapters.layout(model)
    qk, vo = lay.blocks[:2]
    assert qk.family == "hf-gpt2" and qk.g_pieces[0] == FactorPiece("transformer.h.0.attn.c_attn.weight", "cols", 0, 2, 16)
    assert vo.h_pieces[0] == FactorPiece("transformer.h.0.attn.c_proj.weight", "rows", 0, 2, 16)
    assert bool(lay.gl_masks["transformer.h.0.attn.c_attn.weight"].all())
    assert lay.verify(model, {"input_ids": torch.randint(0, 100, (2, 6)), "use_cache": False}, **FAST).passed


def test_open_clip_through_multihead_attention():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.transformer.VisionTransformer(image_size=16, patch_size=8, width=32, layers=2, heads=2,
                                                    mlp_ratio=2.0, output_dim=16).eval()
    lay = adapters.layout(model)
    assert len(lay.blocks) == 4 and all(b.family == "torch-mha" for b in lay.blocks)
    assert lay.verify(model, torch.randn(2, 3, 16, 16)).passed


def test_frozen_parameters_excluded(tiny_bert):
    model, _ = tiny_bert
    for p in model.bert.embeddings.parameters():
        p.requires_grad_(False)
    lay = adapters.layout(model)
    assert "bert.embeddings.word_embeddings.weight" in lay.frozen
    assert not any(n.startswith("bert.embeddings") for n in lay.adaptive)
    assert len(lay.blocks) == 4 and lay.counts()["frozen"] == sum(
        p.numel() for p in model.bert.embeddings.parameters())
    model.bert.encoder.layer[0].attention.self.key.weight.requires_grad_(False)
    lay = adapters.layout(model)
    assert "bert.encoder.layer.0.attention/qk" not in lay.block_names and len(lay.blocks) == 3
    assert "bert.encoder.layer.0.attention.self.query.weight" in lay.adaptive
    assert any("frozen" in n for n in lay.notes)


# ------------------------------------------------------------------------- user-declared blocks
class MyAttention(nn.Module):
    """Attention with unconventional names (not auto-detected)."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.wa, self.wb, self.wc = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.wd = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        sh = lambda t: t.view(B, T, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = sh(self.wa(x)), sh(self.wb(x)), sh(self.wc(x))
        att = torch.softmax(q @ k.transpose(-1, -2), -1)
        return self.wd((att @ v).transpose(1, 2).reshape(B, T, D))


def test_user_declared_blocks_on_custom_module():
    torch.manual_seed(0)
    model = nn.Sequential(MyAttention(), nn.LayerNorm(16)).eval()
    with pytest.raises(UnsupportedModel, match=r"0 \[MyAttention\]"):
        adapters.layout(model)
    blocks = [declare_block(model, q="0.wa", k="0.wb", num_heads=2),
              declare_block(model, v="0.wc", o="0.wd", num_heads=2)]
    assert blocks[0].name == "0/qk" and (blocks[0].n, blocks[0].m) == (17, 16)   # k without bias
    assert blocks[1].name == "0/vo" and (blocks[1].n, blocks[1].m) == (17, 16)
    lay = adapters.layout(model, blocks=blocks)
    assert lay.unsupported == [] and any("covered by user-declared" in n for n in lay.notes)
    assert lay.verify(model, torch.randn(2, 5, 16)).passed
    # declared without the q bias: a sub-block; the q bias becomes adaptive
    lay2 = adapters.layout(model, blocks=[declare_block(model, q="0.wa", k="0.wb", num_heads=2, bias=False)])
    assert "0.wa.bias" in lay2.adaptive and "0.wa.bias" not in lay2.gl_masks
    with pytest.raises(InvalidArgument, match="declare either"):
        declare_block(model, q="0.wa", v="0.wc", num_heads=2)


def test_declared_packed_offsets_give_partial_masks():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 1,
                                enable_nested_tensor=False).eval()
    path = "layers.0.self_attn.in_proj_weight"
    with pytest.raises(InvalidArgument, match="head_dim is required"):
        declare_block(enc, q=path, k=path, num_heads=4, offsets={"k": 16})
    blk = declare_block(enc, q=path, k=path, num_heads=4, head_dim=4, offsets={"k": 16})
    assert (blk.n, blk.m) == (16, 16)
    lay = adapters.layout(enc, blocks=[blk], detect_blocks=False)
    mask = lay.gl_masks[path]
    assert bool(mask[:32].all()) and not bool(mask[32:].any())
    assert path in lay.adaptive and lay.counts()["gl"] == 2 * 16 * 16
    assert lay.verify(enc, torch.randn(2, 5, 16)).passed
    # the user block replaces the overlapping detected QK block
    lay2 = adapters.layout(enc, blocks=[blk])
    assert lay2.block_names == ["layers.0.self_attn/qk", "layers.0.self_attn/vo"]
    assert [b.family for b in lay2.blocks] == ["declared", "torch-mha"] and any("replaced" in n for n in lay2.notes)


# ----------------------------------------------------------------------- verify catches breaks
def apply_rotary(x, pos):
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype) / half))
    ang = pos[:, None].to(x.dtype) * freq[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RotaryAttention(PlainAttention):
    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        pos = torch.arange(T)
        q, k, v = apply_rotary(split(self.q(x)), pos), apply_rotary(split(self.k(x)), pos), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, -1))


def test_rotary_attention_is_unsupported_and_declared_block_is_caught():
    torch.manual_seed(0)
    model = PlainViT(attn_cls=RotaryAttention).eval()
    with pytest.raises(UnsupportedModel) as err:
        adapters.layout(model)
    msg = str(err.value)
    # only the Q/K half is unsupported (the rotation acts between q and k); V/O is still detected
    assert "blocks.0.attn/qk [RotaryAttention]" in msg and "blocks.1.attn/qk" in msg and "rotary" in msg
    assert [b.name for b in adapters.layout(model, allow_unsupported=True).blocks] == ["blocks.0.attn/vo",
                                                                                       "blocks.1.attn/vo"]
    assert "allow_unsupported=True" in msg and "declare_block" in msg
    # a full-GL Q/K block on rotary attention is refused when declared (it is not a symmetry) ...
    with pytest.raises(InvalidArgument, match="group='rope'"):
        declare_block(model, q="blocks.0.attn.q", k="blocks.0.attn.k", num_heads=2)
    # ... and caught by verify when forced with an explicit group
    blocks = [declare_block(model, q=f"blocks.{i}.attn.q", k=f"blocks.{i}.attn.k", num_heads=2,
                            group=FULL_GL) for i in range(2)]
    blocks += [declare_block(model, v=f"blocks.{i}.attn.v", o=f"blocks.{i}.attn.o", num_heads=2) for i in range(2)]
    lay = adapters.layout(model, blocks=blocks)
    snap = snapshot(model)
    with pytest.raises(SymmetryError) as err:
        lay.verify(model, torch.randn(2, 1, 8, 8))
    report = err.value.report
    assert sorted(report.failing) == ["blocks.0.attn/qk", "blocks.1.attn/qk"]      # VO is still a symmetry
    assert "blocks.0.attn/qk" in str(err.value) and not isinstance(err.value, AssertionError)
    assert min(b.max_rel_dev for b in report.blocks if not b.passed) > 100 * report.rtol
    assert_unchanged(model, snap)
    soft = lay.verify(model, torch.randn(2, 1, 8, 8), raise_on_failure=False)
    assert not soft.passed and "FAIL" in str(soft)
    # with the rotary commutant (rotate_half pairing) the declared blocks are symmetries
    rope = [declare_block(model, q=f"blocks.{i}.attn.q", k=f"blocks.{i}.attn.k", num_heads=2,
                          group="rope") for i in range(2)]
    assert adapters.layout(model, blocks=rope + blocks[2:]).verify(model, torch.randn(2, 1, 8, 8)).passed


def test_misdeclared_blocks_are_caught(plain_vit):
    model, inputs = plain_vit
    a = "blocks.0.attn"
    # one head of 32 instead of two heads of 16: the action mixes heads
    wide = declare_block(model, q=f"{a}.q", k=f"{a}.k", num_heads=1, name="wide_qk")
    assert wide.head_dim == 16
    # k/v swapped
    swapped = declare_block(model, q=f"{a}.q", k=f"{a}.v", num_heads=2, name="swapped_qk")
    good_vo = declare_block(model, v=f"{a}.v", o=f"{a}.o", num_heads=2)
    for bad in (wide, swapped):
        blocks = [bad] if bad is swapped else [bad, good_vo]
        lay = adapters.layout(model, blocks=blocks, detect_blocks=False)
        with pytest.raises(SymmetryError, match=bad.name) as err:
            lay.verify(model, inputs)
        assert err.value.report.failing == [bad.name]
        assert not err.value.report.joint_passed
    # a finer split (4 heads of 4 inside true heads of 8) is a sub-symmetry: passes
    fine = declare_block(model, q=f"{a}.q", k=f"{a}.k", num_heads=4)
    assert adapters.layout(model, blocks=[fine], detect_blocks=False).verify(model, inputs, **FAST).passed


def test_relative_position_bert_4x_structure_is_unsupported():
    class BertSelfAttention(ViTSelfAttention):   # 4.x BERT with position_embedding_type="relative_key"
        def __init__(self, dim, heads):
            super().__init__(dim, heads)
            self.position_embedding_type = "relative_key"
            self.distance_embedding = nn.Embedding(2 * 8 - 1, dim // heads)

    class BertAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.self = BertSelfAttention(16, 2)
            self.output = ViTSelfOutput(16)

    model = nn.ModuleDict({"attention": BertAttention()})
    with pytest.raises(UnsupportedModel) as err:
        adapters.layout(model)
    msg = str(err.value)
    assert "attention [BertSelfAttention]" in msg and "relative_key" in msg and "distance_embedding" in msg


def test_llama_subclass_with_own_forward_gets_structural_blocks():
    """LlamaAttention itself is an allowlisted rotary family (tests/test_families.py); a subclass with
    its own forward() is not on the allowlist and gets its blocks from structure and config (the
    ``structural`` family): grouped-query heads from the config, RoPE from ``position_embeddings``."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = T.LlamaModel(cfg).eval()
    reference = adapters.layout(model)
    assert [b.family for b in reference.blocks] == ["hf-rotary"] * 4

    class MyLlamaAttention(T.models.llama.modeling_llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    for layer in model.layers:
        layer.self_attn.__class__ = MyLlamaAttention
    lay = adapters.layout(model)
    assert [b.family for b in lay.blocks] == ["structural"] * 4 and not lay.unsupported
    for got, want in zip(lay.blocks, reference.blocks):
        assert (got.kind, got.g_pieces, got.h_pieces, got.group) == (want.kind, want.g_pieces, want.h_pieces,
                                                                     want.group)
    assert "rotary_dim=8 half" in lay.blocks[0].group_source


def test_model_without_attention_raises():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(UnsupportedModel, match="(?s)no GL block found in Sequential.*No attention-like module"):
        adapters.layout(model)
    lay = adapters.layout(model, allow_unsupported=True)
    assert lay.blocks == [] and lay.adaptive == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert lay.verify(model, torch.randn(3, 4)).passed     # nothing to check


def test_attention_pooling_head_around_mha_is_not_claimed_by_name():
    class AttentionPoolingHead(nn.Module):   # like SigLIP's head: a learned query + nn.MultiheadAttention
        def __init__(self):
            super().__init__()
            self.probe = nn.Parameter(torch.randn(1, 1, 16))
            self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            return self.attention(self.probe.expand(x.shape[0], -1, -1), x, x)[0][:, 0]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), AttentionPoolingHead()).eval()
    lay = adapters.layout(model)
    assert lay.block_names == ["1.attention/qk", "1.attention/vo"] and lay.unsupported == []
    assert "1.probe" in lay.adaptive
    assert lay.verify(model, torch.randn(2, 5, 8), **FAST).passed


def test_packed_qkv_linear_is_unsupported_not_adaptive():
    class Attention(nn.Module):  # timm-style packed qkv: order is implementation-specific
        def __init__(self):
            super().__init__()
            self.num_heads = 2
            self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    with pytest.raises(UnsupportedModel, match=r"packed projection qkv.*offsets"):
        adapters.layout(nn.Sequential(Attention()))


# --------------------------------------------------------------------- printing, dtypes, safety
def test_print_layout_readable(tiny_bert):
    model, _ = tiny_bert
    text = str(adapters.layout(model))
    print(text)
    lines = text.splitlines()
    assert lines[0] == "Layout of BertForSequenceClassification: 4 GL blocks in 2 modules"
    assert "  bert.encoder.layer.0.attention  [hf-bert]" in lines
    qk = lines.index("      qk: 2 heads x GL(16)  [group: family hf-bert]")
    assert lines[qk + 1:qk + 3] == ["          G (33, 16) = self.query.weight[0:32]ᵀ + self.query.bias[0:32]",
                                    "          H (33, 16) = self.key.weight[0:32]ᵀ + self.key.bias[0:32]"]
    vo = lines.index("      vo: 2 heads x GL(16)  [group: family hf-bert]")
    assert lines[vo + 2] == "          H (32, 16) = output.dense.weight[:, 0:32]"
    assert any(l.startswith("Scalars: total ") and "GL 8,384" in l and "frozen 0" in l for l in lines)
    assert max(map(len, lines)) <= 100, "a layout prints in lines a terminal shows whole"
    layout = adapters.layout(model)
    assert layout.blocks[0].describe(width=50).splitlines()[1:] == [
        "    G (33, 16) = self.query.weight[0:32]ᵀ", "               + self.query.bias[0:32]",
        "    H (33, 16) = self.key.weight[0:32]ᵀ", "               + self.key.bias[0:32]"]
    assert lines[-1] == "Unsupported attention-like modules: none"
    assert "blocks=4" in repr(adapters.layout(model))


def test_verify_dtypes_and_gaussian_actions(plain_vit):
    model, inputs = plain_vit
    lay = adapters.layout(model)
    r64 = lay.verify(copy.deepcopy(model).double(), inputs.double(), **FAST)
    assert r64.passed and r64.dtype == torch.float64 and r64.max_rel_dev < 1e-12
    assert r64.rtol == pytest.approx(default_tolerance(torch.float64, 1e2))
    rbf = lay.verify(copy.deepcopy(model).to(torch.bfloat16), inputs.to(torch.bfloat16), **FAST)
    assert rbf.passed and rbf.dtype == torch.float32      # half precision is checked in float32
    rg = lay.verify(model, inputs, cond=None, per_block=False)
    assert rg.passed and rg.blocks == [] and "not checked one by one" in str(rg)
    assert default_tolerance(torch.float32, 1e2) < 1e-3 and default_tolerance(torch.float64, 1e4) < 1e-10


def test_verify_restores_mixed_training_flags(plain_vit):
    model, inputs = plain_vit
    model.train()
    model.blocks[1].eval()
    snap = snapshot(model)
    adapters.layout(model).verify(model, inputs, **FAST)
    assert_unchanged(model, snap)


def test_reparametrised_copy_is_the_same_function_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    layout = adapters.layout(model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    actions = layout.random_actions(params, scale=1.0, cond=1e3, generator=torch.Generator().manual_seed(1))
    other = layout.reparametrised(model, actions)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), params[name]), name          # the original is untouched
    moved = {n: p.detach() for n, p in other.named_parameters()}
    expected = layout.act(params, actions)
    assert all(torch.equal(moved[n], expected[n]) for n in params)
    assert any(not torch.allclose(moved[n], params[n]) for n in params)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(other(x, x, x)[0], model(x, x, x)[0], atol=1e-10)
