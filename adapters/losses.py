r"""Losses of a model's outputs: cross-entropy on the logits (:func:`default_loss`), the shifted
next-token cross-entropy of a causal language model (:func:`next_token_loss`), the logits in a
model's output (:func:`logits_of`) and their normalisation (:func:`normalize_logits`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

from . import validation as check

__all__ = ["HALF_DTYPES", "default_loss", "next_token_loss", "logits_of", "normalize_logits"]

Tensor = torch.Tensor

#: the half-precision floating dtypes (upcast to float32 before a loss or an evaluation)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def default_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Mean cross-entropy on ``outputs`` or on ``outputs.logits`` (Hugging Face outputs), for
    logits of shape (batch, classes) and integer targets of shape (batch,). Logits with more
    dimensions are refused, since cross-entropy would read their dim 1 (the tokens of
    (batch, tokens, classes) logits) as the classes: pass ``loss_fn`` (e.g. :func:`next_token_loss`)."""
    logits = logits_of(outputs)
    check.class_logits(logits, targets)
    check.class_targets(logits, targets)
    return F.cross_entropy(logits, targets)


def next_token_loss(outputs: Any, labels: Tensor) -> Tensor:
    r"""Shifted next-token cross-entropy of a causal language model (the loss Hugging Face causal
    LMs compute from ``labels``): position t predicts token t+1,

        L = (1/|V|) Σ_{(b,t) ∈ V} −log softmax(z[b, t])[y[b, t+1]],
        V = {(b, t) : y[b, t+1] ≠ −100},

    with logits z = ``outputs`` or ``outputs.logits`` of shape (B, T, vocab) and ``labels`` y of
    shape (B, T) (usually ``input_ids``, with −100 on padding). Half-precision logits are upcast.

    Parameters
    ----------
    outputs:
        Logits (B, T, vocab), or a model output with ``.logits``.
    labels:
        Token ids (B, T), −100 where a position is not predicted.

    Returns
    -------
    Tensor
        The mean loss, a 0-d tensor.

    Raises
    ------
    ValueError
        The shapes of logits and labels do not match, or a label is outside the vocabulary.
    TypeError
        ``outputs`` is neither a tensor nor has ``.logits``.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> logits = torch.zeros(1, 3, 5, dtype=torch.float64)      # uniform over 5 tokens
    >>> labels = torch.tensor([[1, 2, -100]])
    >>> round(float(adapters.next_token_loss(logits, labels)), 6)   # log 5, one predicted token
    1.609438
    """
    logits = logits_of(outputs)
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise InvalidArgument(f"next_token_loss needs logits of shape (batch, tokens, vocab) and labels "
                              f"of shape (batch, tokens); got logits {tuple(logits.shape)} and labels "
                              f"{tuple(labels.shape)}")
    check.class_targets(logits[:, :-1], labels[:, 1:], "next_token_loss")
    if logits.dtype in HALF_DTYPES:
        logits = logits.float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(logits.device),
                           ignore_index=-100)


def logits_of(outputs: Any) -> Tensor:
    """The logits in a model's output: the output itself when it is a tensor, ``outputs.logits``
    (Hugging Face outputs), or the one tensor of a tuple/list whose other items are not tensors
    (e.g. ``(logits, hidden_states_tuple)``). A tuple holding several tensors, e.g.
    ``(features, logits)``, is ambiguous and refused: pass ``loss_fn``."""
    if isinstance(outputs, Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, (tuple, list)):
        tensors = [i for i, item in enumerate(outputs) if isinstance(item, Tensor)]
        if len(tensors) == 1:
            return outputs[tensors[0]]
        if len(tensors) > 1:
            shapes = ", ".join(f"[{i}] {tuple(outputs[i].shape)}" for i in tensors)
            raise InvalidArgumentType(
                f"the model returns a {type(outputs).__name__} of {len(tensors)} tensors ({shapes}): "
                f"which one holds the logits is ambiguous, so the default cross-entropy is not "
                f"applied to any of them. Pass loss_fn=lambda outputs, targets: "
                f"torch.nn.functional.cross_entropy(outputs[i], targets) with the index i of the "
                f"logits (or return a tensor or an object with .logits)")
    raise InvalidArgumentType(f"cannot find logits in a model output of type {type(outputs).__name__}; pass "
                              f"loss_fn=callable(outputs, targets) -> scalar loss")


def normalize_logits(logits: Tensor) -> Tensor:
    """Andriushchenko et al.'s LogitNormalizationWrapper: centre, then divide by the L2 norm."""
    centred = logits - logits.mean(dim=-1, keepdim=True)
    return centred / centred.norm(dim=-1, keepdim=True).clamp_min(1e-10)
