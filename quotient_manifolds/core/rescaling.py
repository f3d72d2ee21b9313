r"""The elementwise rescaling quotient of diagonal networks (docs/maths.md §8, §A.11).

A point is (u, v) ∈ (R∖{0})^d × (R∖{0})^d stored as ONE tensor ``x = [u; v]`` of shape ``(..., 2, d)``.
The group (R∖{0})^d acts by (u, v) ↦ (a⊙u, v/a); β = u⊙v is invariant.

This is exactly d independent copies of the GL(1) two-factor quotient with n = m = h = 1, so the
metrics, horizontal projection, Riemannian gradient and Christoffel terms are *not* written again:
they are those of :class:`~quotient_manifolds.core.gl.GLQuotientGeometry` applied to the view
``x.mT[..., None]`` of shape ``(..., d, 2, 1)``. For n = m = h = 1 they read (docs/maths.md
§8.1–§8.2):

    inv:  g = Σ_i ξ_uⁱη_uⁱ/(uⁱ)² + ξ_vⁱη_vⁱ/(vⁱ)²,   Γ^u_uu = −1/u, Γ^v_vv = −1/v
    mix:  g = Σ_i ξ_uⁱη_uⁱ(vⁱ)² + ξ_vⁱη_vⁱ(uⁱ)²,     Γ^u_uv = 1/v, Γ^u_vv = −u/v², (u ↔ v)
    horizontal (both): ξ_uⁱ/uⁱ = ξ_vⁱ/vⁱ =: bⁱ

What is specific to d = 1 per coordinate is the closed-form geodesic (docs/maths.md §8.3), used
by the ``exact`` retraction when ε = 0 (written with the other formulas of each metric, in
:meth:`~quotient_manifolds.core.metrics.GLMetric.gl1_geodesic`):

    inv: (u e^{ξ_u/u}, v e^{ξ_v/v})            (any ξ; = (u e^{b}, v e^{b}) for horizontal ξ)
    mix: (u √(1+2b), v √(1+2b))                 (horizontal ξ, needs 1 + 2b > 0)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import InvalidArgument
from .._validation import batch_shape, choice, floating_dtype, floating_tensor, optional_generator, size
from .gl import RETRACTIONS, GLFrame, GLQuotientGeometry
from .metrics import GLMetric

Tensor = torch.Tensor


def _check_representable(x: Tensor) -> None:
    """Refuse a point whose u², v² or β² = (u v)² underflow in float64 (below its smallest normal
    number): the metrics and the projection multiply these, and they would turn into 0 and then NaN
    (a coordinate that an optimiser drove towards β = 0)."""
    x64 = x.detach().to(torch.float64)
    beta = x64[..., 0, :] * x64[..., 1, :]
    tiny = torch.finfo(torch.float64).tiny
    small = ((x64 * x64) < tiny).any(-2) | ((beta * beta) < tiny)
    if bool(small.any()):
        index = torch.nonzero(small)[0].tolist()
        u, v = (float(x64[(*index[:-1], row, index[-1])]) for row in (0, 1))
        raise InvalidArgument(
            f"x = [u; v] has β = u⊙v = {u * v:.3g} at index {index} (u = {u:.3g}, v = {v:.3g}): "
            f"the metric's products of these underflow in float64 and would give NaN. The "
            f"coordinate's β has collapsed towards 0: under metric='inv' β = 0 is infinitely far "
            f"and the gradient along it vanishes, so an optimiser that overshoots towards it (e.g. "
            f"Adam with a large learning rate) drives it there geometrically and it does not come "
            f"back; use a smaller learning rate, or metric='mix'")


class RescalingFrame:
    """Geometry of the rescaling quotient at one point x = [u; v], computed once.

    Every formula is the GL(1) quotient's (:class:`~quotient_manifolds.core.gl.GLFrame`), applied to
    the d coordinates at once.

    Parameters
    ----------
    geometry:
        The :class:`RescalingGeometry` (usually made by its ``frame``).
    x:
        The point [u; v], shape (..., 2, d), every entry nonzero (unless ``eps`` > 0).
    check:
        Validate the shape, finiteness and nonzero entries of ``x``.

    Raises
    ------
    ValueError
        ``x`` has the wrong shape, a non-finite entry, or a zero entry with ``eps`` = 0.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import RescalingGeometry
    >>> geometry = RescalingGeometry(2, "mix")
    >>> x = torch.tensor([[1.0, 2.0], [1.0, 0.5]], dtype=torch.float64)
    >>> frame = geometry.frame(x)
    >>> u = frame.horizontal_lift(torch.tensor([0.1, -0.2], dtype=torch.float64))
    >>> torch.allclose(frame.project(u), u)             # (b⊙u, b⊙v) is horizontal
    True
    >>> frame.horizontal_coefficient(u)
    tensor([ 0.1000, -0.2000], dtype=torch.float64)
    """

    def __init__(self, geometry: "RescalingGeometry", x: Tensor, *, check: bool = True):
        if check:
            geometry.check_shape(x.shape, "x")
            if not bool(torch.isfinite(x).all()):
                raise InvalidArgument("the point x = [u; v] contains non-finite values (nan or inf)")
            if not geometry.eps and bool((x == 0).any()):
                idx = torch.nonzero(x == 0)[0].tolist()
                raise InvalidArgument(
                    f"x = [u; v] has a zero entry at index {idx}: the rescaling quotient needs every "
                    f"uⁱ ≠ 0 and vⁱ ≠ 0 (the metrics are singular there); pass eps > 0 to use the "
                    f"relaxed metric (u² + ε in place of u²).")
            if not geometry.eps:
                _check_representable(x)
        self.geometry = geometry
        self.x = x
        self.gl: GLFrame = geometry.gl.frame(geometry.to_gl(x), check=False)

    def _lift(self, u: Tensor) -> Tensor:
        return self.geometry.to_gl(u)

    def _drop(self, y: Tensor) -> Tensor:
        return self.geometry.from_gl(y)

    def inner(self, u: Tensor, v: Optional[Tensor] = None, *, keepdim: bool = False) -> Tensor:
        """g_x(u, v), summed over the d coordinates (docs/maths.md §8.1)."""
        out = self.gl.inner(self._lift(u), None if v is None else self._lift(v)).sum(-1)
        return out[..., None, None] if keepdim else out

    def norm(self, u: Tensor, *, keepdim: bool = False) -> Tensor:
        return self.inner(u, keepdim=keepdim).clamp_min(0).sqrt()

    def project(self, u: Tensor) -> Tensor:
        """Metric-orthogonal projection onto ξ_u/u = ξ_v/v (per coordinate)."""
        return self._drop(self.gl.project(self._lift(u)))

    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        return self._drop(self.gl.egrad2rgrad(self._lift(egrad)))

    def ehess2rhess(self, egrad: Tensor, ehess: Tensor, u: Tensor) -> Tensor:
        return self._drop(self.gl.ehess2rhess(self._lift(egrad), self._lift(ehess), self._lift(u)))

    def christoffel(self, u: Tensor, v: Optional[Tensor] = None) -> Tensor:
        return self._drop(self.gl.christoffel(self._lift(u), None if v is None else self._lift(v)))

    def retraction_differential(self, u: Tensor, v: Tensor, method: Optional[str] = None) -> Tensor:
        """As :meth:`GLFrame.retraction_differential` (the exact retraction: projection of v)."""
        return self._drop(self.gl.retraction_differential(self._lift(u), self._lift(v), method))

    def horizontal_coefficient(self, u: Tensor) -> Tensor:
        """b with u = (b⊙u₀, b⊙v₀) for horizontal u; returns ξ_u/u (shape (..., d))."""
        return u[..., 0, :] / self.x[..., 0, :]

    def horizontal_lift(self, b: Tensor) -> Tensor:
        """The horizontal vector (b⊙u, b⊙v) with coefficient b (docs/maths.md §8.1)."""
        return self.x * b[..., None, :]

    def retract(self, u: Tensor, method: Optional[str] = None, *,
                exact_steps: Optional[int] = None) -> Tensor:
        """As :meth:`GLFrame.retract`; the exact geodesic is in closed form when ε = 0."""
        method = choice("retraction", method or self.geometry.retraction, RETRACTIONS)
        if method != "exact" or self.geometry.eps:
            return self._drop(self.gl.retract(self._lift(u), method, exact_steps=exact_steps))
        return self.geometry.exact_geodesic(self.x, u)


class RescalingGeometry:
    r"""The quotient (R∖{0})^d × (R∖{0})^d / (R∖{0})^d of diagonal networks β = u⊙v
    (docs/maths.md §8).

    Parameters: ``d`` (number of coordinates), ``metric`` (``"inv"`` | ``"mix"`` or a
    :class:`~quotient_manifolds.core.metrics.GLMetric`), ``retraction``
    (``"first_order"`` | ``"second_order"`` | ``"exact"``), ``eps`` (relaxation, u² + ε), and the
    ODE settings used by ``exact`` when ε > 0.

    A point is x = [u; v] of shape (..., 2, d) with β = u⊙v; the group acts by (u, v) ↦ (a⊙u, v⊘a).

    Parameters
    ----------
    d:
        Number of coordinates.
    metric:
        ``"mix"`` (default), ``"inv"`` or a :class:`~quotient_manifolds.core.metrics.GLMetric`.
    retraction:
        ``"first_order"``, ``"second_order"`` (default) or ``"exact"`` (closed form when ε = 0).
    eps:
        Relaxation ε ≥ 0 (u² + ε in place of u²).
    exact_steps:
        RK4 steps of the exact retraction when ε > 0.

    Raises
    ------
    ValueError
        ``d`` is not a positive integer, ``eps`` < 0, or ``metric`` or ``retraction`` is not one of
        the choices.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import RescalingGeometry
    >>> geometry = RescalingGeometry(2, "inv", retraction="exact")
    >>> x = torch.tensor([[1.0, 2.0], [1.0, 0.5]], dtype=torch.float64)
    >>> geometry.beta(x)
    tensor([1., 1.], dtype=torch.float64)
    >>> a = torch.tensor([3.0, -1.0], dtype=torch.float64)
    >>> torch.allclose(geometry.beta(geometry.act(x, a)), geometry.beta(x))   # same point
    True
    """

    def __init__(self, d: int, metric: "str | GLMetric" = "mix", *, retraction: str = "second_order",
                 eps: float = 0.0, exact_steps: int = 32):
        self.d = size("d", d)
        self.gl = GLQuotientGeometry(1, 1, 1, metric, retraction=retraction, eps=eps,
                                     exact_steps=exact_steps)
        self.metric, self.retraction, self.eps = self.gl.metric, self.gl.retraction, self.gl.eps
        self.gl_metric = self.gl.gl_metric

    def __repr__(self) -> str:
        return (f"RescalingGeometry(d={self.d}, metric={self.metric!r}, "
                f"retraction={self.retraction!r}, eps={self.eps})")

    @property
    def dim(self) -> int:
        return self.d

    def check_shape(self, shape, name: str = "x") -> None:
        if len(shape) < 2 or shape[-2] != 2 or shape[-1] != self.d:
            raise InvalidArgument(f"`{name}` has shape {tuple(shape)}; expected (..., 2, d) = "
                                  f"(..., 2, {self.d}) with u in row 0 and v in row 1")

    @staticmethod
    def to_gl(x: Tensor) -> Tensor:
        """(..., 2, d) → (..., d, 2, 1): d independent GL(1) points [G; H] = [uⁱ; vⁱ]."""
        return x.mT.unsqueeze(-1)

    @staticmethod
    def from_gl(y: Tensor) -> Tensor:
        return y.squeeze(-1).mT

    def frame(self, x: Tensor, *, check: bool = True) -> RescalingFrame:
        return RescalingFrame(self, x, check=check)

    def act(self, x: Tensor, a: Tensor) -> Tensor:
        """(u, v) ↦ (a⊙u, v/a); also maps tangent vectors. ``a`` must be finite with no zero entry
        (an element of (R∖{0})^d).

        Parameters
        ----------
        x:
            A point or tangent vector (..., 2, d).
        a:
            The group element, d finite nonzero entries.

        Returns
        -------
        Tensor
            (a⊙u, v/a).

        Raises
        ------
        ValueError
            ``a`` is not a tensor of finite nonzero numbers.

        Examples
        --------
        See the class's example (``geometry.act(x, a)``).
        """
        if not isinstance(a, torch.Tensor) or not bool(torch.isfinite(a).all()) or bool((a == 0).any()):
            raise InvalidArgument(f"a must be a tensor of finite non-zero numbers (an element of (R∖{{0}})^d): "
                                  f"its zeros or non-finite entries would give inf or nan points")
        return torch.stack((x[..., 0, :] * a, x[..., 1, :] / a), dim=-2)

    def beta(self, x: Tensor) -> Tensor:
        """The invariant β = u⊙v.

        Parameters
        ----------
        x:
            A point (..., 2, d).

        Returns
        -------
        Tensor
            β, shape (..., d).

        Raises
        ------
        IndexError
            ``x`` has fewer than two rows.

        Examples
        --------
        See the class's example (``geometry.beta(x)``).
        """
        return x[..., 0, :] * x[..., 1, :]

    def exact_geodesic(self, x: Tensor, u: Tensor, t: float = 1.0) -> Tensor:
        """Closed-form geodesic at time t (docs/maths.md §8.3), ε = 0.

        inv: (u e^{tξ_u/u}, v e^{tξ_v/v}) for any ξ. mix: (u √(1+2bt), v √(1+2bt)) for horizontal
        ξ = (b⊙u, b⊙v); a non-horizontal ξ or 1 + 2bt ≤ 0 (the mix geodesic is incomplete) raise.

        Parameters
        ----------
        x, u:
            The start point and velocity, (..., 2, d).
        t:
            The time.

        Returns
        -------
        Tensor
            The point at time t.

        Raises
        ------
        GeodesicLeftManifold
            The mix geodesic ends before t (1 + 2bt ≤ 0).
        ValueError
            ``u`` is not horizontal (mix).

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds.core import RescalingGeometry
        >>> geometry = RescalingGeometry(1, "mix")
        >>> x = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
        >>> geometry.exact_geodesic(x, 0.5 * x)            # b = ½: scale √(1 + 2b) = √2
        tensor([[1.4142],
                [2.8284]], dtype=torch.float64)
        """
        bu, bv = u[..., 0, :] / x[..., 0, :], u[..., 1, :] / x[..., 1, :]
        return self.gl_metric.gl1_geodesic(x, bu, bv, t)

    def random_point(self, *batch: int, dtype=None, device=None, generator=None,
                     signs: Optional[Tensor] = None) -> Tensor:
        """Gaussian u and v; with ``signs`` (d entries ±1) the signs of v are set so that
        β = u⊙v has those signs: a point of that component of the quotient (β cannot change sign
        along a curve, so each sign pattern is a component)."""
        floating_dtype("dtype", dtype)
        optional_generator("generator", generator)
        x = torch.randn(batch_shape("batch", batch) + (2, self.d), dtype=dtype, device=device,
                        generator=generator)
        if signs is None:
            return x
        signs = torch.as_tensor(signs, dtype=x.dtype, device=x.device)
        if signs.shape != (self.d,) or not bool((signs.abs() == 1).all()):
            raise InvalidArgument(f"signs must hold d = {self.d} entries, each +1 or -1 (the signs of "
                                  f"β = u⊙v), got {signs.tolist()}")
        return torch.stack((x[..., 0, :], x[..., 1, :].abs() * torch.sign(x[..., 0, :]) * signs), -2)

    def random_horizontal(self, x: Tensor, *, unit: bool = True, generator=None) -> Tensor:
        floating_tensor("x", x)
        optional_generator("generator", generator)
        frame = self.frame(x)
        u = frame.project(torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=generator))
        return u / frame.norm(u, keepdim=True) if unit else u

    def zero_vector(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)

    # conveniences mirroring GLQuotientGeometry
    def inner(self, x, u, v=None, *, keepdim=False):
        return self.frame(x).inner(u, v, keepdim=keepdim)

    def norm(self, x, u, *, keepdim=False):
        return self.frame(x).norm(u, keepdim=keepdim)

    def project(self, x, u):
        return self.frame(x).project(u)

    def egrad2rgrad(self, x, egrad):
        return self.frame(x).egrad2rgrad(egrad)

    def christoffel(self, x, u, v=None):
        return self.frame(x).christoffel(u, v)

    def retract(self, x, u, method=None):
        return self.frame(x).retract(u, method)

    def transport(self, y, v):
        return self.frame(y).project(v)
