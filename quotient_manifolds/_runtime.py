r"""Runtime helpers shared by the faces and the sharpness solver: a thread bound for small linear
algebra, a cache of frames keyed on the point's contents, and the check that an optimiser's step
stayed on the manifold (:class:`StepTooLarge`).

Threads. With torch's OpenMP runtime (libgomp), every parallel region waits for all its threads at
a barrier, and idle workers spin before sleeping. When another process holds a core, a region waits
for a descheduled thread, up to a scheduler time slice (milliseconds) per region, while the work on
small tensors takes microseconds: a 4×60 ``cholesky_solve`` went from 56 µs on one thread to 1.8 ms
on two with one of two cores busy elsewhere. :func:`bounded_threads` runs such work on one thread and
restores ``torch.get_num_threads()`` afterwards (the setting is process-wide).
"""

from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from .errors import InvalidArgument
from ._validation import all_finite
from .core.errors import GeodesicLeftManifold, StepTooLarge
from .core.metrics import GLMetric

Tensor = torch.Tensor

#: Tensors with at most this many elements are "small": their linear algebra runs on one thread.
SMALL_NUMEL = 2 ** 18


@contextmanager
def bounded_threads(limit: Optional[int]) -> Iterator[None]:
    """Run the body on at most ``limit`` intra-op threads (``None``: unchanged); the previous
    ``torch.get_num_threads()`` is restored afterwards, also on an exception."""
    previous = torch.get_num_threads()
    if limit is None or limit >= previous:
        yield
        return
    torch.set_num_threads(max(1, int(limit)))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def threads_for(numel: int) -> Optional[int]:
    """The thread bound for work on ``numel`` elements: 1 if small (≤ :data:`SMALL_NUMEL`), else
    ``None`` (torch's setting)."""
    return 1 if numel <= SMALL_NUMEL else None


def small_work(size_of: Callable[[Any], int]) -> Callable:
    """Decorator for a method ``f(self, point, ...)``: run it under :func:`bounded_threads` with the
    bound :func:`threads_for` ``(size_of(point))``."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(self, point, *args, **kwargs):
            try:
                size = size_of(point)
            except (AttributeError, TypeError, ValueError):
                size = 0   # not a point: the method's own checks say so, naming the argument
            with bounded_threads(threads_for(size)):
                return method(self, point, *args, **kwargs)
        return wrapper

    return decorate


class FrameCache:
    """The last ``size`` core frames of one geometry, looked up by the point's contents.

    A frame costs Gram matrices, a Cholesky factorisation and host syncs; an optimizer step asks for
    several at the same point (geoopt's RiemannianAdam: ``egrad2rgrad``, ``component_inner``,
    ``retr`` at x, ``transp`` at the new point y, which is the next step's x). A hit needs a point
    of equal shape, dtype and device and equal values (``torch.equal`` against a snapshot), so a point
    modified in place, even through ``x.data`` (which does not bump ``x._version``), misses. The
    frame is built on the snapshot, so later writes to the caller's tensor cannot reach it. Points
    that need autograd (``requires_grad`` with grad mode on) bypass the cache: a frame holding a
    graph must not outlive its backward pass.
    """

    def __init__(self, size: int = 2):
        self.size = size
        # (geometry, snapshot, frame), newest first
        self._entries: List[Tuple[Any, Tensor, Any]] = []

    def clear(self) -> None:
        self._entries.clear()

    def frame(self, geometry, x: Tensor, name: str = "x"):
        """``geometry.frame(x)``, reused when a cached frame was built at an equal point; a point the
        core refuses raises its ValueError, naming the argument ``name``."""
        try:
            return self._frame(geometry, x)
        except ValueError as err:
            if re.search(rf"\b{re.escape(name)}\b", str(err)):
                raise
            raise InvalidArgument(f"{name}: {err}") from None

    def _frame(self, geometry, x: Tensor, *, new: bool = False):
        if self.size < 1 or (x.requires_grad and torch.is_grad_enabled()):
            return geometry.frame(x)
        for i, (geom, snap, frame) in enumerate(() if new else self._entries):
            if (geom is geometry and snap.shape == x.shape and snap.dtype == x.dtype
                    and snap.device == x.device and torch.equal(snap, x)):
                self._entries.insert(0, self._entries.pop(i))
                return frame
        snap = x.detach().clone()
        frame = geometry.frame(snap)  # validates; a failure caches nothing
        self._entries.insert(0, (geometry, snap, frame))
        del self._entries[self.size:]
        return frame

    def frame_after_step(self, geometry, y: Tensor):
        """The frame at ``y``, a point a retraction just reached (cached: the next step starts
        there, so the validation costs nothing extra). A ``y`` off the manifold (non-finite, or a
        factor that lost rank) raises :class:`StepTooLarge` with what to do."""
        try:
            return self._frame(geometry, y, new=True)   # just computed: no earlier frame has it
        except ValueError as err:
            raise StepTooLarge(step_too_large_message(geometry, err)) from err


def step_too_large_message(geometry, err: Exception) -> str:
    """What :class:`StepTooLarge` says: the reason, and how to take smaller steps per metric.

    Why the metrics differ: the Riemannian gradient of the inv metric is the Euclidean one times
    the Gram matrices (∇_G GᵀG, ∇_H HᵀH), so its size grows like ‖G‖²‖H‖² for a loss of G Hᵀ; the
    mix metric divides by them instead (∇_G (HᵀH)⁻¹, ∇_H (GᵀG)⁻¹), a step that does not grow with
    the scale of the factors (docs/maths.md §4)."""
    reason = str(err).split(":")[0]
    return (f"step too large: the retraction left the manifold (at the new point, {reason}). "
            f"{_smaller_steps(geometry)}.")


@contextmanager
def step_advice(geometry, more: str = "") -> Iterator[None]:
    """Run a move (a retraction, the exact geodesic); a :class:`GeodesicLeftManifold` it raises
    comes out as one of the same type saying what to change (:func:`_smaller_steps`, then
    ``more``)."""
    try:
        yield
    except GeodesicLeftManifold as err:
        raise GeodesicLeftManifold(f"step too large: {err}. {_smaller_steps(geometry)}."
                                   + (f" {more}" if more else "")) from None


def finite_step(geometry, name: str, step: Tensor) -> Tensor:
    """``step`` (the tangent vector a retraction moves along), refused with :class:`StepTooLarge`
    if it holds a NaN or an infinity: the new point would be off the manifold."""
    try:
        all_finite(name, step)
    except ValueError as err:
        raise StepTooLarge(f"step too large: {err}; no retraction along it stays on the manifold. "
                           f"{_smaller_steps(geometry)}.") from None
    return step


def _smaller_steps(geometry) -> str:
    """How to take smaller steps under ``geometry``'s metric (its ``step_advice``)."""
    metric = getattr(geometry, "gl_metric", None) or GLMetric()
    return "Reduce the optimiser's learning rate" + metric.step_advice
