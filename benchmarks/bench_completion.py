"""Fixed-rank matrix completion with the library's manifolds and with pymanopt's FixedRankEmbedded,
side by side in one run: CPU seconds (``time.process_time``, one thread) to a relative error of
1e-10 on ALL entries of the target.

Every method evaluates the same sparse cost, written once below (:class:`Completion`):
f(G, H) = ½ Σ_{(i,j) ∈ Ω} (⟨G_i, H_j⟩ − A_ij)², its gradient (R H, Rᵀ G) with R the sparse residual
(scipy CSR), and for trust regions its Hessian. FixedRankEmbedded's point (U, s, Vᵀ) calls it with
(G, H) = (U diag(s), V) and the chain rule. All methods start from the same rank-r matrix X₀:
Gaussian factors scaled to the target's norm, or with ``--start spectral`` the truncated SVD of
the observed entries scaled by nm/|Ω| (the usual start of completion methods; computed once per
row, outside every method's clock).

Methods (columns):

* ``pymanopt FixedRankEmbedded + CG``: pymanopt 2's embedded manifold, its ConjugateGradient;
* ``ours mix + CG``, ``ours inv + CG``: :class:`quotient_manifolds.pymanopt.GLQuotient`, the same
  ConjugateGradient;
* ``ours mix + TR``: the same face with pymanopt's TrustRegions and the exact Hessian (pymanopt's
  TrustRegions cannot run on FixedRankEmbedded: its tangent vectors have no Hessian here), with
  the radius bound and the initial radius ``Delta_bar`` = ``Delta0`` = ‖G₀H₀ᵀ‖_F (a mix length
  is the size of a change of G Hᵀ), at most :data:`TR_MAX_INNER` inner iterations, and the
  inner solve's tolerance :data:`TR_KAPPA`;
* ``ours mix + CG, ranks 1 … r`` (``mix-cg-ranks``): the same face and CG over the ranks 1, 2, …,
  r from a spectral start (:func:`run_rank_continuation`), for targets whose singular values span
  many decades;
* ``ours geoopt mix SGD`` / ``Adam``: :class:`quotient_manifolds.GLQuotient` with geoopt's
  RiemannianSGD (momentum 0) / RiemannianAdam, learning rates scaled by the sampling ratio
  nm/|Ω| (:func:`scaled_lr`, see the user guide's optimisation section).

Timing: the clock runs while the optimizer runs, and stops while the benchmark checks the error on
all entries (done whenever the relative residual on the observed entries falls below 1e-9) — the
check is not part of any method. A method that has not reached 1e-10 within ``--budget`` CPU seconds
reports the best all-entries error it reached ("best err" column), measured at the point with the
smallest cost.

Rows: ``200x500`` (rank 10, 4r(m+n−r) observed), ``1000`` (1000², rank 10, oversampling 3),
``ill`` (500², rank 5, oversampling 2, singular values from 1 to 1e-6: condition number 1e6) and,
with ``--large``, ``5000`` (5000², rank 10, oversampling 3; minutes on a 2-core machine).

Retraction: our manifolds move with their default, the second-order retraction
x + ξ − ½Γ(ξ, ξ); ``--retraction first_order`` uses x + ξ instead, the retraction of Manopt's
two-factor factories (FixedRankEmbedded keeps its own, a truncated SVD).

Repeats: with ``--repeats N`` every method runs N times per row, the methods interleaved
(method 1, 2, …, then again), and each column is the median over the repeats: on a shared machine
the speed of one run varies by more than the differences measured here.

Usage: python benchmarks/bench_completion.py [--rows 200x500 1000 ill] [--large] [--budget 30]
       [--methods ...] [--seed 0] [--retraction second_order] [--start random] [--repeats 1]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402
import scipy.sparse.linalg as spl  # noqa: E402
import torch  # noqa: E402

#: the target relative error on all entries
TARGET = 1e-10
#: the residual on the observed entries below which the error on all entries is checked
CHECK_BELOW = 1e-9

ROWS = {
    "200x500": dict(n=200, m=500, r=10, observed=lambda n, m, r: 4 * r * (m + n - r), cond=None),
    "1000": dict(n=1000, m=1000, r=10, observed=lambda n, m, r: 3 * r * (m + n - r), cond=None),
    "5000": dict(n=5000, m=5000, r=10, observed=lambda n, m, r: 3 * r * (m + n - r), cond=None),
    "ill": dict(n=500, m=500, r=5, observed=lambda n, m, r: 2 * r * (m + n - r), cond=1e6),
}
METHODS = ("fixedrank-cg", "mix-cg", "inv-cg", "mix-tr", "mix-cg-ranks", "geoopt-mix-sgd",
           "geoopt-mix-adam", "geoopt-inv-sgd")
LABELS = {"fixedrank-cg": "pymanopt FixedRankEmbedded + CG", "mix-cg": "ours, pymanopt face, mix + CG",
          "inv-cg": "ours, pymanopt face, inv + CG", "mix-tr": "ours, pymanopt face, mix + TR",
          "mix-cg-ranks": "ours, pymanopt face, mix + CG, ranks 1 … r from a spectral start",
          "geoopt-mix-sgd": "ours, geoopt face, mix SGD", "geoopt-mix-adam": "ours, geoopt face, mix Adam",
          "geoopt-inv-sgd": "ours, geoopt face, inv SGD"}


class Reached(Exception):
    """The target error on all entries was reached (ends an optimizer's run from inside its cost)."""


class OutOfBudget(Exception):
    """The CPU budget is spent (pymanopt's own ``max_time`` counts wall time, not CPU time)."""


class Completion:
    """The sparse completion problem and its cost, gradient and Hessian on factors (G, H)."""

    def __init__(self, n, m, r, k, cond, seed, start="random"):
        if start not in ("random", "spectral"):
            raise ValueError(f"start must be 'random' or 'spectral', got {start!r}")
        rng = np.random.default_rng(seed)
        if cond is None:
            self.Gt, self.Ht = rng.standard_normal((n, r)), rng.standard_normal((m, r))
        else:
            U, _ = np.linalg.qr(rng.standard_normal((n, r)))
            V, _ = np.linalg.qr(rng.standard_normal((m, r)))
            self.Gt, self.Ht = U * np.logspace(0, -math.log10(cond), r), V
        self.n, self.m, self.r, self.seed = n, m, r, seed
        flat = np.sort(rng.choice(n * m, size=k, replace=False))
        self.I, self.J = flat // m, flat % m
        #: nm/|Ω|: the observed entries, rescaled by it, estimate the full matrix without bias
        self.scale = n * m / k
        self._buffers = {}    # per rank (the rank continuation fits ranks 1 … r)
        self.vals = self._pairs(self.Gt, self.Ht)
        indptr = np.concatenate(([0], np.cumsum(np.bincount(self.I, minlength=n))))
        self.R = sp.csr_matrix((np.zeros(k), self.J, indptr), shape=(n, m))
        self.RT = self.R.T.tocsr()
        self.dR, self.dRT = self.R.copy(), self.RT.copy()
        self._memo = None
        self._to_RT = np.argsort(self.J, kind="stable")       # CSR order of Rᵀ's entries
        self.norm_vals = float(np.linalg.norm(self.vals))
        self.norm_target = math.sqrt(float(np.sum((self.Gt.T @ self.Gt) * (self.Ht.T @ self.Ht))))
        G0, H0 = rng.standard_normal((n, r)), rng.standard_normal((m, r))
        if start == "spectral":
            self.G0, self.H0 = self.spectral(self.vals, r)
        else:
            scale = (self.norm_target / math.sqrt(float(np.sum((G0.T @ G0) * (H0.T @ H0))))) ** 0.5
            self.G0, self.H0 = scale * G0, scale * H0
        self.norm_x0 = math.sqrt(float(np.sum((self.G0.T @ self.G0) * (self.H0.T @ self.H0))))

    def spectral(self, values, rank):
        """The top ``rank`` singular triplets (U, s, V) of the sparse matrix of ``values`` on Ω,
        scaled by nm/|Ω| (an unbiased estimate of the full matrix), as factors (U√s, V√s).

        ARPACK starts from the problem's seed, not a fresh random vector, so that a run (the rank
        continuation calls this at every rank) is the same run to run."""
        u, s, vt = spl.svds(sp.csr_matrix((values * self.scale, (self.I, self.J)),
                                          shape=(self.n, self.m)), k=rank, random_state=self.seed)
        return u * np.sqrt(s), vt.T * np.sqrt(s)

    def _buffers_of(self, rank):
        """(gi, hj, ones, Gi, Hj) for factors of ``rank``: two work buffers, a vector of ones, and
        the rows G_i, H_j of the point the gradient was last taken at (allocated once: fresh
        |Ω|×r arrays are page-faulted in at every call, which cost more than the arithmetic)."""
        if rank not in self._buffers:
            k = len(self.I)
            self._buffers[rank] = (np.empty((k, rank)), np.empty((k, rank)), np.ones(rank),
                                   np.empty((k, rank)), np.empty((k, rank)))
        return self._buffers[rank]

    def _pairs(self, G, H, keep_rows=False):
        """⟨G_i, H_j⟩ for every observed (i, j); with ``keep_rows`` the rows G_i, H_j stay in the
        buffers the Hessian-vector products read."""
        gi, hj, ones, Gi, Hj = self._buffers_of(G.shape[1])
        rows_G, rows_H = (Gi, Hj) if keep_rows else (gi, hj)
        np.take(G, self.I, axis=0, out=rows_G)
        np.take(H, self.J, axis=0, out=rows_H)
        return np.multiply(rows_G, rows_H, out=gi) @ ones

    def residual(self, G, H):
        return self._pairs(G, H) - self.vals

    def _sparse(self, res, R, RT):
        R.data[:] = res
        RT.data[:] = res[self._to_RT]
        return R, RT

    def cost(self, G, H):
        res = self.residual(G, H)
        return 0.5 * float(res @ res)

    def _at(self, G, H):
        """(R, Rᵀ) at (G, H), and the rows G_i, H_j on Ω, kept for the next call at the same
        point: pymanopt asks for the gradient again in every Hessian-vector product, which needs
        the rows of the point as well as those of the direction."""
        memo = self._memo
        if not (memo and memo[0] is G and memo[1] is H and np.array_equal(G, memo[2])
                and np.array_equal(H, memo[3])):
            self._sparse(self._pairs(G, H, keep_rows=True) - self.vals, self.R, self.RT)
            memo = self._memo = (G, H, G.copy(), H.copy(), self.R @ H, self.RT @ G)
        return memo

    def gradient(self, G, H):
        *_, gG, gH = self._at(G, H)
        return gG.copy(), gH.copy()

    def hessian(self, G, H, dG, dH):
        """D(gradient)[dG, dH] = (R dH + dR H, Rᵀ dG + dRᵀ G), dR the sparse matrix of
        ⟨dG_i, H_j⟩ + ⟨G_i, dH_j⟩ on Ω."""
        self._at(G, H)
        gi, hj, ones, Gi, Hj = self._buffers_of(G.shape[1])
        np.multiply(np.take(dG, self.I, axis=0, out=gi), Hj, out=gi)
        gi += np.multiply(Gi, np.take(dH, self.J, axis=0, out=hj), out=hj)
        dR, dRT = self._sparse(gi @ ones, self.dR, self.dRT)
        return dR @ H + self.R @ dH, dRT @ G + self.RT @ dG

    def error(self, G, H, rows=2000):
        """‖G Hᵀ − A‖_F / ‖A‖_F on all entries, in row chunks."""
        total = 0.0
        for i in range(0, self.n, rows):
            d = G[i:i + rows] @ H.T - self.Gt[i:i + rows] @ self.Ht.T
            total += float(np.sum(d * d))
        return math.sqrt(total) / self.norm_target


class Monitor:
    """Watches every cost evaluation: stops the clock for the all-entries check, keeps the best point."""

    def __init__(self, problem: Completion, budget: float):
        self.p, self.budget = problem, budget
        self.excluded, self.start = 0.0, time.process_time()
        self.best_cost, self.best = math.inf, None
        self.reached_at = None
        self.evaluations = self.iterations = 0
        self.user = 0.0   # CPU seconds inside the cost, gradient and Hessian (the same code for all)

    def elapsed(self):
        return time.process_time() - self.start - self.excluded

    def seen(self, G, H, cost):
        self.evaluations += 1
        if self.out_of_time():
            raise OutOfBudget()
        if cost < self.best_cost:
            self.best_cost, self.best = cost, (np.array(G, copy=True), np.array(H, copy=True))
        if math.sqrt(2 * cost) / self.p.norm_vals <= CHECK_BELOW:
            t0 = time.process_time()
            err = self.p.error(G, H)
            self.excluded += time.process_time() - t0
            if err <= TARGET:
                self.reached_at = self.elapsed()
                raise Reached()

    def timed(self, fn, *args):
        """fn(*args), its CPU time counted as the problem's (not the manifold's or optimizer's)."""
        t0 = time.process_time()
        try:
            return fn(*args)
        finally:
            self.user += time.process_time() - t0

    def out_of_time(self):
        return self.elapsed() > self.budget


def _watched_problem(manifold, mon: Monitor, hessian: bool = False):
    """The pymanopt problem of ``mon``'s completion on one of our faces (points (G, H)), every
    cost evaluation watched and every call timed as the problem's."""
    import pymanopt

    p = mon.p

    @pymanopt.function.numpy(manifold)
    def cost(G, H):
        value = mon.timed(p.cost, G, H)
        mon.seen(G, H, value)
        return value

    @pymanopt.function.numpy(manifold)
    def egrad(G, H):
        mon.iterations += 1
        return mon.timed(p.gradient, G, H)

    @pymanopt.function.numpy(manifold)
    def ehess(G, H, dG, dH):
        return mon.timed(p.hessian, G, H, dG, dH)

    return pymanopt.Problem(manifold, cost, euclidean_gradient=egrad,
                            euclidean_hessian=ehess if hessian else None)


def run_pymanopt(problem: Completion, method: str, budget: float, retraction: str = "second_order"):
    import pymanopt
    from pymanopt.manifolds import FixedRankEmbedded
    from pymanopt.optimizers import ConjugateGradient, TrustRegions
    from quotient_manifolds.pymanopt import GLQuotient

    mon = Monitor(problem, budget)
    p = problem
    if method == "fixedrank-cg":
        M = FixedRankEmbedded(p.n, p.m, p.r)

        @pymanopt.function.numpy(M)
        def cost(u, s, vt):
            G, H = u * s, vt.T
            value = mon.timed(p.cost, G, H)
            mon.seen(G, H, value)
            return value

        @pymanopt.function.numpy(M)
        def egrad(u, s, vt):
            mon.iterations += 1
            gG, gH = mon.timed(p.gradient, u * s, vt.T)  # ∂/∂G, ∂/∂H at (G, H) = (U diag(s), V)
            return gG * s, np.einsum("ij,ij->j", u, gG), gH.T

        Q1, R1 = np.linalg.qr(p.G0)
        Q2, R2 = np.linalg.qr(p.H0)
        Us, S, Vts = np.linalg.svd(R1 @ R2.T)
        x0 = (Q1 @ Us, S, (Q2 @ Vts.T).T)
        problem_ = pymanopt.Problem(M, cost, euclidean_gradient=egrad)
    else:
        M = GLQuotient(p.n, p.m, p.r, metric=method.split("-")[0], retraction=retraction)
        x0 = (p.G0.copy(), p.H0.copy())
        problem_ = _watched_problem(M, mon, hessian=method.endswith("tr"))
    stop = dict(max_time=math.inf, max_iterations=10 ** 7, min_gradient_norm=0.0, min_step_size=0.0,
                max_cost_evaluations=10 ** 8, verbosity=0)
    optimizer = (TrustRegions(kappa=TR_KAPPA, **stop) if method.endswith("tr")
                 else ConjugateGradient(**stop))
    mon.start = time.process_time()
    try:
        if method.endswith("tr"):
            # pymanopt's default trust-region radius is typical_dist = 10h, in metric units; a
            # mix length is the size of the change of G Hᵀ, so the radius must scale with the
            # matrix (the user guide's rule): ‖G₀H₀ᵀ‖_F, from the first step on (pymanopt's
            # default start is an eighth of it)
            radius = (dict(Delta_bar=p.norm_x0, Delta0=p.norm_x0) if method.startswith("mix")
                      else {})
            optimizer.run(problem_, initial_point=x0, maxinner=min(M.dim, TR_MAX_INNER), **radius)
        else:
            optimizer.run(problem_, initial_point=x0)
    except (Reached, OutOfBudget):
        pass
    if method.endswith("tr"):  # one cost evaluation per outer iteration (the gradient is asked
        mon.iterations = mon.evaluations   # again in every Hessian-vector product)
    return mon


#: Inner (truncated CG) iterations per trust-region step, at most. pymanopt's default, the
#: manifold's dimension, lets steps near the solution take up to 55 Hessian-vector products
#: (the sampled Hessian is ill-conditioned there). With this cap and the initial radius above,
#: mix TR reached 1e-10 at 5000² in 28.5–28.6 CPU s instead of 42.2 with pymanopt's defaults (the
#: cap alone: 42.3 s), at 1000² in 0.83–0.87 s instead of 1.04–1.08, at 200 × 500 in 0.25–0.26 s
#: instead of 0.29–0.30 (one session, seed 0).
TR_MAX_INNER = 20

#: The linear rate of the trust-region inner solve: truncated CG stops once the residual is below
#: ‖r₀‖ min(κ, ‖r₀‖^θ) (θ = 1: the superlinear phase near a solution is unchanged). pymanopt's
#: default κ = 0.1 asks for tenfold reductions far from the solution, where an inexact step does
#: as well. κ = 0.5 was as fast or faster on every row (one session, seed 0, CPU s, κ = 0.1 →
#: 0.5): 200 × 500 random start 0.26 → 0.23, spectral 0.16 → 0.16; 1000² 0.90 → 0.89 and
#: 0.56 → 0.45; 5000² 26.0 → 16.2 and 3.60 → 3.06. κ = 0.9 was faster still at 5000² from a random
#: start (10.8 s) but slower on the other five.
TR_KAPPA = 0.5

#: CG iterations of each rank below r in the rank continuation (the last rank runs to the target)
RANK_STAGE_ITERATIONS = 400


def run_rank_continuation(problem: Completion, method: str, budget: float,
                          retraction: str = "second_order"):
    """Mix + CG over the ranks 1, 2, …, r (the fixed-rank quotients GLQuotient(n, m, k)): rank 1
    from the top singular pair of the observed entries (scaled by nm/|Ω|), each next rank from the
    current factors and the top singular pair of the residual's negative, the pair split evenly
    between G and H. A rank k < r fits what it can in :data:`RANK_STAGE_ITERATIONS` iterations;
    rank r runs to the target. Where the singular values span many decades, a rank-r start fits
    the observed entries with a wrong matrix (a slow valley of the cost, from every start we
    tried), while each rank here only resolves its own next singular value.

    The line search is pymanopt's backtracking one, whose first trial step of each rank is the
    gradient step of the user guide's SGD rule, nm/|Ω| times the mix gradient (with all entries
    observed the mix metric makes the cost's Hessian the identity; sampling scales it by
    |Ω|/nm). pymanopt's default for CG tries a metric length of 1 first, which here jumps to a
    worse fit, leaves the manifold, or is rejected where the cost is tiny; after one rejected
    search it tries a step of 0 forever."""
    from pymanopt.optimizers import ConjugateGradient
    from pymanopt.optimizers.line_search import BackTrackingLineSearcher
    from quotient_manifolds.pymanopt import GLQuotient

    mon = Monitor(problem, budget)
    p = problem
    G, H = p.spectral(p.vals, 1)
    try:
        for rank in range(1, p.r + 1):
            M = GLQuotient(p.n, p.m, rank, metric="mix", retraction=retraction)
            last = rank == p.r
            step = p.scale * M.norm((G, H), M.euclidean_to_riemannian_gradient(
                (G, H), mon.timed(p.gradient, G, H)))
            optimizer = ConjugateGradient(
                line_searcher=BackTrackingLineSearcher(initial_step_size=step),
                max_time=math.inf, max_iterations=10 ** 7 if last else RANK_STAGE_ITERATIONS,
                min_gradient_norm=0.0, min_step_size=0.0, max_cost_evaluations=10 ** 8, verbosity=0)
            G, H = optimizer.run(_watched_problem(M, mon), initial_point=(G, H)).point
            if not last:
                g, h = p.spectral(-mon.timed(p.residual, G, H), 1)
                G, H = np.hstack([G, g]), np.hstack([H, h])
    except (Reached, OutOfBudget):
        pass
    return mon


def scaled_lr(base: float, problem: Completion) -> float:
    """``base`` × nm/|Ω|: the cost sums over the |Ω| observed entries only, so its (mix-metric)
    Riemannian gradient is about |Ω|/nm times the full-observation one."""
    return base * problem.scale


#: geoopt learning rates (the user guide's rules). SGD: the mix metric's step is scale-free, a
#: multiple of nm/|Ω| (:func:`scaled_lr`); the inv metric's grows with ‖G‖²‖H‖², so its rate is
#: also divided by the target's mean squared singular value. Adam: lr is a step length in the
#: metric, which under mix is the Frobenius size of the change of G Hᵀ: lr = c·‖G₀H₀ᵀ‖_F.
GEOOPT_LR = {"geoopt-mix-sgd": 0.5, "geoopt-mix-adam": 1.0, "geoopt-inv-sgd": 0.3}


def run_geoopt(problem: Completion, method: str, budget: float, retraction: str = "second_order"):
    import geoopt
    from quotient_manifolds import GLQuotient

    p = problem
    metric = method.split("-")[1]
    M = GLQuotient(p.n, p.m, p.r, metric=metric, retraction=retraction)
    x = geoopt.ManifoldParameter(torch.from_numpy(np.concatenate((p.G0, p.H0))), manifold=M)
    if method.endswith("adam"):
        lr = GEOOPT_LR[method] * p.norm_x0
    else:
        lr = scaled_lr(GEOOPT_LR[method], p)
        if metric == "inv":
            lr /= p.norm_target ** 2 / p.r       # the mean squared singular value of the target
    if method.endswith("adam"):
        opt = geoopt.optim.RiemannianAdam([x], lr=lr)
    else:
        opt = geoopt.optim.RiemannianSGD([x], lr=lr)
    mon = Monitor(p, budget)
    mon.start = time.process_time()
    data = x.data.numpy()
    try:
        while True:
            G, H = data[:p.n], data[p.n:]
            mon.seen(G, H, mon.timed(p.cost, G, H))
            mon.iterations += 1
            gG, gH = mon.timed(p.gradient, G, H)
            x.grad = torch.from_numpy(np.concatenate((gG, gH)))
            opt.step()
            data = x.data.numpy()
    except (Reached, OutOfBudget):
        pass
    return mon


def _row(row: str, method: str, results, budget: float) -> str:
    """The table row of one method: medians over its runs."""
    within = sum(r[0] for r in results)
    t, iterations, per_iter, own, err = (float(np.median([r[i] for r in results]))
                                          for i in range(1, 6))
    reached = (f"{t:.2f}" if within == len(results) else f"— (not within {t:.0f} s)"
               if not within else f"— ({within} of {len(results)} runs within {budget:g} s)")
    return (f"| {row} | {LABELS[method]} | {reached} | {iterations:.0f} | {per_iter:.2f} | "
            f"{own:.2f} | {err:.1e} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=["200x500", "1000", "ill"], choices=list(ROWS))
    ap.add_argument("--large", action="store_true", help="also the 5000² row (minutes)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--budget", type=float, default=30.0, help="CPU seconds per method and row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retraction", default="second_order", choices=("second_order", "first_order"),
                    help="the retraction of our manifolds (FixedRankEmbedded keeps its own)")
    ap.add_argument("--start", default="random", choices=("random", "spectral"),
                    help="the start X₀ of every method (the rank continuation makes its own)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per method and row, interleaved; the table shows medians")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    torch.set_num_threads(1)
    rows = list(args.rows) + (["5000"] if args.large and "5000" not in args.rows else [])
    print(f"# bench_completion: CPU seconds (process_time, 1 thread) to relative error {TARGET:g} on "
          f"all entries; budget {args.budget:g} s; seed {args.seed}; torch {torch.__version__}; "
          f"median of {args.repeats} interleaved run(s); our retraction {args.retraction}; "
          f"{args.start} start")
    print("| problem | method | CPU s to 1e-10 | iterations | ms / iteration | of which manifold + "
          "optimizer | best err |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        spec = ROWS[row]
        n, m, r = spec["n"], spec["m"], spec["r"]
        problem = Completion(n, m, r, spec["observed"](n, m, r), spec["cond"], args.seed,
                             args.start)
        runs = {method: [] for method in args.methods}
        for repeat in range(args.repeats):
            for method in args.methods:
                runner = (run_geoopt if method.startswith("geoopt") else run_rank_continuation
                          if method == "mix-cg-ranks" else run_pymanopt)
                mon = runner(problem, method, args.budget, args.retraction)
                t = mon.reached_at if mon.reached_at is not None else mon.elapsed()
                err = TARGET if mon.reached_at is not None else problem.error(*mon.best)
                runs[method].append((mon.reached_at is not None, t, mon.iterations,
                                     1e3 * t / max(mon.iterations, 1),
                                     1e3 * (t - mon.user) / max(mon.iterations, 1), err))
                if repeat == args.repeats - 1:   # this method's runs are complete
                    print(_row(row, method, runs[method], args.budget), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
