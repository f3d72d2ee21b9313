"""Random invalid arguments at the public surface (hypothesis): every call either refuses with a
``ValueError``/``TypeError`` whose message names the argument, or gives a finite right answer, and
the user's model is bit-identical afterwards.

One tiny float64 BERT built from a config is shared by the tests (each test checks it is unchanged);
``max_examples`` is small and every example fails fast at the argument checks, so the file runs in a
few seconds.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotient_manifolds import adapters
from quotient_manifolds.adapters.detection import layout as detect_layout
from conftest import tiny_lora_bert

transformers = pytest.importorskip("transformers")

#: Values that are wrong for most arguments: wrong types, strings for numbers, NaN/inf, negatives,
#: zeros, non-integers, booleans, empty and wrong-shaped containers and tensors.
BAD = [None, "0.1", "abc", math.nan, math.inf, -math.inf, -1, 0, -0.5, 2.5, True, [], [0.1], (),
       torch.tensor([1.0, 2.0]), torch.tensor(math.nan), np.float64(math.nan), object()]

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _model():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=8, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).double().eval()
    inputs = {"input_ids": torch.randint(0, 20, (2, 4)), "attention_mask": torch.ones(2, 4, dtype=torch.long)}
    return model, inputs


MODEL, INPUTS = _model()
BATCHES = [(INPUTS, torch.tensor([0, 1]))]
LAYOUT = detect_layout(MODEL)


def _state(model):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {n: p.requires_grad for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()})


def _same(model, before):
    state, grads, flags = before
    now = model.state_dict()
    assert set(now) == set(state)
    assert all(torch.equal(now[k], v) for k, v in state.items()), "the model's weights changed"
    assert grads == {n: p.requires_grad for n, p in model.named_parameters()}
    assert flags == {n: m.training for n, m in model.named_modules()}


def _names(err: Exception, name: str) -> None:
    """The message of ``err`` names the argument ``name`` (``batches`` may be named per batch)."""
    said = str(err)
    assert name in said or (name == "batches" and "batch " in said), \
        f"{type(err).__name__} does not name {name!r}: {said}"


def _refused_or_finite(call, name, *, finite=lambda r: True, accept=()):
    """``call()`` raises ValueError/TypeError naming ``name``, or returns a result ``finite`` accepts
    (an exception of a type in ``accept`` stands for "the arguments were accepted")."""
    try:
        result = call()
    except (ValueError, TypeError) as err:
        _names(err, name)
        return
    except accept:
        return
    assert finite(result), f"{name}: a non-finite answer {result!r}"


def _with(name, bad, positional, keywords):
    """The arguments of a call with ``bad`` put in place of ``name``: ``positional`` (a dict, in
    order) and ``keywords`` as ``(args, kwargs)``."""
    positional, keywords = dict(positional), dict(keywords)
    (positional if name in positional else keywords)[name] = bad
    return list(positional.values()), keywords


def _value_finite(res):
    values = res if isinstance(res, list) else [res]
    return all(math.isfinite(r.value) for r in values)


SHARPNESS_ARGS = ["rho", "geometry", "n_iters", "measure", "n_samples", "gram_eps", "step_size_mult", "seed",
                  "retraction", "momentum", "step_normalization", "adaptive_direction", "num_threads",
                  "loss_fn", "layout", "retraction_tolerance", "progress", "unsafe", "include_frozen",
                  "model", "batches"]


def _sharpness_call(fn, name, bad):
    args, kwargs = _with(name, bad, {"model": MODEL, "batches": BATCHES},
                         {"rho": 0.1, "geometry": "geodesic-mix", "n_iters": 1, "layout": LAYOUT,
                          "check_retraction": False})
    return lambda: fn(*args, **kwargs)


@PROPERTY
@given(name=st.sampled_from(SHARPNESS_ARGS), bad=st.sampled_from(BAD))
def test_sharpness(name, bad):
    before = _state(MODEL)
    _refused_or_finite(_sharpness_call(adapters.sharpness, name, bad), name, finite=_value_finite)
    _same(MODEL, before)


@PROPERTY
@given(name=st.sampled_from(["rhos", "n_iters", "geometry", "gram_eps", "model", "batches"]),
       bad=st.sampled_from(BAD + [[0.2, 0.1], [0.1, math.nan]]))
def test_sharpness_sweep(name, bad):
    before = _state(MODEL)
    args, kwargs = _with(name, bad, {"model": MODEL, "batches": BATCHES, "rhos": [0.05, 0.1]},
                         {"geometry": "geodesic-mix", "n_iters": 1, "layout": LAYOUT,
                          "check_retraction": False})
    _refused_or_finite(lambda: adapters.sharpness_sweep(*args, **kwargs), name,
                       finite=_value_finite)
    _same(MODEL, before)


@PROPERTY
@given(name=st.sampled_from(["rho", "seed", "n_iters", "geometry", "gram_eps", "model", "batches", "measure"]),
       bad=st.sampled_from(BAD))
def test_distributed_sharpness(name, bad):
    # no process group: valid arguments end at the "needs an initialised process group" error
    before = _state(MODEL)
    _refused_or_finite(_sharpness_call(adapters.distributed_sharpness, name, bad), name,
                       accept=RuntimeError)
    _same(MODEL, before)


@PROPERTY
@given(name=st.sampled_from(["scales", "cond", "rtol", "atol", "seed", "per_block", "output_fn",
                             "compute_dtype", "model"]),
       bad=st.sampled_from(BAD))
def test_layout_verify(name, bad):
    before = _state(MODEL)
    lay = detect_layout(MODEL)
    args, kwargs = _with(name, bad, {"model": MODEL, "example_inputs": INPUTS}, {"scales": (1.0,)})
    _refused_or_finite(lambda: lay.verify(*args, **kwargs), name,
                       finite=lambda rep: rep is not None)
    _same(MODEL, before)


@PROPERTY
@given(name=st.sampled_from(["model", "blocks", "allow_unsupported", "detect_blocks", "include_frozen"]),
       bad=st.sampled_from(BAD))
def test_layout(name, bad):
    before = _state(MODEL)
    args, kwargs = _with(name, bad, {"model": MODEL}, {})
    _refused_or_finite(lambda: detect_layout(*args, **kwargs), name, finite=lambda lay: lay is not None)
    _same(MODEL, before)


@PROPERTY
@given(name=st.sampled_from(["rho", "geometry", "retraction", "gram_eps", "layout", "model",
                             "base_optimizer", "elementwise_second_order"]),
       bad=st.sampled_from(BAD))
def test_geodesic_sam(name, bad):
    before = _state(MODEL)
    args, kwargs = _with(name, bad, {"model": MODEL, "base_optimizer": torch.optim.SGD},
                         {"rho": 0.05, "geometry": "geodesic-mix", "layout": LAYOUT, "lr": 0.1})
    _refused_or_finite(lambda: adapters.GeodesicSAM(*args, **kwargs), name,
                       finite=lambda opt: opt is not None)
    _same(MODEL, before)


@PROPERTY
@given(name=st.sampled_from(["geometry", "loss_fn", "reduction", "gram_eps", "layout", "model", "batches"]),
       bad=st.sampled_from(BAD))
def test_riemannian_hessian(name, bad):
    pytest.importorskip("curvlinops")
    from quotient_manifolds.adapters.hessian import riemannian_hessian
    before = _state(MODEL)
    args, kwargs = _with(name, bad, {"model": MODEL, "batches": BATCHES},
                         {"geometry": "geodesic-mix", "layout": LAYOUT})

    def finite(op):
        return bool(torch.isfinite(op @ torch.ones(op.shape[1], dtype=torch.float64)).all())

    _refused_or_finite(lambda: riemannian_hessian(*args, **kwargs), name, finite=finite)
    _same(MODEL, before)


@PROPERTY
@given(name=st.sampled_from(["layer", "loss_fn", "method", "n_probes", "seed", "reduction", "batch_size_fn",
                             "exact_limit", "model", "batches"]), bad=st.sampled_from(BAD))
def test_relative_flatness(name, bad):
    before = _state(MODEL)
    args, kwargs = _with(name, bad, {"model": MODEL, "batches": BATCHES}, {"n_probes": 2})
    _refused_or_finite(lambda: adapters.relative_flatness(*args, **kwargs), name,
                       finite=lambda r: math.isfinite(r.value) and all(map(math.isfinite, r.per_batch)))
    _same(MODEL, before)


@PROPERTY
@given(name=st.sampled_from(["geometry", "target_loss_rise", "rho_start", "tolerance", "max_evals",
                             "model", "batches"]),
       bad=st.sampled_from(BAD))
def test_calibrate_rho(name, bad):
    before = _state(MODEL)
    args, kwargs = _with(name, bad, {"model": MODEL, "batches": BATCHES},
                         {"geometry": "geodesic-mix", "target_loss_rise": 0.1, "max_evals": 2,
                          "n_iters": 1, "layout": LAYOUT, "check_retraction": False})
    _refused_or_finite(lambda: adapters.calibrate_rho(*args, **kwargs), name,
                       finite=lambda cal: math.isfinite(cal.rho) and cal.rho > 0)
    _same(MODEL, before)


LORA = None


@PROPERTY
@given(name=st.sampled_from(["metric", "retraction", "gram_eps", "adapters", "model"]), bad=st.sampled_from(BAD))
def test_lora_quotient_parameters(name, bad):
    global LORA
    pytest.importorskip("peft")
    LORA = LORA or tiny_lora_bert(hidden=8)
    before = _state(LORA)
    args, kwargs = _with(name, bad, {"model": LORA}, {})
    try:
        groups = adapters.lora_quotient_parameters(*args, **kwargs)
    except (ValueError, TypeError) as err:
        _names(err, name)
        _same(LORA, before)
        return
    # accepted (e.g. gram_eps=2.5): the call re-points the model, by design; undo it for the next example
    assert all(torch.isfinite(p).all() for g in groups for p in g["params"])
    adapters.merge_back(LORA)
    now = LORA.state_dict()
    assert all(torch.equal(now[k], v) for k, v in before[0].items())


# -------------------------------------------------------------------------------- manifold faces
def _geoopt_face():
    from quotient_manifolds.geoopt import GLQuotient
    M = GLQuotient(5, 4, 2, metric="inv")
    return M, M.random(9, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


BAD_TANGENTS = BAD + [torch.ones(9, 2, dtype=torch.int64), torch.ones(9, 3, dtype=torch.float64),
                      torch.ones(4, 9, 2, dtype=torch.float64), torch.full((9, 2), math.nan, dtype=torch.float64),
                      torch.ones(9, 2, dtype=torch.complex128), np.ones((9, 2))]


@PROPERTY
@given(method=st.sampled_from(["proju", "egrad2rgrad", "inner", "norm", "retr", "expmap", "transp"]),
       bad=st.sampled_from(BAD_TANGENTS), which=st.sampled_from(["x", "u"]))
def test_geoopt_glquotient(method, bad, which):
    M, x = _geoopt_face()
    x0 = x.clone()
    u = M.proju(x, torch.ones(9, 2, dtype=torch.float64))
    args = {"x": x, "u": u}
    args[which] = bad
    fn = getattr(M, method)
    call = (lambda: fn(args["x"], args["x"] if which == "x" else x, args["u"])) if method == "transp" \
        else (lambda: fn(args["x"], args["u"]))
    name = {"u": "v", "x": "y"}[which] if method == "transp" else which   # transp(x, y, v) uses y, v
    _refused_or_finite(call, name,
                       finite=lambda r: bool(torch.isfinite(torch.as_tensor(r)).all()))
    assert torch.equal(x, x0)


def _pymanopt_face():
    from quotient_manifolds.pymanopt import GLQuotient
    M = GLQuotient(5, 4, 2, metric="inv")
    np.random.seed(0)
    return M, M.random_point()


BAD_PAIRS = BAD + [(np.ones((5, 3)), np.ones((4, 2))), (np.ones((3, 5, 2)), np.ones((3, 4, 2))),
                   (np.full((5, 2), np.nan), np.ones((4, 2))), (np.ones((5, 2)) * 1j, np.ones((4, 2))),
                   ("a", np.ones((4, 2))), np.ones((9, 2)), (np.ones((5, 2)),)]


@PROPERTY
@given(method=st.sampled_from(["inner_product", "norm", "projection", "euclidean_to_riemannian_gradient",
                               "retraction", "exp", "transport"]),
       bad=st.sampled_from(BAD_PAIRS), which=st.sampled_from(["point", "vector"]))
def test_pymanopt_glquotient(method, bad, which):
    M, x = _pymanopt_face()
    x0 = [a.copy() for a in x]
    u = M.projection(x, (np.ones((5, 2)), np.ones((4, 2))))
    point, vector = (bad, u) if which == "point" else (x, bad)
    fn = getattr(M, method)
    names = {"inner_product": "tangent_vector_a", "norm": "tangent_vector", "projection": "vector",
             "euclidean_to_riemannian_gradient": "euclidean_gradient", "retraction": "tangent_vector",
             "exp": "tangent_vector", "transport": "tangent_vector_a"}
    if method == "inner_product":
        call = lambda: fn(point, vector, u)  # noqa: E731
    elif method == "transport":
        call = lambda: fn(x, point, vector)  # noqa: E731
    else:
        call = lambda: fn(point, vector)  # noqa: E731
    name = names[method] if which == "vector" else ("point_b" if method == "transport" else "point")
    _refused_or_finite(call, name, finite=lambda r: bool(np.all(np.isfinite(np.concatenate(
        [np.ravel(a) for a in r])) if isinstance(r, tuple) else np.isfinite(r))))
    assert all(np.array_equal(a, b) for a, b in zip(x, x0))


@PROPERTY
@given(name=st.sampled_from(["n", "m", "h", "metric", "retraction", "eps", "exact_steps"]),
       bad=st.sampled_from(BAD), face=st.sampled_from(["geoopt", "pymanopt"]))
def test_glquotient_constructor(name, bad, face):
    if face == "geoopt":
        from quotient_manifolds.geoopt import GLQuotient
    else:
        from quotient_manifolds.pymanopt import GLQuotient
    kwargs = {"n": 5, "m": 4, "h": 2, name: bad}
    _refused_or_finite(lambda: GLQuotient(**kwargs), name, finite=lambda M: M.dim > 0)
