"""Cheap checks come before expensive work: targets that the default cross-entropy cannot take
(labels of ±1 on a 2-class model) are refused after one forward pass, before the verification of
the layout (many forward passes), with what to do."""

from __future__ import annotations

import pytest
import torch

from quotient_manifolds import adapters
from quotient_manifolds.errors import InvalidArgument
from tests.conftest import PlainViT


def _counted(model):
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("geometry", ["geodesic-mix", "geodesic-inv"])
def test_plus_minus_one_labels_are_refused_before_verification(geometry):
    torch.manual_seed(0)
    model = PlainViT(num_classes=2).eval()
    calls = _counted(model)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([-1, 1, 1, -1])
    with pytest.raises(InvalidArgument, match=r"0\.\.1 of the model's 2 outputs.*-1\.\.1.*\(y \+ 1\) // 2"):
        adapters.sharpness(model, [(x, y)], geometry=geometry, rho=0.05, n_iters=1)
    assert len(calls) == 1, f"{len(calls)} forward passes before the refusal (verification ran)"


def test_a_class_index_past_the_outputs_is_refused_and_valid_targets_run():
    torch.manual_seed(0)
    model = PlainViT(num_classes=3).eval()
    x = torch.randn(4, 1, 8, 8)
    with pytest.raises(InvalidArgument, match=r"0\.\.2 of the model's 3 outputs, but these range over 0\.\.3\. For"):
        adapters.sharpness(model, [(x, torch.tensor([0, 1, 2, 3]))], geometry="geodesic-mix", rho=0.05,
                           n_iters=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # -100 is cross-entropy's ignored index, not a class: accepted; the model is left as it was
    res = adapters.sharpness(model, [(x, torch.tensor([0, 2, -100, 1]))], geometry="geodesic-mix",
                             rho=0.05, n_iters=1)
    assert res.value >= 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not model.training
