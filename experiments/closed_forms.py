r"""The closed forms of the diagonal-network study (``quotient-manifolds diagonal``): the product
β = u⊙v along a horizontal geodesic of the rescaling quotient, the exact geodesic sharpness of a
least-squares loss with orthonormal inputs (XᵀX = I), and the diagonal trust-region subproblem
both reduce to (docs/maths.md §8.3–§8.6). They serve the study and its checks, not the library's
measures: :func:`quotient_manifolds.adapters.sharpness` needs none of them.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np
import torch

from quotient_manifolds.core.gl import as_metric
from quotient_manifolds.core.metrics import GLMetric

Tensor = torch.Tensor

__all__ = ["beta_along_geodesic", "sharpness_mix_orthonormal", "sharpness_inv_orthonormal_second_order",
           "diagonal_trust_region"]


def beta_along_geodesic(beta0: Tensor, b: Tensor, metric: "str | GLMetric", t: float = 1.0) -> Tensor:
    """β(t) = u(t)⊙v(t) along the horizontal geodesic with coefficient b (docs/maths.md §8.3).

    inv: β₀ ⊙ e^{2bt};  mix: β₀ ⊙ (1 + 2bt) (polynomial, so it extends past 1 + 2bt ≤ 0).
    """
    return beta0 * as_metric(metric).gl1_beta_scale(b, t)


def sharpness_mix_orthonormal(beta0: Tensor, beta_star: Tensor, rho: float) -> Tensor:
    """Exact geodesic mix sharpness of L(β) = ‖Xβ − y‖² with XᵀX = I (docs/maths.md §8.5):

        S_mix(ρ) = max_{‖δ‖ ≤ ρ/√2} 4δᵀ(β₀ − β*) + 4‖δ‖² = 2√2 ρ ‖β₀ − β*‖₂ + 2ρ²,

    with β* = Xᵀy, δ = β₀⊙b and ‖ξ‖² = 2‖β₀⊙b‖² (the paper drops the √2; docs/maths.md §12.4).
    """
    return 2 * math.sqrt(2) * rho * torch.linalg.vector_norm(beta0 - beta_star, dim=-1) + 2 * rho ** 2


def sharpness_inv_orthonormal_second_order(beta0: Tensor, beta_star: Tensor, rho: float) -> Tensor:
    """Second-order inv sharpness with XᵀX = I (docs/maths.md §8.5, paper Eqs. 26–29, corrected √2):

        max_{‖b‖ ≤ ρ/√2} 4bᵀr + 4bᵀDb,   r = β₀⊙(β₀ − β*),  D = diag(β₀⊙(2β₀ − β*)),

    a trust-region subproblem with a diagonal quadratic (:func:`diagonal_trust_region`). Works on
    1-D inputs.
    """
    r = beta0 * (beta0 - beta_star)
    D = beta0 * (2 * beta0 - beta_star)
    b = diagonal_trust_region(r, D, rho / math.sqrt(2))
    return 4 * (b @ r) + 4 * (b * D) @ b


def diagonal_trust_region(g: Union[Tensor, np.ndarray], a: Union[Tensor, np.ndarray],
                          radius: float) -> Union[Tensor, np.ndarray]:
    r"""The maximiser x of q(x) = gᵀx + xᵀ diag(a) x over the ball ‖x‖ ≤ R (1-D g and a), through
    the secular equation of this trust-region subproblem.

    Stationarity g + 2a⊙x = 2λx gives x(λ) = g ⊘ (2(λ − a)), with λ ≥ max(a, 0) (KKT), and:

    * the interior point x(0) = −g ⊘ (2a) when a < 0 (q concave) and it lies in the ball;
    * otherwise ‖x(λ)‖ = R, which decreases in λ > max a: λ by bisection, x rescaled to norm R;
    * the hard case, g (nearly) 0 where a is largest so that ‖x(λ)‖ ≤ R as λ → max a: x(max a) on the
      other coordinates, the rest of the norm along the top one.

    numpy arrays are computed as float64 tensors and given back as numpy arrays.
    """
    if isinstance(g, np.ndarray):
        return diagonal_trust_region(torch.from_numpy(g), torch.from_numpy(np.asarray(a)), radius).numpy()
    R = float(radius)
    amax = float(a.max())

    def xnorm(lam: float) -> float:
        return float(torch.linalg.vector_norm(g / (2 * (lam - a))))

    if amax < 0 and xnorm(0.0) <= R:
        return g / (-2 * a)
    if xnorm(amax + 1e-12 * max(1.0, abs(amax))) <= R:
        x = torch.zeros_like(g)
        mask = a < amax
        x[mask] = g[mask] / (2 * (amax - a[mask]))
        x[int(torch.argmax(a))] += math.sqrt(max(R * R - float(x @ x), 0.0))
        return x
    lo, hi = amax, amax + float(torch.linalg.vector_norm(g)) / (2 * R) + 1e-300
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if xnorm(mid) > R:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * abs(hi):
            break
    x = g / (2 * (hi - a))
    return x * (R / float(torch.linalg.vector_norm(x)))
