"""Inputs a model cannot take (integer or half-precision inputs to a float32 model, a float32
input to a float64 one, a wrong feature dimension) are refused at the first forward pass of
their batch with an error that names the batch, the input's dtype and shape and what the model's
first layer expects, chained to torch's ``mat1 and mat2`` error; an error inside the model that is
not about its input passes unchanged."""

import pytest
import torch

from quotient_manifolds import adapters


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).to(dtype)


TARGETS = torch.tensor([0, 1, 2, 0, 1])


@pytest.mark.parametrize("bad, error, words", [
    (torch.randint(0, 3, (5, 4)), TypeError, r"integer torch.int64 tensor of shape \(5, 4\).*inputs.float\(\)"),
    (torch.randn(5, 4).half(), TypeError, r"torch.float16 tensor of shape \(5, 4\)"),
    (torch.randn(5, 7), ValueError, r"last dimension is 4.*torch.float32 tensor of shape \(5, 7\)"),
])
@pytest.mark.parametrize("measure", ["worst", "average"])
def test_an_input_the_first_layer_cannot_take_is_named_with_its_batch(bad, error, words, measure):
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [(torch.randn(5, 4), TARGETS), (bad, TARGETS)]
    with pytest.raises(error, match=r"batch 1: the model's first layer '0' \(Linear\(in_features=4.*" + words) as err:
        adapters.sharpness(model, batches, rho=0.1, geometry="adaptive", n_iters=1, measure=measure, n_samples=1)
    assert isinstance(err.value.__cause__, RuntimeError) and "mat1 and mat2" in str(err.value.__cause__)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.mha(h, h, h, need_weights=False)[0].mean(1))


def test_the_geodesic_set_up_names_the_first_batch_and_the_layer():
    """The geodesic path's first forward is the layout's verification on batch 0."""
    torch.manual_seed(0)
    model, targets = _Attention().double(), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"batch 0: the model's first layer 'inp'.*last dimension is 4.*"
                                         r"torch.float64 tensor of shape \(2, 5, 6\)") as err:
        adapters.sharpness(model, [(torch.randn(2, 5, 6, dtype=torch.float64), targets)], rho=0.1,
                           geometry="geodesic-inv", n_iters=1)
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(TypeError, match=r"batch 0: .*weights are torch.float64 and its input is a torch.float32"):
        adapters.sharpness(model, [(torch.randn(2, 5, 4), targets)], rho=0.1, geometry="geodesic-inv", n_iters=1)


def test_an_error_inside_the_model_passes_unchanged():
    """A model whose second layer does not fit its first (a bug of the model, not of the batch):
    torch's own error, not a message about the batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(5, 3))
    with pytest.raises(RuntimeError, match="mat1 and mat2") as err:
        adapters.sharpness(model, [(torch.randn(5, 4), TARGETS)], rho=0.1, geometry="adaptive", n_iters=1)
    assert "batch" not in str(err.value)


def test_a_half_precision_model_takes_its_inputs_as_before():
    """A float16 model runs in float32 with its floating inputs cast: float16 and float32 inputs
    are both taken (no mismatch is reported for the float32 inputs its layers then get)."""
    model = _mlp(torch.float16)
    for x in (torch.randn(5, 4).half(), torch.randn(5, 4)):
        res = adapters.sharpness(model, [(x, TARGETS)], rho=0.1, geometry="adaptive", n_iters=1)
        assert res.value == res.value
