"""What a sharpness run holds in memory, and the error that says so when it does not fit.

Beyond the model's own weights and the activations of one forward+backward of a batch (in
float32 for a half-precision model), a run holds three float32 vectors of the perturbed
weights: the iterate ξ, the worst point and the gradient (over which the next iterate is
written), and the last step ξ − ξ⁻ in bfloat16 (:data:`BYTES_PER_PARAMETER`); one more float32
vector for the worst point's gradient where memory allows
(:func:`~quotient_manifolds.adapters.solver.auto_pgd`); and for the GL(h) attention blocks
their heads, points and exact last step. The weights themselves are never copied: the model
reads each perturbed weight when it needs it (:mod:`~quotient_manifolds.adapters.streaming`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BYTES_PER_PARAMETER", "SharpnessOutOfMemoryError", "explained_out_of_memory"]

#: bytes per perturbed float32 weight held by the solver: ξ, the worst point and the gradient in
#: float32, the last step ξ − ξ⁻ in bfloat16
BYTES_PER_PARAMETER = 14


class SharpnessOutOfMemoryError(MemoryError):
    """A sharpness run did not fit in the memory of its device; the message says how much the run
    needs and what to do. The model is left as it was."""


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text
                                              or "not enough memory" in text)


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


class explained_out_of_memory:  # noqa: N801 - a context manager named like torch.no_grad
    """``with explained_out_of_memory(model, what):`` turns an allocator's out-of-memory error
    inside the block into a :class:`SharpnessOutOfMemoryError` that gives the run's needs (bytes
    per parameter × trainable parameters, beside the model's own size and the device's free
    memory) and what to do; the allocator's trace is dropped (its first line is quoted)."""

    def __init__(self, model: nn.Module, what: str):
        self.model, self.what = model, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, trace) -> bool:
        if err is None or not isinstance(err, Exception) or not _is_out_of_memory(err):
            return False
        params = list(self.model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        weights = sum(p.numel() * p.element_size() for p in params)
        device = params[0].device if params else torch.device("cpu")
        free = ""
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free_bytes, total = torch.cuda.mem_get_info(device)
            free = f"; {_gib(free_bytes)} of {_gib(total)} free on {device} now"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SharpnessOutOfMemoryError(
            f"{self.what} ran out of memory on {device} ({first[:160]}). Beyond the model's weights "
            f"({_gib(weights)}) and the activations of one forward+backward of a batch (float32), "
            f"it holds about {BYTES_PER_PARAMETER} bytes per trainable parameter × {trainable:,} = "
            f"{_gib(BYTES_PER_PARAMETER * trainable)}{free}. Use a smaller batch (fewer or shorter "
            f"sequences), keep weights out of the ball (requires_grad=False on those to hold "
            f"fixed), or shard the model over several devices with FSDP2 "
            f"(torch.distributed.fsdp.fully_shard; sharpness then holds 1/world of this per "
            f"device). The model is unchanged.") from None
