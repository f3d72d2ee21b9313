r"""Geometry of the GL(h) two-factor quotient, written once in torch.

A point is a pair (G, H), G ∈ R^{n×h}, H ∈ R^{m×h} of full column rank, stored as ONE tensor
``x = [G; H]`` of shape ``(..., n+m, h)``; every leading dimension is a batch dimension (e.g. one
quotient per attention head). The group GL(h) acts by (G, H) ↦ (G A, H A^{-T}); the function
f(G, H) = g(G Hᵀ) is constant along orbits. Tangent vectors ξ = [ξ_G; ξ_H] share the layout.

Notation (docs/maths.md §1): P = GᵀG + εI, Q = HᵀH + εI (the ε relaxation of docs/maths.md
§6.4, used consistently everywhere below).

Metrics (docs/maths.md §2). Both are of the form

    g_x(u, v) = tr(M_G u_Gᵀ v_G) + tr(M_H u_Hᵀ v_H),

with N_G = M_G⁻¹, N_H = M_H⁻¹ the inverse weights; the formulas in which "inv" and "mix" differ
are methods of their classes in :mod:`quotient_manifolds.core.metrics`, and everything below is
written once, for both.

Everything that depends on the point alone (Gram matrices, Cholesky factors, the eigenstructure
of the projection) is computed once per point in a :class:`GLFrame`; the sharpness engine keeps
one frame at the trained weights for the whole Auto-PGD run.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from ..errors import InvalidArgument
from .._validation import (batch_shape, choice, finite_real, flag, floating_dtype, floating_tensor,
                           group_element, optional_generator, relaxation, size)
from .groups import FULL_GL, Group, as_group, pencil_basis, sym
from .metrics import GeodesicLeftManifold, GLMetric, InvMetric, MixMetric
from .products import add_product, matmul

#: The metric of each name users may pass as ``metric=``.
METRIC_BY_NAME = {metric.name: metric for metric in (InvMetric(), MixMetric())}
METRICS = tuple(METRIC_BY_NAME)
RETRACTIONS = ("first_order", "second_order", "exact")

Tensor = torch.Tensor


def as_metric(metric: "str | GLMetric") -> GLMetric:
    """The metric object of ``metric``: a :class:`~quotient_manifolds.core.metrics.GLMetric` as
    given, or the one named by a string of :data:`METRICS`.

    Parameters
    ----------
    metric:
        ``"mix"``, ``"inv"`` or a :class:`~quotient_manifolds.core.metrics.GLMetric`.

    Returns
    -------
    GLMetric
        ``metric`` itself if it is a metric object, else the metric of that name.

    Raises
    ------
    ValueError
        ``metric`` is a string not in :data:`METRICS`.

    Examples
    --------
    >>> from quotient_manifolds.core import as_metric
    >>> as_metric("inv").name
    'inv'
    """
    if isinstance(metric, GLMetric):
        return metric
    return METRIC_BY_NAME[choice("metric", metric, METRICS)]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the Gram-matrix work: float64 for float inputs of lower precision
    (docs/maths.md §7.3)."""
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float64
    raise InvalidArgument(f"points and tangent vectors must be floating point tensors, got dtype {dtype}")


def _right_solve(x: Tensor, chol: Tensor) -> Tensor:
    """X S⁻¹ for S = L Lᵀ given its Cholesky factor L (S symmetric, so X S⁻¹ = (S⁻¹ Xᵀ)ᵀ)."""
    return torch.cholesky_solve(x.mT, chol).mT


def _weighted_dot(uM: Tensor, v: Tensor) -> Tensor:
    """Σ (uM ⊙ v) over the last two dimensions: one dot product for single contiguous matrices,
    else in place into ``uM`` (a fresh product) when the shapes agree."""
    if uM.dim() == 2 and uM.shape == v.shape and uM.is_contiguous() and v.is_contiguous():
        return torch.dot(uM.view(-1), v.view(-1))
    return (uM.mul_(v) if uM.shape == v.shape else uM * v).sum((-1, -2))


def group_action(G: Tensor, H: Tensor, A: Tensor) -> Tuple[Tensor, Tensor]:
    """The GL(h) action (G, H) ↦ (G A, H A⁻ᵀ) (docs/maths.md §1; the paper's (G A⁻¹, H Aᵀ)
    with A ↦ A⁻¹).

    G Hᵀ is unchanged; tangent vectors transform by the same linear map.

    Parameters
    ----------
    G, H:
        Factors of shapes (..., n, h) and (..., m, h).
    A:
        An invertible (..., h, h) matrix.

    Returns
    -------
    tuple of Tensor
        (G A, H A⁻ᵀ).

    Raises
    ------
    torch.linalg.LinAlgError
        ``A`` is singular.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import group_action
    >>> G, H = torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    >>> A = torch.tensor([[2.0, 1.0], [0.0, 0.5]], dtype=torch.float64)
    >>> GA, HA = group_action(G, H, A)
    >>> torch.allclose(GA @ HA.T, G @ H.T)
    True
    """
    return G @ A, torch.linalg.solve(A, H.mT).mT


class GLFrame:
    r"""Everything the geometry needs at one point x = [G; H], computed once.

    Methods take tangent vectors (or ambient vectors) with the layout of the point and broadcast
    over leading batch dimensions. Inputs of any float dtype are promoted to float64 internally and
    results are returned in the dtype of the tangent argument.

    ``keep_dtype=True`` stores x in its own dtype and promotes it where a method uses it, instead
    of holding a float64 copy: the same numbers (promotion is exact), half the memory of the point
    for float32 weights (a quarter for bfloat16), one conversion per use. The sharpness engine
    frames the attention weights of large models this way.

    Parameters
    ----------
    geometry:
        The :class:`GLQuotientGeometry` the point belongs to (usually made by its ``frame``).
    x:
        The point [G; H], shape (..., n+m, h), G and H of full column rank.
    check:
        Validate the shape of ``x`` and that its Gram matrices are positive definite.
    keep_dtype:
        Store ``x`` in its own dtype (see above).

    Raises
    ------
    ValueError
        ``x`` has the wrong shape or a non-float dtype, or G or H is rank deficient (with
        ``check=True``; relax with ``eps > 0`` for rank-deficient weights).

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import GLQuotientGeometry
    >>> geometry = GLQuotientGeometry(3, 3, 2, "mix")
    >>> x = geometry.random_point(dtype=torch.float64)
    >>> frame = geometry.frame(x)
    >>> u = frame.project(torch.randn_like(x))          # a horizontal vector
    >>> torch.allclose(frame.project(u), u)
    True
    >>> bool(frame.norm(u) > 0)
    True
    """

    def __init__(self, geometry: "GLQuotientGeometry", x: Tensor, *, check: bool = True,
                 keep_dtype: bool = False):
        self.geometry = geometry
        self.metric = geometry.metric
        self.gl_metric = geometry.gl_metric
        self.eps = geometry.eps
        n = geometry.n
        if check:
            geometry.check_shape(x.shape, "x")
        self.dtype = x.dtype
        self.cdtype = compute_dtype(x.dtype)
        xc = x if x.dtype == self.cdtype else x.to(self.cdtype)
        self._n = n
        if flag("keep_dtype", keep_dtype) and x.dtype != self.cdtype:
            self._x, self._G, self._H = x, None, None
        else:
            self._x, self._G, self._H = xc, xc[..., :n, :], xc[..., n:, :]
        self.eye = geometry.identity(self.cdtype, x.device)
        # (GᵀG, HᵀH) stacked (..., 2, h, h): both factors through one Cholesky and one check
        self._stacked_grams = self.block_grams(xc, xc)
        del xc
        self._stacked_relaxed = (self._stacked_grams + self.eps * self.eye if self.eps
                                 else self._stacked_grams)
        self._stacked_chol = self._cholesky(self._stacked_relaxed, x, check)

    # the blocks of the stacked (..., 2, h, h) matrices, as views made when first asked for
    @functools.cached_property
    def _grams(self) -> Tuple[Tensor, Tensor]:
        return self._stacked_grams.unbind(-3)

    @functools.cached_property
    def _relaxed(self) -> Tuple[Tensor, Tensor]:
        return self._stacked_relaxed.unbind(-3)

    @functools.cached_property
    def _chol(self) -> Tuple[Tensor, Tensor]:
        return self._stacked_chol.unbind(-3)

    gram_G = property(lambda self: self._grams[0], doc="GᵀG.")
    gram_H = property(lambda self: self._grams[1], doc="HᵀH.")
    P = property(lambda self: self._relaxed[0], doc="P = GᵀG + εI.")
    Q = property(lambda self: self._relaxed[1], doc="Q = HᵀH + εI.")
    chol_P = property(lambda self: self._chol[0], doc="The Cholesky factor of P.")
    chol_Q = property(lambda self: self._chol[1], doc="The Cholesky factor of Q.")

    @property
    def x(self) -> Tensor:
        """The point [G; H] in the compute dtype."""
        return self._x if self._x.dtype == self.cdtype else self._x.to(self.cdtype)

    @property
    def G(self) -> Tensor:
        return self._G if self._G is not None else self._x[..., :self._n, :].to(self.cdtype)

    @property
    def H(self) -> Tensor:
        return self._H if self._H is not None else self._x[..., self._n:, :].to(self.cdtype)

    # ------------------------------------------------------------------ factorisations
    def _cholesky(self, grams: Tensor, x: Tensor, check: bool) -> Tensor:
        """The Cholesky factors of the stacked (P, Q) ``(..., 2, h, h)``; with ``check``, a point
        with non-finite values or a factor without full column rank raises a ValueError naming it.

        A non-finite entry of x reaches a diagonal entry of its Gram matrix (a sum of squares), so
        the pivot test below catches it too; x itself is read only to say which it was."""
        chol, info = torch.linalg.cholesky_ex(grams)
        if check:
            smallest, largest = torch.aminmax(torch.diagonal(chol, dim1=-2, dim2=-1), dim=-1)
            # min_i L_ii² ≥ λ_min(gram): a tiny pivot relative to the largest one flags rank loss.
            # (min/max)² ≈ (σ_min/σ_max)² of the factor: rank is judged at the input precision
            # (σ_min/σ_max < 10·eps(dtype)) and at the compute precision of the Gram matrix.
            tol = max((10 * torch.finfo(self.dtype).eps) ** 2, 10 * torch.finfo(self.cdtype).eps)
            # min > √tol·max ⟺ (min/max)² > tol; false for NaN pivots and for max = 0
            full_rank = (smallest > math.sqrt(tol) * largest).logical_and_(info == 0)
            if not bool(full_rank.all()):
                bad = full_rank.logical_not_()
                ratio = (smallest / largest.clamp_min(1e-300)).square_()
                if not bool(torch.isfinite(x).all()):
                    raise InvalidArgument("the point x = [G; H] contains non-finite values (nan or inf)")
                *idx, block = (int(i) for i in torch.nonzero(bad)[0])
                factor = "GH"[block]
                where = f" at batch index {tuple(idx)}" if idx else ""
                raise InvalidArgument(
                    f"{factor} is rank-deficient or numerically singular{where}: its Gram matrix "
                    f"{factor}ᵀ{factor}{' + εI' if self.eps else ''} has relative smallest pivot "
                    f"{float(ratio[..., block].reshape(-1).min()):.2e} (tolerance {tol:.1e} for "
                    f"{self.dtype}). The quotient needs G and H of full column rank h; pass a "
                    f"relaxation eps > 0 (e.g. eps=1e-6 × the mean eigenvalue of the Gram matrix, "
                    f"docs/maths.md §6.4) to use the relaxed metric GᵀG + εI."
                )
        return chol

    @functools.cached_property
    def _stacked_inverses(self) -> Tuple[Tensor, Tensor]:
        """(P⁻¹, Q⁻¹), from one batched inversion of the stacked Cholesky factors."""
        return torch.cholesky_inverse(self._stacked_chol).unbind(-3)

    @property
    def P_inv(self) -> Tensor:
        return self._stacked_inverses[0]

    @property
    def Q_inv(self) -> Tensor:
        return self._stacked_inverses[1]

    @functools.cached_property
    def metric_weights(self) -> Tuple[Tensor, Tensor]:
        """(M_G, M_H) with g(u, v) = tr(M_G u_Gᵀv_G) + tr(M_H u_Hᵀv_H)."""
        return self.gl_metric.weights(self)

    @functools.cached_property
    def inverse_metric_weights(self) -> Tuple[Tensor, Tensor]:
        """(N_G, N_H) = (M_G⁻¹, M_H⁻¹); the Riemannian gradient is (∇_G N_G, ∇_H N_H)."""
        return self.gl_metric.inverse_weights(self)

    @functools.cached_property
    def _projection_basis(self) -> Tuple[Tensor, Tensor, Tensor]:
        r"""(W₁, W₂, D) such that, for the full GL(h), the vertical component of u is (GΛ, −HΛᵀ) with

            Λ = W₁ [ (W₁ᵀ C W₂) ⊘ D ] W₂ᵀ,   C = Gᵀu_G M_G − M_H u_Hᵀ H.

        Derivation (docs/maths.md §3.2, generalised to the ε-relaxed metrics): the metric-orthogonal
        vertical component solves GᵀG Λ M_G + M_H Λ HᵀH = C. Multiplying by N_H on the left and N_G
        on the right gives the Sylvester equation A₁Λ + ΛA₂ = N_H C N_G with A₁ = N_H GᵀG and
        A₂ = HᵀH N_G. Writing N_H = F_H F_Hᵀ and N_G = F_G F_Gᵀ, A₁ = F_H U₁ diag(d₁) U₁ᵀ F_H⁻¹ with
        (d₁, U₁) = eigh(F_Hᵀ GᵀG F_H), and A₂ = F_G⁻ᵀ U₂ diag(d₂) U₂ᵀ F_Gᵀ with
        (d₂, U₂) = eigh(F_Gᵀ HᵀH F_G); so W₁ = F_H U₁, W₂ = F_G U₂, D_ij = d₁ᵢ + d₂ⱼ.
        For ε = 0 and the inv metric this is the corrected Sylvester equation (PQ)X + X(PQ) = B,
        Λ = Xᵀ, of docs/maths.md §3.2 (not the paper's misprint). For ε = 0 and the mix metric
        d₁ = d₂ = 1 and the formula is the closed form Λ = ½ P⁻¹ C Q⁻¹ = ½[P⁻¹Gᵀu_G − u_HᵀH Q⁻¹]; no
        eigendecomposition is needed then.
        """
        F_G, F_H = self.gl_metric.inverse_weight_factors(self)
        if self.gl_metric.closed_form_projection(self.eps):
            two = torch.full(self.P.shape[:-2] + (1, 1), 2.0, dtype=self.cdtype, device=self.P.device)
            return F_H, F_G, two
        return pencil_basis(F_H, self.gram_G, F_G, self.gram_H)

    @functools.cached_property
    def christoffel_weights(self) -> Tensor:
        """The stacked h×h weights K of :meth:`GLMetric.christoffel_coefficients
        <quotient_manifolds.core.metrics.GLMetric.christoffel_coefficients>`."""
        return self.gl_metric.christoffel_weights(self)

    # ------------------------------------------------------------------ blockwise products
    def _paired(self, u) -> bool:
        """Whether u (a stacked tensor) can be worked on as ``(..., 2, n, h)`` blocks (n = m)."""
        return self.geometry.n == self.geometry.m and not isinstance(u, tuple)

    @functools.cached_property
    def _stacked_weights(self) -> Tensor:
        """(M_G, M_H) stacked as ``(..., 2, h, h)``."""
        return torch.stack(self.metric_weights, dim=-3)

    @functools.cached_property
    def _stacked_inverse_weights(self) -> Tensor:
        """(N_G, N_H) stacked as ``(..., 2, h, h)``."""
        return torch.stack(self.inverse_metric_weights, dim=-3)

    def _blocks(self, u: Tensor) -> Tensor:
        """u = [u_G; u_H] as a ``(..., 2, n, h)`` view (n = m only)."""
        return u.unflatten(-2, (2, self.geometry.n))

    def block_grams(self, a: Tensor, b: Tensor) -> Tensor:
        """(a_Gᵀb_G, a_Hᵀb_H) stacked as ``(..., 2, h, h)``: one batched product when n = m."""
        if self.geometry.n == self.geometry.m and not (isinstance(a, tuple) or isinstance(b, tuple)):
            return matmul(self._blocks(a).mT, self._blocks(b))
        aG, aH = self._split(a)
        bG, bH = (aG, aH) if b is a else self._split(b)
        return torch.stack((matmul(aG.mT, bG), matmul(aH.mT, bH)), dim=-3)

    def block_combination(self, *terms: Tuple[Tensor, Tensor]) -> Tensor:
        """Σᵢ [aᵢ_G Cᵢ_G; aᵢ_H Cᵢ_H] for pairs (aᵢ, Cᵢ), aᵢ of the layout of x and Cᵢ stacked h×h
        blocks ``(..., 2, h, h)``: one batched product per term when n = m, accumulated in place
        (no n×h temporary per term) where the batch shapes agree."""
        if self.geometry.n != self.geometry.m:
            split = [(self._split(a), C.unbind(-3)) for a, C in terms]
            parts = []
            for block in (0, 1):
                (a0, C0), rest = split[0], split[1:]
                out = matmul(a0[block], C0[block])
                for a, C in rest:
                    out = add_product(out, a[block], C[block])
                parts.append(out)
            return self._pack(*parts)
        (a0, C0), rest = terms[0], terms[1:]
        out = matmul(self._blocks(a0), C0)
        for a, C in rest:
            out = add_product(out, self._blocks(a), C)
        return out.flatten(-3, -2)

    def _forward_grams(self, uc: Tensor) -> Tuple[Tensor, Tensor]:
        """(Aᵀu_A, u_Aᵀu_A) per block A: the Gram products of the second-order retraction."""
        return self.block_grams(self.x, uc), self.block_grams(uc, uc)

    def _retraction_grams(self, uc: Tensor) -> Tuple[Tensor, Tensor]:
        """(S, W) = (sym(Aᵀu_A), u_Aᵀu_A) per block A, the inputs of the Christoffel coefficients."""
        x_u, u_u = self._forward_grams(uc)
        return sym(x_u), u_u

    # ------------------------------------------------------------------ helpers
    # A tangent vector is one stacked tensor [u_G; u_H], or (for inner, norm, project and
    # egrad2rgrad) the pair (u_G, u_H) of its blocks, answered in the same form: the pymanopt face
    # passes its pairs of arrays without concatenating them.
    def _split(self, u: "Tensor | Tuple[Tensor, Tensor]") -> Tuple[Tensor, Tensor]:
        if isinstance(u, tuple):
            return u
        if u is self._x and self._G is not None:   # the point: its blocks are kept
            return self._G, self._H
        return u.split((self.geometry.n, self.geometry.m), dim=-2)  # one call, not two slicings

    def _pack(self, uG: Tensor, uH: Tensor) -> Tensor:
        return torch.cat((uG, uH), dim=-2)

    def _pack_like(self, uG: Tensor, uH: Tensor, like) -> "Tensor | Tuple[Tensor, Tensor]":
        """[u_G; u_H], or the pair (u_G, u_H) when ``like`` is a pair."""
        return (uG, uH) if isinstance(like, tuple) else self._pack(uG, uH)

    # (dtype compared in Python first: a no-op ``.to`` still costs a dispatch on small tensors)
    def _in(self, u):
        if isinstance(u, tuple):
            for part in u:
                if not part.is_floating_point():   # cast back to u's dtype, it would be truncated
                    floating_tensor("u", part)
            return tuple(part if part.dtype == self.cdtype else part.to(self.cdtype) for part in u)
        if not u.is_floating_point():      # the result, cast back to u's dtype, would be truncated
            floating_tensor("u", u)
        if u.shape[-2:] != self._x.shape[-2:]:   # (not self.x: that may convert the point)
            self.geometry.check_shape(u.shape, "tangent vector")
        return u if u.dtype == self.cdtype else u.to(self.cdtype)

    def _out(self, y, like):
        dtype = like[0].dtype if isinstance(like, tuple) else like.dtype
        if isinstance(y, tuple):
            return tuple(part if part.dtype == dtype else part.to(dtype) for part in y)
        return y if y.dtype == dtype else y.to(dtype)

    # ------------------------------------------------------------------ metric
    def inner(self, u: Tensor, v: Optional[Tensor] = None, *, keepdim: bool = False) -> Tensor:
        """g_x(u, v) = tr(M_G u_Gᵀv_G) + tr(M_H u_Hᵀv_H) (docs/maths.md §2, Eqs. 9–10)."""
        uc = self._in(u)
        vc = uc if v is None else self._in(v)
        paired = self._paired(uc) and self._paired(vc)
        uM = self._times_metric(uc, paired)
        if paired:
            out = _weighted_dot(uM, self._blocks(vc)).sum(-1)
        else:
            vG, vH = self._split(vc)
            out = _weighted_dot(uM[0], vG) + _weighted_dot(uM[1], vH)
        if keepdim:
            out = out[..., None, None]
        first = u[0] if isinstance(u, tuple) else u
        second = first if v is None else (v[0] if isinstance(v, tuple) else v)
        dtype = first.dtype if first.dtype == second.dtype else torch.result_type(first, second)
        return out if out.dtype == dtype else out.to(dtype)

    def inners(self, u: Tensor, *vs: Tensor) -> Tuple[Tensor, ...]:
        """(g_x(u, v₁), g_x(u, v₂), …) in the compute dtype, one per batch element each, with the
        metric product u·M formed once (stacked u and v)."""
        uc = self._in(u)
        paired = self._paired(uc)
        uM = self._times_metric(uc, paired)
        uM = uM.flatten(-3, -2) if paired else self._pack(*uM)
        return tuple((uM * self._in(v)).sum((-1, -2)) for v in vs)

    def norm_sq_and_grams(self, u: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """Σ over the batch of ‖u‖²_x = Σ_A tr(M_A u_Aᵀu_A), in float64, and the Gram products
        (Aᵀu_A, u_Aᵀu_A) it comes from: those of the second-order retraction along u (and, scaled
        by c and c², along c·u), one product more than the norm alone needs."""
        uc = self._in(u)
        grams = self._forward_grams(uc)
        return self.norm_sq_of_gram(grams[1]).sum(dtype=torch.float64), grams

    def norm_sq_of_gram(self, W: Tensor) -> Tensor:
        """‖u‖²_x = Σ_A tr(M_A u_Aᵀu_A) per batch element, from W = (u_Gᵀu_G, u_Hᵀu_H) stacked
        ``(..., 2, h, h)`` (:meth:`block_grams` of u with itself)."""
        return (self._stacked_weights * W).sum((-1, -2, -3))

    def _times_metric(self, uc: "Tensor | Tuple[Tensor, Tensor]", paired: bool
                      ) -> "Tensor | Tuple[Tensor, Tensor]":
        """u·M per block: the ``(..., 2, n, h)`` blocks [u_G M_G; u_H M_H] in one batched product
        where ``paired``, else the pair (u_G M_G, u_H M_H)."""
        if paired:
            return matmul(self._blocks(uc), self._stacked_weights)
        M_G, M_H = self.metric_weights
        uG, uH = self._split(uc)
        return matmul(uG, M_G), matmul(uH, M_H)

    def norm(self, u: Tensor, *, keepdim: bool = False) -> Tensor:
        """‖u‖_x = √g_x(u, u)."""
        return self.inner(u, keepdim=keepdim).clamp_min(0).sqrt()

    # ------------------------------------------------------------------ vertical / horizontal
    def vertical(self, lam: Tensor) -> Tensor:
        """The vertical vector (GΛ, −HΛᵀ) generated by Λ ∈ ℝʰˣʰ (docs/maths.md §1)."""
        lc = floating_tensor("lam", lam).to(self.cdtype)
        return self._out(self._pack(matmul(self.G, lc), -matmul(self.H, lc.mT)), lam)

    @functools.cached_property
    def _vertical_solver(self):
        return self.geometry.group.vertical_solver(self)

    def _generator_of_grams(self, GtuG: Tensor, HtuH: Tensor) -> Tensor:
        """Λ of :meth:`vertical_generator` from Gᵀu_G and Hᵀu_H: the pairing
        C = Gᵀu_G M_G − M_H u_HᵀH gives g(u, (GE, −HEᵀ)) = ⟨E, C⟩_F for every E, and Λ solves
        L(Λ) = C on the group's algebra (the group's solver)."""
        M_G, M_H = self.metric_weights
        return self._vertical_solver.solve(matmul(GtuG, M_G) - matmul(M_H, HtuH.mT))

    def vertical_generator(self, u: Tensor) -> Tensor:
        """Λ ∈ 𝔤 such that (GΛ, −HΛᵀ) is the metric-orthogonal vertical component of u
        (docs/maths.md §3.2; for a subgroup of GL(h), §13.2 and
        :mod:`quotient_manifolds.core.groups`)."""
        uc = self._in(u)
        if self._paired(uc):  # (Gᵀu_G, Hᵀu_H) in one batched product
            return self._generator_of_grams(*self.block_grams(self.x, uc).unbind(-3))
        uG, uH = self._split(uc)
        return self._generator_of_grams(matmul(self.G.mT, uG), matmul(self.H.mT, uH))

    def project(self, u: Tensor) -> Tensor:
        """Metric-orthogonal projection onto the horizontal space H_x (docs/maths.md §3.2).

        Parameters
        ----------
        u:
            An ambient vector with the layout of x.

        Returns
        -------
        Tensor
            Its horizontal part, the dtype of ``u``.

        Raises
        ------
        RuntimeError
            ``u`` does not broadcast against x.

        Examples
        --------
        See the class's example (``frame.project(u)``).
        """
        uc = self._in(u)
        lam = self.vertical_generator(uc)
        if self._paired(uc):  # u + [G(−Λ); HΛᵀ] in one batched product
            out = self.block_combination((self.x, torch.stack((-lam, lam.mT), dim=-3)))
            return self._out(out.add_(uc) if out.shape == uc.shape else out + uc, u)
        uG, uH = self._split(uc)
        moved = (uG - matmul(self.G, lam), uH + matmul(self.H, lam.mT))
        return self._out(self._pack_like(*moved, u), u)

    def horizontal_residual(self, u: Tensor) -> Tensor:
        """Relative residual of the horizontal equations (0 for horizontal u; docs/maths.md §3.1).

        u is horizontal iff g(u, (GE, −HEᵀ)) = ⟨E, Gᵀu_G M_G − M_H u_HᵀH⟩_F = 0 for all E ∈ 𝔤, i.e.
        Π_𝔤(Gᵀu_G M_G) = Π_𝔤(M_H u_HᵀH) (for the full GL(h) and ε = 0: inv ξ_GᵀG Q = P Hᵀξ_H,
        mix Gᵀξ_G Q = P ξ_HᵀH up to the invertible factors). Returned: max|lhs − rhs| / (max|lhs| +
        max|rhs|) per batch element.
        """
        uG, uH = self._split(self._in(u))
        M_G, M_H = self.metric_weights
        project = self.geometry.group.project_algebra
        lhs, rhs = project(self.G.mT @ uG @ M_G), project(M_H @ uH.mT @ self.H)
        scale = lhs.abs().amax((-1, -2)) + rhs.abs().amax((-1, -2))
        return (lhs - rhs).abs().amax((-1, -2)) / scale.clamp_min(torch.finfo(self.cdtype).tiny)

    # ------------------------------------------------------------------ gradient / Hessian
    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        """Horizontal Riemannian gradient (∇_G N_G, ∇_H N_H), then projected (docs/maths.md §4).

        inv: (∇_G P, ∇_H Q); mix: (∇_G Q⁻¹, ∇_H P⁻¹). For GL-invariant losses the result is already
        horizontal; the final projection makes non-invariant terms (weight decay) horizontal too.

        Parameters
        ----------
        egrad:
            The Euclidean gradient (∇_G, ∇_H), the layout of x.

        Returns
        -------
        Tensor
            The Riemannian gradient, horizontal, the dtype of ``egrad``.

        Raises
        ------
        RuntimeError
            ``egrad`` does not broadcast against x.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds.core import GLQuotientGeometry
        >>> geometry = GLQuotientGeometry(3, 3, 2, "mix")
        >>> x = geometry.random_point(dtype=torch.float64).requires_grad_()
        >>> G, H = geometry.split(x)
        >>> (G @ H.T).pow(2).sum().backward()               # a loss of G Hᵀ only
        >>> frame = geometry.frame(x.detach())
        >>> rgrad = frame.egrad2rgrad(x.grad)
        >>> torch.allclose(frame.project(rgrad), rgrad)     # horizontal
        True
        """
        gc = self._in(egrad)
        # projected in the compute dtype, then cast once: no rounded copy in between
        if self._paired(gc):
            rgrad = self.block_combination((gc, self._stacked_inverse_weights))
            del gc
            return self._out(self.project(rgrad), egrad)
        gG, gH = self._split(gc)
        N_G, N_H = self.inverse_metric_weights
        return self._out(self.project(self._pack_like(matmul(gG, N_G), matmul(gH, N_H), egrad)),
                         egrad)

    def ehess2rhess(self, egrad: Tensor, ehess: Tensor, u: Tensor) -> Tensor:
        """Riemannian Hessian P_h(D rgrad[u] + Γ(rgrad, u)) of the quotient, u horizontal.

        D rgrad[u] = (∇²_G[u] N_G + ∇_G DN_G[u], …) with DP[u] = 2 sym(Gᵀu_G) and
        D(Q⁻¹)[u] = −Q⁻¹ 2 sym(Hᵀu_H) Q⁻¹ (docs/maths.md §4; Manopt's ``ehess2rhess`` for both
        factories, §A.9).
        """
        gG, gH = self._split(self._in(egrad))
        hG, hH = self._split(self._in(ehess))
        uG, uH = self._split(self._in(u))
        N_G, N_H = self.inverse_metric_weights
        dP = 2 * sym(matmul(self.G.mT, uG))
        dQ = 2 * sym(matmul(self.H.mT, uH))
        dN_G, dN_H = self.gl_metric.inverse_weights_derivative(self, dP, dQ)
        rgrad = self._pack(matmul(gG, N_G), matmul(gH, N_H))
        d_rgrad = self._pack(add_product(matmul(hG, N_G), gG, dN_G),
                             add_product(matmul(hH, N_H), gH, dN_H))
        return self._out(self.project(d_rgrad + self.christoffel(rgrad, self._in(u))), u)

    # ------------------------------------------------------------------ connection
    def christoffel(self, u: Tensor, v: Optional[Tensor] = None) -> Tensor:
        r"""Symmetric Christoffel map Γ_x(u, v) of the (ε-relaxed) total-space metric
        (docs/maths.md §5), with P = GᵀG + εI, Q = HᵀH + εI: for each metric the formula of
        :meth:`~quotient_manifolds.core.metrics.GLMetric.christoffel` (paper Eq. 11 for inv,
        Eq. 12 for mix).

        Geodesics satisfy :math:`\ddot\gamma + \Gamma(\dot\gamma, \dot\gamma) = 0`, and the
        connection is :math:`\nabla_u v = Dv[u] + \Gamma(u, v)`.
        """
        uc = self._in(u)
        if v is None:  # Γ(u, u) = [G C_G + u_G D_G; H C_H + u_H D_H]: four products per block
            C, D = self.gl_metric.christoffel_coefficients(self, *self._retraction_grams(uc))
            return self._out(self.block_combination((self.x, C), (uc, D)), u)
        uG, uH = self._split(uc)
        vG, vH = self._split(self._in(v))
        return self._out(self._pack(*self.gl_metric.christoffel(self, uG, uH, vG, vH)), u)

    # ------------------------------------------------------------------ retractions
    def retract(self, u: Tensor, method: Optional[str] = None, *,
                exact_steps: Optional[int] = None) -> Tensor:
        r"""Move from x along u (docs/maths.md §5.1).

        * ``first_order``: :math:`x + u`;
        * ``second_order``: :math:`x + u - \tfrac12 \Gamma_x(u, u)`, the second-order geodesic of
          the paper's Eq. 5 (default);
        * ``exact``: the geodesic :math:`\ddot\gamma + \Gamma_\gamma(\dot\gamma, \dot\gamma) = 0`,
          :math:`\gamma(0) = x`, :math:`\dot\gamma(0) = u`, at t = 1, integrated numerically (see
          :func:`integrate_geodesic`; ``exact_steps`` overrides the geometry's number of RK4 steps).

        All three are equivariant under the group action.

        Parameters
        ----------
        u:
            A tangent vector at x, the layout of x.
        method:
            ``"first_order"``, ``"second_order"`` or ``"exact"`` (default: the geometry's).
        exact_steps:
            RK4 steps of ``"exact"``.

        Returns
        -------
        Tensor
            The new point, the dtype of ``u``.

        Raises
        ------
        ValueError
            An unknown ``method``; :class:`~quotient_manifolds.StepTooLarge` when the new point
            leaves the manifold (a factor loses rank).

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds.core import GLQuotientGeometry
        >>> geometry = GLQuotientGeometry(3, 3, 2, "mix")
        >>> x = geometry.random_point(dtype=torch.float64)
        >>> frame = geometry.frame(x)
        >>> u = 0.1 * geometry.random_horizontal(x)
        >>> exact = frame.retract(u, "exact")
        >>> float((frame.retract(u, "second_order") - exact).norm()) < 1e-3   # O(‖u‖³) apart
        True

        The second-order step is computed as [G(I − ½C_G) + u_G(I − ½D_G); H(…)] from the
        Christoffel coefficients (:meth:`GLMetric.christoffel_coefficients
        <quotient_manifolds.core.metrics.GLMetric.christoffel_coefficients>`). When u requires a
        gradient and the point does not (the sharpness engine's case), its backward is the
        closed-form vector–Jacobian product :func:`second_order_retraction_vjp` (exact, and
        differentiable again when a double backward asks for it); otherwise autograd records the
        forward.
        """
        method = choice("retraction", method or self.geometry.retraction, RETRACTIONS)
        out_dtype = u.dtype if u.dtype == self.dtype else torch.promote_types(self.dtype, u.dtype)
        if method == "second_order":
            if torch.is_grad_enabled() and u.requires_grad and not self._x.requires_grad:
                self._in(u)  # shape check
                return _SecondOrderRetraction.apply(u, self, out_dtype)
            y = self._second_order(self._in(u))
        elif method == "first_order":
            y = self.x + self._in(u)
        else:
            y, _ = self.geometry.integrate_geodesic(self.x, self._in(u), steps=exact_steps)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def retraction_differential(self, u: Tensor, v: Tensor, method: Optional[str] = None) -> Tensor:
        r"""DR_x(u)[v], the derivative of the retraction at u along v, projected onto the horizontal
        space at y = R_x(u): the vector transport along the retraction whose inner product with
        grad f(y) is d/dt f(R_x(u + tv)) (a line search's φ'(α) for u = αη, v = η).

        ``first_order``: v; ``second_order``: v − Γ_x(u, v) (Γ symmetric); ``exact``: the
        differential of the exponential is a Jacobi field, not computed: the projection of v
        (exact only to first order in u).
        """
        method = choice("retraction", method or self.geometry.retraction, RETRACTIONS)
        if method == "second_order":
            v = v - self.christoffel(u, v)
        return self.geometry.frame(self.retract(u, method)).project(v)

    def _second_order(self, uc: Tensor, grams: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        """x + u − ½Γ(u, u) for u in the compute dtype (``grams``: (S, W) if already computed)."""
        if not self._paired(uc):
            uc = self._split(uc)   # the blocks once, for the Gram products and the combination
        K_x, K_u = self.gl_metric.christoffel_coefficients(
            self, *(grams or self._retraction_grams(uc)), shift=self.eye, scale=-0.5)
        return self.block_combination((self.x, K_x), (uc, K_u))


def second_order_retraction_vjp(frame: GLFrame, u: Tensor, y_bar: Tensor,
                                D: Optional[Tensor] = None) -> Tensor:
    r"""The vector–Jacobian product ū = (∂y/∂u)ᵀ ȳ of the second-order retraction
    y = x + u − ½Γ_x(u, u) at a fixed point x, in the compute dtype of ``frame``.

    With Γ_A(u, u) = A C_A + u_A D_A per block A ∈ {G, H} (C, D linear in S_A = sym(Aᵀu_A) and
    W_A = u_Aᵀu_A, :meth:`~quotient_manifolds.core.metrics.GLMetric.christoffel_coefficients`),
    y_A = A(I − ½C_A) + u_A(I − ½D_A), and for R_A = Aᵀȳ_A, T_A = u_Aᵀȳ_A

    .. math::

        \langle \bar y, \delta y\rangle = \langle \bar y_A (I - \tfrac12 D_A)^\top, \delta u_A\rangle
            - \tfrac12\langle R, \delta C\rangle - \tfrac12\langle T, \delta D\rangle ,

    so with (Z_S, Z_W) the adjoint of (S, W) ↦ (C, D) applied to (−½R, −½T)
    (:meth:`~quotient_manifolds.core.metrics.GLMetric.christoffel_coefficients_adjoint`),
    δS_A = sym(Aᵀδu_A) and δW_A = δu_Aᵀu_A + u_Aᵀδu_A:

    .. math::

        \bar u_A = \bar y_A (I - \tfrac12 D_A)^\top + A\,\operatorname{sym}(Z_{S,A})
                   + 2 u_A \operatorname{sym}(Z_{W,A}).

    Five batched products (two Gram reductions, three updates) per pair of blocks, against the
    four of the forward. ``D``: the coefficient D of the forward, if kept.
    """
    uc, yc = u.to(frame.cdtype), y_bar.to(frame.cdtype)
    if D is None:
        _, D = frame.gl_metric.christoffel_coefficients(frame, *frame._retraction_grams(uc))
    x = frame.x   # (once: a frame that keeps the weights' dtype converts it at each use)
    K_y, K_x, K_u, _, _ = _vjp_coefficients(frame, x, uc, yc, D)
    return frame.block_combination((yc, K_y), (x, K_x), (uc, K_u))


def _vjp_coefficients(frame: GLFrame, x: Tensor, uc: Tensor, yc: Tensor, D: Tensor
                      ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(K_y, K_x, K_u, R, T) with ū_A = ȳ_A K_y + A K_x + u_A K_u per block (the VJP of
    :func:`second_order_retraction_vjp`), R = Aᵀȳ_A and T = u_Aᵀȳ_A, all stacked
    ``(..., 2, h, h)``; x is the frame's point in the compute dtype."""
    R, T = frame.block_grams(x, yc), frame.block_grams(uc, yc)
    ZS, ZW = frame.gl_metric.christoffel_coefficients_adjoint(frame, -0.5 * R, -0.5 * T)
    return (frame.eye - 0.5 * D).mT, sym(ZS), 2 * sym(ZW), R, T


def second_order_step(frame: GLFrame, u: Tensor, grams: Optional[Tuple[Tensor, Tensor]] = None
                      ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """The second-order retraction y = x + u − ½Γ_x(u, u) (in the compute dtype, not
    differentiated) and the Gram products (Aᵀu_A, u_Aᵀu_A) of each block A that
    :func:`second_order_riemannian_gradient` at the same u reuses (``grams``: those products if
    the caller has them, e.g. from :meth:`GLFrame.norm_sq_and_grams` of the vector u is a multiple
    of)."""
    uc = frame._in(u)
    if grams is None:
        grams = frame._forward_grams(uc)
    return frame._second_order(uc, (sym(grams[0]), grams[1])), grams


def second_order_riemannian_gradient(frame: GLFrame, u: Tensor, y_bar: Tensor,
                                     grams: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    r"""The Riemannian gradient P_h(ū N) of ξ ↦ ℓ(x + ξ − ½Γ_x(ξ, ξ)) at ξ = u, from
    ȳ = ∂ℓ/∂y at the retracted point, without forming the vector–Jacobian product ū.

    With ū_A = ȳ_A K_y + A K_x + u_A K_u (:func:`second_order_retraction_vjp`) and N the inverse
    metric weights (:meth:`GLFrame.egrad2rgrad`), ū_A N_A = ȳ_A K_y N_A + A K_x N_A + u_A K_u N_A,
    and the horizontal projection needs only the Gram products

    .. math::

        A^\top(\bar u_A N_A) = (R_A K_y + A^\top A\, K_x + A^\top u_A\, K_u) N_A,
        \qquad R_A = A^\top \bar y_A,

    which are h×h products of matrices at hand (AᵀA is the frame's, Aᵀu_A the forward's:
    ``grams`` from :func:`second_order_step`, recomputed when not given). With Λ the vertical
    generator of that pairing, the gradient is

    .. math::

        g_G = \bar y_G K_y N_G + G (K_x N_G - \Lambda) + u_G K_u N_G, \qquad
        g_H = \bar y_H K_y N_H + H (K_x N_H + \Lambda^\top) + u_H K_u N_H:

    two Gram reductions and three n×h products, against eight for the VJP, then
    :meth:`GLFrame.egrad2rgrad`. The same numbers up to rounding (tested). Returned in the
    compute dtype.
    """
    return _second_order_gradient(frame, u, y_bar, grams)[0]


def second_order_gradient_and_inners(frame: GLFrame, u: Tensor, y_bar: Tensor,
                                     grams: Optional[Tuple[Tensor, Tensor]] = None
                                     ) -> Tuple[Tensor, Tensor, Tensor]:
    r"""The gradient g of :func:`second_order_riemannian_gradient` and, per batch element, the
    inner products ‖g‖²_x and g_x(g, u) the sharpness solver takes, for a horizontal u, without
    an n×h product or pass beyond one Gram reduction:

    .. math::

        \|g\|_x^2 = \sum_A \operatorname{tr}(M_A\, g_A^\top g_A), \qquad
        g_x(g, u) = \langle \bar u, u\rangle
          = \sum_A \langle I - \tfrac12 D_A, u_A^\top \bar y_A\rangle
                 + \langle K_{x,A}, A^\top u_A\rangle + \langle K_{u,A}, u_A^\top u_A\rangle,

    the second because g is the metric-orthogonal projection of ū N onto the horizontal space, so
    g_x(g, v) = g_x(ū N, v) = ⟨ū, v⟩ for horizontal v, and ū = ȳ(I − ½D)ᵀ + A K_x + u K_u
    (:func:`second_order_retraction_vjp`) pairs with u through h×h matrices at hand. All three
    in the compute dtype.
    """
    g, K_y, K_x, K_u, T, (x_u, u_u) = _second_order_gradient(frame, u, y_bar, grams)
    dims = (-1, -2, -3)
    sq = frame.norm_sq_of_gram(frame.block_grams(g, g))
    # ⟨ȳK_y, u⟩ = ⟨K_y, ȳᵀu⟩ = ⟨K_yᵀ, uᵀȳ⟩ = ⟨K_yᵀ, T⟩
    dot = (K_y.mT * T).sum(dims) + (K_x * x_u).sum(dims) + (K_u * u_u).sum(dims)
    return g, sq, dot


def _second_order_gradient(frame: GLFrame, u: Tensor, y_bar: Tensor,
                           grams: Optional[Tuple[Tensor, Tensor]]) -> Tuple:
    """(g, K_y, K_x, K_u, T, (x_u, u_u)) of :func:`second_order_riemannian_gradient`: the
    gradient, the VJP's coefficients (before N), T = u_Aᵀȳ_A and the forward's Gram products."""
    uc, yc = frame._in(u), frame._in(y_bar)
    x = frame.x   # (once: a frame that keeps the weights' dtype converts it at each use)
    x_u, u_u = frame._forward_grams(uc) if grams is None else grams
    _, D = frame.gl_metric.christoffel_coefficients(frame, sym(x_u), u_u)
    K_y, K_x, K_u, R, T = _vjp_coefficients(frame, x, uc, yc, D)
    N = frame._stacked_inverse_weights
    L_y, L_x, L_u = matmul(K_y, N), matmul(K_x, N), matmul(K_u, N)
    pairing = add_product(add_product(matmul(R, L_y), frame._stacked_grams, L_x), x_u, L_u)
    lam = frame._generator_of_grams(*pairing.unbind(-3))
    L_x = L_x + torch.stack((-lam, lam.mT), dim=-3)
    g = frame.block_combination((yc, L_y), (x, L_x), (uc, L_u))
    return g, K_y, K_x, K_u, T, (x_u, u_u)


class _SecondOrderRetraction(torch.autograd.Function):
    """y = x + u − ½Γ_x(u, u) with x fixed, differentiable in u by the closed form of
    :func:`second_order_retraction_vjp` (autograd through the forward holds its float64
    intermediates of size n×h until the backward and costs about 1.7× the forward)."""

    @staticmethod
    def forward(ctx, u: Tensor, frame: GLFrame, out_dtype: torch.dtype) -> Tensor:
        uc = u.to(frame.cdtype)
        grams = frame._retraction_grams(uc)
        ctx.frame = frame
        ctx.coefficient_D = frame.gl_metric.christoffel_coefficients(frame, *grams)[1]
        ctx.save_for_backward(u)
        return frame._second_order(uc, grams).to(out_dtype)

    @staticmethod
    def backward(ctx, y_bar: Tensor):
        (u,) = ctx.saved_tensors
        # under create_graph the coefficients are recomputed from u, so that the double backward
        # sees their dependence on u
        D = None if torch.is_grad_enabled() else ctx.coefficient_D
        u_bar = second_order_retraction_vjp(ctx.frame, u, y_bar, D)
        if u_bar.shape != u.shape:  # u was broadcast against the point's batch dimensions
            u_bar = u_bar.sum_to_size(u.shape)
        return u_bar.to(u.dtype), None, None


class GLQuotientGeometry:
    r"""The GL(h) two-factor quotient
    :math:`\mathbb{R}_*^{n\times h}\times\mathbb{R}_*^{m\times h}\,/\,\mathrm{GL}(h)`
    (docs/maths.md §1–§6).

    Parameters
    ----------
    n, m, h:
        Shapes of G (n×h) and H (m×h); h ≤ min(n, m).
    metric:
        ``"inv"`` or ``"mix"`` (docs/maths.md §2), or a
        :class:`~quotient_manifolds.core.metrics.GLMetric`. ``metric`` is its name and
        ``gl_metric`` the object.
    retraction:
        ``"first_order"``, ``"second_order"`` (default) or ``"exact"`` (docs/maths.md §5).
    eps:
        Relaxation ε ≥ 0: Gram matrices become GᵀG + εI everywhere (metric, projection, gradient,
        Christoffel term; docs/maths.md §6.4). The relaxed metric is only approximately
        GL-invariant.
    exact_steps, exact_method:
        Fixed-step integrator used by the ``exact`` retraction (torchdiffeq method name).
    group:
        The symmetry group quotiented out: ``"gl"`` (default, all of GL(h)), ``"rope"`` (the
        commutant of rotary position encodings, :class:`~quotient_manifolds.core.groups.RotaryGroup`)
        or a group object. The metric, Γ, retractions, gradient and Hessian do not depend on it
        (the metric is GL(h)-invariant); the vertical space, the projection and ``dim`` do.

    Raises
    ------
    ValueError
        A size is not a positive integer, h > min(n, m), ``eps`` < 0, or ``metric``,
        ``retraction`` or ``group`` is not one of the choices (the message lists them).

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import GLQuotientGeometry
    >>> geometry = GLQuotientGeometry(4, 3, 2, "mix")
    >>> geometry.dim                                    # (n + m) h - h²
    10
    >>> x = geometry.random_point(dtype=torch.float64)
    >>> u = geometry.random_horizontal(x)
    >>> round(float(geometry.norm(x, u)), 6)
    1.0
    >>> A = torch.tensor([[2.0, 1.0], [0.0, 0.5]], dtype=torch.float64)
    >>> y = geometry.act(x, A)                          # same point of the quotient
    >>> G, H = geometry.split(x); Gy, Hy = geometry.split(y)
    >>> torch.allclose(Gy @ Hy.mT, G @ H.mT)
    True
    """

    def __init__(self, n: int, m: int, h: int, metric: "str | GLMetric" = "mix", *,
                 retraction: str = "second_order", eps: float = 0.0,
                 exact_steps: int = 32, exact_method: str = "rk4",
                 group: "str | Group | None" = None):
        n, m, h = size("n", n), size("m", m), size("h", h)
        if h > n or h > m:
            raise InvalidArgument(
                f"h = {h} exceeds n = {n} or m = {m}: G (n×h) and H (m×h) cannot have full column "
                f"rank h unless h ≤ min(n, m)")
        self.n, self.m, self.h = n, m, h
        self.gl_metric = as_metric(metric)
        self.metric = self.gl_metric.name
        self.retraction = choice("retraction", retraction, RETRACTIONS)
        self.eps = relaxation("eps", eps)
        self.exact_steps = size("exact_steps", exact_steps)
        self.exact_method = exact_method
        self.group = as_group(group)
        self.group.check(h)
        self._identities = {}

    def __repr__(self) -> str:
        group = "" if self.group == FULL_GL else f", group={self.group!r}"
        return (f"GLQuotientGeometry(n={self.n}, m={self.m}, h={self.h}, metric={self.metric!r}, "
                f"retraction={self.retraction!r}, eps={self.eps}{group})")

    @property
    def dim(self) -> int:
        """Dimension of the quotient, (n+m)h − dim 𝔤 ((n+m)h − h² for the full GL(h))."""
        return (self.n + self.m) * self.h - self.group.dim(self.h)

    # ------------------------------------------------------------------ layout
    def check_shape(self, shape, name: str = "x") -> None:
        expected = f"(..., n+m, h) = (..., {self.n + self.m}, {self.h})"
        if len(shape) < 2 or shape[-2] != self.n + self.m or shape[-1] != self.h:
            raise InvalidArgument(f"`{name}` has shape {tuple(shape)}; expected {expected} "
                                  f"(G stacked over H, leading dimensions are batch dimensions)")

    def split(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Views (G, H) of x = [G; H]."""
        return x[..., :self.n, :], x[..., self.n:, :]

    def pack(self, G: Tensor, H: Tensor) -> Tensor:
        """x = [G; H]."""
        return torch.cat((G, H), dim=-2)

    def identity(self, dtype: torch.dtype, device) -> Tensor:
        """The h×h identity in ``dtype`` on ``device``, made once per pair (frames share it; it
        is never written to)."""
        key = (dtype, torch.device(device))
        eye = self._identities.get(key)
        if eye is None:
            eye = self._identities[key] = torch.eye(self.h, dtype=dtype, device=device)
        return eye

    def frame(self, x: Tensor, *, check: bool = True, keep_dtype: bool = False) -> GLFrame:
        """Precompute the geometry at x (validated unless ``check=False``; ``keep_dtype``: x is
        stored in its own dtype, see :class:`GLFrame`)."""
        return GLFrame(self, x, check=check, keep_dtype=keep_dtype)

    # ------------------------------------------------------------------ group action
    def act(self, x: Tensor, A: Tensor) -> Tensor:
        """(G, H) ↦ (G A, H A⁻ᵀ); also maps tangent vectors (the action is linear).

        Parameters
        ----------
        x:
            A point or tangent vector (..., n+m, h).
        A:
            An invertible (..., h, h) matrix (any element of GL(h), also for a smaller group).

        Returns
        -------
        Tensor
            [G A; H A⁻ᵀ].

        Raises
        ------
        ValueError
            ``A`` is not an (h, h) floating matrix or is singular.

        Examples
        --------
        See the class's example (``geometry.act(x, A)``).
        """
        group_element("A", A, self.h)
        try:
            return self.pack(*group_action(*self.split(x), A))
        except torch.linalg.LinAlgError as err:
            raise InvalidArgument(f"A is singular: not an element of GL({self.h}) ({err})") from None

    def balance(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        r"""Balanced representative x·A with GᵀG = HᵀH (docs/maths.md §A.4), and A itself.

        With the QR factors :math:`G = Q_G R_G`, :math:`H = Q_H R_H` and the SVD
        :math:`R_G R_H^\top = U S V^\top`, take :math:`A = R_G^{-1} U S^{1/2}`: then
        :math:`G A = Q_G U S^{1/2}` and :math:`H A^{-\top} = Q_H V S^{1/2}`, so G Hᵀ is unchanged and
        both Gram matrices equal S. Map optimizer buffers with :meth:`act` (same A); never call this
        inside ``projx``.

        Parameters
        ----------
        x:
            A point (..., n+m, h).

        Returns
        -------
        tuple of Tensor
            (x·A, A).

        Raises
        ------
        ValueError
            A group other than GL(h), or ``x`` not a floating tensor.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds.core import GLQuotientGeometry
        >>> geometry = GLQuotientGeometry(3, 3, 2, "mix")
        >>> x = geometry.random_point(dtype=torch.float64)
        >>> balanced, A = geometry.balance(x)
        >>> G, H = geometry.split(balanced)
        >>> torch.allclose(G.T @ G, H.T @ H)
        True
        """
        floating_tensor("x", x)
        if not self.group.is_full:
            raise InvalidArgument(f"balance() moves x along its full GL({self.h}) orbit, which leaves the "
                                  f"{self.group.describe(self.h)} quotient; it is defined for group='gl' only")
        G, H = self.split(x)
        _, R_G = torch.linalg.qr(G)
        _, R_H = torch.linalg.qr(H)
        U, S, _ = torch.linalg.svd(R_G @ R_H.mT)
        A = torch.linalg.solve_triangular(R_G, U * S.sqrt()[..., None, :], upper=True)
        return self.act(x, A), A

    # ------------------------------------------------------------------ sampling
    def random_point(self, *batch: int, dtype=None, device=None, generator=None) -> Tensor:
        """Gaussian G and H (full rank with probability one), entries of variance 1/h."""
        shape = batch_shape("batch", batch) + (self.n + self.m, self.h)
        floating_dtype("dtype", dtype)
        optional_generator("generator", generator)
        return torch.randn(shape, dtype=dtype, device=device, generator=generator) / math.sqrt(self.h)

    def random_horizontal(self, x: Tensor, *, unit: bool = True, generator=None) -> Tensor:
        """Projected Gaussian vector at x, normalised to unit metric norm per batch element."""
        floating_tensor("x", x)
        optional_generator("generator", generator)
        u = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=generator)
        frame = self.frame(x)
        u = frame.project(u)
        return u / frame.norm(u, keepdim=True) if unit else u

    def zero_vector(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)

    # ------------------------------------------------------------------ geodesics
    def integrate_geodesic(self, x: Tensor, u: Tensor, t: float = 1.0, *,
                           steps: Optional[int] = None, method: Optional[str] = None
                           ) -> Tuple[Tensor, Tensor]:
        """Solve γ̈ = −Γ_γ(γ̇, γ̇), γ(0) = x, γ̇(0) = u up to time t; returns (γ(t), γ̇(t)).

        Uses torchdiffeq's fixed-grid solvers (default RK4 with ``exact_steps`` steps), so it is
        batched, device-agnostic and differentiable. Computation is in float64.

        Parameters
        ----------
        x, u:
            The start point and a (horizontal) velocity, shape (..., n+m, h).
        t:
            The end time.
        steps, method:
            Override the geometry's ``exact_steps`` and torchdiffeq method.

        Returns
        -------
        tuple of Tensor
            (γ(t), γ̇(t)) in the dtype of ``x``.

        Raises
        ------
        ValueError
            ``x`` of the wrong shape or rank deficient;
            :class:`~quotient_manifolds.core.errors.GeodesicLeftManifold` (a ValueError) when the
            geodesic leaves the manifold before t.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds.core import GLQuotientGeometry
        >>> geometry = GLQuotientGeometry(3, 3, 2, "mix")
        >>> x = geometry.random_point(dtype=torch.float64)
        >>> u = 0.1 * geometry.random_horizontal(x)
        >>> y, v = geometry.integrate_geodesic(x, u)
        >>> torch.allclose(geometry.norm(y, v), geometry.norm(x, u))   # constant speed
        True
        """
        from torchdiffeq import odeint

        finite_real("t", t)
        steps = self.exact_steps if steps is None else size("steps", steps)
        x0, u0 = x.to(compute_dtype(x.dtype)), u.to(compute_dtype(u.dtype))
        x0, u0 = torch.broadcast_tensors(x0, u0)

        def field(_t, state):
            pos, vel = state
            return vel, -self.frame(pos, check=False).christoffel(vel)

        ts = torch.tensor([0.0, float(t)], dtype=x0.dtype, device=x0.device)
        try:
            pos, vel = odeint(field, (x0, u0), ts, method=method or self.exact_method,
                              options={"step_size": float(t) / steps})
        except torch.linalg.LinAlgError as err:
            raise GeodesicLeftManifold(
                f"the geodesic left the manifold (G or H lost full rank) within t = {t}: the step "
                f"is too long for this point; use a shorter step or more exact_steps "
                f"(now {steps})") from err
        if not bool(torch.isfinite(pos[-1]).all()):
            raise GeodesicLeftManifold(f"the geodesic diverged within t = {t} ({steps} {self.exact_method} "
                             f"steps); use a shorter step or more exact_steps")
        self._check_speed(x0, u0, pos[-1], vel[-1], t, steps)
        return pos[-1], vel[-1]

    #: relative change of the speed ‖γ̇‖_γ along an integrated geodesic that means the integration
    #: failed (a geodesic keeps its speed; RK4 with 32 steps keeps it to 2e-7 for steps of 8 times
    #: the point's scale, with 8 steps to ~2e-3 on long steps, and misses by orders of magnitude
    #: past the end of an incomplete geodesic)
    SPEED_TOLERANCE = 0.1

    def _check_speed(self, x0: Tensor, u0: Tensor, pos: Tensor, vel: Tensor, t: float,
                     steps: int) -> None:
        """Raise :class:`GeodesicLeftManifold` if the integrated geodesic did not keep its speed:
        past the end of the mix geodesic (a factor reaching rank loss between two RK4 nodes) the
        integration returns a finite point that is not on the geodesic."""
        with torch.no_grad():
            try:
                end = self.frame(pos.detach(), check=False).norm(vel.detach())
            except torch.linalg.LinAlgError:
                end = torch.full((), math.inf, dtype=pos.dtype, device=pos.device)
            start = self.frame(x0.detach(), check=False).norm(u0.detach())
            drift = (end - start).abs() > self.SPEED_TOLERANCE * start + torch.finfo(start.dtype).tiny
            if bool(drift.any()):
                raise GeodesicLeftManifold(
                    f"the geodesic left the manifold within t = {t}: its speed ‖γ̇‖ went from "
                    f"{float(start.max()):.3g} to {float(end.max()):.3g} ({steps} {self.exact_method} "
                    f"steps; a geodesic keeps its speed), so the step passes the end of the geodesic "
                    f"or the singular point of a factor; use a shorter step or more exact_steps")

    # ------------------------------------------------------------------ conveniences
    def inner(self, x: Tensor, u: Tensor, v: Optional[Tensor] = None, *, keepdim=False) -> Tensor:
        return self.frame(x).inner(u, v, keepdim=keepdim)

    def norm(self, x: Tensor, u: Tensor, *, keepdim=False) -> Tensor:
        return self.frame(x).norm(u, keepdim=keepdim)

    def project(self, x: Tensor, u: Tensor) -> Tensor:
        return self.frame(x).project(u)

    def egrad2rgrad(self, x: Tensor, egrad: Tensor) -> Tensor:
        return self.frame(x).egrad2rgrad(egrad)

    def christoffel(self, x: Tensor, u: Tensor, v: Optional[Tensor] = None) -> Tensor:
        return self.frame(x).christoffel(u, v)

    def retract(self, x: Tensor, u: Tensor, method: Optional[str] = None) -> Tensor:
        return self.frame(x).retract(u, method)

    def transport(self, y: Tensor, v: Tensor) -> Tensor:
        """Vector transport by projection onto the horizontal space at the new point y (Manopt)."""
        return self.frame(y).project(v)
