"""The gate from a model to its accepted layout (adapters.gate): the README's workflow
(layout → verify → sharpness(layout=...)) and the one-call path (layout=None) give the same value,
on a decoder whose rotary pairs are interleaved (read by probing its rotary function, not named in
its config) and on OLMo2 (QK-norm across heads: the proposed Q/K block fails and is derived away);
both invariant under a symmetry action written here by hand. Tiny models from config, float64."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from quotient_manifolds import adapters
from quotient_manifolds.adapters import SymmetryError
from quotient_manifolds.adapters.families.rotary_probe import probe_rotary, read_pairing
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaAttention  # noqa: E402

VOCAB, SEQ, HEADS, HEAD_DIM = 64, 12, 4, 8
KW = dict(geometry="geodesic-inv", rho=0.05, n_iters=3, loss_fn=adapters.next_token_loss)


# ------------------------------------------------------------------------------ an interleaved decoder
def rotate_pairs(x):
    """(x₀, x₁, x₂, x₃, …) ↦ (−x₁, x₀, −x₃, x₂, …): GPT-J's pairing, under a name detection does not know."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary_interleaved(q, k, cos, sin):
    """RoPE on (2i, 2i+1) pairs, from the (cos, sin) of the Llama rotary embedding."""
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin


class InterleavedAttention(LlamaAttention):
    """Llama attention whose own forward turns interleaved pairs; its config names no pairing."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        B, T, _ = hidden_states.shape
        heads = lambda lin: lin(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k = apply_rotary_interleaved(heads(self.q_proj), heads(self.k_proj), *position_embeddings)
        out = F.scaled_dot_product_attention(q, k, heads(self.v_proj), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None


def _config(cls):
    return cls(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=HEADS, num_key_value_heads=HEADS, eos_token_id=None, bos_token_id=None,
               pad_token_id=None)


def _interleaved_decoder():
    torch.manual_seed(0)
    cfg = _config(transformers.LlamaConfig)
    model = transformers.LlamaForCausalLM(cfg)
    for i, layer in enumerate(model.model.layers):
        attention = InterleavedAttention(cfg, i)
        attention.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = attention
    return model.double().eval()


def _olmo2():
    torch.manual_seed(0)
    return transformers.Olmo2ForCausalLM(_config(transformers.Olmo2Config)).double().eval()


def _batches():
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, [({"input_ids": ids}, ids)]


# ------------------------------------------------------------------------------ the action, by hand
def _scaled_pair_rotations(gen):
    """An element of the interleaved rotary commutant: per head, per (2i, 2i+1) pair, s·R(φ)."""
    s = torch.exp(torch.randn(HEADS, HEAD_DIM // 2, generator=gen, dtype=torch.float64))
    phi = torch.rand(HEADS, HEAD_DIM // 2, generator=gen, dtype=torch.float64) * 6.28
    A = torch.zeros(HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float64)
    for p in range(HEAD_DIM // 2):
        c, si = s[:, p] * phi[:, p].cos(), s[:, p] * phi[:, p].sin()
        A[:, 2 * p, 2 * p], A[:, 2 * p, 2 * p + 1], A[:, 2 * p + 1, 2 * p], A[:, 2 * p + 1, 2 * p + 1] = c, si, -si, c
    return A


def _general_linear(gen):
    """Per head an invertible h×h matrix with condition number about 1e1."""
    U, _ = torch.linalg.qr(torch.randn(HEADS, HEAD_DIM, HEAD_DIM, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(HEADS, HEAD_DIM, HEAD_DIM, generator=gen, dtype=torch.float64))
    return U @ torch.diag_embed(torch.logspace(0, 1, HEAD_DIM, dtype=torch.float64)) @ V


@torch.no_grad()
def _acted(model, qk=None, vo=None):
    """A copy of ``model`` with q ↦ qA, k ↦ kA⁻ᵀ per head (A = qk[j]) and v ↦ vB with the output
    projection's columns of head j times B⁻ᵀ (B = vo[j]): the function is unchanged."""
    import copy

    moved = copy.deepcopy(model)
    for layer in moved.model.layers:
        att = layer.self_attn
        for j in range(HEADS):
            rows = slice(j * HEAD_DIM, (j + 1) * HEAD_DIM)
            if qk is not None:
                att.q_proj.weight[rows] = qk[j].T @ att.q_proj.weight[rows]
                att.k_proj.weight[rows] = torch.linalg.inv(qk[j]) @ att.k_proj.weight[rows]
            if vo is not None:
                att.v_proj.weight[rows] = vo[j].T @ att.v_proj.weight[rows]
                att.o_proj.weight[:, rows] = att.o_proj.weight[:, rows] @ torch.linalg.inv(vo[j]).T
    return moved


def _readme_workflow(model, ids, batches):
    """The README's lines: layout, verify (which raises SymmetryError on a failing block, saying what
    to call next), sharpness(..., layout=layout)."""
    lay = adapters.layout(model)
    try:
        report = lay.verify(model, ids)
    except SymmetryError as err:
        assert str(err).splitlines()[-1] == err.report.next_step
        report = err.report
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = adapters.sharpness(model, batches, layout=lay, **KW).value
    return lay, report, value, [str(w.message) for w in seen]


# ------------------------------------------------------------------------------ tests
def test_probe_reads_the_pairing_the_rotary_function_computes():
    model = _interleaved_decoder()
    assert probe_rotary(model, model.model.layers[0].self_attn, HEAD_DIM) == (
        "interleaved", HEAD_DIM, "apply_rotary_interleaved")
    olmo = _olmo2()
    assert probe_rotary(olmo, olmo.model.layers[0].self_attn, HEAD_DIM)[:2] == ("half", HEAD_DIM)
    # partial rotary, half pairs: the last 2 of 6 coordinates stay, (0,2) and (1,3) turn
    turn = torch.eye(6, dtype=torch.float64)
    for i, j in ((0, 2), (1, 3)):
        turn[i, i] = turn[j, j] = 0.6
        turn[i, j], turn[j, i] = 0.8, -0.8
    assert read_pairing(turn) == ("half", 4)
    turn[4, 4] = 2.0                                  # a scaled coordinate: not a rotation
    assert read_pairing(turn) is None


def test_interleaved_decoder_readme_workflow_equals_one_call_and_is_invariant():
    model = _interleaved_decoder()
    ids, batches = _batches()
    lay, report, value, seen = _readme_workflow(model, ids, batches)
    assert report.passed and not seen                 # proposed as it computes: verify passes as proposed
    assert {b.kind: b.group.describe(HEAD_DIM) for b in lay.blocks}["qk"].endswith("[interleaved pairs]")
    assert value == adapters.sharpness(model, batches, **KW).value
    gen = torch.Generator().manual_seed(5)
    moved = _acted(model, qk=_scaled_pair_rotations(gen), vo=_general_linear(gen))
    assert (moved(ids).logits - model(ids).logits).abs().max() < 1e-10     # a symmetry, by hand
    assert adapters.sharpness(moved, batches, **KW).value == pytest.approx(value, rel=1e-6, abs=1e-12)


def test_olmo2_readme_workflow_equals_one_call_and_is_invariant():
    """QK-norm across heads: the proposed Q/K block fails verify; sharpness(layout=lay) derives its
    group (none: it is treated elementwise) as the one-call path does, and says so."""
    model = _olmo2()
    ids, batches = _batches()
    lay, report, value, seen = _readme_workflow(model, ids, batches)
    assert not report.passed and all(name.endswith("/qk") for name in report.failing)
    assert "next:" in str(report).splitlines()[-1] and "accept_layout" in str(report).splitlines()[-1]
    assert any("no group found" in message and "/qk" in message for message in seen)
    assert value == adapters.sharpness(model, batches, **KW).value
    moved = _acted(model, vo=_general_linear(torch.Generator().manual_seed(5)))
    assert (moved(ids).logits - model(ids).logits).abs().max() < 1e-10
    assert adapters.sharpness(moved, batches, **KW).value == pytest.approx(value, rel=1e-6, abs=1e-12)


# ------------------------------------------------------------------------------ refusals of the gate's inputs
def test_empty_batch_and_wrong_arguments_are_refused_clearly():
    model = _interleaved_decoder()
    ids, _ = _batches()
    lay = adapters.layout(model)
    with pytest.raises(InvalidArgument, match="empty batch proves nothing"):
        lay.verify(model, ids[:0])
    with pytest.raises(InvalidArgument, match="empty batch proves nothing"):
        adapters.accept_layout(model, lay, ids[:0])
    with pytest.raises(InvalidArgumentType, match="layout must be a Layout"):
        adapters.accept_layout(model, "x", ids)
    with pytest.raises(InvalidArgumentType, match="model must be a torch.nn.Module"):
        adapters.detect("x")
    with pytest.raises(InvalidArgumentType, match="output_fn returned a tuple, not a tensor"):
        lay.verify(model, ids, output_fn=lambda out: (out.logits,))


# ------------------------------------------------------------------------------ a custom autograd.Function
def _normalised_attention(q, k, v):
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return F.normalize(torch.softmax(4.0 * q @ k.transpose(-1, -2), dim=-1) @ v, dim=-1)


class NormalisedAttentionFunction(torch.autograd.Function):
    """Attention with normalised q, k and head outputs, as a custom autograd.Function without the
    setup_context / jvp that functorch transforms need."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return _normalised_attention(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            return torch.autograd.grad(_normalised_attention(q, k, v), (q, k, v), grad)


class CustomFunctionAttention(torch.nn.Module):
    def __init__(self, dim=16, num_heads=2):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        heads = NormalisedAttentionFunction.apply(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.o(heads.transpose(1, 2).reshape(B, T, -1))


class CustomFunctionEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.head = CustomFunctionAttention(), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head((x + self.attn(x)).mean(1))


def test_custom_autograd_function_in_attention_gets_its_true_groups():
    """functorch cannot transform the module: the derivation falls back to finite differences under
    the same thresholds and finds R₊·SO(h) on Q/K and SO(h) on V/O (no crash); the accepted layout
    verifies, and sharpness is invariant under such an action written by hand."""
    from quotient_manifolds.core.subalgebra import OrthogonalGroup, ScaledOrthogonalGroup

    torch.manual_seed(0)
    model = CustomFunctionEncoder().double().eval()
    x = torch.randn(4, 16, 16, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1])
    accepted, report = adapters.accept_layout(model, adapters.layout(model), x)
    assert [type(b.group) for b in accepted.blocks] == [ScaledOrthogonalGroup, OrthogonalGroup]
    assert all("finite differences" in b.group_source for b in accepted.blocks)
    assert accepted.verify(model, x).passed
    gen = torch.Generator().manual_seed(3)
    A = ScaledOrthogonalGroup().random_element(8, (2,), cond=1e2, generator=gen)
    O = OrthogonalGroup().random_element(8, (2,), generator=gen)
    import copy

    moved = copy.deepcopy(model)
    with torch.no_grad():
        for i in range(2):
            r = slice(i * 8, (i + 1) * 8)
            att = moved.attn
            for lin, M in ((att.q, A[i].T), (att.k, torch.linalg.inv(A[i])), (att.v, O[i].T)):
                lin.weight[r], lin.bias[r] = M @ lin.weight[r], M @ lin.bias[r]
            att.o.weight[:, r] = att.o.weight[:, r] @ O[i]
    assert (moved(x) - model(x)).abs().max() < 1e-10
    kw = dict(geometry="geodesic-inv", rho=0.05, n_iters=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s0, s1 = (adapters.sharpness(m, [(x, y)], **kw).value for m in (model, moved))
    assert s1 == pytest.approx(s0, rel=1e-6, abs=1e-12)


def test_hessian_and_sam_accept_a_passed_layout_like_sharpness():
    """The same gate in riemannian_hessian and GeodesicSAM: a passed layout whose full-GL candidates
    fail gets the derived groups (a warning names them), as sharpness does."""
    from quotient_manifolds.core.subalgebra import OrthogonalGroup, ScaledOrthogonalGroup

    pytest.importorskip("curvlinops")
    torch.manual_seed(0)
    model = CustomFunctionEncoder().double().eval()
    x, y = torch.randn(4, 16, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    with pytest.warns(UserWarning, match=r"layout= are not symmetries.*derived: R\+ SO\(8\)"):
        hess = adapters.riemannian_hessian(model, [(x, y)], geometry="geodesic-inv", layout=adapters.layout(model))
    assert hess.quotient_dim == sum(p.numel() for p in model.parameters()) - 2 * (8 * 7 // 2 + 1) - 2 * (8 * 7 // 2)
    sam = adapters.GeodesicSAM(model, torch.optim.SGD, rho=0.05, geometry="geodesic-inv", lr=0.0,
                               layout=adapters.layout(model))
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match="layout= are not symmetries"):
        sam.first_step(zero_grad=True)
    F.cross_entropy(model(x), y).backward()
    sam.second_step(zero_grad=True)
    assert [type(b.group) for b in sam.layout.blocks] == [ScaledOrthogonalGroup, OrthogonalGroup]


def test_one_sharpness_call_passes_each_module_once_in_one_direction():
    """Following the model through one geodesic sharpness call (benchmarks/trace_setup.py): every
    module of the set-up is entered once, in one direction (no return to a module already left)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "trace_setup.py"
    spec = importlib.util.spec_from_file_location("trace_setup", path)
    trace_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace_setup)
    model, batches = trace_setup._model()
    stops, modules, returns = trace_setup.trace(model, batches)
    assert returns == 0, " -> ".join(stops)
    assert stops[0] == "adapters/worst_case" and stops[-1] == "adapters/streaming"
    assert {"adapters/gate", "adapters/detection", "adapters/verify", "adapters/evaluation"} <= set(modules)
