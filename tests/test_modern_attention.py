"""Modern attention out of the box: rotary positions, grouped-query attention, QK-norm, LoRA pairs.

For each family (tiny models from config, random weights): the detected layout passes ``verify``
with random elements of each block's own group (condition 1e2, scales 1e-2 … 1e2); geodesic
sharpness is invariant under those reparametrisations while adaptive sharpness is not; a RoPE Q/K
block treated as full GL(h) fails ``verify``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from quotient_manifolds import adapters
from quotient_manifolds.adapters import sharpness
from quotient_manifolds.adapters.layouts import Layout
from quotient_manifolds.core import FULL_GL, RotaryGroup
from conftest import reparametrised_copy

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 12
SCALES = (1e-2, 1.0, 1e2)  # the extremes and a unit-scale random action


def _decoder(cls_name: str, dtype=torch.float32, **extra):
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, cls_name)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64)
    cfg.update(extra)
    torch.manual_seed(0)
    return model_cls(config_cls(**cfg)).to(dtype).eval()


def _lora(base, targets, task_type=None):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      task_type=task_type))
    # peft initialises lora_B at zero (a rank-deficient factor): give the pairs trained-like values
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def _bert_classifier(dtype=torch.float32):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).to(dtype).eval()


BUILDERS = {
    "llama-mha": lambda dt=torch.float32: _decoder("LlamaForCausalLM", dt, num_key_value_heads=4),
    "llama-gqa": lambda dt=torch.float32: _decoder("LlamaForCausalLM", dt, num_key_value_heads=2),
    "llama-mqa": lambda dt=torch.float32: _decoder("LlamaForCausalLM", dt, num_key_value_heads=1),
    "mistral": lambda dt=torch.float32: _decoder("MistralForCausalLM", dt, num_key_value_heads=2),
    "qwen2": lambda dt=torch.float32: _decoder("Qwen2ForCausalLM", dt, num_key_value_heads=2),
    "qwen3": lambda dt=torch.float32: _decoder("Qwen3ForCausalLM", dt, num_key_value_heads=2, head_dim=8),
    "phi": lambda dt=torch.float32: _decoder("PhiForCausalLM", dt, partial_rotary_factor=0.5),
    "gpt2": lambda dt=torch.float32: _gpt2(dt),
    "lora-bert": lambda dt=torch.float32: _lora(_bert_classifier(dt), ["query", "value"], "SEQ_CLS"),
    "lora-llama": lambda dt=torch.float32: _lora(
        _decoder("LlamaForCausalLM", dt, num_key_value_heads=2), ["q_proj", "k_proj", "v_proj", "o_proj"]),
}
CAUSAL = {name for name in BUILDERS if name != "lora-bert"}


def _gpt2(dtype):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype).eval()


def causal_loss(outputs, ids):
    """Next-token cross-entropy (what ``adapters.next_token_loss`` computes for causal LMs)."""
    logits = outputs.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def inputs_for(name):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    if name in CAUSAL:
        return ids, ids, causal_loss
    return ids, torch.randint(0, 3, (3,), generator=g), None


# ------------------------------------------------------------------------------------ layouts
EXPECTED_GROUPS = {   # kind -> group description of the detected blocks (head_dim 8)
    "llama-mha": {"qk": "GL(1,C)^4 [half pairs]", "vo": "GL(8)"},
    "llama-gqa": {"qk": "GL(1,C)^4 [half pairs]", "vo": "GL(8)"},
    "phi": {"qk": "GL(1,C)^2 [half pairs] x GL(4) [rotary_dim=4]", "vo": "GL(8)"},
    "qwen3": {"vo": "GL(8)"},
    "gpt2": {"qk": "GL(8)", "vo": "GL(8)"},
    "lora-llama": {"lora": "GL(4)"},
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_layout_verifies_with_its_own_groups(name):
    model = BUILDERS[name]()
    layout = adapters.layout(model)
    ids = inputs_for(name)[0]
    report = layout.verify(model, ids)                   # raises SymmetryError on failure
    assert report.passed and layout.verify_failed == []
    kinds = {b.kind: b.group.describe(b.head_dim) for b in layout.blocks}
    for kind, group in EXPECTED_GROUPS.get(name, {}).items():
        assert kinds.get(kind) == group, (kind, kinds)
    print(f"{name}: max rel dev {report.max_rel_dev:.2e}")


def test_gqa_blocks_share_one_gauge_per_kv_head():
    model = BUILDERS["llama-gqa"]()
    layout = adapters.layout(model)
    qk = next(b for b in layout.blocks if b.kind == "qk")
    vo = next(b for b in layout.blocks if b.kind == "vo")
    # 2 KV heads; G of QK stacks 2 query heads (2 × 32 rows), H of VO stacks 2 output slices
    assert (qk.num_heads, qk.n, qk.m) == (2, 64, 32)
    assert (vo.num_heads, vo.n, vo.m) == (2, 32, 64)


def test_qk_norm_keeps_vo_as_gl_and_says_qk_is_elementwise():
    model = BUILDERS["qwen3"]()
    layout = adapters.layout(model)
    assert {b.kind for b in layout.blocks} == {"vo"}
    assert any("q_proj" in n for n in layout.adaptive)
    assert any("QK-norm" in note for note in layout.notes), layout.notes
    assert "QK-norm" in str(layout)


def test_rope_qk_block_as_full_gl_fails_verify():
    model = BUILDERS["llama-gqa"]()
    layout = adapters.layout(model)
    wrong = [dataclasses.replace(b, group=FULL_GL) if b.kind == "qk" else b for b in layout.blocks]
    bad = Layout(blocks=wrong, adaptive=layout.adaptive, gl_masks=layout.gl_masks,
                 frozen=layout.frozen, unsupported=[], param_shapes=layout.param_shapes)
    report = bad.verify(model, inputs_for("llama-gqa")[0], raise_on_failure=False)
    assert not report.passed
    assert set(report.failing) == {b.name for b in wrong if b.kind == "qk"}
    assert bad.verify_failed == report.failing
    assert min(b.max_rel_dev for b in report.blocks if b.kind == "qk") > 1e-2


def test_interleaved_pairing_is_not_rotate_half():
    """The pairing matters: HF models rotate (i, i + d/2); declaring (2i, 2i+1) fails verify."""
    model = BUILDERS["llama-mha"]()
    layout = adapters.layout(model)
    wrong = [dataclasses.replace(b, group=RotaryGroup("interleaved")) if b.kind == "qk" else b
             for b in layout.blocks]
    bad = Layout(blocks=wrong, adaptive=[], gl_masks={}, frozen=[], unsupported=[])
    assert not bad.verify(model, inputs_for("llama-mha")[0], raise_on_failure=False).passed


def test_lora_pairs_are_gl_r_blocks_and_base_weights_stay_out():
    model = BUILDERS["lora-llama"]()
    layout = adapters.layout(model)
    lora = [b for b in layout.blocks if b.kind == "lora"]
    assert len(lora) == 2 * 4 and all(b.head_dim == 4 and b.num_heads == 1 for b in lora)
    assert not any(b.kind in ("qk", "vo") for b in layout.blocks)
    assert all("base_layer" not in n for n in layout.adaptive)        # frozen, not in the ball
    assert any("base_layer" in n for n in layout.frozen)
    params = dict(model.named_parameters())
    q = next(b for b in lora if "q_proj" in b.name)
    G, H = q.split(q.gather(params))
    lora_B = params[q.g_pieces[0].param]
    lora_A = params[q.h_pieces[0].param]
    assert torch.equal(G[0], lora_B) and torch.equal(H[0], lora_A.T)


# ------------------------------------------------------------------------------------ sharpness
RHO = 0.05


def _sharpness(model, name, geometry, dtype=torch.float32):
    ids, targets, loss_fn = inputs_for(name)
    return sharpness(model, [(ids, targets)], geometry=geometry, rho=RHO, n_iters=6,
                     loss_fn=loss_fn).value


def _ratios(model, name, geometry, scales):
    base = _sharpness(model, name, geometry)
    assert base > 0
    return [_sharpness(reparametrised_copy(model, scale=a, cond=1e2), name, geometry) / base
            for a in scales]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_geodesic_sharpness_invariant_under_each_group_float32(name):
    model = BUILDERS[name]()
    for geometry in ("geodesic-inv", "geodesic-mix"):
        ratios = _ratios(model, name, geometry, SCALES)
        assert max(abs(r - 1) for r in ratios) < 1e-3, (geometry, ratios)
    adaptive = _ratios(model, name, "adaptive", [1e-2, 1e2])
    assert max(abs(r - 1) for r in adaptive) > 1e-2, adaptive


@pytest.mark.parametrize("name", ["llama-gqa", "phi", "lora-llama"])
def test_geodesic_sharpness_invariant_float64(name):
    model = BUILDERS[name](torch.float64)
    for geometry in ("geodesic-inv", "geodesic-mix"):
        ratios = _ratios(model, name, geometry, [1e-2, 1.0, 1e2])
        assert max(abs(r - 1) for r in ratios) < 1e-6, (geometry, ratios)


def test_sharpness_ball_uses_each_blocks_group():
    """The quotient components of the ball carry the block's own group (a RoPE Q/K block projected
    with the full-GL vertical space would still be invariant, but on the wrong horizontal space)."""
    model = BUILDERS["phi"]()
    layout = adapters.layout(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    ball, _ = adapters.ball.build_ball(model, params, geometry="geodesic-inv", layout=layout)
    groups = {c.frame.geometry.group for c in ball.components if hasattr(c, "frame")}
    assert groups == {RotaryGroup("half", 4), FULL_GL}
    dims = sorted(c.frame.geometry.dim for c in ball.components if hasattr(c, "frame"))
    h = 8
    assert dims == sorted([(33 + 33) * h - (4 + 4 ** 2), (33 + 32) * h - h * h])
