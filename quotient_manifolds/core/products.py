r"""The matrix products of the geometry core: :func:`matmul` (a b) and :func:`add_product`
(out + a b).

The core's work is batched products of small matrices: an n×h block times an h×h matrix, the
Gram reductions Aᵀu (h×n by n×h), and h×h products, in float64, with h the head dimension (tens
to a few hundred). On the CPU, torch's float64 batched product runs such shapes well below the
machine's rate on one thread: on a 2-core AMD EPYC (torch 2.13 with MKL, numpy 2 with
OpenBLAS), a (24, 385, 32)·(24, 32, 32) product took 0.85–0.95 ms in torch and 0.35 ms in numpy,
the Gram reduction of the same blocks 0.9 ms against 0.35–0.5 ms, and a (24, 32, 32) product 78 µs
against 31 µs. So where torch runs on one thread (``torch.get_num_threads() == 1``: the user's
setting, or the library's bound for work on small tensors), float64 CPU products whose result
autograd does not need go through numpy's BLAS on views of the same memory (no copy in, none
out), on one thread too. Everything else stays in torch: other devices and dtypes, products
autograd records, tensors numpy cannot view, and every product where torch has several threads
(its batched products use them; numpy's BLAS runs products of this size on one). The values agree
to rounding (the summation order of a dot product may differ).

Threads: OpenBLAS runs products of fewer than about 2·10⁶ multiply-adds per matrix on one thread
anyway; above :data:`THREADED_WORK` its thread count is set to one around the product through
``threadpoolctl`` (where that is not installed, such products stay in torch).

Set :data:`NUMPY_ON_CPU` to ``False`` to keep every product in torch (e.g. where numpy's BLAS
is slower than torch's on your machine).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import numpy as np
import torch

Tensor = torch.Tensor
_FLOAT64 = torch.float64

#: Route CPU float64 products through numpy's BLAS where torch runs on one thread (see the
#: module's docstring).
NUMPY_ON_CPU = True

#: Multiply-adds per matrix above which numpy's BLAS may use several threads: its thread count is
#: set to one around such products.
THREADED_WORK = 2 ** 20


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a b, with torch's broadcasting rules (``a @ b``); CPU float64 products autograd does not
    record go through numpy's BLAS where torch runs on one thread."""
    arrays = _numpy_views(a, b)
    if arrays is None:
        return a @ b
    product = _numpy_product(*arrays)
    return a @ b if product is None else torch.from_numpy(product)


def add_product(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """out + a b, accumulated in place into ``out`` when the product has its shape, else out of
    place: pass an ``out`` the caller may modify (e.g. a fresh product)."""
    arrays = _numpy_views(a, b)
    product = None if arrays is None else _numpy_product(*arrays)
    if product is not None:
        product = torch.from_numpy(product)
        return out.add_(product) if product.shape == out.shape else out + product
    if a.shape[:-2] != out.shape[:-2] or b.shape[:-2] != out.shape[:-2]:
        return out + a @ b
    if out.dim() == 2:
        return out.addmm_(a, b)
    out.flatten(0, -3).baddbmm_(a.flatten(0, -3), b.flatten(0, -3))
    return out


def _numpy_views(a: Tensor, b: Tensor) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """numpy views of a and b where the product may go through numpy, else None."""
    # (attributes that cost a fraction of a microsecond first: products of 700×10 by 10×10
    # take 6 µs in BLAS)
    if not (a.dtype is _FLOAT64 and b.dtype is _FLOAT64 and a.is_cpu and b.is_cpu
            and NUMPY_ON_CPU and a.dim() >= 2 and b.dim() >= 2 and torch.get_num_threads() == 1):
        return None
    if a.requires_grad or b.requires_grad:
        if torch.is_grad_enabled():
            return None   # autograd records the product
        a, b = a.detach(), b.detach()
    try:
        return a.numpy(), b.numpy()
    except (RuntimeError, TypeError):   # no storage (e.g. functorch), a negative bit, a subclass
        return None


def _numpy_product(a: np.ndarray, b: np.ndarray) -> Optional[np.ndarray]:
    """np.matmul(a, b) on one thread; None where that cannot be set (threadpoolctl missing) for a
    product BLAS may thread."""
    if a.shape[-2] * a.shape[-1] * b.shape[-1] <= THREADED_WORK:
        return _quiet_matmul(a, b)
    controllers = _blas_controllers()
    if controllers is None:
        return None
    previous = [controller.num_threads for controller in controllers]
    for controller, threads in zip(controllers, previous):
        if threads > 1:
            controller.set_num_threads(1)
    try:
        return _quiet_matmul(a, b)
    finally:
        for controller, threads in zip(controllers, previous):
            if threads > 1:
                controller.set_num_threads(threads)


@np.errstate(all="ignore")
def _quiet_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul without numpy's warnings: like torch, an overflow gives inf and an invalid
    operation NaN silently (the library's own checks name non-finite values)."""
    return np.matmul(a, b)


@functools.lru_cache(maxsize=None)
def _blas_controllers() -> Optional[List]:
    """threadpoolctl's controllers of the BLAS libraries loaded (numpy's among them), or None."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return list(ThreadpoolController().select(user_api="blas").lib_controllers)
