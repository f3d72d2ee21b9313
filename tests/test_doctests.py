"""The docstrings of the public API are its reference (the docs site renders them): every public
function and class of ``quotient_manifolds``, its faces (``quotient_manifolds.geoopt``,
``quotient_manifolds.pymanopt``, ``quotient_manifolds.core``) and ``quotient_manifolds.adapters``
has Parameters / Returns / Raises sections and an example, and every example runs here, one pytest
case per docstring (so that ``pytest -n auto`` spreads them over the workers).

A new public name without an example, or an example that no longer prints what it says, fails here.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import io
import re
from typing import Dict, List

import pytest
import torch

#: the packages whose ``__all__`` is the public API
FACES = (
    "quotient_manifolds",
    "quotient_manifolds.geoopt",
    "quotient_manifolds.pymanopt",
    "quotient_manifolds.core",
    "quotient_manifolds.adapters",
)

#: the output of an example is compared up to whitespace, and ``...`` stands for any text
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE



def _qualified(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def public_objects() -> Dict[str, object]:
    """Every public function and class of the faces' ``__all__``, once, by qualified name.
    Constants (tuples of names, group objects, the version string) are described in the API pages'
    text; the exception classes are left to the library's error family, which documents them."""
    found: Dict[str, object] = {}
    for face in FACES:
        module = importlib.import_module(face)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            found.setdefault(_qualified(obj), obj)
    return dict(sorted(found.items()))


def _modules() -> List[str]:
    names = set(FACES)
    names.update(obj.__module__ for obj in public_objects().values())
    return sorted(names)


def collected_doctests() -> List[doctest.DocTest]:
    """The examples of every docstring in the faces and in the modules that define a public name
    (functions, classes, their methods and the modules' own docstrings)."""
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    tests: Dict[str, doctest.DocTest] = {}
    for name in _modules():
        for test in finder.find(importlib.import_module(name)):
            if test.examples:
                tests.setdefault(test.name, test)
    return [tests[name] for name in sorted(tests)]


DOCTESTS = collected_doctests()


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_example_runs(test: doctest.DocTest):
    torch.manual_seed(0)               # an example that draws at random prints the same numbers
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report = io.StringIO()
    default_dtype = torch.get_default_dtype()
    try:
        result = runner.run(test, out=report.write, clear_globs=True)
    finally:
        torch.set_default_dtype(default_dtype)
    if result.failed:
        pytest.fail(f"{result.failed} of {result.attempted} examples of {test.name} failed:\n"
                    + report.getvalue(), pytrace=False)


def _section(doc: str, title: str) -> bool:
    return re.search(rf"^\s*{title}\n\s*-{{3,}}\s*$", doc, flags=re.MULTILINE) is not None


def _takes_parameters(obj) -> bool:
    if inspect.isclass(obj) and obj.__init__ is object.__init__:
        return False
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return True
    return any(name not in ("self", "cls") for name in signature.parameters)


def _returns_a_value(obj) -> bool:
    if inspect.isclass(obj):
        return False
    annotation = inspect.signature(obj).return_annotation
    return annotation not in (None, "None", type(None))


def _validates(obj) -> bool:
    """A result record (a dataclass that checks nothing on construction) raises nothing itself."""
    return not (dataclasses.is_dataclass(obj) and not hasattr(obj, "__post_init__"))


def _missing_sections(obj) -> List[str]:
    doc = inspect.getdoc(obj) or ""
    missing = []
    if _takes_parameters(obj) and not (_section(doc, "Parameters")
                                       or (inspect.isclass(obj) and _section(doc, "Attributes"))):
        missing.append("Parameters")
    if _returns_a_value(obj) and not (_section(doc, "Returns") or _section(doc, "Yields")):
        missing.append("Returns")
    if _takes_parameters(obj) and _validates(obj) and not _section(doc, "Raises"):
        missing.append("Raises")
    if not _section(doc, "Examples"):
        missing.append("Examples")
    return missing


PUBLIC = public_objects()


@pytest.mark.parametrize("name", list(PUBLIC))
def test_public_name_is_documented(name: str):
    missing = _missing_sections(PUBLIC[name])
    assert not missing, (f"{name}'s docstring has no {', '.join(missing)} section: write it in the "
                         "numpy style of the others (Parameters / Returns / Raises / Examples)")


#: the methods a user calls on the public classes: documented like the functions (their example may
#: be the class's, where it calls them)
MAIN_METHODS = (
    "quotient_manifolds.adapters.layouts.Layout.verify",
    "quotient_manifolds.adapters.layouts.Layout.check_model",
    "quotient_manifolds.adapters.layouts.Layout.act",
    "quotient_manifolds.adapters.layouts.Layout.reparametrised",
    "quotient_manifolds.adapters.layouts.Layout.random_actions",
    "quotient_manifolds.adapters.monitor.SharpnessMonitor.measure",
    "quotient_manifolds.adapters.sam.GeodesicSAM.first_step",
    "quotient_manifolds.adapters.sam.GeodesicSAM.second_step",
    "quotient_manifolds.adapters.sam.GeodesicSAM.step",
    "quotient_manifolds.core.gl.GLQuotientGeometry.integrate_geodesic",
    "quotient_manifolds.core.gl.GLQuotientGeometry.balance",
    "quotient_manifolds.core.gl.GLFrame.retract",
    "quotient_manifolds.core.gl.GLFrame.project",
    "quotient_manifolds.core.gl.GLFrame.egrad2rgrad",
    "quotient_manifolds.core.gl.GLQuotientGeometry.act",
    "quotient_manifolds.core.rescaling.RescalingGeometry.act",
    "quotient_manifolds.core.rescaling.RescalingGeometry.beta",
    "quotient_manifolds.core.rescaling.RescalingGeometry.exact_geodesic",
)


@pytest.mark.parametrize("path", MAIN_METHODS)
def test_main_method_is_documented(path: str):
    owner_path, method_name = path.rsplit(".", 1)
    owner = PUBLIC[owner_path]
    missing = [section for section in _missing_sections(getattr(owner, method_name))
               if not (section == "Examples" and f".{method_name}(" in (inspect.getdoc(owner) or ""))]
    assert not missing, f"{path}'s docstring has no {', '.join(missing)} section"


def test_the_check_sees_every_face():
    """The walk above finds the public names of every face, the lazily imported ones included."""
    names = {name.rsplit(".", 1)[-1] for name in PUBLIC}
    assert {"GLQuotient", "RescalingQuotient", "RiemannianSGD", "GLPoint", "GLQuotientGeometry",
            "Layout", "GeodesicSAM", "SharpnessMonitor", "relative_flatness"} <= names
    assert len(DOCTESTS) >= len(PUBLIC)


def test_a_name_without_sections_is_caught():
    def undocumented(x: int) -> int:
        """Does something."""
        return x

    assert _missing_sections(undocumented) == ["Parameters", "Returns", "Raises", "Examples"]
