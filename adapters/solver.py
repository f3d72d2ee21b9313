r"""Sharpness as Riemannian maximisation over a geodesic ball: a generic solver.

The solver knows manifolds and a loss closure, nothing about model families. A *ball* is a product of
components, each owning one piece of the perturbation ξ in the tangent space at the trained
weights w⁽⁰⁾ (all metrics are taken at w⁽⁰⁾, docs/maths.md §7.1):

* :class:`QuotientComponent` wraps a frame of the geometry core (GL(h) quotient, batched over heads,
  or the rescaling quotient): horizontal projection, Riemannian gradient, retraction
  w⁽⁰⁾ + ξ − ½Γ(ξ, ξ) (or first-order / exact);
* :class:`ElementwiseComponent` is the adaptive-sharpness recipe for every other weight (docs/maths.md §6.2):
  metric Σ ξ²/w², Riemannian gradient ∇⊙w², perturbation w + ξ, zero weights kept fixed.

One combined norm ‖ξ‖² = Σ_components ‖ξ_c‖² defines the ball (docs/maths.md §6.3), and
:func:`auto_pgd` maximises L(retract(w⁽⁰⁾, ξ)) − L(w⁽⁰⁾) over it (docs/maths.md §7.3).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import torch

from quotient_manifolds._runtime import bounded_threads, threads_for
from quotient_manifolds.core.gl import check_choice

Tensor = torch.Tensor
Tangent = List[Tensor]

MOMENTUM_FORMS = ("apgd", "andriushchenko", "none")
STEP_NORMALISATIONS = ("metric", "none")
#: the ascent directions of the elementwise (adaptive) weights: ``"riemannian"`` ∇⊙w² (the paper's
#: Alg. 1) or ``"andriushchenko"`` ∇⊙|w| (their code)
ADAPTIVE_DIRECTIONS: Tuple[str, ...] = ("riemannian", "andriushchenko")


# ---------------------------------------------------------------------------------- components
class BallComponent(Protocol):
    """What :class:`ProductBall` and :func:`auto_pgd` need of one component of the ball
    (:class:`QuotientComponent`, :class:`ElementwiseComponent`).

    The geometry at the fixed point: ``zeros``, ``inner``, ``project``, ``rgrad``, ``random`` and
    ``point`` (the weights at a tangent vector ξ; ``retraction`` / ``exact_steps`` override a
    quotient component's retraction, an elementwise one keeps its own; ``out`` may receive the
    point).  Then the solver protocol, which works in place on buffers owned by the run, in linear
    coordinates of the tangent space of the component's choice (the elementwise one: ξ/w):

    * ``to_coords(ξ, out)``, ``from_coords_(u) -> ξ``: tangent vector ↔ coordinates (in place);
    * ``leaf_point(u, need_grad) -> (inputs, point)``: the point for the closure and the tensors
      whose gradients give the gradient w.r.t. u;
    * ``gradient(grads, u) -> (g, ‖g‖², ⟨g, u⟩)``: the Riemannian gradient g at u, in any form
      ``combine`` understands (grads may be consumed);
    * ``combine(out, u, v, c, b, g) -> ‖out‖²``: out ← u + c·v + b·g (out may be v, never u);
    * ``scale_(u, a)``: u ← a·u.

    Scalars (‖·‖², ⟨·,·⟩, the coefficients c, b, a) are 0-d float64 tensors: the solver's only host
    sync per iteration is the loss."""

    def zeros(self) -> Tensor: ...

    def inner(self, u: Tensor, v: Tensor) -> Tensor: ...

    def project(self, u: Tensor) -> Tensor: ...

    def rgrad(self, egrad: Tensor) -> Tensor: ...

    def random(self, generator: Optional[torch.Generator]) -> Tensor: ...

    def point(self, xi: Tensor, retraction: Optional[str] = None, exact_steps: Optional[int] = None, *,
              out: Optional[Tensor] = None) -> Tensor: ...

    def to_coords(self, xi: Tensor, out: Tensor) -> None: ...

    def from_coords_(self, u: Tensor) -> Tensor: ...

    def leaf_point(self, u: Tensor, need_grad: bool) -> Tuple[List[Tensor], Tensor]: ...

    def gradient(self, grads: List[Optional[Tensor]], u: Tensor) -> Tuple[Any, Tensor, Tensor]: ...

    def combine(self, out: Tensor, u: Tensor, v: Optional[Tensor], c: Tensor, b: Tensor, g: Any) -> Tensor: ...

    def scale_(self, u: Tensor, a: Tensor) -> None: ...



class QuotientComponent:
    """One quotient-manifold piece of the ball, at the fixed point ``frame.x``.

    ``frame`` is a :class:`~quotient_manifolds.core.gl.GLFrame` (batched over heads) or a
    :class:`~quotient_manifolds.core.rescaling.RescalingFrame`. Tangent vectors are kept in ``dtype``
    (default: that of ``x0``; the sharpness engine passes the model's dtype): the frame promotes them
    to its float64 work and casts its results back, so a float32 model keeps float32 iterates while
    Gram matrices, factorisations and Γ are float64.

    ``use_metric_norm=False`` is the ablation "no corrected norm" (docs/maths.md §7.3, paper App. G): the
    block is measured with the elementwise adaptive norm Σ ξ²/w² instead of the quotient metric, and
    the ascent direction is the steepest direction of that norm, ∇⊙w², made horizontal by the
    quotient's projection (so the Γ-step and the horizontal restriction stay). Using the quotient
    metric's gradient with the elementwise norm instead would let near-zero weights (e.g. key
    biases, which get no gradient) dominate the norm and stall every step.

    The per-head linear algebra of a small component runs on one thread
    (:func:`~quotient_manifolds._runtime.threads_for`): h×h solves are far too small to pay for
    thread synchronisation.
    """

    def __init__(self, name: str, frame, x0: Tensor, *, retraction: str,
                 use_metric_norm: bool = True, dtype: Optional[torch.dtype] = None):
        self.name = name
        self.frame = frame
        self.x0 = x0
        self.dtype = dtype or x0.dtype
        self.retraction = retraction
        self.elementwise_norm = None if use_metric_norm else _inverse_square(x0)
        self.elementwise_rgrad = None if use_metric_norm else x0 * x0 * (self.elementwise_norm > 0)
        self.threads = threads_for(x0.numel())

    def zeros(self) -> Tensor:
        return torch.zeros(self.x0.shape, dtype=self.dtype, device=self.x0.device)

    def inner(self, u: Tensor, v: Tensor) -> Tensor:
        if self.elementwise_norm is not None:
            return (u * v * self.elementwise_norm).sum(dtype=torch.float64)
        with bounded_threads(self.threads):
            return self.frame.inner(u, v).sum(dtype=torch.float64)

    def project(self, u: Tensor) -> Tensor:
        with bounded_threads(self.threads):
            return self.frame.project(u)

    def rgrad(self, egrad: Tensor) -> Tensor:
        with bounded_threads(self.threads):
            if self.elementwise_rgrad is not None:
                return self.frame.project(egrad * self.elementwise_rgrad)
            return self.frame.egrad2rgrad(egrad)

    def point(self, xi: Tensor, retraction: Optional[str] = None, exact_steps: Optional[int] = None, *,
              out: Optional[Tensor] = None) -> Tensor:
        """The retraction of ξ at x0 (the component's own, or ``retraction`` to compare), written
        into ``out`` when given."""
        with bounded_threads(self.threads):
            moved = self.frame.retract(xi, retraction or self.retraction, exact_steps=exact_steps)
        return moved if out is None else out.copy_(moved)

    def random(self, generator: Optional[torch.Generator]) -> Tensor:
        u = torch.randn(self.x0.shape, dtype=self.dtype, device=self.x0.device,
                        generator=generator)
        return self.project(u)

    # solver protocol (see the comment above the class)
    def to_coords(self, xi: Tensor, out: Tensor) -> None:
        out.copy_(xi)

    def from_coords_(self, u: Tensor) -> Tensor:
        return u

    def leaf_point(self, xi: Tensor, need_grad: bool) -> Tuple[List[Tensor], Tensor]:
        leaf = xi.detach().requires_grad_(need_grad)
        return [leaf], self.point(leaf)

    def gradient(self, grads: List[Optional[Tensor]], xi: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """g = rgrad(∇); with the quotient metric ‖g‖² = ⟨∇, g⟩ and ⟨g, ξ⟩ = ⟨∇, ξ⟩ (Euclidean):
        g is the metric-orthogonal projection of the metric gradient, so g(g, v) = ⟨∇, v⟩ for every
        horizontal v (g and ξ are), and no n×h×h product is needed."""
        egrad = torch.zeros_like(xi) if grads[0] is None else grads[0]
        g = self.rgrad(egrad).to(self.dtype)
        if self.elementwise_norm is not None:
            return g, self.inner(g, g), self.inner(g, xi)
        return (g, torch.sum(egrad * g, dtype=torch.float64),
                torch.sum(egrad * xi, dtype=torch.float64))

    def combine(self, out: Tensor, xi: Tensor, u: Optional[Tensor], c: Tensor, b: Tensor,
                g: Tensor) -> Tensor:
        if u is None:
            out.copy_(xi)
        else:
            torch.addcmul(xi, u, c, out=out)
        out.addcmul_(g, b)
        return self.inner(out, out)

    def scale_(self, u: Tensor, a: Tensor) -> None:
        u.mul_(a)


#: Elements per piece of the elementwise component's loops: a reduction re-reads the piece its
#: operation just wrote from cache, and the pieces are few (each call costs tens of µs to start
#: its threads). 2**20 was fastest on MiniLM's 23M weights (2 threads; 2**17: +40 %, whole
#: tensors: +35 %).
CHUNK = 2 ** 20


class ElementwiseComponent:
    r"""Adaptive-sharpness geometry of plain weight tensors w (c = |w|; docs/maths.md §6.2, §10).

    Metric ⟨ξ, η⟩ = Σ ξη/w², Riemannian gradient ∇⊙w², point w + ξ. Entries with w = 0 (or |w| so
    small that w² underflows, or outside their ``mask``) have infinite cost and are kept fixed
    (ξ = 0 there; docs/maths.md §12.12). With ``direction="andriushchenko"`` the ascent direction is ∇⊙|w|
    (their code) instead of ∇⊙w². ``second_order=True`` adds the elementwise Christoffel term (docs/maths.md
    §12.10; default off, as the paper's App. C.1 keeps "the recipe of adaptive sharpness" for these
    weights).

    A tangent vector is ONE flat vector over all tensors given (this part holds most scalars of a
    transformer: embeddings, MLPs); :meth:`unflatten` returns differentiable views per name. The
    trained weights are read in place (no copy) and nothing of their size is stored: the solver
    works in the coordinates r = ξ/w, in which

        ‖ξ‖² = Σ ξ²/w² = ‖r‖²,   point w(1 + r),   Riemannian gradient h = ∂L/∂r = ∇⊙w
        (∇⊙|w| in ξ is ∇⊙sign(w) in r),

    all Euclidean, one pass over memory per operation, piece by piece (:data:`CHUNK`) so that a
    reduction follows its operation in cache. Entries with w = 0 are fixed by these formulas
    (h = 0 there); only tensors with other fixed entries keep a boolean mask. ``x0``, ``abs_w``
    and ``inv_w2`` are formed on demand for other callers.

    On an accelerator (``flat=None`` and a weight off the CPU, or ``flat=True``) the same passes are
    bound by kernel launches, not memory: a pass per tensor piece costs hundreds of launches per
    iteration for a transformer, each longer than its work. There the component keeps one
    contiguous copy of the weights (one parameter-sized vector more), the closure's leaf is the
    flat point alone (autograd returns one flat gradient), and every pass is one kernel.
    """

    def __init__(self, tensors: Dict[str, Tensor], *, masks: Optional[Dict[str, Tensor]] = None,
                 direction: str = "riemannian", second_order: bool = False,
                 name: str = "elementwise", flat: Optional[bool] = None):
        if not tensors:
            raise ValueError("an elementwise component needs at least one tensor")
        self.name = name
        self.names = list(tensors)
        self.shapes = [tensors[n].shape for n in self.names]
        self.sizes = [tensors[n].numel() for n in self.names]
        self.weights = [tensors[n].detach().reshape(-1) for n in self.names]  # views, no copy
        self.dtype, self.device = self.weights[0].dtype, self.weights[0].device
        self.numel = sum(self.sizes)
        self.direction = check_choice(direction, ADAPTIVE_DIRECTIONS,
                                      "adaptive direction")
        self.second_order = second_order
        tiny = torch.finfo(self.dtype).tiny
        self.fixed: List[Optional[Tensor]] = []
        for n, w in zip(self.names, self.weights):
            # w = 0 is fixed by the formulas themselves (∇⊙w = 0 there); what else is fixed
            # (w² ≤ tiny: 1/w² would overflow; outside the mask) needs the mask
            mask = None if not masks or masks.get(n) is None else masks[n].reshape(-1)
            fixed = torch.cat([(p * p <= tiny) & (p != 0) for p in w.split(CHUNK)])
            if mask is not None:
                fixed |= ~mask.to(w.device)
            self.fixed.append(fixed if bool(fixed.any()) else None)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.flat = self.device.type != "cpu" if flat is None else bool(flat)
        if self.flat:  # one piece over a contiguous copy (see the class docstring)
            self._piece_weights = [self._flat_from(self.weights)]
            self._piece_fixed = [None if all(f is None for f in self.fixed) else self._flat_from(
                [torch.zeros(w.shape, dtype=torch.bool, device=w.device) if f is None else f
                 for w, f in zip(self.weights, self.fixed)])]
            self._pieces = [(0, 0, self.numel, 0)]
        else:  # (tensor index, start, stop, offset in the flat vector) of every piece
            self._piece_weights, self._piece_fixed = self.weights, self.fixed
            self._pieces = [(i, a, min(a + CHUNK, size), offset + a)
                            for i, (size, offset) in enumerate(zip(self.sizes, self.offsets))
                            for a in range(0, size, CHUNK)]
        self._point: Optional[Tensor] = None
        self._live: Optional[Tuple[Tensor, List[Tensor]]] = None

    # -- pieces
    def _over(self, *vectors):
        """(w, fixed, *pieces of ``vectors``) per piece; a vector is flat or a list per tensor
        (with ``flat``, a list of the one flat vector)."""
        for i, a, b, s in self._pieces:
            fixed = self._piece_fixed[i]
            yield (self._piece_weights[i][a:b], None if fixed is None else fixed[a:b],
                   *(v[i][a:b] if isinstance(v, list) else v[s:s + b - a] for v in vectors))

    @staticmethod
    def _relative(u: Tensor, w: Tensor, fixed: Optional[Tensor]) -> Tensor:
        """u/w, with 0 on fixed entries (where 0/0 or u/tiny would appear)."""
        t = torch.div(u, w).nan_to_num_(0.0, 0.0, 0.0)
        return t if fixed is None else t.masked_fill_(fixed, 0.0)

    def _flat_from(self, parts: Sequence[Tensor]) -> Tensor:
        return torch.cat([p.reshape(-1) for p in parts])

    # -- geometry
    @property
    def x0(self) -> Tensor:
        """The trained weights as one flat vector (a copy, formed on demand)."""
        return self._flat_from(self.weights)

    @property
    def abs_w(self) -> Tensor:
        """c = |w|, 0 on fixed entries (formed on demand)."""
        return self._flat_from([w.abs().masked_fill_(f, 0) if f is not None else w.abs()
                                for w, f in zip(self.weights, self.fixed)])

    @property
    def inv_w2(self) -> Tensor:
        """1/w², 0 on fixed entries (formed on demand)."""
        return self._flat_from([_inverse_square(w).masked_fill_(f, 0) if f is not None else
                                _inverse_square(w) for w, f in zip(self.weights, self.fixed)])

    def unflatten(self, flat: Tensor) -> Dict[str, Tensor]:
        if self._live is not None and flat is self._live[0]:
            return dict(zip(self.names, self._live[1]))  # per-tensor leaves: see leaf_point
        return {n: t.view(shape) for n, t, shape in
                zip(self.names, torch.split(flat, self.sizes), self.shapes)}

    def zeros(self) -> Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def inner(self, u: Tensor, v: Tensor) -> Tensor:
        out = torch.zeros((), dtype=torch.float64, device=self.device)
        for w, fixed, a, b in self._over(u, v):
            ta = self._relative(a, w, fixed)
            out += torch.dot(ta, ta if u is v else self._relative(b, w, fixed))
        return out

    def sq_norm_on(self, u: Tensor, masks: Mapping[str, Tensor]) -> float:
        """The part of ‖u‖² = Σ u²/w² on the entries that ``masks`` marks (parameter name → boolean
        tensor of the parameter's shape; names not given count nothing)."""
        flat_u = u if isinstance(u, Tensor) else self._flat_from(u)
        total = 0.0
        for name, w, fixed, offset, size in zip(self.names, self.weights, self.fixed, self.offsets,
                                                 self.sizes):
            mask = masks.get(name)
            if mask is None:
                continue
            mask = mask.reshape(-1)
            for a in range(0, size, CHUNK):
                b = min(a + CHUNK, size)
                t = self._relative(flat_u[offset + a:offset + b], w[a:b],
                                   None if fixed is None else fixed[a:b])
                total += float(torch.dot(t, t * mask[a:b].to(device=t.device, dtype=t.dtype)))
        return total

    def project(self, u: Tensor) -> Tensor:
        # Every vector the solver forms is a combination of gradients ∇⊙w², already 0 where w is
        # fixed; random directions are masked in :meth:`random`. Nothing to project.
        return u

    def _direction_(self, g: Tensor, w: Tensor, fixed: Optional[Tensor]) -> Tensor:
        """h = ∇⊙w (or ∇⊙sign(w)) in place, 0 on fixed entries: the Riemannian gradient in r
        (in ξ it is h⊙w)."""
        g.mul_(w if self.direction == "riemannian" else w.sign())
        return g if fixed is None else g.masked_fill_(fixed, 0.0)

    def rgrad(self, egrad: Tensor) -> Tensor:
        """∇⊙w² (or ∇⊙|w|); in place when ``egrad`` is a plain contiguous tensor (it is consumed)."""
        g = egrad if egrad.is_contiguous() else egrad.contiguous()
        for w, fixed, piece in self._over(g):
            self._direction_(piece, w, fixed).mul_(w)
        return g

    def point(self, xi: Tensor, retraction: Optional[str] = None, exact_steps: Optional[int] = None, *,
              out: Optional[Tensor] = None) -> Tensor:
        """w + ξ (``retraction`` and ``exact_steps`` concern the quotient components: this one keeps
        its own, :class:`BallComponent`), or with ``second_order`` the second-order geodesic of the elementwise metric
        Σ ξ²/w², w + ξ − ½Γ(ξ, ξ) = w + ξ + ξ²/(2w) (Γ^w_ww = −1/w; docs/maths.md §10, §12.10).
        Differentiable in ξ; ``out`` (may be ``xi`` itself) receives the point without a
        full-size temporary. The solver fills a reused buffer instead (:meth:`leaf_point`)."""
        parts = []
        for w, fixed, x, *dest in self._over(xi, *(() if out is None else (out,))):
            if self.second_order:  # x = 0 on fixed entries; 1 there keeps the derivative finite
                safe = torch.where((w == 0) if fixed is None else (w == 0) | fixed, 1.0, w)
                moved = w + x + 0.5 * x * x / safe
            else:
                moved = w + x
            if dest:
                dest[0].copy_(moved)
            else:
                parts.append(moved)
        return out if out is not None else torch.cat(parts)

    def random(self, generator: Optional[torch.Generator]) -> Tensor:
        u = torch.randn(self.numel, dtype=self.dtype, device=self.device, generator=generator)
        return u.mul_(self.abs_w)

    # -- solver protocol (see the comment above QuotientComponent), in the coordinates r = ξ/w:
    # there the metric Σ ξ²/w² = ‖r‖² is Euclidean, so no step of the solver divides or masks
    def to_coords(self, xi: Tensor, out: Tensor) -> None:
        for w, fixed, x, r in self._over(xi, out):
            r.copy_(self._relative(x, w, fixed))

    def from_coords_(self, r: Tensor) -> Tensor:
        for w, _, piece in self._over(r):
            piece.mul_(w)
        return r

    def leaf_point(self, r: Tensor, need_grad: bool) -> Tuple[List[Tensor], Tensor]:
        """w(1 + r) (second order: w(1 + r + r²/2)) written into a buffer kept across iterations;
        the closure gets it as one flat leaf, and :meth:`unflatten` of that leaf returns
        per-tensor leaves (views of the buffer), so autograd returns per-tensor gradients:
        splitting a flat leaf would make it concatenate them into a fresh full-size vector, which
        costs more than a pass over it."""
        if self._point is None:
            self._point = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for w, _, x, p in self._over(r, self._point):
                if self.second_order:
                    torch.addcmul(x, x, x, value=0.5, out=p).add_(1.0).mul_(w)
                else:
                    torch.addcmul(w, w, x, out=p)
        flat = self._point.detach().requires_grad_(need_grad)
        if self.flat:  # unflatten's views of the one leaf: autograd returns one flat gradient
            self._live = None
            return [flat], flat
        parts = [t.view(shape).detach().requires_grad_(need_grad) for t, shape in
                 zip(torch.split(self._point, self.sizes), self.shapes)]
        self._live = (flat, parts)
        return [flat, *parts], flat

    def gradient(self, grads: List[Optional[Tensor]], r: Tensor
                 ) -> Tuple[List[Tensor], Tensor, Tensor]:
        """The Riemannian gradient in r: h = ∂L/∂r = ∇⊙w (second order: ∇⊙w⊙(1 + r)), or
        ∇⊙sign(w) (⊙(1 + r)) for "andriushchenko" (∇⊙|w| in ξ); ‖h‖², ⟨h, r⟩. The Euclidean
        gradients are consumed where autograd returned tensors of their own."""
        flat, parts = grads[0], grads[1:]
        if self.flat:  # the one flat leaf (leaf_point): its gradient is already one vector
            h = [self.zeros() if flat is None else flat.contiguous()]
        else:
            h = self._tensor_gradients(flat, parts)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        dot = torch.zeros((), dtype=torch.float64, device=self.device)
        for w, fixed, x, g in self._over(r, h):
            if self.second_order:
                g.addcmul_(g, x)  # ∂/∂r w(1 + r + r²/2) = w(1 + r)
            self._direction_(g, w, fixed)
            sq += torch.dot(g, g)
            dot += torch.dot(g, x)
        return h, sq, dot

    def _tensor_gradients(self, flat: Optional[Tensor], parts: Sequence[Optional[Tensor]]
                          ) -> List[Tensor]:
        """One contiguous gradient per tensor, owned by the caller: the per-tensor leaves' plus the
        flat leaf's piece (a closure may use either), zero where autograd returned None."""
        h, seen = [], set()
        for i, (g, size) in enumerate(zip(parts, self.sizes)):
            g = None if g is None else g.reshape(-1)
            if flat is not None:
                piece = flat[self.offsets[i]:self.offsets[i] + size]
                g = piece.clone() if g is None else g + piece
            elif g is None:
                g = torch.zeros(size, dtype=self.dtype, device=self.device)
            elif not g.is_contiguous() or g.untyped_storage().data_ptr() in seen:
                g = g.contiguous().clone()  # expanded, or shared with another gradient
            seen.add(g.untyped_storage().data_ptr())
            h.append(g)
        return h

    def combine(self, out: Tensor, r: Tensor, u: Optional[Tensor], c: Tensor, b: Tensor,
                h: List[Tensor]) -> Tensor:
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for _, _, o, x, g, v in self._over(out, r, h, r if u is None else u):
            if u is None:
                o.copy_(x)
            else:
                torch.addcmul(x, v, c, out=o)
            o.addcmul_(g, b)
            sq += torch.dot(o, o)
        return sq

    def scale_(self, u: Tensor, a: Tensor) -> None:
        u.mul_(a)


def _inverse_square(w: Tensor) -> Tensor:
    """1/w² where that is finite, else 0 (such weights are kept fixed)."""
    w2 = w * w
    ok = w2 > torch.finfo(w.dtype).tiny
    return torch.where(ok, 1 / torch.where(ok, w2, torch.ones_like(w2)), torch.zeros_like(w2))


class ProductBall:
    """The product of components with one combined norm ‖ξ‖² = Σ_c ‖ξ_c‖² (docs/maths.md §6.3)."""

    def __init__(self, components: Sequence):
        if not components:
            raise ValueError("a ball needs at least one component")
        self.components = list(components)

    def zeros(self) -> Tangent:
        return [c.zeros() for c in self.components]

    def inner(self, u: Tangent, v: Tangent) -> Tensor:
        return sum(c.inner(a, b) for c, a, b in zip(self.components, u, v))

    def norm(self, u: Tangent) -> Tensor:
        return self.inner(u, u).clamp_min(0).sqrt()

    def quotient_share(self, u: Tangent) -> float:
        """Share of ‖u‖² in the quotient (GL) components: Σ_{c quotient} ‖u_c‖² / Σ_c ‖u_c‖², each
        in its own metric (the rest is the elementwise components); nan for u = 0."""
        return self.share_on(u, {})

    def share_on(self, u: Tangent, covered: Mapping[str, Tensor]) -> float:
        """Share of ‖u‖² on the quotient components and on the elementwise entries that ``covered``
        marks (parameter name → boolean tensor of its shape), each in its own metric; nan for
        u = 0. With ``covered`` the weights of a layout's GL blocks, it says how much of an
        adaptive perturbation lies on the attention weights that the geodesic geometries move
        along the quotient, comparably across geometries."""
        parts = [float(c.inner(a, a)) for c, a in zip(self.components, u)]
        total = sum(parts)
        on = sum(v if isinstance(c, QuotientComponent) else
                 (c.sq_norm_on(a, covered) if covered and isinstance(c, ElementwiseComponent) else 0.0)
                 for c, a, v in zip(self.components, u, parts))
        return on / total if total > 0 else float("nan")

    def project(self, u: Tangent) -> Tangent:
        return [c.project(a) for c, a in zip(self.components, u)]

    def rgrad(self, egrads: Tangent) -> Tangent:
        return [c.rgrad(g) for c, g in zip(self.components, egrads)]

    def points(self, xi: Tangent, retraction: Optional[str] = None,
               exact_steps: Optional[int] = None, *, consume: bool = False) -> List[Tensor]:
        """Ball points → weights; ``retraction`` (and ``exact_steps``) override the quotient
        components' retraction (e.g. ``"exact"`` to check a second-order step). ``consume=True``
        writes the elementwise points into ``xi`` itself (no full-size copy; ``xi`` is lost)."""
        return [c.point(a, retraction, exact_steps, out=a if consume and isinstance(c, ElementwiseComponent) else None)
                for c, a in zip(self.components, xi)]

    @property
    def has_quotients(self) -> bool:
        return any(isinstance(c, QuotientComponent) for c in self.components)

    def random(self, generator: Optional[torch.Generator] = None) -> Tangent:
        return [c.random(generator) for c in self.components]

    def project_ball(self, xi: Tangent, rho: float, *, horizontal: bool = False,
                     inplace: bool = False) -> Tangent:
        """P_S: horizontal projection, then radial scaling into ‖ξ‖ ≤ ρ (exact, docs/maths.md §3.2).

        ``horizontal=True`` skips the projection for vectors that are horizontal by construction
        (linear combinations of horizontal vectors); ``inplace=True`` rescales ``xi`` itself."""
        if not horizontal:
            xi = self.project(xi)
        # a float64 tensor ρ makes ρ/‖ξ‖ a true division (a Python ρ would multiply by 1/‖ξ‖)
        nrm = self.norm(xi).double()
        factor = float(ball_factor(nrm, nrm.new_tensor(float(rho))))
        if factor == 1:
            return xi
        if inplace:
            torch._foreach_mul_(xi, factor)
            return xi
        return scale(xi, factor)


def ball_factor(norm: Union[Tensor, np.ndarray], rho: Union[float, Tensor, np.ndarray],
                a: Union[float, Tensor] = 1.0) -> Union[Tensor, np.ndarray]:
    r"""The radial scaling of P_S onto the ball ‖ξ‖ ≤ ρ (docs/maths.md §3.2): for a horizontal y of
    norm ``norm``, P_S(a·y) = f·y with

        f = ρ/‖y‖ where a‖y‖ > ρ,   f = a otherwise (a = 1: f = min(1, ρ/‖y‖), 1 at y = 0).

    Elementwise over tensors (0-d scalars stay on their device: no host sync) or numpy arrays, e.g.
    the row norms of a batch of points with their radii; a numpy ``norm`` gives a numpy answer."""
    if isinstance(norm, np.ndarray):
        rho = torch.from_numpy(rho) if isinstance(rho, np.ndarray) else rho
        return ball_factor(torch.from_numpy(norm), rho, a).numpy()
    return torch.where(a * norm > rho, rho / norm, a)


def scale(x: Tangent, a: float) -> Tangent:
    return torch._foreach_mul(x, a)


# ---------------------------------------------------------------------------------- Auto-PGD
def apgd_checkpoints(n_iters: int) -> List[int]:
    """Checkpoints of Andriushchenko et al. / Croce & Hein (docs/maths.md §7.2): p₀ = 0, p₁ = 0.22,
    p_{j+1} = p_j + max(p_j − p_{j−1} − 0.03, 0.06), w_j = ⌈p_j N⌉; first entry dropped.
    For N = 20: [5, 9, 12, 15, 16, 18, 19, 20]."""
    p = [0.0, 0.22]
    while True:
        nxt = p[-1] + max(p[-1] - p[-2] - 0.03, 0.06)
        if nxt > 1:
            break
        p.append(nxt)
    out = []
    for pj in p:
        w = math.ceil(pj * n_iters)
        if out and w <= out[-1]:
            continue
        out.append(w)
        if w >= n_iters:
            break
    return out[1:]


@dataclass
class APGDResult:
    init_loss: float
    worst_loss: float
    xi: Tangent
    norm: float
    n_forward: int
    n_backward: int
    history: List[float] = field(default_factory=list)
    step_sizes: List[float] = field(default_factory=list)

    @property
    def sharpness(self) -> float:
        return self.worst_loss - self.init_loss


@dataclass
class _Gradient:
    """The Riemannian gradient g at an iterate ξ: per component in the form its ``combine`` takes,
    with ‖g‖² and ⟨g, ξ⟩."""

    parts: list
    sq: Tensor
    dot: Tensor


def _evaluate(comps: Sequence, closure: Callable[[List[Tensor]], Tensor], xi: Tangent,
              need_grad: bool, xi_sq: Tensor) -> Tuple[float, Optional[_Gradient]]:
    """ℓ at the point of ξ and, with ``need_grad``, the Riemannian gradient there (one forward,
    one backward); a finite loss with a non-finite gradient is refused."""
    inputs, points = zip(*(c.leaf_point(x, need_grad) for c, x in zip(comps, xi)))
    with torch.enable_grad() if need_grad else torch.no_grad():
        loss = closure(list(points))
    del points  # a retraction's point (float64 for GL blocks) is not needed by the backward
    value = finite_loss(loss, math.sqrt(float(xi_sq)))
    if not need_grad:
        return value, None
    flat = [t for ts in inputs for t in ts]
    grads = list(torch.autograd.grad(loss, flat, allow_unused=True))
    del loss, flat
    finite = [torch.isfinite(g).all() for g in grads if g is not None]
    if finite and not bool(torch.stack(finite).all()):  # one host sync, not one per tensor
        # a finite loss with a non-finite gradient is a kink of the model or loss (sqrt or log at
        # 0, a norm of a zero vector), not a step that went too far
        raise FloatingPointError(
            f"the loss is finite ({value}) but its gradient is not (nan or inf) at a perturbation "
            f"of norm {math.sqrt(float(xi_sq)):.3g}: the model or loss_fn is not differentiable "
            f"there (e.g. sqrt or log at 0, the norm of a zero vector); make it differentiable, "
            f"e.g. add a small epsilon inside sqrt/log")
    parts, at = [], 0
    for c, x, ts in zip(comps, xi, inputs):
        parts.append(c.gradient(grads[at:at + len(ts)], x))
        at += len(ts)
    del grads
    return value, _Gradient([p[0] for p in parts], sum(p[1] for p in parts),
                            sum(p[2] for p in parts))


def _step_coefficients(momentum: str, first: bool, alpha: float, c: Tensor, s: Tensor):
    """(A, C, B, project) of ξ⁺ = A ξ + C ξ⁻ + B g for the momentum form (see :func:`auto_pgd`)."""
    if momentum == "none" or first:
        return c, 0.0, c * s, False
    if momentum == "apgd":
        return alpha * c + 2 * (1 - alpha), alpha - 1, alpha * c * s, True
    return 0.75 * c, 0.25, 0.75 * c * s, False


def auto_pgd(ball: ProductBall, closure: Callable[[List[Tensor]], Tensor], rho: float, *,
             n_iters: int = 20, step_size_mult: float = 1.0, alpha: float = 0.75,
             momentum: str = "apgd", step_normalisation: str = "metric",
             min_update_ratio: float = 0.75, decay: float = 0.5,
             on_iteration: Optional[Callable[[int, float], None]] = None,
             start: Optional[Tuple[Tangent, float]] = None) -> APGDResult:
    r"""Maximise ``closure(ball.points(ξ))`` over horizontal ξ with ‖ξ‖ ≤ ρ (docs/maths.md §7.1, §7.3).

    Iterations k = 0..N−1 each cost exactly one forward and one backward: the pass at ξ_k gives both
    ℓ(ξ_k) (checked against the worst loss so far) and the gradient for the next step; the final
    iterate gets one extra forward. Per step: g = P_h(grad_g ℓ) (Riemannian gradient of ξ ↦ ℓ(R(ξ))
    in the metric at w⁽⁰⁾, autograd through the retraction, docs/maths.md §12.5), normalised by its norm
    (``step_normalisation="metric"``, docs/maths.md §12.6), z = P_S(ξ + η g), and the momentum step
    ``"apgd"`` ξ⁺ = P_S(ξ + α(z−ξ) + (1−α)(ξ−ξ⁻)) (α = 1 at k = 0; Croce & Hein, paper Alg. 1),
    ``"andriushchenko"`` ξ⁺ = 0.75 z + 0.25 ξ⁻ (their code, docs/maths.md §7.2), or ``"none"`` ξ⁺ = z.
    At the checkpoints of :func:`apgd_checkpoints`, if fewer than 75 % of the steps since the last
    checkpoint improved the worst loss, or neither η nor the worst loss changed, η is halved and
    the iterate restarts from the worst point (whose gradient was kept, so no extra pass).
    The initial step is η₀ = 2ρ·step_size_mult. ``on_iteration(k, loss)`` is called after each
    iteration k = 0..N−1 with ℓ(ξ_{k+1}) (e.g. to advance a progress bar).

    ``start=(ξ₀, ℓ(0))`` warm-starts from ξ₀ (‖ξ₀‖ ≤ ρ, e.g. the worst point of a smaller ball on
    the same batch, whose unperturbed loss ℓ(0) is passed along instead of recomputed): the
    iterates begin at ξ₀ and the worst loss found is at least ℓ(ξ₀), so a sweep over increasing ρ
    that chains its runs never returns a smaller maximum for a larger ball.

    Every step is one linear combination ξ⁺ = A ξ + C ξ⁻ + B g followed by a radial scaling, formed
    in place (``combine`` of the components): with ‖ξ‖², ‖g‖² and ⟨g, ξ⟩ known,
    ‖ξ + s g‖² = ‖ξ‖² + 2s⟨g, ξ⟩ + s²‖g‖² gives the scaling c of z = c(ξ + s g) without forming z, and

        none (and k = 0):  A = c,              C = 0,       B = c s
        apgd:              A = αc + 2(1 − α),  C = α − 1,   B = α c s,   then P_S
        andriushchenko:    A = 0.75 c,         C = 0.25,    B = 0.75 c s.

    Three iterate buffers serve ξ, ξ⁻ and the worst point (roles change, values are not copied).
    Beyond the model's own forward and backward a run holds these three, the worst point's
    gradient and the elementwise point buffer: five parameter-sized vectors. Keeping the gradient
    saves a forward and backward at each restart from an older worst point (3 to 6 restarts in 20
    iterations on MiniLM).
    """
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho!r}")
    if not isinstance(n_iters, int) or n_iters < 1:
        raise ValueError(f"n_iters must be a positive integer, got {n_iters!r}")
    check_choice(momentum, MOMENTUM_FORMS, "momentum form")
    check_choice(step_normalisation, STEP_NORMALISATIONS, "step normalisation")
    checkpoints = set(apgd_checkpoints(n_iters))
    comps = ball.components

    pool = [ball.zeros() for _ in range(3)]
    eta = 2 * rho * step_size_mult
    if start is None:
        xi = pool[0]
        xi_sq = torch.zeros((), dtype=torch.float64, device=xi[0].device)
        loss0, grad = _evaluate(comps, closure, xi, True, xi_sq)
        worst = loss0
    else:
        given, loss0 = start
        xi_sq = ball.inner(given, given)
        if math.sqrt(max(float(xi_sq), 0.0)) > rho * (1 + 1e-6):
            raise ValueError(f"the warm start has norm {math.sqrt(float(xi_sq)):.4g} > rho = "
                             f"{rho:.4g}: start from a point of a smaller ball")
        xi = pool[0]
        for comp, buf, t in zip(comps, xi, given):
            comp.to_coords(t, buf)
        worst, grad = _evaluate(comps, closure, xi, True, xi_sq)
    xi_prev = xi
    n_fwd, n_bwd = 1, 1
    xi_worst, worst_sq, grad_worst = xi, xi_sq, grad
    history, steps = [worst], [eta]
    n_updates, last_ckpt, ckpt_eta, ckpt_worst = 0, 0, eta, worst
    for k in range(n_iters):
        if k in checkpoints:
            stalled = n_updates < min_update_ratio * (k - last_ckpt)
            frozen = ckpt_eta == eta and ckpt_worst == worst
            ckpt_eta, ckpt_worst = eta, worst
            if stalled or frozen:
                eta *= decay
                xi, xi_prev, grad, xi_sq = xi_worst, xi_worst, grad_worst, worst_sq
            n_updates, last_ckpt = 0, k
        # scalars stay 0-d tensors (no host sync): the step s, z = P_S(ξ + s g) = c(ξ + s g)
        s = (torch.where(grad.sq > 0, eta / grad.sq.sqrt(), 0.0)
             if step_normalisation == "metric" else torch.full_like(grad.sq, eta))
        z_sq = (xi_sq + 2 * s * grad.dot + s * s * grad.sq).clamp_min(0)
        c = ball_factor(z_sq.sqrt(), rho)
        A, C, B, project = _step_coefficients(momentum, k == 0, alpha, c, s)
        # ξ⁺ = A·y with y = ξ + (C/A) ξ⁻ + (B/A) g, written over ξ⁻ unless ξ⁻ is ξ or the worst
        out = xi_prev if all(xi_prev is not t for t in (xi, xi_worst)) else next(
            b for b in pool if b is not xi and b is not xi_worst)
        y_sq = sum(comp.combine(o, x, None if C == 0 else u, C / A, B / A, g) for
                   comp, o, x, u, g in zip(comps, out, xi, xi_prev, grad.parts))
        factor = ball_factor(y_sq.sqrt(), rho, A) if project else A
        for comp, o in zip(comps, out):
            comp.scale_(o, factor)
        grad = None  # only the worst point's gradient outlives its step
        xi_prev, xi, xi_sq = xi, out, factor * factor * y_sq
        last = k == n_iters - 1
        loss, grad = _evaluate(comps, closure, xi, not last, xi_sq)
        n_fwd += 1
        n_bwd += 0 if last else 1
        history.append(loss)
        steps.append(eta)
        if loss > worst:
            worst, xi_worst, worst_sq, grad_worst = loss, xi, xi_sq, grad
            n_updates += 1
        if on_iteration is not None:
            on_iteration(k, loss)
    xi_worst = [comp.from_coords_(u) for comp, u in zip(comps, xi_worst)]
    return APGDResult(loss0, worst, xi_worst, float(ball.norm(xi_worst)), n_fwd, n_bwd, history,
                      steps)


def finite_loss(loss: Tensor, perturbation_norm: float) -> float:
    """The loss as a float, refused (``FloatingPointError``, with where and what to do) when it is
    nan or inf: a mean or a maximum over such values would be a silent wrong number."""
    value = float(loss.detach())
    if not math.isfinite(value):
        where = ("at the unperturbed weights: check the model, its inputs and targets"
                 if perturbation_norm == 0 else f"at a perturbation of norm {perturbation_norm:.3g}: "
                 f"reduce rho")
        raise FloatingPointError(f"the loss is not finite ({value}) {where}")
    return value


@dataclass
class AverageCaseResult:
    """Outcome of :func:`average_case`: the loss at the centre, the loss at each random point of the
    sphere ‖ξ‖ = ρ, and their mean. ``sharpness`` = ``mean_loss`` − ``init_loss``.

    ``result["init_loss"]`` (the dict of version 0.1.0) still reads a field, with a
    DeprecationWarning: use the attribute."""

    init_loss: float
    mean_loss: float
    losses: List[float] = field(default_factory=list)

    @property
    def sharpness(self) -> float:
        return self.mean_loss - self.init_loss

    def __getitem__(self, key: str) -> Union[float, List[float]]:
        if key not in ("init_loss", "mean_loss", "losses"):
            raise KeyError(key)
        warnings.warn(f"average_case returns an AverageCaseResult: read result.{key} instead of "
                      f"result[{key!r}]", DeprecationWarning, stacklevel=2)
        return getattr(self, key)


def average_case(ball: ProductBall, closure: Callable[[List[Tensor]], Tensor], rho: float, *,
                 n_samples: int = 10, generator: Optional[torch.Generator] = None,
                 on_iteration: Optional[Callable[[int, float], None]] = None
                 ) -> AverageCaseResult:
    """E_ξ[L(R(ξ))] − L(w⁰) over random horizontal ξ on the sphere ‖ξ‖ = ρ (forward passes only).

    Directions are Gaussian in the metric's natural scaling (projected horizontally), rescaled to
    norm ρ; ``generator`` makes the draw deterministic. ``on_iteration(k, loss)`` is called after
    each sample k."""
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho!r}")
    with torch.no_grad():
        loss0 = finite_loss(closure(ball.points(ball.zeros())), 0.0)
        losses = []
        for k in range(n_samples):
            u = ball.random(generator)
            u = scale(u, rho / float(ball.norm(u)))
            losses.append(finite_loss(closure(ball.points(u)), rho))
            if on_iteration is not None:
                on_iteration(k, losses[-1])
    return AverageCaseResult(loss0, sum(losses) / len(losses), losses)
