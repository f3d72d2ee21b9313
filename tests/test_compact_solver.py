"""What the solver holds: the compact solver (``solver_dtype=torch.bfloat16``: invariance, its value
against the float32 solver, its bytes), a GL block's point in the gradient buffer, the options that
replace the solver's module globals and the out-of-memory advice."""

from __future__ import annotations

import pytest
import torch

from quotient_manifolds.adapters.worst_case import sharpness
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType
from conftest import reparametrised_copy
from test_sharpness import batches_for, tiny_bert

pytest.importorskip("transformers")

COMPACT = torch.bfloat16
#: A relative bound on |compact − float32| / float32 of a sharpness value. The compact solver
#: rounds each entry of the elementwise iterates twice per step (the combination, the radial
#: scaling: at most 2⁻⁸ relative in all), and the value is the loss at a point it evaluated, so
#: at a perturbation ξ rounded to ξ + δ, |δ| ≤ 2⁻⁸|ξ| entrywise, the loss rise ⟨∇, ξ⟩ moves by
#: at most 2⁻⁸ ⟨|∇|, |ξ|⟩, which for an ascent iterate (∇ and ξ mostly of one sign) is about
#: 2⁻⁸ ≈ 3.9e-3 of the rise; the trajectories part further over a run's steps, for which the
#: bound leaves a factor 2.5: 1e-2.
VALUE_BOUND = 1e-2


def _value(model, batches, geometry, solver_dtype=None, **kw):
    return sharpness(model, batches, geometry=geometry, rho=0.05, n_iters=6,
                     solver_dtype=solver_dtype, **kw).value


@pytest.mark.parametrize("geometry", ["geodesic-inv", "geodesic-mix"])
def test_compact_solver_is_invariant_under_the_symmetries(geometry):
    """The GL blocks keep float32/float64 iterates in the compact solver: its value on a model
    reparametrised by the group's action (extreme scales and a random one) is the same to 1e-6
    relative, as the float32 solver's."""
    model = tiny_bert(torch.float64)
    batches = batches_for("bert", model, torch.float64)
    base = _value(model, batches, geometry, COMPACT)
    assert base > 0
    ratios = [_value(reparametrised_copy(model, scale=a, cond=None), batches, geometry, COMPACT) / base
              for a in (1e-2, 1.0, 1e2)]
    assert max(abs(r - 1) for r in ratios) < 1e-6, ratios


@pytest.mark.parametrize("geometry", ["adaptive", "geodesic-inv", "geodesic-mix"])
def test_compact_solver_value_is_within_its_rounding_of_the_float32_solver(geometry):
    """float64 model (the losses carry no rounding of their own): the compact value is within
    :data:`VALUE_BOUND` of the float32 solver's, and differs from it (the vectors are rounded)."""
    model = tiny_bert(torch.float64)
    batches = batches_for("bert", model, torch.float64)
    full, compact = _value(model, batches, geometry), _value(model, batches, geometry, COMPACT)
    assert full > 0 and abs(compact - full) <= VALUE_BOUND * full, (full, compact)
    assert compact != full
    record = sharpness(model, batches, geometry=geometry, rho=0.05, n_iters=1, solver_dtype=COMPACT)
    assert record.options["solver_dtype"] == "torch.bfloat16"   # plain data, as every option


@pytest.mark.parametrize("solver_dtype, per_weight", [(None, 14), (COMPACT, 8)])
def test_the_solver_holds_its_bytes_per_weight(monkeypatch, solver_dtype, per_weight):
    """Beyond the model, a run without the worst point's gradient holds ξ, the worst point and the
    gradient (float32, or bfloat16 in the compact solver) and the step in bfloat16: 14 bytes per
    weight, 8 compact, and transients of one weight, or one piece of a pass, at a time (the
    pieces made smaller than this model, as a real model's are). One float32 vector more than
    that (4 bytes per weight) exceeds the slack."""
    from quotient_manifolds.adapters import elementwise
    from test_sharpness_engine import _LiveBytes

    monkeypatch.setattr(elementwise, "CHUNK", 2 ** 14)
    monkeypatch.setattr(elementwise, "REDUCTION_BLOCK", 2 ** 14)
    torch.manual_seed(0)
    width, depth = 128, 12
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 3))
    x, y = torch.randn(2, width), torch.tensor([0, 2])
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    tracker = _LiveBytes()
    with tracker.mode:
        sharpness(model, [(x, y)], geometry="adaptive", rho=0.05, n_iters=2,
                  keep_worst_gradient=False, solver_dtype=solver_dtype)
    slack = 6 * largest * 4 + 64 * 1024  # float32 transients of the largest weight, activations
    assert slack < 4 * n and tracker.peak <= per_weight * n + slack, (tracker.peak / n, slack / n)


def test_keep_worst_gradient_is_an_option_and_the_options_are_checked():
    """``keep_worst_gradient`` decides the restarts' passes (kept: none recomputed), and both new
    options refuse what they do not take, naming themselves."""
    model = tiny_bert()
    batches = batches_for("bert", model)
    kept = sharpness(model, batches, geometry="adaptive", rho=0.05, n_iters=20,
                     keep_worst_gradient=True)
    lean = sharpness(model, batches, geometry="adaptive", rho=0.05, n_iters=20,
                     keep_worst_gradient=False)
    assert kept.value == lean.value and lean.n_forward > kept.n_forward
    with pytest.raises(InvalidArgument, match="solver_dtype must be None .* or torch.bfloat16"):
        sharpness(model, batches, geometry="adaptive", rho=0.05, solver_dtype=torch.float16)
    with pytest.raises(InvalidArgumentType, match="keep_worst_gradient"):
        sharpness(model, batches, geometry="adaptive", rho=0.05, keep_worst_gradient="yes")


def test_the_out_of_memory_advice_gives_the_compact_solvers_arithmetic():
    """weights + 8 bytes × trainable parameters, against the device's memory where known: a 7B
    bfloat16 decoder fits an 80 GB card (71 GB), a 13B does not; no advice for a compact run."""
    from quotient_manifolds.adapters.memory import _compact_advice

    n7 = 7_070_000_000
    advice = _compact_advice(None, 2 * n7, n7, 80 * 10 ** 9)
    assert "solver_dtype=torch.bfloat16" in advice and f"8 × {n7:,}" in advice
    assert "65.8 GiB before activations, within the device's 74.5 GiB" in advice
    n13 = 13_000_000_000
    assert "more than the device's 74.5 GiB" in _compact_advice(None, 2 * n13, n13, 80 * 10 ** 9)
    assert _compact_advice(torch.bfloat16, 2 * n7, n7, 80 * 10 ** 9) == ""


def test_a_gl_blocks_point_lives_in_the_solvers_gradient_buffer():
    """Through the forward and backward the closed-form point of a GL block is held in the buffer
    the solver hands for the gradient (free until the gradient is formed), not in a tensor of its
    own: the same values as without the buffer, in its memory; the same gradient from it."""
    from quotient_manifolds.adapters.components import QuotientComponent
    from quotient_manifolds.core import GLQuotientGeometry

    gen = torch.Generator().manual_seed(4)
    x0 = torch.randn(3, 12, 3, dtype=torch.float64, generator=gen)
    frame = GLQuotientGeometry(6, 6, 3, "inv").frame(x0, keep_dtype=True)
    comp = QuotientComponent("gl", frame, x0, retraction="second_order")
    xi = comp.project(0.2 * torch.randn(x0.shape, dtype=torch.float64, generator=gen))
    weights = torch.randn(x0.shape, dtype=torch.float64, generator=gen)
    results = []
    for into in (None, comp.solver_vector()):
        (leaf,), point = comp.leaf_point(xi, True, into)
        if into is not None:
            assert leaf.untyped_storage().data_ptr() == into.untyped_storage().data_ptr()
        grads = list(torch.autograd.grad(torch.sin(point * weights).sum(), [leaf]))
        results.append((point.detach().clone(), *comp.gradient(grads, xi)))
    for plain, held in zip(*results):
        assert torch.equal(plain, held)
