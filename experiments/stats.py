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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["kendall_tau_a", "kendall_tau_b", "kendall_tau", "partial_kendall_tau", "bootstrap_ci",
           "TauResult", "tau_with_ci", "partial_tau_with_ci", "error_rate", "error_and_loss",
           "generalization_gap"]


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


@dataclass
class TauResult:
    tau_b: float
    tau_a: float
    ci_low: float
    ci_high: float
    n: int

    def as_dict(self) -> dict:
        return dict(tau_b=self.tau_b, tau_a=self.tau_a, ci_low=self.ci_low, ci_high=self.ci_high,
                    n=self.n)

    def fmt(self) -> str:
        if not math.isfinite(self.tau_b):
            return "n/a"
        return f"{self.tau_b:+.2f} [{self.ci_low:+.2f}, {self.ci_high:+.2f}]"


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
