r"""Groups given by a Lie subalgebra 𝔤 ⊆ gl(h): any subalgebra by a basis, and the closed forms
that normalised attention brings.

* :class:`SubalgebraGroup`: the connected group exp(𝔤) of any Lie subalgebra given by a basis
  (e.g. the one :func:`~quotient_manifolds.core.algebra.derive_algebra` finds numerically).
* :class:`TrivialGroup`: {I}, 𝔤 = 0 (no symmetry: the quotient is the total space).
* :class:`ScalarGroup`: R₊·I, 𝔤 = R·I, dimension 1 (both q and k normalised per head and a
  learned per-coordinate gain, for example).
* :class:`OrthogonalGroup`: SO(h), 𝔤 = so(h), dimension h(h−1)/2 (a head's output normalised,
  then mixed by the output projection).
* :class:`ScaledOrthogonalGroup`: R₊·SO(h), 𝔤 = so(h) ⊕ R·I, dimension h(h−1)/2 + 1 (q and k
  L2-normalised per head: the scores see only angles, kept by rotations, and a common rescaling of
  G against H).

Every group needs only its Lie algebra for the quotient: the vertical space at x = [G; H] is
{(GΛ, −HΛᵀ) : Λ ∈ 𝔤}, and the metric-orthogonal vertical component of u is (GΛ, −HΛᵀ) with Λ ∈ 𝔤
solving the normal equations over 𝔤

    Π_𝔤 L(Λ) = Π_𝔤 C,   L(Λ) = GᵀG Λ M_G + M_H Λ HᵀH,   C = Gᵀu_G M_G − M_H u_HᵀH

(Π_𝔤 the Frobenius projection onto 𝔤, M_G and M_H the metric weights of
:class:`~quotient_manifolds.core.gl.GLFrame`; see :mod:`quotient_manifolds.core.groups`). L is
self-adjoint and positive definite in the Frobenius inner product (⟨Λ, L(Λ)⟩ = ‖(GΛ, −HΛᵀ)‖²_g > 0),
so its compression Π_𝔤 L Π_𝔤 to 𝔤 is too, and the equations have one solution. Two exact solvers:

* :class:`NormalEquationsSolver`: in an orthonormal basis E_1 … E_d of 𝔤, per head the d×d system
  K c = b with K_ab = ⟨E_a, L(E_b)⟩_F, b_a = ⟨E_a, C⟩_F, Λ = Σ c_a E_a, by Cholesky (set up once per
  point; O(d h³ + d² h²) to set up, O(d h²) per solve). Used for small d.
* :class:`ConjugateGradientSolver`: conjugate gradients on 𝔤 for the same equations, preconditioned
  by Π_𝔤 L⁻¹ Π_𝔤 (L⁻¹ is the full-GL(h) Sylvester solve the frame already has; Π_𝔤 L⁻¹ Π_𝔤 is positive
  definite on 𝔤, and exact when L maps 𝔤 into itself), in the compute precision until the relative
  residual is below 1e-13. O(h³) per iteration; used for so(h) and so(h) ⊕ R·I (2016 unknowns per
  head at h = 64, where a dense d×d factorisation would cost seconds per point) and for large d.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from ..errors import InvalidArgument
from .groups import SymmetryGroup, apply_pencil, batched_eigh, sym

Tensor = torch.Tensor


def skew(a: Tensor) -> Tensor:
    """Antisymmetric part ½(A − Aᵀ) over the last two dimensions."""
    return 0.5 * (a - a.mT)


def _frobenius(X: Tensor, Y: Tensor) -> Tensor:
    """⟨X, Y⟩_F over the last two dimensions (keepdim)."""
    return (X * Y).sum((-1, -2), keepdim=True)


def _trace_part(X: Tensor) -> Tensor:
    """Π_{R·I}(X) = tr(X)/h · I."""
    h = X.shape[-1]
    tr = torch.diagonal(X, dim1=-2, dim2=-1).sum(-1)
    return (tr / h)[..., None, None] * torch.eye(h, dtype=X.dtype, device=X.device)


def _normal_terms(frame) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(A, B, A₂, B₂) with L(Λ) = A Λ B + A₂ Λ B₂: A = GᵀG, B = M_G, A₂ = M_H, B₂ = HᵀH."""
    M_G, M_H = frame.metric_weights
    return frame.gram_G, M_G, M_H, frame.gram_H


class ZeroSolver:
    """The vertical solver of the trivial group: Λ = 0."""

    def solve(self, C: Tensor) -> Tensor:
        return torch.zeros_like(C)


class NormalEquationsSolver:
    r"""Λ = Σ c_a E_a with K c = b, K_ab = ⟨E_a, L(E_b)⟩_F, b_a = ⟨E_a, C⟩_F (Cholesky per head),
    for an orthonormal basis E (d, h, h) of 𝔤. Exact for both metrics and any ε.

    ``normal_matrix``: K when the caller has a structured formula for it (see
    :func:`so_normal_matrix`); otherwise it is assembled from L(E_b) in chunks of ``chunk``."""

    def __init__(self, basis: Tensor, frame, *, normal_matrix: Optional[Tensor] = None,
                 chunk: int = 256):
        A, B, A2, B2 = _normal_terms(frame)
        E = basis.to(dtype=A.dtype, device=A.device)
        self.basis = E
        if normal_matrix is None:
            cols = []
            for start in range(0, E.shape[0], chunk):   # L(E_b), (..., chunk, h, h) at a time
                Eb = E[start:start + chunk]
                LE = (A[..., None, :, :] @ Eb @ B[..., None, :, :]
                      + A2[..., None, :, :] @ Eb @ B2[..., None, :, :])
                cols.append(torch.einsum("ahk,...bhk->...ab", E, LE))
            normal_matrix = torch.cat(cols, -1)
        self.chol = torch.linalg.cholesky(sym(normal_matrix))

    def solve(self, C: Tensor) -> Tensor:
        rhs = torch.einsum("ahk,...hk->...a", self.basis, C)
        c = torch.cholesky_solve(rhs[..., None], self.chol)[..., 0]
        return torch.einsum("...a,ahk->...hk", c, self.basis)


def so_normal_matrix(frame, *, with_scalars: bool = False) -> Tensor:
    r"""K_ab = ⟨E_a, L(E_b)⟩_F for the basis E_(kl) = (e_ke_lᵀ − e_le_kᵀ)/√2 (k < l) of so(h)
    (then I/√h when ``with_scalars``), entry by entry in O(h⁴) without forming L(E_b):

        ⟨E_(kl), A E_(ij) B⟩ = ½ (A_ki B_jl − A_kj B_il − A_li B_jk + A_lj B_ik),

    summed over the two terms (A, B), (A₂, B₂) of L."""
    A, B, A2, B2 = _normal_terms(frame)
    h = A.shape[-1]
    k, l = torch.triu_indices(h, h, 1, device=A.device)
    r_k, r_l = k[:, None], l[:, None]          # rows (k, l)
    c_i, c_j = k[None, :], l[None, :]          # columns (i, j)

    def pair(X, Y):
        return 0.5 * (X[..., r_k, c_i] * Y[..., c_j, r_l] - X[..., r_k, c_j] * Y[..., c_i, r_l]
                      - X[..., r_l, c_i] * Y[..., c_j, r_k] + X[..., r_l, c_j] * Y[..., c_i, r_k])

    K = pair(A, B) + pair(A2, B2)
    if not with_scalars:
        return K
    LI = A @ B + A2 @ B2                       # L(I)
    col = (LI[..., k, l] - LI[..., l, k]) / math.sqrt(2 * h)       # ⟨E_(kl), L(I)⟩/√h
    corner = torch.diagonal(LI, dim1=-2, dim2=-1).sum(-1) / h      # ⟨I, L(I)⟩/h
    top = torch.cat((K, col[..., :, None]), -1)
    bottom = torch.cat((col, corner[..., None]), -1)[..., None, :]
    return torch.cat((top, bottom), -2)


class ConjugateGradientSolver:
    r"""Λ ∈ 𝔤 with Π_𝔤 L(Λ) = Π_𝔤 C by preconditioned conjugate gradients on 𝔤, batched over heads.

    Preconditioner: ``preconditioner`` (an SPD map on 𝔤, e.g. the closed form of a nearby
    operator), by default Π_𝔤 L⁻¹ Π_𝔤 (the frame's full-GL Sylvester solve, then the projection);
    the first iterate is the preconditioner applied to Π_𝔤 C. Runs until
    ‖Π_𝔤(C − L(Λ))‖_F ≤ ``rtol``·‖Π_𝔤 C‖_F for every
    head (at most ``max_iter`` iterations, default dim 𝔤 + 50: conjugate gradients ends in dim 𝔤
    steps in exact arithmetic). Where that fails (ill-conditioned points: the preconditioner is
    exact only when L maps 𝔤 into itself, and the iteration count grows with the condition number of
    the rest), the whole batch is solved by ``fallback()`` instead — a direct solver — so the result
    is exact either way; ``iterations`` and ``used_fallback`` record what happened."""

    def __init__(self, project: Callable[[Tensor], Tensor], dim: int, frame, *,
                 fallback: Callable[[], "NormalEquationsSolver"], rtol: float = 1e-13,
                 max_iter: Optional[int] = None,
                 preconditioner: Optional[Callable[[Tensor], Tensor]] = None):
        self.project = project
        self._preconditioner = preconditioner
        self.fallback = fallback
        self._direct: Optional[NormalEquationsSolver] = None
        self.used_fallback = False
        self.A, self.B, self.A2, self.B2 = _normal_terms(frame)
        self.pencil = frame._projection_basis
        self.rtol = rtol
        self.max_iter = dim + 50 if max_iter is None else max_iter
        self.iterations = 0

    def operator(self, lam: Tensor) -> Tensor:
        return self.project(self.A @ lam @ self.B + self.A2 @ lam @ self.B2)

    def precondition(self, r: Tensor) -> Tensor:
        if self._preconditioner is not None:
            return self._preconditioner(r)
        return self.project(apply_pencil(self.pencil, r))

    def solve(self, C: Tensor) -> Tensor:
        rhs = self.project(C)
        target = self.rtol * _frobenius(rhs, rhs).sqrt()
        x = self.precondition(rhs)
        r = rhs - self.operator(x)
        z = self.precondition(r)
        p, rz = z, _frobenius(r, z)
        it = 0
        while it < self.max_iter and bool((_frobenius(r, r).sqrt() > target).any()):
            Tp = self.operator(p)
            pTp = _frobenius(p, Tp)
            alpha = torch.where(pTp > 0, rz / torch.where(pTp > 0, pTp, 1.0), 0.0)
            x = x + alpha * p
            r = r - alpha * Tp
            z = self.precondition(r)
            rz_new = _frobenius(r, z)
            beta = torch.where(rz > 0, rz_new / torch.where(rz > 0, rz, 1.0), 0.0)
            p, rz = z + beta * p, rz_new
            it += 1
        self.iterations = it
        if bool((_frobenius(r, r).sqrt() > target).any()):
            if self._direct is None:
                self._direct = self.fallback()
            self.used_fallback = True
            return self._direct.solve(C)
        return x


class SkewPencilSolver:
    r"""Exact O(h³) solution of Π_𝔤(2MΛN) = Π_𝔤 C on 𝔤 = so(h) (or so(h) ⊕ R·I), M and N SPD.

    On antisymmetric Λ, Π_so(2MΛN) = MΛN + NΛM. With W such that WᵀMW = I and WᵀNW = diag(d)
    (one generalised eigendecomposition per head), Λ = W Z Wᵀ turns MΛN + NΛM = S into
    Z D + D Z = WᵀSW, so Z_ij = (WᵀSW)_ij / (d_i + d_j) (antisymmetric when S is). With the scalars,
    the extra unknown λ of Λ = Λ_so + λI/√h is eliminated by a 1×1 Schur complement: with
    t = Π_so(2MN)/√h, k = tr(2MN)/h and T the operator above, λ = (b_λ − ⟨t, T⁻¹b_so⟩)/(k − ⟨t, T⁻¹t⟩),
    Λ_so = T⁻¹(b_so − λ t).

    For the mix metric with ε = 0, L(Λ) = 2PΛQ (P = GᵀG, Q = HᵀH) and this *is* the vertical
    solver; otherwise it preconditions conjugate gradients (see :func:`_orthogonal_solver`)."""

    def __init__(self, M: Tensor, N: Tensor, *, with_scalars: bool):
        eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
        F = torch.linalg.solve_triangular(torch.linalg.cholesky(M), eye, upper=False).mT  # FᵀMF = I
        d, U = batched_eigh(sym(F.mT @ N @ F))
        self.W = F @ U
        self.D = d[..., :, None] + d[..., None, :]
        self.with_scalars = with_scalars
        if with_scalars:
            h = M.shape[-1]
            LI = 2 * M @ N
            self.t = skew(LI) / math.sqrt(h)
            k = torch.diagonal(LI, dim1=-2, dim2=-1).sum(-1) / h
            self.z = self.inverse(self.t)
            self.schur = k - _frobenius(self.t, self.z)[..., 0, 0]

    def inverse(self, S: Tensor) -> Tensor:
        W = self.W
        return W @ ((W.mT @ S @ W) / self.D) @ W.mT

    def solve(self, C: Tensor) -> Tensor:
        y = self.inverse(skew(C))
        if not self.with_scalars:
            return y
        h = C.shape[-1]
        b = torch.diagonal(C, dim1=-2, dim2=-1).sum(-1) / math.sqrt(h)
        lam = (b - _frobenius(self.t, y)[..., 0, 0]) / self.schur
        eye = torch.eye(h, dtype=C.dtype, device=C.device)
        return y - lam[..., None, None] * self.z + (lam / math.sqrt(h))[..., None, None] * eye


def _orthogonal_solver(group: "SymmetryGroup", frame, with_scalars: bool):
    r"""The exact solver for so(h) (⊕ R·I): the closed form :class:`SkewPencilSolver` where the
    metric's vertical operator is one pencil (mix with ε = 0); otherwise conjugate gradients
    preconditioned by the mean of the closed-form inverses of the metric's nearby pencils
    (:meth:`~quotient_manifolds.core.metrics.GLMetric.skew_pencils`: (P, Q) for mix with ε > 0,
    (P, P⁻¹) and (Q, Q⁻¹) for inv), with the dense normal equations (structured O(h⁴) matrix) as
    fallback."""
    metric = frame.gl_metric
    pencils = [SkewPencilSolver(M, N, with_scalars=with_scalars) for M, N in metric.skew_pencils(frame)]
    if metric.closed_form_projection(frame.eps):
        return pencils[0]

    def precondition(r: Tensor) -> Tensor:   # the mean of the pencils' inverses
        return sum(pencil.solve(r) for pencil in pencils) / len(pencils)
    h = frame.G.shape[-1]

    def dense():
        basis = group.algebra_basis(h, dtype=frame.cdtype, device=frame.G.device)
        K = so_normal_matrix(frame, with_scalars=with_scalars)
        return NormalEquationsSolver(basis, frame, normal_matrix=K)

    return ConjugateGradientSolver(group.project_algebra, group.dim(h), frame, fallback=dense,
                                   preconditioner=precondition)


def _haar_rotation(batch: Tuple[int, ...], h: int, generator, dtype) -> Tensor:
    """Haar-distributed elements of SO(h): QR of a Gaussian matrix with the signs fixed, then one
    column flipped where the determinant is −1."""
    Q, R = torch.linalg.qr(torch.randn(batch + (h, h), generator=generator, dtype=dtype))
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[..., None, :]
    flip = torch.ones(batch + (h,), dtype=dtype)
    flip[..., 0] = torch.sign(torch.linalg.det(Q))
    return Q * flip[..., None, :]


def _random_scalar(batch: Tuple[int, ...], cond: Optional[float], generator, dtype) -> Tensor:
    """Positive scalars: log-uniform over [cond^{-1/2}, cond^{1/2}] (e^{N(0,1)} when cond is None)."""
    u = torch.rand(batch, generator=generator, dtype=dtype)
    if cond is None:
        return torch.randn(batch, generator=generator, dtype=dtype).exp()
    return ((u - 0.5) * math.log(float(cond))).exp()


def _check_scale(group: SymmetryGroup, scale: float) -> None:
    if scale != 1.0 and not group.has_scalars:
        raise InvalidArgument(
            f"scale={scale} would take a random element out of {group!r}, which does not contain "
            f"the positive scalars; use scale=1.0 for this group (check group.has_scalars)")


class _ClosedForm(SymmetryGroup):
    """Shared checks of the closed-form groups below."""

    def check(self, h: int) -> None:
        if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
            raise InvalidArgument(f"{self.describe(1)}-type group needs a head dimension h ≥ 1, got {h!r}")

    def contains(self, A: Tensor, *, rtol: float = 1e-10) -> bool:
        return bool(self._deviation(A.to(torch.float64)) <= rtol)


@dataclass(frozen=True)
class TrivialGroup(_ClosedForm):
    """The trivial group {I}: no symmetry; the vertical space is zero and the quotient is the whole
    total space, of dimension (n + m)h. Its vertical solver returns Λ = 0.

    Examples
    --------
    >>> from quotient_manifolds.core import GLQuotientGeometry, TrivialGroup
    >>> GLQuotientGeometry(3, 3, 2, group=TrivialGroup()).dim      # (n + m) h
    12
    """

    name = "trivial"

    def dim(self, h: int) -> int:
        return 0

    def describe(self, h: int) -> str:
        return "trivial {I}"

    @property
    def has_scalars(self) -> bool:
        return False

    def project_algebra(self, X: Tensor) -> Tensor:
        return torch.zeros_like(X)

    def algebra_basis(self, h: int, *, dtype=torch.float64, device=None) -> Tensor:
        return torch.zeros(0, h, h, dtype=dtype, device=device)

    def random_element(self, h, batch=(), *, scale=1.0, cond=1e2, generator=None, dtype=torch.float64):
        _check_scale(self, scale)
        return torch.eye(h, dtype=dtype).expand(tuple(batch) + (h, h)).clone()

    def _deviation(self, A: Tensor) -> Tensor:
        return (A - torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)).abs().amax()

    def vertical_solver(self, frame) -> ZeroSolver:
        return ZeroSolver()


class _ScalarSolver:
    """Λ = λI with λ = tr C / ⟨I, L(I)⟩, ⟨I, L(I)⟩ = tr(AB) + tr(A₂B₂)."""

    def __init__(self, frame):
        A, B, A2, B2 = _normal_terms(frame)
        self.k = (A * B).sum((-1, -2)) + (A2 * B2).sum((-1, -2))

    def solve(self, C: Tensor) -> Tensor:
        tr = torch.diagonal(C, dim1=-2, dim2=-1).sum(-1)
        return (tr / self.k)[..., None, None] * torch.eye(C.shape[-1], dtype=C.dtype, device=C.device)


@dataclass(frozen=True)
class ScalarGroup(_ClosedForm):
    """The positive scalars R₊·I: (G, H) ~ (sG, H/s), s > 0. 𝔤 = R·I, dimension 1.
    Π_𝔤(X) = tr(X)/h·I; the normal equations are one number per head: λ = tr C / ⟨I, L(I)⟩.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import GLQuotientGeometry, ScalarGroup
    >>> ScalarGroup().project_algebra(torch.tensor([[1.0, 5.0], [0.0, 3.0]], dtype=torch.float64))
    tensor([[2., 0.],
            [0., 2.]], dtype=torch.float64)
    >>> GLQuotientGeometry(3, 3, 2, group=ScalarGroup()).dim       # (n + m) h - 1
    11
    """

    name = "scalar"

    def dim(self, h: int) -> int:
        return 1

    def describe(self, h: int) -> str:
        return "R+ I (scalars)"

    def project_algebra(self, X: Tensor) -> Tensor:
        return _trace_part(X)

    def algebra_basis(self, h: int, *, dtype=torch.float64, device=None) -> Tensor:
        return (torch.eye(h, dtype=dtype, device=device) / math.sqrt(h))[None]

    def random_element(self, h, batch=(), *, scale=1.0, cond=1e2, generator=None, dtype=torch.float64):
        """s·I with s log-uniform over [cond^{-1/2}, cond^{1/2}] (the condition number of a scalar
        matrix is 1; ``cond`` sets the spread of the scales), times ``scale``."""
        s = _random_scalar(tuple(batch), cond, generator, dtype)
        return scale * s[..., None, None] * torch.eye(h, dtype=dtype)

    def _deviation(self, A: Tensor) -> Tensor:
        s = torch.diagonal(A, dim1=-2, dim2=-1).mean(-1)
        if not bool((s > 0).all()):
            return torch.tensor(math.inf)
        return ((A - _trace_part(A)).abs().amax((-1, -2)) / s).amax()

    def vertical_solver(self, frame) -> _ScalarSolver:
        return _ScalarSolver(frame)


def _so_basis(h: int, dtype, device) -> Tensor:
    """(e_ie_jᵀ − e_je_iᵀ)/√2 for i < j: an orthonormal basis of so(h)."""
    i, j = torch.triu_indices(h, h, 1, device=device)
    E = torch.zeros(i.numel(), h, h, dtype=dtype, device=device)
    k = torch.arange(i.numel(), device=device)
    E[k, i, j] = 1 / math.sqrt(2)
    E[k, j, i] = -1 / math.sqrt(2)
    return E


def _orthogonal_deviation(A: Tensor, scaled: bool) -> Tensor:
    """max |AᵀA/c − I| (c = 1, or the mean of diag AᵀA when scaled), ∞ where det A ≤ 0."""
    if not bool((torch.linalg.det(A) > 0).all()):
        return torch.tensor(math.inf)
    AtA = A.mT @ A
    c = torch.diagonal(AtA, dim1=-2, dim2=-1).mean(-1)[..., None, None] if scaled else 1.0
    return (AtA / c - torch.eye(A.shape[-1], dtype=A.dtype)).abs().amax()


@dataclass(frozen=True)
class OrthogonalGroup(_ClosedForm):
    """The rotations SO(h): (G, H) ~ (GQ, HQ), QᵀQ = I, det Q = 1. 𝔤 = so(h) (antisymmetric
    matrices), dimension h(h−1)/2; Π_𝔤(X) = ½(X − Xᵀ). Vertical solver: the closed form
    :class:`SkewPencilSolver` for the mix metric with ε = 0; otherwise
    :class:`ConjugateGradientSolver` (to a relative residual of 1e-13), which hands over to the dense
    normal equations (:func:`so_normal_matrix`, Cholesky) where it does not converge.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import OrthogonalGroup
    >>> group = OrthogonalGroup()
    >>> group.dim(3), group.describe(3)
    (3, 'SO(3)')
    >>> Q = group.random_element(3, dtype=torch.float64)
    >>> torch.allclose(Q.T @ Q, torch.eye(3, dtype=torch.float64)), group.contains(Q)
    (True, True)
    """

    name = "orthogonal"

    def dim(self, h: int) -> int:
        return h * (h - 1) // 2

    def describe(self, h: int) -> str:
        return f"SO({h})"

    @property
    def has_scalars(self) -> bool:
        return False

    def project_algebra(self, X: Tensor) -> Tensor:
        return skew(X)

    def algebra_basis(self, h: int, *, dtype=torch.float64, device=None) -> Tensor:
        return _so_basis(h, dtype, device)

    def random_element(self, h, batch=(), *, scale=1.0, cond=1e2, generator=None, dtype=torch.float64):
        """Haar-random rotations (condition number 1 whatever ``cond``; ``scale`` must be 1)."""
        _check_scale(self, scale)
        return _haar_rotation(tuple(batch), h, generator, dtype)

    def _deviation(self, A: Tensor) -> Tensor:
        return _orthogonal_deviation(A, scaled=False)

    def vertical_solver(self, frame):
        """:class:`SkewPencilSolver` (mix, ε = 0) or :class:`ConjugateGradientSolver` with the dense
        normal equations as fallback."""
        return _orthogonal_solver(self, frame, with_scalars=False)


def _scaled_skew(X: Tensor) -> Tensor:
    return skew(X) + _trace_part(X)


@dataclass(frozen=True)
class ScaledOrthogonalGroup(_ClosedForm):
    """Rotation-scalings R₊·SO(h): (G, H) ~ (sGQ, HQ/s). 𝔤 = so(h) ⊕ R·I, dimension
    h(h−1)/2 + 1; Π_𝔤(X) = ½(X − Xᵀ) + tr(X)/h·I. Vertical solver: as for
    :class:`OrthogonalGroup`, with the scalar direction eliminated by a Schur complement in the
    closed form.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import ScaledOrthogonalGroup
    >>> group = ScaledOrthogonalGroup()
    >>> group.dim(3), group.describe(3)
    (4, 'R+ SO(3)')
    >>> group.contains(2.0 * torch.eye(3, dtype=torch.float64))
    True
    """

    name = "scaled_orthogonal"

    def dim(self, h: int) -> int:
        return h * (h - 1) // 2 + 1

    def describe(self, h: int) -> str:
        return f"R+ SO({h})"

    def project_algebra(self, X: Tensor) -> Tensor:
        return _scaled_skew(X)

    def algebra_basis(self, h: int, *, dtype=torch.float64, device=None) -> Tensor:
        eye = torch.eye(h, dtype=dtype, device=device)[None] / math.sqrt(h)
        return torch.cat((_so_basis(h, dtype, device), eye), 0)

    def random_element(self, h, batch=(), *, scale=1.0, cond=1e2, generator=None, dtype=torch.float64):
        """s·Q: Haar Q ∈ SO(h), s log-uniform over [cond^{-1/2}, cond^{1/2}], times ``scale``."""
        s = _random_scalar(tuple(batch), cond, generator, dtype)
        return scale * s[..., None, None] * _haar_rotation(tuple(batch), h, generator, dtype)

    def _deviation(self, A: Tensor) -> Tensor:
        return _orthogonal_deviation(A, scaled=True)

    def vertical_solver(self, frame):
        """As :meth:`OrthogonalGroup.vertical_solver`, with the scalar direction added."""
        return _orthogonal_solver(self, frame, with_scalars=True)


#: The one tolerance on closure under the commutator, for every basis found numerically or given by
#: a user: ‖[X, Y] − Π[X, Y]‖_F ≤ CLOSURE_RTOL for unit-Frobenius X, Y of the span (relative, so
#: independent of the basis' scale). A basis accurate to δ (each element within δ of the true span)
#: gives residuals of about 4δ; a derived basis is accurate to (largest kept singular value) /
#: (smallest dropped one) = 1/gap, at most 1e-8 with the smallest gap the derivation trusts (1e4 ×
#: its threshold 1e-8·σ_max, see :func:`~quotient_manifolds.core.algebra.derive_algebra`), and to
#: rounding (1e-13) for exact symmetries; a span that is not an algebra has residuals of order 1.
CLOSURE_RTOL = 1e-6


def closure_residual(basis: Tensor, *, samples: int = 4, generator=None) -> float:
    r"""How far span(basis) is from closed under the commutator: max over random pairs X, Y of
    unit-Frobenius elements of ‖[X, Y] − Π[X, Y]‖_F (Π the projection onto the span; ``basis``
    orthonormal (d, h, h)). [X, Y] − Π[X, Y] is a bilinear polynomial in the coefficients of X and
    Y, so it vanishes for random X, Y (almost surely) only if it vanishes identically, i.e. only if
    the span is a Lie algebra: a few random pairs decide closure at O(d h² + h³) cost."""
    d = basis.shape[0]
    if d < 2:
        return 0.0
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    c = torch.randn(2, samples, d, generator=gen, dtype=torch.float64).to(basis.dtype)
    c = c / c.norm(dim=-1, keepdim=True)
    X, Y = torch.einsum("psa,ahk->pshk", c, basis)
    Z = X @ Y - Y @ X
    coef = torch.einsum("ahk,shk->sa", basis, Z)
    out = Z - torch.einsum("sa,ahk->shk", coef, basis)
    return float(out.flatten(1).norm(dim=-1).max())


class SubalgebraGroup(SymmetryGroup):
    r"""The connected group exp(𝔤) of a Lie subalgebra 𝔤 ⊆ gl(h) given by a basis.

    ``basis``: (d, h, h) matrices spanning 𝔤 (any spanning set: it is orthonormalised in the
    Frobenius inner product by an SVD, keeping the directions with singular value above
    ``rank_rtol`` × the largest). The span must be closed under the commutator (checked with
    :func:`closure_residual` against ``closure_rtol``, by default :data:`CLOSURE_RTOL`; ValueError
    otherwise), since the vertical
    space of a group is the image of its Lie algebra. ``label`` names it in ``describe``.

    Immutable and hashable; two instances are equal when their spans are (to 1e-8). The vertical
    solver is :class:`NormalEquationsSolver` (dense d×d Cholesky per head); with ``dense_max_dim``
    set, algebras of larger dimension use :class:`ConjugateGradientSolver` first (cheaper at
    well-conditioned points, falling back to the dense solve where it does not converge).

    Parameters
    ----------
    basis:
        A (d, h, h) tensor (or nested sequence) of matrices spanning 𝔤.
    label:
        The name ``describe`` gives the group.
    rank_rtol:
        Relative singular-value threshold below which a direction of ``basis`` is dropped.
    closure_rtol:
        Relative tolerance of the commutator-closure check.
    dense_max_dim:
        Algebras of larger dimension try conjugate gradients before the dense solve; None: always
        dense.

    Raises
    ------
    ValueError
        ``basis`` is not a (d, h, h) stack of square matrices, or its span is not closed under the
        commutator (not a Lie algebra).

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import GLQuotientGeometry, SubalgebraGroup
    >>> diagonal = torch.stack([torch.diag(torch.tensor(e, dtype=torch.float64))
    ...                         for e in ([1.0, 0.0], [0.0, 1.0])])
    >>> group = SubalgebraGroup(diagonal, label="diagonal")
    >>> group.dim(2)
    2
    >>> GLQuotientGeometry(3, 3, 2, group=group).dim
    10
    """

    name = "subalgebra"

    def __init__(self, basis, label: str = "derived", *, rank_rtol: float = 1e-10,
                 closure_rtol: float = CLOSURE_RTOL, dense_max_dim: Optional[int] = None):
        B = torch.as_tensor(basis).detach().to(device="cpu", dtype=torch.float64)
        if B.ndim != 3 or B.shape[-1] != B.shape[-2] or B.shape[-1] < 1:
            raise InvalidArgument(f"SubalgebraGroup needs a (d, h, h) basis of h×h matrices, got shape "
                                  f"{tuple(B.shape)}")
        d0, h = B.shape[0], B.shape[-1]
        if d0:
            _, S, Vh = torch.linalg.svd(B.reshape(d0, h * h), full_matrices=False)
            Q = Vh[S > rank_rtol * S[0].clamp_min(1e-300)] if float(S[0]) > 0 else Vh[:0]
        else:
            Q = B.reshape(0, h * h)
        Q = Q.reshape(-1, h, h).contiguous()
        residual = closure_residual(Q)
        if residual > closure_rtol:
            raise InvalidArgument(
                f"the span of the basis ({Q.shape[0]} dimensions in gl({h})) is not closed under the "
                f"commutator [X, Y] = XY − YX (residual {residual:.2e} > {closure_rtol:g}), so it is "
                f"not the Lie algebra of a group; pass a basis of a Lie subalgebra (e.g. from "
                f"derive_algebra, whose result says whether it is closed)")
        object.__setattr__(self, "_basis", Q)
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "label", str(label))
        object.__setattr__(self, "dense_max_dim", dense_max_dim)
        object.__setattr__(self, "_cache", {})

    def __setattr__(self, key, value):
        raise AttributeError(f"SubalgebraGroup is immutable (cannot set {key!r})")

    def __repr__(self) -> str:
        return f"SubalgebraGroup(label={self.label!r}, h={self._h}, dim={self._basis.shape[0]})"

    def __hash__(self) -> int:
        return hash(("SubalgebraGroup", self._h, self._basis.shape[0]))

    def __eq__(self, other) -> bool:
        if not isinstance(other, SubalgebraGroup):
            return NotImplemented
        if other._h != self._h or other._basis.shape[0] != self._basis.shape[0]:
            return False
        if self._basis.shape[0] == 0:
            return True
        return bool((other._basis - self.project_algebra(other._basis)).abs().max() <= 1e-8)

    # ------------------------------------------------------------------ structure
    @property
    def head_dim(self) -> int:
        return self._h

    def check(self, h: int) -> None:
        if h != self._h:
            raise InvalidArgument(f"{self!r} is a subgroup of GL({self._h}); it does not act on heads of "
                                  f"dimension h = {h}")

    def dim(self, h: int) -> int:
        self.check(h)
        return self._basis.shape[0]

    def describe(self, h: int) -> str:
        return f"{self.label} subgroup of GL({h}), dim {self.dim(h)}"

    @property
    def is_full(self) -> bool:
        return self._basis.shape[0] == self._h ** 2

    @property
    def has_scalars(self) -> bool:
        eye = torch.eye(self._h, dtype=torch.float64)[None] / math.sqrt(self._h)
        return bool((eye - self.project_algebra(eye)).abs().max() <= 1e-10)

    def _basis_as(self, dtype, device) -> Tensor:
        key = (dtype, str(device))
        if key not in self._cache:
            self._cache[key] = self._basis.to(dtype=dtype, device=device)
        return self._cache[key]

    def project_algebra(self, X: Tensor) -> Tensor:
        """Π_𝔤(X) = Σ_a ⟨E_a, X⟩_F E_a (orthonormal basis E)."""
        E = self._basis_as(X.dtype, X.device)
        return torch.einsum("...a,ahk->...hk", torch.einsum("ahk,...hk->...a", E, X), E)

    def algebra_basis(self, h: int, *, dtype=torch.float64, device=None) -> Tensor:
        """The Frobenius-orthonormal basis of 𝔤, (dim 𝔤, h, h)."""
        self.check(h)
        return self._basis.to(dtype=dtype, device=device)

    # ------------------------------------------------------------------ elements
    def random_element(self, h: int, batch: Tuple[int, ...] = (), *, scale: float = 1.0,
                       cond: Optional[float] = 1e2, generator=None,
                       dtype=torch.float64) -> Tensor:
        r"""exp(tX) for a random X ∈ 𝔤 (Gaussian coefficients, unit Frobenius norm), times
        ``scale`` (which must be 1 unless the scalars are in 𝔤).

        t ≤ t_π = 3 / max |Im λ(X)| keeps the eigenvalues of tX in the strip |Im| < π, where the
        principal logarithm inverts the exponential (so ``contains`` recognises the element); below
        that cap, t is bisected so that cond(exp(tX)) = ``cond`` when the algebra allows it (compact
        directions such as rotations have condition number 1: the result is then exp(t_π X)). With
        ``cond=None``, t = min(1, t_π)."""
        self.check(h)
        _check_scale(self, scale)
        batch = tuple(batch)
        d = self._basis.shape[0]
        if d == 0:
            return scale * torch.eye(h, dtype=dtype).expand(batch + (h, h)).clone()
        c = torch.randn(batch + (d,), generator=generator, dtype=torch.float64)
        X = torch.einsum("...a,ahk->...hk", c / c.norm(dim=-1, keepdim=True), self._basis)
        imag = torch.linalg.eigvals(X).imag.abs().amax(-1)
        t_pi = torch.where(imag > 1e-12, 3.0 / imag.clamp_min(1e-12), torch.full_like(imag, 60.0))
        t_pi = t_pi.clamp_max(60.0)     # exp(60·X) with ‖X‖_F = 1 stays far from overflow
        if cond is None:
            t = t_pi.clamp_max(1.0)
        else:
            def log_cond(tt):
                s = torch.linalg.svdvals(torch.linalg.matrix_exp(tt[..., None, None] * X))
                return (s[..., 0] / s[..., -1]).log()
            goal = math.log(float(cond))
            lo, hi = torch.zeros_like(t_pi), t_pi.clone()
            reachable = log_cond(hi) >= goal
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                above = log_cond(mid) >= goal
                hi = torch.where(above, mid, hi)
                lo = torch.where(above, lo, mid)
            t = torch.where(reachable, 0.5 * (lo + hi), t_pi)
        A = torch.linalg.matrix_exp(t[..., None, None] * X)
        return (scale * A).to(dtype)

    def contains(self, A: Tensor, *, rtol: float = 1e-10) -> bool:
        r"""Whether the principal logarithm of every A lies in 𝔤: ‖log A − Π_𝔤 log A‖_F ≤
        rtol·max(1, ‖log A‖_F), and False where A has a real eigenvalue ≤ 0.

        This decides membership of exp(X), X ∈ 𝔤, whenever the eigenvalues of X lie in the strip
        |Im| < π (the elements ``random_element`` draws, and every element near the identity); a
        group element that is only a product of such exponentials may be reported outside."""
        import warnings

        import scipy.linalg

        mats = A.detach().to(device="cpu", dtype=torch.float64).reshape(-1, self._h, self._h)
        for M in mats:
            with warnings.catch_warnings():     # logm's accuracy warning: the threshold decides
                warnings.simplefilter("ignore", RuntimeWarning)
                L = torch.as_tensor(scipy.linalg.logm(M.numpy()))
            if L.is_complex():
                if float(L.imag.abs().max()) > rtol * max(1.0, float(L.abs().max())):
                    return False
                L = L.real
            L = L.to(torch.float64)
            dev = float((L - self.project_algebra(L)).norm())
            if not dev <= rtol * max(1.0, float(L.norm())):
                return False
        return True

    # ------------------------------------------------------------------ horizontal projection
    def vertical_solver(self, frame):
        """:class:`NormalEquationsSolver` (or :class:`ConjugateGradientSolver` for dim 𝔤 >
        ``dense_max_dim``); :class:`ZeroSolver` for 𝔤 = 0."""
        self.check(frame.G.shape[-1])
        d = self._basis.shape[0]
        if d == 0:
            return ZeroSolver()
        dense = lambda: NormalEquationsSolver(self._basis, frame)  # noqa: E731
        if self.dense_max_dim is None or d <= self.dense_max_dim:
            return dense()
        return ConjugateGradientSolver(self.project_algebra, d, frame, fallback=dense)
