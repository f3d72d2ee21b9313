r"""Statistics of the correlation study: Kendall τ (τ-a and τ-b), bootstrap confidence intervals
over models, error rates and the generalisation gap (docs/maths.md §11.1).

Everything is plain numpy, O(M²) in the number of models M (M ≤ a few hundred here).

* τ-a = 2/(M(M−1)) Σ_{i<j} sign(xᵢ−xⱼ) sign(yᵢ−yⱼ)  (the paper's formula, docs/maths.md §11.1);
* τ-b = Σ_{i<j} sign·sign / √(Σ sign(Δx)² · Σ sign(Δy)²), which corrects for ties and equals
  ``scipy.stats.kendalltau`` (its default variant); τ-a = τ-b when there are no ties.
* :func:`bootstrap_ci` resamples *models* (pairs (xᵢ, yᵢ)) with replacement. Resamples contain
  duplicated models, i.e. ties, so the bootstrap uses τ-b by default (τ-a would be biased towards 0).
* partial τ (Kendall 1942), the association of x and y with z held fixed:
  τ_xy·z = (τ_xy − τ_xz τ_yz) / √((1 − τ_xz²)(1 − τ_yz²)), from τ-b. The population studies use it
  with z = training loss: sharpness grows as a model fits its data, and so does the gap. It is a
  descriptive adjustment, not a test of conditional independence (it is not 0 in general when x
  and y are related only through z).
* within-group τ (:func:`within_tau_with_ci`): only pairs of models that share a group (e.g. a data
  draw) count; the bootstrap resamples models within each group.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple

import numpy as np

__all__ = ["kendall_tau_a", "kendall_tau_b", "kendall_tau", "partial_kendall_tau", "bootstrap_ci",
           "TauResult", "tau_with_ci", "partial_tau_with_ci", "error_rate", "error_and_loss",
           "generalization_gap", "DeltaTauResult", "bootstrap_weights",
           "paired_delta_tau", "tau_ci_weighted", "within_tau_with_ci",
           "within_partial_tau_with_ci", "r_squared", "dummies", "mean_std"]


def _pairs(x, y):
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.ndim != 1 or y.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"x and y must be 1-D of equal length, got shapes {x.shape} and {y.shape}")
    if x.size < 2:
        raise ValueError("Kendall τ needs at least 2 observations")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("Kendall τ: x and y must be finite")
    iu = np.triu_indices(x.size, k=1)
    sx = np.sign(x[:, None] - x[None, :])[iu]
    sy = np.sign(y[:, None] - y[None, :])[iu]
    return sx, sy


def kendall_tau_a(x: Sequence[float], y: Sequence[float]) -> float:
    """τ-a = (concordant − discordant) / (M(M−1)/2); ties count 0 (docs/maths.md §11.1)."""
    sx, sy = _pairs(x, y)
    return float((sx * sy).sum() / sx.size)


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float:
    """τ-b (tie-corrected; equals ``scipy.stats.kendalltau``). ``nan`` if x or y is constant."""
    sx, sy = _pairs(x, y)
    den = math.sqrt(float((sx * sx).sum()) * float((sy * sy).sum()))
    return float((sx * sy).sum() / den) if den > 0 else float("nan")


def kendall_tau(x, y, variant: str = "b") -> float:
    if variant == "a":
        return kendall_tau_a(x, y)
    if variant == "b":
        return kendall_tau_b(x, y)
    raise ValueError(f"unknown Kendall τ variant {variant!r}; valid: 'a', 'b'")


def _partial(t_xy, t_xz, t_yz):
    with np.errstate(invalid="ignore", divide="ignore"):
        return (t_xy - t_xz * t_yz) / np.sqrt((1 - t_xz ** 2) * (1 - t_yz ** 2))


def partial_kendall_tau(x: Sequence[float], y: Sequence[float], z: Sequence[float]) -> float:
    """Partial τ-b of x and y given z: (τ_xy − τ_xz τ_yz) / √((1 − τ_xz²)(1 − τ_yz²)).

    ``nan`` where z ranks like x or y exactly (|τ| = 1: nothing is left once z is held fixed).
    """
    _pairs(x, z)  # validation of the third column
    return float(_partial(kendall_tau_b(x, y), kendall_tau_b(x, z), kendall_tau_b(y, z)))


def _tau_b_batch(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """τ-b of each row pair of x, y (shape (B, M)), vectorised."""
    sx = np.sign(x[:, :, None] - x[:, None, :])
    sy = np.sign(y[:, :, None] - y[:, None, :])
    num = (sx * sy).sum(axis=(1, 2))
    den = np.sqrt((sx * sx).sum(axis=(1, 2)) * (sy * sy).sum(axis=(1, 2)))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def bootstrap_ci(x: Sequence[float], y: Sequence[float], *, statistic: Optional[Callable] = None,
                 n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple:
    """Percentile bootstrap CI of ``statistic(x, y)`` (default Kendall τ-b), resampling models.

    Returns ``(low, high)``. Resamples where the statistic is undefined (e.g. all x equal) are
    dropped; ``(nan, nan)`` if fewer than half of them are usable.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    _pairs(x, y)  # validation
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be ≥ 1, got {n_boot}")
    idx = _resamples(x.size, n_boot, seed)
    if statistic is None:
        stats = np.concatenate([_tau_b_batch(x[chunk], y[chunk]) for chunk in _chunks(idx)])
    else:
        stats = np.array([statistic(x[i], y[i]) for i in idx], dtype=float)
    return _percentile_ci(stats, n_boot, level)


def _resamples(m: int, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, m) model indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, m, size=(n_boot, m))


def _chunks(idx: np.ndarray):
    return np.array_split(idx, max(1, idx.shape[0] // 250))  # bounds the (chunk, M, M) sign arrays


def _percentile_ci(stats: np.ndarray, n_boot: int, level: float) -> tuple:
    """Percentile interval of the finite resampled statistics; nan if fewer than half are."""
    stats = stats[np.isfinite(stats)]
    if stats.size < n_boot / 2:
        return (float("nan"), float("nan"))
    a = (1 - level) / 2
    return (float(np.quantile(stats, a)), float(np.quantile(stats, 1 - a)))


class _Estimate:
    """``as_dict`` and ``fmt`` of the result dataclasses; ``_point`` names the estimate's field."""
    _point = ""
    _bare_without_ci = False  # fmt: the estimate alone when there is no CI (else it says why)
    #: what fmt says in place of a CI that is undefined: fewer than 3 models, or too few resamples
    #: with a defined estimate (e.g. the ties of a handful of models)
    NO_CI = "CI n/a: too few models"

    def as_dict(self) -> dict:
        return asdict(self)

    def fmt(self) -> str:
        """"+0.12 [+0.01, +0.20]" (the estimate and its CI); "n/a" if the estimate is undefined;
        "+0.12 [CI n/a: too few models]" if only the CI is (never "[nan, nan]")."""
        value, low, high = getattr(self, self._point), self.ci_low, self.ci_high
        if not math.isfinite(value):
            return "n/a"
        if not (math.isfinite(low) and math.isfinite(high)):
            return f"{value:+.2f}" if self._bare_without_ci else f"{value:+.2f} [{self.NO_CI}]"
        return f"{value:+.2f} [{low:+.2f}, {high:+.2f}]"


@dataclass
class TauResult(_Estimate):
    tau_b: float
    tau_a: float
    ci_low: float
    ci_high: float
    n: int
    _point = "tau_b"


def tau_with_ci(x, y, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> TauResult:
    """τ-b, τ-a and the bootstrap CI (of τ-b) in one go; needs ≥ 2 models (else all nan)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size < 2:
        return TauResult(float("nan"), float("nan"), float("nan"), float("nan"), int(x.size))
    lo, hi = (bootstrap_ci(x, y, n_boot=n_boot, level=level, seed=seed) if x.size >= 3
              else (float("nan"), float("nan")))
    return TauResult(kendall_tau_b(x, y), kendall_tau_a(x, y), lo, hi, int(x.size))


def partial_tau_with_ci(x, y, z, *, n_boot: int = 2000, level: float = 0.95,
                        seed: int = 0) -> TauResult:
    """Partial τ-b of x, y given z with a bootstrap CI that resamples models (x, y, z together).

    The ``tau_a`` field holds the same partial τ-b (there is no tie-free variant of interest)."""
    x, y, z = (np.asarray(v, dtype=float) for v in (x, y, z))
    if not x.shape == y.shape == z.shape or x.ndim != 1:
        raise ValueError(f"x, y and z must be 1-D of equal length, got shapes {x.shape}, "
                         f"{y.shape} and {z.shape}")
    keep = np.isfinite(x) & np.isfinite(y) & np.isfinite(z)
    x, y, z = x[keep], y[keep], z[keep]
    if x.size < 3:
        return TauResult(float("nan"), float("nan"), float("nan"), float("nan"), int(x.size))
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    idx = _resamples(x.size, n_boot, seed)
    stats = np.concatenate([_partial(_tau_b_batch(x[c], y[c]), _tau_b_batch(x[c], z[c]),
                                     _tau_b_batch(y[c], z[c])) for c in _chunks(idx)])
    lo, hi = _percentile_ci(stats, n_boot, level)
    t = partial_kendall_tau(x, y, z)
    return TauResult(t, t, lo, hi, int(x.size))


def error_rate(predictions, labels) -> float:
    """Fraction of mismatches; ``predictions`` may be class indices (1-D) or logits/scores (2-D)."""
    p = np.asarray(predictions)
    t = np.asarray(labels)
    if p.ndim == 2:
        p = p.argmax(axis=1)
    if p.shape != t.shape:
        raise ValueError(f"predictions {p.shape} and labels {t.shape} differ in shape")
    if t.size == 0:
        raise ValueError("error rate of an empty set")
    return float((p != t).mean())


def error_and_loss(logits, labels) -> tuple:
    """(error rate, mean cross-entropy) of class logits (M, C) against integer labels (M,)."""
    z = np.asarray(logits, dtype=np.float64)
    t = np.asarray(labels)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return error_rate(z, t), float(-logp[np.arange(t.size), t].mean())


def generalization_gap(test_error: float, train_error: float) -> float:
    """Generalisation gap = test error − train error (the ImageNet/MNLI protocol,
    docs/maths.md §11.1)."""
    for name, v in (("test_error", test_error), ("train_error", train_error)):
        if not (isinstance(v, (int, float, np.floating)) and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(test_error) - float(train_error)


def mean_std(values: Iterable[Optional[float]], *,
             sd_of_one: float = float("nan")) -> Tuple[float, float]:
    """(mean, sample standard deviation √(Σ(vᵢ − v̄)² / (n − 1))) of the finite values (``None``
    and non-finite values are left out); ``(nan, nan)`` when none is left. With one value the
    sample standard deviation is undefined: ``sd_of_one`` stands for it (default ``nan``)."""
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if a.size == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else float(sd_of_one)


def r_squared(y: Sequence[float], *columns) -> float:
    """R² = 1 − Σ residual² / Σ (y − ȳ)² of the least-squares fit of y on an intercept and
    ``columns`` (each (m,) or (m, p)); ``nan`` if y is constant."""
    y = np.asarray(y, float)
    A = np.column_stack([np.ones_like(y)] + [np.asarray(c, float).reshape(y.size, -1)
                                             for c in columns])
    resid = y - A @ np.linalg.lstsq(A, y, rcond=None)[0]
    total = float(((y - y.mean()) ** 2).sum())
    return 1 - float((resid ** 2).sum()) / total if total > 0 else float("nan")


def dummies(values: Sequence[Any]) -> np.ndarray:
    """One-hot columns of a categorical variable for :func:`r_squared`, the first level (in sorted
    order) dropped: the intercept stands for it. Shape (m, levels − 1)."""
    values = np.asarray(values)
    levels = sorted(set(values.tolist()))
    return np.column_stack([(values == lv).astype(float) for lv in levels[1:]]) if len(levels) > 1 \
        else np.zeros((values.size, 0))


# ------------------------------------------------------------------ weighted (resampling) bootstrap
# A bootstrap resample is a vector of multiplicities w (how often each model was drawn). The τ-b of
# the resample is  wᵀ(Sx∘Sy)w / √(wᵀSx²w · wᵀSy²w)  with S_ij = sign(vᵢ − vⱼ): every ordered pair of
# copies contributes S_ij (copies of one model: sign 0). Written this way, a plain, a clustered
# (whole clusters drawn) and a stratified (models drawn within each stratum) bootstrap differ only
# in how w is drawn, and two measures share one w: the *paired* bootstrap of Δτ.
@dataclass
class DeltaTauResult(_Estimate):
    """Δτ = τ-b(x₁, y) − τ-b(x₂, y) on the same models, with a paired bootstrap CI."""
    delta: float
    ci_low: float
    ci_high: float
    tau_1: float
    tau_2: float
    n: int
    _point = "delta"
    _bare_without_ci = True


def bootstrap_weights(n: int, *, n_boot: int, seed: int, clusters: Optional[Sequence] = None,
                      strata: Optional[Sequence] = None) -> np.ndarray:
    """(n_boot, n) multiplicities of the n models in each bootstrap resample.

    * plain (neither given): n models drawn with replacement — the same draws as
      :func:`bootstrap_ci` with the same seed;
    * ``clusters`` (a label per model): as many clusters as there are drawn with replacement, each
      drawn cluster contributing all its models (the unit when models share a data draw);
    * ``strata`` (a label per model): within each stratum, as many models as it holds drawn with
      replacement from it (strata keep their sizes).
    """
    if clusters is not None:
        if strata is not None:
            raise ValueError("pass clusters or strata, not both")
        member = _membership(clusters, n)
        return _cluster_counts(member.shape[0], n_boot, seed) @ member
    rng = np.random.default_rng(seed)
    if strata is None:
        return _row_counts(rng.integers(0, n, size=(n_boot, n)), n)
    w = np.zeros((n_boot, n))
    for row in _membership(strata, n):
        pos = np.flatnonzero(row)
        w += _row_counts(pos[rng.integers(0, pos.size, size=(n_boot, pos.size))], n)
    return w


def _row_counts(idx: np.ndarray, n: int) -> np.ndarray:
    """(rows, n) float counts of the values 0..n−1 in each row of the integer array ``idx``: one
    ``bincount`` over row-offset indices (a Python loop over 40,000 resamples took seconds)."""
    rows = idx.shape[0]
    flat = (idx + n * np.arange(rows)[:, None]).ravel()
    return np.bincount(flat, minlength=rows * n).reshape(rows, n).astype(float)


def _membership(labels: Sequence, n: int) -> np.ndarray:
    """(K, n) 0/1 matrix: model i belongs to the k-th distinct label (in order of appearance)."""
    labels = np.asarray(labels)
    if labels.shape != (n,):
        raise ValueError(f"need one cluster/stratum label per model ({n}), got shape "
                         f"{labels.shape}")
    return np.stack([labels == lv for lv in dict.fromkeys(labels.tolist())]).astype(float)


def _cluster_counts(k: int, n_boot: int, seed: int) -> np.ndarray:
    return _row_counts(np.random.default_rng(seed).integers(0, k, size=(n_boot, k)), k)


def _quad(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """wᵀ A w for every row w of ``w``."""
    return np.einsum("bi,bi->b", w @ a, w)


def _weighted_taus(columns, y, *, n_boot: int, seed: int, clusters=None, strata=None,
                   within: bool = False):
    """Point τ-b of each column with y and its (n_boot,) bootstrap replicates, all columns sharing
    each resample. Inputs already finite and of one length."""
    n = y.size
    mask = 1.0
    if within:
        if strata is None:
            raise ValueError("within=True compares pairs inside strata: pass strata")
        mask = (np.asarray(strata)[:, None] == np.asarray(strata)[None, :]).astype(float)
    sy = np.sign(y[:, None] - y[None, :]) * mask
    mats = [(sx * sy, sx * sx) for sx in (np.sign(c[:, None] - c[None, :]) * mask
                                           for c in columns)]
    mats.append((sy * sy, None))
    if clusters is not None:  # weights are constant on clusters: sum each matrix over blocks
        member = _membership(clusters, n)
        mats = [tuple(None if a is None else member @ a @ member.T for a in m) for m in mats]
        w = _cluster_counts(member.shape[0], n_boot, seed)
        ones = np.ones((1, member.shape[0]))
    else:
        w = bootstrap_weights(n, n_boot=n_boot, seed=seed, strata=strata)
        ones = np.ones((1, n))
    out = []
    for ww in (ones, w):
        dy = _quad(ww, mats[-1][0])
        with np.errstate(invalid="ignore", divide="ignore"):
            out.append([_quad(ww, a) / np.sqrt(_quad(ww, b) * dy) for a, b in mats[:-1]])
    return [float(t[0]) for t in out[0]], out[1]


def _finite_rows(*cols):
    cols = [np.asarray(c, dtype=float) for c in cols]
    if any(c.ndim != 1 or c.shape != cols[0].shape for c in cols):
        raise ValueError(f"inputs must be 1-D of equal length, got shapes "
                         f"{[c.shape for c in cols]}")
    return np.all([np.isfinite(c) for c in cols], axis=0)


def paired_delta_tau(x1, x2, y, *, n_boot: int, seed: int, level: float = 0.95,
                     clusters: Optional[Sequence] = None, strata: Optional[Sequence] = None,
                     within: bool = False) -> DeltaTauResult:
    """Δτ = τ-b(x₁, y) − τ-b(x₂, y) with a paired percentile bootstrap: each resample of the models
    (:func:`bootstrap_weights`: plain, ``clusters`` or ``strata``) gives both τ's, so the CI is
    that of the difference, not of two independent intervals.

    ``within``: only pairs of models that share a stratum (``strata`` required) count, i.e. τ-b
    over within-stratum pairs Σ_g Σ_{i<j∈g} sign·sign / √(Σ_g Σ sign(Δx)² · Σ_g Σ sign(Δy)²).
    Models where x₁, x₂ or y is not finite are left out (``n`` says how many are used).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    keep = _finite_rows(x1, x2, y)
    sel = [None if v is None else np.asarray(v)[keep] for v in (clusters, strata)]
    x1, x2, y = (np.asarray(v, dtype=float)[keep] for v in (x1, x2, y))
    nan = float("nan")
    if y.size < 3:
        return DeltaTauResult(nan, nan, nan, nan, nan, int(y.size))
    (t1, t2), (b1, b2) = _weighted_taus([x1, x2], y, n_boot=n_boot, seed=seed, clusters=sel[0],
                                        strata=sel[1], within=within)
    lo, hi = _percentile_ci(b1 - b2, n_boot, level)
    return DeltaTauResult(t1 - t2, lo, hi, t1, t2, int(y.size))


def tau_ci_weighted(x, y, *, n_boot: int, seed: int, level: float = 0.95,
                    clusters: Optional[Sequence] = None, strata: Optional[Sequence] = None,
                    within: bool = False) -> TauResult:
    """τ-b of x and y with a percentile CI from :func:`bootstrap_weights` (e.g. ``clusters``: whole
    data draws resampled). ``tau_a`` holds τ-a of all pairs (``within``: the within-stratum τ-b)."""
    keep = _finite_rows(x, y)
    sel = [None if v is None else np.asarray(v)[keep] for v in (clusters, strata)]
    x, y = np.asarray(x, float)[keep], np.asarray(y, float)[keep]
    nan = float("nan")
    if y.size < 3:
        return TauResult(nan, nan, nan, nan, int(y.size))
    (t,), (b,) = _weighted_taus([x], y, n_boot=n_boot, seed=seed, clusters=sel[0],
                                strata=sel[1], within=within)
    lo, hi = _percentile_ci(b, n_boot, level)
    return TauResult(t, t if within else kendall_tau_a(x, y), lo, hi, int(y.size))


def _in_shared_groups(columns, groups):
    """The rows of ``columns`` (1-D, one length) where every column is finite and whose group holds
    at least two such rows (only those form within-group pairs), and their group labels."""
    keep = _finite_rows(*columns)
    groups = np.asarray(groups)[keep]
    counts = Counter(groups.tolist())
    shared = np.array([counts[g] >= 2 for g in groups.tolist()], dtype=bool)
    return [np.asarray(c, dtype=float)[keep][shared] for c in columns], groups[shared]


def within_tau_with_ci(x: Sequence[float], y: Sequence[float], groups: Sequence, *,
                       n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> TauResult:
    """τ-b over the pairs of models that share a group (a data draw), i.e. Σ_g Σ_{i<j∈g}
    sign(Δx)sign(Δy) / √(Σ_g Σ sign(Δx)² · Σ_g Σ sign(Δy)²); with one group it is τ-b. The
    bootstrap resamples models within each group (:func:`bootstrap_weights` with ``strata``).
    ``tau_a`` holds the same value; ``n`` counts the models with finite x, y in groups of ≥ 2."""
    (x, y), groups = _in_shared_groups([x, y], groups)
    if y.size < 2:
        return TauResult(float("nan"), float("nan"), float("nan"), float("nan"), int(y.size))
    (t,), (b,) = _weighted_taus([x], y, n_boot=n_boot, seed=seed, strata=groups, within=True)
    lo, hi = _percentile_ci(b, n_boot, level)
    return TauResult(t, t, lo, hi, int(y.size))


def within_partial_tau_with_ci(x: Sequence[float], y: Sequence[float], z: Sequence[float],
                               groups: Sequence, *, n_boot: int = 2000, level: float = 0.95,
                               seed: int = 0) -> TauResult:
    """Kendall's partial τ of x and y given z built from within-group τ-b's (pairs of models of
    the same group only, :func:`within_tau_with_ci`):
    (τ_xy − τ_xz τ_yz) / √((1 − τ_xz²)(1 − τ_yz²)); the three τ's share each resample (models
    resampled within groups). Needs ≥ 3 models in shared groups (else all nan)."""
    (x, y, z), groups = _in_shared_groups([x, y, z], groups)
    if y.size < 3:
        return TauResult(float("nan"), float("nan"), float("nan"), float("nan"), int(y.size))
    kw = dict(n_boot=n_boot, seed=seed, strata=groups, within=True)
    (t_xz, t_yz), (b_xz, b_yz) = _weighted_taus([x, y], z, **kw)
    (t_xy,), (b_xy,) = _weighted_taus([x], y, **kw)
    t = float(_partial(t_xy, t_xz, t_yz))
    lo, hi = _percentile_ci(_partial(b_xy, b_xz, b_yz), n_boot, level)
    return TauResult(t, t, lo, hi, int(y.size))
