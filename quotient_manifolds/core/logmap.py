r"""The logarithm log_x(y) and the distance dist(x, y) of the quotients (docs/maths.md §5, §8.3).

log_x(y) is the horizontal vector ξ at x whose geodesic reaches the orbit of y at t = 1; then
dist(x, y) = ‖ξ‖_x, the length of that geodesic.

* **Rescaling quotient, ε = 0: closed form.** Per coordinate the horizontal geodesic with
  coefficient b (ξ = (b u, b v)) moves β = u v to β₀·s(b), s = e^{2b} (inv) or 1 + 2b (mix)
  (:meth:`~quotient_manifolds.core.metrics.GLMetric.gl1_beta_scale`), so
  b = ½ log(β₁/β₀) (inv) or (β₁/β₀ − 1)/2 (mix)
  (:meth:`~quotient_manifolds.core.metrics.GLMetric.gl1_log_coefficient`), and
  dist = (1/√2)‖log|β₁/β₀|‖ (inv), (1/√2)‖β₁ − β₀‖ (mix). Each coordinate's quotient is a
  half-line, so this geodesic is the only one and it is minimising. Points whose β differ in sign
  somewhere lie in different components: no geodesic joins them (dist = ∞).
* **GL(h) quotient (and the rescaling quotient with ε > 0): shooting.** No closed form is known
  (Manopt's two-factor factories leave ``dist`` and ``log`` unimplemented). The boundary-value
  problem Exp_x(ξ) ∈ orbit(y) is solved for horizontal ξ by Gauss–Newton on the invariant:
  r(ξ) = G(1)H(1)ᵀ − G_y H_yᵀ, where (G(1), H(1)) = Exp_x(ξ) is the exact geodesic the library
  integrates (:meth:`~quotient_manifolds.core.gl.GLQuotientGeometry.integrate_geodesic`). The
  Jacobian of r is taken by finite differences along a basis of the horizontal space, all
  integrated in one batched call; each step is the minimum-norm least-squares solution, projected
  onto the horizontal space, halved until the residual falls (a trial that leaves the manifold is
  halved too). It stops when ‖r‖_F ≤ ``tol``·‖G_y H_yᵀ‖_F, or at rounding level. The geodesic
  found is the one Gauss–Newton reaches from ξ = 0 (the first step is the first-order solution
  ξ_G Hᵀ + G ξ_Hᵀ = Y − G Hᵀ): for nearby points the minimising one, for far points perhaps a
  longer one, and beyond where the geodesics from x stay on the manifold (the mix metric is
  incomplete) none is found: :class:`~quotient_manifolds.core.LogNotFound`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import torch

from ..errors import InvalidArgument, InvalidArgumentType, NotSupported
from .._validation import finite_real, floating_tensor, size
from .errors import LogNotFound, StepTooLarge
from .gl import GLQuotientGeometry
from .rescaling import RescalingGeometry

Tensor = torch.Tensor

__all__ = ["LogResult", "log_map", "distance"]


@dataclass(frozen=True)
class LogResult:
    """The convergence report of :func:`log_map`.

    Attributes
    ----------
    vector : log_x(y), horizontal at x (the dtype of x).
    residual : ‖inv(Exp_x(vector)) − inv(y)‖_F / ‖inv(y)‖_F, inv the quotient's invariant
        (G Hᵀ, or β = u⊙v); 0 for a closed form.
    iterations : Gauss–Newton steps taken (0 for a closed form).
    converged : whether ``residual`` ≤ the tolerance.
    method : ``"closed form"`` or ``"shooting"``.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import RescalingGeometry, log_map
    >>> g = RescalingGeometry(2, "inv")
    >>> x = torch.tensor([[1.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    >>> result = log_map(g, x, 2 * x)                   # β scaled by 4 > 0: a closed form
    >>> result.method, result.iterations, result.converged
    ('closed form', 0, True)
    """

    vector: Tensor
    residual: float
    iterations: int
    converged: bool
    method: str


def log_map(geometry: "GLQuotientGeometry | RescalingGeometry", x: Tensor, y: Tensor, *,
            tol: float = 1e-12, max_iter: int = 30, strict: bool = True) -> LogResult:
    r"""log_x(y): the horizontal vector at x whose geodesic reaches the orbit of y at t = 1.

    Closed form on the rescaling quotient with ε = 0, shooting along the integrated geodesic
    otherwise (module docstring). Leading dimensions of x and y are batch dimensions, solved as
    one problem.

    Parameters
    ----------
    geometry : a :class:`~quotient_manifolds.core.gl.GLQuotientGeometry` (group GL(h)) or a
        :class:`~quotient_manifolds.core.rescaling.RescalingGeometry`.
    x, y : points of the same shape.
    tol : relative residual of the invariant at which shooting stops (it also stops, converged,
        when no step lowers a residual below 1e-10, where float64 rounding dominates).
    max_iter : Gauss–Newton steps at most.
    strict : raise :class:`~quotient_manifolds.core.LogNotFound` when no geodesic was found
        (default); with ``False`` return the report with ``converged=False`` instead.

    Returns
    -------
    :class:`LogResult` (``.vector`` is the logarithm).

    Raises
    ------
    LogNotFound
        x and y lie in different components, or shooting did not converge (with ``strict``).
    NotImplementedError
        A GL geometry whose group is not all of GL(h) (its orbits are not the level sets of G Hᵀ).
    ValueError, TypeError
        Invalid points (shape, finiteness, rank) or options.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import GLQuotientGeometry, log_map
    >>> g = GLQuotientGeometry(4, 3, 2, "mix")
    >>> x = g.random_point(dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    >>> v = 0.3 * g.random_horizontal(x, generator=torch.Generator().manual_seed(1))
    >>> result = log_map(g, x, g.retract(x, v, "exact"))
    >>> result.converged, bool(torch.allclose(result.vector, v, atol=1e-7))
    (True, True)
    """
    x, y = floating_tensor("x", x), floating_tensor("y", y)
    if x.shape != y.shape:
        raise InvalidArgument(f"x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    tol, max_iter = finite_real("tol", tol), size("max_iter", max_iter)
    if not tol > 0:
        raise InvalidArgument(f"tol must be a positive finite number, got {tol!r}")
    geometry.frame(x)   # validates both points (shape, finiteness, rank), naming them
    try:
        geometry.frame(y)
    except ValueError as err:
        raise InvalidArgument(f"y: {err}") from None
    if isinstance(geometry, RescalingGeometry):
        if not geometry.eps:
            return _rescaling_closed_form(geometry, x, y)
        gl = geometry.gl
        result = _shoot(gl, geometry.to_gl(x), geometry.to_gl(y), _gl_invariant(gl), tol, max_iter)
        result = LogResult(geometry.from_gl(result.vector), result.residual, result.iterations,
                           result.converged, result.method)
    elif isinstance(geometry, GLQuotientGeometry):
        if not geometry.group.is_full:
            raise NotSupported(
                f"log_map is implemented for the quotient by all of GL({geometry.h}); the "
                f"{geometry.group.describe(geometry.h)} quotient's orbits are not the level sets of "
                f"G Hᵀ that the shooting method matches")
        result = _shoot(geometry, x, y, _gl_invariant(geometry), tol, max_iter)
    else:
        raise InvalidArgumentType(f"geometry must be a GLQuotientGeometry or a RescalingGeometry, got "
                                  f"{type(geometry).__name__}")
    if strict and not result.converged:
        raise LogNotFound(
            f"no geodesic from x to y was found: after {result.iterations} Gauss–Newton steps the "
            f"relative residual of G Hᵀ is {result.residual:.3g} (tol={tol:g}). y is too far from x "
            f"(beyond where the geodesics from x stay on the manifold; the mix metric is "
            f"incomplete) or in another component; try points closer together, or more max_iter",
            result)
    return result


def distance(geometry: "GLQuotientGeometry | RescalingGeometry", x: Tensor, y: Tensor, *,
             tol: float = 1e-12, max_iter: int = 30) -> Tensor:
    r"""dist(x, y) = ‖log_x(y)‖_x (:func:`log_map`), per batch element; ∞ where x and y lie in
    different components of the rescaling quotient (β of different signs).

    Parameters
    ----------
    geometry : a :class:`~quotient_manifolds.core.gl.GLQuotientGeometry` (group GL(h)) or a
        :class:`~quotient_manifolds.core.rescaling.RescalingGeometry`.
    x, y : points of the geometry, same shape (leading dimensions are batch dimensions).
    tol, max_iter : as in :func:`log_map`.

    Returns
    -------
    Tensor
        The geodesic distance per batch element (∞ between components of the rescaling quotient).

    Raises
    ------
    LogNotFound
        Shooting finds no geodesic from x to the orbit of y.
    NotImplementedError
        A GL geometry whose group is not all of GL(h).
    ValueError, TypeError
        Invalid points (shape, finiteness, rank) or options.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import RescalingGeometry, distance
    >>> g = RescalingGeometry(2, "mix")
    >>> x = torch.tensor([[1.0, 2.0], [1.0, 1.0]], dtype=torch.float64)   # β = (1, 2)
    >>> y = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)   # β = (3, 2)
    >>> round(float(distance(g, x, y)), 12) == round(2 / 2 ** 0.5, 12)   # (1/√2)‖β₁ − β₀‖
    True
    """
    try:
        vector = log_map(geometry, x, y, tol=tol, max_iter=max_iter).vector
    except LogNotFound as err:
        if err.report is not None:
            raise
        return _component_distance(geometry, x, y)
    return geometry.frame(x).norm(vector)


# ---------------------------------------------------------------------------------- closed form
def _rescaling_closed_form(geometry: RescalingGeometry, x: Tensor, y: Tensor) -> LogResult:
    ratio = geometry.beta(y.to(torch.float64)) / geometry.beta(x.to(torch.float64))
    if bool((ratio <= 0).any()):
        index = torch.nonzero(ratio <= 0)[0].tolist()
        raise LogNotFound(
            f"x and y lie in different components of the rescaling quotient: β = u⊙v has opposite "
            f"signs at index {index} (β cannot cross 0 on the quotient), so no geodesic joins them "
            f"and dist(x, y) = inf")
    b = geometry.gl_metric.gl1_log_coefficient(ratio)
    vector = geometry.frame(x).horizontal_lift(b.to(x.dtype))
    return LogResult(vector, 0.0, 0, True, "closed form")


def _component_distance(geometry, x: Tensor, y: Tensor) -> Tensor:
    """∞ where the components differ, else the closed-form distance (per batch element)."""
    ratio = geometry.beta(y) / geometry.beta(x)
    apart = (ratio <= 0).any(-1)
    same = torch.where(apart[..., None, None], x, y)   # y where it is reachable, x (distance 0) else
    near = geometry.frame(x).norm(_rescaling_closed_form(geometry, x, same).vector)
    return torch.where(apart, torch.full_like(near, float("inf")), near)


# ---------------------------------------------------------------------------------- shooting
#: relative residual of the invariant at which rounding dominates (float64 products of points of
#: norm ~1): a shot that no step improves below it has converged as far as float64 allows
ROUNDOFF = 1e-10


def _gl_invariant(geometry: GLQuotientGeometry) -> Callable[[Tensor], Tensor]:
    def invariant(z: Tensor) -> Tensor:
        G, H = geometry.split(z)
        return G @ H.mT
    return invariant


def _shoot(geometry: GLQuotientGeometry, x: Tensor, y: Tensor,
           invariant: Callable[[Tensor], Tensor], tol: float, max_iter: int) -> LogResult:
    """Gauss–Newton on r(ξ) = inv(Exp_x(ξ)) − inv(y) over horizontal ξ (module docstring)."""
    x64 = x.to(torch.float64)
    frame = geometry.frame(x64)
    target = invariant(y.to(torch.float64))
    scale = float(torch.linalg.vector_norm(target))
    directions = _horizontal_basis(frame, x64)
    vector, end = torch.zeros_like(x64), x64
    residual = invariant(end) - target
    size = float(torch.linalg.vector_norm(residual))
    iterations, stalled = 0, False
    # The Jacobian at ξ = 0 is that of the straight line x + ξ (Exp_x(ξ) = x + ξ + O(‖ξ‖²)), free of
    # integrations; it is kept (a chord method) while each step cuts the residual a thousandfold,
    # as it does for nearby points, and replaced by the Jacobian at ξ otherwise.
    jacobian, chord = _jacobian(geometry, x64, None, x64, directions, invariant), True
    while size > tol * scale and iterations < max_iter:
        iterations += 1
        if not chord:
            jacobian = _jacobian(geometry, x64, vector, end, directions, invariant)
        coefficients = torch.linalg.lstsq(jacobian, -residual.reshape(-1, 1), driver="gelsd").solution
        delta = frame.project((coefficients[:, 0, None] * directions.flatten(1)).sum(0).reshape(x64.shape))
        moved = _backtrack(geometry, x64, vector, delta, target, size, invariant)
        if moved is None:
            if chord:
                chord, iterations = False, iterations - 1   # retry with the Jacobian at ξ
                continue
            stalled = size <= ROUNDOFF * scale   # no step lowers a residual at rounding level
            break
        chord = chord and moved[3] < 1e-3 * size
        vector, end, residual, size = moved
    converged = size <= tol * scale or stalled
    return LogResult(vector.to(x.dtype), size / scale, iterations, converged, "shooting")


def _horizontal_basis(frame, x: Tensor) -> Tensor:
    """A basis of the horizontal space at x (orthonormal in the Euclidean inner product), as
    ``(dim, *x.shape)``: the range of the projection, from its singular vectors. Shooting along
    these directions only keeps the Jacobian of full column rank (the vertical directions would be
    columns of finite-difference noise)."""
    k = x.numel()
    projected = frame.project(torch.eye(k, dtype=x.dtype, device=x.device).reshape(k, *x.shape))
    left, singular, _ = torch.linalg.svd(projected.reshape(k, k).mT)
    rank = int((singular > 1e-9 * singular[0]).sum())
    return left[:, :rank].mT.reshape(rank, *x.shape)


def _jacobian(geometry, x: Tensor, vector: "Tensor | None", end: Tensor, directions: Tensor,
              invariant) -> Tensor:
    """d inv(Exp_x(ξ)) / dξ along ``directions`` by forward differences, one batched integration
    (columns: the directions; rows: the entries of the invariant); ``vector=None``: at ξ = 0, along
    the straight line x + ξ (the same derivative, no integration)."""
    size = 0.0 if vector is None else float(torch.linalg.vector_norm(vector))
    step = 1e-7 * (1.0 + size + float(torch.linalg.vector_norm(x)) / max(1, x.numel()) ** 0.5)
    if vector is None:
        shifted = x + step * directions
    else:
        shifted, _ = geometry.integrate_geodesic(x, vector + step * directions)
    columns = (invariant(shifted) - invariant(end)) / step
    return columns.reshape(directions.shape[0], -1).mT


def _backtrack(geometry, x: Tensor, vector: Tensor, delta: Tensor, target: Tensor, size: float,
               invariant) -> "Tuple[Tensor, Tensor, Tensor, float] | None":
    """The first of ξ + δ, ξ + δ/2, … whose residual is smaller than ``size`` (a trial that leaves
    the manifold counts as not smaller); ``None`` if none of 30 halvings is."""
    t = 1.0
    for _ in range(30):
        trial = vector + t * delta
        try:
            end, _ = geometry.integrate_geodesic(x, trial)
        except StepTooLarge:
            end = None
        if end is not None:
            residual = invariant(end) - target
            new = float(torch.linalg.vector_norm(residual))
            if new < size:
                return trial, end, residual, new
        t /= 2
    return None
