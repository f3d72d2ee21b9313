r"""Vision population: fine-tunes of one pretrained small ViT (:mod:`quotient_manifolds.experiments.vit`) on
Fashion-MNIST (``--protocol finetune``, default), or ViTs trained from scratch
(``--protocol scratch``, the earlier population).

Fine-tune protocol (a scaled-down analogue of the paper's CLIP fine-tunes with random
hyperparameters, "model soups"; docs/maths.md §11.3):

* data: one fixed seeded order of the 60k Fashion-MNIST training images. The first ``pool_size``
  (20k) form the fine-tuning pool, model subsets are prefixes of it (nested); the next
  ``pretrain.size`` (40k, disjoint from the pool) are the pretraining set; test on the first
  ``test_size`` images of the official test set (default all 10k);
* pretraining, once per configuration (cached as a checkpoint, reused on resume and by every
  model): the default ViT on the disjoint pretraining set, AdamW with cosine schedule, 12 epochs
  without augmentation (pretraining error 7.2 % on its own images, 12.2 % on the test set).
  ``pretrain.labels = "fine"`` (default): the same 10 classes, and every fine-tune starts from the
  whole pretrained model (head included), as the CLIP fine-tunes of model soups all start from one
  zero-shot model; ``"coarse"``: a *different label task*, the 5 groups
  {T-shirt, pullover, coat, shirt} / {trouser} / {dress} / {sandal, sneaker, ankle boot} / {bag}
  (``COARSE``), and the fine-tunes replace the 5-way head by a 10-way head initialised
  identically for every model (seed ``pretrain.seed + 1``). Coarse pretraining was tried first and
  left the fine-tunes far from the 5 % target (own-subset train error 13–36 % after 10–16 epochs
  at lr 1e-4–1e-3 on 2k–4k images), and so was 5-epoch fine-label pretraining with augmentation
  (7.5–19 %): memorising the confusable shirt / T-shirt / pullover / coat images is the slow part;
* population: model i draws from ``default_rng([seed, i, 29])``: lr log-uniform ``lr_range``,
  weight decay log-uniform ``wd_range``, epochs uniform in ``epochs_range`` (capped so that subset ×
  epochs ≤ ``max_samples_seen``), subset log-uniform ``subset_range`` (≥ the sharpness points, so
  they are training points of every model), label smoothing from ``smoothing_choices``,
  augmentation from ``augment_choices`` ("none", "flip": random horizontal flips; "flip+shift"
  adds ±2 px translations and kept 17 % train error after 24 epochs, so it is not drawn); batch
  from ``batch_choices``;
* training: full fine-tune (every weight), AdamW, cosine schedule with 5 % warm-up, grad-norm clip 1.
  Every model must reach own-subset train error ≤ ``train_error_target`` (5 %): the ranges above
  were chosen so that it does; a model that misses it is excluded from every τ and listed in the
  summary (:func:`exclusions`);
* metrics: as for scratch (pool / own subset / test errors and losses); the report correlates with
  ``gap_own`` = test error − own-subset train error;
* sharpness: on the first ``sharp_points`` (1024; ✂ paper 2048, cut for time: see
  experiments/README.md) pool images in batches of ``sharp_batch`` (256), eval mode, no
  augmentation, ``n_iters`` (20) Auto-PGD iterations; ``points`` cuts the ablations, the ρ sweep
  (×0.1, ×10), the exact-retraction measure, the curvature measures and relative flatness (κ of the
  classifier head) to the first batch of 256 (cost; :func:`quotient_manifolds.experiments.measures.points_of`);
* ρ: calibrated per family (adaptive / inv / mix) on a pilot of models so that the median
  sharpness is ``calibration.target`` nats (:mod:`quotient_manifolds.experiments.calibrate`), then swept by
  ``rho_sweep``.

Scratch protocol (the earlier population, unchanged): models trained from random init on nested
subsets 2k–20k with random lr, weight decay, batch, epochs 5–40, label smoothing, augmentation;
sharpness on 512 images in batches of 128 at fixed ρ. It adds a population whose fit varies
widely (own-subset train error 0.006–0.53), i.e. the regime where sharpness tracks fit.

``--synthetic`` uses SYNTHETIC images (:func:`quotient_manifolds.experiments.data.synthetic_images`); tests only.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from . import measures as M
from .calibrate import calibration_defaults
from .data import find_fashion_mnist, load_fashion_mnist, nested_split, synthetic_images
from .options import calibration_arguments, default_text, population_arguments, positive_int
from .population import log_line, population_jobs, population_member, population_metrics, \
    run_transformer_population, transformer_config
from .checkpoints import restore_exact, trained_model
from .runner import ExperimentError, cores, fmt_seconds, keys_hash, study_device
from .stats import error_and_loss
from .training import TrainingLoop, train_epochs
from .vit import ViT, ViTConfig

NAME = "vision"
PAPER_KEY = "vision"
#: the sharpness points of the paper's experiment (for the report's notes)
PAPER_SHARPNESS = "2048 in batches of 256"
MEAN, STD = 0.2860, 0.3530
PROTOCOLS = ("finetune", "scratch")
#: coarse pretraining task: Fashion-MNIST class -> group (upper body / trouser / dress / shoes / bag)
COARSE = (0, 1, 0, 2, 0, 3, 0, 3, 4, 3)
#: measures of the fine-tune protocol: the main three, the paper's adaptive baseline, the exact
#: mix geodesic, the ablations, the curvature measures and relative flatness (experiments/measures.py)
FINETUNE_MEASURES = (M.MAIN + ("adaptive-andriushchenko", "mix-exact") + M.ABLATIONS
                     + M.AT_WEIGHTS)
#: knobs whose R² the report gives (label, hparams key, transform)
KNOBS = (("log lr", "lr", "log"), ("log weight decay", "weight_decay", "log"),
         ("epochs", "epochs", "linear"), ("label smoothing", "label_smoothing", "categorical"),
         ("augmentation", "augment", "categorical"), ("log subset", "subset", "log"),
         ("batch size", "batch_size", "categorical"))


def defaults(quick: bool, synthetic: bool, protocol: str = "scratch") -> Dict[str, Any]:
    """The configuration of ``protocol`` (module docstring). The module default stays "scratch"
    (the configuration, and hash, of the earlier population, also used by the invariance and
    retraction studies); ``quotient-manifolds vision`` defaults to "finetune"."""
    if protocol == "finetune":
        return finetune_defaults(quick, synthetic)
    if protocol != "scratch":
        raise ExperimentError(f"unknown vision protocol {protocol!r}; valid: "
                              f"{', '.join(PROTOCOLS)}")
    c: Dict[str, Any] = dict(
        data="synthetic" if synthetic else "fashion-mnist", split_seed=0, seed=0,
        pool_size=20000, test_size=10000,
        arch=dict(width=64, depth=4, heads=4, patch=7, mlp_ratio=2.0),
        lr_range=[3e-4, 3e-3], wd_range=[1e-3, 0.3], batch_choices=[64, 128, 256],
        epochs_range=[5, 40], subset_range=[2000, 20000], max_samples_seen=300000,
        smoothing_choices=[0.0, 0.1], augment_choices=[False, True], warmup=0.05,
        sharp_points=512, sharp_batch=128, n_iters=20, eps=0.0,
        rho=dict(adaptive=0.2, inv=0.1, mix=0.01), rho_sweep=[1 / 3, 3.0],
        measures=list(M.DEFAULT_MEASURES), models=48)
    if synthetic:
        c.update(pool_size=4000, test_size=1000, subset_range=[1000, 4000])
    if quick:
        c["quick"] = True  # a smoke test: every output says so (reporting.SMOKE_TEST)
        c.update(pool_size=400, test_size=200, arch=dict(width=32, depth=2, heads=2, patch=7,
                                                         mlp_ratio=2.0),
                 epochs_range=[1, 2], subset_range=[200, 400], batch_choices=[64, 128],
                 max_samples_seen=800, sharp_points=64, sharp_batch=32, n_iters=3,
                 rho_sweep=[2.0], models=4)
    return c


def finetune_defaults(quick: bool, synthetic: bool) -> Dict[str, Any]:
    """Configuration of the fine-tune protocol (module docstring). ``rho`` holds the starting
    points of the calibration (and the values used where no calibration runs, e.g. by the
    invariance study); ``calibration.families`` lists the families calibrated."""
    c: Dict[str, Any] = dict(
        protocol="finetune", data="synthetic" if synthetic else "fashion-mnist", split_seed=0,
        seed=0, pool_size=20000, test_size=10000,
        pretrain=dict(size=40000, labels="fine", epochs=12, lr=1e-3, weight_decay=0.05,
                      batch_size=128, augment=False, seed=12345),
        arch=dict(width=64, depth=4, heads=4, patch=7, mlp_ratio=2.0),
        lr_range=[6e-4, 2e-3], wd_range=[1e-3, 0.3], batch_choices=[128],
        epochs_range=[16, 28], subset_range=[2048, 3072], max_samples_seen=100000,
        smoothing_choices=[0.0, 0.05, 0.1], augment_choices=["none", "flip"], warmup=0.05,
        train_error_target=0.05,
        sharp_points=1024, sharp_batch=256, n_iters=20, eps=0.0,
        points=dict(ablations=256, sweep=256, exact=256, hessian=256),
        hessian=dict(M.HESSIAN_DEFAULTS, trace_matvecs=9),
        rho=dict(adaptive=2.0, inv=0.6, mix=0.03),
        calibration=calibration_defaults(),
        rho_sweep=[0.1, 10.0],
        measures=list(FINETUNE_MEASURES), models=48)
    if synthetic:
        c.update(pool_size=4000, test_size=1000, subset_range=[1024, 3072])
        c["pretrain"].update(size=4000)
    if quick:
        c["quick"] = True  # a smoke test: every output says so (reporting.SMOKE_TEST)
        c.update(pool_size=400, test_size=200, arch=dict(width=32, depth=2, heads=2, patch=7,
                                                         mlp_ratio=2.0),
                 epochs_range=[1, 2], subset_range=[200, 400], batch_choices=[64],
                 max_samples_seen=800, sharp_points=64, sharp_batch=32, n_iters=3,
                 points=dict(ablations=32, sweep=32, exact=32, hessian=32),
                 hessian=dict(M.HESSIAN_DEFAULTS, trace_matvecs=3, lanczos_tol=0.1),
                 rho_sweep=[0.3, 3.0], train_error_target=1.0, models=4)
        c["pretrain"].update(size=200, epochs=1, labels="coarse")
        c["calibration"].update(pilot_models=2, points=32, max_evals=3)
    return c


def hparams(config: Dict[str, Any], model_id: int) -> Dict[str, Any]:
    rng = np.random.default_rng([int(config["seed"]), int(model_id), 29])

    def logu(lo, hi):
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    subset = int(round(logu(*config["subset_range"])))
    epochs = int(rng.integers(config["epochs_range"][0], config["epochs_range"][1] + 1))
    epochs = max(1, min(epochs, config["max_samples_seen"] // subset))
    return dict(seed=int(rng.integers(0, 2 ** 31 - 1)), lr=logu(*config["lr_range"]),
                weight_decay=logu(*config["wd_range"]),
                batch_size=int(rng.choice(config["batch_choices"])), epochs=epochs,
                subset=subset, label_smoothing=float(rng.choice(config["smoothing_choices"])),
                augment=_plain(rng.choice(config["augment_choices"])))


def _plain(v):
    """A numpy scalar drawn by ``rng.choice`` as the plain bool / str it came from."""
    return bool(v) if isinstance(v, (bool, np.bool_)) else str(v)


_CACHE: Dict[str, Any] = {}


def load_data(config: Dict[str, Any], data_dir: Optional[str]) -> Dict[str, Any]:
    """Normalised tensors: the pool ``x, y``, the test set ``x_test, y_test`` and, for the
    fine-tune protocol, the disjoint pretraining set ``x_pre, y_pre`` (fine labels)."""
    pre = (config.get("pretrain") or {}).get("size", 0) if config.get("protocol") == "finetune" \
        else 0
    device = study_device(config)
    key = repr((config["data"], config["split_seed"], config["pool_size"], config["test_size"],
                pre, data_dir, str(device)))
    if key in _CACHE:
        return _CACHE[key]

    if config["data"] == "synthetic":
        xtr, ytr = synthetic_images(config["pool_size"], seed=config["split_seed"])
        xte, yte = synthetic_images(config["test_size"], seed=config["split_seed"] + 1)
        xpre, ypre = synthetic_images(pre, seed=config["split_seed"] + 2) if pre else (None, None)
    else:
        xall, yall, xte, yte = load_fashion_mnist(data_dir)
        # the first pool_size of this order are the pool (as nested_split(n, pool_size) gives
        # them), the next `pre` the pretraining set
        order, _ = nested_split(len(xall), config["pool_size"] + pre, 0, config["split_seed"])
        pool = order[: config["pool_size"]]
        xtr, ytr = xall[pool], yall[pool]
        xpre, ypre = (xall[order[config["pool_size"]:]], yall[order[config["pool_size"]:]]) \
            if pre else (None, None)
        xte, yte = xte[: config["test_size"]], yte[: config["test_size"]]

    def norm(x):
        return ((torch.tensor(x, dtype=torch.float32, device=device) / 255.0 - MEAN) / STD
                ).unsqueeze(1)

    def labels(y):
        return torch.tensor(y, device=device)

    out = dict(x=norm(xtr), y=labels(ytr), x_test=norm(xte), y_test=labels(yte))
    if pre:
        out.update(x_pre=norm(xpre), y_pre=labels(ypre))
    _CACHE[key] = out
    return out


def build_model(config: Dict[str, Any], seed: int, classes: int = 10):
    torch.manual_seed(seed)  # initialised on the CPU: the same weights on every device
    return ViT(ViTConfig(**config["arch"], classes=classes)).to(study_device(config))


AUGMENTATIONS = ("none", "flip", "flip+shift")


def augment(x, gen, shift: bool = True):
    """Random ±2 px translation (zero padding; ``shift``) and horizontal flip, per image. The
    draws come from the CPU generator ``gen`` (the same augmentation on every device)."""
    B, dev = x.shape[0], x.device
    if not shift:
        out = x.clone()
        flip = (torch.rand(B, generator=gen) < 0.5).to(dev)
        out[flip] = out[flip].flip(-1)
        return out
    pad = torch.nn.functional.pad(x, (2, 2, 2, 2), value=float(-MEAN / STD))
    dx = torch.randint(0, 5, (B,), generator=gen).to(dev)
    dy = torch.randint(0, 5, (B,), generator=gen).to(dev)
    rows = (dy[:, None] + torch.arange(28, device=dev)[None, :])  # (B, 28)
    cols = (dx[:, None] + torch.arange(28, device=dev)[None, :])
    out = pad[:, 0][torch.arange(B, device=dev)[:, None, None], rows[:, :, None],
                    cols[:, None, :]].unsqueeze(1)
    flip = (torch.rand(B, generator=gen) < 0.5).to(dev)
    out[flip] = out[flip].flip(-1)
    return out


def fit(model, x, y, hp: Dict[str, Any], warmup: float, progress: bool = False) -> Dict[str, Any]:
    """AdamW (weight decay on matrices except embeddings), cosine schedule with ``warmup``,
    grad-norm clip 1, ``hp["epochs"]`` passes over (x, y) in batches of ``hp["batch_size"]``,
    optional augmentation and label smoothing; the data order comes from ``hp["seed"]``."""
    n = x.shape[0]
    gen = torch.Generator().manual_seed(hp["seed"])
    torch.manual_seed(hp["seed"])
    decay = [p for nme, p in model.named_parameters() if p.dim() >= 2 and "embed" not in nme]
    rest = [p for nme, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in nme)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=hp["lr"])
    bs = hp["batch_size"]
    loop = TrainingLoop(opt, list(model.parameters()), steps_per_epoch=math.ceil(n / bs),
                        epochs=hp["epochs"], warmup=warmup, decay="cosine", progress=progress)

    def epoch():
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, bs):
            b = perm[s:s + bs].to(x.device)
            # augment: a bool (True = flip+shift; scratch protocol) or one of AUGMENTATIONS
            aug = hp["augment"]
            yield (x[b] if aug in (False, "none") else augment(x[b], gen, shift=aug != "flip")), y[b]

    return train_epochs(model, loop, hp["epochs"], epoch, lambda batch: F.cross_entropy(
        model(batch[0]), batch[1], label_smoothing=hp.get("label_smoothing", 0.0)))


def train(model, config, data, hp, progress: bool = False) -> Dict[str, Any]:
    """Train (scratch) or fine-tune (finetune) ``model`` on its own subset, a prefix of the pool."""
    n = hp["subset"]
    return fit(model, data["x"][:n], data["y"][:n], hp, config["warmup"], progress)


def predict(model, x, batch: int = 1000):
    model.eval()
    with torch.no_grad():
        return torch.cat([model(x[s:s + batch]).double() for s in range(0, x.shape[0], batch)])


def _err_loss(logits, y):
    return error_and_loss(logits.cpu().numpy(), y.cpu().numpy())


def evaluate(model, config, data, hp) -> Dict[str, float]:
    """Errors/losses on the pool, on the model's own subset (a prefix of the pool: same forward
    pass) and on the test set (:func:`~quotient_manifolds.experiments.population.population_metrics`)."""
    logits = predict(model, data["x"])
    n = hp["subset"]
    return population_metrics(_err_loss(logits, data["y"]), _err_loss(logits[:n], data["y"][:n]),
                              _err_loss(predict(model, data["x_test"]), data["y_test"]))


def sharpness_batches(config, data):
    n, b = config["sharp_points"], config["sharp_batch"]
    return [(data["x"][s:min(s + b, n)], data["y"][s:min(s + b, n)]) for s in range(0, n, b)]


# ------------------------------------------------------------------------------------ pretraining
def pretrain_hash(config: Dict[str, Any]) -> str:
    """The hash of the pretrained ViT of the fine-tune protocol (its checkpoint's name)."""
    return keys_hash(f"{NAME}-pretrain", config, ("data", "split_seed", "pool_size", "arch", "pretrain"))


_PRETRAINED: Dict[Tuple[str, str], Any] = {}


def pretrained(config: Dict[str, Any], data, ckpt_dir: str, progress: bool = False
               ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(state dict, info) of the one pretrained ViT of the fine-tune protocol: loaded from
    ``ckpt_dir`` when its checkpoint (same pretraining hash) exists, else trained on the coarse
    task of the pretraining set and checkpointed. ``info`` holds its coarse-task errors."""
    h = pretrain_hash(config)
    # per checkpoint directory: a run elsewhere must find (and record) its own checkpoint there
    key = (h, os.path.abspath(ckpt_dir))
    if key in _PRETRAINED:
        return _PRETRAINED[key]
    p = config["pretrain"]
    if p["labels"] not in ("coarse", "fine"):
        raise ExperimentError(f"pretrain.labels {p['labels']!r}: valid 'coarse', 'fine'")
    coarse = torch.tensor(COARSE if p["labels"] == "coarse" else tuple(range(10)),
                          device=study_device(config))
    hp = dict(seed=int(p["seed"]), lr=p["lr"], weight_decay=p["weight_decay"],
              batch_size=int(p["batch_size"]), epochs=int(p["epochs"]), augment=bool(p["augment"]),
              label_smoothing=0.0)

    def train_pre(model):
        info = fit(model, data["x_pre"], coarse[data["y_pre"]], hp, config["warmup"], progress)
        err_pre, _ = _err_loss(predict(model, data["x_pre"]), coarse[data["y_pre"]])
        err_te, _ = _err_loss(predict(model, data["x_test"]), coarse[data["y_test"]])
        return dict(info, coarse_train_error=err_pre, coarse_test_error=err_te,
                    n_images=int(data["x_pre"].shape[0]), classes=int(coarse.max()) + 1)

    model, info = trained_model(
        f"{NAME}-pretrain", 0, h, ckpt_dir, hp=hp,
        build=lambda: build_model(config, hp["seed"], classes=int(coarse.max()) + 1),
        train=train_pre, restore=restore_exact, stored_state=lambda m: m.state_dict())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = (state, dict(info["train"], hash=h, checkpoint=info["checkpoint"],
                       train_time_s=info["train_time_s"]))
    _PRETRAINED[key] = out
    return out


def finetune_start(config: Dict[str, Any], data, ckpt_dir: str, progress: bool = False):
    """The common starting point of every fine-tune: the pretrained trunk with a fresh 10-way head
    initialised from ``pretrain.seed + 1`` (identical for all models)."""
    state, info = pretrained(config, data, ckpt_dir, progress)
    model = build_model(config, int(config["pretrain"]["seed"]) + 1, classes=10)
    if config["pretrain"]["labels"] == "fine":  # same task: every weight, head included
        model.load_state_dict(state, strict=True)
        return model, info
    trunk = {k: v for k, v in state.items() if not k.startswith("head.")}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    if unexpected or any(not k.startswith("head.") for k in missing):
        raise ExperimentError(f"pretrained checkpoint {info['checkpoint']} does not fit the "
                              f"architecture (unexpected {unexpected}, missing {missing}); "
                              f"delete it to pretrain again")
    with torch.no_grad():  # the new head (same draw for every model)
        g = torch.Generator().manual_seed(int(config["pretrain"]["seed"]) + 1)
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=g) * 0.02)
        model.head.bias.zero_()
    return model, info


# ------------------------------------------------------------------------------------ population
def train_hash(config: Dict[str, Any], hp: Dict[str, Any]) -> str:
    """The training hash of the model with hyperparameters ``hp`` (its checkpoint's name); a
    fine-tune's includes its pretrained ViT's."""
    extra = {"pretrained": pretrain_hash(config)} if config.get("protocol") == "finetune" else {}
    return keys_hash(NAME, config, ("data", "split_seed", "pool_size", "arch", "warmup"), **extra, hp=hp)


def get_model(model_id: int, config, data, ckpt_dir: str, progress: bool):
    """Trained model i: loaded from its checkpoint if present (same training hash), else trained
    (scratch) or fine-tuned from the pretrained ViT (finetune) and checkpointed.
    Returns (model, hp, info)."""
    finetune = config.get("protocol") == "finetune"

    def build(hp):
        if finetune:
            return finetune_start(config, data, ckpt_dir, progress)[0]
        return build_model(config, hp["seed"])

    def train_(model, hp):
        info = train(model, config, data, hp, progress)
        if finetune:
            pre = pretrained(config, data, ckpt_dir)[1]
            info["pretrained"] = {k: pre[k] for k in ("hash", "coarse_train_error",
                                                      "coarse_test_error", "n_images")}
        return info

    return population_member(sys.modules[__name__], model_id, config, ckpt_dir, build=build, train=train_)


def exclusions(records: List[Dict[str, Any]]) -> Dict[int, str]:
    """Fine-tune protocol: models whose own-subset train error exceeds ``train_error_target`` are
    left out of every τ and listed in the summary with their error."""
    out: Dict[int, str] = {}
    for r in records:
        target = r.get("study_config", {}).get("train_error_target")
        err = r.get("metrics", {}).get("own_train_error", float("nan"))
        if target is not None and not err <= target:
            out[r["model_id"]] = (f"own-subset train error {err:.4f} > target {target:g} "
                                  f"(subset {r['hparams']['subset']}, "
                                  f"{r['hparams']['epochs']} epochs, lr {r['hparams']['lr']:.2g}, "
                                  f"augment {r['hparams']['augment']})")
    return out


def report_notes(config: Dict[str, Any]) -> List[str]:
    """The protocol in a few lines, from the configuration alone."""
    if config.get("protocol") != "finetune":
        return []
    c, p = config, config["pretrain"]
    pts = c.get("points") or {}
    return [
        f"Pretraining: one ViT ({c['arch']}) on {p['size']} Fashion-MNIST training images "
        f"disjoint from the {c['pool_size']}-image pool, "
        + ("the 10 classes" if p["labels"] == "fine" else
           "5 coarse classes (COARSE in experiments/vision.py)")
        + f", {p['epochs']} epochs, lr {p['lr']:g}, batch {p['batch_size']}"
        + (", augmentation" if p["augment"] else ", no augmentation")
        + "; cached as a checkpoint.",
        "Fine-tunes: every weight, all from the same start ("
        + ("the pretrained model, head included" if p["labels"] == "fine" else
           "pretrained trunk, one new 10-way head draw") + "); lr log-uniform "
        f"{c['lr_range']}, weight decay log-uniform {c['wd_range']}, epochs {c['epochs_range']} "
        f"(subset × epochs ≤ {c['max_samples_seen']}), subset log-uniform {c['subset_range']}, "
        f"label smoothing from {c['smoothing_choices']}, augmentation from "
        f"{c['augment_choices']}, batch "
        f"{c['batch_choices']}; target own-subset train error ≤ {c['train_error_target']:g} "
        "(models that miss it are excluded and listed).",
        f"Points: main measures on {c['sharp_points']} fixed training images (in every subset) in "
        f"batches of {c['sharp_batch']}; " + ", ".join(f"{k} on the first {v}"
                                                       for k, v in pts.items())
        + f"; {c['n_iters']} Auto-PGD iterations; curvature: Hutch++ with "
        f"{(c.get('hessian') or {}).get('trace_matvecs')} products, Lanczos tolerance "
        f"{(c.get('hessian') or {}).get('lanczos_tol')}.",
    ]


#: ``job``: one model of the population (run in a worker process): train or reuse, evaluate,
#: measure; ``calibration_job``: one pilot model of the ρ calibration
job, calibration_job = population_jobs(load_data, get_model, evaluate, sharpness_batches)


# ------------------------------------------------------------------------------------ CLI
def add_arguments(p) -> None:
    """The study's options (``quotient-manifolds vision --help``)."""
    g = population_arguments(p, NAME)
    g.add_argument("--protocol", choices=PROTOCOLS, default="finetune",
                   help="fine-tunes of one ViT, or from scratch")
    # the configuration of a real run of the default protocol, and of --quick
    full, quick = finetune_defaults(False, False), finetune_defaults(True, False)
    g.add_argument("--pool-size", type=positive_int, default=None,
                   help=f"training pool {default_text(full['pool_size'])}")
    for key, what in (("width", "ViT width"), ("depth", "ViT blocks"), ("heads", "heads per block")):
        g.add_argument(f"--{key}", type=positive_int, default=None,
                       help=f"{what} {default_text(full['arch'][key], quick['arch'][key])}")
    calibration_arguments(g, "finetune")


def pretrain(config: Dict[str, Any], ckpt: str, threads: int, data_dir: Optional[str], progress: bool,
             log: Callable[[str], None] = log_line) -> None:
    """The one pretrained ViT every vision fine-tune starts from (:func:`pretrained`), reused
    with every core, or trained at the fixed threads of
    :func:`~quotient_manifolds.experiments.provenance.reproducible_training` (bit-reproducible);
    ``threads`` are restored after it."""
    data = load_data(config, data_dir)
    torch.set_num_threads(max(threads, cores()))  # nothing else runs while pretraining
    try:
        _, info = pretrained(config, data, ckpt, progress)
    finally:
        torch.set_num_threads(threads)
    log(f"pretrained ViT: {info['checkpoint']} (pretraining-task error "
        f"{info['coarse_train_error']:.4f} train, {info['coarse_test_error']:.4f} test; "
        + ("reused)" if info["train_time_s"] == 0 else
           f"trained in {fmt_seconds(info['train_time_s'])})"))


def require_data(config: Dict[str, Any], data_dir: Optional[str]) -> None:
    """Fail early, with the command that prepares it, when Fashion-MNIST is missing."""
    find_fashion_mnist(data_dir)


def run(args, log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds vision``: the population and its report; with --protocol finetune, the
    pretrained ViT and the ρ calibration on the pilot models first."""
    me = sys.modules[__name__]
    config = transformer_config(me, args)

    def before(config, ckpt, threads):
        pretrain(config, ckpt, threads, args.data_dir, not args.no_progress, log)

    return run_transformer_population(me, config, args, calibrated=config.get("protocol") == "finetune",
                                      out_name="vision-finetune", before=before, log=log)
