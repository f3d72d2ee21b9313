"""The documentation's sources stay in step with the code: every public name has an API entry,
the quickstart's examples run, and the citation and changelog name the package's version.

The site itself (with its executed tutorials) is built by ``.ci/run``:
``python -m sphinx -W --keep-going -b html docs docs/_build/html`` fails on any warning and on a
tutorial that raises.
"""

import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)


def _documented_names(page: pathlib.Path) -> set:
    """Names of the auto* directives of an API page, qualified by its module (``automodule``)."""
    text = page.read_text()
    module = re.search(r"^\.\. automodule:: (\S+)$", text, flags=re.M)
    names = re.findall(r"^\.\. auto(?:function|class|data|exception|attribute):: ([\w.]+)(?:\(.*\))?$", text,
                       flags=re.M)                # a directive may give the signature itself
    return {f"{module.group(1)}.{n}" if module and "." not in n else n for n in names}


def _public_names(module_name: str) -> set:
    module = importlib.import_module(module_name)
    names = set(module.__all__) | set(getattr(module, "_LAZY", ()))   # adapters' lazy Hessian names
    return {f"{module_name}.{n}" for n in names}


def test_api_reference_documents_every_public_name():
    documented = set().union(*(_documented_names(p) for p in (DOCS / "api").glob("*.rst")))
    for module_name in ("quotient_manifolds.core", "quotient_manifolds.geoopt",
                        "quotient_manifolds.pymanopt", "quotient_manifolds.adapters"):
        missing = _public_names(module_name) - documented
        assert not missing, f"public names without an entry in docs/api/: {sorted(missing)}"
    # the top-level package re-exports the core and the geoopt faces: each is documented there
    short = {name.rsplit(".", 1)[1] for name in documented if name.startswith("quotient_manifolds.")}
    import quotient_manifolds
    missing = set(quotient_manifolds.__all__) - short - {"__version__"}
    assert not missing, f"re-exported names without an API entry: {sorted(missing)}"


#: Package namespaces that serve names defined in their modules (what a user calls).
NAMESPACES = ("quotient_manifolds", "quotient_manifolds.core", "quotient_manifolds.geoopt", "quotient_manifolds.pymanopt",
              "quotient_manifolds.adapters", "quotient_manifolds.adapters.families")


def _defined_in(module) -> set:
    """The names a module defines at its top level (functions, classes, assignments)."""
    import inspect
    from conftest import top_level_names
    return top_level_names(inspect.getsource(module))[0]


def test_api_reference_documents_each_name_where_it_is_defined():
    """One import path per name: every name of docs/api is documented at the module that defines
    it, or at a package namespace that serves it (its ``__all__``), never at a module that only
    imports it (that path is no API: ``sphinx -W`` fails on a path that stops serving it)."""
    wrong = []
    for page in (DOCS / "api").glob("*.rst"):
        for name in _documented_names(page):
            module_name, _, attr = name.rpartition(".")
            if module_name.endswith("adapters.hessian") and importlib.util.find_spec("curvlinops") is None:
                continue
            module = importlib.import_module(module_name)
            if module_name in NAMESPACES:
                served = set(getattr(module, "__all__", ())) | set(getattr(module, "_LAZY", ()))
                if attr not in served and attr not in _defined_in(module):
                    wrong.append(f"{name}: not in {module_name}.__all__")
            elif attr not in _defined_in(module):
                wrong.append(f"{name}: {module_name} does not define it")
    assert not wrong, wrong


def _readme_blocks() -> list:
    return PYTHON_BLOCK.findall((ROOT / "README.md").read_text())


QUICKSTART = PYTHON_BLOCK.findall((DOCS / "quickstart.md").read_text())


def test_quickstart_has_the_three_examples():
    assert len(QUICKSTART) == 3
    assert "GLQuotient" in QUICKSTART[0] and "TrustRegions" in QUICKSTART[1]
    assert "adapters.sharpness(" in QUICKSTART[2]


@pytest.mark.parametrize("index", range(len(QUICKSTART)))
def test_quickstart_example_runs(index):
    code = QUICKSTART[index]
    if code in _readme_blocks():
        pytest.skip("the same code is a README example, which tests/test_readme.py runs")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                        "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()


def test_citation_and_changelog_name_the_version():
    yaml = pytest.importorskip("yaml")
    import quotient_manifolds
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0"
    assert str(citation["version"]) == quotient_manifolds.__version__
    assert "2505.05409" in str(citation["preferred-citation"])
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(quotient_manifolds.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$",
                     changelog, flags=re.M), "CHANGELOG.md has no dated section for the package version"


@pytest.mark.parametrize("folder, package", [("quotient_manifolds", "quotient_manifolds"),
                                             ("adapters", "quotient_manifolds.adapters")])
def test_packages_are_typed(folder, package):
    assert (ROOT / folder / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^"?{re.escape(package)}"? = \["py.typed"\]$', pyproject, flags=re.M), \
        "py.typed not in package-data"


def _conf(monkeypatch, block_curvlinops: bool = False) -> dict:
    """docs/conf.py's settings, read here (its changes to sys.path and os.environ undone after);
    ``block_curvlinops``: as where curvlinops is not installed."""
    import runpy

    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MPLBACKEND"):
        monkeypatch.setenv(name, os.environ.get(name, "1" if name != "MPLBACKEND" else "Agg"))
    with monkeypatch.context() as m:
        if block_curvlinops:
            m.setitem(sys.modules, "curvlinops", None)      # find_spec then says: not installed
        return runpy.run_path(str(DOCS / "conf.py"))


def test_docs_build_without_curvlinops_mocks_it(monkeypatch):
    """The `docs` extra cannot bring curvlinops (it installs with --no-deps): where it is missing
    autodoc imports the Hessian against a stand-in; where it is installed, the real one."""
    assert _conf(monkeypatch, block_curvlinops=True)["autodoc_mock_imports"] == ["curvlinops"]
    if importlib.util.find_spec("curvlinops") is not None:
        assert _conf(monkeypatch)["autodoc_mock_imports"] == []


def test_dataclass_signatures_render_without_typing_paths_or_factories(monkeypatch):
    signature_of = _conf(monkeypatch)["_dataclass_signature"]
    from quotient_manifolds.adapters import Layout, SharpnessResult
    signature, _ = signature_of(None, "class", "Layout", Layout, {}, "(x)", None)
    assert signature.startswith("(blocks: List[GLBlock], adaptive: List[str], gl_masks: Dict[str, Tensor]")
    assert "typing" not in signature and "<factory>" not in signature and "~" not in signature
    assert "param_shapes: Dict[str, Tuple[int, ...]] = {}" in signature
    signature, _ = signature_of(None, "class", "SharpnessResult", SharpnessResult, {}, "(x)", None)
    assert "per_batch: List[float]" in signature and "quotient_manifolds" not in signature
    assert signature_of(None, "function", "f", len, {}, "(x)", None) is None


def test_install_is_stated_as_it_is():
    """Not on the package index: the tutorials and docs/install.md name a clone or a built wheel
    (whose file name carries the package's version); the library imports as quotient_manifolds
    and quotient_manifolds.adapters (never a top-level `adapters`)."""
    import quotient_manifolds
    install = (DOCS / "install.md").read_text()
    assert "not on the Python package index" in install
    assert f"dist/quotient_manifolds-{quotient_manifolds.__version__}-py3-none-any.whl[hf]" in install
    assert "pip wheel --no-deps -w dist ." in install
    assert not re.search(r"imports as[^.]*`adapters`", install)
    assert "from quotient_manifolds import adapters" in install
    pages = [*(DOCS / "tutorials").glob("*.py"), *DOCS.glob("*.md"), ROOT / "README.md"]
    for page in pages:
        text = page.read_text()
        assert not re.search(r"pip install \"?quotient-manifolds", text), page.name
    for tutorial in (DOCS / "tutorials").glob("tutorial_*.py"):
        assert "pip install -e " in tutorial.read_text(), tutorial.name


def test_sources_hold_no_control_characters():
    """Docstrings are the API reference: maths written through an escaping string (a backspace
    for ``\\bar``, a tab for ``\\top``, a carriage return for ``\\rangle``) renders as garbage
    without any error, so the sources and pages must not contain such characters."""
    bad = []
    for folder in ("quotient_manifolds", "adapters", "experiments", "benchmarks", "docs", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".md", ".rst") or "_build" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            for lineno, line in enumerate(text.split("\n"), 1):
                if re.search(r"[\x00-\x08\x0b-\x1f\x7f]|\t", line):
                    bad.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not bad, f"control characters (write maths in raw strings, r\"\"\"…\"\"\"): {bad[:10]}"
