r"""Sharpness over many batches spread across the processes of ``torch.distributed``.

The paper's protocol measures worst-case sharpness batch by batch and averages (each batch has its
own Auto-PGD maximisation; nothing couples two batches), so batches can be measured on different
ranks and the per-batch results gathered. Batch ``i`` of the iterable goes to rank ``i mod world``
and is measured with seed ``seed + i``; the result is assembled in batch order on every rank, so it
is the same whatever the world size (and equal to :func:`~quotient_manifolds.adapters.sharpness` run batch
by batch with those seeds).

Every rank must iterate over the same batches in the same order (e.g. a DataLoader with a fixed
generator and no ``DistributedSampler``); each rank only measures its own share. The model must be
the same on every rank (it is never modified).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Optional

import torch
from typing_extensions import Unpack

from quotient_manifolds.errors import InvalidArgument, UsageError

from . import validation as check
from .gate import Gate
from .ball import GEOMETRY_TABLE
from .options import SharpnessKwargs, document_options, renamed_options, sharpness_options
from .sharded import is_sharded
from .worst_case import SharpnessResult, sharpness

__all__ = ["distributed_sharpness"]


@document_options
def distributed_sharpness(model: torch.nn.Module, batches: Iterable[Any], *, rho: float,
                          process_group: Optional[Any] = None,
                          **options: Unpack[SharpnessKwargs]) -> SharpnessResult:
    """:func:`~quotient_manifolds.adapters.sharpness` with the batches spread over the ranks of
    ``process_group`` (default: the world). Call it on every rank; every rank returns the same
    :class:`~quotient_manifolds.adapters.SharpnessResult` (``value`` = mean over all batches, ``per_batch``
    in batch order, ``n_forward``/``n_backward``/``time_s`` summed over ranks).

    ``rho`` and the options are those of :func:`~quotient_manifolds.adapters.sharpness` (``geometry``,
    ``n_iters``, ``loss_fn``, ``layout`` …,
    :class:`~quotient_manifolds.adapters.options.SharpnessKwargs`); ``progress`` shows this rank's
    share, and batch ``i`` is measured with seed ``seed + i``.

    Parameters
    ----------
    model:
        The whole model on every rank (not sharded: for an FSDP2 model call
        :func:`~quotient_manifolds.adapters.sharpness` on every rank).
    batches:
        The same list of batches on every rank; rank r measures batches r, r + world, ….
    rho:
        The radius, as for :func:`~quotient_manifolds.adapters.sharpness`.
    process_group:
        The ranks to spread over (default: the default group).
    options:
        The options of :func:`~quotient_manifolds.adapters.sharpness`.

    Returns
    -------
    SharpnessResult
        The same on every rank: the mean over all batches, ``per_batch`` in batch order.

    Raises
    ------
    InvalidArgument, InvalidArgumentType
        A bad argument or option (refused on every rank before any collective), a sharded model,
        or no batches.
    UsageError
        No initialised ``torch.distributed`` process group.

    Examples
    --------
    One process here (a group of one rank); under ``torchrun`` every rank runs the same lines:

    >>> import tempfile, torch, torch.distributed as dist
    >>> from quotient_manifolds import adapters
    >>> store = dist.FileStore(tempfile.mkstemp()[1], 1)
    >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))
    ...            for _ in range(2)]
    >>> result = adapters.distributed_sharpness(model, batches, geometry="geodesic-inv", rho=0.1,
    ...                                         n_iters=3, loss_fn=torch.nn.MSELoss())
    >>> len(result.per_batch), result.options["world_size"] if "world_size" in result.options else 1
    (2, 1)
    >>> dist.destroy_process_group()
    """
    import torch.distributed as dist

    # every rank refuses the same bad argument before any collective (a rank that raised alone
    # would leave the others waiting in all_gather_object)
    check.module("model", model)
    chosen = renamed_options(options)   # a former spelling warned about once, here
    resolved = sharpness_options(chosen, rho=rho)
    seed = chosen.pop("seed", 0)
    if is_sharded(model):
        raise InvalidArgument(
            "distributed_sharpness measures a whole model on every rank, each rank its share of the "
            "batches; this model is sharded with FSDP2 (its parameters are DTensors). Call "
            "adapters.sharpness(model, batches, ...) on every rank instead: on a sharded model each rank "
            "passes its own batches, and the loss is their mean over the ranks")
    check.batches("batches", batches)
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("distributed_sharpness needs an initialised torch.distributed process "
                         "group (torch.distributed.init_process_group(...), e.g. under torchrun); "
                         "for one process call adapters.sharpness instead")
    geometry = resolved["geometry"]
    if GEOMETRY_TABLE[geometry].geodesic:
        # resolved (detected, or checked to belong to the model) once, on every rank alike, before
        # any rank measures or waits for the others
        # (the gate of adapters.gate: every rank's sharpness call then accepts it on its first batch)
        chosen["layout"] = Gate(model, chosen.get("layout"), geometry=geometry,
                                 what=f"distributed {geometry} sharpness", consequence="the value would be meaningless",
                                 allow_unsupported=resolved["allow_unsupported"],
                                 include_frozen=resolved["include_frozen"]).layout
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    rows = []
    for index, batch in itertools.islice(enumerate(batches), rank, None, world):
        res = sharpness(model, [batch], rho=rho, seed=seed + index, **chosen)
        rows.append((index, res.per_batch[0], res.init_losses[0], res.worst_losses[0],
                     res.norms[0], res.n_forward, res.n_backward, res.time_s))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows, group=process_group)
    index, per_batch, init, worst, norms, n_fwd, n_bwd, seconds = zip(
        *sorted(row for part in gathered for row in part)) if any(gathered) else ((),) * 8
    if not per_batch:
        raise InvalidArgument("`batches` is empty: pass at least one batch")
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=list(per_batch), init_losses=list(init),
        worst_losses=list(worst), norms=list(norms), rho=float(rho),
        geometry=geometry, measure=resolved["measure"],
        n_iters=resolved["n_iters"], n_forward=sum(n_fwd), n_backward=sum(n_bwd),
        time_s=sum(seconds),
        options={"rho": rho, **{k: v for k, v in chosen.items() if k != "layout"}, "seed": seed,
                 "world_size": world})
