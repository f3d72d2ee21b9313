"""The options of sharpness as static tools see them (adapters/options.py): the TypedDicts of
``**options: Unpack[...]`` against the dataclass that checks them at run time, the Literal types
of the choice options against the run-time tuples, the former spelling ``step_normalisation``
(accepted with a DeprecationWarning), and a type checker run over a user's calls: a misspelt
option or a value outside a choice fails it, the right spelling passes."""

import inspect
import pathlib
import warnings
from typing import get_args, get_type_hints

import pytest
import torch

from quotient_manifolds import adapters
from quotient_manifolds.adapters import options as opts
from quotient_manifolds.adapters.ball import GEOMETRIES
from quotient_manifolds.adapters.elementwise import ADAPTIVE_DIRECTIONS
from quotient_manifolds.adapters.solver import MOMENTUM_FORMS, STEP_NORMALIZATIONS
from quotient_manifolds.core.gl import RETRACTIONS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_typed_dicts_name_the_dataclass_fields_with_their_types():
    fields = get_type_hints(opts.SharpnessOptions)
    assert get_type_hints(opts.SharpnessKwargs) == fields
    assert get_type_hints(opts.PerGeometryKwargs) == {k: v for k, v in fields.items()
                                                       if k not in ("geometry", "measure")}
    assert opts.SharpnessKwargs.__required_keys__ == frozenset()       # total=False: every option optional
    assert list(opts.OPTION_DOCS) == list(opts.SHARPNESS_OPTION_NAMES)


@pytest.mark.parametrize("literal, values", [
    (opts.GeometryName, GEOMETRIES), (opts.RetractionName, RETRACTIONS), (opts.MeasureName, opts.MEASURES),
    (opts.MomentumForm, MOMENTUM_FORMS), (opts.StepNormalization, STEP_NORMALIZATIONS),
    (opts.AdaptiveDirection, ADAPTIVE_DIRECTIONS)])
def test_each_choice_type_lists_the_values_the_run_time_check_accepts(literal, values):
    assert set(get_args(literal)) == set(values)


@pytest.mark.parametrize("entry", [adapters.sharpness, adapters.sharpness_sweep, adapters.calibrate_rho,
                                   adapters.distributed_sharpness])
def test_every_entry_point_shows_each_option_with_type_and_default(entry):
    params = inspect.signature(entry).parameters
    hints, defaults = get_type_hints(opts.SharpnessOptions), opts.SharpnessOptions()
    shown = [n for n in opts.SHARPNESS_OPTION_NAMES if n in params]
    assert len(shown) >= len(opts.SHARPNESS_OPTION_NAMES) - 2          # calibrate_rho: not geometry's default, measure
    for name in shown:
        if name == "geometry" and entry is adapters.calibrate_rho:
            continue                                                     # a required keyword there
        assert params[name].default == getattr(defaults, name) and params[name].annotation == hints[name], name
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    return model, [(torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,)))]


def test_the_former_spelling_is_taken_with_a_deprecation_warning_naming_the_new_one():
    model, batches = _mlp()
    kw = dict(geometry="adaptive", rho=0.1, n_iters=2, seed=0)
    with pytest.warns(DeprecationWarning, match="step_normalisation= is now spelt step_normalization=") as said:
        old = adapters.sharpness(model, batches, step_normalisation="none", **kw)
    assert said[0].filename == __file__                  # it points at the user's call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = adapters.sharpness(model, batches, step_normalization="none", **kw)
    assert old.value == new.value and old.options["step_normalization"] == "none"
    with pytest.raises(TypeError, match="pass only step_normalization="):
        adapters.sharpness(model, batches, step_normalisation="none", step_normalization="none", **kw)
    with pytest.raises(TypeError, match="'n_itres'"):                # an unknown option, named
        adapters.sharpness(model, batches, rho=0.1, n_itres=2)
    with pytest.warns(DeprecationWarning, match="step_normalization") as said:
        monitor = adapters.SharpnessMonitor(batches, geometries=["adaptive"], rho=0.1, n_iters=2,
                                            step_normalisation="none")
    assert len(said) == 1 and monitor.options == {"n_iters": 2, "step_normalization": "none"}


USER_CODE = """\
from typing import Any
from quotient_manifolds import adapters

model: Any = None
batches: Any = None
"""
#: (the call, whether a type checker must refuse it)
CALLS = [
    ('adapters.sharpness(model, batches, rho=0.1, n_iter=5)', True),
    ('adapters.sharpness(model, batches, rho=0.1, geometry="mix")', True),
    ('adapters.sharpness_sweep(model, batches, [0.1, 0.2], step_normalisation="none")', True),
    ('adapters.calibrate_rho(model, batches, geometry="adaptive", target_loss_rise=0.1, n_itres=5)', True),
    ('adapters.distributed_sharpness(model, batches, rho=0.1, momentum="nesterov")', True),
    ('adapters.SharpnessMonitor(batches, rho=0.1, retraction="second-order")', True),
    ('adapters.sharpness(model, batches, rho=0.1, n_iters=5, geometry="geodesic-inv", step_normalization="none")',
     False),
    ('adapters.sharpness_sweep(model, batches, [0.1, 0.2], measure="worst", loss_fn=None)', False),
    ('adapters.calibrate_rho(model, batches, geometry="adaptive", target_loss_rise=0.1, n_iters=5)', False),
    ('adapters.distributed_sharpness(model, batches, rho=0.1, seed=3, num_threads=None)', False),
    ('adapters.SharpnessMonitor(batches, rho=0.1, retraction="second_order", gram_eps=1e-6)', False),
]
#: mypy reads the library's annotations; the modules that define the entry points are followed,
#: everything else (torch above all: a minute to analyse) is taken as Any, which changes nothing
#: about the options' types and keeps the check to seconds
MYPY_CONFIG = """\
[mypy]
follow_imports = skip
ignore_missing_imports = True
[mypy-quotient_manifolds,quotient_manifolds.adapters,quotient_manifolds.adapters.worst_case,\
quotient_manifolds.adapters.options,quotient_manifolds.adapters.calibration,\
quotient_manifolds.adapters.distributed,quotient_manifolds.adapters.monitor]
follow_imports = silent
"""


def test_a_type_checker_refuses_a_misspelt_option_and_passes_the_right_one(tmp_path):
    mypy = pytest.importorskip("mypy.api", reason="mypy (the test extra) is not installed")
    # the installed layout (adapters/ inside quotient_manifolds/), which an editable install keeps
    # behind an import hook that static tools do not follow
    package = tmp_path / "quotient_manifolds"
    package.mkdir()
    for entry in (ROOT / "quotient_manifolds").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "adapters").symlink_to(ROOT / "adapters")
    user = tmp_path / "user.py"
    user.write_text(USER_CODE + "".join(call + "\n" for call, _ in CALLS))
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    first = USER_CODE.count("\n") + 1
    # the package is found beside the user's file (mypy searches the directory of each file given)
    out, err, status = mypy.run(["--config-file", str(tmp_path / "mypy.ini"), "--cache-dir",
                                 str(tmp_path / "cache"), "--no-error-summary", str(user)])
    flagged = {int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line}
    expected = {first + i for i, (_, refused) in enumerate(CALLS) if refused}
    assert flagged == expected, out + err
    assert status == 1
