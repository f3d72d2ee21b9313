"""Geodesic SAM (adapters.sam): GL-equivariance of the ascent step (SAM and ASAM are not), reduction
to ASAM and to plain SAM, exact restoration of the weights, training, cost per step in passes, errors."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F

from quotient_manifolds import adapters
from quotient_manifolds.adapters import GeodesicSAM
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UsageError
from tests.conftest import PlainViT
from conftest import reparametrised_copy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

F64 = torch.float64


# ------------------------------------------------------------------------------------ helpers
def tiny_bert():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3,
                                  initializer_range=0.3)  # non-uniform attention
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).to(F64).eval()


def bert_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (6, 10), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 3, (6,), generator=g)


def logits(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return getattr(out, "logits", out)


def backward(model, batch):
    inputs, targets = batch
    loss = F.cross_entropy(logits(model, inputs), targets)
    loss.backward()
    return float(loss.detach())


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def perturbed_function(model, batch, **options):
    """(outputs at w, outputs at w_adv) after one first_step; the weights are restored after."""
    inputs, _ = batch
    opt = GeodesicSAM(model, torch.optim.SGD, lr=0.0, **options)
    with torch.no_grad():
        out0 = logits(model, inputs)
    backward(model, batch)
    opt.first_step(zero_grad=True)
    with torch.no_grad():
        out_adv = logits(model, inputs)
    opt.second_step()
    return out0, out_adv


# ------------------------------------------------------------------------------------ (1) equivariance
RHO = {"geodesic-mix": 0.5, "geodesic-inv": 0.5, "adaptive": 0.5, "sam": 0.5}


def test_ascent_is_equivariant_for_geodesic_sam_only():
    """f(w_adv) = f(w'_adv) for w' = A·w (per-head GL actions, cond(A) = 1e3): the perturbed
    function does not depend on the representative for geodesic SAM, and does for SAM and ASAM."""
    model = tiny_bert()
    batch = bert_batch()
    twin = reparametrised_copy(model, scale=3.0, cond=1e3)
    out0, out0_twin = logits(model, batch[0]).detach(), logits(twin, batch[0]).detach()
    assert (out0 - out0_twin).norm() / out0.norm() < 1e-12  # same function
    deviations = {}
    cases = [("geodesic-mix", "second_order"), ("geodesic-inv", "second_order"),
             ("geodesic-mix", "first_order"), ("adaptive", "first_order"), ("sam", "first_order")]
    for geometry, retraction in cases:
        opts = dict(geometry=geometry, retraction=retraction, rho=RHO[geometry])
        _, adv = perturbed_function(model, batch, **opts)
        _, adv_twin = perturbed_function(twin, batch, **opts)
        moved = float((adv - out0).norm())
        assert moved > 1e-3 * float(out0.norm()), (geometry, moved)  # the perturbation is felt
        deviations[geometry, retraction] = float((adv - adv_twin).norm()) / moved
    print("\nrelative deviation of the perturbed function, ‖f(w_adv) − f(w'_adv)‖ / ‖f(w_adv) − "
          "f(w)‖, w' = A·w with cond(A) = 1e3:")
    for key, dev in deviations.items():
        print(f"  {key[0]:>13s} {key[1]:>12s}: {dev:.2e}")
    for key, dev in deviations.items():
        if key[0].startswith("geodesic"):
            assert dev < 1e-8, (key, dev)
        else:
            assert dev > 1e-1, (key, dev)


def test_geodesic_perturbation_is_horizontal_with_metric_norm_rho():
    """With Γ off, ε = w_adv − w read in the ball's coordinates at w is horizontal on every GL
    block and has combined metric norm exactly ρ."""
    model = tiny_bert()
    batch = bert_batch()
    rho = 0.3
    opt = GeodesicSAM(model, torch.optim.SGD, rho=rho, geometry="geodesic-inv",
                      retraction="first_order", lr=0.0)
    w = params_of(model)
    backward(model, batch)
    opt.first_step()
    w_adv = params_of(model)
    opt.second_step()
    ball, _ = adapters.ball.build_ball(model, w, geometry="geodesic-inv", layout=opt.layout)
    ball_adv, _ = adapters.ball.build_ball(model, w_adv, geometry="geodesic-inv", layout=opt.layout)
    eps = [a.x0 - c.x0 for a, c in zip(ball_adv.components, ball.components)]
    assert float(ball.norm(eps)) == pytest.approx(rho, rel=1e-10)
    quotients = [(c, e) for c, e in zip(ball.components, eps) if hasattr(c, "frame")]
    assert quotients
    for comp, e in quotients:
        assert float(e.abs().max()) > 0
        assert float(comp.frame.horizontal_residual(e).max()) < 1e-10


# ------------------------------------------------------------------------------------ (2) reductions
def _epsilon(model, batch, **options):
    """(w, g at w, w_adv − w) per parameter name."""
    w = params_of(model)
    opt = GeodesicSAM(model, torch.optim.SGD, lr=0.0, **options)
    backward(model, batch)
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.first_step()
    eps = {n: p.detach() - w[n] for n, p in model.named_parameters()}
    opt.second_step()
    return w, g, eps


def _assert_close(got, want, rtol):
    scale = max(float(t.abs().max()) for t in want.values())
    err = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert err <= rtol * scale, (err, scale)
    return err / scale


def test_adaptive_first_order_is_asam():
    """geometry='adaptive', Γ off: ε = ρ T²∇ / ‖T∇‖₂ with T = |w| (Kwon et al. 2021), by hand."""
    model = tiny_bert()
    rho = 0.5
    w, g, eps = _epsilon(model, bert_batch(), rho=rho, geometry="adaptive", retraction="first_order")
    t_grad = {n: w[n].abs() * g[n] for n in w}
    norm = torch.sqrt(sum((t * t).sum() for t in t_grad.values()))
    asam = {n: rho * w[n].abs() * t_grad[n] / norm for n in w}
    rel = _assert_close(eps, asam, 1e-12)
    print(f"\nASAM reduction: max |ε − ρT²∇/‖T∇‖| / max |ε| = {rel:.1e}")


def test_adaptive_second_order_adds_the_elementwise_christoffel_term():
    """Γ on, geometry='adaptive': w_adv = w + ε + ε²/(2w) with ε the ASAM step (maths §10)."""
    model = tiny_bert()
    rho = 0.5
    w, g, eps = _epsilon(model, bert_batch(), rho=rho, geometry="adaptive")
    t_grad = {n: w[n].abs() * g[n] for n in w}
    norm = torch.sqrt(sum((t * t).sum() for t in t_grad.values()))
    asam = {n: rho * w[n].abs() * t_grad[n] / norm for n in w}
    want = {n: asam[n] + torch.where(w[n] != 0, asam[n] ** 2 / (2 * w[n]), 0.0) for n in w}
    _assert_close(eps, want, 1e-12)
    # and the Christoffel term is not negligible here, so the comparison can fail
    assert max(float((want[n] - asam[n]).abs().max()) for n in w) > 1e-6


def test_sam_geometry_is_plain_sam():
    model = tiny_bert()
    rho = 0.05
    w, g, eps = _epsilon(model, bert_batch(), rho=rho, geometry="sam")
    norm = torch.sqrt(sum((t * t).sum() for t in g.values()))
    _assert_close(eps, {n: rho * g[n] / norm for n in w}, 1e-12)


# ------------------------------------------------------------------------------------ (3) restore
@pytest.mark.parametrize("geometry", ["geodesic-mix", "adaptive", "sam"])
def test_weights_restored_bit_for_bit_and_base_step_uses_gradient_at_w_adv(geometry):
    torch.manual_seed(0)
    model = PlainViT()
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,)))
    w = params_of(model)
    lr0 = GeodesicSAM(model, torch.optim.SGD, rho=0.5, geometry=geometry, lr=0.0)
    backward(model, batch)
    lr0.first_step(zero_grad=True)
    assert any(not torch.equal(p.detach(), w[n]) for n, p in model.named_parameters())
    backward(model, batch)
    lr0.second_step(zero_grad=True)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), w[n]), n
        assert p.grad is None, n

    # lr > 0: w ← w − lr ∇L(w_adv), bit for bit
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.5, geometry=geometry, lr=0.1)
    backward(model, batch)
    opt.first_step(zero_grad=True)
    backward(model, batch)
    g_adv = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.second_step()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), w[n].add(g_adv[n], alpha=-0.1)), n


def test_half_precision_model_is_perturbed_and_restored():
    """bfloat16 weights: the ascent is computed on float32 copies and written back in bfloat16."""
    torch.manual_seed(0)
    model = PlainViT().to(torch.bfloat16)
    x, y = torch.randn(8, 1, 8, 8, dtype=torch.bfloat16), torch.randint(0, 3, (8,))
    w = params_of(model)
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.5, geometry="geodesic-mix", lr=0.0)
    F.cross_entropy(model(x).float(), y).backward()
    opt.first_step(zero_grad=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), w[n])}
    assert any(".attn.q." in n for n in moved) and "head.weight" in moved
    F.cross_entropy(model(x).float(), y).backward()
    opt.second_step()
    assert all(torch.equal(p.detach(), w[n]) for n, p in model.named_parameters())


def test_step_with_closure_equals_the_two_steps_and_accepts_an_instance():
    torch.manual_seed(0)
    model = PlainViT()
    twin = copy.deepcopy(model)
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,)))

    w = params_of(model)
    opt = GeodesicSAM(model, torch.optim.AdamW, rho=0.3, geometry="geodesic-inv", lr=1e-2)
    loss = opt.step(lambda: backward(model, batch))
    with torch.no_grad():
        assert loss == pytest.approx(float(F.cross_entropy(twin(batch[0]), batch[1])))  # at w

    base = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    manual = GeodesicSAM(twin, base, rho=0.3, geometry="geodesic-inv")
    backward(twin, batch)
    manual.first_step(zero_grad=True)
    backward(twin, batch)
    manual.second_step(zero_grad=True)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p.detach(), w[n]) for n, p in model.named_parameters())
    assert manual.base_optimizer is base and manual.param_groups is base.param_groups


def test_lr_scheduler_and_state_dict_act_on_the_base_optimizer():
    torch.manual_seed(0)
    model = PlainViT()
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.1, geometry="adaptive", lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batch = (torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,)))
    opt.step(lambda: backward(model, batch))
    sched.step()
    assert opt.base_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    state = opt.state_dict()
    assert state["state"]  # momentum buffers of the base optimizer
    fresh = GeodesicSAM(model, torch.optim.SGD, rho=0.1, geometry="adaptive", lr=0.1, momentum=0.9)
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.05)
    assert fresh.param_groups is fresh.base_optimizer.param_groups


# ------------------------------------------------------------------------------------ (4) training
@pytest.mark.parametrize("geometry,rho", [("geodesic-mix", 0.05), ("geodesic-inv", 0.3),
                                          ("adaptive", 0.3), ("sam", 0.05)])
def test_a_few_steps_decrease_the_loss(geometry, rho):
    torch.manual_seed(0)
    model = PlainViT().train()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    opt = GeodesicSAM(model, torch.optim.AdamW, rho=rho, geometry=geometry, lr=1e-2)
    losses = [opt.step(lambda: backward(model, (x, y))) for _ in range(15)]
    with torch.no_grad():
        final = float(F.cross_entropy(model(x), y))
    print(f"\n{geometry}: loss {losses[0]:.3f} -> {final:.3f} in 15 steps")
    assert final < 0.5 * losses[0], (geometry, losses[0], final)


# ------------------------------------------------------------------------------------ (5) cost
@pytest.mark.parametrize("geometry", ["sam", "adaptive", "geodesic-inv", "geodesic-mix"])
def test_an_update_costs_two_passes_like_plain_sam(geometry):
    """Every geometry's update is plain SAM's two forward/backward passes (the closure at w, then
    at w_adv) and nothing more: the ascent itself (geodesic and all) runs no forward pass. The time
    per update is a benchmark (benchmarks/bench_sam.py), not a test."""
    torch.manual_seed(0)
    model = PlainViT(dim=32, num_heads=4)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    forwards, closures = [], []
    model.register_forward_hook(lambda *_: forwards.append(1))

    def closure():
        closures.append(1)
        return backward(model, (x, y))

    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.01, geometry=geometry, lr=0.0)
    opt.step(closure)                   # the first step may verify the detected layout
    for _ in range(3):
        forwards.clear(), closures.clear()
        opt.step(closure)
        assert len(closures) == 2 and len(forwards) == 2, (geometry, len(closures), len(forwards))
    closure()
    forwards.clear()
    opt.first_step(zero_grad=True)
    assert not forwards, f"{geometry}: the ascent ran {len(forwards)} forward pass(es)"
    opt.second_step(zero_grad=True)


# ------------------------------------------------------------------------------------ errors
def test_errors_say_what_to_do():
    torch.manual_seed(0)
    model = PlainViT()
    batch = (torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,)))
    opt = GeodesicSAM(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(UsageError, match="loss.backward"):
        opt.first_step()
    with pytest.raises(UsageError, match="closure"):
        opt.step()
    with pytest.raises(UsageError, match="first_step"):
        opt.second_step()
    backward(model, batch)
    opt.first_step()
    with pytest.raises(UsageError, match="twice"):
        opt.first_step()
    opt.second_step()
    with pytest.raises(InvalidArgument, match="geometry"):
        GeodesicSAM(model, torch.optim.SGD, geometry="asam", lr=0.1)
    with pytest.raises(InvalidArgument, match="first_order"):
        GeodesicSAM(model, torch.optim.SGD, geometry="adaptive", retraction="exact", lr=0.1)
    with pytest.raises(InvalidArgument, match="rho"):
        GeodesicSAM(model, torch.optim.SGD, rho=0.0, lr=0.1)
    with pytest.raises(InvalidArgumentType, match="instance"):
        GeodesicSAM(model, torch.optim.SGD(model.parameters(), lr=0.1), lr=0.1)
    with pytest.raises(InvalidArgumentType, match="Optimizer"):
        GeodesicSAM(model, "sgd", lr=0.1)
    with pytest.raises(InvalidArgument, match="not parameters of the model"):
        GeodesicSAM(model, torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    no_attention = [p for n, p in model.named_parameters() if ".attn." not in n]
    with pytest.raises(InvalidArgument, match="does not update"):
        GeodesicSAM(model, torch.optim.SGD(no_attention, lr=0.1))
    # an exception at w_adv leaves the weights at w
    w = params_of(model)

    def failing():
        if failing.calls:
            raise KeyboardInterrupt
        failing.calls += 1
        backward(model, batch)
    failing.calls = 0
    with pytest.raises(KeyboardInterrupt):
        opt.step(failing)
    assert all(torch.equal(p.detach(), w[n]) for n, p in model.named_parameters())


# ------------------------------------------------------------------------------------ non-finite, AMP
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def _poison(model, seed, value):
    """Write ``value`` into one entry, chosen by ``seed``, of one parameter's ``.grad``."""
    g = torch.Generator().manual_seed(seed)
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    name, p = named[int(torch.randint(len(named), (1,), generator=g))]
    p.grad.view(-1)[int(torch.randint(p.grad.numel(), (1,), generator=g))] = value
    return name


@pytest.mark.parametrize("geometry", ["geodesic-mix", "geodesic-inv", "adaptive", "sam"])
def test_second_step_refuses_a_non_finite_gradient_at_w_adv_and_restores_w(geometry):
    """NaN/±inf anywhere in the gradient at w_adv: second_step raises, the weights are w bit for bit,
    the base optimizer took no step (no momentum buffer), and the next update runs normally."""
    torch.manual_seed(0)
    model = PlainViT()
    batch = (torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,)))
    w = params_of(model)
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.3, geometry=geometry, lr=0.1, momentum=0.9)
    for seed, value in enumerate(NON_FINITE * 2):
        backward(model, batch)
        opt.first_step(zero_grad=True)
        backward(model, batch)
        name = _poison(model, seed, value)
        with pytest.raises(InvalidArgument, match="non-finite.*restored to w") as err:
            opt.second_step(zero_grad=True)
        assert name in str(err.value)
        assert all(torch.equal(p.detach(), w[n]) for n, p in model.named_parameters()), (seed, name)
        assert not opt.base_optimizer.state
        opt.zero_grad()
    opt.step(lambda: backward(model, batch))           # the state is clean: an update goes through
    assert opt.base_optimizer.state and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("key,value", [("lr", v) for v in NON_FINITE] + [
    ("momentum", float("nan")), ("weight_decay", float("inf")), ("dampening", float("nan")),
    ("lr", torch.tensor(float("nan")))])
def test_base_optimizer_hyperparameters_are_validated(key, value):
    """A non-finite (or negative) setting of the base optimizer is refused: as a class's keyword, in
    an instance, and when a schedule or the user writes it into a param group later (refused at
    first_step, before any weight moves)."""
    torch.manual_seed(0)
    model = PlainViT()
    batch = (torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,)))
    kwargs = {"lr": 0.1, "momentum": 0.9, key: value}
    with pytest.raises(ValueError, match=f"{key}=|Invalid"):   # ours, or torch's own (negative values)
        GeodesicSAM(model, torch.optim.SGD, geometry="adaptive", **kwargs)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    base.param_groups[0][key] = value           # torch lets NaN through (nan < 0 is False)
    with pytest.raises(InvalidArgument, match=f"param group 0 has {key}="):
        GeodesicSAM(model, base, geometry="adaptive")
    opt = GeodesicSAM(model, torch.optim.SGD, geometry="adaptive", lr=0.1, momentum=0.9)
    opt.param_groups[0][key] = value
    w = params_of(model)
    backward(model, batch)
    with pytest.raises(InvalidArgument, match=key):
        opt.first_step()
    assert all(torch.equal(p.detach(), w[n]) for n, p in model.named_parameters())
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    adam.param_groups[0]["lr"] = -1e-3         # a negative rate would ascend: refused too
    with pytest.raises(InvalidArgument, match="lr=-0.001: a number >= 0"):
        GeodesicSAM(model, adam, geometry="adaptive")
    adam.param_groups[0].update(lr=1e-3, betas=(0.9, float("nan")))
    with pytest.raises(InvalidArgument, match="betas=.*nan"):
        GeodesicSAM(model, adam, geometry="adaptive")
    adam.param_groups[0].update(betas=(0.9, 0.999), custom_threshold=float("inf"))
    GeodesicSAM(model, adam, geometry="adaptive")   # an infinite setting torch does not define: kept


@pytest.mark.parametrize("geometry", ["geodesic-mix", "geodesic-inv", "adaptive", "sam"])
def test_bf16_autocast_step_is_finite_and_a_non_finite_gradient_leaves_the_model(geometry):
    """float32 weights, forward and backward in bfloat16 autocast: the update is finite and moves
    the weights; a NaN gradient (at w or at w_adv) leaves them as they were."""
    torch.manual_seed(0)
    model = PlainViT()
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,)))

    def closure():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return backward(model, batch)

    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.3, geometry=geometry, lr=0.1)
    w = params_of(model)
    assert math.isfinite(opt.step(closure)) and math.isfinite(opt.grad_norm) and opt.grad_norm > 0
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(p.detach(), w[n]) for n, p in model.named_parameters())
    for where in ("w", "w_adv"):
        w = params_of(model)
        opt.zero_grad()
        closure()
        if where == "w":
            _poison(model, 0, float("nan"))
        else:
            opt.first_step(zero_grad=True)
            closure()
            _poison(model, 1, float("inf"))
        with pytest.raises(InvalidArgument, match="non-finite"):
            opt.first_step() if where == "w" else opt.second_step()
        assert all(torch.equal(p.detach(), w[n]) for n, p in model.named_parameters()), where


def test_grad_scaler_unscales_before_the_norm_and_skips_an_overflow():
    """float16-style loop with a torch.amp.GradScaler: the gradients are unscaled before ‖g‖ and
    the base step (the update equals the unscaled one bit for bit: the scale is a power of 2); an
    overflow at w or at w_adv skips the update, leaves the weights, and halves the scale."""
    torch.manual_seed(0)
    model = PlainViT()
    twin = copy.deepcopy(model)
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,)))

    def scaled(scaler):
        inputs, targets = batch
        scaler.scale(F.cross_entropy(model(inputs), targets)).backward()

    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.3, geometry="geodesic-mix", lr=0.1, momentum=0.9)
    plain = GeodesicSAM(twin, torch.optim.SGD, rho=0.3, geometry="geodesic-mix", lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=100)
    scaled(scaler)
    opt.first_step(zero_grad=True, scaler=scaler)
    scaled(scaler)
    opt.second_step(zero_grad=True)
    plain.step(lambda: backward(twin, batch))
    assert opt.skipped is False and opt.grad_norm == plain.grad_norm
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    assert scaler.get_scale() == 2.0 ** 10

    for where in ("w", "w_adv"):
        w = params_of(model)
        scale = scaler.get_scale()
        scaled(scaler)
        if where == "w":
            _poison(model, 2, float("inf"))
        opt.first_step(zero_grad=True, scaler=scaler)
        assert opt.skipped is (None if where == "w" else False)
        scaled(scaler)
        if where == "w_adv":
            _poison(model, 3, float("nan"))
        opt.second_step(zero_grad=True, scaler=scaler)
        assert opt.skipped is True, where
        assert all(torch.equal(p.detach(), w[n]) for n, p in model.named_parameters()), where
        assert scaler.get_scale() == scale / 2, where


def test_parameters_replaced_after_construction_are_refused():
    """fully_shard (or assigning a new Parameter) after GeodesicSAM was built leaves the base
    optimizer on the old tensors: first_step refuses before any weight moves."""
    torch.manual_seed(0)
    model = PlainViT()
    opt = GeodesicSAM(model, torch.optim.SGD, geometry="adaptive", lr=0.1)
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    w = params_of(model)
    backward(model, (torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))))
    with pytest.raises(UsageError, match="head.weight were replaced.*after sharding"):
        opt.first_step()
    assert all(torch.equal(p.detach(), w[n]) for n, p in model.named_parameters())
