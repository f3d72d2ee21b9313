"""How much the compact last step moves a sharpness value.

The solver keeps Auto-PGD's last step d = ξ − ξ⁻ of the elementwise weights in bfloat16 for a
float32 run (``solver.COMPACT_STEP``, 2 bytes per weight fewer). This runs the same measurement
with the step in bfloat16 and in float32 (each in one process, same seed and batch) and prints the
relative change of the value for each geometry and radius, on MiniLM's real weights (32 × 32
tokens, the default 20 iterations).

    python benchmarks/compact_step_values.py [--rhos 0.01 0.1 1.0] [--iters 20] [--batch 32] [--seq 32]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv=None):
    import torch

    from bench_sharpness import batch, build
    from quotient_manifolds import adapters
    from quotient_manifolds.adapters import solver

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rhos", nargs="+", type=float, default=[0.01, 0.1, 1.0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args(argv)
    model = build("minilm", "cpu")
    inputs, labels = batch(model, args.batch, args.seq, "cpu")
    print(f"{'geometry':13s} {'rho':>6s} {'float32 step':>14s} {'bfloat16 step':>14s} {'rel. change':>11s}")
    worst = 0.0
    for geometry in ("adaptive", "geodesic-mix", "geodesic-inv"):
        for rho in args.rhos:
            values = []
            for compact in (False, True):
                solver.COMPACT_STEP = compact
                torch.manual_seed(0)
                values.append(adapters.sharpness(model, [(inputs, labels)], geometry=geometry, rho=rho,
                                                 n_iters=args.iters, check_retraction=False).value)
            change = abs(values[1] - values[0]) / abs(values[0])
            worst = max(worst, change)
            print(f"{geometry:13s} {rho:6g} {values[0]:14.8g} {values[1]:14.8g} {change:11.2e}", flush=True)
    print(f"largest relative change: {worst:.2e} (MiniLM, {args.batch} x {args.seq} tokens, "
          f"{args.iters} iterations, torch {torch.__version__})")


if __name__ == "__main__":
    main()
