"""The cost code of ``benchmarks/bench_completion.py``, which every method of the completion benchmark
calls: its gradient and Hessian-vector products against finite differences, and its spectral start
against a dense SVD."""

import importlib.util
import os
import pathlib

import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench():
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_completion.py"
    spec = importlib.util.spec_from_file_location("bench_completion", path)
    module = importlib.util.module_from_spec(spec)
    environ = dict(os.environ)   # the script sets thread variables for its own process
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return module


def _directions(seed, n, m, r):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in ((n, r), (m, r), (n, r), (m, r))]


def test_gradient_and_hessian_match_finite_differences(bench):
    p = bench.Completion(30, 40, 3, 300, None, seed=0)
    G, H, dG, dH = _directions(1, 30, 40, 3)
    h = 1e-6
    slope = (p.cost(G + h * dG, H + h * dH) - p.cost(G - h * dG, H - h * dH)) / (2 * h)
    gG, gH = p.gradient(G, H)
    assert np.sum(gG * dG) + np.sum(gH * dH) == pytest.approx(slope, rel=1e-7)
    hG, hH = p.hessian(G, H, dG, dH)
    plus, minus = p.gradient(G + h * dG, H + h * dH), p.gradient(G - h * dG, H - h * dH)
    for exact, a, b in ((hG, plus[0], minus[0]), (hH, plus[1], minus[1])):
        np.testing.assert_allclose(exact, (a - b) / (2 * h), rtol=1e-5, atol=1e-6 * np.abs(exact).max())
    # the rows of the point kept for the Hessian follow the point: a gradient taken elsewhere in
    # between (new arrays) changes nothing, and neither does a point changed in place
    p.gradient(G + 1.0, H)
    again = p.hessian(G, H, dG, dH)
    np.testing.assert_array_equal(again[0], hG)
    np.testing.assert_array_equal(again[1], hH)
    G2 = G.copy()
    p.gradient(G2, H)
    G2 += 0.5
    moved = p.hessian(G2, H, dG, dH)
    fresh = bench.Completion(30, 40, 3, 300, None, seed=0).hessian(G + 0.5, H, dG, dH)
    np.testing.assert_allclose(moved[0], fresh[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(moved[1], fresh[1], rtol=1e-12, atol=1e-12)


def test_spectral_start_is_the_truncated_svd_of_the_rescaled_observations(bench):
    n, m, r, k = 30, 40, 3, 600
    p = bench.Completion(n, m, r, k, None, seed=0, start="spectral")
    dense = np.zeros((n, m))
    dense[p.I, p.J] = p.vals * (n * m / k)
    U, s, Vt = np.linalg.svd(dense)
    np.testing.assert_allclose(p.G0 @ p.H0.T, (U[:, :r] * s[:r]) @ Vt[:r], atol=1e-10)
    assert p.norm_x0 == pytest.approx(np.linalg.norm(s[:r]), rel=1e-12)
    # the default start is random, scaled to the target's norm
    q = bench.Completion(n, m, r, k, None, seed=0)
    assert np.linalg.norm(q.G0 @ q.H0.T) == pytest.approx(q.norm_target, rel=1e-12)
    with pytest.raises(ValueError, match="start must be"):
        bench.Completion(n, m, r, k, None, seed=0, start="svd")


def test_spectral_pairs_are_the_same_run_to_run(bench):
    # ARPACK from a random start vector differs in the last bits from call to call, and the rank
    # continuation's iterations with it (1,719 to 1,764 for one instance)
    p = bench.Completion(200, 300, 5, 8000, None, seed=0)
    first = p.spectral(p.vals, 1)
    for _ in range(4):
        again = p.spectral(p.vals, 1)
        assert np.array_equal(again[0], first[0]) and np.array_equal(again[1], first[1])
