"""Timings of the GL(h) quotient core at BERT-base shapes, with ratios measured in the same run.

Workload: 12 layers × 12 heads = 144 heads, one GL(64) block each, G and H of 769×64 (768 weight
rows plus the bias row), stored as one batch x of shape (144, 1538, 64).

Rows of the table:

* horizontal projection, batched torch, inv and mix: "frame + projection" (Gram matrices, Cholesky,
  eigendecompositions, validation and the projection) and "projection, cached frame" (the sharpness
  engine keeps one frame at the trained weights for the whole run);
* the same inv projection as a Python loop over heads with `scipy.linalg.solve_sylvester`
  (docs/maths.md §3.2: P, Q, A = PQ, B = P Hᵀξ_H − ξ_GᵀG Q computed per head in numpy, A X + X A = B,
  Λ = Xᵀ, (ξ_G + GΛ, ξ_H − HΛᵀ));
* Γ(ξ, ξ) and the second-order retraction x + ξ − ½Γ(ξ, ξ) with a cached frame, relative to ONE
  batched matrix product of the same shapes, ξ_G @ (h×h) over the 144 heads, in the compute dtype;
* the differentiable retraction as the sharpness engine uses it (ξ a leaf that requires a gradient,
  the point fixed): forward, and backward of a random cotangent, for the core's closed-form backward
  ("now") and for autograd through the previous implementation ("before", x + ξ − ½Γ(ξ, ξ) with
  Γ's v = u formula of each metric, reproduced below): the backward / forward ratio of each, and
  the number of matrix-product calls (mm, bmm, baddbmm) one forward + backward issues. On the CPU
  these rows are process (CPU) seconds, median of at least 15 repeats;
* the sharpness solver's gradient at one iterate ξ from the cotangent ȳ of the retracted point:
  "VJP, then egrad2rgrad" (ū = the retraction's vector–Jacobian product, g = P_h(ū N),
  ‖g‖² = ⟨ū, g⟩ and ⟨g, ξ⟩ = ⟨ū, ξ⟩ as Euclidean sums: what the solver did before) against
  "closed form" (``second_order_riemannian_gradient`` with the forward's Gram products, and both
  scalars from one metric product, ``GLFrame.inners``), interleaved, with their ratio, the
  matrix-product calls and the largest relative difference of g. ``--keep-dtype`` frames a
  float32 point in its own dtype, as the sharpness engine does.

Usage:  python benchmarks/bench_geometry.py [--threads N] [--device cpu|cuda] [--repeats R]
        [--retraction-only | --gradient-only] [--keep-dtype]
        (MiniLM's shapes: --heads 72 --rows 384 --h 32 --dtype float32 --keep-dtype)
Each timing is the median of R repeats after warm-up calls; the scipy loop always runs on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads for torch and the BLAS used by numpy/scipy (default: all cores)")
    p.add_argument("--device", default="cpu", help="torch device for the batched core (cpu, cuda, cuda:1, …)")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                   help="dtype of the points and tangent vectors given to the core (it computes in float64)")
    p.add_argument("--heads", type=int, default=144, help="number of GL(h) blocks (default 12×12 = 144)")
    p.add_argument("--rows", type=int, default=769, help="rows of G and of H (default 768 + bias row)")
    p.add_argument("--h", type=int, default=64, help="head dimension h (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per row (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls per row")
    p.add_argument("--scipy-repeats", type=int, default=3, help="timed repeats of the scipy loop")
    p.add_argument("--retraction-only", action="store_true",
                   help="only the differentiable retraction's before/after rows")
    p.add_argument("--gradient-only", action="store_true",
                   help="only the solver's gradient: VJP then egrad2rgrad against the closed form")
    p.add_argument("--keep-dtype", action="store_true",
                   help="frame a float32 point in its own dtype (GLFrame keep_dtype), as sharpness does")
    return p.parse_args(argv)


ARGS = parse_args()
THREADS = ARGS.threads or os.cpu_count() or 1
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(THREADS)  # before numpy/torch are imported, so their BLAS pools obey it

import numpy as np  # noqa: E402
import scipy  # noqa: E402
import scipy.linalg  # noqa: E402
import torch  # noqa: E402

from quotient_manifolds.core import GLQuotientGeometry  # noqa: E402


def timer(fn, device, repeats, warmup, clock=time.perf_counter):
    """Median time of fn() over `repeats` calls after `warmup` calls (device-synchronised), by
    ``clock`` (wall time unless given)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return float(np.median(times))


def scipy_loop_projection(X, U, n):
    """Per-head inv projection with scipy's Bartels–Stewart solver (numpy float64 arrays)."""
    out = np.empty_like(U)
    for i in range(X.shape[0]):
        G, H = X[i, :n], X[i, n:]
        xG, xH = U[i, :n], U[i, n:]
        P, Q = G.T @ G, H.T @ H
        A = P @ Q
        B = P @ (H.T @ xH) - (xG.T @ G) @ Q
        Lam = scipy.linalg.solve_sylvester(A, A, B).T
        out[i, :n] = xG + G @ Lam
        out[i, n:] = xH - H @ Lam.T
    return out


def previous_second_order(frame, u):
    """The retraction before the closed-form backward: x + u − ½Γ(u, u) with the v = u forms of
    Γ (inv: −2u_A K sym(Aᵀu_A) + A K u_Aᵀu_A; mix: u_G 2sym(u_HᵀH)Q⁻¹ − G u_Hᵀu_H Q⁻¹, …),
    differentiated by autograd."""
    uc = u.to(frame.cdtype)
    n = frame.geometry.n
    (G, H), (uG, uH) = (frame.G, frame.H), (uc[..., :n, :], uc[..., n:, :])
    sym = lambda a: 0.5 * (a + a.mT)  # noqa: E731
    if frame.metric == "inv":
        def block(A, uA, inv):
            return (-2 * uA @ (inv @ sym(A.mT @ uA))) + A @ (inv @ (uA.mT @ uA))
        gamma = (block(G, uG, frame.P_inv), block(H, uH, frame.Q_inv))
    else:
        def block(A, uA, uB, B, inv):
            return uA @ (2 * sym(uB.mT @ B) @ inv) - A @ ((uB.mT @ uB) @ inv)
        gamma = (block(G, uG, uH, H, frame.Q_inv), block(H, uH, uG, G, frame.P_inv))
    return frame.x + uc - 0.5 * torch.cat(gamma, dim=-2)


def matmul_calls(fn):
    """Matrix-product calls issued by fn(): torch's operators (aten mm, bmm, baddbmm, addmm) and
    the core's products that numpy's BLAS computed (CPU float64, quotient_manifolds.core.products)."""
    from torch.profiler import ProfilerActivity, profile

    from quotient_manifolds.core import products
    in_numpy = []
    real = products._quiet_matmul
    products._quiet_matmul = lambda a, b: (in_numpy.append(1), real(a, b))[1]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        products._quiet_matmul = real
    names = ("aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm")
    return sum(e.count for e in prof.key_averages() if e.key in names) + len(in_numpy)


def retraction_rows(frame, xi, device, rep, wu, rows, calls):
    """Forward and backward of the differentiable retraction, before and after."""
    y_bar = torch.randn(xi.shape, dtype=xi.dtype, device=xi.device)
    for label, forward in (("before", previous_second_order),
                           ("now", lambda f, leaf: f.retract(leaf, "second_order"))):
        def fwd():
            leaf = xi.detach().requires_grad_()
            return leaf, forward(frame, leaf)

        def fwd_bwd():
            leaf, y = fwd()
            return torch.autograd.grad(y, leaf, y_bar)

        # on the CPU: process time (this machine is shared), more repeats (the ratio is the result)
        clock = time.process_time if device.type == "cpu" else time.perf_counter
        t_fwd = timer(fwd, device, max(rep, 15), wu, clock)
        t_both = timer(fwd_bwd, device, max(rep, 15), wu, clock)
        rows[f"{frame.metric}: differentiable retraction {label}: forward"] = t_fwd
        rows[f"{frame.metric}: differentiable retraction {label}: backward"] = t_both - t_fwd
        calls[f"{frame.metric} {label}"] = matmul_calls(fwd_bwd)
    leaf = xi.detach().requires_grad_()
    g_now = torch.autograd.grad(frame.retract(leaf, "second_order"), leaf, y_bar)[0]
    leaf = xi.detach().requires_grad_()
    g_before = torch.autograd.grad(previous_second_order(frame, leaf), leaf, y_bar)[0]
    return float((g_now - g_before).abs().max() / g_before.abs().max())


def gradient_rows(frame, xi, device, rep):
    """(ms VJP then egrad2rgrad, ms closed form, matmul calls of each, max rel. diff of g): the
    solver's gradient at ξ from a cotangent ȳ, the two ways interleaved (process seconds on the
    CPU), each with the scalars ‖g‖² and ⟨g, ξ⟩ the solver needs."""
    from quotient_manifolds.core.gl import (second_order_retraction_vjp,
                                            second_order_riemannian_gradient, second_order_step)

    y_bar = torch.randn(xi.shape, dtype=xi.dtype, device=xi.device)
    _, grams = second_order_step(frame, xi)

    def before():
        u_bar = second_order_retraction_vjp(frame, xi, y_bar).to(xi.dtype)
        g = frame.egrad2rgrad(u_bar).to(xi.dtype)
        return g, torch.sum(u_bar * g, dtype=torch.float64), torch.sum(u_bar * xi, dtype=torch.float64)

    def now():
        g = second_order_riemannian_gradient(frame, xi, y_bar, grams)
        sq, dot = frame.inners(g, g, xi)
        return g.to(xi.dtype), sq.sum(), dot.sum()

    clock = time.process_time if device.type == "cpu" else time.perf_counter
    times = {"before": [], "now": []}
    for fn in (before, now):
        fn()
    for _ in range(max(rep, 15)):
        for label, fn in (("before", before), ("now", now)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[label].append(clock() - t)
    g_before, g_now = before()[0], now()[0]
    diff = float((g_now - g_before).abs().max() / g_before.abs().max())
    return (1e3 * float(np.median(times["before"])), 1e3 * float(np.median(times["now"])),
            matmul_calls(before), matmul_calls(now), diff)


def main():
    torch.set_num_threads(THREADS)
    device = torch.device(ARGS.device)
    dtype = getattr(torch, ARGS.dtype)
    B, n, h = ARGS.heads, ARGS.rows, ARGS.h
    gen = torch.Generator().manual_seed(0)
    # weights of BERT-like scale (entries ~ 0.04) and a tangent vector
    x = (0.04 * torch.randn(B, 2 * n, h, generator=gen, dtype=torch.float64)).to(device, dtype)
    u = torch.randn(B, 2 * n, h, generator=gen, dtype=torch.float64).to(device, dtype)
    rep, wu = ARGS.repeats, ARGS.warmup

    print(f"# bench_geometry: {B} heads, G and H of {n}×{h} (x: {tuple(x.shape)}), input dtype "
          f"{ARGS.dtype} (core computes in float64)")
    print(f"# device {device}, torch {torch.__version__} threads {torch.get_num_threads()}, "
          f"numpy {np.__version__}, scipy {scipy.__version__}, BLAS threads {THREADS}, "
          f"cpu_count {os.cpu_count()}, median of {rep} (scipy loop: {ARGS.scipy_repeats}) after "
          f"{wu} warm-up")

    rows = {}
    results = {}
    calls, vjp_diff = {}, {}
    if ARGS.gradient_only:
        print(f"\nsolver gradient at one iterate (ms, median; same run){'':6s}  before   now   ratio  "
              f"matmul calls  max rel. diff of g")
        for metric in ("inv", "mix"):
            frame = GLQuotientGeometry(n, n, h, metric).frame(x, keep_dtype=ARGS.keep_dtype)
            xi = frame.project(0.01 * u)
            t_before, t_now, c_before, c_now, diff = gradient_rows(frame, xi, device, rep)
            print(f"{metric:3s}: VJP, then egrad2rgrad → closed form{'':14s}{t_before:7.2f} {t_now:6.2f}  "
                  f"{t_now / t_before:5.2f}  {c_before:>4d} → {c_now:<4d}   {diff:.1e}")
        return 0
    for metric in ("inv", "mix"):
        geom = GLQuotientGeometry(n, n, h, metric)
        if ARGS.retraction_only:
            frame = geom.frame(x)
            xi = frame.project(0.01 * u)
            vjp_diff[metric] = retraction_rows(frame, xi, device, rep, wu, rows, calls)
            continue
        rows[f"{metric}: frame + projection (torch, batched)"] = timer(
            lambda: geom.frame(x).project(u), device, rep, wu)
        frame = geom.frame(x)
        results[metric] = frame.project(u)  # also fills the cached projection basis
        rows[f"{metric}: projection, cached frame (torch)"] = timer(lambda: frame.project(u), device, rep, wu)
        xi = frame.project(0.01 * u)
        rows[f"{metric}: Γ(ξ,ξ), cached frame"] = timer(lambda: frame.christoffel(xi), device, rep, wu)
        rows[f"{metric}: 2nd-order retraction, cached frame"] = timer(
            lambda: frame.retract(xi, "second_order"), device, rep, wu)
        vjp_diff[metric] = retraction_rows(frame, xi, device, rep, wu, rows, calls)

    width = max(map(len, rows))
    if ARGS.retraction_only:
        print(f"\n{'operation':{width}s}  {'median [ms]':>12s}")
        for k, v in rows.items():
            print(f"{k:{width}s}  {1e3 * v:12.2f}")
        print_retraction_ratios(rows, calls, vjp_diff)
        return 0

    # one batched matrix product of the same shapes, in the compute dtype (float64), the way the
    # core multiplies (quotient_manifolds.core.products: numpy's BLAS on the CPU)
    from quotient_manifolds.core.products import matmul
    xiG = u[:, :n].to(torch.float64)
    small = torch.randn(B, h, h, generator=gen, dtype=torch.float64).to(device)
    rows["reference: one matmul ξ_G @ (h×h), batched"] = timer(lambda: matmul(xiG, small), device,
                                                              rep, wu)

    # scipy loop (CPU, float64 numpy; the conversion is done once, outside the timing)
    Xn = x.detach().to("cpu", torch.float64).numpy()
    Un = u.detach().to("cpu", torch.float64).numpy()
    rows["inv: Python loop of scipy solve_sylvester"] = timer(
        lambda: scipy_loop_projection(Xn, Un, n), torch.device("cpu"), ARGS.scipy_repeats, 1)
    ref = scipy_loop_projection(Xn, Un, n)
    diff = np.abs(results["inv"].to("cpu", torch.float64).numpy() - ref).max() / np.abs(ref).max()

    width = max(map(len, rows))
    print(f"\n{'operation':{width}s}  {'median [ms]':>12s}")
    for k, v in rows.items():
        print(f"{k:{width}s}  {1e3 * v:12.2f}")

    mm = rows["reference: one matmul ξ_G @ (h×h), batched"]
    loop = rows["inv: Python loop of scipy solve_sylvester"]
    print("\nratios (same run)")
    ratios = [
        ("scipy loop / inv frame + projection (goal ≥ 10)", loop / rows["inv: frame + projection (torch, batched)"]),
        ("scipy loop / inv projection, cached frame", loop / rows["inv: projection, cached frame (torch)"]),
        ("inv projection, cached frame / one matmul", rows["inv: projection, cached frame (torch)"] / mm),
        ("mix projection, cached frame / one matmul", rows["mix: projection, cached frame (torch)"] / mm),
        ("inv Γ(ξ,ξ) / one matmul", rows["inv: Γ(ξ,ξ), cached frame"] / mm),
        ("mix Γ(ξ,ξ) / one matmul", rows["mix: Γ(ξ,ξ), cached frame"] / mm),
        ("inv 2nd-order retraction / one matmul", rows["inv: 2nd-order retraction, cached frame"] / mm),
        ("mix 2nd-order retraction / one matmul", rows["mix: 2nd-order retraction, cached frame"] / mm),
    ]
    rw = max(len(k) for k, _ in ratios)
    for k, v in ratios:
        print(f"{k:{rw}s}  {v:8.2f}×")
    print_retraction_ratios(rows, calls, vjp_diff)
    print(f"\ncheck: max |torch inv projection − scipy| / max |scipy| = {diff:.1e}")
    return 0


def print_retraction_ratios(rows, calls, vjp_diff):
    print("\ndifferentiable second-order retraction (ξ requires a gradient, point fixed), same run")
    print(f"{'metric':6s}  {'backward / forward, before':>27s}  {'now':>6s}  "
          f"{'(fwd+bwd) now / before':>23s}  {'matmul calls before → now':>26s}  max rel. diff of ū")
    for metric in vjp_diff:
        key = f"{metric}: differentiable retraction "
        fb, bb = rows[key + "before: forward"], rows[key + "before: backward"]
        fn, bn = rows[key + "now: forward"], rows[key + "now: backward"]
        print(f"{metric:6s}  {bb / fb:27.2f}  {bn / fn:6.2f}  {(fn + bn) / (fb + bb):23.2f}  "
              f"{calls[metric + ' before']:>17d} → {calls[metric + ' now']:<6d}  {vjp_diff[metric]:.1e}")


if __name__ == "__main__":
    sys.exit(main())
