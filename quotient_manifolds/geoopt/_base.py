r"""Shared body of the geoopt faces: nothing to convert, every method delegates to a core frame.

The core geometry object (:class:`~quotient_manifolds.core.gl.GLQuotientGeometry` or
:class:`~quotient_manifolds.core.rescaling.RescalingGeometry`) owns every formula; a frame
``geometry.frame(x)`` is built at the point and its methods are called. Frames compute in float64
and return results in the dtype of the input, and they broadcast over leading batch dimensions, so
the methods below do too (docs/maths.md §A.1, shape conventions).

Frames are cached by the point's contents (:class:`~quotient_manifolds._runtime.FrameCache`): one
RiemannianAdam step builds one frame instead of four. Methods on small points run on one thread
(:func:`~quotient_manifolds._runtime.small_work`): their linear algebra is far below what threads
pay off for.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from geoopt.manifolds.base import Manifold
from geoopt.tensor import ManifoldTensor
from geoopt.utils import size2shape

from ..errors import InvalidArgument
from .._runtime import FrameCache, finite_step, small_work, step_advice
from .._validation import floating_dtype, floating_tensor, tangent
from ..core.logmap import distance, log_map

Tensor = torch.Tensor

_small = small_work(lambda x: x.numel())  # the point's size decides the thread bound

class CoreQuotientManifold(Manifold):
    r"""geoopt :class:`~geoopt.manifolds.base.Manifold` delegating to a core quotient geometry.

    Subclasses set ``self.geometry`` (the core object) in ``__init__`` and provide ``split``,
    ``pack``, ``_point_shape`` and ``_origin_point`` (the deterministic point of :meth:`origin`).

    Adam note (docs/maths.md §A.3). The default ``component_inner`` (``inner`` with
    ``keepdim=True``, shape ``(..., 1, 1)``) is kept on purpose: RiemannianAdam then holds ONE
    second-moment scalar per quotient point (per head for a ``(heads, n+m, h)`` parameter), so its
    step direction is a scalar multiple of the (transported, horizontal) first moment and stays
    horizontal and GL-invariant. Per-coordinate moments would break both.
    """

    ndim = 2
    reversible = False
    forward = NotImplemented
    _group = "group"

    geometry = None  # set by subclasses (a core geometry object, not an nn.Module)

    # ------------------------------------------------------------------ helpers
    def _frame(self, x: Tensor, name: str = "x"):
        """The core frame at the point ``name`` (validated: a real floating tensor, shape,
        finiteness, full rank; raises TypeError / ValueError naming it), reused from the cache when
        it has the values of a recent point."""
        return self._frame_cache_().frame(self.geometry, floating_tensor(name, x), name)

    def _frame_cache_(self) -> FrameCache:
        cache = self.__dict__.get("_frame_cache")
        if cache is None:  # created lazily: subclasses need not call a base __init__
            cache = self.__dict__["_frame_cache"] = FrameCache()
        return cache

    @staticmethod
    def _tangent(x: Tensor, u: Tensor, name: str, what: str = "the point x") -> Tensor:
        """``u`` checked to be a finite real floating tensor of the shape of ``x`` (an integer vector
        would be truncated by the metric weights; a different batch shape would broadcast silently;
        a NaN would spread to every result)."""
        return tangent(name, u, x.shape, what)

    def _step(self, x: Tensor, u: Tensor) -> Tensor:
        """The step ``u`` of a retraction at ``x``: checked as :meth:`_tangent`, except that a
        non-finite step raises :class:`~quotient_manifolds.StepTooLarge`."""
        return finite_step(self.geometry, "u", tangent("u", u, x.shape, "the point x", finite=False))

    @property
    def dim(self) -> int:
        """Dimension of the quotient (from the core)."""
        return self.geometry.dim

    @property
    def metric(self) -> str:
        return self.geometry.metric

    @property
    def retraction(self) -> str:
        return self.geometry.retraction

    @property
    def eps(self) -> float:
        return self.geometry.eps

    # ------------------------------------------------------------------ checks
    def _check_shape(self, shape: Tuple[int], name: str) -> Tuple[bool, Optional[str]]:
        """Shape check of the core (``geometry.check_shape``), as ``(ok, reason)``."""
        try:
            self.geometry.check_shape(tuple(shape), name)
        except ValueError as err:
            return False, str(err)
        return True, None

    @_small
    def _check_point_on_manifold(self, x: Tensor, *, atol=1e-5, rtol=1e-5
                                 ) -> Tuple[bool, Optional[str]]:
        """Finite, full-rank point: the validation the core frame does (``atol``/``rtol`` unused:
        the rank test uses the core's dtype-dependent relative pivot tolerance)."""
        try:
            self._frame(x)
        except ValueError as err:
            return False, str(err)
        return True, None

    @_small
    def _check_vector_on_tangent(self, x: Tensor, u: Tensor, *, atol=1e-5, rtol=1e-5
                                 ) -> Tuple[bool, Optional[str]]:
        """u is horizontal iff P_h(u) = u (the horizontal space is the tangent space of the
        quotient, docs/maths.md §3)."""
        if not bool(torch.isfinite(u).all()):
            return False, "`u` contains non-finite values (nan or inf)"
        try:
            pu = self.proju(x, u)
        except ValueError as err:  # invalid x or shapes
            return False, str(err)
        if torch.allclose(pu, u, atol=atol, rtol=rtol):
            return True, None
        err = float((pu - u).abs().max())
        return False, (f"`u` is not horizontal at `x`: max |u − P_h(u)| = {err:.3e} "
                       f"(atol={atol}, rtol={rtol}); project it with `proju`")

    # ------------------------------------------------------------------ projections
    def projx(self, x: Tensor) -> Tensor:
        """Identity. A quotient point is any representative; changing it here would invalidate
        optimizer buffers stored in its coordinates (geoopt master calls ``projx`` at every Adam
        step, docs/maths.md §A.3). Use ``geometry.balance`` + ``geometry.act`` explicitly instead."""
        return x

    @_small
    def proju(self, x: Tensor, u: Tensor) -> Tensor:
        """Metric-orthogonal projection onto the horizontal space (core ``frame.project``)."""
        return self._frame(x).project(self._tangent(x, u, "u"))

    @_small
    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        """Horizontal Riemannian gradient (core ``frame.egrad2rgrad``, docs/maths.md §4): Euclidean gradient
        times the inverse metric weights, then projected (needed for non-invariant terms such as
        weight decay)."""
        return self._frame(x).egrad2rgrad(self._tangent(x, u, "u"))

    # ------------------------------------------------------------------ metric
    @_small
    def inner(self, x: Tensor, u: Tensor, v: Optional[Tensor] = None, *, keepdim=False) -> Tensor:
        """g_x(u, v) (core ``frame.inner``); ``keepdim=True`` gives shape ``(..., 1, 1)``."""
        v = None if v is None else self._tangent(x, v, "v")
        return self._frame(x).inner(self._tangent(x, u, "u"), v, keepdim=keepdim)

    @_small
    def norm(self, x: Tensor, u: Tensor, *, keepdim=False) -> Tensor:
        """‖u‖_x = √g_x(u, u) (core ``frame.norm``)."""
        return self._frame(x).norm(self._tangent(x, u, "u"), keepdim=keepdim)

    # ------------------------------------------------------------------ moves
    @_small
    def retr(self, x: Tensor, u: Tensor) -> Tensor:
        """The retraction chosen at construction (core ``frame.retract``, docs/maths.md §5.1).
        Raises :class:`~quotient_manifolds.StepTooLarge` if the new point is off the manifold."""
        with step_advice(self.geometry):
            return self._checked_step(self._frame(x).retract(self._step(x, u)))

    @_small
    def expmap(self, x: Tensor, u: Tensor) -> Tensor:
        """Exact geodesic at t = 1 (core ``frame.retract(u, "exact")``). Raises
        :class:`~quotient_manifolds.StepTooLarge` (a ``GeodesicLeftManifold``) if the geodesic
        leaves the manifold before t = 1."""
        with step_advice(self.geometry):
            return self._checked_step(self._frame(x).retract(self._step(x, u), "exact"))

    def _checked_step(self, y: Tensor) -> Tensor:
        """``y`` after validating it (and caching its frame: the next step starts there)."""
        self._frame_cache_().frame_after_step(self.geometry, y)
        return y

    @_small
    def transp(self, x: Tensor, y: Tensor, v: Tensor) -> Tensor:
        """Vector transport by projection onto the horizontal space at y (Manopt; core
        ``geometry.transport``, here through the cached frame at y: the next step's point). ``x``
        is not used."""
        return self._frame(y, "y").project(self._tangent(y, v, "v", "the point y"))

    def retr_transp(self, x: Tensor, u: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    def expmap_transp(self, x: Tensor, u: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        y = self.expmap(x, u)
        return y, self.transp(x, y, v)

    def transp_follow_retr(self, x: Tensor, u: Tensor, v: Tensor) -> Tensor:
        return self.transp(x, self.retr(x, u), v)

    def transp_follow_expmap(self, x: Tensor, u: Tensor, v: Tensor) -> Tensor:
        return self.transp(x, self.expmap(x, u), v)

    # ------------------------------------------------------------------ logarithm and distance
    @_small
    def logmap(self, x: Tensor, y: Tensor) -> Tensor:
        """log_x(y): the horizontal vector at x whose geodesic (:meth:`expmap`) reaches the orbit of
        y (core :func:`~quotient_manifolds.core.logmap.log_map`: closed form on the rescaling
        quotient with ε = 0, shooting along the integrated geodesic otherwise). Raises
        :class:`~quotient_manifolds.core.LogNotFound` when no geodesic is found (points too
        far apart, or in different components)."""
        return log_map(self.geometry, x, self._tangent(x, y, "y", "x")).vector

    @_small
    def dist(self, x: Tensor, y: Tensor, *, keepdim=False) -> Tensor:
        """dist(x, y) = ‖log_x(y)‖_x (core :func:`~quotient_manifolds.core.logmap.distance`; ∞
        between components of the rescaling quotient); ``keepdim=True`` gives ``(..., 1, 1)``."""
        d = distance(self.geometry, x, self._tangent(x, y, "y", "x"))
        return d[..., None, None] if keepdim else d

    # ------------------------------------------------------------------ sampling
    def random(self, *size, dtype=None, device=None, generator=None) -> ManifoldTensor:
        """Random point (core ``geometry.random_point``) of the full shape ``size`` (geoopt
        convention: manifold dimensions included; empty ``size`` gives a single point)."""
        shape = size2shape(*size) if size else self._point_shape
        self._assert_check_shape(shape, "x")
        data = self.geometry.random_point(*shape[:-2], dtype=dtype, device=device,
                                          generator=generator)
        return ManifoldTensor(data, manifold=self)

    @property
    def _point_shape(self) -> Tuple[int, int]:
        raise NotImplementedError

    def _origin_point(self, dtype, device) -> Tensor:
        raise NotImplementedError

    def origin(self, *size, dtype=None, device=None, seed: Optional[int] = 42) -> ManifoldTensor:
        """Deterministic point broadcast to the full shape ``size`` (``seed`` unused)."""
        shape = size2shape(*size) if size else self._point_shape
        self._assert_check_shape(shape, "x")
        point = self._origin_point(floating_dtype("dtype", dtype) or torch.get_default_dtype(), device)
        return ManifoldTensor(point.expand(shape).clone(), manifold=self)

    # ------------------------------------------------------------------ layout
    def unpack_tensor(self, tensor: Tensor) -> Tuple[Tensor, Tensor]:
        """The two factors (views) of a stacked point."""
        return self.split(tensor)

    def pack_point(self, *tensors: Tensor) -> Tensor:
        """Stack the two factors into one tensor (inverse of :meth:`unpack_tensor`)."""
        if len(tensors) != 2:
            raise InvalidArgument(f"2 tensors expected (the two factors), got {len(tensors)}")
        return self.pack(*tensors)
