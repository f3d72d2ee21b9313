r"""The two GL(h)-invariant metrics of the two-factor quotient, one class each (docs/maths.md §2).

Both are of the form

    g_x(u, v) = tr(M_G u_Gᵀ v_G) + tr(M_H u_Hᵀ v_H),     P = GᵀG + εI,  Q = HᵀH + εI,

    inv:  M_G = P⁻¹, M_H = Q⁻¹      (:class:`InvMetric`, Manopt ``fixedrankfactory_2factors``)
    mix:  M_G = Q,   M_H = P        (:class:`MixMetric`, Mishra–Sepulchre,
                                     ``fixedrankfactory_2factors_preconditioned``)

with N_G = M_G⁻¹, N_H = M_H⁻¹ the inverse weights. A :class:`GLMetric` holds every formula in
which the two differ: the weights, their inverses and derivatives, the Christoffel map, the
factors the horizontal projection is solved with, and the closed-form geodesics of the GL(1)
quotient (the rescaling quotient of diagonal networks, n = m = h = 1). Everything else is written
once, for both, in :class:`~quotient_manifolds.core.gl.GLFrame`, which calls these methods with
itself as ``frame`` (the point's Gram matrices ``P``, ``Q``, their inverses ``P_inv``, ``Q_inv`` and
Cholesky factors ``chol_P``, ``chol_Q``). Every method broadcasts over leading batch dimensions.

Users choose a metric by name (``metric="inv"`` or ``"mix"``); the geometries turn the name into
the object once (:func:`~quotient_manifolds.core.gl.as_metric`) and keep both: ``geometry.metric``
is the name, ``geometry.gl_metric`` the object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch

from ..errors import InvalidArgument
from .errors import GeodesicLeftManifold
from .groups import sym
from .products import matmul

if TYPE_CHECKING:  # pragma: no cover
    from .gl import GLFrame

Tensor = torch.Tensor


def mix_geodesic_scale(b: Tensor, t: float = 1.0) -> Tensor:
    r"""s(t) = 1 + 2bt, the squared scale of the mix geodesic with horizontal coefficient b
    (docs/maths.md §8.3): (u, v)(t) = (u√s, v√s), so β(t) = β₀⊙s.

    The geodesic exists while s > 0; β₀⊙s is a polynomial in t and continues past it.

    Parameters
    ----------
    b:
        The horizontal coefficient(s), any shape.
    t:
        Time along the geodesic.

    Returns
    -------
    Tensor
        1 + 2bt, the shape of ``b``.

    Raises
    ------
    TypeError
        ``b`` is not a tensor or number that can be scaled and shifted.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import mix_geodesic_scale
    >>> mix_geodesic_scale(torch.tensor([0.5, -0.25], dtype=torch.float64), t=1.0)
    tensor([2.0000, 0.5000], dtype=torch.float64)
    """
    return 1 + 2 * t * b


def _affine(shift: Optional[Tensor], product: Tensor, alpha: float) -> Tensor:
    """shift + alpha·product in one pass (``product`` is fresh: scaled in place when there is no
    shift)."""
    if shift is not None:
        return torch.add(shift, product, alpha=alpha)
    return product if alpha == 1 else product.mul_(alpha)


class GLMetric:
    r"""A GL(h)-invariant metric g_x(u, v) = tr(M_G u_Gᵀv_G) + tr(M_H u_Hᵀv_H) of the two-factor
    quotient: the formulas that depend on the choice of (M_G, M_H). Subclasses: :class:`InvMetric`,
    :class:`MixMetric`.

    ``name`` is the string users pass as ``metric=``; ``step_advice`` completes the advice of
    :class:`~quotient_manifolds.StepTooLarge` ("Reduce the optimiser's learning rate…").

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import GLQuotientGeometry, MixMetric
    >>> geometry = GLQuotientGeometry(3, 3, 2, metric=MixMetric())   # same as metric="mix"
    >>> frame = geometry.frame(geometry.random_point(dtype=torch.float64))
    >>> M_G, M_H = geometry.gl_metric.weights(frame)                 # (Q, P) for mix
    >>> torch.allclose(M_G, frame.Q) and torch.allclose(M_H, frame.P)
    True
    """

    name: str = ""
    step_advice: str = ", or the momentum"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def weights(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        """(M_G, M_H), the weights of g_x(u, v) = tr(M_G u_Gᵀv_G) + tr(M_H u_Hᵀv_H)."""
        raise NotImplementedError

    def inverse_weights(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        """(N_G, N_H) = (M_G⁻¹, M_H⁻¹); the Riemannian gradient is (∇_G N_G, ∇_H N_H) (docs/maths.md §4)."""
        raise NotImplementedError

    def inverse_weight_factors(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        """(F_G, F_H) with N_G = F_G F_Gᵀ and N_H = F_H F_Hᵀ: the factors that turn the vertical
        equations into a symmetric eigenproblem (docs/maths.md §3.2)."""
        raise NotImplementedError

    def inverse_weights_derivative(self, frame: "GLFrame", dP: Tensor, dQ: Tensor
                                   ) -> Tuple[Tensor, Tensor]:
        """(DN_G[u], DN_H[u]) from DP[u] = 2 sym(Gᵀu_G) and DQ[u] = 2 sym(Hᵀu_H) (the Hessian's
        D rgrad[u], docs/maths.md §4)."""
        raise NotImplementedError

    def closed_form_projection(self, eps: float) -> bool:
        """Whether the vertical operator L(Λ) = GᵀG Λ M_G + M_H Λ HᵀH is the single pencil 2PΛQ,
        whose inverse is in closed form (docs/maths.md §3.2); ``eps`` is the relaxation ε."""
        return False

    def skew_pencils(self, frame: "GLFrame") -> Tuple[Tuple[Tensor, Tensor], ...]:
        """Pairs (M, N) of SPD matrices such that the mean of the inverses of Λ ↦ Π_so(2MΛN) over
        the pairs approximates Π_so L⁻¹ on so(h): the preconditioner of the orthogonal groups'
        solver (exact when :meth:`closed_form_projection`; docs/maths.md §14.4)."""
        raise NotImplementedError

    def christoffel(self, frame: "GLFrame", uG: Tensor, uH: Tensor, vG: Optional[Tensor] = None,
                    vH: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """(Γ_G, Γ_H) = Γ_x(u, v) of the (ε-relaxed) total-space metric (docs/maths.md §5) on the
        blocks of u and v, in the compute dtype; ``vG = vH = None`` means v = u (the frame computes
        Γ(u, u) from :meth:`christoffel_coefficients` instead, a cheaper form)."""
        raise NotImplementedError

    def christoffel_weights(self, frame: "GLFrame") -> Tensor:
        """The h×h weights K of each block in :meth:`christoffel_coefficients`, stacked as
        ``(..., 2, h, h)`` (index 0: the G block, 1: the H block)."""
        raise NotImplementedError

    def christoffel_coefficients(self, frame: "GLFrame", S: Tensor, W: Tensor, *,
                                 scale: float = 1.0, shift: Optional[Tensor] = None
                                 ) -> Tuple[Tensor, Tensor]:
        r"""Γ_x(u, u) in the form Γ_A = A C_A + u_A D_A for each block A ∈ {G, H} of x (h×h
        coefficients C, D), from the block Gram matrices S_A = sym(Aᵀu_A) and W_A = u_Aᵀu_A.

        All four are stacked over the blocks as ``(..., 2, h, h)``. The second-order retraction is
        then x + u − ½Γ(u, u) = A(I − ½C_A) + u_A(I − ½D_A): two products per block. Given
        ``scale`` and ``shift`` the result is (shift + scale·C, shift + scale·D), each formed in
        one pass (the retraction's I − ½C, I − ½D with ``shift=I, scale=-0.5``)."""
        raise NotImplementedError

    def christoffel_coefficients_adjoint(self, frame: "GLFrame", ZC: Tensor, ZD: Tensor
                                         ) -> Tuple[Tensor, Tensor]:
        r"""The adjoint of the linear map (S, W) ↦ (C, D) of :meth:`christoffel_coefficients`:
        (Z_S, Z_W) with ⟨Z_C, δC⟩ + ⟨Z_D, δD⟩ = ⟨Z_S, δS⟩ + ⟨Z_W, δW⟩ (Frobenius, over both
        blocks). The backward of the second-order retraction uses it (docs/maths.md §5.1)."""
        raise NotImplementedError

    def gl1_geodesic(self, x: Tensor, bu: Tensor, bv: Tensor, t: float) -> Tensor:
        """The closed-form geodesic at time t of the GL(1) quotient, per coordinate of
        x = [u; v] (shape (..., 2, d)), from the tangent vector ξ with ξ_u/u = ``bu``,
        ξ_v/v = ``bv`` (docs/maths.md §8.3, ε = 0)."""
        raise NotImplementedError

    def gl1_beta_scale(self, b: Tensor, t: float) -> Tensor:
        """β(t)/β₀ along the horizontal GL(1) geodesic with coefficient b, β = u⊙v
        (docs/maths.md §8.3)."""
        raise NotImplementedError

    def gl1_log_coefficient(self, ratio: Tensor) -> Tensor:
        """The horizontal coefficient b whose GL(1) geodesic reaches β₁ = ratio·β₀ at t = 1, the
        inverse of :meth:`gl1_beta_scale` at t = 1 (``ratio`` > 0: points of one component)."""
        raise NotImplementedError


class InvMetric(GLMetric):
    r"""The inv metric g_x(u, v) = tr(P⁻¹u_Gᵀv_G) + tr(Q⁻¹u_Hᵀv_H) (paper Eq. 9; Manopt
    ``fixedrankfactory_2factors``): M_G = P⁻¹, M_H = Q⁻¹, N_G = P, N_H = Q, so the Riemannian
    gradient (∇_G P, ∇_H Q) grows with the scale of the factors.

    Christoffel map (paper Eq. 11), and Γ_H the same with H, Q in place of G, P:

    .. math::

        \Gamma_G = -u_G P^{-1}\operatorname{sym}(G^\top v_G) - v_G P^{-1}\operatorname{sym}(G^\top u_G)
                    + G P^{-1}\operatorname{sym}(v_G^\top u_G)

    GL(1) geodesic: (u e^{tξ_u/u}, v e^{tξ_v/v}) for any ξ, so β(t) = β₀ e^{2bt} for horizontal ξ.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import GLQuotientGeometry, InvMetric
    >>> geometry = GLQuotientGeometry(3, 3, 2, metric=InvMetric())
    >>> frame = geometry.frame(geometry.random_point(dtype=torch.float64))
    >>> N_G, N_H = geometry.gl_metric.inverse_weights(frame)        # (P, Q) for inv
    >>> torch.allclose(N_G, frame.P)
    True
    """

    name = "inv"
    step_advice = (": metric='inv' scales the gradient by the Gram matrices of the factors "
                   "(GᵀG, HᵀH), so it needs steps about 1/(‖G‖²‖H‖²) of those metric='mix' "
                   "takes (lr=5e-4 against mix's 0.2 in the README's matrix-completion example); "
                   "or use metric='mix', whose step does not grow with the scale of the factors")

    def weights(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        return frame.P_inv, frame.Q_inv

    def inverse_weights(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        return frame.P, frame.Q

    def inverse_weight_factors(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        return frame.chol_P, frame.chol_Q  # N_G = P = L_P L_Pᵀ, N_H = Q

    def inverse_weights_derivative(self, frame: "GLFrame", dP: Tensor, dQ: Tensor
                                   ) -> Tuple[Tensor, Tensor]:
        return dP, dQ

    def skew_pencils(self, frame: "GLFrame") -> Tuple[Tuple[Tensor, Tensor], ...]:
        r"""Π_so L(Λ) = T_P(Λ) + T_Q(Λ) with T_P(Λ) = ½(PΛP⁻¹ + P⁻¹ΛP), T_Q(Λ) = ½(QΛQ⁻¹ + Q⁻¹ΛQ)
        (ε = 0), each exactly invertible as the pencils (P, P⁻¹), (Q, Q⁻¹); the mean of their
        inverses ¼(T_P⁻¹ + T_Q⁻¹) ⪰ (T_P + T_Q)⁻¹ (operator convexity of the inverse)."""
        return (frame.P, frame.P_inv), (frame.Q, frame.Q_inv)

    def christoffel(self, frame: "GLFrame", uG: Tensor, uH: Tensor, vG: Optional[Tensor] = None,
                    vH: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        vG, vH = (uG, uH) if vG is None else (vG, vH)

        def block(A, uA, vA, inv):
            return (-matmul(uA, matmul(inv, sym(matmul(A.mT, vA))))
                    - matmul(vA, matmul(inv, sym(matmul(A.mT, uA))))
                    + matmul(A, matmul(inv, sym(matmul(vA.mT, uA)))))

        return block(frame.G, uG, vG, frame.P_inv), block(frame.H, uH, vH, frame.Q_inv)

    def christoffel_weights(self, frame: "GLFrame") -> Tensor:
        return torch.stack((frame.P_inv, frame.Q_inv), dim=-3)

    def christoffel_coefficients(self, frame: "GLFrame", S: Tensor, W: Tensor, *,
                                 scale: float = 1.0, shift: Optional[Tensor] = None
                                 ) -> Tuple[Tensor, Tensor]:
        """Γ_G(u, u) = G P⁻¹W_G − 2u_G P⁻¹S_G (Eq. 11 with v = u), Γ_H the same with H, Q: C = KW,
        D = −2KS with K = (P⁻¹, Q⁻¹)."""
        K = frame.christoffel_weights
        return _affine(shift, matmul(K, W), scale), _affine(shift, matmul(K, S), -2 * scale)

    def christoffel_coefficients_adjoint(self, frame: "GLFrame", ZC: Tensor, ZD: Tensor
                                         ) -> Tuple[Tensor, Tensor]:
        """C = KW and D = −2KS with K symmetric: Z_S = −2KZ_D, Z_W = KZ_C."""
        K = frame.christoffel_weights
        return -2 * matmul(K, ZD), matmul(K, ZC)

    def gl1_geodesic(self, x: Tensor, bu: Tensor, bv: Tensor, t: float) -> Tensor:
        return x * torch.exp(t * torch.stack((bu, bv), dim=-2))

    def gl1_beta_scale(self, b: Tensor, t: float) -> Tensor:
        return torch.exp(2 * t * b)

    def gl1_log_coefficient(self, ratio: Tensor) -> Tensor:
        """b = ½ log(β₁/β₀)."""
        return 0.5 * torch.log(ratio)


class MixMetric(GLMetric):
    r"""The mix metric g_x(u, v) = tr(Q u_Gᵀv_G) + tr(P u_Hᵀv_H) (paper Eq. 10; Mishra–Sepulchre,
    Manopt ``fixedrankfactory_2factors_preconditioned``): M_G = Q, M_H = P, N_G = Q⁻¹, N_H = P⁻¹, so
    the Riemannian gradient (∇_G Q⁻¹, ∇_H P⁻¹) does not grow with the scale of the factors.

    Christoffel map (paper Eq. 12):

    .. math::

        \Gamma_G &= \bigl[u_G \operatorname{sym}(v_H^\top H) + v_G \operatorname{sym}(u_H^\top H)
                    - G \operatorname{sym}(v_H^\top u_H)\bigr] Q^{-1},\\
        \Gamma_H &= \bigl[u_H \operatorname{sym}(v_G^\top G) + v_H \operatorname{sym}(u_G^\top G)
                    - H \operatorname{sym}(v_G^\top u_G)\bigr] P^{-1}.

    GL(1) geodesic: (u √s, v √s), s = 1 + 2bt (:func:`mix_geodesic_scale`), for horizontal
    ξ = (b⊙u, b⊙v); it ends where s reaches 0 (the mix metric is incomplete).

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import MixMetric
    >>> beta = MixMetric().gl1_beta_scale(torch.tensor([0.5], dtype=torch.float64), 1.0)
    >>> beta                                            # s(1) = 1 + 2b
    tensor([2.], dtype=torch.float64)
    """

    name = "mix"

    def weights(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        return frame.Q, frame.P

    def inverse_weights(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        return frame.Q_inv, frame.P_inv

    def inverse_weight_factors(self, frame: "GLFrame") -> Tuple[Tensor, Tensor]:
        # N_G = Q⁻¹ = L_Q⁻ᵀ L_Q⁻¹, so F_G = L_Q⁻ᵀ (any factor with N = F Fᵀ works).
        F_G = torch.linalg.solve_triangular(frame.chol_Q, frame.eye, upper=False).mT
        F_H = torch.linalg.solve_triangular(frame.chol_P, frame.eye, upper=False).mT
        return F_G, F_H

    def inverse_weights_derivative(self, frame: "GLFrame", dP: Tensor, dQ: Tensor
                                   ) -> Tuple[Tensor, Tensor]:
        """D(Q⁻¹)[u] = −Q⁻¹ DQ[u] Q⁻¹ and D(P⁻¹)[u] = −P⁻¹ DP[u] P⁻¹."""
        return (-matmul(matmul(frame.Q_inv, dQ), frame.Q_inv),
                -matmul(matmul(frame.P_inv, dP), frame.P_inv))

    def closed_form_projection(self, eps: float) -> bool:
        """For ε = 0, M_H = P and M_G = Q make L(Λ) = 2PΛQ."""
        return not eps

    def skew_pencils(self, frame: "GLFrame") -> Tuple[Tuple[Tensor, Tensor], ...]:
        """L(Λ) = (GᵀG)ΛQ + PΛ(HᵀH) ≈ 2PΛQ with the relaxed P, Q (equal for ε = 0): the pencil (P, Q)."""
        return ((frame.P, frame.Q),)

    def christoffel(self, frame: "GLFrame", uG: Tensor, uH: Tensor, vG: Optional[Tensor] = None,
                    vH: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        vG, vH = (uG, uH) if vG is None else (vG, vH)

        # the h×h factor Q⁻¹ (P⁻¹) is folded into the small matrices: one n×h×h product less
        def block(A, uA, vA, uB, vB, B, inv):
            return (matmul(uA, matmul(sym(matmul(vB.mT, B)), inv))
                    + matmul(vA, matmul(sym(matmul(uB.mT, B)), inv))
                    - matmul(A, matmul(sym(matmul(vB.mT, uB)), inv)))

        return (block(frame.G, uG, vG, uH, vH, frame.H, frame.Q_inv),
                block(frame.H, uH, vH, uG, vG, frame.G, frame.P_inv))

    def christoffel_weights(self, frame: "GLFrame") -> Tensor:
        return torch.stack((frame.Q_inv, frame.P_inv), dim=-3)

    @staticmethod
    def _other_block(T: Tensor) -> Tensor:
        """The stacked (..., 2, h, h) blocks in the order (H, G): Γ_G uses the H block's Grams."""
        return T.flip(-3)

    def christoffel_coefficients(self, frame: "GLFrame", S: Tensor, W: Tensor, *,
                                 scale: float = 1.0, shift: Optional[Tensor] = None
                                 ) -> Tuple[Tensor, Tensor]:
        """Γ_G(u, u) = −G W_H Q⁻¹ + 2u_G S_H Q⁻¹ (Eq. 12 with v = u), Γ_H the same with G and H
        (and P, Q) exchanged: C_A = −W_B K_A, D_A = 2S_B K_A, B the other block, K = (Q⁻¹, P⁻¹)."""
        K = frame.christoffel_weights
        return (_affine(shift, matmul(self._other_block(W), K), -scale),
                _affine(shift, matmul(self._other_block(S), K), 2 * scale))

    def christoffel_coefficients_adjoint(self, frame: "GLFrame", ZC: Tensor, ZD: Tensor
                                         ) -> Tuple[Tensor, Tensor]:
        """C_A = −W_B K_A and D_A = 2S_B K_A: Z_{W,B} = −Z_{C,A}K_A, Z_{S,B} = 2Z_{D,A}K_A."""
        K = frame.christoffel_weights
        return 2 * self._other_block(matmul(ZD, K)), -self._other_block(matmul(ZC, K))

    def gl1_geodesic(self, x: Tensor, bu: Tensor, bv: Tensor, t: float) -> Tensor:
        """A non-horizontal ξ (bu ≠ bv) or s = 1 + 2bt ≤ 0 (past the end of the geodesic) raise a
        ValueError."""
        scale = (bu.abs() + bv.abs()).clamp_min(torch.finfo(x.dtype).tiny)
        if bool(((bu - bv).abs() > 1e-6 * scale + 1e-12).any()):
            raise InvalidArgument("the closed-form mix geodesic needs a horizontal tangent vector "
                                  "(ξ_u/u = ξ_v/v per coordinate); project it first with `project`")
        s = self.gl1_beta_scale(bu, t)
        if bool((s <= 0).any()):
            raise GeodesicLeftManifold("the mix geodesic leaves the manifold (1 + 2b ≤ 0 for some coordinate, "
                             "docs/maths.md §8.3); use a shorter step")
        return x * s.sqrt()[..., None, :]

    def gl1_beta_scale(self, b: Tensor, t: float) -> Tensor:
        return mix_geodesic_scale(b, t)

    def gl1_log_coefficient(self, ratio: Tensor) -> Tensor:
        """b = (β₁/β₀ − 1)/2: β is linear along the mix geodesic."""
        return 0.5 * (ratio - 1)
