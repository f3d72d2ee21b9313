"""Transient memory of GeodesicSAM's GL-block work under FSDP2, per attention parameter.

Under FSDP2, ``GeodesicSAM`` assembles one attention module's parameters whole at a time
(``DTensor.full_tensor()``) and forms its heads' ascent direction and perturbed point on every rank
(adapters/sam_parallel.py, ``_sharded_pieces``). This measures, in one process on the CPU, the peak
resident memory that this per-module work adds (the ball of the whole module: float64 heads, their
gradient, direction and point), for one float32 attention module with separate q/k/v/o layers. The
whole weights and gradients that FSDP2 gathers for it add 8 bytes per parameter on top (float32).

    python benchmarks/bench_sam_sharded_memory.py [--dims 1024 2048] [--head-dim 128]

Measured (2026-11, CPU, two runs): hidden 1024 / 8 heads (4.2 M parameters) 34-36 bytes per
parameter, hidden 2048 / 16 heads (16.8 M) 22-23 (the fixed part of the cost shrinks with size).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import PlainAttention  # noqa: E402


def _resident() -> tuple:
    """(current, peak) resident set size in bytes (Linux /proc, by the library's reading)."""
    from quotient_manifolds.adapters.memory import device_memory

    now = device_memory("cpu")
    if now is None:
        raise RuntimeError("the resident set is read from /proc/self/status (Linux only)")
    return now.in_use, now.peak


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:   # "5": reset VmHWM to the current RSS
        fh.write("5")


class OneAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn = PlainAttention(dim, heads)

    def forward(self, x):
        return self.attn(x)


def measure(dim: int, head_dim: int) -> float:
    """Bytes per attention parameter of the per-module work of one sharded GeodesicSAM step."""
    from quotient_manifolds import adapters
    from quotient_manifolds.adapters import GeodesicSAM

    torch.manual_seed(0)
    model = OneAttention(dim, dim // head_dim)
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.05, geometry="geodesic-inv",
                      layout=adapters.layout(model), lr=0.1, unsafe=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad for n, p in opt._perturbed.items()}
    n_params = sum(p.numel() for p in model.parameters())
    gc.collect()
    _reset_peak()
    before, _ = _resident()
    # the work of one module's piece of the sharded ascent (_sharded_pieces); unsharded tensors are used as they are
    # (their "whole" copies are the 8 bytes per parameter not counted here)
    ball, ball_params, rgrad = opt._whole_blocks(opt._block_groups()[0], grads, False)
    torch._foreach_mul_(rgrad, 0.01)
    ball_params(ball.points(rgrad, consume=True))
    _, peak = _resident()
    return (peak - before) / n_params, n_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("hidden  heads  attention params  transient bytes/param (ball work; + 8 for whole weights+grads)")
    for dim in args.dims:
        per_param, n = measure(dim, args.head_dim)
        print(f"{dim:6d}  {dim // args.head_dim:5d}  {n / 1e6:13.1f} M  {per_param:10.1f}")


if __name__ == "__main__":
    main()
