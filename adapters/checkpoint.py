r"""Sharpness of a saved Hugging Face checkpoint on a local data file: the library side of
``quotient-manifolds sharpness CHECKPOINT_DIR`` (needs the ``hf`` extra).

:func:`checkpoint_sharpness` loads the model and tokenizer with ``from_pretrained`` from a local
directory (never from the hub), reads the first ``batches × batch_size`` rows of a JSONL or CSV file
(or of a ``datasets`` directory saved with ``save_to_disk``), tokenises them, and measures
worst-case sharpness in each geometry asked for (:class:`~quotient_manifolds.adapters.monitor.SharpnessMonitor`:
at a given ρ, or at the ρ calibrated to a target loss rise). Two kinds of model:

* sequence classification (``…ForSequenceClassification``): the loss is the model's own
  cross-entropy on the label column (integers ``0 … num_labels − 1``, or the names of the
  checkpoint's ``label2id``);
* causal language model (``…ForCausalLM``, ``…LMHeadModel``): the loss is the model's own
  next-token cross-entropy on the text (padding excluded).

Every error a user can make with the inputs (a directory without a model, an unknown column, an
empty file …) is a :class:`CheckpointError` whose message is one line saying what to do.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from typing_extensions import Unpack

from quotient_manifolds.errors import CheckpointError

from .monitor import DEFAULT_GEOMETRIES, SharpnessMonitor, metric_name
from .options import PerGeometryKwargs, document_options

__all__ = ["CheckpointSharpness", "checkpoint_sharpness", "load_checkpoint",
           "read_rows", "TASKS", "DTYPES"]

#: the kinds of model measured: sequence classification and causal language modelling
TASKS = ("sequence-classification", "causal-lm")
#: ``dtype=`` names and their torch dtypes (``None``: the checkpoint's own)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
#: the weight files of a saved model (``save_pretrained``), sharded or not
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


@dataclass
class CheckpointSharpness:
    """Result of :func:`checkpoint_sharpness`: what was measured, and per geometry its sharpness
    (``results[geometry]``: ``sharpness``, ``rho``, ``initial_loss``, ``per_batch``, ``seconds``,
    and ``calibration`` when ρ was calibrated).

    Attributes
    ----------
    checkpoint, task, data:
        The checkpoint directory, ``"sequence-classification"`` or ``"causal-lm"``, the data file.
    n_examples, batch_size, max_length, device, dtype:
        What was measured, and where.
    results:
        Per geometry, the measurement (above).


    Examples
    --------
    >>> from quotient_manifolds.adapters import CheckpointSharpness
    >>> res = CheckpointSharpness("runs/ckpt", "sequence-classification", "val.jsonl", n_examples=2,
    ...                           batch_size=2, max_length=128, device="cpu", dtype="float32",
    ...                           results={"adaptive": {"rho": 0.1, "sharpness": 0.0123,
    ...                                                 "initial_loss": 0.69, "seconds": 0.4}})
    >>> print(res.table())                              # doctest: +NORMALIZE_WHITESPACE
    runs/ckpt (sequence-classification, 2 examples of val.jsonl)
    geometry               rho     sharpness  initial loss   seconds
    adaptive               0.1        0.0123          0.69       0.4
    >>> res.as_dict()["results"]["adaptive"]["sharpness"]
    0.0123
    """

    checkpoint: str
    task: str
    data: str
    n_examples: int
    batch_size: int
    max_length: int
    device: str
    dtype: str
    results: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable dict of everything."""
        return asdict(self)

    def table(self) -> str:
        """A one-screen table: one line per geometry."""
        head = f"{'geometry':<14}{'rho':>12}{'sharpness':>14}{'initial loss':>14}{'seconds':>10}"
        lines = [f"{self.checkpoint} ({self.task}, {self.n_examples} examples of {self.data})", head]
        for geometry, r in self.results.items():
            calibrated = " (calibrated)" if r.get("calibration") else ""
            lines.append(f"{geometry:<14}{r['rho']:>12.4g}{r['sharpness']:>14.5g}{r['initial_loss']:>14.4g}"
                         f"{r['seconds']:>10.1f}{calibrated}")
        return "\n".join(lines)


def _task_of(config: Any, task: Optional[str]) -> str:
    if task is not None:
        if task not in TASKS:
            raise CheckpointError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
        return task
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch.endswith("ForSequenceClassification"):
            return "sequence-classification"
        if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
            return "causal-lm"
    raise CheckpointError(f"cannot tell the task from the checkpoint's architectures {architectures}: "
                          f"pass task= (--task) {' or '.join(TASKS)}")


def load_checkpoint(path: str, *, task: Optional[str] = None, tokenizer: Optional[str] = None,
                    device: str = "cpu", dtype: Optional[str] = None) -> Tuple[torch.nn.Module, Any, str]:
    """(model in eval mode on ``device``, tokenizer, task) of the checkpoint directory ``path``
    (``save_pretrained``), loaded locally; the tokenizer from ``tokenizer`` (a directory) if given,
    else from ``path``. Raises :class:`CheckpointError` for a directory without a model or
    tokenizer, an unknown task or dtype."""
    import transformers

    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory: give a checkpoint directory written by "
                              f"model.save_pretrained(DIR) (or a Trainer's checkpoint-N)")
    if not os.path.isfile(os.path.join(path, "config.json")) or not any(
            os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        raise CheckpointError(f"no Hugging Face model in {path}: expected config.json and "
                              f"model.safetensors (or pytorch_model.bin), as model.save_pretrained(DIR) "
                              f"writes them")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise CheckpointError(f"unknown device {device!r}: e.g. cpu, cuda, cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"device {device} asked for, but torch sees no CUDA device here: use "
                              f"--device cpu, or install the CUDA build of torch")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    task = _task_of(config, task)
    auto = (transformers.AutoModelForSequenceClassification if task == "sequence-classification"
            else transformers.AutoModelForCausalLM)
    kwargs = {"dtype": DTYPES[dtype]} if dtype is not None else {}
    model = auto.from_pretrained(path, local_files_only=True, **kwargs).to(device).eval()
    source = tokenizer or path
    try:
        tok = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"no tokenizer in {source} ({type(err).__name__}): save it beside the "
                              f"model with tokenizer.save_pretrained(DIR), or pass tokenizer= "
                              f"(--tokenizer DIR)") from None
    if tok.pad_token is None:              # causal LMs often have none: pad with EOS (masked out)
        if tok.eos_token is None:
            raise CheckpointError(f"the tokenizer in {source} has neither a pad nor an eos token: "
                                  f"set tokenizer.pad_token and save it again")
        tok.pad_token = tok.eos_token
    return model, tok, task


def read_rows(data: str, columns: Sequence[str], *, limit: Optional[int] = None,
              split: Optional[str] = None) -> Dict[str, List[Any]]:
    """The ``columns`` of the first ``limit`` rows of ``data``: a JSON Lines file (``.jsonl``, one
    object per line), a CSV file with a header (``.csv``), or a directory written by a ``datasets``
    ``save_to_disk`` (a ``DatasetDict``'s ``split``, default the first of validation / test /
    train). Raises :class:`CheckpointError` for a missing or empty file, an unknown column (naming
    those there are) or an unknown format."""
    if os.path.isdir(data):
        return _read_saved_dataset(data, columns, limit, split)
    if not os.path.isfile(data):
        raise CheckpointError(f"data file {data} does not exist: give a .jsonl or .csv file, or a "
                              f"datasets directory written by save_to_disk")
    rows: List[Mapping[str, Any]] = []
    if data.endswith((".jsonl", ".json")):
        with open(data, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise CheckpointError(f"{data}, line {number}: not JSON ({err.msg}): a JSON "
                                              f"Lines file holds one object per line") from None
                if limit is not None and len(rows) >= limit:
                    break
    elif data.endswith(".csv"):
        with open(data, encoding="utf-8", newline="") as fh:
            for row in csv.DictReader(fh):
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
    else:
        raise CheckpointError(f"{data}: unknown data format: give a .jsonl or .csv file, or a "
                              f"datasets directory written by save_to_disk")
    if not rows:
        raise CheckpointError(f"{data} is empty: it needs at least one row with a text column")
    if not all(isinstance(r, Mapping) for r in rows):
        raise CheckpointError(f"{data}: every line must be a JSON object such as "
                              f'{{"text": "...", "label": 0}}')
    known = list(rows[0])
    for column in columns:
        missing = [i for i, r in enumerate(rows) if column not in r]
        if missing:
            raise CheckpointError(f"{data} has no column {column!r} (row {missing[0] + 1}; its "
                                  f"columns: {', '.join(known)}): choose one with --text-column / "
                                  f"--label-column")
    return {c: [r[c] for r in rows] for c in columns}


def _read_saved_dataset(data: str, columns: Sequence[str], limit: Optional[int],
                        split: Optional[str]) -> Dict[str, List[Any]]:
    try:
        import datasets
    except ImportError:
        raise CheckpointError(f"{data} is a directory: reading a datasets save_to_disk directory "
                              f"needs the datasets package (pip install datasets); or export the "
                              f"rows to .jsonl") from None
    try:
        loaded = datasets.load_from_disk(data)
    except FileNotFoundError:
        raise CheckpointError(f"{data} is not a datasets directory written by save_to_disk (and "
                              f"a data file is a .jsonl or .csv file)") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        chosen = split or next((s for s in ("validation", "test", "train") if s in loaded), names[0])
        if chosen not in loaded:
            raise CheckpointError(f"{data} has no split {chosen!r}: its splits are {', '.join(names)}")
        loaded = loaded[chosen]
    if len(loaded) == 0:
        raise CheckpointError(f"{data} is empty: it needs at least one row with a text column")
    for column in columns:
        if column not in loaded.column_names:
            raise CheckpointError(f"{data} has no column {column!r} (its columns: "
                                  f"{', '.join(loaded.column_names)}): choose one with --text-column "
                                  f"/ --label-column")
    rows = loaded.select(range(min(len(loaded), limit or len(loaded))))
    return {c: list(rows[c]) for c in columns}


def _labels(values: List[Any], config: Any, data: str, column: str) -> torch.Tensor:
    """Class indices from integers (or integer strings, as CSV holds them) or label names."""
    label2id = {str(k): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
    n = int(getattr(config, "num_labels", 0) or 0)
    out = []
    for i, v in enumerate(values):
        if isinstance(v, str) and v in label2id:
            out.append(label2id[v])
            continue
        try:
            index = int(v)
        except (TypeError, ValueError):
            index = None
        if index is None or (isinstance(v, float) and v != index):
            raise CheckpointError(f"{data}, row {i + 1}: label {v!r} in column {column!r} is neither "
                                  f"a class index nor a name of the checkpoint's label2id "
                                  f"({', '.join(label2id) or 'none'})")
        if not 0 <= index < n:
            raise CheckpointError(f"{data}, row {i + 1}: label {index} is outside the checkpoint's "
                                  f"{n} classes (0 … {n - 1})")
        out.append(index)
    return torch.tensor(out, dtype=torch.long)


def _batches(texts: List[Any], labels: Optional[torch.Tensor], tokenizer: Any, *, task: str,
             batch_size: int, max_length: int) -> List[Dict[str, torch.Tensor]]:
    batches = []
    for start in range(0, len(texts), batch_size):
        chunk = [str(t) for t in texts[start:start + batch_size]]
        enc = tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        batch = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        if task == "sequence-classification":
            batch["labels"] = labels[start:start + batch_size]
        else:   # the model's own shifted next-token loss; padding does not count
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        batches.append(batch)
    return batches


@document_options
def checkpoint_sharpness(checkpoint: str, data: str, *, geometries: Sequence[str] = DEFAULT_GEOMETRIES,
                         rho: Optional[float] = None, target_loss_rise: Optional[float] = None,
                         text_column: str = "text", label_column: Optional[str] = "label",
                         batches: int = 4, batch_size: int = 16, max_length: int = 128,
                         task: Optional[str] = None, tokenizer: Optional[str] = None,
                         split: Optional[str] = None, device: str = "cpu", dtype: Optional[str] = None,
                         log: Optional[Callable[[str], None]] = None,
                         **sharpness_options: Unpack[PerGeometryKwargs]) -> CheckpointSharpness:
    r"""Worst-case sharpness of the saved Hugging Face model in ``checkpoint`` on the first
    ``batches × batch_size`` rows of ``data`` (module docstring).

    Parameters
    ----------
    checkpoint: a directory written by ``save_pretrained`` (model and tokenizer), read locally.
    data: a ``.jsonl`` or ``.csv`` file, or a ``datasets`` ``save_to_disk`` directory.
    geometries: the geometries measured (default ``("geodesic-inv", "adaptive")``).
    rho, target_loss_rise: exactly one: the radius, or the loss rise (nats) ρ is calibrated to
        per geometry (:func:`~quotient_manifolds.adapters.calibrate_rho`).
    text_column: the column of the texts (default ``"text"``).
    label_column: the column of the labels (sequence classification; default ``"label"``); not
        read for a causal LM.
    batches, batch_size, max_length: how many batches of how many rows, truncated to how many tokens.
    task: ``"sequence-classification"`` or ``"causal-lm"`` (default: from the checkpoint's
        ``architectures``).
    tokenizer: a directory to load the tokenizer from (default: ``checkpoint``).
    split: the split of a ``DatasetDict`` directory.
    device, dtype: where to load the model and in which dtype (``"float32"``, ``"float64"``,
        ``"bfloat16"``, ``"float16"``; default the checkpoint's). Half precision is measured in
        float32 (:func:`~quotient_manifolds.adapters.sharpness`).
    log: called with a line of text at each stage (e.g. ``print``).
    sharpness_options: options of :func:`~quotient_manifolds.adapters.sharpness` (``n_iters``,
        ``progress`` …).

    Returns
    -------
    CheckpointSharpness
        What was measured and the results per geometry (``.as_dict()`` for JSON, ``.table()`` to
        print).

    Raises
    ------
    CheckpointError: a directory without a model or tokenizer, a missing, empty or unreadable
        data file, an unknown column, label, task or dtype.

    Examples
    --------
    A tiny BERT classifier and a word-level tokenizer saved from configs, measured on two rows:

    >>> import os, tempfile, tokenizers, torch, transformers
    >>> from quotient_manifolds import adapters
    >>> root = tempfile.mkdtemp()
    >>> vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "a", "good", "bad", "film"])}
    >>> tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    >>> tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    >>> _ = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
    ...                                          pad_token="[PAD]").save_pretrained(root)
    >>> _ = torch.manual_seed(0)
    >>> config = transformers.BertConfig(vocab_size=6, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
    ...                                  intermediate_size=8, max_position_embeddings=8, num_labels=2)
    >>> transformers.BertForSequenceClassification(config).double().save_pretrained(root)
    >>> with open(os.path.join(root, "val.jsonl"), "w") as f:
    ...     _ = f.write('{"text": "a good film", "label": 1}\n{"text": "a bad film", "label": 0}\n')
    >>> res = adapters.checkpoint_sharpness(root, os.path.join(root, "val.jsonl"), rho=0.1, batches=1,
    ...                                     batch_size=2, n_iters=3)
    >>> res.task, res.n_examples, sorted(res.results)
    ('sequence-classification', 2, ['adaptive', 'geodesic-inv'])
    >>> import shutil; shutil.rmtree(root)
    """
    for name, value in (("batches", batches), ("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{name} must be an integer >= 1, got {value!r}")
    # the geometries, radius and options refused before the model is loaded (the batch is a stand-in)
    SharpnessMonitor([{}], geometries=geometries, rho=rho, target_loss_rise=target_loss_rise, **sharpness_options)
    say = log or (lambda line: None)
    model, tok, task = load_checkpoint(checkpoint, task=task, tokenizer=tokenizer, device=device, dtype=dtype)
    say(f"loaded {type(model).__name__} ({task}) from {checkpoint}")
    columns = [text_column] + ([label_column] if task == "sequence-classification" else [])
    if task == "sequence-classification" and not label_column:
        raise CheckpointError("a sequence classifier is measured on labelled rows: give label_column "
                              "(--label-column)")
    rows = read_rows(data, columns, limit=batches * batch_size, split=split)
    texts = rows[text_column]
    labels = (_labels(rows[label_column], model.config, data, label_column)
              if task == "sequence-classification" else None)
    held = _batches(texts, labels, tok, task=task, batch_size=batch_size, max_length=max_length)
    say(f"{len(texts)} examples of {data} in {len(held)} batch(es) of up to {batch_size}")
    monitor = SharpnessMonitor(held, geometries=geometries, rho=rho, target_loss_rise=target_loss_rise,
                               **sharpness_options)
    metrics = monitor.measure(model)
    out = CheckpointSharpness(checkpoint=checkpoint, task=task, data=data, n_examples=len(texts),
                              batch_size=batch_size, max_length=max_length, device=str(device),
                              dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    for geometry, result in monitor.last_results.items():
        cal = monitor.calibrations.get(geometry)
        out.results[geometry] = dict(
            sharpness=metrics[metric_name(geometry)], rho=metrics[metric_name(geometry, "rho")],
            initial_loss=metrics[metric_name(geometry, "initial_loss")],
            seconds=metrics[metric_name(geometry, "seconds")], per_batch=list(result.per_batch),
            calibration=None if cal is None else dict(target_loss_rise=cal.target_loss_rise,
                                                      converged=cal.converged, evals=cal.evals))
    return out
