"""Model families (``adapters.families``): the registry, the structure of the blocks each family
finds (rotary groups, grouped-query gauges, QK-norm notes, LoRA GL(r) pairs), and ``verify`` on
tiny models from config (random weights): every detected layout passes with random elements of its
blocks' own groups (condition 1e2, scales 1e-2 … 1e2), a rotary Q/K block declared as full GL fails."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from quotient_manifolds import adapters
from quotient_manifolds.adapters import SymmetryError, declare_block
from quotient_manifolds.adapters.blocks import FactorPiece
from quotient_manifolds.adapters.families import FAMILIES, Context, Family, Match, register_family, unregister_family
from quotient_manifolds.adapters.families.structure import LORA_NOTE, projection, attention_blocks
from quotient_manifolds.core import FULL_GL, RotaryGroup
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UnknownName, UnsupportedModel

T = pytest.importorskip("transformers")

VOCAB = 64
IDS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))


def decoder(name: str, **extra) -> nn.Module:
    """Tiny ``<name>ForCausalLM``: hidden 32, 2 layers, 4 heads of 8."""
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64)
    cfg.update(extra)
    torch.manual_seed(0)
    return getattr(T, f"{name}ForCausalLM")(getattr(T, f"{name}Config")(**cfg)).eval()


def bert() -> nn.Module:
    torch.manual_seed(0)
    return T.BertForSequenceClassification(T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=4, intermediate_size=64,
                                                        num_labels=3)).eval()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                          bos_token_id=0, eos_token_id=0)).eval()


def with_lora(model: nn.Module, targets, **config) -> nn.Module:
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, **config))
    with torch.no_grad():        # peft starts B at zero (rank 0): give the pairs generic values
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


BUILDERS = {
    "llama-mha": lambda: decoder("Llama", num_key_value_heads=4),
    "llama-gqa": lambda: decoder("Llama", num_key_value_heads=2),
    "mistral": lambda: decoder("Mistral", num_key_value_heads=2),
    "qwen2": lambda: decoder("Qwen2", num_key_value_heads=2),
    "qwen3": lambda: decoder("Qwen3", num_key_value_heads=2, head_dim=8),
    "phi": lambda: decoder("Phi", partial_rotary_factor=0.5),
    "phi3": lambda: decoder("Phi3", num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0,
                            eos_token_id=0, bos_token_id=0),
    "gemma2": lambda: decoder("Gemma2", num_key_value_heads=2, head_dim=8),
    "gpt-neox": lambda: decoder("GPTNeoX", rotary_pct=0.5),
    "gpt2": gpt2,
    "bert": bert,
    "lora-bert": lambda: with_lora(bert(), ["query", "value"]),
    "lora-llama": lambda: with_lora(decoder("Llama", num_key_value_heads=2), ["q_proj", "k_proj", "v_proj", "o_proj"]),
}
ROPE_HALF_8 = "GL(1,C)^4 [half pairs]"
ROPE_HALF_4_OF_8 = "GL(1,C)^2 [half pairs] x GL(4) [rotary_dim=4]"
EXPECTED = {   # name -> (family of the blocks, {kind: group})
    "llama-mha": ("hf-rotary", {"qk": ROPE_HALF_8, "vo": "GL(8)"}),
    "llama-gqa": ("hf-rotary", {"qk": ROPE_HALF_8, "vo": "GL(8)"}),
    "mistral": ("hf-rotary", {"qk": ROPE_HALF_8, "vo": "GL(8)"}),
    "qwen2": ("hf-rotary", {"qk": ROPE_HALF_8, "vo": "GL(8)"}),
    "qwen3": ("hf-rotary", {"vo": "GL(8)"}),
    "phi": ("hf-rotary", {"qk": ROPE_HALF_4_OF_8, "vo": "GL(8)"}),
    "phi3": ("hf-rotary", {"qk": ROPE_HALF_4_OF_8, "vo": "GL(8)"}),
    "gemma2": ("hf-rotary", {"qk": ROPE_HALF_8, "vo": "GL(8)"}),
    "gpt-neox": ("hf-rotary", {"qk": ROPE_HALF_4_OF_8, "vo": "GL(8)"}),
    "gpt2": ("hf-gpt2", {"qk": "GL(8)", "vo": "GL(8)"}),
    "bert": ("hf-bert", {"qk": "GL(8)", "vo": "GL(8)"}),
    "lora-bert": ("peft-lora", {"lora": "GL(4)"}),
    "lora-llama": ("peft-lora", {"lora": "GL(4)"}),
}
ROTARY = [n for n, (_, groups) in EXPECTED.items() if "GL(1,C)" in groups.get("qk", "")]


def param(model, name):
    return dict(model.named_parameters())[name]


# ------------------------------------------------------------------------------ verify per family
@pytest.mark.parametrize("name", list(BUILDERS))
def test_detected_layout_verifies_with_its_own_groups(name):
    model = BUILDERS[name]()
    lay = adapters.layout(model)
    print(lay)
    family, groups = EXPECTED[name]
    assert lay.unsupported == [] and {b.family for b in lay.blocks} == {family}
    assert {b.kind: b.group.describe(b.head_dim) for b in lay.blocks} == groups
    report = lay.verify(model, {"input_ids": IDS})
    assert report.passed and report.max_rel_dev < 1e-4
    print(f"{name}: max rel dev {report.max_rel_dev:.2e} (float32)")


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_qk_block_as_full_gl_fails_verify(name):
    model = BUILDERS[name]()
    detected = adapters.layout(model).blocks
    # passing the detected blocks back in keeps their groups (and GQA grouping) and still verifies
    assert adapters.layout(model, blocks=detected, detect_blocks=False).blocks == detected
    wrong = [dataclasses.replace(b, group=FULL_GL) if b.kind == "qk" else b for b in detected]
    lay = adapters.layout(model, blocks=wrong, detect_blocks=False)
    with pytest.raises(SymmetryError) as err:
        lay.verify(model, {"input_ids": IDS})
    report = err.value.report
    assert sorted(report.failing) == sorted(b.name for b in wrong if b.kind == "qk")
    assert min(b.max_rel_dev for b in report.blocks if b.kind == "qk") > 10 * report.rtol


# ------------------------------------------------------------------------------ block structure
def test_llama_gqa_one_gauge_per_kv_head():
    model = BUILDERS["llama-gqa"]()
    lay = adapters.layout(model)
    assert lay.block_names == [f"model.layers.{i}.self_attn/{k}" for i in range(2) for k in ("qk", "vo")]
    qk, vo = lay.blocks[:2]
    a = "model.layers.0.self_attn"
    # 4 query heads of 8 in 2 groups: G of QK stacks 2 query heads per key head
    assert qk.g_pieces == (FactorPiece(f"{a}.q_proj.weight", "rows", 0, 4, 8, group_size=2),)
    assert qk.h_pieces == (FactorPiece(f"{a}.k_proj.weight", "rows", 0, 2, 8),)
    assert vo.g_pieces == (FactorPiece(f"{a}.v_proj.weight", "rows", 0, 2, 8),)
    assert vo.h_pieces == (FactorPiece(f"{a}.o_proj.weight", "cols", 0, 4, 8, group_size=2),)
    assert (qk.num_heads, qk.n, qk.m, vo.num_heads, vo.n, vo.m) == (2, 64, 32, 2, 32, 64)
    assert qk.group == RotaryGroup("half") and vo.group == FULL_GL
    # query heads 2j, 2j+1 read key head j: the gauge of KV head j acts on both query slices
    G, H = qk.split(qk.gather(dict(model.named_parameters())))
    Wq, Wk = param(model, f"{a}.q_proj.weight"), param(model, f"{a}.k_proj.weight")
    assert torch.equal(G[1], torch.cat([Wq[16:24].T, Wq[24:32].T])) and torch.equal(H[1], Wk[8:16].T)
    assert "x2 heads per gauge" in str(lay)


def test_llama_without_gqa_and_qwen2_biases():
    mha = adapters.layout(BUILDERS["llama-mha"]()).blocks[0]
    assert (mha.num_heads, mha.g_pieces[0].group_size, mha.n, mha.m) == (4, 1, 32, 32)
    qk, vo = adapters.layout(BUILDERS["qwen2"]()).blocks[:2]
    a = "model.layers.0.self_attn"
    assert qk.g_pieces[1] == FactorPiece(f"{a}.q_proj.bias", "bias", 0, 4, 8, group_size=2)
    assert qk.h_pieces[1] == FactorPiece(f"{a}.k_proj.bias", "bias", 0, 2, 8)
    assert (qk.n, qk.m, vo.n, vo.m) == (2 * 33, 33, 33, 64)       # o_proj has no bias in Qwen2


def test_phi_partial_rotary_and_dense_output():
    qk, vo = adapters.layout(BUILDERS["phi"]()).blocks[:2]
    assert qk.group == RotaryGroup("half", rotary_dim=4)
    assert vo.h_pieces == (FactorPiece("model.layers.0.self_attn.dense.weight", "cols", 0, 4, 8),)


def test_packed_projections_phi3_and_gpt_neox():
    qk, vo = adapters.layout(BUILDERS["phi3"]()).blocks[:2]
    w = "model.layers.0.self_attn.qkv_proj.weight"            # rows [q (4x8) | k (2x8) | v (2x8)]
    assert qk.g_pieces == (FactorPiece(w, "rows", 0, 4, 8, group_size=2),)
    assert (qk.h_pieces[0].offset, vo.g_pieces[0].offset) == (32, 48)
    lay = adapters.layout(BUILDERS["gpt-neox"]())
    qk, vo = lay.blocks[:2]
    w = "gpt_neox.layers.0.attention.query_key_value.weight"   # rows [q_i k_i v_i] per head
    assert [(p.param, p.offset, p.stride) for p in qk.pieces if p.kind == "rows"] == [(w, 0, 24), (w, 8, 24)]
    assert vo.g_pieces[0].offset == 16 and vo.g_pieces[0].stride == 24
    assert bool(lay.gl_masks[w].all())                         # q, k, v interleaved rows all covered


@pytest.mark.parametrize("name, extra", [("qwen3", {}), ("phi", {"qk_layernorm": True})])
def test_qk_norm_keeps_vo_and_notes_qk_elementwise(name, extra):
    model = BUILDERS[name]() if not extra else decoder("Phi", partial_rotary_factor=0.5, **extra)
    lay = adapters.layout(model)                                # no error: a deliberate choice
    assert [b.kind for b in lay.blocks] == ["vo", "vo"] and lay.unsupported == []
    assert "model.layers.0.self_attn.q_proj.weight" in lay.adaptive
    assert "model.layers.0.self_attn.k_proj.weight" not in lay.gl_masks
    notes = [n for n in lay.notes if "QK-norm" in n]
    assert len(notes) == 2 and notes[0].startswith("model.layers.0.self_attn: Q/K weights treated elementwise")
    assert ("all-ones" in notes[0]) == bool(extra)             # Phi's LayerNorm also allows a shift
    assert "Note: model.layers.1.self_attn: Q/K weights" in str(lay)
    assert lay.verify(model, {"input_ids": IDS}, scales=(1e-2, 1e2)).passed


def test_gpt2_and_bert_structure_unchanged():
    qk, vo = adapters.layout(gpt2()).blocks[:2]
    assert qk.g_pieces[0] == FactorPiece("transformer.h.0.attn.c_attn.weight", "cols", 0, 4, 8)
    assert qk.h_pieces[0].offset == 32 and vo.g_pieces[0].offset == 64
    assert vo.h_pieces[0] == FactorPiece("transformer.h.0.attn.c_proj.weight", "rows", 0, 4, 8)
    qk, vo = adapters.layout(bert()).blocks[:2]
    assert qk.module == "bert.encoder.layer.0.attention" and qk.family == "hf-bert"
    assert vo.h_pieces == (FactorPiece("bert.encoder.layer.0.attention.output.dense.weight", "cols", 0, 4, 8),)


# ------------------------------------------------------------------------------ LoRA
def test_lora_pairs_are_gl_r_blocks_and_keep_the_product():
    model = BUILDERS["lora-llama"]()
    lay = adapters.layout(model)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert lay.block_names[:4] == [f"base_model.model.model.layers.0.self_attn.{p}/lora[default]"
                                   for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    blk = lay.block(f"{q}/lora[default]")
    assert (blk.kind, blk.module, blk.num_heads, blk.head_dim, blk.n, blk.m) == ("lora", q, 1, 4, 32, 32)
    assert blk.g_pieces == (FactorPiece(f"{q}.lora_B.default.weight", "cols", 0, 1, 4),)
    assert blk.h_pieces == (FactorPiece(f"{q}.lora_A.default.weight", "rows", 0, 1, 4),)
    # no block over the frozen base weights, and no complaint about them
    assert {b.kind for b in lay.blocks} == {"lora"} and lay.unsupported == []
    assert sum(LORA_NOTE in n for n in lay.notes) == 2
    assert f"{q}.base_layer.weight" in lay.frozen and not any("base_layer" in n for n in lay.adaptive)
    # (B M, M⁻¹ A) for a random M keeps s·B·A
    params = {n: p.detach().double() for n, p in model.named_parameters()}
    acted = lay.act(params, lay.random_actions(params, scale=10.0, generator=torch.Generator().manual_seed(0)))
    B, A = (f"{q}.lora_{x}.default.weight" for x in "BA")
    assert not torch.allclose(acted[B], params[B])
    torch.testing.assert_close(acted[B] @ acted[A], params[B] @ params[A], rtol=1e-10, atol=1e-12)


def test_lora_several_adapters_dora_and_partial_targets():
    peft = pytest.importorskip("peft")
    model = with_lora(bert(), ["query", "key"])
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["query"]))
    for name, p in model.named_parameters():      # peft freezes the inactive adapter: train both
        p.requires_grad_(p.requires_grad or "lora_" in name)
    lay = adapters.layout(model)
    q = "base_model.model.bert.encoder.layer.0.attention.self.query"
    assert [b.name for b in lay.blocks if b.module == q] == [f"{q}/lora[default]", f"{q}/lora[second]"]
    assert lay.block(f"{q}/lora[second]").head_dim == 2
    # only q/k adapted: the V/O block is detected over the (frozen) base weights and dropped as frozen
    assert any("attention/vo dropped" in n and "frozen" in n for n in lay.notes)
    assert any("attention: no GL block over the base weights of qk (query, key)" in n for n in lay.notes)
    dora = with_lora(bert(), ["query"], use_dora=True)
    lay = adapters.layout(dora, allow_unsupported=True)
    assert not any(b.kind == "lora" for b in lay.blocks)
    assert any("uses a LoRA variant (DoraLinearVariant)" in n for n in lay.notes)


def test_lora_structure_without_peft(monkeypatch):
    """Without peft, LoRA layers are recognised by structure alone (base_layer + lora_A/lora_B
    ModuleDicts of nn.Linear); with peft installed, a look-alike must also be a peft BaseTunerLayer."""
    from quotient_manifolds.adapters.families import structure
    class LoRALinear(nn.Module):
        def __init__(self, base, r=3):
            super().__init__()
            self.base_layer = base
            self.lora_A = nn.ModuleDict({"a": nn.Linear(base.in_features, r, bias=False)})
            self.lora_B = nn.ModuleDict({"a": nn.Linear(r, base.out_features, bias=True)})

        def forward(self, x):
            return self.base_layer(x) + self.lora_B["a"](self.lora_A["a"](x))

    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(nn.Linear(6, 5)), nn.Tanh(), nn.Linear(5, 2))
    if structure.peft_tuner_layer() is not None:
        assert adapters.layout(model, allow_unsupported=True).blocks == []
    monkeypatch.setattr(structure, "peft_tuner_layer", lambda: None)
    lay = adapters.layout(model)
    assert lay.block_names == ["0/lora[a]"] and "0.lora_B.a.bias" in lay.adaptive
    assert lay.verify(model, torch.randn(4, 6)).passed


# ------------------------------------------------------------------------------ Q/K-only unsupported
class RotaryAttention(nn.Module):
    """An unknown class with rotary positions: V/O is a GL block, Q/K only the rotary commutant."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, L, _ = x.shape
        split = lambda t: t.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        half = self.head_dim // 2
        ang = torch.arange(L)[:, None] / 10000 ** (torch.arange(half) / half)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def apply_rotary(t):
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        q, k, v = apply_rotary(split(self.q(x))), apply_rotary(split(self.k(x))), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), -1)
        return self.o((att @ v).transpose(1, 2).reshape(B, L, -1))


def test_unknown_rotary_module_keeps_vo_and_reports_qk_part():
    torch.manual_seed(0)
    model = nn.Sequential(RotaryAttention(), nn.LayerNorm(16)).eval()
    x = torch.randn(2, 5, 16)
    with pytest.raises(UnsupportedModel, match=r"(?s)0/qk \[RotaryAttention\]: forward\(\) source mentions apply_rotary"):
        adapters.layout(model)
    lay = adapters.layout(model, allow_unsupported=True)
    assert lay.block_names == ["0/vo"] and [u.module for u in lay.unsupported] == ["0/qk"]
    assert "0.q.weight" in lay.adaptive and lay.verify(model, x).passed
    # a declared V/O block does not cover the Q/K part ...
    with pytest.raises(UnsupportedModel, match=r"0/qk"):
        adapters.layout(model, blocks=[declare_block(model, v="0.v", o="0.o", num_heads=2)])
    # ... a declared rotary Q/K block does, and verifies
    qk = declare_block(model, q="0.q", k="0.k", num_heads=2, group=RotaryGroup("half"))
    lay = adapters.layout(model, blocks=[qk])
    assert lay.block_names == ["0/qk", "0/vo"] and lay.unsupported == []
    assert "unsupported part qk of module 0 [RotaryAttention] covered by user-declared blocks" in lay.notes
    assert lay.verify(model, x).passed
    bad = adapters.layout(model, blocks=[dataclasses.replace(qk, group=FULL_GL)])
    with pytest.raises(SymmetryError, match="0/qk"):
        bad.verify(model, x)


# ------------------------------------------------------------------------------ registry
class OddAttention(nn.Module):
    """Unconventional names: no built-in family recognises it."""

    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.wa, self.wb, self.wc, self.wd = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, L, D = x.shape
        sh = lambda t: t.view(B, L, self.heads, self.hd).transpose(1, 2)  # noqa: E731
        att = torch.softmax(sh(self.wa(x)) @ sh(self.wb(x)).transpose(-1, -2), -1)
        return self.wd((att @ sh(self.wc(x))).transpose(1, 2).reshape(B, L, D))


class OddFamily(Family):
    name = "odd"

    def match(self, ctx: Context, path: str, module: nn.Module):
        if not isinstance(module, OddAttention):
            return None
        res = Match(path, self.name, type(module).__name__)
        lin = {n: projection(f"{path}.{n}", getattr(module, n)) for n in ("wa", "wb", "wc", "wd")}
        attention_blocks(ctx, res, q=lin["wa"], k=lin["wb"], v=lin["wc"], o=lin["wd"], num_heads=module.heads,
                         head_dim=module.hd)
        res.notes.append(f"{path}: matched by the odd family")
        return res


@pytest.fixture
def odd_family():
    fam = register_family(OddFamily())
    yield fam
    if fam in FAMILIES:
        unregister_family(fam.name)


def test_user_family_extends_the_registry(odd_family):
    assert FAMILIES[0] is odd_family
    torch.manual_seed(0)
    model = nn.Sequential(OddAttention(), nn.LayerNorm(16)).eval()
    lay = adapters.layout(model)
    assert lay.block_names == ["0/qk", "0/vo"] and {b.family for b in lay.blocks} == {"odd"}
    assert lay.notes == ["0: matched by the odd family"]
    assert lay.verify(model, torch.randn(2, 5, 16)).passed
    unregister_family("odd")
    with pytest.raises(UnsupportedModel, match=r"0 \[OddAttention\]"):      # back to unsupported
        adapters.layout(model)


def test_register_family_order_and_errors(odd_family):
    with pytest.raises(InvalidArgument, match="already registered"):
        register_family(OddFamily())
    with pytest.raises(InvalidArgumentType, match="Family instance"):
        register_family(object())
    with pytest.raises(UnknownName, match="no family named 'nope'"):
        register_family(type("Later", (OddFamily,), {"name": "later"})(), before="nope")
    later = register_family(type("Later", (OddFamily,), {"name": "later"})(), before="unknown")
    try:
        names = [f.name for f in FAMILIES]
        assert names.index("later") == names.index("unknown") - 1 and names[0] == "odd"
    finally:
        unregister_family("later")


def test_detect_with_explicit_families_and_nesting():
    model = BUILDERS["lora-bert"]()
    only_lora = [f for f in FAMILIES if f.nested]
    det = adapters.detect(model, families=only_lora)
    assert {b.kind for b in det.blocks} == {"lora"} and det.unsupported == []
    # without the nested family, the attention modules still yield no block over adapted projections
    det = adapters.detect(model, families=[f for f in FAMILIES if not f.nested])
    assert det.blocks == [] and det.unsupported == []
    assert all(LORA_NOTE in n for n in det.notes) and len(det.notes) == 2
