"""Run every example of the README and the docs in a fresh environment built from the one install
it names, and check the package installs beside AdapterHub's ``adapters``.

An example is a ```python block preceded (within six lines) by a line naming its install, e.g.
``Needs: `pip install -e ".[hf]"` `` or ``Needs only `pip install -e .` ``; a block with no such
line continues the previous example of its page (it runs appended to it). Each install gets one
venv: the CPU build of torch first (as .ci/run), then the package's wheel with that extra, then
what the line adds after ``&&`` (e.g. ``pip install --no-deps curvlinops-for-pytorch``).

Usage: python .ci/examples.py [--only EXTRA ...] [--keep DIR]
"""

import argparse
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)
NEEDS = re.compile(r"[Nn]eeds[^`]*`(pip install -e \"?\.(?:\[(?P<extra>[\w,]+)\])?\"?(?P<rest>[^`]*))`")
#: marks a block (within the three lines above it) that is a multi-process script, not run here
NOT_RUN = "<!-- not run:"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def examples():
    """{install key: (extra, extra pip commands, [(page:line, code), ...])}, in page order."""
    found, seen = {}, set()
    for page in PAGES:
        text = page.read_text()
        last = None
        for match in BLOCK.finditer(text):
            before = text[:match.start()].split("\n")[-7:]
            needs = [m for line in before for m in [NEEDS.search(line)] if m]
            where = f"{page.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}"
            if any(NOT_RUN in line for line in before[-3:]):
                continue   # a script for several GPUs (torchrun): compiled by tests/test_docs.py
            if needs:
                extra = needs[-1].group("extra") or ""
                rest = [c.strip() for c in needs[-1].group("rest").split("&&") if c.strip()]
                key = (extra, tuple(rest))
                last = [where, match.group(1)]
                if match.group(1) not in seen:     # the same code on two pages runs once
                    seen.add(match.group(1))
                    found.setdefault(key, []).append(last)
            elif last is not None:           # a continuation of the page's previous example
                last[1] += "\n" + match.group(1)
                last[0] += f" + {where}"
            else:
                raise SystemExit(f"{where}: a python block with no install line before it "
                                 f"(add 'Needs: `pip install -e \".[extra]\"`')")
    return found


def sh(cmd, **kw):
    print("+", cmd if isinstance(cmd, str) else shlex.join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def build_env(base, name, wheel, extra, rest):
    env_dir = base / f"env-{name or 'core'}"
    sh([sys.executable, "-m", "venv", str(env_dir)])
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q"]
    sh(pip + ["torch==2.13.0"])
    sh(pip + [f"{wheel}[{extra}]" if extra else str(wheel)])
    for command in rest:
        words = shlex.split(command)
        assert words[:2] == ["pip", "install"], command
        sh(pip + words[2:])
    version = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("2.13.0"), f"env {name}: torch was replaced by {version}"
    return env_dir


def run_example(env_dir, where, code, workdir):
    started = time.perf_counter()
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         cwd=workdir, env={"PATH": "/usr/bin:/bin", **ENV}, timeout=900)
    took = time.perf_counter() - started
    if out.returncode != 0 or not out.stdout.strip():
        print(out.stdout[-2000:], out.stderr[-4000:], sep="\n")
        raise SystemExit(f"FAILED: example {where} in {env_dir.name} (exit {out.returncode})")
    print(f"ok   {where} in {env_dir.name} ({took:.0f} s)", flush=True)


def beside_adapterhub(env_dir, workdir):
    """AdapterHub's `adapters` and this package in one environment: both import, each is its own."""
    sh([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "adapters"])
    code = (
        "import adapters, transformers, torch\n"
        "from quotient_manifolds import adapters as qm\n"
        "assert hasattr(adapters, 'AutoAdapterModel'), adapters.__file__\n"
        "assert qm.__name__ == 'quotient_manifolds.adapters' and qm is not adapters\n"
        "cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,\n"
        "                              num_attention_heads=2, intermediate_size=32)\n"
        "model = transformers.BertForSequenceClassification(cfg).eval()\n"
        "layout = qm.layout(model)\n"
        "assert len(layout.blocks) == 2, layout\n"
        "print('AdapterHub', adapters.__version__, 'beside', qm.__name__, '; transformers',\n"
        "      transformers.__version__, ';', len(layout.blocks), 'blocks')\n")
    run_example(env_dir, "beside AdapterHub's adapters", code, workdir)


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="extras to run ('' = the core install)")
    parser.add_argument("--keep", default=None,
                        help="build the environments here and keep them (default: a temporary folder, "
                             "each environment removed once its examples ran, the folder at the end)")
    args = parser.parse_args()
    base = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="qm-examples-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        run_all(base, args.only, keep=args.keep is not None)
    finally:
        # each environment holds its own torch (~1 GB): left behind, a few CI runs fill the disk
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)


def run_all(base, only, keep):
    """Build the wheel, then each install's environment in ``base``, and run its examples there."""
    sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(base / "dist"), str(ROOT)])
    wheel = next((base / "dist").glob("quotient_manifolds-*.whl"))
    workdir = base / "work"                 # not the checkout: the examples use the installed wheel
    workdir.mkdir(exist_ok=True)
    found = examples()
    print(f"{sum(map(len, found.values()))} examples in {len(found)} installs:", flush=True)
    for (extra, rest), items in found.items():
        print(f"  [{extra or 'core'}] {' && '.join(rest)}: " + ", ".join(w for w, _ in items))
    for (extra, rest), items in found.items():
        if only is not None and extra not in only:
            continue
        env_dir = build_env(base, extra.replace(",", "-"), wheel, extra, rest)
        for where, code in items:
            run_example(env_dir, where, code, workdir)
        if extra == "hf" and not rest:
            beside_adapterhub(env_dir, workdir)
        if not keep:
            shutil.rmtree(env_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
