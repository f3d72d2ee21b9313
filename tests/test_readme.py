"""The README's examples, and the longer ones it moved to the user guide (docs/guide.md), run and
do what they claim (the geoopt and pymanopt completion examples reach a small error on ALL
entries, not only the observed ones); every link of the README and the docs pages resolves."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
# the examples run as a user's fresh script would: no inherited environment, except PYTHONPATH
# where the package is importable only through it (e.g. a machine without `pip install -e .`)
CLEAN_ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
             **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}


def _examples():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if "relative error on all entries" in b]


def test_readme_has_both_examples():
    blocks = _examples()
    assert len(blocks) == 2
    assert any("geoopt" in b for b in blocks) and any("pymanopt" in b for b in blocks)
    assert all(len(b.strip().splitlines()) <= 20 for b in blocks)


def test_readme_is_a_front_page():
    """At most 200 lines; the two newcomer commands; three quickstarts, each saying the install it
    needs; the choice of ρ; links to the documentation's pages."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    commands = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert len(commands) == 2 and commands[0].rstrip().endswith("quotient-manifolds demo")
    assert commands[1].rstrip().endswith("python -m pytest -n auto")
    # CI runs the README's test command, and builds the docs with the README's command in a venv
    # of their own (the docs extra alone)
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest -q -n auto" in ci
    docs = re.search(r'`(pip install -e "\.\[docs\]" && python -m sphinx [^`]*)`', " ".join(text.split()))
    assert docs and docs.group(1) in ci, "the README's docs command is not the one CI runs"
    assert 'pip install -e ".[docs]" && python -m sphinx' in (ROOT / "docs" / "install.md").read_text()
    quickstarts = re.findall(r"^## Quickstart \d: .*?\n\n(.*?)\n", text, flags=re.S | re.M)
    assert len(quickstarts) == 3 and all("pip install -e ." in q for q in quickstarts)
    flat = " ".join(text.split())
    assert "adapters.calibrate_rho" in flat and "comparable across geometries only at a matched loss rise" in flat
    for page in ("install", "quickstart", "concepts", "guide", "maths", "results", "benchmarks",
                 "studies"):
        assert f"(docs/{page}.md" in text, page


@pytest.mark.parametrize("index,metric", [(0, "mix"), (0, "inv"), (1, "mix")],
                         ids=["geoopt-mix", "geoopt-inv", "pymanopt"])
def test_readme_example_converges(index, metric):
    """Both metrics, with the README's per-metric learning rates, in the geoopt example."""
    code = _examples()[index]
    if index == 0:
        assert 'metric = "mix"' in code
    code = code.replace('metric = "mix"', f'metric = "{metric}"')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=CLEAN_ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    error = float(re.search(r"relative error on all entries: (\S+)", out.stdout).group(1))
    assert error < 1e-5, out.stdout


PAGES = [README, ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("readme", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_readme_links_and_results_exist(readme):
    """Every relative link or image and every ``experiments/results/...`` path a README or a docs
    page names is in the repository (results are committed, not left in an ignored run
    directory)."""
    text = readme.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)\)", text)
    targets += re.findall(r"`(experiments/results/[^`<>*\s]+)`", text)
    relative = [t for t in targets if "://" not in t]
    if readme in (README, ROOT / "docs" / "results.md"):
        assert relative, f"{readme.name} should link its pages or figures"
    if readme == ROOT / "docs" / "results.md":
        assert sum(t.endswith(".png") for t in relative) >= 4, "the results page shows the figures"
    missing = [t for t in relative if not (readme.parent / t).exists()
               and not (ROOT / t).exists()]
    assert not missing, f"{readme.name} names files that do not exist: {missing}"


def _block_with(marker: str, page: pathlib.Path = README) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S) if marker in b]
    assert len(blocks) == 1, f"expected one {page.name} example containing {marker!r}"
    return blocks[0]


def _run_example(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**CLEAN_ENV, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_readme_causal_lm_example_runs():
    """The README's sharpness quickstart, and its choice of ρ continuing it: calibrate_rho finds a
    radius whose loss rise is the target (within its tolerance, 1.25×)."""
    out = _run_example(_block_with("LlamaForCausalLM") + _block_with("adapters.calibrate_rho("))
    *lines, calibrated = out.strip().splitlines()
    values = dict(line.split() for line in lines)
    assert set(values) == {"adaptive", "geodesic-inv", "geodesic-mix"}
    assert all(float(v) > 0 for v in values.values()), out
    rise = float(re.search(r"geodesic-mix rho \S+: loss rise (\S+) nats", calibrated).group(1))
    assert 0.1 / 1.25 <= rise <= 0.1 * 1.25, out


def test_guide_causal_lm_example_is_the_readme_one():
    """The user guide's causal-LM example is the README's quickstart (run above), not a copy that
    could drift."""
    assert _block_with("LlamaForCausalLM", GUIDE) == _block_with("LlamaForCausalLM")


def test_guide_lora_example_runs():
    pytest.importorskip("peft")
    out = _run_example(_block_with('task_type="SEQ_CLS"', GUIDE))
    assert "GL(8)" in out and "lora_B.default.weight" in out
    assert re.search(r"worst-case geodesic-inv sharpness \(rho=0.05\): \d", out), out


def test_guide_beyond_measurement_example_runs():
    pytest.importorskip("peft")
    pytest.importorskip("curvlinops")
    out = _run_example(_block_with("adapters.riemannian_hessian(", GUIDE))
    trace, lam = map(float, re.search(r"Riemannian trace (\S+), λ_max (\S+)", out).groups())
    assert trace >= lam > 0, out
    assert float(re.search(r"LoRA loss after 20 invariant steps: (\S+)", out).group(1)) < 0.7
