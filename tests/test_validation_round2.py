"""No silent wrong number, round 2: one property test per root cause, each generating its family
of bad inputs (hypothesis where the family is a space of values), below the top-level
``sharpness``: the geometry core and its faces, the low-level solver (``auto_pgd``,
``average_case``, ``build_ball``, ``Layout.random_actions``), the default loss, a worst-case run
that finds no rise, the messages of a model's evaluation, the studies' records and the CLI's
write faults. Every refusal is a ValueError/TypeError naming what was wrong, and the user's model
and tensors are unchanged after it.

The models are tiny float64 ones built from configs; the file runs in about a minute.
"""
from __future__ import annotations

import errno
import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotient_manifolds import _validation
from quotient_manifolds import adapters
from quotient_manifolds.adapters.components import ProductBall
from quotient_manifolds.adapters.elementwise import ElementwiseComponent
from quotient_manifolds.adapters.detection import layout as detect_layout
from quotient_manifolds.adapters.losses import default_loss
from quotient_manifolds.adapters.validation import ascent_found
from quotient_manifolds.core.gl import GLQuotientGeometry
from quotient_manifolds.core.rescaling import RescalingGeometry
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UnknownName

transformers = pytest.importorskip("transformers")

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _bert(**extra):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=8, num_labels=2, **extra)
    model = transformers.BertForSequenceClassification(cfg).double().eval()
    ids = torch.randint(0, 20, (2, 4))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


MODEL, INPUTS = _bert()
BATCHES = [(INPUTS, torch.tensor([0, 1]))]


def _state(model):
    """Everything a failing call must leave as it was: weights and buffers, requires_grad, .grad
    and every submodule's train/eval flag."""
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {n: (p.requires_grad, None if p.grad is None else p.grad.clone())
             for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()})


def _same(model, before):
    state, params, flags = before
    now = model.state_dict()
    assert set(now) == set(state) and all(torch.equal(now[k], v) for k, v in state.items())
    for n, p in model.named_parameters():
        flag, grad = params[n]
        assert p.requires_grad == flag
        assert (p.grad is None) == (grad is None) and (grad is None or torch.equal(p.grad, grad))
    assert flags == {n: m.training for n, m in model.named_modules()}


# ------------------------------------------------------------------ two validation modules, one path per check
def test_each_check_lives_in_one_module():
    """The geometry's checks live in quotient_manifolds._validation (the core and the faces use
    them), the adapters' in adapters.validation, which uses the former without serving its names:
    every check is importable from one module only."""
    from quotient_manifolds.adapters import validation
    from quotient_manifolds.adapters.options import as_rho

    def defined(module):
        return {n for n, v in vars(module).items()
                if callable(v) and getattr(v, "__module__", None) == module.__name__}

    base, own = defined(_validation), defined(validation)
    assert {"floating_tensor", "same_shape", "tangent", "flag", "integer_at_least", "size", "relaxation",
            "group_element", "optional_generator", "choice"} <= base
    assert {"positive_finite", "non_negative_finite", "module", "batches", "names",
            "optional_callable", "optional_layout", "scalar_loss", "TokenInputs",
            "materialised", "radius", "ascent_found", "class_targets", "layout_for_ball"} <= own
    assert not (base & set(vars(validation))), "adapters.validation serves a check of the base package"
    assert not (own & set(vars(_validation))), "the base package holds a check of the adapters"
    assert as_rho(np.float32(0.5)) == validation.radius(np.float32(0.5)) == 0.5
    with pytest.raises(InvalidArgument, match="rho must be a finite number > 0"):
        as_rho(math.nan)


# ------------------------------------------------------------------ the core: tangents and dtypes
BAD_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
              torch.complex64, torch.complex128]
GL_METHODS = ["inner", "norm", "project", "egrad2rgrad", "christoffel", "retract", "transport"]


@PROPERTY
@given(dtype=st.sampled_from(BAD_DTYPES), method=st.sampled_from(GL_METHODS),
       rescaling=st.booleans(), batch=st.sampled_from([(), (3,)]))
def test_the_core_refuses_integer_and_complex_tangents(dtype, method, rescaling, batch):
    """Integer tangent vectors were truncated (the result is cast back to their dtype) and
    complex ones kept a complex part: every method of both geometries refuses them, naming u."""
    gen = torch.Generator().manual_seed(0)
    if rescaling:
        geom = RescalingGeometry(3, "inv")
        x = torch.rand(*batch, 2, 3, dtype=torch.float64, generator=gen) + 0.5
    else:
        geom = GLQuotientGeometry(5, 4, 2, "inv")
        x = geom.random_point(*batch, dtype=torch.float64, generator=gen)
    u = torch.ones(x.shape, dtype=dtype)
    if method == "transport" and rescaling:
        return                                       # the rescaling geometry has no transport
    x_before, u_before = x.clone(), u.clone()
    with pytest.raises(InvalidArgumentType, match="floating-point"):
        getattr(geom, method)(x, u)
    assert torch.equal(x, x_before) and torch.equal(u, u_before)
    # the same vector as floats is taken, and answered in its dtype
    assert getattr(geom, method)(x, u.real.double() if u.is_complex() else u.double()).dtype in (
        torch.float64,)


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_random_points_and_origins_refuse_a_non_real_dtype(dtype):
    from quotient_manifolds.geoopt import GLQuotient, RescalingQuotient

    for call in (lambda: GLQuotient(5, 4, 2).random(dtype=dtype),
                 lambda: GLQuotient(5, 4, 2).origin(dtype=dtype),
                 lambda: RescalingQuotient(3).random(dtype=dtype),
                 lambda: GLQuotientGeometry(5, 4, 2).random_point(dtype=dtype)):
        with pytest.raises(InvalidArgumentType, match="real floating torch.dtype"):
            call()
    assert GLQuotient(5, 4, 2).random(dtype=torch.float32).dtype == torch.float32


INTEGER_TYPES = [int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@PROPERTY
@given(kind=st.sampled_from(INTEGER_TYPES), n=st.integers(2, 6), h=st.integers(1, 2),
       face=st.sampled_from(["core", "geoopt", "pymanopt"]))
def test_numpy_integers_are_sizes_like_python_ones(kind, n, h, face):
    """A size read from an array's shape (np.int64) is accepted wherever a Python int is, and
    gives the same manifold with Python-int sizes (no check that passes it and a later one that
    refuses it with 'must be a positive integer, got np.int64(5)')."""
    from quotient_manifolds import geoopt, pymanopt

    make = {"core": GLQuotientGeometry, "geoopt": geoopt.GLQuotient, "pymanopt": pymanopt.GLQuotient}[face]
    made, want = make(kind(n), kind(n + 1), kind(h)), make(n, n + 1, h)
    geom = getattr(made, "geometry", made)
    assert (geom.n, geom.m, geom.h) == (n, n + 1, h) and all(type(v) is int for v in (geom.n, geom.m, geom.h))
    assert made.dim == want.dim
    rescale = {"core": RescalingGeometry, "geoopt": geoopt.RescalingQuotient,
               "pymanopt": pymanopt.RescalingQuotient}[face](kind(n))
    assert getattr(rescale, "geometry", rescale).d == n


@pytest.mark.parametrize("bad", [0, -1, 2.0, 2.5, True, "3", None, np.float64(2.0), np.int64(0)])
def test_sizes_that_are_not_positive_integers_are_refused(bad):
    for call in (lambda: GLQuotientGeometry(5, 5, bad), lambda: RescalingGeometry(bad),
                 lambda: GLQuotientGeometry(5, 5, 2, exact_steps=bad)):
        with pytest.raises(InvalidArgument, match="must be a positive integer") as err:
            call()
        assert repr(bad) in str(err.value)


def test_numpy_integer_options_pass_every_layer():
    """n_iters=np.int64(3) gives what n_iters=3 gives, through sharpness and auto_pgd alike."""
    kw = dict(rho=0.1, geometry="adaptive")
    got = adapters.sharpness(MODEL, BATCHES, n_iters=np.int64(3), step_size_mult=np.float32(1), **kw)
    assert got.value == adapters.sharpness(MODEL, BATCHES, n_iters=3, **kw).value
    assert json.loads(json.dumps(got.options))["n_iters"] == 3      # recorded as plain numbers
    ball, closure = _small_ball()
    assert adapters.solver.auto_pgd(ball, closure, np.float64(0.1), n_iters=np.int32(3)).history == \
        adapters.solver.auto_pgd(ball, closure, 0.1, n_iters=3).history


# ------------------------------------------------------------------ the low-level solver
def _small_ball():
    w = torch.tensor([0.5, -1.0, 2.0, 0.3], dtype=torch.float64)
    ball = ProductBall([ElementwiseComponent({"w": w})])
    calls = []

    def closure(points):
        calls.append(1)
        return (torch.sin(points[0]) ** 2).sum()
    closure.calls = calls
    return ball, closure


SOLVER_BAD = {
    "rho": [0, -1.0, math.nan, math.inf, "1", None, True, torch.tensor([1.0, 2.0])],
    "n_iters": [0, -3, 2.5, True, "5", None],
    "step_size_mult": [0.0, -1.0, math.nan, math.inf, "1", None],
    "alpha": [0.0, -0.1, 1.5, math.nan, math.inf, "0.75"],
    "decay": [0.0, 1.0, 1.5, -0.5, math.nan, None],
    "min_update_ratio": [-0.1, 1.1, math.nan, math.inf, "x"],
    "momentum": ["nesterov", None],
    "step_normalization": ["l2", None],
    "on_iteration": [1, "print"],
}


@PROPERTY
@given(data=st.data())
def test_auto_pgd_refuses_every_bad_argument_before_any_work(data):
    """step_size_mult=0 or -1 used to return the unperturbed loss (sharpness 0) and nan a
    'reduce rho' error: each bad argument is now refused by name before the first forward."""
    name = data.draw(st.sampled_from(sorted(SOLVER_BAD)))
    value = data.draw(st.sampled_from(SOLVER_BAD[name]))
    ball, closure = _small_ball()
    kw = {"n_iters": 2, name: value} if name != "rho" else {"n_iters": 2}
    rho = value if name == "rho" else 0.1
    with pytest.raises((InvalidArgument, InvalidArgumentType), match=name.replace("_", ".")
                       if name not in ("momentum", "step_normalization") else name.split("_")[0]):
        adapters.solver.auto_pgd(ball, closure, rho, **kw)
    assert not closure.calls


@PROPERTY
@given(name=st.sampled_from(["rho", "n_samples", "on_iteration"]), data=st.data())
def test_average_case_refuses_every_bad_argument_before_any_work(name, data):
    bad = {"rho": SOLVER_BAD["rho"], "n_samples": [0, -1, 2.5, True, "3", None],
           "on_iteration": SOLVER_BAD["on_iteration"]}[name]
    value = data.draw(st.sampled_from(bad))
    ball, closure = _small_ball()
    kw = {"n_samples": 2, **({name: value} if name != "rho" else {})}
    with pytest.raises((InvalidArgument, InvalidArgumentType), match=name):
        adapters.solver.average_case(ball, closure, value if name == "rho" else 0.1, **kw)
    assert not closure.calls


def test_average_case_with_valid_numpy_arguments():
    ball, closure = _small_ball()
    res = adapters.solver.average_case(ball, closure, np.float64(0.1), n_samples=np.int64(3),
                                generator=torch.Generator().manual_seed(0))
    assert len(res.losses) == 3 and all(math.isfinite(v) for v in res.losses)


def test_auto_pgd_inside_inference_mode_names_it():
    ball, closure = _small_ball()
    with torch.inference_mode():
        with pytest.raises(InvalidArgument, match="inference_mode"):
            adapters.solver.auto_pgd(ball, closure, 0.1, n_iters=2)
    before = _state(MODEL)
    with torch.inference_mode():
        with pytest.raises(InvalidArgument, match="inference_mode.*outside"):
            adapters.sharpness(MODEL, BATCHES, rho=0.1, n_iters=1, geometry="adaptive")
    _same(MODEL, before)


def test_the_hessian_inside_inference_mode_names_it():
    pytest.importorskip("curvlinops")
    from quotient_manifolds.adapters.hessian import riemannian_hessian

    with torch.inference_mode():
        with pytest.raises(InvalidArgument, match="inference_mode"):
            op = riemannian_hessian(MODEL, BATCHES, geometry="adaptive")
            op @ torch.ones(op.shape[1], dtype=torch.float64)


# ------------------------------------------------------------------ layouts and balls
@pytest.mark.parametrize("geometry", ["geodesic-inv", "geodesic-mix"])
def test_build_ball_of_a_geodesic_geometry_needs_a_layout(geometry):
    params0 = {n: p.detach() for n, p in MODEL.named_parameters()}
    with pytest.raises(InvalidArgument, match="needs layout="):
        adapters.ball.build_ball(MODEL, params0, geometry=geometry)
    with pytest.raises(InvalidArgumentType, match="layout"):
        adapters.ball.build_ball(MODEL, params0, geometry=geometry, layout="x")


@settings(PROPERTY, max_examples=25)   # each example is a sharpness run: within the test budget
@given(data=st.data(), before=st.booleans())
def test_a_layout_that_disagrees_with_requires_grad_is_refused_by_name(data, before):
    """A weight frozen after the layout was built used to end in KeyError; one unfrozen after it
    was silently left out of the ball. Both are refused, naming requires_grad and the weight."""
    model, inputs = _bert()
    names = [n for n, _ in model.named_parameters()]
    name = data.draw(st.sampled_from(names))
    p = dict(model.named_parameters())[name]
    if before:                       # built while trainable, frozen now
        lay = detect_layout(model)
        p.requires_grad_(False)
    else:                            # built while frozen, trainable now
        p.requires_grad_(False)
        lay = detect_layout(model)
        p.requires_grad_(True)
    snap = _state(model)
    in_blocks = any(name in b.params for b in lay.blocks)
    try:
        adapters.sharpness(model, [(inputs, torch.tensor([0, 1]))], rho=0.1, n_iters=1, layout=lay,
                           geometry="geodesic-inv")
    except InvalidArgument as err:
        assert "requires_grad" in str(err) and name in str(err)
    else:                            # only a frozen weight in no block is consistent either way
        assert before and not in_blocks
    _same(model, snap)


@PROPERTY
@given(scale=st.sampled_from([0.0, -1.0, -1e-3, math.nan, math.inf, "1", None, True]))
def test_random_actions_refuse_a_scale_that_gives_no_group_element(scale):
    lay = detect_layout(MODEL)
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="scale"):
        lay.random_actions(scale=scale)
    for cond in (0.5, math.nan, -1.0):
        with pytest.raises(InvalidArgument, match="cond"):
            lay.random_actions(scale=1.0, cond=cond)
    acts = lay.random_actions(scale=np.float64(2.0), generator=torch.Generator().manual_seed(0))
    assert all(bool(torch.isfinite(a).all()) and float(torch.linalg.det(a).abs().min()) > 0
               for a in acts.values())


# ------------------------------------------------------------------ the default loss
@PROPERTY
@given(batch=st.integers(1, 3), tokens=st.integers(1, 5), classes=st.integers(2, 5),
       extra=st.booleans())
def test_the_default_loss_refuses_logits_with_a_token_axis(batch, tokens, classes, extra):
    """cross_entropy reads dim 1 as the classes: for (batch, tokens, classes) logits that is the
    tokens, a silent wrong loss when tokens == classes. Refused, naming loss_fn and
    next_token_loss; (batch, classes) logits give cross_entropy's value."""
    gen = torch.Generator().manual_seed(0)
    shape = (batch, tokens, classes) + ((2,) if extra else ())
    logits = torch.randn(shape, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, classes, (batch, tokens), generator=gen)
    with pytest.raises(InvalidArgument, match="loss_fn=.*next_token_loss"):
        default_loss(logits, targets)
    flat = logits.reshape(batch, -1)[:, :classes]
    y = torch.randint(0, classes, (batch,), generator=gen)
    assert default_loss(flat, y) == torch.nn.functional.cross_entropy(flat, y)


@pytest.mark.parametrize("num_labels", [6, 3])
def test_a_token_classifier_without_loss_fn_is_refused(num_labels):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=8, num_labels=num_labels)
    model = transformers.BertForTokenClassification(cfg).double().eval()
    ids = torch.randint(0, 20, (2, 6))
    before = _state(model)
    with pytest.raises(InvalidArgument, match="loss_fn="):
        adapters.sharpness(model, [({"input_ids": ids}, torch.randint(0, num_labels, (2, 6)))], rho=0.1,
                           n_iters=1, geometry="adaptive")
    _same(model, before)


# ------------------------------------------------------------------ a larger ball returning 0
class _Run:
    def __init__(self, init, history):
        self.init_loss, self.history = init, [init] + list(history)
        self.worst_loss = max(self.history)


@PROPERTY
@given(init=st.floats(0.01, 10), history=st.lists(st.floats(0, 20), min_size=1, max_size=8),
       rho=st.floats(1e-3, 1e6))
def test_a_run_that_finds_no_rise_says_why(init, history, rho):
    """A worst-case run whose points all have a loss <= the centre's reports sharpness 0, a lower
    bound that a smaller ball may beat: it warns with the cause (saturated loss, or steps that
    overshoot) and what to do; a run that found a rise says nothing."""
    run = _Run(init, history)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ascent_found(run, rho)
    said = [str(w.message) for w in caught]
    if run.worst_loss > init:
        assert not said
    else:
        assert len(said) == 1 and "lower bound" in said[0] and "sharpness_sweep" in said[0]
        assert ("saturated" in said[0]) == (all(v == init for v in history) or 0.0 in history)


class _Cliff(torch.nn.Module):
    """One weight w = 1 and the output w: the loss 0.5 + 10 (w − 1) rises from the centre up to
    w = 1.01 and is exactly 0 (with a zero gradient) beyond, a saturated plateau."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x):
        return self.w * x


def _cliff_loss(out, _targets):
    return torch.where(out - 1 > 0.01, out * 0, 0.5 + 10 * (out - 1)).sum()


@pytest.mark.parametrize("rho", [1.0, 10.0, 1e3])
def test_a_run_that_lands_on_a_saturated_plateau_warns(rho):
    """Steps of length ~2ρ from the centre land on the plateau (loss and gradient exactly 0), so
    no point above the centre is found and the value is 0 where a smaller ball finds a rise: the
    run warns (naming the cause and the way out), and sharpness_sweep, which warm-starts each
    radius from the smaller one's worst point, never reports less for the larger ball."""
    model = _Cliff()
    batches = [(torch.ones((), dtype=torch.float64), None)]
    kw = dict(geometry="adaptive", loss_fn=_cliff_loss, n_iters=10)
    with pytest.warns(UserWarning, match="no point with a loss above.*saturated.*sharpness_sweep") as caught:
        res = adapters.sharpness(model, batches, rho=rho, **kw)
    assert res.value == 0.0 and caught[0].filename == __file__
    small = adapters.sharpness(model, batches, rho=1e-3, **kw).value
    assert small > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a warm-started sweep finds the rise: no warning
        swept = adapters.sharpness_sweep(model, batches, [1e-3, rho], **kw)
    assert swept[1].value >= swept[0].value > 0


def test_a_larger_ball_on_a_float32_bert_reports_more_or_warns():
    """The case found: adaptive sharpness of a tiny float32 BERT at rho = 1e5 stepped onto a
    plateau where the softmax saturates and reported 0 where rho = 1e4 reports > 0. Whatever the
    solver's path, a larger ball reports at least the smaller one's value or warns."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(0, 50, (2, 6))
    batches = [({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.tensor([0, 1]))]
    kw = dict(geometry="adaptive", n_iters=10)
    small = adapters.sharpness(model, batches, rho=1e4, **kw).value
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        large = adapters.sharpness(model, batches, rho=1e5, **kw).value
    assert large >= small or any("no point with a loss above" in str(w.message) for w in caught)
    swept = adapters.sharpness_sweep(model, batches, [1e4, 1e5], **kw)
    assert swept[1].value >= swept[0].value > 0


# ------------------------------------------------------------------ messages that point the right way
def test_return_dict_false_with_labels_is_told_about_return_dict():
    model, inputs = _bert(return_dict=False)
    with pytest.raises(InvalidArgument, match="return_dict") as err:
        adapters.sharpness(model, [{**inputs, "labels": torch.tensor([0, 1])}], rho=0.1, n_iters=1,
                           geometry="adaptive")
    assert "Add 'labels'" not in str(err.value)


@PROPERTY
@given(index=st.integers(0, 2), bad=st.sampled_from([20, 21, 1000, -1, -100]), row=st.integers(0, 1),
       col=st.integers(0, 3), as_pair=st.booleans())
def test_token_ids_outside_the_vocabulary_name_the_batch_and_the_id(index, bad, row, col, as_pair):
    batches = []
    for i in range(3):
        ids = INPUTS["input_ids"].clone()
        if i == index:
            ids[row, col] = bad
        batches.append(({"input_ids": ids}, torch.tensor([0, 1])) if as_pair else
                       {"input_ids": ids, "labels": torch.tensor([0, 1])})
    kept = [b[0]["input_ids"].clone() if as_pair else b["input_ids"].clone() for b in batches]
    before = _state(MODEL)
    with pytest.raises(InvalidArgument, match=rf"batch {index}: input_ids holds the token id {bad} "
                                         rf"\(at \({row}, {col}\)\), outside the vocabulary"):
        adapters.sharpness(MODEL, batches, rho=0.1, n_iters=1, geometry="adaptive")
    _same(MODEL, before)
    assert all(torch.equal(k, b[0]["input_ids"] if as_pair else b["input_ids"]) for k, b in zip(kept, batches))


@PROPERTY
@given(index=st.integers(0, 2), kind=st.sampled_from(["dict", "tensor", "hf-dict-batch"]))
def test_an_empty_batch_is_refused_naming_it(index, kind):
    if kind == "tensor":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3)).double()
        full = (torch.randn(2, 4, dtype=torch.float64), torch.tensor([0, 1]))
        empty = (torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, dtype=torch.long))
    elif kind == "dict":
        model = MODEL
        full, empty = BATCHES[0], ({k: v[:0] for k, v in INPUTS.items()}, torch.zeros(0, dtype=torch.long))
    else:
        model = MODEL
        full = {**INPUTS, "labels": torch.tensor([0, 1])}
        empty = {k: v[:0] for k, v in full.items()}
    batches = [empty if i == index else full for i in range(3)]
    before = _state(model)
    with pytest.raises(InvalidArgument, match=rf"batch {index} is empty"):
        adapters.sharpness(model, batches, rho=0.1, n_iters=1, geometry="adaptive")
    _same(model, before)


def test_a_float64_head_over_a_float32_body_verifies_as_it_runs():
    """verify() cast every weight to the first parameter's dtype, so a model whose head runs in
    float64 over a float32 body failed with a dtype error; it runs as it is now, and a block that
    is not a symmetry still fails."""
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = torch.nn.Linear(8, 3).double()

        def forward(self, x):
            y, _ = self.attn(x, x, x, need_weights=False)
            return self.head(torch.relu(y).mean(1).double())

    torch.manual_seed(0)
    model = Mixed().eval()
    x = torch.randn(2, 5, 8)
    before = _state(model)
    report = detect_layout(model).verify(model, x)
    assert report.passed and report.blocks
    _same(model, before)


# ------------------------------------------------------------------ records counted twice
@PROPERTY
@given(n=st.integers(2, 6), repeats=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       changed=st.booleans())
def test_report_counts_each_model_once(tmp_path_factory, n, repeats, changed):
    """A duplicated record line (concatenated or copied results) was counted twice in every
    statistic; the report keeps one record per model id, the last written, as the runner does on
    resume."""
    from quotient_manifolds.experiments.report import _records_of_one_config
    from quotient_manifolds.experiments.runner import ResultStore

    path = str(tmp_path_factory.mktemp("records") / "results.jsonl")
    store = ResultStore(path)
    for i in range(n):
        store.append({"model_id": i, "config_hash": "h", "value": i})
    for r in repeats:
        store.append({"model_id": r % n, "config_hash": "h", "value": 100 + r if changed else r % n})
    _, records, _ = _records_of_one_config(path)
    assert [r["model_id"] for r in records] == list(range(n))
    last = {r % n: (100 + r if changed else r % n) for r in repeats}
    assert [r["value"] for r in records] == [last.get(i, i) for i in range(n)]


def test_report_of_a_duplicated_line_reproduces_the_summary(tmp_path, capsys):
    import shutil
    from quotient_manifolds.experiments.cli import main

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                       "results", "lora")
    if not os.path.exists(os.path.join(src, "results.jsonl")):
        pytest.skip("no committed lora results")
    run = tmp_path / "lora"
    shutil.copytree(src, run)
    lines = (run / "results.jsonl").read_bytes().splitlines(True)
    (run / "results.jsonl").write_bytes(b"".join(lines + [lines[3]]))
    assert main(["report", str(run), "--out", str(tmp_path / "again")]) == 0
    assert "counted once" in capsys.readouterr().err
    once = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert once["cells"] == json.loads((run / "summary.json").read_text())["cells"]


# ------------------------------------------------------------------ the CLI's write faults
@PROPERTY
@given(where=st.sampled_from(["open", "write", "fsync", "replace"]),
       code=st.sampled_from([errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT]))
def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temp(tmp_path_factory, where, code):
    from unittest import mock

    from quotient_manifolds.experiments import runner

    d = tmp_path_factory.mktemp("atomic")
    path = str(d / "summary.json")
    runner.atomic_write_bytes(path, b"old")

    def fail(*a, **k):
        raise OSError(code, os.strerror(code))
    real_open = open

    class FailingWrites:                     # the temporary file is created, its write fails
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            fail()

    patch = (mock.patch("builtins.open", lambda *a, **k: FailingWrites(real_open(*a, **k)))
             if where == "write" else
             mock.patch({"open": "builtins.open", "fsync": "os.fsync", "replace": "os.replace"}[where],
                        side_effect=fail))
    with patch:
        with pytest.raises(OSError) as err:
            runner.atomic_write_bytes(path, b"new")
    assert err.value.filename == path and err.value.errno == code
    assert Path(path).read_bytes() == b"old"
    assert [f for f in os.listdir(d) if ".tmp-" in f] == []


@pytest.mark.parametrize("code,advice", [(errno.ENOSPC, "free disk space"), (errno.EROFS, "read-only"),
                                         (errno.EACCES, "not writable")])
def test_the_cli_reports_a_write_fault_in_one_line(tmp_path, capsys, monkeypatch, code, advice):
    import shutil

    from quotient_manifolds.experiments.cli import main

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                       "results", "lora")
    if not os.path.exists(os.path.join(src, "results.jsonl")):
        pytest.skip("no committed lora results")
    shutil.copytree(src, tmp_path / "lora")
    out = tmp_path / "out"

    def fail(fd):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(os, "fsync", fail)
    assert main(["report", str(tmp_path / "lora"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}") and advice in err[0]
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs if ".tmp-" in f] == []


# ------------------------------------------------------------------ the solver's closure, ball and start
CLOSURE_OUTPUTS = {
    "a float": (lambda p: float((p[0] ** 2).sum()), InvalidArgumentType, "must be a tensor"),
    "a vector": (lambda p: p[0] ** 2, InvalidArgument, "one number"),
    "an integer tensor": (lambda p: (p[0] ** 2).sum().round().long(), InvalidArgumentType, "floating-point"),
    "a constant": (lambda p: torch.tensor(1.0, dtype=torch.float64), InvalidArgument, "does not depend"),
}


@PROPERTY
@given(kind=st.sampled_from(sorted(CLOSURE_OUTPUTS)), average=st.booleans())
def test_a_closure_that_returns_no_usable_loss_is_named(kind, average):
    """A closure returning a float, a vector or an integer ended in AttributeError or 'only one
    element tensors can be converted'; it is refused naming the closure (a constant only where a
    gradient is taken: average_case evaluates without one)."""
    fn, error, words = CLOSURE_OUTPUTS[kind]
    ball = _small_ball()[0]
    if average and kind == "a constant":
        assert adapters.solver.average_case(ball, fn, 0.1, n_samples=2).mean_loss == 1.0
        return
    with pytest.raises(error, match=f"closure.*{words}|{words}.*closure"):
        if average:
            adapters.solver.average_case(ball, fn, 0.1, n_samples=2)
        else:
            adapters.solver.auto_pgd(ball, fn, 0.1, n_iters=2)


@pytest.mark.parametrize("call,words", [
    (lambda b, f: adapters.solver.auto_pgd("ball", f, 0.1), "ball must be a ProductBall"),
    (lambda b, f: adapters.solver.auto_pgd(b, 3, 0.1), "closure must be a function"),
    (lambda b, f: adapters.solver.average_case(b, None, 0.1), "closure must be a function"),
    (lambda b, f: adapters.solver.average_case(b, f, 0.1, generator=0), "generator must be a torch.Generator"),
    (lambda b, f: adapters.solver.auto_pgd(b, f, 0.1, start=("x", 1.0)), r"start\[0\]"),
    (lambda b, f: adapters.solver.auto_pgd(b, f, 0.1, start=([torch.zeros(3)], 1.0)), r"start\[0\]\[0\] has shape"),
    (lambda b, f: adapters.solver.auto_pgd(b, f, 0.1, start=([torch.zeros(4, dtype=torch.float64)], math.nan)),
     r"start\[1\]"),
    (lambda b, f: adapters.solver.auto_pgd(b, f, 0.1, start=torch.zeros(4)), "pair"),
])
def test_the_solver_names_a_bad_ball_closure_generator_or_start(call, words):
    ball, closure = _small_ball()
    with pytest.raises((InvalidArgument, InvalidArgumentType), match=words):
        call(ball, closure)
    assert not closure.calls


@PROPERTY
@given(kind=st.sampled_from(["list", "empty", "integer", "unknown name", "wrong shape", "tensor"]))
def test_build_ball_names_bad_params0(kind):
    params0 = {n: p.detach() for n, p in MODEL.named_parameters()}
    first = next(iter(params0))
    bad = {"list": list(params0.values()), "empty": {}, "tensor": params0[first],
           "integer": {**params0, first: params0[first].long()},
           "unknown name": {**params0, "nope": params0[first]},
           "wrong shape": {**params0, first: params0[first][:1]}}[kind]
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="params0"):
        adapters.ball.build_ball(MODEL, bad, geometry="adaptive")


def test_build_ball_refuses_a_layout_of_another_model():
    other, _ = _bert()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=16, max_position_embeddings=8, num_labels=2)
    four_heads = transformers.BertForSequenceClassification(cfg).double()
    params0 = {n: p.detach() for n, p in other.named_parameters()}
    with pytest.raises(InvalidArgument, match="build_ball: the layout .* was built for another model"):
        adapters.ball.build_ball(other, params0, geometry="geodesic-inv", layout=detect_layout(four_heads))


# ------------------------------------------------------------------ group actions
@PROPERTY
@given(kind=st.sampled_from(["integer", "complex", "nan", "inf", "singular", "wrong shape", "unknown block",
                             "not a dict"]), which=st.integers(0, 3), reparametrise=st.booleans())
def test_actions_that_are_not_group_elements_are_refused(kind, which, reparametrise):
    """Layout.act / reparametrised with NaN or singular 'actions' gave NaN weights (or a
    LinAlgError, or a KeyError for an unknown block); each is refused naming the block."""
    lay = detect_layout(MODEL)
    acts = lay.random_actions(scale=1.0, generator=torch.Generator().manual_seed(which))
    name = sorted(acts)[which % len(acts)]
    A = acts[name]
    if kind == "singular":
        A = A.clone()
        A[which % A.shape[0], :, 0] = 0.0
    bad = {"integer": {**acts, name: A.long()}, "complex": {**acts, name: A.to(torch.complex128)},
           "nan": {**acts, name: A * math.nan}, "inf": {**acts, name: A * math.inf},
           "singular": {**acts, name: A}, "wrong shape": {**acts, name: A[:, :-1]},
           "unknown block": {**acts, "nope": A}, "not a dict": [A]}[kind]
    params = {n: p.detach() for n, p in MODEL.named_parameters()}
    before = _state(MODEL)
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="actions"):
        if reparametrise:
            lay.reparametrised(MODEL, bad)
        else:
            lay.act(params, bad)
    _same(MODEL, before)
    if kind == "unknown block":                      # still the KeyError it was
        with pytest.raises(UnknownName):
            lay.act(params, bad)
    assert all(bool(torch.isfinite(t).all()) for t in lay.act(params, acts).values())


# ------------------------------------------------------------------ the default loss's targets
@PROPERTY
@given(batch=st.integers(1, 4), classes=st.integers(2, 5), data=st.data())
def test_targets_the_default_loss_cannot_read_are_named(batch, classes, data):
    """Targets out of range, of another batch size, or floats of another shape were raw torch
    errors (IndexError 'Target 5 is out of bounds'); they are refused naming the targets, and
    -100 (ignored) positions are taken as cross_entropy takes them."""
    gen = torch.Generator().manual_seed(batch * 10 + classes)
    logits = torch.randn(batch, classes, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (batch,), generator=gen)
    kind = data.draw(st.sampled_from(["too large", "negative", "batch", "float", "bool", "list"]))
    at = data.draw(st.integers(0, batch - 1))
    bad = {"too large": y.index_fill(0, torch.tensor([at]), classes + at),
           "negative": y.index_fill(0, torch.tensor([at]), -1 - at),
           "batch": torch.cat([y, y[:1]]), "float": y.double(), "bool": y > 0, "list": y.tolist()}[kind]
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="targets"):
        default_loss(logits, bad)
    ignored = y.index_fill(0, torch.tensor([at]), -100)
    if batch > 1:
        assert default_loss(logits, ignored) == torch.nn.functional.cross_entropy(logits, ignored)
    with pytest.raises(InvalidArgument, match=f"class {classes + 3}"):
        adapters.next_token_loss(torch.randn(2, 3, classes, generator=gen),
                                 torch.full((2, 3), classes + 3))


# ------------------------------------------------------------------ the core's group elements and sampling
@PROPERTY
@given(kind=st.sampled_from(["integer", "complex", "nan", "inf", "singular", "shape"]), batch=st.booleans())
def test_the_core_refuses_what_is_not_a_group_element(kind, batch):
    """GLQuotientGeometry.act with a NaN A gave NaN points, a singular one a LinAlgError, an integer
    one a dtype error; RescalingGeometry.act with a zero or NaN a gave inf/NaN points."""
    geom = GLQuotientGeometry(5, 4, 2, "inv")
    dims = (3,) if batch else ()
    x = geom.random_point(*dims, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    A = torch.eye(2, dtype=torch.float64).expand(*dims, 2, 2).clone()
    bad = {"integer": A.long(), "complex": A.to(torch.complex128), "nan": A * math.nan, "inf": A * math.inf,
           "singular": A * 0, "shape": torch.eye(3, dtype=torch.float64)}[kind]
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="A "):
        geom.act(x, bad)
    torch.testing.assert_close(geom.act(x, A), x, rtol=0, atol=0)
    resc = RescalingGeometry(3, "inv")
    xr = torch.tensor([[1.0, 2.0, -1.5], [0.5, -1.0, 2.0]], dtype=torch.float64)
    a = {"integer": torch.tensor([1, 0, 2]), "complex": torch.tensor([1.0, 0.0, 2.0]),
         "nan": torch.tensor([1.0, math.nan, 2.0]), "inf": torch.tensor([1.0, math.inf, 2.0]),
         "singular": torch.zeros(3), "shape": torch.tensor([0.0, 1.0, 1.0])}[kind]
    with pytest.raises(InvalidArgument, match="non-zero"):
        resc.act(xr, a)


@pytest.mark.parametrize("call,words", [
    (lambda g, x, u: g.integrate_geodesic(x, u, t=math.nan), "t must be a finite"),
    (lambda g, x, u: g.integrate_geodesic(x, u, t="1"), "t must be a finite"),
    (lambda g, x, u: g.integrate_geodesic(x, u, steps=0), "steps must be a positive integer"),
    (lambda g, x, u: g.random_point(-1), r"batch\[0\]"),
    (lambda g, x, u: g.random_point(2.5), r"batch\[0\]"),
    (lambda g, x, u: g.random_point(generator=3), "generator"),
    (lambda g, x, u: g.random_horizontal(x.long()), "floating-point"),
    (lambda g, x, u: g.balance(x.int()), "floating-point"),
    (lambda g, x, u: g.frame(x).vertical(torch.eye(2, dtype=torch.long)), "lam must be a real floating"),
])
def test_the_core_names_other_bad_arguments(call, words):
    geom = GLQuotientGeometry(5, 4, 2, "inv")
    x = geom.random_point(dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    u = geom.project(x, torch.full_like(x, 0.01))
    with pytest.raises((InvalidArgument, InvalidArgumentType), match=words):
        call(geom, x, u)
    assert geom.random_point(np.int64(2), dtype=torch.float64).shape == (2, 9, 2)
