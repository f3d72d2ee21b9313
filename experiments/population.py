r"""The run of a population study shared by the studies: its output directory, threads, configuration
from the command line (:func:`transformer_config` for text and vision), the models in worker
processes and the report (:func:`run_population_study`), with an optional ρ calibration first
(:func:`calibrated_population`).

The text and vision populations share one skeleton, written here once: a model of the population
is trained or restored from its checkpoint (:func:`population_member`), evaluated on its splits
(:func:`population_metrics`), measured in a worker (:func:`population_jobs`), and the study runs
plain or calibrated (:func:`run_transformer_population`). Their modules keep what differs: data,
model, hyperparameters, training, protocol notes and options."""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from . import calibrate
from .population_summary import population_kwargs, population_report
from .reporting import print_table, stamp_provenance
from .measures import CURVATURE, curvature_unavailable, population_job
from .checkpoints import restore_exact, trained_model
from .runner import ExperimentError, OutputDir, cores, fmt_seconds, run_population
from .stats import generalization_gap


def default_out(study: str, args: argparse.Namespace) -> str:
    """The output directory when --out is not given: ``runs/STUDY[-quick][-synthetic]``."""
    suffix = ("-quick" if getattr(args, "quick", False) else "") + \
             ("-synthetic" if getattr(args, "synthetic", False) else "")
    return os.path.join("runs", study + suffix)


def apply_sharp_overrides(config: Dict[str, Any], args: argparse.Namespace) -> None:
    """Apply the sharpness options (--rho-X, --rho-sweep, --measures, --n-iters, --sharp-points,
    --sharp-batch, --eps, --sweep-only) given on the command line to ``config``, in place."""
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
    measures = list(config.get("measures") or ())
    unavailable = curvature_unavailable(measures)
    if unavailable:
        others = [m for m in measures if m not in CURVATURE]
        raise ExperimentError(
            f"the curvature measures {', '.join(m for m in measures if m in CURVATURE)} cannot run "
            f"here: {unavailable.rstrip('.')}." + (f" Or leave them out: --measures "
                                                   f"{','.join(others)}" if others else ""))


def log_line(msg: str) -> None:
    """The studies' progress log: one line on stdout, flushed."""
    print(msg, flush=True)


def set_threads(workers: int, threads: Optional[int] = None) -> int:
    """Set torch's threads of this process to ``threads``, else the cores shared out over
    ``workers`` processes (at least 1); returns the number set."""
    threads = threads or max(1, cores() // max(1, workers))
    torch.set_num_threads(threads)
    return threads


def run_population_study(mod: ModuleType, config: Dict[str, Any], args: argparse.Namespace, *,
                         report_kwargs: Union[Dict[str, Any], Callable[[Dict[str, Any]], Dict[str, Any]]],
                         study: Optional[str] = None, prepare: Optional[Callable[..., Any]] = None,
                         log: Callable[[str], None] = log_line) -> int:
    """Run a population in its output directory and write its report. ``prepare(od, ckpt,
    threads)`` (optional) runs first, under the directory's lock, and returns the configuration
    the models run with (e.g. with calibrated ρ), or None to stop there; ``report_kwargs`` may be
    a function of that configuration."""
    study = study or mod.NAME
    n_models = int(config.pop("models"))
    if args.models is not None:
        n_models = args.models
    out = os.path.abspath(args.out or default_out(study, args))
    started = time.perf_counter()
    with OutputDir(out, study, config, force_mix=args.force_mix) as od:
        ckpt = os.path.abspath(args.checkpoint_dir or od.file("checkpoints"))
        log(f"{study}: {n_models} models -> outputs in {od.path}\n"
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
            workers=args.workers, progress=not args.no_progress, log=log, desc=study,
            threads=threads)
        wall = time.perf_counter() - started
        exclude = report_kwargs.pop("exclude_fn", lambda recs: {})(records)
        notes_fn = report_kwargs.pop("notes_fn", None)
        if notes_fn is not None:
            report_kwargs["notes"] = list(report_kwargs.get("notes", ())) + notes_fn(records)
        report_fn = report_kwargs.pop("report_fn", None)
        if hasattr(args, "n_boot"):  # studies without --n-boot report with fixed resamples only
            report_kwargs["n_boot"] = args.n_boot
        if report_fn is not None:
            summary = report_fn(od.path, config, od.hash, records, wall_s=wall, exclude=exclude,
                                **report_kwargs)
        else:
            summary = population_report(od.path, study, config, od.hash, records,
                                        wall_s=wall, exclude=exclude, **report_kwargs)
        stamp_provenance(od.path, records, summary)
        if len(summary["provenance"]["commits"]) > 1:
            log(f"warning: {od.file('results.jsonl')} holds models computed by "
                f"{len(summary['provenance']['commits'])} versions of the code (summary.md, "
                f"'Provenance'); `quotient-manifolds report` pools them only with "
                f"--allow-mixed-commits")
    print_table(summary, log)
    log(f"{study}: {len(records)} models done in {fmt_seconds(wall)} this run"
         + (f"; {len(failed)} FAILED (see {os.path.join(out, 'errors.jsonl')}; rerun retries "
            f"them)" if failed else "") + f"\n  summary: {os.path.join(out, 'summary.md')}")
    return 1 if failed else 0


def device_name(name: Optional[str]) -> Optional[str]:
    """``--device`` checked: None for the CPU, else the device's canonical name."""
    if name is None:
        return None
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


def transformer_config(mod: ModuleType, args: argparse.Namespace) -> Dict[str, Any]:
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
    device = device_name(getattr(args, "device", None))
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


def transformer_report_kwargs(mod: ModuleType, config: Dict[str, Any], synthetic: bool, target: str = "gap"
                              ) -> Dict[str, Any]:
    """:func:`~quotient_manifolds.experiments.population_summary.population_kwargs` of the population
    ``mod``."""
    return population_kwargs(mod.NAME, config, target, synthetic)


def calibrated_population(mod: ModuleType, config: Dict[str, Any], args: argparse.Namespace,
                          before: Optional[Callable[[Dict[str, Any], str, int], None]] = None,
                          log: Callable[[str], None] = log_line) -> int:
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
        if before is not None:
            before(config, ckpt, threads)
        if cal is None:
            return config
        found["calibration"] = calibrate.calibrate(
            mod, config, od, ckpt, data_dir=args.data_dir, workers=args.workers,
            threads=args.threads or threads, progress=not args.no_progress, log=log)
        run_config = calibrate.resolved(config, found["calibration"])
        calibrate.check_rho_unchanged(od, run_config)
        return None if getattr(args, "calibrate_only", False) else run_config

    def report_kwargs(run_config):
        return dict(transformer_report_kwargs(mod, run_config, args.synthetic, args.target),
                    calibration=found.get("calibration"), exclude_fn=mod.exclusions)

    return run_population_study(mod, config, args, report_kwargs=report_kwargs, prepare=prepare,
                                log=log)


def population_jobs(load_data: Callable, get_model: Callable, evaluate: Callable,
                    sharpness_batches: Callable) -> Tuple[Callable, Callable]:
    """``(job, calibration_job)`` of a text or vision population from its four hooks:
    :func:`~quotient_manifolds.experiments.measures.population_job` (one model: train or reuse,
    evaluate, measure) and :func:`~quotient_manifolds.experiments.calibrate.pilot_job` (one pilot
    model of the ρ calibration), each ``f(model_id, config, ckpt_dir, data_dir, progress)``. They are
    ``functools.partial`` objects of module-level functions, so they pickle into spawned worker
    processes."""
    hooks = dict(load_data=load_data, get_model=get_model, sharpness_batches=sharpness_batches)
    return (partial(population_job, evaluate=evaluate, **hooks),
            partial(calibrate.pilot_job, **hooks))


def population_member(mod: ModuleType, model_id: int, config: Dict[str, Any], ckpt_dir: str, *,
                      build: Callable[[Dict[str, Any]], Any],
                      train: Callable[[Any, Dict[str, Any]], Dict[str, Any]],
                      restore: Callable[[Any, Dict[str, Any]], bool] = restore_exact,
                      stored_state: Optional[Callable[[Any], Dict[str, Any]]] = None
                      ) -> Tuple[Any, Dict[str, Any], Dict[str, Any]]:
    """Model ``model_id`` of the population ``mod`` (text or vision): its hyperparameters
    ``mod.hparams(config, model_id)``, then the model restored from its checkpoint (named by
    ``mod.train_hash``) or ``build(hp)``, ``train(model, hp)`` and checkpointed
    (:func:`~quotient_manifolds.experiments.checkpoints.trained_model`; by default every tensor is
    stored and restored). Returns ``(model, hp, info)``."""
    hp = mod.hparams(config, model_id)
    model, info = trained_model(
        mod.NAME, model_id, mod.train_hash(config, hp), ckpt_dir, hp=hp, build=lambda: build(hp),
        train=lambda model: train(model, hp), restore=restore,
        stored_state=stored_state or (lambda model: model.state_dict()))
    return model, hp, info


def population_metrics(train: Tuple[float, float], own: Tuple[float, float], test: Tuple[float, float]
                       ) -> Dict[str, float]:
    """The metrics of a model of a population from the (error, mean loss) pairs on the whole train
    split (or pool), on the model's own training subset and on the test split; ``gap`` and
    ``gap_own``: test error − train error on the split and on the own subset
    (:func:`~quotient_manifolds.experiments.stats.generalization_gap`)."""
    (tr_err, tr_loss), (own_err, own_loss), (te_err, te_loss) = train, own, test
    return dict(train_error=tr_err, train_loss=tr_loss, test_error=te_err, test_loss=te_loss,
                own_train_error=own_err, own_train_loss=own_loss,
                gap=generalization_gap(te_err, tr_err), gap_own=generalization_gap(te_err, own_err))


def run_transformer_population(mod: ModuleType, config: Dict[str, Any], args: argparse.Namespace, *,
                               calibrated: bool, out_name: str,
                               before: Optional[Callable[[Dict[str, Any], str, int], None]] = None,
                               log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds text`` / ``vision`` once ``config`` is read from the command line: the
    data checked first (``mod.require_data``, which names the command that prepares them; not
    with --synthetic), then the population with its report, ``calibrated`` (ρ calibrated on the
    pilot models first, :func:`calibrated_population`, output by default in
    ``runs/OUT_NAME...``) or plain (:func:`run_population_study`)."""
    if not args.synthetic:
        mod.require_data(config, args.data_dir)
    if not calibrated:
        return run_population_study(mod, config, args, log=log, report_kwargs=transformer_report_kwargs(
            mod, config, args.synthetic, args.target))
    args.out = args.out or default_out(out_name, args)
    return calibrated_population(mod, config, args, before=before, log=log)
