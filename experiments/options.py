r"""The command line's option types (``type=`` of argparse) and the option groups several studies share.

Each study module adds its own options (``add_arguments``); the groups here are the ones every study
has (:func:`common_arguments`), the sharpness options (:func:`sharpness_arguments`), the
population options of text and vision (:func:`population_arguments`) and their ρ calibration
(:func:`calibration_arguments`).
"""

from __future__ import annotations

import argparse
import math
from typing import List

from .calibrate import calibration_defaults
from .measures import parse_floats, parse_measures
from .studies import STUDY

#: options whose default None means "the study's configuration decides" (written to config.json)
FROM_CONFIG = {"seed", "rho_inv", "rho_mix", "rho_sweep", "sharp_points", "sharp_batch", "lr",
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


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v}")
    return v


def float_list(text: str) -> List[float]:
    """argparse type: comma-separated numbers ("0.1,1,10")."""
    try:
        return list(parse_floats(text, "list"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def value_range(text: str) -> List[float]:
    """argparse type: ``LO,HI`` with 0 < LO ≤ HI."""
    vals = float_list(text)
    if len(vals) != 2 or not vals[0] <= vals[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO ≤ HI, got {text!r}")
    return vals


def nonneg_range(text: str) -> List[float]:
    """argparse type: ``LO,HI`` with 0 ≤ LO ≤ HI (finite)."""
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


def measure_list(text: str) -> List[str]:
    """argparse type: comma-separated measure names (:data:`~quotient_manifolds.experiments.measures.MEASURES`)."""
    try:
        return list(parse_measures(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def shown(value) -> str:
    """A configuration's default as a help string shows it: a number as ``:g`` writes it, a list
    comma-separated (the form the option takes)."""
    if isinstance(value, (list, tuple)):
        return ",".join(shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def default_text(value, quick=None) -> str:
    """``(default: VALUE; quick QUICK)``: a default the configuration holds, as the help states it
    (the quick run's value only where it differs)."""
    return f"(default: {shown(value)}" + ("" if quick is None or quick == value else
                                         f"; quick {shown(quick)}") + ")"


def defaults_of(full: dict, quick: dict):
    """``key -> default_text(full[key], quick[key])``: the help text of a study's options whose
    defaults the full and the quick configurations hold under the same keys."""
    return lambda key: default_text(full[key], quick[key])


# ------------------------------------------------------------------------------------ parser
def common_arguments(p: argparse.ArgumentParser, *, population: bool = True,
                     device: bool = False, data: bool = True, synthetic: bool = True,
                     bootstrap: bool = True) -> None:
    """The options every study has (one group, "run"); each help is one line, the long form is in
    the docs page "Studies" (options of every study)."""
    g = p.add_argument_group("run")
    g.add_argument("--quick", action="store_true", help="small smoke-test version (seconds–minutes)")
    g.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default: a folder under runs/)")
    g.add_argument("--workers", type=positive_int, default=1,
                   help="models run in parallel processes")
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
        if bootstrap:  # a study whose CIs all use the fixed paired resamples has no --n-boot
            g.add_argument("--n-boot", type=positive_int, default=2000, help="bootstrap resamples")
    if device:
        g.add_argument("--device", default=None, metavar="DEV",
                       help="torch device: cpu (default), cuda, cuda:1, …")
    if data:
        g.add_argument("--data-dir", metavar="DIR", default=None,
                       help="look for the data only here (default: the cache)")
    if data and synthetic:
        g.add_argument("--synthetic", action="store_true",
                       help="TESTS ONLY: tiny synthetic stand-ins")


def sharpness_arguments(p: argparse.ArgumentParser, *, transformer: bool = True,
                        population: bool = False) -> None:
    """The sharpness options (group "sharpness"): the ρ of each family and, for a transformer
    (``transformer``), the measures and the solver's budget; ``population``: also --sweep-only."""
    g = p.add_argument_group("sharpness")
    g.add_argument("--rho-adaptive", type=positive_float, default=None,
                   help="ρ of adaptive sharpness (default: config)")
    g.add_argument("--rho-inv", type=positive_float, default=None, help="ρ of the inv measures")
    g.add_argument("--rho-mix", type=positive_float, default=None, help="ρ of the mix measures")
    g.add_argument("--rho-sweep", type=float_list, default=None, metavar="M1,...",
                   help="also measure at ρ·M for each M")
    if population:
        g.add_argument("--sweep-only", action="store_true",
                       help="measure only at the --rho-sweep radii")
    if transformer:
        g.add_argument("--measures", type=measure_list, default=None, metavar="NAME,...",
                       help="measures to compute (default: config)")
        g.add_argument("--n-iters", type=positive_int, default=None,
                       help="Auto-PGD iterations per batch")
        g.add_argument("--sharp-points", type=positive_int, default=None,
                       help="points sharpness is measured on")
        g.add_argument("--sharp-batch", type=positive_int, default=None,
                       help="batch size of sharpness")
        g.add_argument("--eps", type=float, default=None,
                       help="Gram relaxation ε (default: 0)")



def population_arguments(p: argparse.ArgumentParser, name: str) -> argparse._ArgumentGroup:
    """The options of a text or vision population (group "``name`` population"): the sharpness
    options, --target (default: the study's :attr:`~quotient_manifolds.experiments.studies.Study.target`)
    and --test-size; returns the group for the study's own options."""
    sharpness_arguments(p, population=True)
    g = p.add_argument_group(f"{name} population")
    g.add_argument("--target", choices=("gap", "gap_own", "test_error", "test_loss"),
                   metavar="T", default=STUDY[name].target, help="gap|gap_own|test_error|test_loss")
    g.add_argument("--test-size", type=positive_int, default=None, help="test examples")
    return g


def calibration_arguments(g: argparse._ArgumentGroup, calibrated: str) -> None:
    """The ρ calibration options of a population whose protocol ``calibrated`` calibrates ρ
    (:mod:`~quotient_manifolds.experiments.calibrate`)."""
    g.add_argument("--calibrate-only", action="store_true",
                   help=f"{calibrated}: stop after the ρ calibration")
    g.add_argument("--calibration-target", type=positive_float, default=None,
                   help=f"{calibrated}: median nats of ρ (default: {shown(calibration_defaults()['target'])})")
    g.add_argument("--pilot-models", type=positive_int, default=None,
                   help=f"{calibrated}: pilot models")
