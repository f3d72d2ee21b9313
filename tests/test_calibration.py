"""quotient_manifolds.adapters.calibrate_rho: the calibrated ρ gives the target loss rise when measured independently,
in every geometry; the search agrees with a brute-force scan of the loss rise."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from quotient_manifolds import adapters
from quotient_manifolds.adapters.calibration import find_rho
from quotient_manifolds.adapters.ball import GEOMETRIES
from quotient_manifolds.errors import InvalidArgument


class _TinyEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.embed = nn.Linear(5, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


def _model_and_batches():
    torch.manual_seed(0)
    model = _TinyEncoder().double().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, 5, generator=g, dtype=torch.float64),
                torch.randint(0, 3, (8,), generator=g))]
    return model, batches


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_calibrated_rho_gives_the_target_loss_rise(geometry):
    model, batches = _model_and_batches()
    target = 0.05
    cal = adapters.calibrate_rho(model, batches, geometry=geometry, target_loss_rise=target,
                                 n_iters=4)
    assert cal.converged and cal.geometry == geometry and cal.target_loss_rise == target
    assert len(cal.evals) <= 7 and cal.evals[-1] == (cal.rho, cal.loss_rise)
    # measured again, independently of the search: within the tolerance factor of the target
    again = adapters.sharpness(model, batches, geometry=geometry, rho=cal.rho, n_iters=4).value
    assert again == pytest.approx(cal.loss_rise, rel=1e-9)
    assert abs(math.log(again / target)) <= math.log(1.25)


def test_calibration_agrees_with_a_brute_force_scan():
    """Scan the loss rise on a log grid of ρ (brute force): it increases, and the calibrated ρ lies
    between the grid points whose loss rises bracket the target."""
    model, batches = _model_and_batches()
    geometry, target = "geodesic-inv", 0.05
    grid = [0.01 * 1.6 ** k for k in range(8)]
    rises = [adapters.sharpness(model, batches, geometry=geometry, rho=r, n_iters=4).value
             for r in grid]
    assert all(b > a for a, b in zip(rises, rises[1:]))
    k = next(i for i, s in enumerate(rises) if s >= target)
    assert k > 0, "grid starts above the target"
    cal = adapters.calibrate_rho(model, batches, geometry=geometry, target_loss_rise=target,
                                 n_iters=4, tolerance=1.02, max_evals=12)
    assert grid[k - 1] <= cal.rho <= grid[k]


def test_find_rho_is_monotone_in_the_target():
    f = lambda r: 0.3 * r ** 2 + r ** 3  # noqa: E731 (increasing; S ∝ ρ² near 0)
    roots = [find_rho(f, 1.0, t, tolerance=1.001, max_evals=30)["root"] for t in (0.01, 0.1, 1, 10)]
    assert all(b > a for a, b in zip(roots, roots[1:]))
    for t, r in zip((0.01, 0.1, 1, 10), roots):
        assert f(r) == pytest.approx(t, rel=2e-3)


def test_calibrate_rho_rejects_what_it_cannot_calibrate():
    model, batches = _model_and_batches()
    with pytest.raises(InvalidArgument, match="geometry must be one of"):
        adapters.calibrate_rho(model, batches, geometry="mix", target_loss_rise=0.1)
    with pytest.raises(InvalidArgument, match="worst-case"):
        adapters.calibrate_rho(model, batches, geometry="adaptive", target_loss_rise=0.1,
                               measure="average")
    with pytest.raises(InvalidArgument, match="target_loss_rise must be a positive"):
        adapters.calibrate_rho(model, batches, geometry="adaptive", target_loss_rise=0.0)
