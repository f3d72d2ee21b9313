r"""Shared body of the pymanopt faces: convert with :class:`PairConverter`, delegate to the core.

Points and tangent vectors are numpy pairs (``point_layout=2``: the cost receives the two factors as
two arguments). Each method converts its arguments to ONE float64 torch tensor, calls the core
frame (``geometry.frame(x)``), and converts back. Random draws use a torch generator seeded from
numpy's global RNG, so ``np.random.seed`` makes pymanopt runs reproducible as usual.

Frames are cached by the point's values (:class:`~quotient_manifolds._runtime.FrameCache`): a
trust-region run asks for many inner products and projections at one point. The points this
manifold returned itself (retraction, exp) are found first by the identity of their arrays,
confirmed by a comparison of their values in numpy (a point changed in place misses), so that an
optimizer's calls at its current point convert nothing. Methods on small points run on one thread
(:func:`~quotient_manifolds._runtime.small_work`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from pymanopt.manifolds.manifold import Manifold

from .._runtime import FrameCache, StepTooLarge, finite_step, small_work, step_advice
from ..core.logmap import distance, log_map
from ._tangent import PairConverter

_small = small_work(lambda point: sum(np.size(part) for part in point))

#: What a pymanopt user can do about a step that left the manifold: pymanopt's optimisers choose
#: the step themselves, and their line searches do not take back a retraction that raises.
_PYMANOPT_STEPS = (
    "With pymanopt the trial step is the optimiser's: for ConjugateGradient or SteepestDescent pass "
    "line_searcher=BackTrackingLineSearcher(initial_step_size=s) (pymanopt.optimizers.line_search) "
    "with s a step length of your problem's scale in the metric's units (under mix, the Frobenius "
    "size of a change of G Hᵀ; its default 1 can leave the manifold), and for TrustRegions a "
    "smaller Delta_bar.")


class CoreQuotientManifold(Manifold):
    """pymanopt ``Manifold`` delegating to a core quotient geometry (subclasses set ``geometry``,
    ``_conv``, ``_point_cls``, ``_tangent_cls`` and ``_group``)."""

    geometry = None
    _conv: PairConverter
    _point_cls = tuple
    _tangent_cls = tuple
    _group = "group"

    # ------------------------------------------------------------------ conversion
    def _t(self, pair, name: str = "point") -> torch.Tensor:
        """The point ``name`` as one float64 tensor (shape and dtype checked, naming the argument)."""
        return self._conv.to_torch(pair, name)

    #: whether the core frame takes tangent vectors as pairs (u_G, u_H) (no concatenation)
    _pairs = False

    def _tv(self, pair, name: str, *, check_finite: bool = True):
        """The tangent vector ``name`` as one float64 tensor, or as a pair of them for a core that
        takes pairs; checked to be finite unless ``check_finite=False`` (for a caller that checks
        its result instead, see :meth:`_refuse_non_finite`)."""
        return self._conv.to_torch(pair, name, tangent=check_finite, stacked=not self._pairs)

    def _refuse_non_finite(self, *named) -> None:
        """Raise the ValueError naming the first of ``named`` ((name, pair) items) that holds a NaN
        or an infinity. Called when a result came out non-finite: a non-finite input always makes
        it so (u·M ⊙ v has an inf or NaN term), so checking the one result replaces checking
        every input first; a result that overflowed from finite inputs is returned as it is."""
        for name, pair in named:
            self._tv(pair, name)

    def _step(self, pair) -> torch.Tensor:
        """The step ``tangent_vector`` of a retraction (its finiteness is checked when the new
        point fails its check, :meth:`_checked_step`)."""
        return self._t(pair, "tangent_vector")

    def _point(self, t: torch.Tensor):
        return self._conv.to_numpy(t, self._point_cls)

    def _vec(self, t: torch.Tensor):
        return self._conv.to_numpy(t, self._tangent_cls)

    def _frame(self, point, name: str = "point"):
        """The core frame at ``point``, reused from the cache when the point has recent values."""
        frame = self._own_point_frame(point)
        if frame is not None:
            return frame
        return self._frame_cache_().frame(self.geometry, self._t(point, name), name)

    #: how many of the points this manifold returned keep their frames by identity
    _OWN_POINTS = 3

    def _own_point_frame(self, point):
        """The frame of a point this manifold returned, if ``point`` holds the very arrays it
        returned with the values it returned (a point changed in place misses)."""
        if not isinstance(point, tuple) or len(point) != 2:
            return None
        for arrays, snapshot, frame in self.__dict__.get("_own_points", ()):
            # the frame was built on its own copy of the values: compare with it (one numpy pass
            # each, a third of torch.equal's cost on arrays of this size)
            if (point[0] is arrays[0] and point[1] is arrays[1]
                    and (arrays[0] == snapshot[0]).all() and (arrays[1] == snapshot[1]).all()):
                return frame
        return None

    def _frame_cache_(self) -> FrameCache:
        cache = self.__dict__.get("_frame_cache")
        if cache is None:  # created lazily: subclasses need not call a base __init__
            cache = self.__dict__["_frame_cache"] = FrameCache()
        return cache

    def _checked_step(self, y: torch.Tensor, step: torch.Tensor):
        """The point ``y`` (torch) for pymanopt, after validating it (its frame is cached: the
        next step starts there); off the manifold raises :class:`~quotient_manifolds.StepTooLarge`,
        naming the ``step`` if it held a NaN or an infinity (then no retraction along it stays on
        the manifold)."""
        try:
            frame = self._frame_cache_().frame_after_step(self.geometry, y)
        except StepTooLarge as left:
            try:
                finite_step(self.geometry, "tangent_vector", step)
            except StepTooLarge as non_finite:
                left = non_finite
            raise StepTooLarge(f"{left} {_PYMANOPT_STEPS}") from None
        point = self._point(y)
        own = self.__dict__.setdefault("_own_points", [])
        snapshot = self._point(frame.x)   # numpy views of the values the frame was built on
        own.insert(0, (point, snapshot, frame))
        del own[self._OWN_POINTS:]
        return point

    @staticmethod
    def _generator() -> torch.Generator:
        return torch.Generator().manual_seed(int(np.random.randint(0, 2 ** 62)))

    # ------------------------------------------------------------------ metric
    @_small
    def inner_product(self, point, tangent_vector_a, tangent_vector_b) -> float:
        """g_x(a, b) (core ``frame.inner``)."""
        frame = self._frame(point)
        value = float(frame.inner(self._tv(tangent_vector_a, "tangent_vector_a", check_finite=False),
                                  self._tv(tangent_vector_b, "tangent_vector_b", check_finite=False)))
        if not math.isfinite(value):
            self._refuse_non_finite(("tangent_vector_a", tangent_vector_a),
                                    ("tangent_vector_b", tangent_vector_b))
        return value

    @_small
    def norm(self, point, tangent_vector) -> float:
        """‖v‖_x (core ``frame.norm``)."""
        frame = self._frame(point)
        value = float(frame.norm(self._tv(tangent_vector, "tangent_vector", check_finite=False)))
        if not math.isfinite(value):
            self._refuse_non_finite(("tangent_vector", tangent_vector))
        return value

    # ------------------------------------------------------------------ projections
    @_small
    def projection(self, point, vector):
        """Horizontal projection (core ``frame.project``)."""
        return self._vec(self._frame(point).project(self._tv(vector, "vector")))

    to_tangent_space = projection

    @_small
    def euclidean_to_riemannian_gradient(self, point, euclidean_gradient):
        """Horizontal Riemannian gradient (core ``frame.egrad2rgrad``, docs/maths.md §4)."""
        return self._vec(self._frame(point).egrad2rgrad(self._tv(euclidean_gradient,
                                                                 "euclidean_gradient")))

    @_small
    def euclidean_to_riemannian_hessian(self, point, euclidean_gradient, euclidean_hessian,
                                        tangent_vector):
        """P_h(D rgrad[ξ] + Γ(rgrad, ξ)) (core ``frame.ehess2rhess``)."""
        frame = self._frame(point)
        return self._vec(frame.ehess2rhess(self._tv(euclidean_gradient, "euclidean_gradient"),
                                           self._tv(euclidean_hessian, "euclidean_hessian"),
                                           self._tv(tangent_vector, "tangent_vector")))

    # ------------------------------------------------------------------ moves
    @_small
    def retraction(self, point, tangent_vector):
        """The retraction chosen at construction (core ``frame.retract``)."""
        step = self._step(tangent_vector)
        with step_advice(self.geometry, _PYMANOPT_STEPS):
            y = self._frame(point).retract(step)
        return self._checked_step(y, step)

    @_small
    def exp(self, point, tangent_vector):
        """The exact geodesic at t = 1 (core ``frame.retract(·, "exact")``)."""
        step = self._step(tangent_vector)
        with step_advice(self.geometry, _PYMANOPT_STEPS):
            y = self._frame(point).retract(step, "exact")
        return self._checked_step(y, step)

    @_small
    def transport(self, point_a, point_b, tangent_vector_a):
        """Projection onto the horizontal space at ``point_b`` (core ``geometry.transport``, through
        the cached frame at ``point_b``)."""
        return self._vec(self._frame(point_b, "point_b").project(
            self._tv(tangent_vector_a, "tangent_vector_a")))

    # ------------------------------------------------------------------ sampling
    def random_point(self):
        """Core ``geometry.random_point`` (float64), seeded from numpy's global RNG."""
        return self._point(self.geometry.random_point(dtype=torch.float64,
                                                      generator=self._generator()))

    @_small
    def random_tangent_vector(self, point):
        """Unit-norm horizontal Gaussian vector (core ``geometry.random_horizontal``)."""
        x = self._t(point)
        return self._vec(self.geometry.random_horizontal(x, unit=True,
                                                         generator=self._generator()))

    @_small
    def zero_vector(self, point):
        return self._vec(self.geometry.zero_vector(self._t(point)))

    # ------------------------------------------------------------------ logarithm and distance
    @_small
    def log(self, point_a, point_b):
        """log_a(b), horizontal at ``point_a`` (core :func:`~quotient_manifolds.core.logmap.log_map`:
        closed form on the rescaling quotient with ε = 0, shooting otherwise); raises
        :class:`~quotient_manifolds.core.LogNotFound` when no geodesic is found."""
        return self._vec(log_map(self.geometry, self._t(point_a, "point_a"),
                                 self._t(point_b, "point_b")).vector)

    def pair_mean(self, point_a, point_b):
        """The midpoint of the geodesic from a to b, exp_a(½ log_a(b)) (NelderMead's centroid)."""
        return self.exp(point_a, 0.5 * self.log(point_a, point_b))

    @_small
    def dist(self, point_a, point_b) -> float:
        """‖log_a(b)‖_a (core :func:`~quotient_manifolds.core.logmap.distance`; ∞ between
        components of the rescaling quotient)."""
        return float(distance(self.geometry, self._t(point_a, "point_a"), self._t(point_b, "point_b")))
