"""The weighted bootstrap of experiments.stats (paired Δτ; clustered and stratified resampling)
against brute force: resampled index lists and scipy-free τ-b of the resampled data."""

import numpy as np
import pytest

from quotient_manifolds.experiments.stats import (bootstrap_ci, bootstrap_weights, kendall_tau_b, paired_delta_tau,
                               tau_ci_weighted)


def _data(m=24, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=m)
    x1 = y + rng.normal(size=m)
    x2 = np.round(-0.3 * y + rng.normal(size=m), 1)  # ties
    return x1, x2, y


def _expand(w):
    return np.repeat(np.arange(w.size), w.astype(int))


def test_plain_weights_reproduce_bootstrap_ci():
    x1, _, y = _data()
    t = tau_ci_weighted(x1, y, n_boot=300, seed=3)
    lo, hi = bootstrap_ci(x1, y, n_boot=300, seed=3)
    assert (t.ci_low, t.ci_high) == pytest.approx((lo, hi), abs=1e-12)
    assert t.tau_b == pytest.approx(kendall_tau_b(x1, y), abs=1e-12)


@pytest.mark.parametrize("kind", ["plain", "clusters", "strata"])
def test_paired_delta_matches_brute_force_resamples(kind):
    x1, x2, y = _data()
    labels = np.repeat([0, 1, 2, 3], 6)
    kw = {"plain": {}, "clusters": {"clusters": labels}, "strata": {"strata": labels}}[kind]
    w = bootstrap_weights(y.size, n_boot=50, seed=7, **kw)
    assert (w.sum(axis=1) == y.size).all()
    if kind == "strata":  # strata keep their sizes
        assert (w.reshape(50, 4, 6).sum(axis=2) == 6).all()
    if kind == "clusters":  # a cluster is drawn whole
        assert (w.reshape(50, 4, 6).std(axis=2) == 0).all()
    brute = []
    for row in w:
        i = _expand(row)
        brute.append(kendall_tau_b(x1[i], y[i]) - kendall_tau_b(x2[i], y[i]))
    lo, hi = np.quantile(brute, [0.025, 0.975])
    d = paired_delta_tau(x1, x2, y, n_boot=50, seed=7, **kw)
    assert (d.ci_low, d.ci_high) == pytest.approx((lo, hi), abs=1e-12)
    assert d.delta == pytest.approx(kendall_tau_b(x1, y) - kendall_tau_b(x2, y), abs=1e-12)


def test_within_strata_counts_only_pairs_inside_a_stratum():
    x1, x2, y = _data()
    s = np.repeat([0, 1], 12)
    d = paired_delta_tau(x1, x2, y, n_boot=20, seed=0, strata=s, within=True)
    def within(x):
        num = den_x = den_y = 0.0
        for g in (0, 1):
            k = s == g
            sx = np.sign(x[k][:, None] - x[k][None, :])
            sy = np.sign(y[k][:, None] - y[k][None, :])
            num += (sx * sy).sum(); den_x += (sx * sx).sum(); den_y += (sy * sy).sum()
        return num / np.sqrt(den_x * den_y)
    assert d.tau_1 == pytest.approx(within(x1), abs=1e-12)
    assert d.delta == pytest.approx(within(x1) - within(x2), abs=1e-12)
    with pytest.raises(ValueError, match="strata"):
        paired_delta_tau(x1, x2, y, n_boot=5, seed=0, within=True)


def test_paired_ci_is_narrower_than_the_unpaired_difference_when_measures_agree():
    x1, _, y = _data(40)
    x2 = x1 + np.random.default_rng(1).normal(scale=0.05, size=x1.size)
    d = paired_delta_tau(x1, x2, y, n_boot=400, seed=0)
    assert d.ci_high - d.ci_low < 0.1
    assert np.isnan(paired_delta_tau(x1[:2], x2[:2], y[:2], n_boot=5, seed=0).delta)
