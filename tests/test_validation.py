"""Bad arguments at the public surface: a clear ValueError/TypeError naming the argument, never a silent
wrong number, and the user's model left bit-identical."""
from __future__ import annotations

import math

import pytest
import torch

from quotient_manifolds.adapters.detection import layout as detect_layout
from quotient_manifolds.adapters.worst_case import sharpness
from conftest import tiny_lora_bert
from quotient_manifolds.geoopt import GLQuotient
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, NonFiniteLoss, UnsupportedModel


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: p.requires_grad for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()})


def _unchanged(model, snap):
    state, grads, flags = snap
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in state.items())
    assert grads == {n: p.requires_grad for n, p in model.named_parameters()}
    assert flags == {n: m.training for n, m in model.named_modules()}


def _batches(inputs):
    return [(inputs, torch.tensor([0, 1]))]


@pytest.mark.parametrize("name,value,error", [
    ("step_size_mult", 0.0, InvalidArgument), ("step_size_mult", -1.0, InvalidArgument),
    ("step_size_mult", math.nan, InvalidArgument), ("n_samples", 0, InvalidArgument),
    ("n_iters", 0, InvalidArgument), ("n_samples", 2.5, InvalidArgumentType), ("measure", "best", InvalidArgument),
])
def test_sharpness_refuses_out_of_range_options(tiny_bert, name, value, error):
    model, inputs = tiny_bert
    snap = _snapshot(model)
    kw = {"measure": "average"} if name == "n_samples" else {}
    kw[name] = value
    with pytest.raises(error, match=name):
        sharpness(model, _batches(inputs), rho=0.1, **kw)
    _unchanged(model, snap)


def test_include_frozen_with_a_layout_built_without_it_is_refused(tiny_bert):
    model, inputs = tiny_bert
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    lay = detect_layout(model)
    assert lay.frozen
    with pytest.raises(InvalidArgument, match="include_frozen=True"):
        sharpness(model, _batches(inputs), rho=0.1, layout=lay, include_frozen=True)


@pytest.mark.parametrize("kw,name", [({"scales": ()}, "scales"), ({"cond": math.nan}, "cond"),
                                     ({"scales": (1.0, -1.0)}, r"scales\[1\]"), ({"cond": 0.5}, "cond")])
def test_verify_refuses_empty_scales_and_bad_cond(tiny_bert, kw, name):
    model, inputs = tiny_bert
    lay = detect_layout(model)
    snap = _snapshot(model)
    with pytest.raises(InvalidArgument, match=name):
        lay.verify(model, inputs, **kw)
    _unchanged(model, snap)


def test_glquotient_refuses_integer_and_mismatched_tangents():
    M = GLQuotient(5, 4, 2, metric="inv")
    torch.manual_seed(0)
    x = M.random(5 + 4, 2, dtype=torch.float64)
    u = torch.ones(9, 2, dtype=torch.int64)
    for call in (lambda: M.inner(x, u), lambda: M.inner(x, u.double(), u), lambda: M.proju(x, u),
                 lambda: M.egrad2rgrad(x, u)):
        with pytest.raises(InvalidArgumentType, match="floating-point"):
            call()
    with pytest.raises(InvalidArgument, match="u has shape"):
        M.proju(x, torch.ones(9, 3, dtype=torch.float64))
    xb = M.random(3, 9, 2, dtype=torch.float64)
    with pytest.raises(InvalidArgument, match="broadcast"):
        M.inner(xb, torch.ones(4, 9, 2, dtype=torch.float64))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("geometry", ["geodesic-inv", "adaptive"])
def test_sam_first_step_refuses_nonfinite_grad_before_writing(tiny_bert, bad, geometry):
    from quotient_manifolds.adapters import GeodesicSAM
    model, inputs = tiny_bert
    opt = GeodesicSAM(model, torch.optim.SGD, lr=0.1, rho=0.05, geometry=geometry)
    model(**inputs).logits.sum().backward()
    model.bert.encoder.layer[0].attention.self.query.weight.grad[0, 0] = bad
    snap = _snapshot(model)
    with pytest.raises(InvalidArgument, match="non-finite"):
        opt.first_step()
    _unchanged(model, snap)


# ------------------------------------------------------------------------------------ the loss
def _ce(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs.logits, targets)


@pytest.mark.parametrize("loss_fn,error,words", [
    (lambda o, y: torch.nn.functional.cross_entropy(o.logits, y, reduction="none"), InvalidArgument,
     "one number"),                                                           # a vector loss
    (lambda o, y: float(_ce(o, y).detach()), InvalidArgumentType, "a tensor"),          # a Python float
    (lambda o, y: torch.tensor(1.0), InvalidArgument, "does not depend"),          # a constant
])
@pytest.mark.parametrize("geometry", ["adaptive", "geodesic-mix"])
def test_a_loss_that_is_not_a_differentiable_scalar_is_refused(tiny_bert, loss_fn, error, words,
                                                               geometry):
    model, inputs = tiny_bert
    snap = _snapshot(model)
    with pytest.raises(error, match=f"(?s)loss_fn.*{words}"):
        sharpness(model, _batches(inputs), rho=0.1, geometry=geometry, n_iters=1, loss_fn=loss_fn)
    _unchanged(model, snap)


def test_a_finite_loss_with_a_non_finite_gradient_is_not_blamed_on_rho(tiny_bert):
    model, inputs = tiny_bert

    def kinked(outputs, targets):   # sqrt at 0: the value is 0, its derivative is infinite
        logits = outputs.logits
        return _ce(outputs, targets) + torch.sqrt(logits - logits.detach()).sum()

    with pytest.raises(NonFiniteLoss, match="gradient") as err:
        sharpness(model, _batches(inputs), rho=0.1, n_iters=1, loss_fn=kinked)
    assert "reduce rho" not in str(err.value)


def test_a_vector_loss_is_refused_by_the_riemannian_hessian(tiny_bert):
    pytest.importorskip("curvlinops")
    from quotient_manifolds.adapters.hessian import riemannian_hessian
    model, inputs = tiny_bert
    vector = lambda o, y: torch.nn.functional.cross_entropy(o.logits, y, reduction="none")  # noqa: E731
    with pytest.raises(InvalidArgument, match="(?s)loss_fn.*one number"):
        riemannian_hessian(model, _batches(inputs), geometry="geodesic-inv", loss_fn=vector)


@pytest.mark.parametrize("measure", ["worst", "average"])
def test_a_nan_in_the_batch_is_refused_by_every_measure(tiny_bert, measure):
    model, inputs = tiny_bert
    snap = _snapshot(model)
    nan_loss = lambda o, y: _ce(o, y) * torch.tensor(float("nan"))  # noqa: E731  (a NaN label weight)
    kw = {"n_samples": 2} if measure == "average" else {"n_iters": 1}
    with pytest.raises(NonFiniteLoss, match="not finite"):
        sharpness(model, _batches(inputs), rho=0.1, measure=measure, loss_fn=nan_loss, **kw)
    _unchanged(model, snap)


def test_a_tuple_of_several_tensors_needs_loss_fn():
    class FeaturesAndLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            features = torch.tanh(self.body(x))
            return features, self.head(features)

    torch.manual_seed(0)
    model, x, y = FeaturesAndLogits(), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(InvalidArgumentType, match="(?s)2 tensors.*loss_fn"):
        sharpness(model, [(x, y)], rho=0.1, geometry="adaptive", n_iters=1)
    ce = lambda o, t: torch.nn.functional.cross_entropy(o[1], t)  # noqa: E731
    assert sharpness(model, [(x, y)], rho=0.1, geometry="adaptive", n_iters=1, loss_fn=ce).value >= 0


# ------------------------------------------------------------------ the pymanopt face: same checks
def test_pymanopt_glquotient_refuses_misshaped_nonfinite_and_non_real_tangents():
    import numpy as np

    from quotient_manifolds.pymanopt import GLQuotient as PymanoptGLQuotient
    from quotient_manifolds import StepTooLarge

    M = PymanoptGLQuotient(5, 4, 2, metric="inv")
    np.random.seed(0)
    x = M.random_point()
    ok = (np.ones((5, 2)), np.ones((4, 2)))
    nan = (np.full((5, 2), np.nan), np.ones((4, 2)))
    for call, name in ((lambda: M.inner_product(x, ok, nan), "tangent_vector_b.G"),
                       (lambda: M.projection(x, nan), "vector.G"),
                       (lambda: M.euclidean_to_riemannian_gradient(x, nan), "euclidean_gradient.G"),
                       (lambda: M.norm(x, (np.ones((5, 2)), np.full((4, 2), np.inf))),
                        "tangent_vector.H")):
        with pytest.raises(InvalidArgument, match=rf"{name} contains \d+ non-finite"):
            call()
    with pytest.raises(StepTooLarge, match="tangent_vector contains(.|\n)*BackTrackingLineSearcher"):
        M.retraction(x, nan)
    # a step that loses rank: what to do in pymanopt's terms (its optimisers choose the step)
    flat = PymanoptGLQuotient(5, 4, 2, metric="mix", retraction="first_order")
    G, H = x
    with pytest.raises(StepTooLarge, match="G is rank-deficient(.|\n)*initial_step_size(.|\n)*Delta_bar"):
        flat.retraction(x, (-G, np.zeros_like(H)))
    with pytest.raises(InvalidArgument, match=r"tangent_vector_a.G has shape \(5, 3\), expected \(5, 2\)"):
        M.inner_product(x, (np.ones((5, 3)), np.ones((4, 2))), ok)
    with pytest.raises(InvalidArgument, match=r"vector.G has shape \(3, 5, 2\)"):   # no batches here
        M.projection(x, (np.ones((3, 5, 2)), np.ones((3, 4, 2))))
    with pytest.raises(InvalidArgumentType, match="vector must be a pair"):
        M.projection(x, np.ones((9, 2)))
    with pytest.raises(InvalidArgumentType, match="vector.G must be an array of real numbers"):
        M.projection(x, (1j * np.ones((5, 2)), np.ones((4, 2))))   # no silently dropped imaginary part
    # integers convert exactly (the face computes in float64): the right answer, not a refusal
    ints = (np.ones((5, 2), dtype=int), np.ones((4, 2), dtype=int))
    assert M.inner_product(x, ints, ints) == M.inner_product(x, ok, ok)


def test_geoopt_glquotient_refuses_nonfinite_and_unchecked_method_tangents():
    M = GLQuotient(5, 4, 2, metric="inv")
    torch.manual_seed(0)
    x = M.random(9, 2, dtype=torch.float64)
    nan = torch.full((9, 2), math.nan, dtype=torch.float64)
    for call in (lambda: M.proju(x, nan), lambda: M.inner(x, nan), lambda: M.egrad2rgrad(x, nan),
                 lambda: M.norm(x, nan), lambda: M.transp(x, x, nan)):
        with pytest.raises(InvalidArgument, match="non-finite"):
            call()
    integer = torch.ones(9, 2, dtype=torch.int64)
    for call in (lambda: M.norm(x, integer), lambda: M.retr(x, integer), lambda: M.transp(x, x, integer),
                 lambda: M.proju(x, integer.to(torch.complex128))):
        with pytest.raises(InvalidArgumentType, match="real floating-point"):
            call()


# --------------------------------------------- distributed_sharpness and lora_quotient_parameters
@pytest.mark.parametrize("kw,error,name", [
    ({"rho": -0.1}, InvalidArgument, "rho"), ({"rho": "0.1"}, InvalidArgument, "rho"), ({}, TypeError, "argument: .rho."),
    ({"rho": 0.1, "seed": 1.5}, InvalidArgumentType, "seed"), ({"rho": 0.1, "n_iters": 0}, InvalidArgument, "n_iters"),
    ({"rho": 0.1, "geometry": "geodesic"}, InvalidArgument, "geometry"),
    ({"rho": 0.1, "n_itres": 3}, InvalidArgumentType, "n_itres"), ({"rho": 0.1, "gram_eps": -1.0}, InvalidArgument, "gram_eps"),
    ({"rho": 0.1, "loss_fn": "ce"}, InvalidArgumentType, "loss_fn"), ({"rho": 0.1, "progress": "no"}, InvalidArgumentType,
                                                            "progress"),
])
def test_distributed_sharpness_checks_every_argument_before_any_collective(tiny_bert, kw, error, name):
    from quotient_manifolds.adapters import distributed_sharpness
    model, inputs = tiny_bert
    snap = _snapshot(model)
    # no process group is initialised: each bad argument is named before that is even looked at,
    # so every rank refuses it alike (none is left waiting in all_gather_object)
    with pytest.raises(error, match=name):
        distributed_sharpness(model, _batches(inputs), **kw)
    with pytest.raises(InvalidArgumentType, match="batches"):
        distributed_sharpness(model, inputs, rho=0.1)            # one dict batch, not a list of them
    with pytest.raises(InvalidArgumentType, match="model"):
        distributed_sharpness("bert", _batches(inputs), rho=0.1)
    _unchanged(model, snap)


@pytest.mark.parametrize("kw,error,name", [
    ({"metric": "euclid"}, InvalidArgument, "metric"), ({"retraction": 2}, InvalidArgument, "retraction"),
    ({"gram_eps": -1e-6}, InvalidArgument, "gram_eps"), ({"gram_eps": math.nan}, InvalidArgument, "gram_eps"),
    ({"gram_eps": "1e-6"}, InvalidArgumentType, "gram_eps"), ({"adapters": "default"}, InvalidArgumentType, r"adapters=\['default'\]"),
    ({"adapters": []}, InvalidArgument, "adapters"), ({"adapters": [1]}, InvalidArgumentType, "adapters"),
    ({"adapters": ["default", "typo"]}, InvalidArgument, r"\['typo'\].*\['default'\]"),
])
def test_lora_quotient_parameters_checks_every_argument(kw, error, name):
    pytest.importorskip("peft")
    from quotient_manifolds.adapters.lora_training import lora_quotient_parameters, lora_quotient_points
    model = tiny_lora_bert()
    snap = _snapshot(model)
    with pytest.raises(error, match=name):
        lora_quotient_parameters(model, **kw)
    assert lora_quotient_points(model) == {}
    _unchanged(model, snap)
    with pytest.raises(InvalidArgumentType, match="model"):
        lora_quotient_parameters(None)


def test_a_head_dim_larger_than_the_hidden_size_is_refused_naming_the_block():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 50, (2, 6))
    snap = _snapshot(model)
    # the symmetry is real, but no quotient of full-rank factors exists: refused when the layout is
    # built, naming the block and the factor shapes
    with pytest.raises(UnsupportedModel, match=r"(?s)model.layers.0.self_attn/qk.*head_dim 16 exceeds.*G 8, H 8.*adaptive"):
        sharpness(model, [{"input_ids": ids, "labels": ids}], rho=0.1, n_iters=1)
    _unchanged(model, snap)
