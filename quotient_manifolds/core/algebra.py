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

:func:`derive_group` is what a caller uses: it screens the closed forms with two random directions
each and certifies the largest that passes with one directional derivative per irreducible
component of its complement (:func:`complement_components`), so GL(h), the orthogonal groups and
the rotary commutant cost O(h) to O(h²) directional derivatives and no dense algebra; the null
space (:func:`derive_algebra`, h² directional derivatives and O(h⁶) algebra) only when that fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ..errors import InvalidArgument
from .groups import GLGroup, PAIRINGS, RotaryGroup, SymmetryGroup
from .subalgebra import (
    OrthogonalGroup,
    ScalarGroup,
    ScaledOrthogonalGroup,
    CLOSURE_RTOL,
    SubalgebraGroup,
    TrivialGroup,
    closure_residual,
    skew,
)

Tensor = torch.Tensor

#: Directions Λ with ‖J(GΛ, −HΛᵀ)‖ ≤ NULL_RTOL × (the largest response) leave the output unchanged.
NULL_RTOL = 1e-8
#: A derived algebra is trusted only when the responses drop by at least this factor between the
#: directions kept (the algebra) and the others: an exact symmetry gives 1e7 .. inf; a
#: near-symmetry (scaling q against k under RMSNorm with eps ≪ mean(q²)) sits in between.
MIN_GAP = 1e4


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

    Attributes
    ----------
    basis, singular_values, gap, closure_residual, closed, rtol, outputs:
        As listed above.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import derive_algebra
    >>> G, H = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    >>> found = derive_algebra(lambda G, H: G @ H.T, G, H)     # scores: all of gl(2)
    >>> tuple(found.basis.shape), found.closed, found.outputs
    ((4, 2, 2), True, 9)
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


def _elementary(idx: Tensor, h: int, dtype, device) -> Tensor:
    """Λ = e_i e_jᵀ for a = i·h + j in ``idx``: shape (len(idx), h, h)."""
    lam = torch.zeros(idx.numel(), h * h, dtype=dtype, device=device)
    lam[torch.arange(idx.numel()), idx] = 1.0
    return lam.view(-1, h, h)


def directional_derivatives(output_of: Callable[[Tensor, Tensor], Tensor], G: Tensor, H: Tensor,
                            lams: Tensor, *, chunk: int = 256, vectorize: bool = True,
                            jvp: Optional[Callable] = None) -> Tensor:
    r"""The N × k matrix whose column a is J(GΛ_a, −HΛ_aᵀ) = d/dt output_of(G e^{tΛ_a},
    H e^{−tΛ_aᵀ})|₀ for ``lams`` (k, h, h), by forward-mode AD: ``torch.func.jvp`` under
    ``torch.func.vmap`` on ``chunk`` directions at a time (one jvp per direction with
    ``vectorize=False``, for closures that vmap cannot trace). ``jvp``: another
    ``jvp(f, primals, tangents) -> (f(primals), derivative)`` (e.g. finite differences, for
    closures functorch cannot transform); it is called once per direction."""
    from torch.func import vmap

    if jvp is None:
        from torch.func import jvp
    else:
        vectorize = False

    flat = lambda g, hh: output_of(g, hh).reshape(-1)  # noqa: E731

    def one(dG, dH):
        return jvp(flat, (G, H), (dG, dH))[1]

    cols = []
    for start in range(0, lams.shape[0], chunk):
        lam = lams[start:start + chunk].to(G.dtype)
        dG, dH = G @ lam, -(H @ lam.mT)
        if vectorize:
            cols.append(vmap(one)(dG, dH).T)
        else:
            cols.append(torch.stack([one(a, b) for a, b in zip(dG, dH)], 1))
    if not cols:
        return torch.zeros(output_of(G, H).numel(), 0, dtype=G.dtype)
    return torch.cat(cols, 1)


def linearised_invariance(output_of: Callable[[Tensor, Tensor], Tensor], G: Tensor, H: Tensor, *,
                          chunk: int = 256, vectorize: bool = True, jvp: Optional[Callable] = None) -> Tensor:
    r"""The N × h² matrix of Λ ↦ J(GΛ, −HΛᵀ) (column a = i·h + j for Λ = e_i e_jᵀ), see
    :func:`directional_derivatives`."""
    h = G.shape[-1]
    cols = [directional_derivatives(output_of, G, H,
                                    _elementary(torch.arange(s, min(s + chunk, h * h)), h, G.dtype, G.device),
                                    chunk=chunk, vectorize=vectorize, jvp=jvp)
            for s in range(0, h * h, chunk)]
    return torch.cat(cols, 1)


def derive_algebra(output_of: Callable[[Tensor, Tensor], Tensor], G: Tensor, H: Tensor, *,
                   rtol: float = NULL_RTOL, atol: float = 0.0, closure_rtol: float = CLOSURE_RTOL,
                   chunk: int = 256,
                   vectorize: bool = True, jvp: Optional[Callable] = None) -> AlgebraDerivation:
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
    σ ≤ max(``rtol``·σ_max, ``atol``) are kept as the null space; relative to σ_max, so independent
    of the output's scale, unless the rounding of the derivatives (``atol``, see
    :func:`derive_group`) is larger. Computation: the Gram matrix JᵀJ (eigh) locates the subspace
    with σ ≤ 1e-6·σ_max, and an
    SVD of J restricted to it gives those singular values to working precision (the Gram matrix
    alone resolves σ only down to ≈ 1e-8·σ_max). Cost: h² jvps of ``output_of`` plus O(N h⁴ + h⁶)
    dense linear algebra (see the benchmarks for timings).

    Parameters
    ----------
    output_of:
        ``output_of(G, H)``, a tensor that depends on one head's factors.
    G, H:
        The factors at which to linearise, shapes (n, h) and (m, h); float64 recommended.
    rtol, atol:
        The null-space threshold (see above).
    closure_rtol:
        Tolerance of the commutator-closure check (``closed``).
    chunk:
        Directional derivatives computed per batch.
    vectorize:
        Batch the derivatives with ``torch.func.vmap``; False loops (for functions vmap cannot
        trace).
    jvp:
        A replacement for ``torch.func.jvp`` (see :func:`directional_derivatives`).

    Returns
    -------
    AlgebraDerivation
        The basis of the derived algebra, the singular values, the gap and the closure check.

    Raises
    ------
    ValueError
        ``G`` or ``H`` is not a 2-D tensor with h columns, or ``output_of`` returns fewer than h²
        numbers.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import derive_algebra
    >>> G, H = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    >>> # the output keeps G Gᵀ too: only rotations survive, so(2) has dimension 1
    >>> found = derive_algebra(lambda G, H: torch.cat([(G @ H.T).ravel(), (G @ G.T).ravel()]), G, H)
    >>> found.basis.shape[0], found.closed
    (1, True)
    """
    G = G.detach()
    H = H.detach()
    if G.ndim != 2 or H.ndim != 2 or G.shape[-1] != H.shape[-1]:
        raise InvalidArgument(f"derive_algebra needs one head's factors G (n, h) and H (m, h), got "
                              f"{tuple(G.shape)} and {tuple(H.shape)}")
    h = G.shape[-1]
    J = linearised_invariance(output_of, G, H, chunk=chunk, vectorize=vectorize, jvp=jvp).to(torch.float64)
    N = J.shape[0]
    if N < h * h:
        raise InvalidArgument(
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
        kept = int((sigma <= max(rtol * sigma_max, atol)).sum())
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
    for r in range(2, h + 1, 2):
        for scalars in (False, True):
            if _PairRotations(PAIRINGS[0], r, scalars).dim(h) == d:
                for pairing in PAIRINGS:
                    yield _PairRotations(pairing, r, scalars).group(h)


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
    dimension r with r + (h − r)² = d (the rotated coordinates are the first r), and the
    rotations of each rotary pair, SO(2)^{r/2} × SO(h − r), without or with the positive scalars
    (dimension r/2 + (h−r)(h−r−1)/2, + 1; normalised q and k under RoPE), as a
    :class:`~quotient_manifolds.core.subalgebra.SubalgebraGroup` labelled so.

    Parameters
    ----------
    basis:
        A (d, h, h) tensor or an :class:`AlgebraDerivation`.
    h:
        The head dimension.
    atol:
        Tolerance of the span comparison.

    Returns
    -------
    SymmetryGroup
        A closed-form group where one matches, else a
        :class:`~quotient_manifolds.core.subalgebra.SubalgebraGroup` of the span.

    Raises
    ------
    ValueError
        ``basis`` is not a (d, h, h) stack, or (for a new subalgebra) its span is not closed under
        the commutator.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import recognise_algebra
    >>> recognise_algebra(torch.tensor([[[0.0, 1.0], [-1.0, 0.0]]], dtype=torch.float64), 2)
    OrthogonalGroup()
    >>> recognise_algebra(torch.eye(2, dtype=torch.float64)[None], 2)
    ScalarGroup()
    """
    if isinstance(basis, AlgebraDerivation):
        basis = basis.basis
    B = torch.as_tensor(basis).detach().to(device="cpu", dtype=torch.float64)
    if B.ndim != 3 or B.shape[1:] != (h, h):
        raise InvalidArgument(f"recognise_algebra needs a (d, {h}, {h}) basis, got shape {tuple(B.shape)}")
    d0 = B.shape[0]
    if d0:
        _, S, Vh = torch.linalg.svd(B.reshape(d0, h * h), full_matrices=False)
        B = Vh[S > 1e-10 * S[0].clamp_min(1e-300)].reshape(-1, h, h) if float(S[0]) > 0 else B[:0]
    d = B.shape[0]
    for group in _candidates(h, d):
        if _span_contained(B, group, atol):
            return group
    return SubalgebraGroup(B)



# ------------------------------------------------------------------------------ the fast path
class _PairRotations:
    r"""𝔤 = span{J_p : rotary pairs p} ⊕ so(F) (⊕ R·I with ``scalars``), F the h − r coordinates
    that are not rotated: the orthogonal (times positive scalars) elements of the rotary commutant,
    the algebra of q and k normalised (whole width or per head) under RoPE.
    J_p = e_q e_pᵀ − e_p e_qᵀ for the pair (p, q)."""

    def __init__(self, pairing: str, r: int, scalars: bool):
        self.pairing, self.r, self.scalars = pairing, r, scalars

    def dim(self, h: int) -> int:
        f = h - self.r
        return self.r // 2 + f * (f - 1) // 2 + int(self.scalars)

    def project_algebra(self, X: Tensor) -> Tensor:
        h = X.shape[-1]
        out = torch.zeros_like(X)
        for p, q in RotaryGroup(self.pairing, self.r).pairs(h):
            c = 0.5 * (X[..., q, p] - X[..., p, q])
            out[..., q, p], out[..., p, q] = c, -c
        out[..., self.r:, self.r:] = skew(X[..., self.r:, self.r:])
        if self.scalars:
            out = out + torch.diagonal(X, dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(
                h, dtype=X.dtype, device=X.device)
        return out

    def group(self, h: int) -> SymmetryGroup:
        eye = torch.eye(h * h, dtype=torch.float64).reshape(h * h, h, h)
        basis = self.project_algebra(eye)               # spans 𝔤 (the projection of every e_ie_jᵀ)
        keep = basis.flatten(1).norm(dim=-1) > 0
        f = h - self.r
        what = f"SO(2)^{self.r // 2} [{self.pairing} pairs]" + (f" x SO({f})" if f > 1 else "")
        return SubalgebraGroup(basis[keep], label=("R+ " if self.scalars else "") + what)


def _pair_blocks(group: RotaryGroup, h: int):
    """Index tensors of the rotary pairs and of the free coordinates."""
    pairs = torch.tensor(group.pairs(h), dtype=torch.long).reshape(-1, 2)
    return pairs, torch.arange(group.rotated(h), h)


def complement_components(group: SymmetryGroup, h: int, *, generator=None) -> Optional[Tensor]:
    r"""One random unit element of each irreducible component of gl(h) ⊖ 𝔤 under ad(𝔤), when
    these components are pairwise non-isomorphic (then every ad(𝔤)-invariant subspace of the
    complement is a sum of whole components); None for groups without such a decomposition here.

    Why it decides maximality: if 𝔤 ⊆ 𝔨 (𝔨 the algebra of the true symmetry group), 𝔨 is a Lie
    algebra, so [𝔤, 𝔨] ⊆ 𝔨 and 𝔨 = 𝔤 ⊕ (𝔨 ∩ complement) with 𝔨 ∩ complement ad(𝔤)-invariant, hence
    a sum of whole components. As 𝔨 ⊆ null(J) at every point and for every input, one element v of a
    component with J(v) ≠ 0 excludes that whole component from 𝔨. So 𝔨 = 𝔤 once every component
    answers, at the cost of one directional derivative per component:

    * GL(h): no complement.
    * R₊·SO(h): sym₀(h) (traceless symmetric), irreducible under SO(h) (h ≥ 2).
    * SO(h): R·I and sym₀(h) (h ≥ 2).
    * Rotary commutant GL(1, ℂ)^{r/2} × GL(h − r): in the pair coordinates, for rotary pairs
      a ≠ b the ℂ-linear and the ℂ-antilinear maps from pair b to pair a (two components each),
      the antilinear maps of each pair to itself, and (when r < h) the maps from the free
      coordinates to each pair and back (one component each). They are distinct joint
      eigenspaces of ad(𝔤) (eigenvalues λ_a − λ_b, λ_a − λ̄_b, ... for generic λ ∈ ℂ^{r/2}), so
      pairwise non-isomorphic; (h² − h)/2 components when r = h.
    """
    gen = generator if generator is not None else torch.Generator().manual_seed(1)
    dt = torch.float64
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=dt)  # noqa: E731
    if isinstance(group, GLGroup) and group.is_full:
        return torch.zeros(0, h, h, dtype=dt)
    if isinstance(group, (OrthogonalGroup, ScaledOrthogonalGroup)) and h >= 2:
        S = randn(h, h)
        S = S + S.T
        S = S - torch.trace(S) / h * torch.eye(h, dtype=dt)
        comps = [S / S.norm()]
        if isinstance(group, OrthogonalGroup):
            comps.append(torch.eye(h, dtype=dt) / math.sqrt(h))
        return torch.stack(comps)
    if isinstance(group, RotaryGroup):
        pairs, free = _pair_blocks(group, h)
        k = pairs.shape[0]
        lin = lambda x, y: torch.stack((torch.stack((x, -y), -1), torch.stack((y, x), -1)), -2)  # noqa: E731
        anti = lambda x, y: torch.stack((torch.stack((x, y), -1), torch.stack((y, -x), -1)), -2)  # noqa: E731
        blocks, where = [], []
        for a in range(k):
            for b in range(k):
                for form in ((lin, anti) if a != b else (anti,)):
                    x, y = randn(2)
                    blocks.append(form(x, y))
                    where.append((a, b))
        out = torch.zeros(len(blocks) + 2 * k * int(free.numel() > 0), h, h, dtype=dt)
        for i, ((a, b), blk) in enumerate(zip(where, blocks)):
            out[i][pairs[a][:, None], pairs[b][None, :]] = blk
        if free.numel():
            i = len(blocks)
            for a in range(k):
                out[i][pairs[a][:, None], free[None, :]] = randn(2, free.numel())
                out[i + 1][free[:, None], pairs[a][None, :]] = randn(free.numel(), 2)
                i += 2
        return out / out.flatten(1).norm(dim=-1)[:, None, None]
    return None


@dataclass(frozen=True)
class Candidate:
    """A closed-form algebra to screen: its dimension, Frobenius projection and group."""

    name: str
    dim: int
    project: Callable[[Tensor], Tensor]
    make: Callable[[], SymmetryGroup]


def candidate_groups(h: int) -> List[Candidate]:
    """The closed forms :func:`derive_group` screens, largest first: GL(h); the rotary commutants
    and the rotations of each rotary pair (× SO(h − r), with and without scalars) for both
    pairings and every even r; R₊·SO(h); SO(h); R₊·I; {I}."""
    out = [Candidate("GL", h * h, lambda X: X, GLGroup)]
    for r in range(2, h + 1, 2):
        for pairing in PAIRINGS:
            g = RotaryGroup(pairing, None if r == h else r)
            out.append(Candidate(g.describe(h), g.dim(h), g.project_algebra, lambda g=g: g))
            for scalars in (True, False):
                pr = _PairRotations(pairing, r, scalars)
                out.append(Candidate(f"pair rotations r={r} {pairing}{' + scalars' if scalars else ''}",
                                     pr.dim(h), pr.project_algebra, lambda pr=pr: pr.group(h)))
    if h > 1:
        for g in (ScaledOrthogonalGroup(), OrthogonalGroup()):
            out.append(Candidate(g.describe(h), g.dim(h), g.project_algebra, lambda g=g: g))
    g = ScalarGroup()
    out.append(Candidate(g.describe(h), 1, g.project_algebra, lambda: ScalarGroup()))
    out.append(Candidate("trivial", 0, lambda X: torch.zeros_like(X), TrivialGroup))
    out.sort(key=lambda c: -c.dim)           # stable: GL first, rotary before its rotations
    return out


@dataclass(frozen=True)
class GroupDerivation:
    r"""The result of :func:`derive_group`.

    * ``group``: the group found (None when the derivation is inconclusive, see ``reason``);
    * ``dim``: dim 𝔤; ``gap``: (smallest response outside 𝔤) / (largest response inside), as for
      :class:`AlgebraDerivation`; ``closed``: closure under the commutator (always True for a
      screened closed form);
    * ``method``: ``"screened"`` (a closed form passed the screen and its maximality certificate:
      :func:`complement_components`), ``"null space"`` (:func:`derive_algebra` then
      :func:`recognise_algebra`) or ``"invariant"`` (the output does not depend on the factors
      beyond rounding: all of gl(h));
    * ``evaluations``: directional derivatives of ``output_of`` computed;
    * ``reason``: why an inconclusive derivation was not trusted (empty otherwise);
    * ``algebra``: the :class:`AlgebraDerivation` when the null space was computed.

    Attributes
    ----------
    group, dim, gap, closed, method, evaluations, reason, algebra:
        As listed above.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import derive_group
    >>> G, H = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    >>> found = derive_group(lambda G, H: G @ H.T, G, H)
    >>> found.group, found.dim, found.reason
    (GLGroup(), 4, '')
    """

    group: Optional[SymmetryGroup]
    dim: int
    gap: float
    closed: bool
    method: str
    evaluations: int
    reason: str = ""
    algebra: Optional[AlgebraDerivation] = None


#: the output is exactly invariant (all of gl(h) in the null space) when its response along random
#: directions of gl(h) is below this fraction of its response to a generic change of (G, H) of the
#: same size: what remains is rounding, and a threshold relative to it would cut noise
ROUNDING_FRACTION = 1e-10
#: a response is "zero" below FLOOR_FACTOR × the measured rounding of one directional derivative
#: (J(Λ₁ + Λ₂) − J(Λ₁) − J(Λ₂), which is exactly zero in exact arithmetic): rounding differs from
#: one direction to the next, and inside normalisations it can reach 1e-8 of the responses
FLOOR_FACTOR = 1e3


def derive_group(output_of: Callable[[Tensor, Tensor], Tensor], G: Tensor, H: Tensor, *,
                 rtol: float = NULL_RTOL, min_gap: float = MIN_GAP, samples: int = 2,
                 chunk: int = 256, vectorize: bool = True, generator=None,
                 jvp: Optional[Callable] = None) -> GroupDerivation:
    r"""The symmetry group of ``output_of`` in the per-head action (G, H) ↦ (G A, H A⁻ᵀ), cheaply
    when it is one of the closed forms, else from the null space (:func:`derive_algebra`).

    1. *Scale.* The responses ρ(Λ) = ‖J(GΛ, −HΛᵀ)‖ of a few random unit Λ ∈ gl(h) give the
       reference ρ_ref; a direction with ρ ≤ ``rtol``·ρ_ref is in the null space. When ρ_ref is at
       rounding level against a generic change of (G, H), the output is invariant: GL(h).
    2. *Screen* every closed form of :func:`candidate_groups` with ``samples`` random unit elements
       of its algebra (random Gaussian combinations: a linear map that vanishes on them vanishes on
       the whole algebra, almost surely): 2 directional derivatives each, whatever dim 𝔤.
    3. *Certify* the largest closed form 𝔤 that passes (every other one that passes must lie in
       it): one directional derivative per irreducible component of its complement
       (:func:`complement_components`); each must respond, by at least ``min_gap`` × the largest
       response inside 𝔤. This proves that no larger group leaves the output unchanged.
    4. Otherwise (no certificate for this closed form, a component in the null space, passing
       closed forms not nested), :func:`derive_algebra` and :func:`recognise_algebra`: h²
       directional derivatives and O(N h⁴ + h⁶) dense algebra.

    Cost of the screened path: 4 + ``samples`` × (3h + 4) directional derivatives (the closed
    forms of :func:`candidate_groups` with dim 𝔤 > 0), plus one per component of the certificate
    (none for GL(h), 1 or 2 for the orthogonal groups, (h² − h)/2 for the rotary
    commutant); no dense algebra. ``jvp``: as in :func:`directional_derivatives`.

    Parameters
    ----------
    output_of:
        ``output_of(G, H)``, a tensor that depends on one head's factors.
    G, H:
        The factors at which to linearise, shapes (n, h) and (m, h); float64 recommended.
    rtol:
        Relative response below which a direction is in the null space.
    min_gap:
        The factor by which every direction outside the group must respond more than the largest
        response inside it.
    samples:
        Random algebra elements per screened closed form.
    chunk, vectorize, jvp:
        As in :func:`derive_algebra`.
    generator:
        A ``torch.Generator`` for the random directions (None: the global one).

    Returns
    -------
    GroupDerivation
        The group found (or None with the reason), how it was found, its gap and cost.

    Raises
    ------
    ValueError
        As :func:`derive_algebra`, when the null space has to be computed.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import derive_group
    >>> G, H = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    >>> found = derive_group(lambda G, H: torch.cat([(G @ H.T).ravel(), (G @ G.T).ravel()]), G, H)
    >>> found.dim, found.group.contains(torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64))
    (1, True)
    """
    G, H = G.detach(), H.detach()
    h = G.shape[-1]
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    dd = lambda lams: directional_derivatives(output_of, G, H, lams, chunk=chunk,  # noqa: E731
                                              vectorize=vectorize, jvp=jvp).norm(dim=0)
    unit = lambda X: X / X.flatten(-2).norm(dim=-1).clamp_min(1e-300)[..., None, None]  # noqa: E731
    if jvp is None:
        from torch.func import jvp

    # 1. scale, rounding floor, and the exactly invariant output
    probe = unit(torch.randn(2, h, h, generator=gen, dtype=torch.float64))
    cols = directional_derivatives(output_of, G, H, torch.cat((probe, probe.sum(0, keepdim=True))),
                                   chunk=chunk, vectorize=vectorize, jvp=jvp)
    ref = float(cols[:, :2].norm(dim=0).max())
    # J is linear: what J(Λ₁ + Λ₂) − J(Λ₁) − J(Λ₂) leaves is the rounding of one directional derivative
    floor = float((cols[:, 2] - cols[:, 0] - cols[:, 1]).norm())
    dG = torch.randn(G.shape, generator=gen, dtype=torch.float64).to(G.dtype) * G.norm() / G.numel() ** 0.5
    dH = torch.randn(H.shape, generator=gen, dtype=torch.float64).to(H.dtype) * H.norm() / H.numel() ** 0.5
    generic = float(jvp(output_of, (G, H), (dG, dH))[1].detach().norm())
    evaluations = 4
    if (ref <= ROUNDING_FRACTION * generic * max(float(G.norm()), float(H.norm()), 1.0)
            or ref <= FLOOR_FACTOR * floor):
        return GroupDerivation(GLGroup(), h * h, math.inf, True, "invariant", evaluations)
    tol = max(rtol * ref, FLOOR_FACTOR * floor)

    # 2. screen the closed forms (one batch of directional derivatives for all of them)
    cands = candidate_groups(h)
    tested = [c for c in cands if c.dim > 0]
    lams = torch.cat([unit(c.project(torch.randn(samples, h, h, generator=gen, dtype=torch.float64)))
                      for c in tested])
    resp = dd(lams).view(len(tested), samples).amax(-1)
    evaluations += lams.shape[0]
    passing = [(c, float(r), lams[i * samples:(i + 1) * samples]) for i, (c, r) in enumerate(zip(tested, resp))
               if float(r) <= tol]
    best = passing[0] if passing else (cands[-1], 0.0, lams[:0])
    nested = all(bool((x - best[0].project(x)).flatten(1).norm(dim=-1).max() <= 1e-8) for _, _, x in passing)

    # 3. the maximality certificate
    reason = ""
    if nested:
        group = best[0].make()
        comps = complement_components(group, h, generator=gen)
        if comps is not None:
            out = dd(comps) if comps.shape[0] else torch.zeros(0, dtype=torch.float64)
            evaluations += comps.shape[0]
            low = float(out.min()) if out.numel() else math.inf
            kept = best[1]
            gap = math.inf if kept == 0.0 else low / kept
            if low > tol and gap >= min_gap:
                return GroupDerivation(group, group.dim(h), gap, True, "screened", evaluations)
            reason = (f"{group.describe(h)} passes the screen but a direction outside it responds "
                      f"only {low / ref:.1e} of the reference")

    # 4. the null space
    d = derive_algebra(output_of, G, H, rtol=rtol, atol=tol, chunk=chunk, vectorize=vectorize, jvp=jvp)
    evaluations += h * h
    if not d.closed:
        return GroupDerivation(None, d.dim, d.gap, False, "null space", evaluations,
                               "not closed under the bracket", d)
    if d.dim and d.gap < min_gap:
        return GroupDerivation(None, d.dim, d.gap, True, "null space", evaluations,
                               f"no clear gap in the singular values (< {min_gap:g})", d)
    if nested and passing and best[0].dim == d.dim:
        # the screened closed form lies in the null space and has its dimension: it is the null space
        group = best[0].make()
    else:
        group = recognise_algebra(d.basis, h)
    return GroupDerivation(group, d.dim, d.gap, True, "null space", evaluations, reason, d)
