"""The distribution installs one top-level import name, ``quotient_manifolds``: the repository's
``adapters/`` and ``experiments/`` folders install as ``quotient_manifolds.adapters`` and
``quotient_manifolds.experiments`` (``adapters`` is AdapterHub's package on the index, and an
environment with peft/LoRA is exactly where a user has it). ``.ci/examples.py`` installs the built
wheel beside AdapterHub's ``adapters`` and imports both; this file checks the configuration."""

import pathlib
import shutil
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = CONFIG["tool"]["setuptools"]


def _folder(package: str) -> pathlib.Path:
    """Where setuptools takes ``package`` from, under the package-dir mapping."""
    mapping = SETUPTOOLS.get("package-dir", {})
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in mapping:
            return ROOT / mapping[prefix] / pathlib.Path(*parts[cut:])
    return ROOT / pathlib.Path(*parts)


def test_every_package_folder_is_installed_under_the_namespace():
    packages = set(SETUPTOOLS["packages"])
    assert all(p == "quotient_manifolds" or p.startswith("quotient_manifolds.") for p in packages), packages
    for package in packages:
        assert (_folder(package) / "__init__.py").is_file(), f"{package}: no {_folder(package)}/__init__.py"
    on_disk = set()
    for top, name in (("quotient_manifolds", "quotient_manifolds"),
                      ("adapters", "quotient_manifolds.adapters"),
                      ("experiments", "quotient_manifolds.experiments")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            on_disk.add(".".join((name, *rel)))
    assert on_disk == packages, f"package folders not listed in pyproject: {sorted(on_disk - packages)}"


def test_no_top_level_name_of_another_distribution():
    mapping = SETUPTOOLS["package-dir"]
    assert mapping == {"quotient_manifolds.adapters": "adapters",
                       "quotient_manifolds.experiments": "experiments"}
    import quotient_manifolds.adapters as adapters
    import quotient_manifolds.experiments as experiments
    assert pathlib.Path(adapters.__file__).parent == ROOT / "adapters"
    assert pathlib.Path(experiments.__file__).parent == ROOT / "experiments"


def test_console_script_is_the_cli():
    assert CONFIG["project"]["scripts"] == {"quotient-manifolds": "quotient_manifolds.experiments.cli:main"}
    script = shutil.which("quotient-manifolds")
    if script is None:
        pytest.skip("the package is not installed in this environment (pip install -e .)")
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: quotient-manifolds")


def test_library_code_imports_nothing_by_the_old_top_level_names():
    """A leftover ``import adapters`` would import AdapterHub's package where it is installed."""
    import re
    pattern = re.compile(r"^\s*(import|from)\s+(adapters|experiments)\b", flags=re.M)
    offenders = [str(path.relative_to(ROOT))
                 for top in ("quotient_manifolds", "adapters", "experiments", "tests", "benchmarks", "docs")
                 for path in (ROOT / top).rglob("*.py")
                 if "_build" not in path.parts and "auto_tutorials" not in path.parts
                 and pattern.search(path.read_text())]
    assert not offenders, offenders


#: The extension API's names that the adapters namespace served at its top level in 0.1.0, a version
#: that was never published: each lives in its submodule only.
FORMER_TOP_LEVEL = ("Detection", "Family", "Match", "register_family", "unregister_family", "FactorPiece", "GLBlock",
                    "Unsupported", "BlockCheck", "default_tolerance", "primary_output", "build_ball", "auto_pgd",
                    "average_case", "apgd_checkpoints", "APGDResult", "ProductBall", "QuotientComponent",
                    "ElementwiseComponent", "lora_quotient_points", "LoRAQuotientPoint", "init_momentum_buffers",
                    "elementwise_rhess")


def test_one_import_path_per_name_and_no_compatibility_layer():
    """No compatibility layer for a version that was never released: the former top-level names
    of the extension API and the ``adapters.verified`` shim are gone, nothing in the adapters
    warns of a deprecation but the former spelling of a released option (``adapters.options``),
    and no module of the adapters serves a name it imports (its
    ``__all__`` lists what it defines; no re-export marked ``noqa: F401``). The package
    namespaces (``quotient_manifolds.adapters``, ``adapters.families``) serve what a user calls."""
    import importlib.util

    from conftest import top_level_names
    from quotient_manifolds import adapters

    for name in FORMER_TOP_LEVEL:
        assert not hasattr(adapters, name), f"adapters.{name} is served again"
        with pytest.raises(AttributeError, match=name):
            getattr(adapters, name)
    assert importlib.util.find_spec("quotient_manifolds.adapters.verified") is None
    serving = []
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        text = path.read_text()
        # the one deprecation: option names released in 0.1.0 and respelt since (RENAMED_OPTIONS)
        assert "_MOVED" not in text and ("DeprecationWarning" not in text
                                         or path == ROOT / "adapters" / "options.py"), path
        if path.name == "__init__.py":
            continue
        defined, listed = top_level_names(text)
        serving += [f"{path.relative_to(ROOT)}: {name}" for name in (listed or ()) if name not in defined]
        serving += [f"{path.relative_to(ROOT)}: {line.strip()}" for line in text.splitlines()
                    if "noqa" in line and "F401" in line and line.lstrip().startswith(("from ", "import "))]
    assert not serving, serving
