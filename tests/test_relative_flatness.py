"""adapters.relative_flatness against a dense Hessian computed here (float64, tiny models): the exact
path to 1e-10, the stochastic path within 3 standard errors, and the rescalings that leave κ
unchanged but not the layer's Hessian trace."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from quotient_manifolds import adapters
from quotient_manifolds.adapters.flatness import default_layer
from quotient_manifolds.adapters.modes import second_order_mode
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

F = nn.functional


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(),
                         nn.Linear(6, 3)).double()


def data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for n in (7, 5)]


def dense_hessian(model, batches, name, loss_of):
    """The Hessian of L = Σ_b |b|/N L_b with respect to the weight ``name``, as an (m, n, m, n) array
    (rows per output unit), by torch.autograd.functional.hessian."""
    W0 = dict(model.named_parameters())[name].detach()
    total = sum(loss_of.size(b) for b in batches)

    def L(W):
        return sum(loss_of.size(b) / total * loss_of(functional_call(model, {name: W}, loss_of.args(b)), b)
                   for b in batches)

    with second_order_mode(model):
        H = torch.autograd.functional.hessian(L, W0)
    return H


class PairLoss:
    @staticmethod
    def size(b):
        return b[0].shape[0]

    @staticmethod
    def args(b):
        return (b[0],)

    @staticmethod
    def __call__(out, b):
        return F.cross_entropy(out, b[1])


def kappa_dense(H, W):
    """κ = Σ_j Σ_{s,s'} (W Wᵀ)_{ss'} H_{(s,j),(s',j)} from the dense Hessian."""
    return float(torch.einsum("st,sjtj->", W @ W.T, H))


def trace_dense(H):
    return float(torch.einsum("sjsj->", H))


@pytest.mark.parametrize("layer", ["0", "2", "4"])   # n < m, n > m (eigh factor), the head
def test_exact_matches_the_dense_hessian_on_an_mlp(layer):
    model, batches = mlp(), data()
    W = dict(model.named_parameters())[f"{layer}.weight"].detach()
    H = dense_hessian(model, batches, f"{layer}.weight", PairLoss())
    res = adapters.relative_flatness(model, batches, layer=layer)
    assert res.method == "exact" and res.shape == tuple(W.shape) and res.std_error == 0.0
    assert res.n_products == min(W.shape) * W.shape[1]
    want = kappa_dense(H, W)
    assert abs(res.value - want) <= 1e-10 * max(1.0, abs(want))
    # per batch: each batch's own loss
    for b, got in zip(batches, res.per_batch):
        Hb = dense_hessian(model, [b], f"{layer}.weight", PairLoss())
        assert abs(got - kappa_dense(Hb, W)) <= 1e-10 * max(1.0, abs(got))
    assert res.num_data == 12 and res.layer == layer


def test_stochastic_is_within_three_standard_errors():
    model, batches = mlp(), data()
    W = model[2].weight.detach()
    want = kappa_dense(dense_hessian(model, batches, "2.weight", PairLoss()), W)
    res = adapters.relative_flatness(model, batches, layer="2", method="stochastic", n_probes=200, seed=3)
    assert res.method == "stochastic" and res.n_products == 200 and res.std_error > 0
    assert abs(res.value - want) <= 3 * res.std_error
    # the seed fixes the probes; another seed gives another estimate
    again = adapters.relative_flatness(model, batches, layer="2", method="stochastic", n_probes=200, seed=3)
    other = adapters.relative_flatness(model, batches, layer="2", method="stochastic", n_probes=200, seed=4)
    assert again.value == res.value and other.value != res.value


def test_auto_switches_to_the_estimator_above_the_limit():
    model, batches = mlp(), data()
    res = adapters.relative_flatness(model, batches, layer="2", exact_limit=(6 * 8) ** 2 - 1, n_probes=4)
    assert res.method == "stochastic"


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg).double().eval()
    g = torch.Generator().manual_seed(2)
    batches = [dict(input_ids=torch.randint(0, 30, (n, 6), generator=g),
                    attention_mask=torch.ones(n, 6, dtype=torch.long),
                    labels=torch.randint(0, 3, (n,), generator=g)) for n in (4, 3)]
    return model, batches


class OwnLoss(PairLoss):
    @staticmethod
    def size(b):
        return b["input_ids"].shape[0]

    @staticmethod
    def args(b):
        return ((), b)

    @staticmethod
    def __call__(out, b):
        return out.loss


def test_exact_matches_the_dense_hessian_on_a_bert_classifier():
    model, batches = tiny_bert()
    res = adapters.relative_flatness(model, batches)       # the default layer: the classifier
    assert res.layer == "classifier" and res.shape == (3, 16)
    W = model.classifier.weight.detach()

    loss_of = OwnLoss()
    total = sum(loss_of.size(b) for b in batches)

    def L(w):
        return sum(loss_of.size(b) / total * functional_call(model, {"classifier.weight": w}, (), b).loss
                   for b in batches)

    H = torch.autograd.functional.hessian(L, W)
    want = kappa_dense(H, W)
    assert abs(res.value - want) <= 1e-10 * max(1.0, abs(want))


def test_the_rescalings_leave_kappa_unchanged_but_not_the_hessian_trace():
    model, batches = mlp(), data()
    lam = torch.tensor([0.3, 2.0, 1.7, 0.5, 4.0, 1.1], dtype=torch.float64)
    neuron = copy.deepcopy(model)                # rows of layer 2 × λ, columns of layer 4 × 1/λ
    layerwise = copy.deepcopy(model)             # layer 0 × 2.5, layer 2's weight × 1/2.5
    with torch.no_grad():
        neuron[2].weight.mul_(lam[:, None]), neuron[2].bias.mul_(lam), neuron[4].weight.div_(lam)
        layerwise[0].weight.mul_(2.5), layerwise[0].bias.mul_(2.5), layerwise[2].weight.div_(2.5)
    x = batches[0][0]
    for other in (neuron, layerwise):
        torch.testing.assert_close(other(x), model(x))           # the same function
    base = adapters.relative_flatness(model, batches, layer="2").value
    trace = trace_dense(dense_hessian(model, batches, "2.weight", PairLoss()))
    for other in (neuron, layerwise):
        assert adapters.relative_flatness(other, batches, layer="2").value == pytest.approx(base, rel=1e-10)
        assert abs(trace_dense(dense_hessian(other, batches, "2.weight", PairLoss())) - trace) > 0.05 * abs(trace)
    # the compensation matters: rows rescaled alone (another function) change κ
    alone = copy.deepcopy(model)
    with torch.no_grad():
        alone[2].weight.mul_(lam[:, None]), alone[2].bias.mul_(lam)
    assert abs(adapters.relative_flatness(alone, batches, layer="2").value - base) > 1e-3 * abs(base)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=6, max_size=6))
def test_neuron_wise_rescaling_property(scales):
    model, batches = mlp(), data()
    lam = torch.tensor(scales, dtype=torch.float64)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other[2].weight.mul_(lam[:, None]), other[2].bias.mul_(lam), other[4].weight.div_(lam)
    base = adapters.relative_flatness(model, batches[:1], layer="2").value
    assert adapters.relative_flatness(other, batches[:1], layer="2").value == pytest.approx(base, rel=1e-9)


def test_a_conv1d_layer_is_read_with_rows_per_output_unit():
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = nn.Sequential(Conv1D(8, 4), nn.Tanh(), nn.Linear(8, 3)).double()    # Conv1D weight (in, out)
    linear = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with torch.no_grad():
        linear[0].weight.copy_(conv[0].weight.T), linear[0].bias.copy_(conv[0].bias)
        linear[2].load_state_dict(conv[2].state_dict())
    batches = data()
    got = adapters.relative_flatness(conv, batches, layer="0")
    want = adapters.relative_flatness(linear, batches, layer="0")
    assert got.shape == (8, 4) and got.value == pytest.approx(want.value, rel=1e-12)
    assert transformers is not None


def test_default_layer_finds_the_last_linear_layer_of_a_head_module():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.classifier = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

        def forward(self, x):
            return self.classifier(self.body(x))

    assert default_layer(Net()) == "classifier.2"
    with pytest.raises(InvalidArgument, match="no output layer"):
        adapters.relative_flatness(nn.Sequential(nn.Linear(4, 3)), data())


def test_the_model_is_left_as_it_was():
    model, batches = mlp(), data()
    model.train()
    model[2].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapters.relative_flatness(model, batches, layer="2", method="stochastic", n_probes=3)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.training and not model[2].training and model[0].training
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(layer="9"), InvalidArgument, "no module '9'"),
    (dict(layer="1"), InvalidArgumentType, "ReLU, not a linear layer"),
    (dict(layer=2), InvalidArgumentType, "module path"),
    (dict(layer="2", n_probes=1), InvalidArgument, "n_probes"),
    (dict(layer="2", method="dense"), InvalidArgument, "method"),
    (dict(layer="2", reduction="max"), InvalidArgument, "reduction"),
    (dict(layer="2", seed=-1), InvalidArgument, "seed"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        adapters.relative_flatness(mlp(), data(), **kwargs)


def test_half_precision_and_empty_batches_are_refused():
    with pytest.raises(InvalidArgumentType, match="float32 copy"):
        adapters.relative_flatness(mlp().half(), data(), layer="2")
    with pytest.raises(InvalidArgument, match="empty"):
        adapters.relative_flatness(mlp(), [], layer="2")


def test_the_studies_measure_it_at_the_trained_weights_beside_sharpness():
    """experiments.measures: relative flatness has no ρ (not in the plan, the curvature points);
    its entry is adapters.relative_flatness of the output layer; the paired Δτ views hold it at
    the calibrated ρ only (no sweep radii)."""
    from quotient_manifolds.experiments import measures as M
    from quotient_manifolds.experiments.population_summary import _paired_views

    config = dict(sharp_points=512, rho=dict(adaptive=1.0, inv=0.5, mix=0.1), points=dict(hessian=64))
    assert M.parse_measures("adaptive,relative-flatness") == ("adaptive", "relative-flatness")
    assert M.plan(["adaptive", "relative-flatness"], config["rho"], [0.1]) == [("adaptive", 1.0),
                                                                              ("adaptive", 0.1)]
    assert M.points_of(config, "relative-flatness") == 64
    net = nn.Sequential()
    net.add_module("body", nn.Linear(4, 8)), net.add_module("act", nn.ReLU())
    net.add_module("head", nn.Linear(8, 3))
    net, batches = net.double(), data()
    (entry,) = M.run_flatness(net, batches)
    assert entry["measure"] == "relative-flatness" and entry["rho"] == 0.0 and entry["n_points"] == 12
    assert entry["layer"] == "head" and entry["method"] == "exact"
    assert entry["value"] == adapters.relative_flatness(net, batches, layer="head").value
    records = [dict(sharpness=[dict(measure="adaptive", rho=r, value=float(i + r)) for r in (1.0, 0.1, 10.0)]
                    + [dict(measure="relative-flatness", rho=0.0, value=float(i))], metrics={})
               for i in range(4)]
    views = {name: cols for name, _, _, cols in _paired_views(records, ["adaptive", "relative-flatness"],
                                                            {"adaptive": 1.0, "relative-flatness": 0.0})}
    assert set(views["calibrated ρ"]) == {"adaptive", "relative-flatness"}
    assert set(views["ρ × 0.1"]) == set(views["ρ × 10"]) == {"adaptive"}


def test_one_backward_per_direction_where_vectorising_fails(monkeypatch):
    from quotient_manifolds.adapters import flatness

    model, batches = mlp(), data()
    want = adapters.relative_flatness(model, batches, layer="2").value
    grad = torch.autograd.grad

    def unbatched(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("no batching rule")
        return grad(*args, **kwargs)

    monkeypatch.setattr(flatness.torch.autograd, "grad", unbatched)
    assert adapters.relative_flatness(model, batches, layer="2").value == pytest.approx(want, rel=1e-12)


def test_a_loss_linear_in_the_layer_has_zero_kappa():
    model, batches = mlp(), data()
    res = adapters.relative_flatness(model, batches, layer="4", loss_fn=lambda out, y: out.sum())
    assert res.value == 0.0 and res.per_batch == [0.0, 0.0]


def test_a_report_of_a_pass_with_relative_flatness_alone(tmp_path):
    """A second pass that measures only at the trained weights has no sharpness to plot: its
    report holds the curvature table (it failed on an empty figure before)."""
    pytest.importorskip("matplotlib")
    from quotient_manifolds.experiments.population_summary import population_report

    records = [dict(model_id=i, hparams=dict(seed=i, lr=1e-4 * (i + 1)),
                    metrics=dict(gap=0.1 * i, train_loss=0.5 - 0.01 * i),
                    sharpness=[dict(measure="relative-flatness", rho=0.0, value=1.0 + i % 3, n_points=8)])
               for i in range(5)]
    summary = population_report(str(tmp_path), "text", dict(models=5), "hash", records, target="gap", main=[],
                                default_rho={"relative-flatness": 0.0}, curvature=["relative-flatness"],
                                flatness=["relative-flatness"], n_boot=50)
    assert set(summary["curvature"]) == {"relative-flatness"}
    assert (tmp_path / "fig_curvature.png").stat().st_size > 0 and not (tmp_path / "fig_scatter.png").exists()
