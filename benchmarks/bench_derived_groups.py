"""Costs of the derived-group machinery: derive_algebra on one head, and the vertical solvers of
the orthogonal groups, on this machine.

Rows:

* ``derive_algebra`` on RoPE scores of one head (half pairing, all coordinates rotated): queries
  and keys of T tokens with T² ≥ h² outputs, G and H random (n = m = 2h rows); the time splits into
  the h² forward-mode jvps and the dense linear algebra (Gram matrix, eigh, refined SVD);
* frame set-up + one horizontal projection for SO(h) and R₊·SO(h) on ``--heads`` heads at
  points acted on by GL elements of condition number ``--cond``, per metric (mix with ε = 0 uses
  the closed form; the other cases conjugate gradients with the dense fallback).

Usage:  python benchmarks/bench_derived_groups.py [--h 16 32 64] [--threads N] [--heads 12]
"""

from __future__ import annotations

import argparse
import math
import time

import torch


def rope_scores(h: int, tokens: int, gen):
    X = torch.randn(tokens, 2 * h, dtype=torch.float64, generator=gen)
    Y = torch.randn(tokens, 2 * h, dtype=torch.float64, generator=gen)
    pos = torch.arange(tokens, dtype=torch.float64)
    freq = 10000.0 ** (-torch.arange(h // 2, dtype=torch.float64) * 2 / h)
    ang = pos[:, None] * freq[None, :]
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)

    def rot(v):
        a, b = v[..., : h // 2], v[..., h // 2:]
        return v * cos + torch.cat((-b, a), -1) * sin

    return lambda G, H: rot(X @ G) @ rot(Y @ H).T


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--h", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--cond", type=float, default=10.0)
    p.add_argument("--skip-solvers", action="store_true", help="only time derive_algebra")
    p.add_argument("--skip-derive", action="store_true", help="only time the vertical solvers")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from quotient_manifolds.core import (FULL_GL, GLQuotientGeometry, OrthogonalGroup,
                                         ScaledOrthogonalGroup, derive_algebra, recognise_algebra)
    from quotient_manifolds.core.algebra import linearised_invariance

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    for h in ([] if args.skip_derive else args.h):
        tokens = math.ceil(math.sqrt(2 * h * h))
        f = rope_scores(h, tokens, gen)
        G = torch.randn(2 * h, h, dtype=torch.float64, generator=gen)
        H = torch.randn(2 * h, h, dtype=torch.float64, generator=gen)
        t0 = time.perf_counter()
        linearised_invariance(f, G, H)
        t_jvp = time.perf_counter() - t0
        t0 = time.perf_counter()
        d = derive_algebra(f, G, H)
        t_all = time.perf_counter() - t0
        group = recognise_algebra(d, h)
        print(f"derive_algebra h={h:4d}: {t_all:7.2f} s total ({t_jvp:6.2f} s jvps, "
              f"N = {d.outputs} outputs), "
              f"dim {d.dim}, gap {d.gap:.1e}, closed {d.closed} -> {group.describe(h)}")
    if args.skip_solvers:
        return
    for h in args.h:
        for group in (OrthogonalGroup(), ScaledOrthogonalGroup()):
            for metric, eps in (("mix", 0.0), ("mix", 1e-3), ("inv", 0.0), ("inv", 1e-3)):
                geom = GLQuotientGeometry(4 * h, 4 * h, h, metric, group=group, eps=eps)
                x = geom.random_point(args.heads, dtype=torch.float64, generator=gen)
                x = geom.act(x, FULL_GL.random_element(h, (args.heads,), cond=args.cond, generator=gen))
                u = torch.randn(x.shape, dtype=torch.float64, generator=gen)
                t0 = time.perf_counter()
                frame = geom.frame(x)
                frame.project(u)
                t = time.perf_counter() - t0
                solver = frame._vertical_solver
                how = type(solver).__name__
                if hasattr(solver, "iterations"):
                    how += f" ({solver.iterations} it{', dense fallback' if solver.used_fallback else ''})"
                print(f"{group.describe(h):>10} {metric} eps={eps:g}: frame + projection {t:7.3f} s "
                      f"for {args.heads} heads [{how}]")


if __name__ == "__main__":
    main()
