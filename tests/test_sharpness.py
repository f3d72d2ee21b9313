"""The sharpness engine: invariance on real and from-config transformers, reduction to known closed
forms, model safety, determinism, pass counting and error messages (issue 3 §3)."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
import torch.nn as nn

from quotient_manifolds import adapters
from quotient_manifolds.adapters.ball import GEOMETRIES
from quotient_manifolds.adapters.components import ProductBall, QuotientComponent
from quotient_manifolds.adapters.solver import auto_pgd
from quotient_manifolds.adapters.worst_case import sharpness
from quotient_manifolds.core import RescalingGeometry
from quotient_manifolds.experiments.closed_forms import sharpness_mix_orthonormal
from quotient_manifolds.errors import InvalidArgument, NonFiniteLoss, UnsupportedModel
from conftest import reparametrised_copy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------ models
def tiny_bert(dtype=torch.float32):
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3,
                                  initializer_range=0.3)  # non-uniform attention
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).to(dtype).eval()


def tiny_vit(dtype=torch.float32):
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32,
                                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 num_labels=3, initializer_range=0.3)
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(cfg).to(dtype).eval()


class ClipVisionClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = transformers.CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=32,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, initializer_factor=5.0)
        self.tower = transformers.CLIPVisionModel(cfg)
        self.head = nn.Linear(32, 3)

    def forward(self, pixel_values):
        return self.head(self.tower(pixel_values=pixel_values).pooler_output)


class MHAEncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.embed = nn.Linear(5, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


def batches_for(name: str, model, dtype=torch.float32, n_batches: int = 1):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n_batches):
        if name in ("bert", "minilm"):
            ids = torch.randint(1, 100, (6, 10), generator=g)
            out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                        torch.randint(0, model.config.num_labels, (6,), generator=g)))
        elif name in ("vit", "clip"):
            out.append(({"pixel_values": torch.randn(6, 3, 16, 16, generator=g, dtype=dtype)}
                        if name == "vit" else torch.randn(6, 3, 16, 16, generator=g, dtype=dtype),
                        torch.randint(0, 3, (6,), generator=g)))
        else:
            out.append((torch.randn(6, 7, 5, generator=g, dtype=dtype),
                        torch.randint(0, 3, (6,), generator=g)))
    return out


BUILDERS = {"bert": tiny_bert, "vit": tiny_vit,
            "clip": lambda dtype=torch.float32: ClipVisionClassifier().to(dtype).eval(),
            "mha": lambda dtype=torch.float32: MHAEncoderClassifier().to(dtype).eval()}


def snapshot(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()},
            {n: p.requires_grad for n, p in model.named_parameters()}, model.training)


def assert_unchanged(model, snap):
    params, buffers, flags, training = snap
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        assert p.requires_grad == flags[n], n
        assert p.grad is None, n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert model.training == training


# ------------------------------------------------------------------------------------ invariance
RHO = {"geodesic-inv": 0.05, "geodesic-mix": 0.05, "adaptive": 0.05}


def _ratios(model, batches, geometry, scales, n_iters=6, **kw):
    base = sharpness(model, batches, geometry=geometry, rho=RHO[geometry], n_iters=n_iters, **kw).value
    assert base > 0
    return [sharpness(reparametrised_copy(model, scale=a, cond=None), batches, geometry=geometry,
                      rho=RHO[geometry], n_iters=n_iters, **kw).value / base for a in scales]


@pytest.mark.parametrize("name", ["bert", "vit", "clip", "mha"])
def test_geodesic_sharpness_invariant_float32(name):
    model = BUILDERS[name]()
    batches = batches_for(name, model)
    scales = [1e-2, 1.0, 1e2]  # the extremes and a unit-scale random action
    for geometry in ("geodesic-inv", "geodesic-mix"):
        ratios = _ratios(model, batches, geometry, scales)
        assert max(abs(r - 1) for r in ratios) < 1e-3, (geometry, ratios)
    adaptive = _ratios(model, batches, "adaptive", [1e-2, 1e2])
    assert max(abs(r - 1) for r in adaptive) > 1e-2, adaptive


@pytest.mark.parametrize("name", ["bert", "mha"])
def test_geodesic_sharpness_invariant_float64(name):
    model = BUILDERS[name](torch.float64)
    batches = batches_for(name, model, torch.float64)
    for geometry in ("geodesic-inv", "geodesic-mix"):
        ratios = _ratios(model, batches, geometry, [1e-2, 1.0, 1e2])
        assert max(abs(r - 1) for r in ratios) < 1e-6, (geometry, ratios)


def test_invariance_on_real_minilm_weights(minilm):
    # the session's MiniLM (2 real layers), copied: a fresh head, and the 11.7M-weight embedding
    # frozen as in the small text protocol (perturbing it was 2/3 of this test's time; the GL
    # blocks whose invariance is checked are all in the encoder)
    model = copy.deepcopy(minilm[0])
    torch.manual_seed(0)
    nn.init.normal_(model.classifier.weight, std=0.5)
    model.bert.embeddings.requires_grad_(False)
    batches = batches_for("minilm", model)
    for geometry in ("geodesic-inv", "geodesic-mix"):
        # the exact-geodesic check of the worst point (8 RK4 steps) is 40 % of this test's time
        # and is tested elsewhere; invariance is about the measured value
        ratios = _ratios(model, batches, geometry, [1e-2, 1e2], n_iters=3, check_retraction=False)
        assert max(abs(r - 1) for r in ratios) < 1e-3, (geometry, ratios)
    adaptive = _ratios(model, batches, "adaptive", [1e-2, 1e2], n_iters=3)
    assert max(abs(r - 1) for r in adaptive) > 1e-2, adaptive


# ------------------------------------------------------------------------------------ closed forms
def test_generic_solver_reproduces_diagonal_closed_form():
    torch.manual_seed(0)
    d, n = 20, 40
    X, _ = torch.linalg.qr(torch.randn(n, d, dtype=torch.float64))
    beta_star = torch.zeros(d, dtype=torch.float64)
    beta_star[:2] = torch.randn(2, dtype=torch.float64)
    y = X @ beta_star
    u = torch.randn(d, dtype=torch.float64)
    beta0 = beta_star + 0.1 * torch.randn(d, dtype=torch.float64)
    x0 = torch.stack([u, beta0 / u])
    frame = RescalingGeometry(d, "mix").frame(x0)
    ball = ProductBall([QuotientComponent("diag", frame, x0, retraction="exact")])

    def closure(points):
        beta = points[0][0] * points[0][1]
        return ((X @ beta - y) ** 2).sum()

    for rho in (0.01, 0.1):
        got = auto_pgd(ball, closure, rho, n_iters=20).sharpness
        want = float(sharpness_mix_orthonormal(beta0, beta_star, rho))
        assert got == pytest.approx(want, rel=1e-2)


def test_no_gamma_and_elementwise_metric_everywhere_is_adaptive_sharpness():
    """Spec §10: with the elementwise GL(1) metric on every weight and the first-order step, the
    geodesic engine is adaptive sharpness: run it through the geodesic code path with a layout that
    declares no GL block."""
    model = tiny_bert()
    batches = batches_for("bert", model)
    empty = adapters.layout(model)
    empty = type(empty)(blocks=[], adaptive=[n for n, _ in model.named_parameters()], gl_masks={},
                        frozen=[], unsupported=[])
    for metric in ("inv", "mix"):
        with pytest.warns(UserWarning, match="no GL block"):
            geo = sharpness(model, batches, geometry=f"geodesic-{metric}", rho=0.1, n_iters=5,
                            retraction="first_order", layout=empty).value
        ada = sharpness(model, batches, geometry="adaptive", rho=0.1, n_iters=5).value
        assert geo == pytest.approx(ada, rel=1e-12)


# ------------------------------------------------------------------------------------ behaviour
def test_one_forward_and_one_backward_per_iteration():
    model = tiny_bert()
    batches = batches_for("bert", model, n_batches=2)
    adapters.layout(model).verify(model, batches[0][0])   # else sharpness verifies it (6 forwards)
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        res = sharpness(model, batches, geometry="geodesic-mix", rho=0.1, n_iters=7,
                        check_retraction=False)
        checked = sharpness(model, batches, geometry="geodesic-mix", rho=0.1, n_iters=7)
    finally:
        handle.remove()
    assert len(calls) - checked.n_forward == 2 * (7 + 1) == res.n_forward
    assert res.n_backward == checked.n_backward == 2 * 7
    # the exact-geodesic check costs one more forward per batch
    assert checked.n_forward == res.n_forward + 2 and len(checked.retraction_gaps) == 2


def test_deterministic():
    model = tiny_bert()
    batches = batches_for("bert", model)
    for geometry in GEOMETRIES:
        a = sharpness(model, batches, geometry=geometry, rho=0.1, n_iters=5)
        b = sharpness(model, batches, geometry=geometry, rho=0.1, n_iters=5)
        assert a.per_batch == b.per_batch
    a = sharpness(model, batches, rho=0.1, measure="average", n_samples=3, seed=3)
    b = sharpness(model, batches, rho=0.1, measure="average", n_samples=3, seed=3)
    assert a.value == b.value


def test_result_fields_and_ablations_run():
    model = tiny_bert()
    batches = batches_for("bert", model, n_batches=2)
    res = sharpness(model, batches, geometry="geodesic-inv", rho=0.1, n_iters=4)
    assert len(res.per_batch) == 2 and res.value == pytest.approx(sum(res.per_batch) / 2)
    assert all(w >= i for w, i in zip(res.worst_losses, res.init_losses))
    assert all(nrm <= 0.1 * (1 + 1e-6) for nrm in res.norms)  # float32 accumulation
    assert "geodesic-inv" in str(res)
    for kw in (dict(retraction="first_order"), dict(retraction="exact"),
               dict(use_metric_norm=False), dict(momentum="andriushchenko"),
               dict(momentum="none"), dict(step_normalization="none"),
               dict(adaptive_direction="andriushchenko"), dict(normalize_logits=True),
               dict(elementwise_second_order=True),
               dict(gram_eps=1e-6), dict(measure="average", n_samples=2)):
        r = sharpness(model, batches[:1], geometry="geodesic-mix", rho=0.1, n_iters=3, **kw)
        assert math.isfinite(r.value), kw


def test_worst_case_beats_average_case():
    model = tiny_bert()
    batches = batches_for("bert", model)
    worst = sharpness(model, batches, geometry="geodesic-mix", rho=0.1, n_iters=10).value
    avg = sharpness(model, batches, geometry="geodesic-mix", rho=0.1, measure="average",
                    n_samples=5).value
    assert worst > avg


# ------------------------------------------------------------------------------------ model safety
def test_model_bit_identical_after_success_and_mode_restored():
    model = MHAEncoderClassifier()
    model.train()
    model.embed.weight.requires_grad_(False)
    snap = snapshot(model)
    sharpness(model, batches_for("mha", model), geometry="geodesic-mix", rho=0.1, n_iters=3)
    assert_unchanged(model, snap)


class _Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [_Boom, KeyboardInterrupt])
def test_model_bit_identical_after_exception_or_interrupt(exc):
    model = tiny_bert()
    model.train()
    snap = snapshot(model)
    count = []

    def loss_fn(outputs, targets):
        count.append(1)
        if len(count) == 3:
            raise exc("stop")
        return nn.functional.cross_entropy(outputs.logits, targets)

    with pytest.raises(exc):
        sharpness(model, batches_for("bert", model), rho=0.1, n_iters=5, loss_fn=loss_fn)
    assert_unchanged(model, snap)


# ------------------------------------------------------------------------------------ errors
def test_errors_are_actionable():
    model = tiny_bert()
    batches = batches_for("bert", model)
    with pytest.raises(InvalidArgument, match="rho"):
        sharpness(model, batches, rho=0.0)
    with pytest.raises(InvalidArgument, match="rho"):
        sharpness(model, batches, rho=-1.0)
    with pytest.raises(InvalidArgument, match="geodesic-mix"):
        sharpness(model, batches, geometry="geodesic", rho=0.1)
    with pytest.raises(InvalidArgument, match="second_order"):
        sharpness(model, batches, rho=0.1, retraction="secondorder")
    with pytest.raises(InvalidArgument, match="empty"):
        sharpness(model, [], rho=0.1)


def test_non_finite_weights_and_loss():
    model = tiny_bert()
    batches = batches_for("bert", model)
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.classifier.weight[0, 0] = float("nan")
    with pytest.raises(InvalidArgument, match="classifier.weight"):
        sharpness(bad, batches, rho=0.1)
    with pytest.raises(NonFiniteLoss, match="not finite"):
        sharpness(model, batches, rho=0.1, loss_fn=lambda o, t: o.logits.sum() * float("inf"))


def test_model_without_attention():
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    batches = [(torch.randn(4, 5), torch.randint(0, 3, (4,)))]
    with pytest.raises(UnsupportedModel):
        sharpness(model, batches, geometry="geodesic-mix", rho=0.1)
    # adaptive needs no attention at all
    assert math.isfinite(sharpness(model, batches, geometry="adaptive", rho=0.1, n_iters=3).value)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        res = sharpness(model, batches, geometry="geodesic-mix", rho=0.1, n_iters=3,
                        allow_unsupported=True)
    assert math.isfinite(res.value)
    assert any("adaptive" in str(w.message) for w in rec)


def test_near_singular_gram_names_block_and_suggests_eps():
    model = tiny_bert()
    with torch.no_grad():
        layer = model.bert.encoder.layer[1].attention.self
        layer.query.weight[:8].zero_()   # heads 0 and 1 of layer 1: G = [W_q rows; b_q] rank-deficient
        layer.query.bias[:8].zero_()
    batches = batches_for("bert", model)
    with pytest.raises(InvalidArgument, match=r"(?s)layer\.1.*eps"):
        sharpness(model, batches, geometry="geodesic-mix", rho=0.1, n_iters=2)
    res = sharpness(model, batches, geometry="geodesic-mix", rho=0.1, n_iters=2, gram_eps=1e-6)
    assert math.isfinite(res.value)


def test_tiny_and_zero_weights_are_kept_fixed():
    """|w| so small that 1/w² overflows (real MiniLM has such entries) counts as zero: kept fixed,
    never a nan norm."""
    model = tiny_bert()
    with torch.no_grad():
        model.classifier.weight[0, 0] = 1e-30
        model.classifier.weight[0, 1] = 0.0
    batches = batches_for("bert", model)
    for geometry in GEOMETRIES:
        res = sharpness(model, batches, geometry=geometry, rho=0.1, n_iters=4)
        assert math.isfinite(res.value) and res.value > 0, geometry


def test_elementwise_second_order_point_is_the_exact_geodesic_to_second_order():
    """w + ξ + ξ²/(2w) vs the exact geodesic w·exp(ξ/w) of the metric Σ ξ²/w² (spec §10): the error
    shrinks like t³."""
    from quotient_manifolds.adapters.elementwise import ElementwiseComponent

    w = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)
    xi = torch.tensor([0.3, 0.7, -1.1], dtype=torch.float64)
    comp = ElementwiseComponent({"w": w}, second_order=True)
    errs = [float((comp.point(t * xi) - w * torch.exp(t * xi / w)).abs().max())
            for t in (0.1, 0.05, 0.025)]
    slopes = [math.log2(errs[i] / errs[i + 1]) for i in range(2)]
    assert all(abs(s - 3) < 0.1 for s in slopes), slopes


def test_no_metric_norm_ablation_is_not_stalled_by_near_zero_weights():
    """Key biases get no gradient (softmax ignores them) and sit near 0 in trained models; the
    ablation must still move (measuring the quotient-metric gradient in the elementwise norm gave
    ~1e-6 here: 1/b_k² ≈ 1e14 swamped the norm)."""
    model = tiny_bert()
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.self.key.bias.fill_(1e-7)
    batches = batches_for("bert", model)
    ablation = sharpness(model, batches, geometry="geodesic-mix", rho=0.1, n_iters=5,
                         use_metric_norm=False).value
    adaptive = sharpness(model, batches, geometry="adaptive", rho=0.1, n_iters=5).value
    assert ablation > 0.01 * adaptive, (ablation, adaptive)
