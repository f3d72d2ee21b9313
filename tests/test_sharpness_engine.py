"""Sharpness engine: half-precision models, argument handling, progress, train flags, Hugging Face
dict batches and next-token loss, verify gating, thread bounds, and the faces' frame cache."""

from __future__ import annotations

import collections
import copy
import math
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from quotient_manifolds import adapters
from quotient_manifolds.adapters.ball import GEOMETRIES
from quotient_manifolds.adapters.components import ProductBall
from quotient_manifolds.adapters.elementwise import ElementwiseComponent, StreamedPoint
from quotient_manifolds.adapters.losses import next_token_loss
from quotient_manifolds.adapters.solver import auto_pgd
from quotient_manifolds.adapters.worst_case import sharpness
from quotient_manifolds._runtime import FrameCache, bounded_threads
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

transformers = pytest.importorskip("transformers")


def _labelled(inputs: dict, num_labels: int = 2):
    g = torch.Generator().manual_seed(1)
    return [(inputs, torch.randint(0, num_labels, (inputs["input_ids"].shape[0],), generator=g))]


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ------------------------------------------------------------------------------ half precision
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.02), (torch.float16, 0.01)])
def test_half_precision_model_matches_float32_copy_of_its_weights(tiny_bert, dtype, tol):
    model, inputs = tiny_bert
    half = model.to(dtype)
    full = copy.deepcopy(half).float()  # the same rounded weights, in float32
    batches = _labelled(inputs)
    before = {n: p.detach().clone() for n, p in half.named_parameters()}
    for geometry in GEOMETRIES:
        got = sharpness(half, batches, geometry=geometry, rho=0.01, n_iters=5)
        want = sharpness(full, batches, geometry=geometry, rho=0.01, n_iters=5).value
        assert want > 0
        assert abs(got.value / want - 1) < tol, (geometry, got.value, want)
        assert "float32" in got.options["compute_dtype"]
    for n, p in half.named_parameters():
        assert p.dtype == dtype and torch.equal(p.detach(), before[n]), n


def test_half_precision_floating_inputs_are_cast(plain_vit):
    model, x = plain_vit
    half = model.to(torch.bfloat16)
    full = copy.deepcopy(half).float()
    xh = x.to(torch.bfloat16)
    targets = torch.tensor([0, 2])
    got = sharpness(half, [(xh, targets)], geometry="geodesic-mix", rho=0.05, n_iters=4).value
    want = sharpness(full, [(xh.float(), targets)], geometry="geodesic-mix", rho=0.05,
                     n_iters=4).value
    assert got == pytest.approx(want, rel=1e-6)


def test_half_precision_loss_is_refused(tiny_bert):
    model, inputs = tiny_bert
    with pytest.raises(InvalidArgumentType, match="bfloat16.*float32"):
        sharpness(model, _labelled(inputs), geometry="adaptive", rho=0.01, n_iters=2,
                  loss_fn=lambda o, t: nn.functional.cross_entropy(o.logits, t).bfloat16())


# ------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("rho", [np.float32(0.05), np.array(0.05), torch.tensor(0.05),
                                 np.float64(0.05)])
def test_rho_accepts_numpy_and_torch_scalars(tiny_bert, rho):
    model, inputs = tiny_bert
    batches = _labelled(inputs)
    want = sharpness(model, batches, geometry="adaptive", rho=float(rho), n_iters=3)
    got = sharpness(model, batches, geometry="adaptive", rho=rho, n_iters=3)
    assert type(got.rho) is float and got.value == want.value


@pytest.mark.parametrize("rho", [float("nan"), float("inf"), np.float32(-1), torch.tensor(0.0),
                                 torch.tensor([0.1, 0.2]), "0.1", None])
def test_rho_rejects_bad_values_clearly(tiny_bert, rho):
    model, inputs = tiny_bert
    with pytest.raises(InvalidArgument, match="rho"):
        sharpness(model, _labelled(inputs), geometry="adaptive", rho=rho, n_iters=2)


def test_all_frozen_model_is_refused_clearly(tiny_bert):
    model, inputs = tiny_bert
    model.requires_grad_(False)
    with pytest.raises(InvalidArgument, match="no trainable parameter.*requires_grad"):
        sharpness(model, _labelled(inputs), rho=0.1)
    assert not any(p.requires_grad for p in model.parameters())


def test_malformed_batch_is_reported(tiny_bert):
    model, inputs = tiny_bert
    with pytest.raises(InvalidArgument, match="batch 0.*pair or a dict"):
        sharpness(model, [inputs["input_ids"]], geometry="adaptive", rho=0.1, n_iters=2)


# ------------------------------------------------------------------------------ progress
def test_progress_counts_auto_pgd_iterations(tiny_bert, monkeypatch):
    import tqdm.auto

    bars = []

    class Recorder:
        def __init__(self, *args, total=None, **kwargs):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    model, inputs = tiny_bert
    batches = _labelled(inputs) * 2
    sharpness(model, batches, geometry="adaptive", rho=0.1, n_iters=4, progress=True)
    sharpness(model, batches, geometry="adaptive", rho=0.1, measure="average", n_samples=3,
              progress=True)
    assert [(b.total, b.n, b.closed) for b in bars] == [(8, 8, True), (6, 6, True)]


def test_auto_pgd_on_iteration_reports_every_iteration():
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    ball = ProductBall([ElementwiseComponent({"w": w})])
    seen = []
    res = auto_pgd(ball, lambda pts: (pts[0] ** 3).sum(), 0.1, n_iters=6,
                   on_iteration=lambda k, loss: seen.append((k, loss)))
    assert seen == list(enumerate(res.history[1:]))


# ------------------------------------------------------------------------------ train flags
def test_every_submodule_training_flag_is_restored(tiny_bert):
    model, inputs = tiny_bert
    model.train()
    model.bert.embeddings.eval()  # e.g. frozen embeddings kept in eval mode by the user
    flags = {n: m.training for n, m in model.named_modules(remove_duplicate=False)}
    seen = []
    loss = lambda o, t: (seen.append(model.bert.encoder.training),  # noqa: E731
                         nn.functional.cross_entropy(o.logits, t))[1]
    sharpness(model, _labelled(inputs), geometry="adaptive", rho=0.1, n_iters=2, loss_fn=loss)
    assert seen and not any(seen)  # evaluated in eval mode
    assert {n: m.training for n, m in model.named_modules(remove_duplicate=False)} == flags


# ------------------------------------------------------------------------------ HF dict batches
def test_next_token_loss_is_the_hf_causal_lm_loss():
    model, batch = _tiny_llama()
    with torch.no_grad():
        out = model(**batch)
    assert float(next_token_loss(out, batch["labels"])) == pytest.approx(float(out.loss), rel=1e-6)
    assert adapters.next_token_loss is next_token_loss
    with pytest.raises(InvalidArgument, match="labels of shape"):
        next_token_loss(out, batch["labels"][:, :-1])


def test_dict_batches_equal_tuple_batches_for_causal_lm():
    model, batch = _tiny_llama()
    kw = dict(geometry="adaptive", rho=0.05, n_iters=5)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    tuples = sharpness(model, [(inputs, batch["labels"])], loss_fn=next_token_loss, **kw)
    dicts = sharpness(model, [batch], loss_fn=next_token_loss, **kw)
    own = sharpness(model, [batch], **kw)  # the model's own outputs.loss
    assert tuples.value > 0
    assert dicts.per_batch == tuples.per_batch
    # HF sums in another order: equal up to float32 rounding of the losses (~4, ulp 5e-7)
    assert own.value == pytest.approx(tuples.value, abs=1e-5)
    assert own.init_losses[0] == pytest.approx(tuples.init_losses[0], rel=1e-6)


def test_dict_batch_without_labels_is_explained():
    model, batch = _tiny_llama()
    unlabelled = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with pytest.raises(InvalidArgument, match="no loss.*'labels'"):
        sharpness(model, [unlabelled], geometry="adaptive", rho=0.05, n_iters=2)
    with pytest.raises(InvalidArgument, match="no 'labels'"):
        sharpness(model, [unlabelled], geometry="adaptive", rho=0.05, n_iters=2,
                  loss_fn=next_token_loss)
    with pytest.raises(InvalidArgument, match="normalize_logits"):
        sharpness(model, [batch], geometry="adaptive", rho=0.05, n_iters=2,
                  normalize_logits=True)


# ------------------------------------------------------------------------------ verify gating
def test_layout_with_failed_verify_is_verified_again_or_run_as_is_when_unsafe(tiny_bert):
    """A layout whose last verification failed runs as it is with unsafe=True (warning); without it,
    it is verified again on the first batch (these blocks are symmetries: nothing is refused)."""
    model, inputs = tiny_bert
    batches = _labelled(inputs)
    lay = adapters.layout(model)
    bad = lay.blocks[0].name
    lay.verify_failed = [bad]
    with pytest.warns(UserWarning, match=rf"unsafe=True.*{bad}"):
        res = sharpness(model, batches, geometry="geodesic-mix", rho=0.05, n_iters=2, layout=lay,
                        unsafe=True)
    assert math.isfinite(res.value)
    assert math.isfinite(sharpness(model, batches, geometry="geodesic-mix", rho=0.05, n_iters=2,
                                   layout=lay).value)
    assert lay.verify_failed == []


# ------------------------------------------------------------------------------ threads
def test_small_model_runs_on_one_thread_and_setting_is_restored(tiny_bert):
    model, inputs = tiny_bert
    previous = torch.get_num_threads()
    seen = []
    loss = lambda o, t: (seen.append(torch.get_num_threads()),  # noqa: E731
                         nn.functional.cross_entropy(o.logits, t))[1]
    try:
        torch.set_num_threads(2)
        sharpness(model, _labelled(inputs), geometry="adaptive", rho=0.1, n_iters=1, loss_fn=loss)
        assert set(seen) == {1} and torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), bounded_threads(1):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


# ------------------------------------------------------------------------------ frame cache
def _count_frames(monkeypatch, manifold):
    calls = []
    build = manifold.geometry.frame

    def counting(x, **kwargs):
        calls.append(1)
        return build(x, **kwargs)

    monkeypatch.setattr(manifold.geometry, "frame", counting)
    return calls


def _adam_run(manifold, steps: int):
    import geoopt

    torch.manual_seed(0)
    target = torch.randn(9, 4, dtype=torch.float64) @ torch.randn(4, 7, dtype=torch.float64)
    x = geoopt.ManifoldParameter(manifold.random(dtype=torch.float64), manifold=manifold)
    opt = geoopt.optim.RiemannianAdam([x], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        G, H = manifold.split(x)
        (0.5 * ((G @ H.T - target) ** 2).sum()).backward()
        opt.step()
    return x.detach().clone()


def test_frame_cache_one_adam_step_and_unchanged_results(monkeypatch):
    pytest.importorskip("geoopt")
    from quotient_manifolds import GLQuotient

    cached = GLQuotient(9, 7, 4, metric="mix")
    calls = _count_frames(monkeypatch, cached)
    x1 = _adam_run(cached, 1)
    assert len(calls) == 2  # at x (egrad2rgrad, component_inner, retr) and at y (transp); was 4
    cached = GLQuotient(9, 7, 4, metric="mix")
    calls = _count_frames(monkeypatch, cached)
    x3 = _adam_run(cached, 3)
    assert len(calls) == 2 + 1 + 1  # later steps reuse the frame at y, the next point

    plain = GLQuotient(9, 7, 4, metric="mix")
    plain._frame_cache = FrameCache(size=0)  # no caching
    assert torch.equal(x1, _adam_run(plain, 1)) and torch.equal(x3, _adam_run(plain, 3))


def test_frame_cache_is_invalidated_by_in_place_writes():
    pytest.importorskip("geoopt")
    from quotient_manifolds import GLQuotient

    M = GLQuotient(9, 7, 4, metric="inv")
    x = M.random(dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    u = torch.randn(16, 4, dtype=torch.float64)
    first = M.inner(x, u)
    assert torch.equal(M.inner(x, u), first)
    x.data.mul_(2.0)  # does not bump x._version
    assert torch.allclose(M.inner(x, u), M.geometry.frame(x).inner(u))
    assert not torch.allclose(M.inner(x, u), first)
    with torch.no_grad():
        x.copy_(2 * x)  # bumps x._version
    assert torch.allclose(M.inner(x, u), M.geometry.frame(x).inner(u))


def test_frame_cache_is_bypassed_for_points_needing_autograd():
    pytest.importorskip("geoopt")
    from quotient_manifolds import GLQuotient

    M = GLQuotient(9, 7, 4, metric="mix")
    x = M.random(dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    u = torch.randn(16, 4, dtype=torch.float64)
    grads = []
    for _ in range(2):  # a cached graph-holding frame would fail the second backward
        (g,) = torch.autograd.grad(M.norm(x, u), x)
        grads.append(g)
    assert torch.equal(*grads)


def test_pymanopt_frame_cache_reuses_frames_at_one_point(monkeypatch):
    pytest.importorskip("pymanopt")
    from quotient_manifolds.pymanopt import GLQuotient

    M = GLQuotient(9, 7, 4, metric="mix")
    calls = _count_frames(monkeypatch, M)
    np.random.seed(0)
    x = M.random_point()
    u = M.random_tangent_vector(x)
    calls.clear()
    a = M.inner_product(x, u, u)
    M.projection(x, u)
    M.norm(x, u)
    assert len(calls) == 1
    x.G[0, 0] += 1.0  # in-place edit of the numpy array
    assert M.inner_product(x, u, u) != a and len(calls) == 2


# ------------------------------------------------------------------------------ rho sweeps, retraction check
def _fitted_vit():
    from quotient_manifolds.experiments.vit import ViT, ViTConfig

    torch.manual_seed(0)
    model = ViT(ViTConfig(width=16, depth=1, heads=2)).eval()
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval(), [(x, y)]


def test_sweep_never_returns_a_smaller_maximum_for_a_larger_ball():
    model, batches = _fitted_vit()
    rhos = [0.003, 0.01, 0.03, 0.1, 0.3, 1.0]
    for geometry in ("geodesic-mix", "geodesic-inv", "adaptive"):
        results = adapters.sharpness_sweep(model, batches, rhos, geometry=geometry, n_iters=8,
                                           check_retraction=False)
        values = [r.value for r in results]
        assert [r.rho for r in results] == rhos
        assert all(b >= a for a, b in zip(values, values[1:])), (geometry, values)
        assert all(r.norms[0] <= rho * (1 + 1e-6) for r, rho in zip(results, rhos))
    # the first radius of a sweep is an ordinary run
    single = adapters.sharpness(model, batches, geometry="geodesic-mix", rho=rhos[0], n_iters=8,
                                check_retraction=False)
    first = adapters.sharpness_sweep(model, batches, rhos[:1], geometry="geodesic-mix", n_iters=8,
                                     check_retraction=False)[0]
    assert first.per_batch == single.per_batch


def test_sweep_rejects_bad_radii_and_warm_start_outside_the_ball():
    model, batches = _fitted_vit()
    with pytest.raises(InvalidArgument, match="strictly increasing"):
        adapters.sharpness_sweep(model, batches, [0.1, 0.05])
    with pytest.raises(InvalidArgument, match="average"):
        adapters.sharpness_sweep(model, batches, [0.1], measure="average")
    with pytest.raises(InvalidArgumentType):
        adapters.sharpness_sweep(model, batches, [0.1], no_such_option=1)
    params = {n: p.detach() for n, p in model.named_parameters()}
    ball, _ = adapters.ball.build_ball(model, params, geometry="adaptive")
    big = ball.random(torch.Generator().manual_seed(0))
    with pytest.raises(InvalidArgument, match="warm start"):
        adapters.solver.auto_pgd(ball, lambda pts: sum(p.sum() for p in pts), 1e-3, n_iters=2,
                          start=(big, 0.0))


def test_retraction_check_warns_when_second_order_leaves_its_range():
    """At a large rho the mix second-order step is far from the geodesic on small weights: the
    check records the gap and warns; at a small rho it is silent and the gap is tiny."""
    model, batches = _fitted_vit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small = adapters.sharpness(model, batches, geometry="geodesic-inv", rho=1e-3, n_iters=6)
    assert len(small.retraction_gaps) == 1 and abs(small.retraction_gaps[0]) < 1e-2
    with pytest.warns(UserWarning, match="retraction='exact'"):
        large = adapters.sharpness(model, batches, geometry="geodesic-mix", rho=0.3, n_iters=6)
    assert not abs(large.retraction_gaps[0]) <= 0.1
    exact = adapters.sharpness(model, batches, geometry="geodesic-mix", rho=1e-3, n_iters=4,
                               retraction="exact")
    assert exact.retraction_gaps == []          # nothing to check: the run used the geodesic


def test_retraction_check_says_when_the_exact_geodesic_leaves_the_manifold(monkeypatch):
    """A gap of -inf (a factor of the exact geodesic loses rank) is reported in words, not as a
    meaningless "-inf%"."""
    engine = sys.modules["quotient_manifolds.adapters.worst_case"]     # the module of the sharpness entry points
    model, batches = _fitted_vit()
    monkeypatch.setattr(engine, "_retraction_gap", lambda *args: -math.inf)
    with pytest.warns(UserWarning, match="on batch 0 the exact geodesic leaves the manifold") as seen:
        res = adapters.sharpness(model, batches, geometry="geodesic-mix", rho=0.3, n_iters=2)
    assert "inf%" not in str(seen[0].message) and res.retraction_gaps == [-math.inf]


@pytest.mark.parametrize("geometry,rho,steps", [("geodesic-inv", 1e-3, "few"),
                                                ("geodesic-mix", 0.01, "more"),
                                                ("geodesic-mix", 0.3, "most")])
def test_retraction_check_takes_few_steps_where_they_agree(monkeypatch, geometry, rho, steps):
    """The check integrates the exact geodesic with 1, 2, 4, … RK4 steps until two endpoints agree:
    on a smooth geodesic two step counts suffice; where 1 and 2 steps disagree it takes more, and
    where the geodesic bends fast (mix at a large rho) the most; either way it measures the gap of
    the fixed most steps."""
    engine = sys.modules["quotient_manifolds.adapters.worst_case"]
    from quotient_manifolds.adapters.components import QuotientComponent

    model, batches = _fitted_vit()
    taken = []
    point = QuotientComponent.point

    def counted(self, xi, retraction=None, exact_steps=None, **kw):
        if retraction == "exact":
            taken.append(exact_steps)
        return point(self, xi, retraction, exact_steps, **kw)

    monkeypatch.setattr(QuotientComponent, "point", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = adapters.sharpness(model, batches, geometry=geometry, rho=rho, n_iters=4)
    most = engine.CHECK_EXACT_STEPS
    assert {"few": max(taken) <= 2, "more": 2 < max(taken), "most": max(taken) == most}[steps]
    taken.clear()
    monkeypatch.setattr(engine, "_endpoints_agree", lambda *a: False)   # the most steps, as before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fixed = adapters.sharpness(model, batches, geometry=geometry, rho=rho, n_iters=4)
    assert max(taken) == most
    assert got.retraction_gaps[0] == pytest.approx(fixed.retraction_gaps[0], abs=1e-3)


# ------------------------------------------------------------------------------ solver at scale
def _toy_ball(dtype=torch.float64):
    """A GL(2) quotient (3 heads) and an elementwise part with a zero, a tiny and a masked-out
    weight, and a non-convex loss (restarts happen)."""
    from quotient_manifolds.adapters.components import QuotientComponent
    from quotient_manifolds.core import GLQuotientGeometry

    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 9, 2, dtype=torch.float64, generator=gen)
    frame = GLQuotientGeometry(5, 4, 2, "mix").frame(x0)
    gl = QuotientComponent("gl", frame, x0, retraction="second_order", dtype=dtype)
    a = torch.randn(7, 3, dtype=dtype, generator=gen)
    b = torch.randn(11, dtype=dtype, generator=gen)
    a[0, 0], a[1, 1], b[2] = 0.0, 1e-200, -1e-200  # w² underflows: fixed
    mask = torch.ones(11, dtype=torch.bool)
    mask[5:7] = False
    el = ElementwiseComponent({"a": a, "b": b}, masks={"b": mask})
    v = torch.randn(3, dtype=dtype, generator=gen)

    def closure(points):
        x, parts = points[0], el.unflatten(points[1])
        scores = x[:, :5] @ x[:, 5:].mT
        return (torch.sin(3 * scores).sum() + torch.tanh(parts["a"] @ v).pow(2).sum()
                + torch.cos(2 * parts["b"]).sum())

    return ProductBall([gl, el]), closure


def _reference_auto_pgd(ball, closure, rho, n_iters, momentum, start=None, alpha=0.75):
    """Auto-PGD written out plainly (docs/maths.md §7.3): fresh tensors, ξ in the ball's own
    coordinates, every norm computed from its vector."""
    checkpoints = set(adapters.solver.apgd_checkpoints(n_iters))

    def evaluate(xi, need_grad):
        leaves = [t.detach().requires_grad_(need_grad) for t in xi]
        with torch.enable_grad():
            loss = closure(ball.points(leaves))
        if not need_grad:
            return float(loss.detach()), None
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return float(loss.detach()), ball.rgrad([torch.zeros_like(t) if g is None else g.clone()
                                        for g, t in zip(grads, leaves)])

    def into_ball(u):
        nrm = float(ball.norm(u))
        return u if nrm <= rho else [t * (rho / nrm) for t in u]

    eta = 2 * rho
    if start is None:
        xi = ball.zeros()
        loss0, grad = evaluate(xi, True)
        worst = loss0
    else:
        xi, loss0 = [t.clone() for t in start[0]], start[1]
        worst, grad = evaluate(xi, True)
    xi_prev, xi_worst, grad_worst = xi, xi, grad
    history, steps = [worst], [eta]
    n_updates, last_ckpt, ckpt_eta, ckpt_worst = 0, 0, eta, worst
    for k in range(n_iters):
        if k in checkpoints:
            stalled = n_updates < 0.75 * (k - last_ckpt)
            frozen = ckpt_eta == eta and ckpt_worst == worst
            ckpt_eta, ckpt_worst = eta, worst
            if stalled or frozen:
                eta /= 2
                xi, xi_prev, grad = xi_worst, xi_worst, grad_worst
            n_updates, last_ckpt = 0, k
        step = eta / float(ball.norm(grad))
        z = into_ball([x + step * g for x, g in zip(xi, grad)])
        if momentum == "none" or k == 0:
            new = z
        elif momentum == "apgd":
            new = into_ball([x + alpha * (s - x) + (1 - alpha) * (x - p)
                             for x, s, p in zip(xi, z, xi_prev)])
        else:
            new = [0.75 * s + 0.25 * p for s, p in zip(z, xi_prev)]
        xi_prev, xi = xi, new
        loss, grad = evaluate(xi, k < n_iters - 1)
        history.append(loss)
        steps.append(eta)
        if loss > worst:
            worst, xi_worst, grad_worst = loss, xi, grad
            n_updates += 1
    return history, steps, xi_worst


@pytest.mark.parametrize("momentum", ["apgd", "andriushchenko", "none"])
def test_in_place_auto_pgd_follows_the_plain_algorithm(momentum):
    """The solver's in-place steps (three rotating iterate buffers, ‖ξ + s g‖ from scalars, the
    elementwise part in r = ξ/w) take the steps of the algorithm written out plainly, restarts and
    warm start included (float64: agreement to rounding)."""
    ball, closure = _toy_ball()
    got = None
    for rho in (0.05, 0.1):
        start = None if got is None else (got.xi, got.init_loss)  # a sweep's warm start
        want_hist, want_steps, want_xi = _reference_auto_pgd(ball, closure, rho, 20, momentum,
                                                             start)
        got = auto_pgd(ball, closure, rho, n_iters=20, momentum=momentum, start=start)
        assert got.history == pytest.approx(want_hist, rel=1e-9, abs=1e-12)
        # once the loss has settled to rounding, whether an iterate "improves" on the worst is a
        # coin flip of the last bit, and so are the restarts it triggers: the steps are compared
        # while the loss still moves (the restarts of apgd and andriushchenko happen there)
        moving = next((k for k, (a, b) in enumerate(zip(want_hist, want_hist[1:]))
                       if abs(b - a) <= 1e-12 * abs(a)), len(want_hist))
        assert got.step_sizes[:moving + 1] == want_steps[:moving + 1]
        if momentum != "none":
            assert any(b < a for a, b in zip(want_steps[:moving + 1], want_steps[1:moving + 1]))
        if start is None:  # restarts from the worst point were taken
            assert any(b < a for a, b in zip(want_steps, want_steps[1:]))
        assert got.worst_loss == pytest.approx(max(want_hist), rel=1e-12)
        for a, b in zip(got.xi, want_xi):  # near-ties on the plateau may pick a neighbour
            assert torch.allclose(a, b, rtol=0, atol=1e-6 * rho)
        assert got.norm <= rho * (1 + 1e-12)
        fixed = ball.components[1].unflatten(got.xi[1])
        assert fixed["a"][0, 0] == 0 and fixed["a"][1, 1] == 0 and fixed["b"][2] == 0
        assert bool((fixed["b"][5:7] == 0).all()) and bool((fixed["b"] != 0).sum() > 5)


def _streaming_toy_ball():
    """The elementwise part of :func:`_toy_ball` in the streaming layout (its backward writes the
    gradient into the solver's buffer) beside the same GL part."""
    ball, closure = _toy_ball()
    gl, el = ball.components
    tensors = dict(zip(el.names, el.tensors))
    masks = {"b": ~el.fixed[1].reshape(-1) | (el.tensors[1].reshape(-1) == 0)}
    stream = ElementwiseComponent(tensors, masks=masks, streaming=True)

    def streamed(points):
        point = points[1]
        if isinstance(point, StreamedPoint):  # the solver's: read the recipes
            values = {n: lazy.compute() for n, lazy in point.weights().items()}
            point = torch.cat([values[n].reshape(-1) for n in stream.names])
        return closure([points[0], point])

    return ProductBall([gl, stream]), streamed


@pytest.mark.parametrize("keep_worst_gradient", [False, True])
def test_streaming_auto_pgd_follows_the_plain_algorithm(keep_worst_gradient):
    """With the gradient written into a free iterate buffer by the streaming backward and the next
    iterate written over it, the solver still takes the plain algorithm's steps, whether the
    worst point's gradient is kept or recomputed at each restart (float64: the step is exact)."""
    ball, closure = _streaming_toy_ball()
    want_hist, want_steps, want_xi = _reference_auto_pgd(ball, closure, 0.05, 20, "apgd")
    got = auto_pgd(ball, closure, 0.05, n_iters=20, keep_worst_gradient=keep_worst_gradient)
    assert got.history == pytest.approx(want_hist, rel=1e-9, abs=1e-12)
    assert got.step_sizes == want_steps
    assert any(b < a for a, b in zip(want_steps, want_steps[1:]))  # restarts were taken
    # a restart from an older worst point recomputes its gradient unless it was kept
    restarts = sum(b < a for a, b in zip(want_steps, want_steps[1:]))
    assert (got.n_forward == 21) if keep_worst_gradient else (21 < got.n_forward <= 21 + restarts)
    for a, b in zip(got.xi, want_xi):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_quotient_gradient_in_closed_form_equals_autograd_through_the_retraction(dtype):
    """A GL component's gradient from ∂ℓ/∂point (the point is the autograd leaf; no vector-Jacobian
    product is formed) equals autograd through the retraction then the metric's Riemannian
    gradient: g, ‖g‖² and ⟨g, ξ⟩; also when ξ is handed back as another view of the same values
    (a sharded component's), and Gram products of a ξ changed since its point are not reused."""
    from quotient_manifolds.adapters.components import QuotientComponent
    from quotient_manifolds.core import GLQuotientGeometry
    from quotient_manifolds.core.gl import second_order_riemannian_gradient

    gen = torch.Generator().manual_seed(4)
    x0 = torch.randn(3, 12, 3, dtype=torch.float64, generator=gen)
    frame = GLQuotientGeometry(6, 6, 3, "inv").frame(x0.to(dtype), keep_dtype=True)
    comp = QuotientComponent("gl", frame, x0.to(dtype), retraction="second_order", dtype=dtype)
    assert comp.closed_form_gradient
    xi = comp.project(0.2 * torch.randn(x0.shape, dtype=dtype, generator=gen))
    weights = torch.randn(x0.shape, dtype=torch.float64, generator=gen)

    def gradient(closed, xi_given):
        comp.closed_form_gradient = closed
        inputs, point = comp.leaf_point(xi, True)
        loss = torch.sin(point.to(torch.float64) * weights).sum()
        grads = list(torch.autograd.grad(loss, inputs))
        return comp.gradient(grads, xi_given(xi))

    tol = 1e-12 if dtype == torch.float64 else 1e-5
    want = gradient(False, lambda u: u)
    for handed in (lambda u: u, lambda u: u.view(u.shape)):
        got = gradient(True, handed)
        assert (got[0] - want[0]).abs().max() <= tol * want[0].abs().max()
        assert float(got[1]) == pytest.approx(float(want[1]), rel=tol)
        assert float(got[2]) == pytest.approx(float(want[2]), rel=tol, abs=tol * float(want[1]) ** 0.5)
    comp.closed_form_gradient = True
    inputs, point = comp.leaf_point(xi, True)
    y_bar = torch.randn(point.shape, dtype=dtype, generator=gen)
    xi.mul_(1.5)                                   # ξ changed after its point: its grams are stale
    g = comp.gradient([y_bar], xi)[0]
    fresh = second_order_riemannian_gradient(frame, xi, y_bar).to(dtype)
    assert torch.equal(g, fresh)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_next_retraction_takes_the_gram_products_of_the_step(dtype):
    """combine computes ‖out‖² from the Gram products of out (the same number as the metric's inner
    product), finish_step_ scales them with out, and the retraction along the new ξ takes them: the
    same point as recomputing them, to rounding. A ξ changed after finish_step_, or another
    tensor, recomputes them."""
    from quotient_manifolds.adapters.components import QuotientComponent
    from quotient_manifolds.core import GLQuotientGeometry
    from quotient_manifolds.core.gl import second_order_step

    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(4, 14, 3, dtype=torch.float64, generator=gen).to(dtype)
    frame = GLQuotientGeometry(8, 6, 3, "mix").frame(x0, keep_dtype=True)
    comp = QuotientComponent("gl", frame, x0, retraction="second_order", dtype=dtype)
    xi, d, g = (comp.project(0.1 * torch.randn(x0.shape, dtype=dtype, generator=gen))
                for _ in range(3))
    out = torch.empty_like(xi)
    a, c, b = (torch.tensor(v, dtype=torch.float64) for v in (0.9, 0.3, 0.05))
    sq = comp.combine(out, xi, d, g, a, c, b)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert float(sq) == pytest.approx(float(frame.inner(out, out).sum(dtype=torch.float64)), rel=tol)
    factor = torch.tensor(0.7, dtype=torch.float64)
    comp.finish_step_(out, factor, xi, d)
    carried = comp._next[2]
    _, point = comp.leaf_point(out, False)
    want, grams = second_order_step(frame, out)
    for got, fresh in zip(carried, grams):
        assert (got - fresh).abs().max() <= tol * fresh.abs().max()
    assert (point.to(torch.float64) - want).abs().max() <= tol * want.abs().max()
    assert comp._next is None                          # used once
    # changed after the step (or never formed by combine): recomputed, exactly
    comp.combine(out, xi, d, g, a, c, b)
    comp.finish_step_(out, factor, xi, d)
    out.mul_(2.0)
    _, point = comp.leaf_point(out, False)
    assert torch.equal(point, second_order_step(frame, out)[0].to(dtype))


def test_compact_step_is_the_rounded_step():
    """The elementwise component's last step d = ξ⁺ − ξ is kept in bfloat16 for float32 iterates
    (finish_step_), and combine reads it as ξ⁻ = ξ − d: out = a ξ + c d + b g, here written over
    the gradient's own buffer, as the solver does."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3000, generator=gen)
    comp = ElementwiseComponent({"w": w}, streaming=True)
    d = comp.step_buffer(True)
    assert d.dtype == torch.bfloat16 and comp.step_buffer(False).dtype == torch.float32
    x, out = torch.randn(3000, generator=gen), torch.randn(3000, generator=gen)
    want_out = 0.5 * out
    comp.finish_step_(out, torch.tensor(0.5, dtype=torch.float64), x, d)
    assert torch.equal(out, want_out) and torch.equal(d, (want_out - x).bfloat16())
    g = torch.randn(3000, generator=gen)
    a, c, b = (torch.tensor(v, dtype=torch.float64) for v in (1.25, -0.25, 0.1))
    want = 1.25 * x - 0.25 * d.float() + 0.1 * g
    sq = comp.combine(g, x, d, g, a, c, b)
    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)
    assert float(sq) == pytest.approx(float(want.double() @ want.double()), rel=1e-5)
    f64 = ElementwiseComponent({"w": w.double()})
    assert f64.step_buffer(True).dtype == torch.float64  # float64 runs keep the step exact


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("direction, second_order",
                         [("riemannian", False), ("riemannian", True), ("andriushchenko", False)])
def test_elementwise_coordinates_match_the_adaptive_geometry(direction, second_order, flat):
    """In r = ξ/w the solver's point, gradient, norm and inner product are those of the adaptive
    geometry in ξ (point(ξ), rgrad, inner), with zero, tiny and masked-out weights fixed; the same
    with the flat (accelerator) layout of the passes."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(7, 3, dtype=torch.float64, generator=gen)
    b = torch.randn(11, dtype=torch.float64, generator=gen)
    a[0, 0], b[2] = 0.0, 1e-200
    mask = torch.ones(11, dtype=torch.bool)
    mask[5:7] = False
    comp = ElementwiseComponent({"a": a, "b": b}, masks={"b": mask}, direction=direction,
                                second_order=second_order, flat=flat)
    xi = 0.1 * comp.random(gen)
    r = comp.zeros()
    comp.to_coords(xi, r)
    assert torch.allclose(r @ r, comp.inner(xi, xi), rtol=1e-12)
    _, point = comp.leaf_point(r, False)
    assert torch.allclose(point, comp.point(xi), rtol=1e-12, atol=1e-300)
    egrad = torch.randn(comp.numel, dtype=torch.float64, generator=gen)
    leaf = xi.clone().requires_grad_()
    (egrad_xi,) = torch.autograd.grad(comp.point(leaf), leaf, grad_outputs=egrad)
    rgrad = comp.rgrad(egrad_xi.clone())
    h, sq, dot = comp.gradient([egrad.clone()] if flat else
                               [None, *[t.clone() for t in egrad.split(comp.sizes)]], r)
    flat_h = torch.cat(h)
    assert torch.allclose(flat_h * comp.x0, rgrad, rtol=1e-12, atol=1e-300)
    assert float(sq) == pytest.approx(float(comp.inner(rgrad, rgrad)), rel=1e-12)
    assert float(dot) == pytest.approx(float(comp.inner(rgrad, xi)), rel=1e-12)
    fixed = torch.zeros(comp.numel, dtype=torch.bool)
    fixed[[0, 21 + 2, 21 + 5, 21 + 6]] = True
    assert bool((flat_h[fixed] == 0).all()) and bool((flat_h[~fixed] != 0).all())
    assert torch.allclose(comp.from_coords_(r), xi, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("direction, second_order",
                         [("riemannian", False), ("riemannian", True), ("andriushchenko", False)])
def test_flat_and_piecewise_passes_give_the_same_run(monkeypatch, direction, second_order):
    """The accelerator layout (one contiguous copy, one flat leaf and gradient, one kernel per pass)
    runs the same Auto-PGD as the piecewise CPU layout (pieces across tensor boundaries, zero and
    masked-out weights): same losses, same worst perturbation and its attention share."""
    import quotient_manifolds.adapters.elementwise as solver

    monkeypatch.setattr(solver, "CHUNK", 37)  # several pieces per tensor
    gen = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(20, 9, dtype=torch.float64, generator=gen),
               "b": torch.randn(50, dtype=torch.float64, generator=gen),
               "c": torch.randn(7, 7, dtype=torch.float64, generator=gen)}
    tensors["a"][3, 4] = 0.0
    mask = torch.rand(50, generator=gen) > 0.2
    runs = []
    for flat in (False, True):
        comp = ElementwiseComponent(tensors, masks={"b": mask}, direction=direction,
                                    second_order=second_order, flat=flat)
        assert len(comp._pieces) == (1 if flat else 9)

        def closure(points, comp=comp):
            p = comp.unflatten(points[0])
            return torch.tanh(p["a"]).sum() + (p["b"] ** 3).sum() + torch.sin(p["c"] @ p["c"]).sum()

        res = auto_pgd(ProductBall([comp]), closure, 0.3, n_iters=12)
        runs.append((res, comp.sq_norm_on(res.xi[0], {"b": torch.ones(50, dtype=torch.bool)})))
    (piecewise, share_p), (flat_run, share_f) = runs
    assert flat_run.history == pytest.approx(piecewise.history, rel=1e-12)
    torch.testing.assert_close(flat_run.xi[0], piecewise.xi[0], rtol=1e-10, atol=1e-14)
    assert share_f == pytest.approx(share_p, rel=1e-12)


@pytest.mark.parametrize("keep_worst_gradient", [False, True])
def test_no_parameter_sized_allocation_per_iteration(keep_worst_gradient):
    """The iterates live in buffers allocated once per run (and the point in one kept by the
    component): more iterations allocate no more vectors of the ball's size; three iterate
    buffers (ξ, the worst point, the gradient that the next ξ overwrites), the last step and the
    point, and one more for the worst point's gradient where it is kept."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class CountLarge(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.count = numel, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                     if isinstance(t, torch.Tensor)}
            self.count += sum(1 for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                              and t.numel() >= self.numel
                              and t.untyped_storage().data_ptr() not in given)
            return out

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 50, generator=gen), "b": torch.randn(777, generator=gen),
               "c": torch.randn(40, 40, generator=gen)}

    def closure(points):
        p = comp.unflatten(points[0])
        return torch.tanh(p["a"]).sum() + (p["b"] ** 3).sum() + torch.sin(p["c"]).sum()

    counts = []
    for n_iters in (2, 8):
        comp = ElementwiseComponent(tensors)
        with CountLarge(comp.numel) as mode:
            auto_pgd(ProductBall([comp]), closure, 0.1, n_iters=n_iters,
                     keep_worst_gradient=keep_worst_gradient)
        counts.append(mode.count)
    assert counts[0] == counts[1] == 5 + keep_worst_gradient, counts


@pytest.mark.parametrize("geometry,second_order", [("geodesic-mix", False),
                                                   ("geodesic-inv", False), ("adaptive", True)])
def test_gather_is_the_adjoint_of_the_ball_map_and_consumed_points_agree(geometry, second_order):
    """BallParameters.gather (a direct gather of ∇ into the ball) gives the same Riemannian
    gradient as autograd's vector-Jacobian product through the ball map, also for tensors that a
    GL block covers only in part (packed qkv); points written into ξ equal the fresh points."""
    model, _ = _fitted_vit()
    params = {n: p.detach() for n, p in model.named_parameters()}
    layout = adapters.layout(model) if geometry != "adaptive" else None
    if layout is not None:
        assert layout.gl_masks, "the test needs a partially covered tensor"
    ball, ball_params = adapters.ball.build_ball(model, params, geometry=geometry, layout=layout,
                                            elementwise_second_order=second_order)
    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in params.items()}
    grads[next(iter(grads))] = None                       # None counts as zero
    centre = [c.x0.detach().requires_grad_() for c in ball.components]
    out = ball_params(centre)
    pairs = [(out[n], g) for n, g in grads.items() if g is not None]
    vjp = torch.autograd.grad([t for t, _ in pairs], centre, [g for _, g in pairs],
                              allow_unused=True)
    vjp = [torch.zeros_like(c) if g is None else g for g, c in zip(vjp, centre)]
    want, got = ball.rgrad(vjp), ball.rgrad(ball_params.gather(grads))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-10, atol=1e-12)
    xi = [t * 0.01 for t in want]
    fresh = ball.points(xi)
    consumed = ball.points([t.clone() for t in xi], consume=True)
    for a, b in zip(consumed, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sharpness_records_where_the_worst_perturbation_lives():
    """gl_norm_shares: per batch, the share of the worst ξ's squared metric norm in the GL blocks,
    checked against the components' own inner products; 0 for a ball without quotients."""
    model, batches = _fitted_vit()
    res = adapters.sharpness(model, batches, geometry="geodesic-inv", rho=1e-2, n_iters=3)
    assert len(res.gl_norm_shares) == len(batches) and 0 < res.gl_norm_shares[0] < 1
    ada = adapters.sharpness(model, batches, geometry="adaptive", rho=1e-2, n_iters=2)
    assert ada.gl_norm_shares == [0.0]
    params = {n: p.detach() for n, p in model.named_parameters()}
    ball, _ = adapters.ball.build_ball(model, params, geometry="geodesic-inv",
                                  layout=adapters.layout(model))
    torch.manual_seed(1)
    u = ball.project([torch.randn_like(z) for z in ball.zeros()])
    from quotient_manifolds.adapters.components import QuotientComponent
    parts = [(isinstance(c, QuotientComponent), float(c.inner(a, a)))
             for c, a in zip(ball.components, u)]
    want = sum(v for q, v in parts if q) / sum(v for _, v in parts)
    assert ball.quotient_share(u) == pytest.approx(want, rel=1e-12)
    assert math.isnan(ball.quotient_share(ball.zeros()))


def test_attention_share_is_comparable_across_geometries():
    """attention_norm_shares: the share of the worst ξ's squared norm on the GL blocks' weights:
    the GL share for a geodesic geometry, and for adaptive the same weights of the detected layout
    (share_on against a brute-force sum of (u/w)² over the masked entries)."""
    model, batches = _fitted_vit()
    res = adapters.sharpness(model, batches, geometry="geodesic-inv", rho=1e-2, n_iters=3)
    assert res.attention_norm_shares == pytest.approx(res.gl_norm_shares, rel=1e-12)
    ada = adapters.sharpness(model, batches, geometry="adaptive", rho=1e-2, n_iters=2)
    assert len(ada.attention_norm_shares) == len(batches) and 0 < ada.attention_norm_shares[0] < 1
    params = {n: p.detach() for n, p in model.named_parameters()}
    masks = adapters.layout(model).gl_masks
    ball, _ = adapters.ball.build_ball(model, params, geometry="adaptive")
    torch.manual_seed(2)
    u = [torch.randn_like(z) for z in ball.zeros()]
    (component,), (flat,) = ball.components, u
    parts = component.unflatten(flat)
    on = sum(float(((parts[n] / params[n]) ** 2)[masks[n]].sum()) for n in masks)
    total = sum(float(((parts[n] / params[n]) ** 2).sum()) for n in parts)
    assert ball.share_on(u, masks) == pytest.approx(on / total, rel=1e-6)  # float32 sums
    assert ball.share_on(u, {}) == 0.0


# ------------------------------------------------------------------------------ no size limit
def _forced_limits(monkeypatch, limit):
    import quotient_manifolds.adapters.elementwise as components

    monkeypatch.setattr(components, "REDUCTION_BLOCK", 4)
    monkeypatch.setattr(components, "KERNEL_LIMIT", limit)
    monkeypatch.setattr(components, "CHUNK", limit)


@pytest.mark.parametrize("layout", ["piecewise", "flat"])
def test_passes_cut_into_tiny_kernel_calls_give_the_same_run_bit_for_bit(monkeypatch, layout):
    """Every pass over the ball's vectors (dots, norms, combinations, the flat copy) cut into
    kernel calls of 8 elements gives the run of uncut passes exactly (==, not approx): reductions
    add fixed blocks in a fixed order, so a model past 2³¹ weights (cut by KERNEL_LIMIT) gets the
    numbers it would get uncut."""
    gen = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(13, 7, dtype=torch.float64, generator=gen),
               "b": torch.randn(30, dtype=torch.float64, generator=gen)}
    tensors["a"][2, 2] = 0.0
    runs = []
    for limit in (8, 2 ** 40):
        _forced_limits(monkeypatch, limit)
        comp = ElementwiseComponent(tensors, flat=layout == "flat")
        assert len(comp._pieces) > 2 if limit == 8 else len(comp._pieces) <= 2

        def closure(points, comp=comp):
            p = comp.unflatten(points[0])
            return torch.tanh(p["a"]).sum() + (p["b"] ** 3).sum()

        runs.append(auto_pgd(ProductBall([comp]), closure, 0.3, n_iters=10))
    cut, whole = runs
    assert cut.history == whole.history
    assert torch.equal(cut.xi[0], whole.xi[0]) and cut.norm == whole.norm


def test_streaming_sharpness_with_tiny_kernel_calls_is_bit_for_bit_the_same(monkeypatch, tiny_bert):
    """The streaming evaluation of a real model (no copy of its weights) cut into kernel calls of
    8 elements returns exactly the value, worst loss and share of uncut passes."""
    model, inputs = tiny_bert
    batches = _labelled(inputs)
    got = []
    for limit in (8, 2 ** 40):
        _forced_limits(monkeypatch, limit)
        res = sharpness(model, batches, geometry="geodesic-inv", rho=0.05, n_iters=4,
                        check_retraction=False)
        got.append((res.value, res.worst_losses, res.gl_norm_shares, res.norms))
    assert got[0] == got[1]


@pytest.mark.parametrize("geometry,second_order", [("adaptive", False), ("adaptive", True),
                                                   ("geodesic-mix", False)])
def test_small_vectors_formed_together_give_the_same_numbers_in_one_node(monkeypatch, tiny_bert,
                                                                         geometry, second_order):
    """The biases and norm scales of a real model are formed in one autograd node per evaluation
    (no recipe and node per vector, a host cost on an accelerator), and the run's numbers are
    bit for bit those of one recipe per tensor; matrices still stream one by one."""
    from quotient_manifolds.adapters import elementwise

    model, inputs = tiny_bert
    batches = _labelled(inputs)
    vectors = {n for n, p in model.named_parameters() if p.dim() == 1}
    got, nodes = [], collections.Counter()
    for small in (elementwise.SMALL_TENSOR, 0):
        monkeypatch.setattr(elementwise, "SMALL_TENSOR", small)
        for cls in (elementwise._StreamedSmall, elementwise._StreamedPoint):
            monkeypatch.setattr(cls, "apply", classmethod(
                lambda c, *a, small=small, apply=cls.apply: nodes.update([(small, c.__name__)])
                or apply(*a)))
        res = sharpness(model, batches, geometry=geometry, rho=0.05, n_iters=4,
                        check_retraction=False, elementwise_second_order=second_order)
        got.append((res.value, res.worst_losses, res.norms))
        monkeypatch.undo()
    assert got[0] == got[1]
    evaluations = nodes[(elementwise.SMALL_TENSOR, "_StreamedSmall")]
    assert evaluations >= 5 and nodes[(0, "_StreamedSmall")] == 0
    # per evaluation, one node for all vectors and one per read of a matrix, against one per read
    # of every tensor
    assert (nodes[(0, "_StreamedPoint")] - nodes[(elementwise.SMALL_TENSOR, "_StreamedPoint")]
            >= len(vectors) * evaluations)


class _TiedLookup(nn.Module):
    """A lookup whose table is also read whole (a tied output layer), with a padding row, and a
    lookup with ``max_norm`` (which renormalises its table in place: read whole)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8, padding_idx=1)
        self.capped = nn.Embedding(30, 8, max_norm=1.0)
        self.mix = nn.Linear(8, 8)

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids) + self.capped(ids))).mean(dim=1)
        return h @ self.emb.weight.T


@pytest.mark.parametrize("geometry,options", [("adaptive", {}),
                                              ("adaptive", {"elementwise_second_order": True}),
                                              ("adaptive", {"adaptive_direction": "andriushchenko"}),
                                              ("geodesic-mix", {})])
def test_embedding_lookups_form_only_the_rows_they_read(monkeypatch, tiny_bert, geometry, options):
    """A plain nn.Embedding reads the rows of its perturbed table that the batch looks up, never
    the whole table; the numbers equal those of reading it whole (float64), with the padding
    row's gradient dropped as F.embedding drops it, fixed entries kept fixed, a table also read
    whole (tied) adding both gradients, and a max_norm lookup read whole."""
    from quotient_manifolds.adapters import elementwise

    model, inputs = tiny_bert
    model = copy.deepcopy(model).double()
    inputs = dict(inputs, input_ids=inputs["input_ids"].clone())
    inputs["input_ids"][0, :2] = model.config.pad_token_id       # the padding row is read
    torch.manual_seed(0)
    tied = _TiedLookup().double()
    with torch.no_grad():  # padding rows start at 0 (their ∇⊙w is 0 anyway): give them weights
        model.bert.embeddings.word_embeddings.weight[model.config.pad_token_id] = 0.1
        tied.emb.weight[1] = 0.3
        tied.emb.weight[4, 0] = 1e-170  # w² underflows: a fixed entry in a row that is read
    ids = torch.tensor([[1, 4, 4, 7], [2, 1, 9, 4]])
    cases = [(model, _labelled(inputs), options),
             (tied, [(ids, torch.tensor([3, 5]))], options if geometry == "adaptive" else None)]
    for net, batches, opts in cases:
        if opts is None:  # no GL block in the tied lookup model
            continue
        got, reads = [], collections.Counter()
        for row_reads in (True, False):
            monkeypatch.setattr(elementwise.ElementwiseComponent, "row_reads", row_reads)
            apply = elementwise._StreamedRows.apply
            monkeypatch.setattr(elementwise._StreamedRows, "apply", classmethod(
                lambda c, *a, row_reads=row_reads, apply=apply: reads.update([row_reads]) or apply(*a)))
            res = sharpness(net, batches, geometry=geometry, rho=0.05, n_iters=4,
                            check_retraction=False, **opts)
            got.append((res.value, res.worst_losses[0], res.norms[0]))
            monkeypatch.undo()
        assert reads[True] >= 5 and reads[False] == 0
        for a, b in zip(*got):
            assert a == pytest.approx(b, rel=1e-10, abs=1e-14)


def test_out_of_memory_says_what_the_run_needs_and_leaves_the_model_as_it_was(monkeypatch, tiny_bert):
    """An allocator failure in the middle of a forward (the weights substituted, the classes of
    the modules swapped) ends in one error with the run's needs and what to do, not an allocator
    trace; the model's classes, weights and gradients are as before."""
    from quotient_manifolds.errors import SharpnessOutOfMemoryError

    model, inputs = tiny_bert
    classes = {n: type(m) for n, m in model.named_modules()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layer = model.bert.encoder.layer[1].intermediate   # BertIntermediate: its class fails
    forward, calls = type(layer).forward, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(layer), "forward", failing)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with pytest.raises(SharpnessOutOfMemoryError, match=rf"14 bytes per trainable parameter × {n:,}"
                       r"(.|\n)*keep_worst_gradient=False(.|\n)*solver_dtype=torch.bfloat16\) holds 8 bytes"
                       rf"(.|\n)*8 × {n:,}(.|\n)*smaller batch(.|\n)*FSDP2"
                       ) as info:
        sharpness(model, _labelled(inputs), geometry="adaptive", rho=0.05, n_iters=3)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    # what a loop that catches torch's (or Python's) out-of-memory error to retry still catches
    assert isinstance(info.value, torch.OutOfMemoryError) and isinstance(info.value, MemoryError)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]) and p.grad is None, name


class _LiveBytes:
    """Peak bytes of the tensors that torch ops create while active (a tensor counts until it and
    every view of it is freed): what a run holds beyond the tensors that existed before it."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                         if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t._base is None and t.numel() \
                            and t.untyped_storage().data_ptr() not in given:
                        tracker.add(t)
                return out

        self.mode, self.live, self.peak = Mode(), 0, 0

    def add(self, t):
        import weakref

        n = t.untyped_storage().nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)

    def _free(self, n):
        self.live -= n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adaptive_sharpness_holds_14_bytes_per_weight_and_no_copy_of_the_model(monkeypatch, dtype):
    """Streaming evaluation: beyond the model, a run holds the solver's three float32 vectors
    (ξ, the worst point, the gradient that the next ξ overwrites) and the last step in bfloat16
    (14 bytes per weight) and transients of one weight at a time, no perturbed or float32 copy of
    the model (a bfloat16 model is evaluated in float32 without one). A copy of the weights, or
    the step in float32, would add 4 or 2 bytes per weight, more than the slack."""
    torch.manual_seed(0)
    width, depth = 128, 6
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 3)).to(dtype)
    x, y = torch.randn(2, width).to(dtype), torch.tensor([0, 2])
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    tracker = _LiveBytes()
    with tracker.mode:
        sharpness(model, [(x, y)], geometry="adaptive", rho=0.05, n_iters=2, keep_worst_gradient=False)
    slack = 6 * largest * 4 + 64 * 1024   # a few float32 transients of the largest weight, activations
    assert tracker.peak <= 14 * n + slack, (tracker.peak / n, slack / n)


def _memory_probe_run(keep_worst_gradient=None, tracker=None):
    """An Auto-PGD run with restarts (20 iterations) on an elementwise ball, under a
    :class:`_LiveBytes` tracker (``tracker``, or a new one): (result, tracker)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 50, generator=gen), "b": torch.randn(777, generator=gen)}
    comp = ElementwiseComponent(tensors, streaming=True)

    def closure(points):
        p = {n: lazy.compute() for n, lazy in points[0].weights().items()}
        return torch.tanh(p["a"] * 3).sum() + (p["b"] ** 3).sum()

    tracker = tracker or _LiveBytes()
    with tracker.mode:
        res = auto_pgd(ProductBall([comp]), closure, 0.3, n_iters=20,
                       keep_worst_gradient=keep_worst_gradient)
    return res, tracker


def test_the_worst_gradient_is_kept_only_where_the_whole_run_fits(monkeypatch):
    """The default decides after the first forward and backward, counting the two vectors still to
    come (the worst point and its gradient) beside that pass's peak. On a device simulated by the
    bytes the run creates (capacity between the peaks of a run without and with the kept
    gradient), the run stays within it and recomputes at restarts; on a larger one it keeps the
    gradient. Deciding before the first pass with two vectors in hand kept it on the small device
    and overflowed it (as a 7B-shaped decoder did on a 140 GiB GPU)."""
    from quotient_manifolds.adapters import memory, solver

    lean, lean_tracker = _memory_probe_run(False)
    kept, kept_tracker = _memory_probe_run(True)
    assert lean.step_sizes == kept.step_sizes and lean.n_forward > kept.n_forward  # restarts
    for capacity, like in (((lean_tracker.peak + kept_tracker.peak) // 2, lean),
                           (3 * kept_tracker.peak, kept)):
        tracker = _LiveBytes()
        monkeypatch.setattr(solver, "device_memory", lambda device, capacity=capacity: memory.DeviceMemory(
            available=max(capacity - tracker.live, 0), total=capacity, in_use=tracker.live,
            peak=tracker.peak))
        got, _ = _memory_probe_run(None, tracker)
        assert tracker.peak <= capacity, (tracker.peak, capacity)
        assert got.n_forward == like.n_forward and got.history == like.history


def test_device_memory_reads_this_process_and_the_decision_counts_the_pass_and_headroom():
    """The CPU reading is Linux's (available within total, the resident set within its peak);
    the rule asks for two vectors, the pass's peak above what is held, and 5 % of the device."""
    from quotient_manifolds.adapters.memory import DeviceMemory, device_memory, room_for_two_more

    now = device_memory(torch.device("cpu"))
    if sys.platform.startswith("linux"):
        assert 0 < now.available <= now.total and 0 < now.in_use <= now.peak
    assert device_memory(torch.device("meta")) is None and room_for_two_more(10, None)
    gib = 2 ** 30
    at = dict(total=100 * gib, in_use=40 * gib, peak=45 * gib)
    # needs 2 × 20 + (45 − 40) + 5 = 50 GiB
    assert room_for_two_more(20 * gib, DeviceMemory(available=50 * gib, **at))
    assert not room_for_two_more(20 * gib, DeviceMemory(available=50 * gib - 1, **at))
    with pytest.raises(InvalidArgument, match="in_use must be a number of bytes"):
        DeviceMemory(available=1, total=2, in_use=-1, peak=0)
    with pytest.raises(InvalidArgument, match="vector_bytes"):
        room_for_two_more(1.5, None)
    with pytest.raises(InvalidArgumentType, match="DeviceMemory reading"):
        room_for_two_more(1, {"available": 1})


def test_substituted_weights_reach_every_reader_and_match_functional_call():
    """Recipes reach a weight read outside its own module's forward (nn.MultiheadAttention reads
    out_proj.weight itself) and both places of a tied weight; output and gradients equal those of
    functional_call with the same tensors, saved weights are recomputed in the backward pass, and
    the modules' classes come back."""
    from torch.func import functional_call

    from quotient_manifolds.adapters.streaming import LazyWeight, parameter_slots, substituted

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 8)
            self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.out = torch.nn.Linear(8, 11, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            h = self.emb(ids)
            return self.out(self.mha(h, h, h, need_weights=False)[0])

    torch.manual_seed(0)
    model = Tied().double()
    ids = torch.randint(0, 11, (2, 5))
    classes = {n: type(m) for n, m in model.named_modules()}
    deltas = {n: 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
    leaves = {n: d.clone().requires_grad_() for n, d in deltas.items()}
    weights = dict(model.named_parameters())
    recipes = {n: LazyWeight(lambda n=n: weights[n].detach() + leaves[n]) for n in leaves}
    with substituted(model, recipes):
        got = model(ids)
    got_grads = torch.autograd.grad(got.square().sum(), list(leaves.values()))
    assert {n: type(m) for n, m in model.named_modules()} == classes
    plain = {n: d.clone().requires_grad_() for n, d in deltas.items()}
    want = functional_call(model, {n: weights[n].detach() + plain[n] for n in plain}, (ids,))
    want_grads = torch.autograd.grad(want.square().sum(), list(plain.values()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    with pytest.raises(InvalidArgumentType, match="LazyWeight"):
        with substituted(model, {"emb.weight": weights["emb.weight"]}):
            pass
    # the places found once serve again (the tied alias included); those of other names are refused
    slots = parameter_slots(model, recipes)
    assert sum(len(places) for places in slots.values()) == len(recipes) + 1   # out.weight too
    with substituted(model, recipes, slots=slots):
        again = model(ids)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    with pytest.raises(InvalidArgument, match="parameter_slots"):
        with substituted(model, recipes, slots=parameter_slots(model, ["emb.weight"])):
            pass


def test_a_run_finds_the_substituted_weights_once(tiny_bert, monkeypatch):
    """Where a streaming run's recipes attach is found once per batch, not at every evaluation
    (a walk over all modules: milliseconds of host time per iteration on a 12-layer model, which
    an accelerator spends idle)."""
    import quotient_manifolds.adapters.evaluation as evaluation

    model, inputs = tiny_bert
    calls = []
    real = evaluation.parameter_slots
    monkeypatch.setattr(evaluation, "parameter_slots", lambda *a: calls.append(1) or real(*a))
    batches = [(inputs, torch.tensor([0, 1]))]
    for geometry in ("adaptive", "geodesic-inv"):
        calls.clear()
        got = sharpness(model, batches, geometry=geometry, rho=0.01, n_iters=4)
        assert got.n_forward >= 5 and len(calls) == 1, (geometry, len(calls))


def test_a_full_garbage_collection_only_where_the_layout_was_checked(tiny_bert, monkeypatch):
    """The layout's check leaves copies of the weights in reference cycles, so it ends with a
    full collection (about 0.2 s in a process that imported transformers); a run on a model whose
    layout passed already, and an adaptive run, which checks nothing, do not pay it."""
    import quotient_manifolds.adapters.verify as verify_module

    model, inputs = tiny_bert
    collected = []
    monkeypatch.setattr(verify_module.gc, "collect", lambda *a: collected.append(a) or 0)
    batch = [(inputs, torch.tensor([0, 1]))]
    for geometry, want in (("geodesic-inv", 1), ("geodesic-inv", 1), ("adaptive", 1),
                           ("geodesic-mix", 1)):
        adapters.sharpness(model, batch, geometry=geometry, rho=0.01, n_iters=2,
                           check_retraction=False)
        assert len(collected) == want, geometry


# ------------------------------------------------------------------------------ host reads
#: the Tensor methods that read values on the host (on an accelerator: wait for it)
_HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu")


@pytest.fixture
def host_reads(monkeypatch):
    """Where tensors are read on the host: a list of (method, caller) filled as they are."""
    seen = []
    for name in _HOST_READS:
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _method=method, **kwargs):
            frame = sys._getframe(1)
            seen.append((_name, f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"))
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize("streaming", [False, True])
def test_the_solver_reads_the_host_once_per_evaluation(host_reads, streaming):
    """An accelerator runs ahead of the host only between host reads: the solver reads the loss
    and ‖g‖² in one read per evaluation, after the backward (none for the steps, the ball's
    projection or the restarts; one at the end for the result's norm), so the backward is queued
    before the host waits."""
    ball, closure = _streaming_toy_ball() if streaming else _toy_ball()
    host_reads.clear()  # the set-up's
    got = auto_pgd(ball, closure, 0.05, n_iters=20, keep_worst_gradient=False)
    assert any(b < a for a, b in zip(got.step_sizes, got.step_sizes[1:]))  # restarts were taken
    assert len(host_reads) == got.n_forward + 1, collections.Counter(where for _, where in host_reads)


def test_the_default_loss_reads_its_targets_range_once_per_tensor(host_reads):
    """A loss evaluated on one batch at every iteration checks the targets' range once (a host
    read each time would stall an accelerator), and again after they change in place; a view
    is remembered by its base, an inference tensor (no version counter) read every time."""
    from quotient_manifolds.adapters.losses import default_loss, next_token_loss

    logits = torch.randn(4, 3)
    targets = torch.tensor([0, 2, 1, -100])
    values = [default_loss(logits, targets) for _ in range(5)]
    first = len(host_reads)
    assert first > 0 and all(torch.equal(v, values[0]) for v in values)
    default_loss(logits, targets)
    assert len(host_reads) == first
    targets[0] = 3  # in place: read again, and refused
    with pytest.raises(InvalidArgument, match="class 3.*3 classes"):
        default_loss(logits, targets)
    with pytest.raises(InvalidArgument, match="class 3"):  # a refused tensor is not remembered
        default_loss(logits, targets)
    assert default_loss(torch.randn(4, 4), targets) is not None  # more classes: in range
    ids = torch.randint(0, 7, (2, 5))
    lm = torch.randn(2, 5, 7)
    next_token_loss(lm, ids)
    before = len(host_reads)
    next_token_loss(lm, ids)  # a new view labels[:, 1:] of the same tensor each time
    assert len(host_reads) == before
    with torch.inference_mode():
        frozen = torch.tensor([0, 1, 2, 1])
    default_loss(logits, frozen)
    before = len(host_reads)
    default_loss(logits, frozen)
    assert len(host_reads) > before


# ------------------------------------------------------------------------------ the closure's call
class _ScaledMLP(nn.Module):
    """A model whose forward reads a float buffer."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)) * self.scale)


def test_the_closure_swaps_in_only_tensors_the_model_does_not_hold(monkeypatch):
    """A tensor the model holds under its name is not swapped in (no functional_call, which walks
    every module at each evaluation); another tensor under that name is, with its values, and
    the model is left as it was."""
    from quotient_manifolds.adapters import evaluation

    torch.manual_seed(0)
    model, x, y = _ScaledMLP(), torch.randn(4, 6), torch.tensor([0, 1, 2, 1])
    loss_fn = nn.functional.cross_entropy

    def closure(buffers):
        c = evaluation.ModelClosure(model, {}, buffers, lambda points: {}, loss_fn, False)
        c.inputs, c.targets = x, y
        return c([])

    own = loss_fn(model(x), y)
    real_call = evaluation.functional_call

    def refused(*args, **kwargs):
        raise AssertionError("functional_call for tensors the model holds")

    monkeypatch.setattr(evaluation, "functional_call", refused)
    assert torch.equal(closure({"scale": model.scale}), own)      # the model's own buffer: no swap
    monkeypatch.setattr(evaluation, "functional_call", real_call)
    doubled = closure({"scale": 2 * model.scale})                  # another tensor: swapped in
    with torch.no_grad():
        expected = loss_fn(model.lin2(torch.tanh(model.lin1(x)) * (2 * model.scale)), y)
    assert torch.allclose(doubled, expected) and not torch.allclose(doubled, own)
    assert torch.equal(model.scale, torch.linspace(0.5, 1.5, 8))   # the model is left as it was
