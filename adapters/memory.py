"""What a sharpness run holds in memory, and the error that says so when it does not fit.

Beyond the model's own weights and the activations of one forward+backward of a batch (in
float32 for a half-precision model), a run holds three float32 vectors of the perturbed
weights: the iterate ξ, the worst point and the gradient (over which the next iterate is
written), and the last step ξ − ξ⁻ in bfloat16 (:data:`BYTES_PER_PARAMETER`); one more float32
vector for the worst point's gradient where the device's memory holds it after the first forward
and backward (:func:`room_for_two_more`, read by
:func:`~quotient_manifolds.adapters.solver.auto_pgd`); and for the GL(h) attention blocks
their heads, points and exact last step. The weights themselves are never copied: the model
reads each perturbed weight when it needs it (:mod:`~quotient_manifolds.adapters.streaming`).
The compact solver (``solver_dtype=torch.bfloat16``) keeps the elementwise weights' four vectors
in bfloat16 (:data:`COMPACT_BYTES_PER_PARAMETER`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Union

import torch
from torch import nn

from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, SharpnessOutOfMemoryError

__all__ = ["BYTES_PER_PARAMETER", "COMPACT_BYTES_PER_PARAMETER", "HEADROOM", "DeviceMemory",
           "device_memory", "explained_out_of_memory", "room_for_two_more"]

#: bytes per perturbed float32 weight held by the solver: ξ, the worst point and the gradient in
#: float32, the last step ξ − ξ⁻ in bfloat16
BYTES_PER_PARAMETER = 14
#: the same for the compact solver (``solver_dtype=torch.bfloat16``): the four vectors in bfloat16
COMPACT_BYTES_PER_PARAMETER = 8
#: the share of a device's memory that :func:`room_for_two_more` leaves free: room for what a
#: reading cannot see (the allocator's fragmentation, other processes on the device)
HEADROOM = 0.05


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory, in bytes.

    ``available``: what new allocations can take (CUDA: the driver's free memory plus what torch's
    caching allocator holds unused; the CPU: Linux's MemAvailable); ``total``: the device's
    memory; ``in_use``: what this process holds now (CUDA: torch's allocated tensors; the CPU: the
    resident set); ``peak``: the most it has held (CUDA: torch's peak allocation; the CPU: the
    peak resident set), so ``peak − in_use`` bounds from above what the process took beyond its
    present holdings at its highest."""

    available: int
    total: int
    in_use: int
    peak: int

    def __post_init__(self):
        for name in ("available", "total", "in_use", "peak"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"DeviceMemory.{name} must be a number of bytes (an int >= 0), "
                                      f"got {value!r}")


def _kib_fields(path: str) -> Dict[str, int]:
    """The ``Name: value kB`` lines of a /proc file, in bytes."""
    out = {}
    with open(path) as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[name] = int(fields[0]) * 1024
    return out


def device_memory(device: Union[str, torch.device]) -> Optional[DeviceMemory]:
    """The memory of ``device`` as this process sees it now (:class:`DeviceMemory`): for a CUDA
    device from torch's allocator and the driver, for the CPU from Linux's /proc; None where it
    cannot be read (another accelerator, another operating system)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        unused_cache = max(torch.cuda.memory_reserved(device) - allocated, 0)
        return DeviceMemory(available=int(free + unused_cache), total=int(total),
                            in_use=int(allocated), peak=int(torch.cuda.max_memory_allocated(device)))
    if device.type == "cpu":
        try:
            system, process = _kib_fields("/proc/meminfo"), _kib_fields("/proc/self/status")
            return DeviceMemory(available=system["MemAvailable"], total=system["MemTotal"],
                                in_use=process["VmRSS"], peak=process["VmHWM"])
        except (OSError, KeyError, ValueError):
            return None
    return None


def room_for_two_more(vector_bytes: int, now: Optional[DeviceMemory]) -> bool:
    """Whether a device whose memory reads ``now`` holds two more vectors of ``vector_bytes``
    bytes on top of what the process holds, while it still takes its highest transient:

        available ≥ 2 · vector_bytes + (peak − in_use) + HEADROOM · total.

    Read after a run's first forward and backward, ``peak − in_use`` is what that pass took beyond
    the buffers that stay (an upper bound where the process once held more). True where the
    memory cannot be read (``now`` None)."""
    if isinstance(vector_bytes, bool) or not isinstance(vector_bytes, int) or vector_bytes < 0:
        raise InvalidArgument(f"vector_bytes must be a number of bytes (an int >= 0), got {vector_bytes!r}")
    if now is not None and not isinstance(now, DeviceMemory):
        raise InvalidArgumentType(f"now must be a DeviceMemory reading (device_memory(device)) or None, got "
                                  f"{type(now).__name__}")
    if now is None:
        return True
    transient = max(now.peak - now.in_use, 0)
    return now.available >= 2 * vector_bytes + transient + HEADROOM * now.total


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text
                                              or "not enough memory" in text)


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


class explained_out_of_memory:  # noqa: N801 - a context manager named like torch.no_grad
    """``with explained_out_of_memory(model, what, solver_dtype):`` turns an allocator's
    out-of-memory error inside the block into a :class:`SharpnessOutOfMemoryError` that gives the
    run's needs (bytes per parameter × trainable parameters, beside the model's own size and the
    device's free memory) and what to do, the compact solver first where the run did not use it
    (``solver_dtype`` None), with what it would hold; the allocator's trace is dropped (its first
    line is quoted)."""

    def __init__(self, model: nn.Module, what: str, solver_dtype: Optional[torch.dtype] = None):
        self.model, self.what, self.solver_dtype = model, what, solver_dtype

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, trace) -> bool:
        if (err is None or not isinstance(err, Exception) or not _is_out_of_memory(err)
                or isinstance(err, SharpnessOutOfMemoryError)):   # explained already (a nested run)
            return False
        params = list(self.model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        weights = sum(p.numel() * p.element_size() for p in params)
        device = params[0].device if params else torch.device("cpu")
        free, total = "", None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free_bytes, total = torch.cuda.mem_get_info(device)
            free = f"; {_gib(free_bytes)} of {_gib(total)} free on {device} now"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SharpnessOutOfMemoryError(
            f"{self.what} ran out of memory on {device} ({first[:160]}). Beyond the model's weights "
            f"({_gib(weights)}) and the activations of one forward+backward of a batch (float32), "
            f"it holds about {BYTES_PER_PARAMETER} bytes per trainable parameter × {trainable:,} = "
            f"{_gib(BYTES_PER_PARAMETER * trainable)}{free}, and 4 bytes more where it keeps the "
            f"worst point's gradient (keep_worst_gradient=False never keeps it). "
            f"{_compact_advice(self.solver_dtype, weights, trainable, total)}Or use a smaller "
            f"batch (fewer or shorter sequences), keep weights out of the ball (requires_grad=False "
            f"on those to hold fixed), or shard the model over several devices with FSDP2 "
            f"(torch.distributed.fsdp.fully_shard; sharpness then holds 1/world of this per "
            f"device). The model is unchanged.") from None


def _compact_advice(solver_dtype: Optional[torch.dtype], weights: int, trainable: int,
                    total: Optional[int]) -> str:
    """The sentence of the out-of-memory error on the compact solver, with its arithmetic (and
    whether weights and solver then fit the device's ``total`` bytes, where known); nothing where
    the run already used it."""
    if solver_dtype is not None:
        return ""
    need = weights + COMPACT_BYTES_PER_PARAMETER * trainable
    fits = ("" if total is None else
            f", {'within' if need < total else 'more than'} the device's {_gib(total)}")
    return (f"The compact solver (solver_dtype=torch.bfloat16) holds "
            f"{COMPACT_BYTES_PER_PARAMETER} bytes per parameter instead: weights {_gib(weights)} + "
            f"{COMPACT_BYTES_PER_PARAMETER} × {trainable:,} = {_gib(need)} before activations{fits}. ")
