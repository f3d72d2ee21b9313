r"""Vision population: small ViTs (:mod:`experiments.vit`) trained from scratch on Fashion-MNIST.

Protocol (a scaled-down analogue of the paper's ImageNet/CLIP experiment, docs/maths.md
§11.3):

* data: Fashion-MNIST; one fixed seeded order of the 60k training images, of which the first
  ``pool_size`` (20k) form the training pool; model subsets are prefixes of it (nested); test on
  the first ``test_size`` images of the official test set (default all 10k);
* population: model i draws from ``default_rng([seed, i])``: lr log-uniform [3e-4, 3e-3], weight
  decay log-uniform [1e-3, 0.3], batch 64/128/256, epochs 5–40, subset log-uniform 2k–20k (then
  epochs capped so that subset × epochs ≤ ``max_samples_seen`` = 300k), label smoothing 0 or 0.1,
  augmentation on/off (random ±2 px translation + horizontal flip);
* training: AdamW, cosine schedule with 5 % warm-up, grad-norm clip 1;
* metrics: errors on the whole pool (train error), on the model's own subset and on the test set;
  gap = test error − pool error, gap_own = test error − own-subset error. The report correlates
  with ``gap_own`` by default (``--target``): most of the 20k pool is unseen by a model trained on
  2k–20k images, so the pool error is nearly a test error (a memorising 2k-image model: gap_own
  0.22, gap 0.03);
* sharpness: on the first ``sharp_points`` pool images (in every subset) in batches of
  ``sharp_batch``, eval mode, no augmentation.

``--synthetic`` uses SYNTHETIC images (:func:`experiments.data.synthetic_images`); tests only.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import numpy as np

from . import measures as M
from .runner import TrainingLoop, check_parent_alive, config_hash, trained_model

NAME = "vision"
PAPER_KEY = "vision"
MEAN, STD = 0.2860, 0.3530


def defaults(quick: bool, synthetic: bool) -> Dict[str, Any]:
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
        c.update(pool_size=400, test_size=200, arch=dict(width=32, depth=2, heads=2, patch=7,
                                                         mlp_ratio=2.0),
                 epochs_range=[1, 2], subset_range=[200, 400], batch_choices=[64, 128],
                 max_samples_seen=800, sharp_points=64, sharp_batch=32, n_iters=3,
                 rho_sweep=[2.0], models=4)
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
                augment=bool(rng.choice(config["augment_choices"])))


_CACHE: Dict[str, Any] = {}


def load_data(config: Dict[str, Any], data_dir: Optional[str]) -> Dict[str, Any]:
    key = repr((config["data"], config["split_seed"], config["pool_size"], config["test_size"],
                data_dir))
    if key in _CACHE:
        return _CACHE[key]
    import torch

    from .data import load_fashion_mnist, nested_split, synthetic_images

    if config["data"] == "synthetic":
        xtr, ytr = synthetic_images(config["pool_size"], seed=config["split_seed"])
        xte, yte = synthetic_images(config["test_size"], seed=config["split_seed"] + 1)
    else:
        xtr, ytr, xte, yte = load_fashion_mnist(data_dir)
        pool, _ = nested_split(len(xtr), config["pool_size"], 0, config["split_seed"])
        xtr, ytr = xtr[pool], ytr[pool]
        xte, yte = xte[: config["test_size"]], yte[: config["test_size"]]

    def norm(x):
        return ((torch.tensor(x, dtype=torch.float32) / 255.0 - MEAN) / STD).unsqueeze(1)

    out = dict(x=norm(xtr), y=torch.tensor(ytr), x_test=norm(xte), y_test=torch.tensor(yte))
    _CACHE[key] = out
    return out


def build_model(config: Dict[str, Any], seed: int):
    import torch

    from .vit import ViT, ViTConfig
    torch.manual_seed(seed)
    return ViT(ViTConfig(**config["arch"]))


def augment(x, gen):
    """Random ±2 px translation (zero padding) and horizontal flip, per image."""
    import torch
    B = x.shape[0]
    pad = torch.nn.functional.pad(x, (2, 2, 2, 2), value=float(-MEAN / STD))
    dx = torch.randint(0, 5, (B,), generator=gen)
    dy = torch.randint(0, 5, (B,), generator=gen)
    rows = (dy[:, None] + torch.arange(28)[None, :])  # (B, 28)
    cols = (dx[:, None] + torch.arange(28)[None, :])
    out = pad[:, 0][torch.arange(B)[:, None, None], rows[:, :, None], cols[:, None, :]].unsqueeze(1)
    flip = torch.rand(B, generator=gen) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def train(model, config, data, hp, progress: bool = False) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F

    n = hp["subset"]
    x, y = data["x"][:n], data["y"][:n]
    gen = torch.Generator().manual_seed(hp["seed"])
    torch.manual_seed(hp["seed"])
    decay = [p for nme, p in model.named_parameters() if p.dim() >= 2 and "embed" not in nme]
    rest = [p for nme, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in nme)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=hp["lr"])
    bs = hp["batch_size"]
    loop = TrainingLoop(opt, list(model.parameters()), steps_per_epoch=math.ceil(n / bs),
                        epochs=hp["epochs"], warmup=config["warmup"], decay="cosine",
                        progress=progress)
    model.train()
    for _ in range(hp["epochs"]):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, bs):
            check_parent_alive()
            b = perm[s:s + bs]
            xb = augment(x[b], gen) if hp["augment"] else x[b]
            loop.step(F.cross_entropy(model(xb), y[b], label_smoothing=hp["label_smoothing"]))
    return loop.finish(model)


def predict(model, x, batch: int = 1000):
    import torch
    model.eval()
    with torch.no_grad():
        return torch.cat([model(x[s:s + batch]).double() for s in range(0, x.shape[0], batch)])


def _err_loss(logits, y):
    from .stats import error_and_loss
    return error_and_loss(logits.cpu().numpy(), y.cpu().numpy())


def evaluate(model, config, data, hp) -> Dict[str, float]:
    """Errors/losses on the pool, on the model's own subset (a prefix of the pool: same forward
    pass) and on the test set."""
    from .stats import generalization_gap
    logits = predict(model, data["x"])
    tr_err, tr_loss = _err_loss(logits, data["y"])
    n = hp["subset"]
    own_err, own_loss = _err_loss(logits[:n], data["y"][:n])
    te_err, te_loss = _err_loss(predict(model, data["x_test"]), data["y_test"])
    return dict(train_error=tr_err, train_loss=tr_loss, test_error=te_err, test_loss=te_loss,
                own_train_error=own_err, own_train_loss=own_loss,
                gap=generalization_gap(te_err, tr_err), gap_own=generalization_gap(te_err, own_err))


def sharpness_batches(config, data):
    n, b = config["sharp_points"], config["sharp_batch"]
    return [(data["x"][s:min(s + b, n)], data["y"][s:min(s + b, n)]) for s in range(0, n, b)]


def train_hash(config: Dict[str, Any], hp: Dict[str, Any]) -> str:
    keys = ("data", "split_seed", "pool_size", "arch", "warmup")
    return config_hash({"study": NAME, **{k: config[k] for k in keys}, "hp": hp})


def get_model(model_id: int, config, data, ckpt_dir: str, progress: bool):
    """Trained model i: loaded from its checkpoint if present (same training hash), else trained
    and checkpointed. Returns (model, hp, info)."""
    hp = hparams(config, model_id)

    def restore(model, tensors) -> bool:
        try:
            model.load_state_dict(tensors, strict=True)
            return True
        except RuntimeError:
            return False  # inconsistent checkpoint: retrain

    model, info = trained_model(
        NAME, model_id, train_hash(config, hp), ckpt_dir, hp=hp,
        build=lambda: build_model(config, hp["seed"]),
        train=lambda model: train(model, config, data, hp, progress),
        restore=restore, stored_state=lambda model: model.state_dict())
    return model, hp, info


def job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
        progress: bool) -> Dict[str, Any]:
    """One model of the population (run in a worker process): train or reuse, evaluate, measure."""
    return M.population_job(model_id, config, ckpt_dir, data_dir, progress, load_data=load_data,
                            get_model=get_model, evaluate=evaluate,
                            sharpness_batches=sharpness_batches)
