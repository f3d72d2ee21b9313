"""GL(r)-invariant LoRA training (adapters/lora_training.py): re-pointing keeps peft's forward,
state dict and merging; trajectories from (B, A) and (B M, M⁻¹ A) coincide for the Riemannian
optimizers and differ for AdamW and peft's Riemannian-preconditioned AdamW; low-rank regression
converges."""

from __future__ import annotations

import copy

import geoopt
import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
load_file = pytest.importorskip("safetensors.torch").load_file

from quotient_manifolds.adapters import InvariantRiemannianSGD, lora_quotient_parameters, merge_back  # noqa: E402
from quotient_manifolds.adapters.lora_training import lora_quotient_points  # noqa: E402
from quotient_manifolds.geoopt import init_momentum_buffers  # noqa: E402
from quotient_manifolds.geoopt import GLQuotient  # noqa: E402
from quotient_manifolds.errors import InvalidArgument

DT = torch.float64
R = 4


# ------------------------------------------------------------------------------------------- models
def bert_lora(seed: int = 1, scale: float = 0.3):
    """Tiny BERT classifier (hidden 32, 2 layers) with LoRA r=4 on query/value, random nonzero B, A
    (peft starts B at 0) and a trainable classifier head (peft's modules_to_save)."""
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification(cfg).to(DT)
    model = peft.get_peft_model(base, peft.LoraConfig(r=R, lora_alpha=8, target_modules=["query", "value"],
                                                      task_type="SEQ_CLS"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g, dtype=DT))
    return model.eval()


def lora_layers(model):
    return [m for m in model.modules() if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)]


def delta_w(model) -> torch.Tensor:
    """All s·B·A, flattened."""
    return torch.cat([(m.scaling["default"] * m.lora_B["default"].weight @ m.lora_A["default"].weight).flatten()
                      for m in lora_layers(model)]).detach()


def ill_conditioned(r: int, cond: float, g: torch.Generator) -> torch.Tensor:
    U, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=DT))
    V, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=DT))
    s = torch.logspace(0.5, -0.5, r, dtype=DT) ** torch.log10(torch.tensor(cond, dtype=DT))
    return U @ torch.diag(s) @ V.T


def act(model, cond: float = 1e2) -> None:
    """(B, A) -> (B M, M⁻¹ A) with a different M of condition number ``cond`` per pair."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in lora_layers(model):
            M = ill_conditioned(R, cond, g)
            assert float(torch.linalg.cond(M)) == pytest.approx(cond, rel=1e-6)
            B, A = m.lora_B["default"].weight, m.lora_A["default"].weight
            B.copy_(B @ M)
            A.copy_(torch.linalg.solve(M, A))


_g = torch.Generator().manual_seed(5)
IDS = torch.randint(0, 50, (8, 12), generator=_g)
LABELS = torch.randint(0, 3, (8,), generator=_g)


def loss_of(model):
    return model(input_ids=IDS, labels=LABELS).loss


def train(model, make_optimizer, steps=50):
    opt = make_optimizer(model)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model).backward()
        opt.step()
    return delta_w(model)


# --------------------------------------------------------------------------------- re-pointing
def test_repointing_keeps_forward_state_dict_and_merging(tmp_path):
    model, plain = bert_lora(), bert_lora()
    y0 = model(input_ids=IDS).logits.detach()
    sd0 = model.state_dict()
    lora_names = {n for n, p in model.named_parameters() if "lora_" in n}
    head = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert len(lora_names) == 2 * 2 * 2 and head      # 2 layers x (query, value) x (A, B); classifier head

    groups = lora_quotient_parameters(model)
    points = lora_quotient_points(model)
    assert len(groups) == 2 and groups[0]["weight_decay"] == 0.0 and len(groups[0]["params"]) == 4
    assert [p.shape for p in groups[1]["params"]] == [p.shape for p in head]
    assert set(map(id, groups[0]["params"])) == {id(p.x) for p in points.values()}
    for x in groups[0]["params"]:
        assert isinstance(x, geoopt.ManifoldParameter) and isinstance(x.manifold, GLQuotient)
        assert x.shape == (32 + 32, R) and x.manifold.metric == "mix"
    layer = lora_layers(model)[0]
    point = points[next(iter(points))]
    assert torch.equal(layer.lora_B["default"].weight, point.x[:32])           # G = B
    assert torch.equal(layer.lora_A["default"].weight, point.x[32:].T)         # H = Aᵀ
    # forward and state dict: exactly peft's (keys, order, values), contiguous, no x
    assert torch.allclose(model(input_ids=IDS).logits, y0, rtol=0, atol=1e-15)   # A is a transposed view
    sd1 = model.state_dict()
    assert list(sd1) == list(sd0)
    assert all(torch.equal(sd1[k], sd0[k]) and sd1[k].is_contiguous() for k in sd0)
    assert {n for n, p in model.named_parameters() if "lora_" in n} != lora_names   # the points replaced them

    # train a few steps: the state dict follows, and loads strictly into a plain peft model and back
    opt = geoopt.optim.RiemannianAdam(groups, lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        loss_of(model).backward()
        opt.step()
    y1 = model(input_ids=IDS).logits.detach()
    assert not torch.allclose(y1, y0)
    sd2 = model.state_dict()
    assert torch.equal(sd2[next(k for k in sd2 if "lora_A" in k)], layer.lora_A["default"].weight)
    plain.load_state_dict(sd2)
    assert torch.allclose(plain(input_ids=IDS).logits, y1, rtol=0, atol=1e-12)
    fresh = bert_lora(seed=2)
    fresh_groups = lora_quotient_parameters(fresh)
    fresh.load_state_dict(sd2)                                # writes the factors into the points
    assert torch.allclose(fresh(input_ids=IDS).logits, y1, rtol=0, atol=1e-12)
    assert torch.equal(fresh_groups[0]["params"][0][:32], sd2[next(k for k in sd2 if "lora_B" in k)])
    bad = dict(sd2)
    bad[next(k for k in sd2 if "lora_A" in k)] = torch.zeros(R + 1, 32, dtype=DT)
    with pytest.raises(RuntimeError, match=r"size mismatch for .*lora_A\.default\.weight.*shape \(4, 32\)"):
        fresh.load_state_dict(bad)
    # assigning a factor writes into the point
    new_A = torch.randn(R, 32, dtype=DT)
    layer.lora_A["default"].weight = new_A
    assert torch.equal(point.x[32:].T, new_A)
    layer.lora_A["default"].weight = sd2[next(k for k in sd2 if "lora_A" in k)]

    # peft's adapter state dict and save_pretrained (safetensors: contiguous, unshared tensors)
    adapter_sd = peft.get_peft_model_state_dict(model)
    plain_sd = peft.get_peft_model_state_dict(plain)          # plain holds the same trained values
    assert adapter_sd.keys() == plain_sd.keys() and all(torch.equal(adapter_sd[k], plain_sd[k]) for k in plain_sd)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved.keys() == adapter_sd.keys() and all(torch.equal(saved[k], adapter_sd[k]) for k in saved)

    # peft merging reads the views
    clone = copy.deepcopy(model)
    unloaded = clone.merge_and_unload()
    assert torch.allclose(unloaded(input_ids=IDS).logits, y1, rtol=0, atol=1e-12)

    # undo: plain trainable parameters with the trained values, same forward and state dict
    assert merge_back(model) == 4 and merge_back(model) == 0
    assert lora_quotient_points(model) == {}
    assert {n for n, p in model.named_parameters() if "lora_" in n} == lora_names
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert type(p) is nn.Parameter and p.requires_grad and p.is_contiguous()
            assert torch.equal(p, sd2[n])
    assert type(layer.lora_A["default"]) is nn.Linear
    assert torch.allclose(model(input_ids=IDS).logits, y1, rtol=0, atol=1e-15)
    assert list(model.state_dict()) == list(sd0)


def test_actionable_errors():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, num_labels=3)
    base = transformers.BertForSequenceClassification(cfg).to(DT)
    with pytest.raises(InvalidArgument, match="no trainable peft LoRA pair"):
        lora_quotient_parameters(base)
    model = peft.get_peft_model(base, peft.LoraConfig(r=R, target_modules=["query"], task_type="SEQ_CLS"))
    with pytest.raises(InvalidArgument, match=r"lora_B is all zeros.*eps > 0"):
        lora_quotient_parameters(model)                       # peft's initialisation B = 0
    assert lora_quotient_points(model) == {}                  # nothing was modified
    with pytest.raises(InvalidArgument, match=r"no trainable peft LoRA pair.*for adapters \['other'\]"):
        lora_quotient_parameters(model, gram_eps=1e-6, adapters=["other"])
    groups = lora_quotient_parameters(model, gram_eps=1e-6)
    assert groups[0]["params"][0].manifold.eps == 1e-6
    with pytest.raises(InvalidArgument, match="already re-pointed"):
        lora_quotient_parameters(model, gram_eps=1e-6)
    dora = peft.get_peft_model(transformers.BertForSequenceClassification(cfg).to(DT), peft.LoraConfig(
        r=R, target_modules=["query"], use_dora=True, task_type="SEQ_CLS"))
    with pytest.warns(UserWarning, match="LoRA variant.*trained as plain parameters"), \
            pytest.raises(InvalidArgument, match="no trainable peft LoRA pair"):
        lora_quotient_parameters(dora)


# ---------------------------------------------------------------------------------- invariance
OURS = {
    "RiemannianSGD(momentum=0.9)": lambda m: InvariantRiemannianSGD(lora_quotient_parameters(m), lr=1.0,
                                                                     momentum=0.9),
    "geoopt RiemannianSGD(nesterov) + init_momentum_buffers": lambda m: _with_buffers(
        geoopt.optim.RiemannianSGD(lora_quotient_parameters(m), lr=0.5, momentum=0.9, nesterov=True)),
    "RiemannianAdam": lambda m: geoopt.optim.RiemannianAdam(lora_quotient_parameters(m), lr=3e-2),
    "RiemannianAdam(inv, second_order, amsgrad)": lambda m: geoopt.optim.RiemannianAdam(
        lora_quotient_parameters(m, metric="inv", retraction="second_order"), lr=3e-2, amsgrad=True),
}


def _with_buffers(opt):
    init_momentum_buffers(opt)
    return opt


def _pair_of_runs(make_optimizer):
    d0 = delta_w(bert_lora())
    a, b = bert_lora(), bert_lora()
    act(b)
    assert float((delta_w(a) - delta_w(b)).norm() / d0.norm()) < 1e-13       # same ΔW, other factors
    da, db = train(a, make_optimizer), train(b, make_optimizer)
    rel = float((da - db).norm() / da.norm())
    moved = float((da - d0).norm() / d0.norm())
    with torch.no_grad():
        logits = float((a(input_ids=IDS).logits - b(input_ids=IDS).logits).abs().max())
    return rel, moved, logits


@pytest.mark.parametrize("name", list(OURS))
def test_trajectory_is_gl_invariant(name):
    rel, moved, logits = _pair_of_runs(OURS[name])
    msg = f"{name}: |ΔW_a - ΔW_b| / |ΔW_a| = {rel:.2e}, training moved ΔW by {moved:.2f} (relative)"
    assert moved > 0.1, msg                     # the runs went somewhere
    assert rel < 1e-5 and logits < 1e-8, msg + f", max logit difference {logits:.1e}"


def _peft_riemannian(model):
    optimizers = pytest.importorskip("peft.optimizers")
    if not hasattr(optimizers, "create_riemannian_optimizer"):
        pytest.skip("this peft has no create_riemannian_optimizer")
    return optimizers.create_riemannian_optimizer(model, torch.optim.AdamW, lr=3e-3)


EUCLIDEAN = {
    "torch AdamW": lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3),
    "peft create_riemannian_optimizer(AdamW)": _peft_riemannian,
}


@pytest.mark.parametrize("name", list(EUCLIDEAN))
def test_per_coordinate_adam_is_not_invariant(name):
    rel, moved, _ = _pair_of_runs(EUCLIDEAN[name])
    assert moved > 0.1 and rel > 1e-2, (
        f"{name}: |ΔW_a - ΔW_b| / |ΔW_a| = {rel:.2e} (moved {moved:.2f}): expected a visible dependence on "
        f"the representative")


def test_mix_sgd_step_is_peft_riemannian_preconditioned_sgd():
    """With ε = δ = 0 and x + ξ, our mix-metric SGD is peft's scaled-GD direction g_B (AAᵀ)⁻¹,
    (BᵀB)⁻¹ g_A (an independent implementation of the Riemannian gradient)."""
    optimizers = pytest.importorskip("peft.optimizers")
    if not hasattr(optimizers, "create_riemannian_optimizer"):
        pytest.skip("this peft has no create_riemannian_optimizer")
    d_ours = train(bert_lora(), lambda m: InvariantRiemannianSGD(lora_quotient_parameters(m), lr=5.0), steps=5)
    d_peft = train(bert_lora(), lambda m: optimizers.create_riemannian_optimizer(
        m, torch.optim.SGD, lr=5.0, reg=0.0), steps=5)
    d0 = delta_w(bert_lora())
    moved = float((d_ours - d0).norm() / d0.norm())
    rel = float((d_ours - d_peft).norm() / (d_ours - d0).norm())
    assert moved > 1e-3 and rel < 1e-9, f"moved {moved:.1e}; ours vs peft, relative to the move: {rel:.1e}"


# ---------------------------------------------------------------------------------- convergence
def low_rank_regression(init: str, r: int = 3, n_out: int = 20, n_in: int = 30, N: int = 200):
    """y = X W*ᵀ with W* of rank r; a peft LoRA of rank r on a zero base Linear fits W = s B A."""
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(n_out, r, generator=g, dtype=DT) @ torch.randn(r, n_in, generator=g, dtype=DT)
    X = torch.randn(N, n_in, generator=g, dtype=DT)
    base = nn.Sequential(nn.Linear(n_in, n_out, bias=False)).to(DT)
    nn.init.zeros_(base[0].weight)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=r, target_modules=["0"]))
    if init == "random":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=DT))
    return model, X, X @ w_star.T, w_star


CONVERGENCE = {   # name: (init, eps, optimizer, steps)
    "SGD(momentum=0.5)": ("random", 0.0, lambda gr: InvariantRiemannianSGD(gr, lr=0.3, momentum=0.5), 60),
    "RiemannianAdam": ("random", 0.0, lambda gr: geoopt.optim.RiemannianAdam(gr, lr=1.0), 200),
    "SGD from peft's B = 0, eps=1e-6": ("peft", 1e-6, lambda gr: InvariantRiemannianSGD(gr, lr=0.5), 60),
}


@pytest.mark.parametrize("name", list(CONVERGENCE))
def test_low_rank_regression_converges(name):
    init, eps, make, steps = CONVERGENCE[name]
    model, X, Y, w_star = low_rank_regression(init)
    opt = make(lora_quotient_parameters(model, gram_eps=eps))
    scale = 0.5 * float((Y ** 2).sum()) / len(X)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.5 * ((model(X) - Y) ** 2).sum() / len(X)
        loss.backward()
        opt.step()
    with torch.no_grad():
        rel_loss = float(0.5 * ((model(X) - Y) ** 2).sum() / len(X)) / scale
        layer = lora_layers(model)[0]
        W = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    rel_w = float((W - w_star).norm() / w_star.norm())
    assert rel_loss < 1e-6 and rel_w < 1e-3, (
        f"{name}: relative loss {rel_loss:.1e}, |W - W*|/|W*| {rel_w:.1e} after {steps} steps")


def test_merge_back_names_a_model_that_is_not_one():
    """merge_back's documented TypeError (it raised an AttributeError from inside before)."""
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        merge_back("not a model")
