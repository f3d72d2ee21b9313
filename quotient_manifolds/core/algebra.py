r"""The Lie algebra of a block's symmetry group, derived numerically, and its closed form.

A block is a pair of factors (G, H) of one head (or one key/value group), and a function of them —
the output of a module or model with everything else fixed. The per-head transformations
(G, H) ↦ (G A, H A⁻ᵀ) that leave the output unchanged form a closed subgroup of GL(h); its
identity component is exp(𝔤) for the Lie algebra

    𝔤 = { Λ ∈ gl(h) : J(GΛ, −HΛᵀ) = 0 },   J = the derivative of the output at (G, H),

the null space of the *linearised invariance condition* Λ ↦ d/dt output(G e^{tΛ}, H e^{−tΛᵀ})|₀.
(If every e^{tΛ} is a symmetry, differentiating at t = 0 gives J(GΛ, −HΛᵀ) = 0; conversely, when
the condition holds at every point of the orbit the flow t ↦ (G e^{tΛ}, H e^{−tΛᵀ}) keeps the output
constant. Evaluated at one generic point, over enough random inputs, the null space is the algebra
of the symmetry group; :func:`derive_algebra` checks that it is closed under the commutator, as
the algebra of a group must be, and a caller verifies the group on the real output with random
finite elements.)

:func:`derive_algebra` computes J on the h² directions Λ = e_i e_jᵀ by forward-mode automatic
differentiation (``torch.func.jvp`` under ``vmap``, in chunks), the singular value decomposition of
the resulting N × h² matrix (via its Gram matrix, refined on the near-null subspace) and keeps the
right singular vectors with σ ≤ rtol·σ_max. :func:`recognise_algebra` returns the closed-form group
with exactly that span when one exists, else a :class:`SubalgebraGroup`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .groups import GLGroup, PAIRINGS, RotaryGroup, SymmetryGroup
from .subalgebra import (
    OrthogonalGroup,
    ScalarGroup,
    ScaledOrthogonalGroup,
    SubalgebraGroup,
    TrivialGroup,
    closure_residual,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class AlgebraDerivation:
    r"""The result of :func:`derive_algebra`.

    * ``basis``: (d, h, h), Frobenius-orthonormal, a basis of the derived algebra 𝔤.
    * ``singular_values``: all h² singular values σ of Λ ↦ J(GΛ, −HΛᵀ) (Λ in Frobenius-orthonormal
      coordinates), descending; the last d are the kept ones (σ ≤ rtol·σ_max).
    * ``gap``: (smallest dropped σ) / (largest kept σ): how cleanly the null space separates from
      the rest (1e6 and more is typical for an exact symmetry, a gap near 1 means the threshold cut
      a continuous spectrum and the result is not trustworthy); ``inf`` when either side is empty
      or the kept values are exactly 0.
    * ``closure_residual``: max ‖[X, Y] − Π_𝔤[X, Y]‖_F over random unit X, Y ∈ 𝔤 (see
      :func:`~quotient_manifolds.core.subalgebra.closure_residual`); ``closed``: whether it is
      below ``closure_rtol``. A null space that is not closed is not the algebra of a group (too
      few inputs, or a threshold in a continuous spectrum).
    * ``rtol``: the threshold used; ``outputs``: N, the number of output numbers.
    """

    basis: Tensor
    singular_values: Tensor
    gap: float
    closed: bool
    closure_residual: float
    rtol: float
    outputs: int

    @property
    def dim(self) -> int:
        return int(self.basis.shape[0])

    @property
    def h(self) -> int:
        return int(self.basis.shape[-1])

    def group(self, *, atol: float = 1e-6) -> SymmetryGroup:
        """The closed-form group of this algebra (:func:`recognise_algebra`)."""
        return recognise_algebra(self.basis, self.h, atol=atol)


def _directions(G: Tensor, H: Tensor, idx: Tensor):
    """(GΛ, −HΛᵀ) for Λ = e_i e_jᵀ, a = i·h + j in ``idx``: GΛ has column j = G[:, i], HΛᵀ has
    column i = H[:, j]."""
    h = G.shape[-1]
    i, j = idx // h, idx % h
    k = torch.arange(idx.numel())
    dG = torch.zeros((idx.numel(),) + G.shape, dtype=G.dtype, device=G.device)
    dH = torch.zeros((idx.numel(),) + H.shape, dtype=H.dtype, device=H.device)
    dG[k, ..., j] = G[..., i].movedim(-1, 0)
    dH[k, ..., i] = -H[..., j].movedim(-1, 0)
    return dG, dH


def linearised_invariance(output_of: Callable[[Tensor, Tensor], Tensor], G: Tensor, H: Tensor, *,
                          chunk: int = 256, vectorize: bool = True) -> Tensor:
    r"""The N × h² matrix of Λ ↦ J(GΛ, −HΛᵀ) (column a = i·h + j for Λ = e_i e_jᵀ), by forward-mode
    AD: ``torch.func.jvp`` under ``torch.func.vmap`` on ``chunk`` directions at a time (one jvp per
    direction with ``vectorize=False``, for closures that vmap cannot trace)."""
    from torch.func import jvp, vmap

    h = G.shape[-1]
    flat = lambda g, hh: output_of(g, hh).reshape(-1)  # noqa: E731

    def one(dG, dH):
        return jvp(flat, (G, H), (dG, dH))[1]

    cols = []
    for start in range(0, h * h, chunk):
        idx = torch.arange(start, min(start + chunk, h * h))
        dG, dH = _directions(G, H, idx)
        if vectorize:
            cols.append(vmap(one)(dG, dH).T)
        else:
            cols.append(torch.stack([one(a, b) for a, b in zip(dG, dH)], 1))
    return torch.cat(cols, 1)


def derive_algebra(output_of: Callable[[Tensor, Tensor], Tensor], G: Tensor, H: Tensor, *,
                   rtol: float = 1e-8, closure_rtol: float = 1e-6, chunk: int = 256,
                   vectorize: bool = True) -> AlgebraDerivation:
    r"""The Lie algebra of the per-head transformations (G, H) ↦ (G A, H A⁻ᵀ) that leave
    ``output_of(G, H)`` unchanged, as the null space of the linearised invariance condition

        Λ ↦ d/dt output_of(G e^{tΛ}, H e^{−tΛᵀ})|_{t=0} = J(GΛ, −HΛᵀ),   Λ ∈ gl(h).

    ``output_of``: a function of ONE head's factors G (n, h), H (m, h) returning a tensor (e.g. the
    scores or the output of a module on fixed random inputs and positions, with this head's slices
    replaced by G and H); it must be differentiable in forward mode (and traceable by
    ``torch.func.vmap`` unless ``vectorize=False``). Use float64, a generic (random,
    well-conditioned) point and at least h² output numbers: the null space of a map into R^N has
    dimension ≥ h² − N, so fewer outputs cannot determine the algebra (ValueError).

    Threshold: the singular values σ of the map (with Λ in Frobenius-orthonormal coordinates) with
    σ ≤ ``rtol``·σ_max are kept as the null space; relative to σ_max, so independent of the output's
    scale. Computation: the Gram matrix JᵀJ (eigh) locates the subspace with σ ≤ 1e-6·σ_max, and an
    SVD of J restricted to it gives those singular values to working precision (the Gram matrix
    alone resolves σ only down to ≈ 1e-8·σ_max). Cost: h² jvps of ``output_of`` plus O(N h⁴ + h⁶)
    dense linear algebra (see the benchmarks for timings).

    Returns an :class:`AlgebraDerivation` (basis, singular values, gap, closure)."""
    G = G.detach()
    H = H.detach()
    if G.ndim != 2 or H.ndim != 2 or G.shape[-1] != H.shape[-1]:
        raise ValueError(f"derive_algebra needs one head's factors G (n, h) and H (m, h), got "
                         f"{tuple(G.shape)} and {tuple(H.shape)}")
    h = G.shape[-1]
    J = linearised_invariance(output_of, G, H, chunk=chunk, vectorize=vectorize).to(torch.float64)
    N = J.shape[0]
    if N < h * h:
        raise ValueError(
            f"output_of returns {N} numbers but the algebra lives in gl({h}) of dimension {h * h}: "
            f"the null space of a map into R^{N} has dimension ≥ {h * h - N}, so it cannot decide "
            f"the symmetry; evaluate on more inputs (tokens, batch, positions) to get ≥ {h * h} "
            f"outputs")
    lam, V = torch.linalg.eigh(J.mT @ J)                   # ascending
    sigma_max = float(lam[-1].clamp_min(0).sqrt())
    sigma = lam.clamp_min(0).sqrt().flip(0)                # descending
    V = V.flip(1)
    if sigma_max == 0.0:                                   # the output does not depend on (G, H) at all
        basis_vec = V
        kept = h * h
    else:
        near = int((lam <= (1e-6 * sigma_max) ** 2).sum())   # candidates: last `near` columns
        if near:
            Vc = V[:, h * h - near:]
            _, s_c, Wh = torch.linalg.svd(J @ Vc, full_matrices=False)   # refined, descending
            Vc = Vc @ Wh.mT
            sigma = torch.cat((sigma[:h * h - near], s_c))
            V = torch.cat((V[:, :h * h - near], Vc), 1)
        kept = int((sigma <= rtol * sigma_max).sum())
        basis_vec = V[:, h * h - kept:]
    dropped = sigma[:h * h - kept]
    kept_vals = sigma[h * h - kept:]
    if kept == 0 or kept == h * h or float(kept_vals.max()) == 0.0:
        gap = math.inf
    else:
        gap = float(dropped.min() / kept_vals.max())
    basis = basis_vec.mT.reshape(kept, h, h).contiguous()
    residual = closure_residual(basis)
    return AlgebraDerivation(basis=basis, singular_values=sigma, gap=gap,
                             closed=residual <= closure_rtol, closure_residual=residual,
                             rtol=rtol, outputs=N)


def _span_contained(basis: Tensor, group: SymmetryGroup, atol: float) -> bool:
    """Every (orthonormal) basis element lies in the group's algebra, to ``atol`` in Frobenius norm."""
    if basis.shape[0] == 0:
        return True
    dev = (basis - group.project_algebra(basis)).flatten(1).norm(dim=-1)
    return bool(dev.max() <= atol)


def _candidates(h: int, d: int):
    """The closed-form groups of dimension d on R^h, cheapest to test first."""
    if d == 0:
        yield TrivialGroup()
    if d == h * h:
        yield GLGroup()
    if d == 1:
        yield ScalarGroup()
    if h > 1 and d == h * (h - 1) // 2:
        yield OrthogonalGroup()
    if h > 1 and d == h * (h - 1) // 2 + 1:
        yield ScaledOrthogonalGroup()
    for r in range(2, h + 1, 2):
        if r + (h - r) ** 2 == d:
            for pairing in PAIRINGS:
                yield RotaryGroup(pairing, None if r == h else r)


def recognise_algebra(basis, h: int, *, atol: float = 1e-6) -> SymmetryGroup:
    r"""The closed-form group whose Lie algebra is span(``basis``), else ``SubalgebraGroup(basis)``.

    ``basis``: (d, h, h) (any spanning set; an :class:`AlgebraDerivation` is accepted too). Spans are
    compared, not only dimensions: a candidate of the same dimension d matches when every element of
    a Frobenius-orthonormal basis of the span lies in the candidate's algebra to ``atol``. Candidates:
    :class:`~quotient_manifolds.core.subalgebra.TrivialGroup` (d = 0),
    :class:`~quotient_manifolds.core.groups.GLGroup` (h²),
    :class:`~quotient_manifolds.core.subalgebra.ScalarGroup` (1),
    :class:`~quotient_manifolds.core.subalgebra.OrthogonalGroup` (h(h−1)/2),
    :class:`~quotient_manifolds.core.subalgebra.ScaledOrthogonalGroup` (h(h−1)/2 + 1),
    :class:`~quotient_manifolds.core.groups.RotaryGroup` with either pairing and every even rotary
    dimension r with r + (h − r)² = d (the rotated coordinates are the first r)."""
    if isinstance(basis, AlgebraDerivation):
        basis = basis.basis
    B = torch.as_tensor(basis).detach().to(device="cpu", dtype=torch.float64)
    if B.ndim != 3 or B.shape[1:] != (h, h):
        raise ValueError(f"recognise_algebra needs a (d, {h}, {h}) basis, got shape {tuple(B.shape)}")
    d0 = B.shape[0]
    if d0:
        _, S, Vh = torch.linalg.svd(B.reshape(d0, h * h), full_matrices=False)
        B = Vh[S > 1e-10 * S[0].clamp_min(1e-300)].reshape(-1, h, h) if float(S[0]) > 0 else B[:0]
    d = B.shape[0]
    for group in _candidates(h, d):
        if _span_contained(B, group, atol):
            return group
    return SubalgebraGroup(B)
