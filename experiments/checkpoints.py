"""The studies' checkpoints: safetensors files of a population's trained models, written
atomically, keyed by the training hash, restored when they fit and trained again (with a warning)
when damaged."""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Any, Callable, Dict, Optional

from .provenance import reproducible_training, weights_hash
from .runner import atomic_write_bytes, canonical_json, display_path

def save_checkpoint(path: str, tensors: Dict[str, Any], metadata: Dict[str, Any]) -> None:
    """Atomically write a safetensors state dict with JSON-encoded metadata."""
    from safetensors.torch import save  # the [experiments] extra: lazily, see progress_bar

    blob = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                metadata={"qm": canonical_json(metadata)})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_bytes(path, blob)


def load_checkpoint(path: str, expect_hash: Optional[str] = None):
    """``(state_dict, metadata)`` or ``None`` if missing, unreadable or for another training hash."""
    if not os.path.exists(path):
        return None
    from safetensors import SafetensorError, safe_open  # lazily: see save_checkpoint

    try:
        with safe_open(path, framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("qm", "{}"))
            if expect_hash is not None and meta.get("train_hash") != expect_hash:
                return None
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    # a damaged checkpoint (truncated or overwritten: safetensors' header or data, the JSON of its
    # metadata, the file itself) is trained again, and says so
    except (SafetensorError, ValueError, OSError) as err:
        warnings.warn(f"{display_path(path)}: the checkpoint cannot be read ({type(err).__name__}: "
                      f"{err}); the model is trained again", RuntimeWarning, stacklevel=2)
        return None
    return tensors, meta


def trained_model(study: str, model_id: int, train_hash: str, ckpt_dir: str, *,
                  build: Callable[[], Any], train: Callable[[Any], Dict[str, Any]],
                  restore: Callable[[Any, Dict[str, Any]], bool],
                  stored_state: Callable[[Any], Dict[str, Any]], hp: Dict[str, Any]):
    """Model ``model_id`` of a population: restored from its checkpoint when one with the same
    training hash exists and ``restore(model, tensors)`` accepts it, else built, trained under
    :func:`~quotient_manifolds.experiments.provenance.reproducible_training` (fixed threads,
    deterministic algorithms: the same weights bit for bit on a rerun) and checkpointed
    (``stored_state(model)``). Returns ``(model, info)``; ``info["weights_sha256"]`` is the
    :func:`~quotient_manifolds.experiments.provenance.weights_hash` of ``stored_state(model)``."""
    path = os.path.join(ckpt_dir, f"{study}-{model_id:04d}-{train_hash[:12]}.safetensors")
    model = build()
    loaded = load_checkpoint(path, train_hash)
    if loaded is not None and restore(model, loaded[0]):
        model.eval()
        return model, dict(checkpoint=display_path(path), reused=True,
                           train=loaded[1].get("train", {}), train_time_s=0.0,
                           weights_sha256=weights_hash(stored_state(model)))
    started = time.perf_counter()
    with reproducible_training() as how:
        info = dict(train(model), reproducible=how)
    elapsed = time.perf_counter() - started
    state = stored_state(model)
    save_checkpoint(path, state, {"train_hash": train_hash, "hp": hp, "train": info,
                                  "study": study, "model_id": model_id})
    return model, dict(checkpoint=display_path(path), reused=False, train=info,
                       train_time_s=elapsed, weights_sha256=weights_hash(state))


def restore_exact(model, tensors: Dict[str, Any]) -> bool:
    """``restore`` of :func:`trained_model` for a checkpoint of every tensor of the model: loads
    ``tensors`` strictly; False (retrain) when they do not fit the model."""
    try:
        model.load_state_dict(tensors, strict=True)
        return True
    except RuntimeError:
        return False
