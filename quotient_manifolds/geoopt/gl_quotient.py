r"""geoopt face of the GL(h) two-factor quotient (docs/maths.md §A.1–§A.3).

A point is ONE tensor ``x = [G; H]`` of shape ``(..., n+m, h)`` (G ∈ R^{n×h}, H ∈ R^{m×h} of full
column rank); leading dimensions are batch dimensions, e.g. ``(heads, n+m, h)`` for one quotient per
attention head. Every formula lives in :class:`~quotient_manifolds.core.gl.GLQuotientGeometry`;
this class only delegates (see :mod:`quotient_manifolds.geoopt._base`).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..core.gl import GLQuotientGeometry
from ..core.groups import Group
from ..core.metrics import GLMetric
from ._base import CoreQuotientManifold

Tensor = torch.Tensor


class GLQuotient(CoreQuotientManifold):
    r"""The quotient :math:`\mathbb{R}_*^{n\times h}\times\mathbb{R}_*^{m\times h}\,/\,\mathrm{GL}(h)`,
    :math:`(G, H) \sim (G A, H A^{-\top})`, as a geoopt manifold.

    The parameters are passed on to the core :class:`~quotient_manifolds.core.gl.GLQuotientGeometry`.

    Parameters
    ----------
    n, m, h : shapes of G (n×h) and H (m×h), h ≤ min(n, m).
    metric : ``"mix"`` tr(Q u_Gᵀv_G) + tr(P u_Hᵀv_H) (default) or ``"inv"``
        tr(P⁻¹u_Gᵀv_G) + tr(Q⁻¹u_Hᵀv_H), with P = GᵀG + εI, Q = HᵀH + εI (docs/maths.md §2), or
        a :class:`~quotient_manifolds.core.metrics.GLMetric`.
    retraction : ``"second_order"`` x + u − ½Γ_x(u, u) (default), ``"first_order"`` x + u, or
        ``"exact"`` (numerically integrated geodesic) — used by :meth:`retr` (docs/maths.md §5.1).
    eps : relaxation ε ≥ 0 of the Gram matrices (docs/maths.md §6.4); needed for rank-deficient
        weights.
    exact_steps : RK4 steps of the geodesic integrator (``expmap`` and ``retraction="exact"``).
    group : the group quotiented out: ``"gl"`` (default, all of GL(h)), ``"rope"`` (the commutant
        of rotary position encodings: one rotation-scaling a·I + b·J per frequency pair, for the
        Q/K factors of RoPE attention) or a group object such as
        ``RotaryGroup(pairing="interleaved", rotary_dim=32)``. Only the vertical space, hence
        ``proju``/``egrad2rgrad`` and ``dim``, depend on it.

    ``expmap`` is the exact geodesic (integrated), ``transp`` the projection onto the horizontal
    space at the new point, ``projx`` the identity; ``logmap`` solves for the geodesic from x to
    the orbit of y by shooting along that integrated geodesic and ``dist`` is its length (group
    GL(h) only; :func:`~quotient_manifolds.core.logmap.log_map`).

    Raises
    ------
    ValueError
        A size is not a positive integer, h > min(n, m), ``eps`` < 0, or ``metric``,
        ``retraction`` or ``group`` is not one of the choices; a point of the wrong shape or with
        a rank-deficient factor, where one is checked.

    Examples
    --------
    >>> import geoopt, torch
    >>> from quotient_manifolds import GLQuotient
    >>> M = GLQuotient(4, 3, 2, metric="mix")
    >>> x = M.random(dtype=torch.float64)
    >>> u = M.proju(x, torch.randn_like(x))             # horizontal projection
    >>> torch.allclose(M.proju(x, u), u)
    True
    >>> G, H = M.split(M.retr(x, 0.1 * u))              # second-order retraction
    >>> tuple(G.shape), tuple(H.shape)
    ((4, 2), (3, 2))
    >>> W = geoopt.ManifoldParameter(x, manifold=M)     # train it with a Riemannian optimizer
    """

    name = "GLQuotient"
    _group = "GL(h)"

    def __init__(self, n: int, m: int, h: int, metric: "str | GLMetric" = "mix",
                 retraction: str = "second_order", eps: float = 0.0, exact_steps: int = 32,
                 group: "str | Group | None" = None):
        super().__init__()
        self.geometry = GLQuotientGeometry(n, m, h, metric, retraction=retraction, eps=eps,
                                           exact_steps=exact_steps, group=group)
        n, m, h = self.geometry.n, self.geometry.m, self.geometry.h  # Python ints, as checked there
        self._group = self.geometry.group.describe(h)
        self.n, self.m, self.h = n, m, h

    @property
    def _point_shape(self) -> Tuple[int, int]:
        return (self.n + self.m, self.h)

    def split(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Views (G, H) of x = [G; H]."""
        return self.geometry.split(x)

    def pack(self, G: Tensor, H: Tensor) -> Tensor:
        """x = [G; H]."""
        return self.geometry.pack(G, H)

    def _origin_point(self, dtype, device) -> Tensor:
        """G = [I_h; 0], H = [I_h; 0]."""
        eye = torch.eye(self.h, dtype=dtype, device=device)
        G = torch.cat((eye, eye.new_zeros(self.n - self.h, self.h)), dim=0)
        H = torch.cat((eye, eye.new_zeros(self.m - self.h, self.h)), dim=0)
        return self.pack(G, H)

    def extra_repr(self) -> str:
        g = self.geometry
        return (f"n={g.n}, m={g.m}, h={g.h}, metric={g.metric!r}, retraction={g.retraction!r}, "
                f"eps={g.eps}, group={self._group}")
