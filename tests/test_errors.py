"""The library's errors are one family (quotient_manifolds.errors): every error raised on purpose is
a QuotientManifoldsError and still the built-in type code caught before; nothing the library
raises on purpose is a bare built-in; no ``assert`` checks anything in library code (``python -O``
drops them); no handler catches every exception and goes on without a word."""
from __future__ import annotations

import ast
import pathlib
import re
import warnings

import pytest
import torch

import quotient_manifolds
from quotient_manifolds import adapters, errors
from quotient_manifolds.errors import (CheckpointError, GeodesicLeftManifold, InvalidArgument, InvalidArgumentType,
                                       LogNotFound, NonFiniteLoss, NotSupported, OutputNotFound,
                                       QuotientManifoldsError, SharpnessOutOfMemoryError, StepTooLarge,
                                       SymmetryError, UnknownName, UnsupportedModel, UsageError)

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = [p for d in ("quotient_manifolds", "adapters") for p in sorted((ROOT / d).rglob("*.py"))]
STUDIES = sorted((ROOT / "experiments").rglob("*.py"))

#: each error and the built-in exceptions it must still be (what ``except`` clauses caught before)
BUILT_INS = {
    InvalidArgument: (ValueError,), InvalidArgumentType: (TypeError,), UnknownName: (ValueError, KeyError),
    StepTooLarge: (ValueError,), GeodesicLeftManifold: (ValueError,), LogNotFound: (ValueError,),
    SymmetryError: (), UnsupportedModel: (ValueError,), OutputNotFound: (ValueError, TypeError),
    NotSupported: (NotImplementedError,), NonFiniteLoss: (FloatingPointError,),
    SharpnessOutOfMemoryError: (MemoryError, torch.cuda.OutOfMemoryError), UsageError: (RuntimeError,),
    CheckpointError: (ValueError,),
}


def test_every_error_is_one_of_the_family_and_its_built_in():
    assert set(BUILT_INS) | {QuotientManifoldsError} == {getattr(errors, n) for n in errors.__all__}
    for cls, built_ins in BUILT_INS.items():
        assert issubclass(cls, QuotientManifoldsError) and all(issubclass(cls, b) for b in built_ins), cls
        err = cls("what was wrong")
        assert str(err) == "what was wrong"      # KeyError would quote it
    assert issubclass(GeodesicLeftManifold, StepTooLarge) and issubclass(CheckpointError, InvalidArgument)
    # a failed symmetry check is no AssertionError (python -O does not change what is raised)
    assert not issubclass(SymmetryError, AssertionError)
    report = object()
    assert SymmetryError("m", report).report is report and LogNotFound("m").report is None


def test_the_family_is_exported_where_users_import_it():
    for name in errors.__all__:
        assert getattr(quotient_manifolds, name) is getattr(errors, name) and name in quotient_manifolds.__all__
    for name in ("SymmetryError", "UnsupportedModel", "SharpnessOutOfMemoryError", "CheckpointError"):
        assert getattr(adapters, name) is getattr(errors, name) and name in adapters.__all__
    from quotient_manifolds.adapters import checkpoint, memory, verify
    from quotient_manifolds.core import errors as core_errors
    assert (verify.SymmetryError, memory.SharpnessOutOfMemoryError, checkpoint.CheckpointError) == (
        SymmetryError, SharpnessOutOfMemoryError, CheckpointError)
    assert core_errors.StepTooLarge is StepTooLarge and core_errors.LogNotFound is LogNotFound
    from quotient_manifolds.experiments.runner import ExperimentError
    assert issubclass(ExperimentError, QuotientManifoldsError) and issubclass(ExperimentError, RuntimeError)


def test_a_bad_argument_is_caught_as_the_family_and_as_before():
    with pytest.raises(InvalidArgument, match="h must be a positive integer"):
        quotient_manifolds.GLQuotient(3, 3, 0)
    with pytest.raises(InvalidArgumentType, match="must be a torch.nn.Module"):
        adapters.layout("bert")
    with pytest.raises(UnknownName, match="no family named 'nope'") as err:
        adapters.families.family("nope")
    assert isinstance(err.value, KeyError)


def test_a_choice_names_the_argument_and_the_closest_allowed_name():
    with pytest.raises(InvalidArgument, match=r"retraction must be one of 'first_order', 'second_order', "
                                              r"'exact', got 'exakt'; did you mean 'exact'\?"):
        quotient_manifolds.RescalingQuotient(2, retraction="exakt")
    with pytest.raises(InvalidArgument, match=r"metric must be one of 'inv', 'mix', got 3$"):
        quotient_manifolds.RescalingQuotient(2, metric=3)


_BUILT_IN_RAISE = re.compile(r"raise (ValueError|TypeError|RuntimeError|KeyError|FloatingPointError|"
                             r"AssertionError|MemoryError|IndexError)\b")


def test_the_library_raises_no_bare_built_in_error():
    """What the library raises on purpose is of the family (``except QuotientManifoldsError``
    catches it); abstract methods' bare ``raise NotImplementedError`` are not errors of use."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in LIBRARY
             for i, line in enumerate(p.read_text().splitlines(), 1) if _BUILT_IN_RAISE.search(line)]
    assert not found, found


def test_no_assert_checks_anything_in_library_code():
    """``python -O`` removes assert statements: a check written as one would vanish."""
    found = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in LIBRARY + STUDIES
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Assert)]
    assert not found, found


def _silent_catch_alls(path: pathlib.Path):
    """The handlers of ``path`` that catch everything (bare, Exception, BaseException) and neither
    raise again nor record the error (use its name, or format the traceback)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.ExceptHandler):
            continue
        caught = [node.type] if not isinstance(node.type, ast.Tuple) else list(node.type.elts)
        if node.type is not None and not any(isinstance(c, ast.Name) and c.id in ("Exception", "BaseException")
                                             for c in caught):
            continue
        body = ast.Module(body=node.body, type_ignores=[])
        raises = any(isinstance(n, ast.Raise) for n in ast.walk(body))
        used = node.name is not None and any(isinstance(n, ast.Name) and n.id == node.name for n in ast.walk(body))
        formats = "format_exc" in ast.unparse(body)
        if not (raises or used or formats):
            yield f"{path.relative_to(ROOT)}:{node.lineno}"


def test_no_handler_catches_everything_and_goes_on_silently():
    found = [where for p in LIBRARY + STUDIES for where in _silent_catch_alls(p)]
    assert not found, found
    # contextlib.suppress(Exception) is the same catch-all
    found = [f"{p.relative_to(ROOT)}:{i}" for p in LIBRARY + STUDIES
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"suppress\((Base)?Exception\)", line)]
    assert not found, found


def test_a_norm_probe_passes_on_what_is_not_a_call_mismatch():
    """The probes of a module's functions catch what a call of another signature or layout raises,
    and let anything else through (a bug in the module is not 'not a norm')."""
    from quotient_manifolds.adapters.families.qk_norm import probe_weightless_norm

    class Broken(torch.nn.Module):
        def __init__(self, error):
            super().__init__()
            self.error = error

        def forward(self, u):
            raise self.error

    assert probe_weightless_norm(Broken(RuntimeError("shapes do not broadcast")), 4) is None
    with pytest.raises(KeyboardInterrupt):
        probe_weightless_norm(Broken(KeyboardInterrupt()), 4)
    with pytest.raises(AttributeError, match="no config"):
        probe_weightless_norm(Broken(AttributeError("no config")), 4)


def test_an_out_of_memory_error_is_explained_once():
    """A run inside a run (a sweep's radii, a calibration's probes) reports the innermost run's
    needs, not a message wrapped in another."""
    from quotient_manifolds.adapters.memory import explained_out_of_memory

    model = torch.nn.Linear(2, 2)
    with pytest.raises(SharpnessOutOfMemoryError, match="^inner ran out of memory") as info:
        with explained_out_of_memory(model, "outer"), explained_out_of_memory(model, "inner"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "outer" not in str(info.value) and isinstance(info.value, torch.OutOfMemoryError)


def test_a_damaged_checkpoint_is_trained_again_and_says_which_file(tmp_path):
    from quotient_manifolds.experiments.checkpoints import load_checkpoint, save_checkpoint

    path = tmp_path / "model_3.safetensors"
    save_checkpoint(str(path), {"w": torch.ones(2)}, {"train_hash": "h"})
    assert load_checkpoint(str(path), "h")[1]["train_hash"] == "h"
    path.write_bytes(path.read_bytes()[:20])                    # truncated
    with pytest.warns(RuntimeWarning, match=r"model_3\.safetensors: the checkpoint cannot be read.*trained again"):
        assert load_checkpoint(str(path), "h") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_checkpoint(str(tmp_path / "missing.safetensors")) is None   # absent: no warning
