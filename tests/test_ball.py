"""The table of geometries (adapters/ball.py), the options of sharpness (``eps``, the former name of
``gram_eps``, refused) and the result type of average_case."""

import inspect

import pytest
import torch

from quotient_manifolds import adapters
from quotient_manifolds.adapters.ball import GEOMETRY_TABLE, geometry_of
from quotient_manifolds.adapters.solver import AverageCaseResult
from quotient_manifolds.adapters.options import SHARPNESS_OPTION_NAMES, SharpnessOptions
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    batches = [(torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,)))]
    return model, batches


def test_the_options_are_the_keywords_of_sharpness_with_their_defaults():
    params = inspect.signature(adapters.sharpness).parameters
    keywords = [p for p in params if p not in ("model", "batches", "rho")]
    assert list(SHARPNESS_OPTION_NAMES) == keywords
    defaults = SharpnessOptions()
    assert all(getattr(defaults, name) == params[name].default for name in keywords)


def test_the_table_serves_every_list_of_geometries():
    assert adapters.GEOMETRIES == ("adaptive", "geodesic-inv", "geodesic-mix")
    assert adapters.SAM_GEOMETRIES == tuple(GEOMETRY_TABLE)
    assert [GEOMETRY_TABLE[g].metric for g in adapters.GEOMETRIES] == [None, "inv", "mix"]
    assert GEOMETRY_TABLE["adaptive"].adaptive and not GEOMETRY_TABLE["sam"].adaptive
    assert geometry_of("geodesic-inv").geodesic
    with pytest.raises(InvalidArgument, match="geometry must be one of .* got 'mix'.*geometry='geodesic-mix'"):
        geometry_of("mix")
    with pytest.raises(InvalidArgument, match="geometry must be one of"):
        geometry_of("sam")                      # not a ball geometry
    for entry in (lambda g: adapters.sharpness(*_mlp(), geometry=g, rho=0.1),
                  lambda g: adapters.GeodesicSAM(_mlp()[0], torch.optim.SGD, geometry=g, lr=0.1)):
        with pytest.raises(InvalidArgument, match="geometry must be one of"):
            entry("euclidean")


def test_eps_the_former_name_of_gram_eps_is_an_unknown_keyword():
    """``eps=`` (the name of ``gram_eps`` in 0.1.0, a version that was never published) is refused
    like any unknown keyword, by every entry point that took it, before any work."""
    model, batches = _mlp()
    params = {n: p.detach() for n, p in model.named_parameters()}
    with pytest.raises(InvalidArgumentType, match="unexpected keyword argument.*'eps'.*the options are those of adapters.sharpness"):
        adapters.sharpness(model, batches, geometry="adaptive", rho=0.1, n_iters=2, eps=1e-3)
    with pytest.raises(InvalidArgumentType, match="unexpected keyword argument.*'eps'"):
        adapters.sharpness_sweep(model, batches, [0.1], geometry="adaptive", n_iters=2, eps=1e-3)
    with pytest.raises(InvalidArgumentType, match="unexpected keyword argument.*'eps'"):
        adapters.calibrate_rho(model, batches, geometry="adaptive", target_loss_rise=0.1, eps=1e-3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'eps'"):
        adapters.ball.build_ball(model, params, geometry="adaptive", eps=1e-3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'eps'"):
        adapters.lora_quotient_parameters(model, eps=1e-3)
    for entry in (adapters.ball.build_ball, adapters.lora_quotient_parameters, adapters.sharpness):
        assert "eps" not in inspect.signature(entry).parameters
    assert not hasattr(adapters.ball, "gram_eps_of")
    with pytest.raises(InvalidArgumentType, match="the options are those of adapters.sharpness"):
        adapters.sharpness_sweep(model, batches, [0.1], n_itres=2)


def test_average_case_returns_a_result_read_by_attribute():
    model, batches = _mlp()
    params = {n: p.detach() for n, p in model.named_parameters()}
    ball, write_back = adapters.ball.build_ball(model, params, geometry="adaptive")
    inputs, targets = batches[0]

    def closure(points):
        return torch.nn.functional.cross_entropy(torch.func.functional_call(model, write_back(points), inputs),
                                                 targets)

    res = adapters.solver.average_case(ball, closure, 0.1, n_samples=3, generator=torch.Generator().manual_seed(0))
    assert isinstance(res, AverageCaseResult) and len(res.losses) == 3
    assert res.sharpness == res.mean_loss - res.init_loss
    with pytest.raises(TypeError, match="not subscriptable"):   # the dict of an unpublished version
        res["mean_loss"]
