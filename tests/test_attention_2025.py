"""The attention of 2025 detected by structure: attention sinks, NoPE layers, interleaved (complex)
rotary, weightless QK norms, multi-head latent attention.

Each case is a tiny float64 model built from config (or a small module written here where
transformers has none).  The symmetry action is written here, independently of the detector: per
gauge a random element ``A`` of the true group, times a scale ``s`` where the group has the
scalars, is applied by editing the weight rows/columns the module's ``forward`` reads as that head
(``W_q ← Aᵀ W_q``, ``W_k ← A⁻¹ W_k``, ``W_v ← Aᵀ W_v``, ``W_o[:, head] ← W_o[:, head] A⁻ᵀ``).  The
output must not change (a symmetry), the detected layout needs no declaration and verifies on the
first try, its blocks have the expected groups, and geodesic-inv / geodesic-mix sharpness is
invariant (1e-6) at scales 1e-2 and 1e2.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from quotient_manifolds import adapters
from quotient_manifolds.core import FULL_GL, RotaryGroup
from quotient_manifolds.errors import InvalidArgument

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 48, 10
SCALES = (1e-2, 1e2)


def _model(name: str, model_cls: str = "", **cfg):
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(**cfg)
    return getattr(transformers, model_cls or f"{name}ForCausalLM")(config).double().eval()


def _gl(h: int, gen: torch.Generator) -> torch.Tensor:
    """Random element of GL(h) with condition number 1e2."""
    u, _ = torch.linalg.qr(torch.randn(h, h, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(h, h, generator=gen, dtype=torch.float64))
    return u @ torch.diag(torch.logspace(-1, 1, h, dtype=torch.float64)) @ v


def _pairs(h: int, pairing: str):
    return [(i, i + h // 2) for i in range(h // 2)] if pairing == "half" else [(2 * i, 2 * i + 1)
                                                                               for i in range(h // 2)]


def _rotary_commutant(h: int, pairing: str, gen: torch.Generator) -> torch.Tensor:
    """Random element commuting with every rotation of the pairs: a·I + b·J on each pair."""
    A = torch.zeros(h, h, dtype=torch.float64)
    for i, j in _pairs(h, pairing):
        a, b = (10 ** (2 * torch.rand(2, generator=gen, dtype=torch.float64) - 1)).tolist()
        A[i, i] = A[j, j] = a
        A[i, j], A[j, i] = b, -b
    return A


def _pair_rotations(h: int, pairing: str, gen: torch.Generator) -> torch.Tensor:
    """A random rotation of each rotary pair: an element of SO(2)^{h/2}."""
    A = torch.zeros(h, h, dtype=torch.float64)
    for i, j in _pairs(h, pairing):
        t = float(2 * math.pi * torch.rand((), generator=gen, dtype=torch.float64))
        A[i, i] = A[j, j] = math.cos(t)
        A[i, j], A[j, i] = math.sin(t), -math.sin(t)
    return A


def _rows(start: int, h: int):
    return list(range(start, start + h))


def _act_separate(model, attentions, sample_qk, sample_vo, scale, seed=0):
    """A copy of ``model`` acted on: ``attentions(m)`` yields the attention modules (separate
    ``q_proj``/``k_proj``/``v_proj``/``o_proj``, grouped-query heads as HF ``repeat_kv``);
    ``sample_qk(layer, gen)`` gives the Q/K element of one gauge (None: Q/K not acted on) and its
    scale flag; ``sample_vo(gen)`` the V/O element, multiplied by ``scale``."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer, a in enumerate(attentions(new)):
            n_q, h = a.config.num_attention_heads, a.head_dim
            n_kv = a.config.num_key_value_heads
            rep = n_q // n_kv
            for g in range(n_kv):
                qk = sample_qk(layer, gen)
                if qk is not None:
                    A, scalable = qk
                    A = A * (scale if scalable else 1.0)
                    for lin, M, heads in ((a.q_proj, A.T, range(g * rep, (g + 1) * rep)),
                                          (a.k_proj, A.inverse(), [g])):
                        for i in heads:
                            rows = _rows(i * h, h)
                            lin.weight[rows] = M @ lin.weight[rows]
                            if lin.bias is not None:
                                lin.bias[rows] = M @ lin.bias[rows]
                A = scale * sample_vo(gen)
                rows = _rows(g * h, h)
                a.v_proj.weight[rows] = A.T @ a.v_proj.weight[rows]
                if a.v_proj.bias is not None:
                    a.v_proj.bias[rows] = A.T @ a.v_proj.bias[rows]
                for i in range(g * rep, (g + 1) * rep):
                    cols = _rows(i * h, h)
                    a.o_proj.weight[:, cols] = a.o_proj.weight[:, cols] @ A.inverse().T
    return new


def _ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(out, targets):
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _groups(layout):
    """``{(module, kind): group}`` of the layout's blocks."""
    return {(b.module, b.kind): b.group for b in layout.blocks}


def _check_invariance(model, act, layout, inputs, targets):
    """``act(scale)`` is a symmetry at each scale and sharpness (inv, mix) does not move under it;
    the layout verifies on the first try."""
    assert not layout.unsupported, layout.unsupported
    assert layout.verify(model, inputs).passed
    out = lambda m: m(**inputs).logits if isinstance(inputs, dict) else m(inputs)  # noqa: E731
    before = out(model)
    batch = [(inputs, targets)]
    kws = [dict(geometry=g, rho=0.01, n_iters=2, loss_fn=_loss, layout=layout, check_retraction=False)
           for g in ("geodesic-inv", "geodesic-mix")]
    base = [adapters.sharpness(model, batch, **kw).value for kw in kws]
    for scale in SCALES:
        acted = act(scale)
        change = ((out(acted) - before).abs().max() / before.abs().max()).item()
        assert change < 1e-10, f"the test's action is not a symmetry at scale {scale}: change {change:.2e}"
        for kw, value in zip(kws, base):
            moved = adapters.sharpness(acted, batch, **kw).value
            assert abs(moved / value - 1) < 1e-6, (kw["geometry"], scale, value, moved)


def _layers(model):
    return [layer.self_attn for layer in model.model.layers]


# ---------------------------------------------------------------------------------------- sinks


def test_attention_sinks_keep_both_groups():
    """GPT-OSS: a learned logit per head (``sinks``) is appended to each score row.  It depends on
    none of q, k, v: Q/K keeps the rotary commutant, V/O keeps GL(h), and the blocks say why."""
    h, n_q, n_kv = 8, 4, 2
    model = _model("GptOss", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=n_q, num_key_value_heads=n_kv, head_dim=h, num_local_experts=2,
                   num_experts_per_tok=1, max_position_embeddings=64, experts_implementation="eager")
    with torch.no_grad():
        for a in _layers(model):
            a.sinks.normal_(0.0, 1.0)                  # sinks that matter (initialised near 0)
    layout = adapters.layout(model)
    assert set(_groups(layout).values()) == {RotaryGroup("half"), FULL_GL} and len(layout.blocks) == 4
    assert all("attention sinks (sinks)" in b.group_source for b in layout.blocks)
    assert all("probed apply_rotary_pos_emb" in b.group_source for b in layout.blocks if b.kind == "qk")  # YaRN
    assert not any(n.endswith("sinks") for b in layout.blocks for n in b.params)
    ids = _ids()
    act = lambda s: _act_separate(model, _layers, lambda _, g: (_rotary_commutant(h, "half", g), True),  # noqa: E731
                                  lambda g: _gl(h, g), s)
    _check_invariance(model, act, layout, {"input_ids": ids}, ids)


class SinkAttention(torch.nn.Module):
    """Plain multi-head attention with a learned sink logit per head (no positions)."""

    def __init__(self, dim=16, num_heads=2):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.sinks = torch.nn.Parameter(torch.randn(num_heads))

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        sink = self.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        return self.o_proj((probs @ v).transpose(1, 2).reshape(B, T, -1))


def test_sinks_in_a_plain_module_keep_full_gl():
    """The plain q/k/v/o family: the sinks are no extra parameter, both halves keep GL(h), and an
    ill-conditioned GL action written here leaves the output unchanged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(SinkAttention()).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    layout = adapters.layout(model)
    assert [(b.kind, b.group, b.family) for b in layout.blocks] == [("qk", FULL_GL, "qkvo"), ("vo", FULL_GL, "qkvo")]
    assert all(b.group_source.startswith("attention sinks (sinks)") for b in layout.blocks)
    assert layout.verify(model, x).passed
    moved = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        a = moved[0]
        for i in range(2):
            rows, A, C = _rows(8 * i, 8), _gl(8, gen), _gl(8, gen)
            for lin, M in ((a.q_proj, A.T), (a.k_proj, A.inverse()), (a.v_proj, C.T)):
                lin.weight[rows], lin.bias[rows] = M @ lin.weight[rows], M @ lin.bias[rows]
            a.o_proj.weight[:, rows] = a.o_proj.weight[:, rows] @ C.inverse().T
    assert (moved(x) - model(x)).abs().max() < 1e-12


def test_sinks_of_the_wrong_size_are_still_extra_parameters():
    """A ``sinks`` parameter that is not one scalar per head is not a sink: the module is refused."""
    h = 8
    model = _model("GptOss", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=h, num_local_experts=2,
                   num_experts_per_tok=1, max_position_embeddings=64)
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))
    lay = adapters.layout(model, allow_unsupported=True)
    assert [u.module for u in lay.unsupported] == ["model.layers.0.self_attn"]
    assert "sinks" in lay.unsupported[0].reason


# ---------------------------------------------------------------------------------------- NoPE


def test_nope_layers_keep_full_gl_on_qk():
    """SmolLM3: every second layer switches its rotary map off (``use_rope`` = 0 from
    ``config.no_rope_layers``).  Its Q/K scores are plain: full GL(h), acted on here by
    ill-conditioned elements, where the rotary commutant of the other layers would be too small."""
    h, n_q, n_kv = 8, 4, 2
    model = _model("SmolLM3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=n_q, num_key_value_heads=n_kv, max_position_embeddings=64,
                   no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert [a.use_rope for a in _layers(model)] == [1, 0]
    layout = adapters.layout(model)
    qk = {b.module: b for b in layout.blocks if b.kind == "qk"}
    assert [b.group for b in qk.values()] == [RotaryGroup("half"), FULL_GL]
    assert "use_rope=0: a NoPE layer" in qk["model.layers.1.self_attn"].group_source
    ids = _ids()
    qk_sample = lambda layer, g: ((_rotary_commutant(h, "half", g), True) if layer == 0  # noqa: E731
                                  else (_gl(h, g), True))
    act = lambda s: _act_separate(model, _layers, qk_sample, lambda g: _gl(h, g), s)  # noqa: E731
    _check_invariance(model, act, layout, {"input_ids": ids}, ids)


# ------------------------------------------------------- Llama 4: interleaved rotary, weightless QK norm


def _llama4(monkeypatch):
    """Tiny Llama 4 text model: layer 0 rotates with complex (interleaved) rotary and then
    normalises q and k without a gain (``qk_norm``, ε = rms_norm_eps); layer 1 is a NoPE layer
    (no rotary, no norm, temperature tuning of q).  HF computes the rotary map and the norm in
    float32; they are evaluated in the input's dtype here so that a float64 check sees float64
    rounding (the functions are the same)."""
    from transformers.models.llama4 import modeling_llama4 as m4

    def apply_rotary_emb(xq, xk, freqs_cis):
        def turn(x):
            z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
            return torch.view_as_real(z * freqs_cis[:, :, None, :].to(z.dtype)).flatten(3)
        return turn(xq), turn(xk)

    monkeypatch.setattr(m4, "apply_rotary_emb", apply_rotary_emb)
    monkeypatch.setattr(m4.Llama4TextL2Norm, "forward", lambda self, x: self._norm(x))
    model = _model("Llama4Text", "Llama4ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                   intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, max_position_embeddings=64, moe_layers=[], no_rope_layer_interval=2,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.copy_(1.0 / 100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    return model


def test_llama4_interleaved_rotary_weightless_qk_norm_and_nope(monkeypatch):
    """Layer 0: the probe reads Llama 4's complex rotary as interleaved pairs (2i, 2i+1); the weightless
    norm after it keeps only a rotation of each pair (SO(2)^{h/2}: orthogonal, since rms(uA) = rms(u)
    for all u, and no scale, since ε > 0).  Layer 1 (``use_rope`` = 0) keeps GL(h).  V/O GL(h) on both.
    The layout verifies on the first try, and sharpness is invariant under the action written here."""
    h = 8
    model = _llama4(monkeypatch)
    layout = adapters.layout(model)
    groups = _groups(layout)
    qk0 = groups[("model.layers.0.self_attn", "qk")]
    J = torch.zeros(h // 2, h, h, dtype=torch.float64)          # quarter turns of the interleaved pairs
    for p in range(h // 2):
        J[p, 2 * p + 1, 2 * p], J[p, 2 * p, 2 * p + 1] = 1.0, -1.0
    assert qk0.dim(h) == h // 2 and torch.allclose(qk0.project_algebra(J), J, atol=1e-12)
    assert not qk0.has_scalars
    assert groups[("model.layers.1.self_attn", "qk")] == FULL_GL
    assert [groups[(f"model.layers.{i}.self_attn", "vo")] for i in (0, 1)] == [FULL_GL, FULL_GL]
    source = next(b.group_source for b in layout.blocks if b.module.endswith("0.self_attn") and b.kind == "qk")
    assert "probed apply_rotary_emb: rotary_dim=8 interleaved" in source and "ε forbids the scale" in source
    ids = _ids()
    qk_sample = lambda layer, g: ((_pair_rotations(h, "interleaved", g), False) if layer == 0  # noqa: E731
                                  else (_gl(h, g), True))
    act = lambda s: _act_separate(model, _layers, qk_sample, lambda g: _gl(h, g), s)  # noqa: E731
    _check_invariance(model, act, layout, {"input_ids": ids}, ids)


def test_weightless_norm_probe():
    """The probe tells an RMS norm without gain (ε > 0: rotations only), an L2 normalisation (ε = 0:
    rotations and scale) and norms that do not commute with rotations apart."""
    from quotient_manifolds.adapters.families.qk_norm import normalised_rotary_group, probe_weightless_norm

    class Rms(torch.nn.Module):
        def __init__(self, eps):
            super().__init__()
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    class L2(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.normalize(x, dim=-1)

    assert probe_weightless_norm(Rms(1e-6), 8) is False
    assert probe_weightless_norm(L2(), 8) is True
    assert probe_weightless_norm(torch.nn.LayerNorm(8, elementwise_affine=False), 8) is None   # centres
    assert probe_weightless_norm(torch.nn.LayerNorm(8), 8) is None                             # has a gain
    group = normalised_rotary_group(RotaryGroup("half", 4), 8, scalars=True)
    assert group.dim(8) == 2 + 6 + 1          # a turn per pair, so(4) on the free coordinates, scale



# ------------------------------------------------------------------------------ latent attention


@pytest.mark.parametrize("low_rank_q, interleave", [(True, True), (False, False)])
def test_multi_head_latent_attention(low_rank_q, interleave):
    """DeepSeek-V3: GL(qk_nope_head_dim) per head between ``q_b_proj``'s no-rope rows and
    ``kv_b_proj``'s key rows; the rotary commutant on the rope part, one gauge for all heads (the
    rotary key of ``kv_a_proj_with_mqa`` is shared); GL(v_head_dim) per head between ``kv_b_proj``'s
    value rows and ``o_proj``'s columns.  Queries low-rank (``q_a_proj`` → norm → ``q_b_proj``) or
    full (``q_proj``, with biases); rotary pairs interleaved (DeepSeek's layout) or half."""
    n, nope, rope, v, rank = 4, 8, 4, 6, 12
    model = _model("DeepseekV3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=n, num_key_value_heads=n,
                   q_lora_rank=16 if low_rank_q else None, kv_lora_rank=rank, qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope, v_head_dim=v, n_routed_experts=2, num_experts_per_tok=1,
                   first_k_dense_replace=2, n_group=1, topk_group=1, max_position_embeddings=64,
                   rope_interleave=interleave, attention_bias=not low_rank_q)
    layout = adapters.layout(model)
    pairing = "interleaved" if interleave else "half"
    assert [(b.kind, b.group, b.num_heads, b.head_dim) for b in layout.blocks[:3]] == [
        ("qk", FULL_GL, n, nope), ("qk_rope", RotaryGroup(pairing), 1, rope), ("vo", FULL_GL, n, v)]
    assert len(layout.blocks) == 6 and all(b.family == "latent" for b in layout.blocks)

    def act(scale, seed=0):
        new = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for a in _layers(new):
                q = a.q_b_proj if low_rank_q else a.q_proj
                B = scale * _rotary_commutant(rope, pairing, gen)    # shared rotary key: one for all heads
                rows = _rows(rank, rope)
                a.kv_a_proj_with_mqa.weight[rows] = B.inverse() @ a.kv_a_proj_with_mqa.weight[rows]
                if a.kv_a_proj_with_mqa.bias is not None:
                    a.kv_a_proj_with_mqa.bias[rows] = B.inverse() @ a.kv_a_proj_with_mqa.bias[rows]
                for i in range(n):
                    A, C = scale * _gl(nope, gen), scale * _gl(v, gen)
                    for M, qrows in ((A.T, _rows(i * (nope + rope), nope)), (B.T, _rows(i * (nope + rope) + nope, rope))):
                        q.weight[qrows] = M @ q.weight[qrows]
                        if q.bias is not None:
                            q.bias[qrows] = M @ q.bias[qrows]
                    krows, vrows = _rows(i * (nope + v), nope), _rows(i * (nope + v) + nope, v)
                    a.kv_b_proj.weight[krows] = A.inverse() @ a.kv_b_proj.weight[krows]
                    a.kv_b_proj.weight[vrows] = C.T @ a.kv_b_proj.weight[vrows]
                    cols = _rows(i * v, v)
                    a.o_proj.weight[:, cols] = a.o_proj.weight[:, cols] @ C.inverse().T
        return new

    ids = _ids()
    _check_invariance(model, act, layout, {"input_ids": ids}, ids)


@pytest.mark.parametrize("name, extra, dtype", [
    ("MiniCPM3", {}, torch.float64),
    ("Glm4MoeLite", dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=2, moe_intermediate_size=16,
                         n_group=1, topk_group=1), torch.float64),
    # DeepSeek-V2 turns its complex rotary in float32 (xq.float()): exact to float32 only
    ("DeepseekV2", dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=2,
                        moe_intermediate_size=16), torch.float32),
])
def test_other_latent_attention_classes_verify_on_the_first_try(name, extra, dtype):
    """The same structure in other classes: three blocks per module, the layout verifies."""
    model = _model(name, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                   qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64, **extra).to(dtype)
    layout = adapters.layout(model)
    assert [(b.kind, b.family) for b in layout.blocks] == [("qk", "latent"), ("qk_rope", "latent"), ("vo", "latent")]
    assert layout.verify(model, {"input_ids": _ids()}).passed


# ------------------------------------------------------------------------- differential attention


def _rotation(n: int, gen: torch.Generator) -> torch.Tensor:
    """Haar-random element of SO(n)."""
    Q, R = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R))
    if torch.det(Q) < 0:
        Q[:, 0] = -Q[:, 0]
    return Q


def test_differential_attention():
    """DiffLlama: query heads j and j + n_q/2 are a differential pair, (P_j − λ P_j') [V_a V_b] with
    value heads a and a + n_kv/2, normalised without gain over 2h, then the output projection.  Q/K
    keeps the rotary commutant per key/value head; V/O has one SO(2h) per value pair, acting on the
    rows of both value heads together (not contiguous: a and a + n_kv/2) and the pair's output
    columns."""
    h, n_q, n_kv = 8, 4, 4
    model = _model("DiffLlama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=n_q, num_key_value_heads=n_kv, max_position_embeddings=64)
    with torch.no_grad():
        for a in _layers(model):                        # a λ that matters (initialised near λ_init)
            for p in (a.lambda_q1, a.lambda_k1, a.lambda_q2, a.lambda_k2):
                p.normal_(0.0, 0.5)
    layout = adapters.layout(model)
    blocks = [(b.kind, b.num_heads, b.head_dim) for b in layout.blocks]
    assert blocks == [("qk", n_kv, h), ("vo", n_kv // 2, 2 * h)] * 2
    assert {type(b.group).__name__ for b in layout.blocks if b.kind == "vo"} == {"OrthogonalGroup"}
    assert {b.group for b in layout.blocks if b.kind == "qk"} == {RotaryGroup("half")}
    pairs = n_kv // 2

    def act(scale, seed=0):
        new = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for a in _layers(new):
                for head in range(n_kv):                    # Q/K: rotary commutant, times the scale (rep = 1)
                    A, rows = scale * _rotary_commutant(h, "half", gen), _rows(head * h, h)
                    a.q_proj.weight[rows] = A.T @ a.q_proj.weight[rows]
                    a.k_proj.weight[rows] = A.inverse() @ a.k_proj.weight[rows]
                for p in range(pairs):                      # V/O: one rotation of the 2h values of a pair
                    Q = _rotation(2 * h, gen)
                    rows = _rows(p * h, h) + _rows((p + pairs) * h, h)
                    a.v_proj.weight[rows] = Q.T @ a.v_proj.weight[rows]
                    cols = _rows(p * 2 * h, 2 * h)          # rep = 1: pair p's output columns
                    a.o_proj.weight[:, cols] = a.o_proj.weight[:, cols] @ Q
        return new

    ids = _ids()
    _check_invariance(model, act, layout, {"input_ids": ids}, ids)


def test_factor_piece_with_runs_reads_and_writes_the_rows_written_out_by_hand():
    """``FactorPiece(parts=2)``: head a is rows a·h … a·h+h−1 then (a+P)·h … (a+P)·h+h−1 (P pairs);
    read, write and mask agree with those rows listed here, and overlapping runs are refused."""
    from quotient_manifolds.adapters.blocks import FactorPiece

    h, pairs, width = 3, 2, 5
    W = torch.randn(2 * pairs * h, width, dtype=torch.float64)
    piece = FactorPiece("w", "rows", 0, pairs, 2 * h, stride=h, parts=2, part_stride=pairs * h)
    by_hand = [list(range(a * h, a * h + h)) + list(range((a + pairs) * h, (a + pairs) * h + h)) for a in range(pairs)]
    read = piece.read_from(W)
    assert torch.equal(read, torch.stack([W[rows].T for rows in by_hand]))
    new = torch.randn_like(read)
    written = piece.write(W, new)
    for a, rows in enumerate(by_hand):
        assert torch.equal(written[rows], new[a].T)
    assert bool(piece.mask(W).all())                    # the two pairs cover every row
    bias = FactorPiece("b", "bias", 0, pairs, 2 * h, stride=h, parts=2, part_stride=pairs * h)
    assert torch.equal(bias.read_from(torch.arange(12.0))[1, 0], torch.tensor([3.0, 4, 5, 9, 10, 11]))
    with pytest.raises(InvalidArgument, match="overlap"):
        FactorPiece("w", "rows", 0, pairs, 2 * h, stride=h, parts=2, part_stride=h)


def apply_rotary_scaled_reordered(q, k, cos, sin):
    """Turns the pairs (2i, 2i+1) by the angles of ``cos``/``sin``, scaled by 1.7, and writes the
    result in rotate_half order (DeepSeek's interleaved function, YaRN's scale)."""
    c, s = 1.7 * cos[..., : cos.shape[-1] // 2].unsqueeze(1), 1.7 * sin[..., : sin.shape[-1] // 2].unsqueeze(1)

    def turn(x):
        return torch.cat([x[..., 0::2] * c - x[..., 1::2] * s, x[..., 1::2] * c + x[..., 0::2] * s], -1)
    return turn(q), turn(k)


class _ScaledReorderedRotary(torch.nn.Module):
    def forward(self, x, position_embeddings):
        return apply_rotary_scaled_reordered(x, x, *position_embeddings)


def test_rotary_probe_sees_through_a_scale_and_a_reordering():
    """The probe's reading of the maps R_t: a map scaled by c (YaRN) whose output is reordered by a
    fixed P (c·P R_t) gives the pairs of R_t in the input's coordinates: interleaved."""
    from quotient_manifolds.adapters.families import rotary_probe

    found = rotary_probe.probe_rotary(None, _ScaledReorderedRotary(), 6)
    assert found == ("interleaved", 6, "apply_rotary_scaled_reordered")
