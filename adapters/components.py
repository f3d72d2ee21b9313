r"""The components of the perturbation ball and their product (the solver's manifolds).

A *ball* is a product of components, each owning one piece of the perturbation ξ in the tangent
space at the trained weights w⁽⁰⁾ (all metrics are taken at w⁽⁰⁾, docs/maths.md §7.1):

* :class:`QuotientComponent` wraps a frame of the geometry core (GL(h) quotient, batched over heads,
  or the rescaling quotient): horizontal projection, Riemannian gradient, retraction
  w⁽⁰⁾ + ξ − ½Γ(ξ, ξ) (or first-order / exact);
* :class:`ElementwiseComponent` is the adaptive-sharpness recipe for every other weight (docs/maths.md §6.2):
  metric Σ ξ²/w², Riemannian gradient ∇⊙w², perturbation w + ξ, zero weights kept fixed.

:class:`ProductBall` combines them with one norm ‖ξ‖² = Σ_components ‖ξ_c‖² (docs/maths.md §6.3);
:func:`~quotient_manifolds.adapters.solver.auto_pgd` maximises over it.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import torch

from quotient_manifolds import _validation as check
from quotient_manifolds._runtime import bounded_threads, threads_for
from quotient_manifolds.core.gl import GLFrame, second_order_gradient_and_inners, second_order_step
from quotient_manifolds.errors import InvalidArgument

from .elementwise import ElementwiseComponent, _inverse_square

Tensor = torch.Tensor
Tangent = List[Tensor]


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
    * ``leaf_point(u, need_grad, into) -> (inputs, point)``: the point for the closure and the
      tensors whose gradients give the gradient w.r.t. u; ``into`` (a free buffer like u) may
      receive the gradient (a streaming component's backward writes it there);
    * ``gradient(grads, u) -> (g, ‖g‖², ⟨g, u⟩)``: the Riemannian gradient g at u, in any form
      ``combine`` understands (grads may be consumed; a streaming component's point filled g during
      the backward pass, and its grads are None);
    * ``step_buffer(compact)``: a zero vector like u for the last step d (``compact``: in the
      narrowest dtype the component's coordinates allow);
    * ``solver_vector(dtype)``: a zero vector for an iterate, the worst point or a gradient, in
      ``dtype`` (a compact solver's) where the component's coordinates allow it, else like u;
    * ``combine(out, u, d, g, a, c, b) -> ‖out‖²``: out ← a·u + c·d + b·g (``d`` None: 0; out may
      be the buffer g was written into, never u or d);
    * ``finish_step_(out, f, u, d)``: out ← f·out, then d ← out − u (in d's dtype).

    Scalars (‖·‖², ⟨·,·⟩, the coefficients c, b, a) are 0-d float64 tensors: the solver's only host
    sync per iteration is the loss. A component sharded over several processes also has
    ``sum_over_ranks(value) -> value summed over them`` (a 0-d float64 tensor; a collective), by
    which every rank takes the solver's decisions alike (:meth:`ProductBall.on_every_rank`).

    ``quotient`` says whether the component is a quotient (GL) piece of the ball: its share of
    ‖ξ‖² is the attention share of a result (:meth:`ProductBall.quotient_share`)."""

    quotient: bool

    def zeros(self) -> Tensor: ...

    def inner(self, u: Tensor, v: Tensor) -> Tensor: ...

    def project(self, u: Tensor) -> Tensor: ...

    def rgrad(self, egrad: Tensor) -> Tensor: ...

    def random(self, generator: Optional[torch.Generator]) -> Tensor: ...

    def point(self, xi: Tensor, retraction: Optional[str] = None, exact_steps: Optional[int] = None, *,
              out: Optional[Tensor] = None) -> Tensor: ...

    def to_coords(self, xi: Tensor, out: Tensor) -> None: ...

    def from_coords_(self, u: Tensor) -> Tensor: ...

    def leaf_point(self, u: Tensor, need_grad: bool, into: Optional[Tensor] = None
                   ) -> Tuple[List[Tensor], Tensor]: ...

    def gradient(self, grads: List[Optional[Tensor]], u: Tensor) -> Tuple[Any, Tensor, Tensor]: ...

    def step_buffer(self, compact: bool) -> Tensor: ...

    def solver_vector(self, dtype: Optional[torch.dtype] = None) -> Tensor: ...

    def combine(self, out: Tensor, u: Tensor, d: Optional[Tensor], g: Any, a: Tensor, c: Tensor,
                b: Tensor) -> Tensor: ...

    def finish_step_(self, out: Tensor, f: Tensor, u: Tensor, d: Tensor) -> None: ...


class _RecomputedPoint(torch.autograd.Function):
    """R(ξ) of a :class:`QuotientComponent` whose backward recomputes R and takes its
    vector-Jacobian product there (the same numbers as differentiating the forward's graph)."""

    @staticmethod
    def forward(ctx, xi: Tensor, comp: "QuotientComponent") -> Tensor:
        ctx.comp, ctx.xi = comp, xi.detach()
        with torch.no_grad():
            return comp.point(xi)

    @staticmethod
    def backward(ctx, grad: Tensor):
        with torch.enable_grad():
            xi = ctx.xi.requires_grad_()
            (out,) = torch.autograd.grad(ctx.comp.point(xi), xi, grad)
        return out, None


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

    quotient = True

    def __init__(self, name: str, frame, x0: Tensor, *, retraction: str,
                 use_metric_norm: bool = True, dtype: Optional[torch.dtype] = None,
                 recompute: bool = False):
        self.recompute = bool(recompute)
        self.name = name
        self.frame = frame
        self.x0 = x0
        self.dtype = dtype or x0.dtype
        self.retraction = retraction
        x64 = x0.to(torch.float64)  # the ablation's weights in float64, as the frame's work
        self.elementwise_norm = None if use_metric_norm else _inverse_square(x64)
        self.elementwise_rgrad = None if use_metric_norm else x64 * x64 * (self.elementwise_norm > 0)
        self.threads = threads_for(x0.numel())
        #: the solver's gradient from ∂ℓ/∂point in closed form (second-order retraction of a GL
        #: frame, quotient metric): the point is the autograd leaf, and
        #: :func:`~quotient_manifolds.core.gl.second_order_riemannian_gradient` forms P_h(ū N)
        #: without the vector–Jacobian product ū (three n×h products fewer per iteration)
        self.closed_form_gradient = (retraction == "second_order" and use_metric_norm
                                     and isinstance(frame, GLFrame))
        self._forward: Optional[Tuple[Tensor, int, Any]] = None
        #: the Gram products of the step the solver is forming (combine → finish_step_ →
        #: leaf_point): (out, its version once scaled, grams), so the retraction along the new ξ
        #: takes them instead of recomputing them
        self._next: Optional[Tuple[Tensor, Optional[int], Any]] = None

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

    def leaf_point(self, xi: Tensor, need_grad: bool, into: Optional[Tensor] = None
                   ) -> Tuple[List[Tensor], Tensor]:
        """The point R(ξ) and its leaf: the point itself where the gradient has a closed form
        (:attr:`closed_form_gradient`; :meth:`gradient` then takes ∂ℓ/∂point), ξ otherwise.
        With ``recompute`` the exact retraction keeps no graph
        between the forward and the backward pass (the ODE's float64 steps would be held all that
        time): the backward recomputes it, one component at a time, and differentiates that. The
        second-order retraction needs none: its backward is closed-form and keeps only ξ and
        h×h matrices (:func:`~quotient_manifolds.core.gl.second_order_retraction_vjp`). ``into``
        (the solver's buffer for the gradient, which :meth:`gradient` forms after the backward,
        and :meth:`combine` then overwrites) holds the closed-form point meanwhile: no tensor of
        the block's size more through the forward and backward."""
        if self.closed_form_gradient:
            carried, self._next = self._next, None
            grams = (carried[2] if carried is not None and carried[0] is xi
                     and carried[1] == xi._version else None)
            with torch.no_grad(), bounded_threads(self.threads):
                point, grams = second_order_step(self.frame, xi, grams)
            self._forward = (xi, xi._version, grams) if need_grad else None
            if into is not None and into.shape == point.shape and into.dtype == self.dtype:
                leaf = into.copy_(point).detach()  # a tensor of its own over the buffer's memory
            else:
                leaf = point.to(self.dtype)
            del point
            leaf.requires_grad_(need_grad)
            return [leaf], leaf
        leaf = xi.detach().requires_grad_(need_grad)
        if self.recompute and need_grad and self.retraction == "exact":
            return [leaf], _RecomputedPoint.apply(leaf, self).to(self.dtype)
        if self.recompute:  # streaming: the point, held through the forward, in the iterates' dtype
            return [leaf], self.point(leaf).to(self.dtype)
        return [leaf], self.point(leaf)

    def gradient(self, grads: List[Optional[Tensor]], xi: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """g = rgrad(∇); with the quotient metric ‖g‖² = ⟨∇, g⟩ and ⟨g, ξ⟩ = ⟨∇, ξ⟩ (Euclidean):
        g is the metric-orthogonal projection of the metric gradient, so g(g, v) = ⟨∇, v⟩ for every
        horizontal v (g and ξ are), and no n×h×h product is needed."""
        if self.closed_form_gradient:  # grads: ∂ℓ/∂point, at the point of leaf_point(xi)
            forward, self._forward = self._forward, None
            y_bar = torch.zeros_like(xi) if grads[0] is None else grads[0]
            # the forward's Gram products, if this is the same ξ, unchanged (a view of the same
            # values, as a sharded component passes, counts as the same)
            same = forward is not None and forward[1] == xi._version and (forward[0] is xi or (
                forward[0].data_ptr() == xi.data_ptr() and forward[0].shape == xi.shape
                and forward[0].stride() == xi.stride()))
            with bounded_threads(self.threads):
                g, sq, dot = second_order_gradient_and_inners(self.frame, xi, y_bar,
                                                              forward[2] if same else None)
            return g.to(self.dtype), sq.sum(dtype=torch.float64), dot.sum(dtype=torch.float64)
        egrad = torch.zeros_like(xi) if grads[0] is None else grads[0]
        g = self.rgrad(egrad).to(self.dtype)
        if self.elementwise_norm is not None:
            return g, self.inner(g, g), self.inner(g, xi)
        return (g, torch.sum(egrad * g, dtype=torch.float64),
                torch.sum(egrad * xi, dtype=torch.float64))

    def combine(self, out: Tensor, xi: Tensor, d: Optional[Tensor], g: Tensor, a: Tensor,
                c: Tensor, b: Tensor) -> Tensor:
        torch.mul(g, b, out=out)
        out.addcmul_(xi, a)
        if d is not None:
            out.addcmul_(d, c)
        if self.closed_form_gradient:
            # ‖out‖² from the Gram products of out, which the retraction along the next ξ, a
            # multiple of out (finish_step_), takes scaled: one product here, two fewer there
            with torch.no_grad(), bounded_threads(self.threads):
                sq, grams = self.frame.norm_sq_and_grams(out)
            self._next = (out, None, grams)
            return sq
        return self.inner(out, out)

    def finish_step_(self, out: Tensor, factor: Tensor, xi: Tensor, d: Tensor) -> None:
        out.mul_(factor)
        torch.sub(out, xi, out=d)
        carried = self._next
        if carried is not None and carried[0] is out:
            x_out, out_out = carried[2]
            self._next = (out, out._version, (x_out * factor, out_out * (factor * factor)))
        else:
            self._next = None

    def step_buffer(self, compact: bool) -> Tensor:
        """A zero step in the iterates' dtype, also where ``compact``: rounding the step's
        entries would add a vertical part to it, which the quotient metric may weigh
        arbitrarily (it is not invariant under the group's action)."""
        return self.zeros()

    def solver_vector(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """A zero iterate in the iterates' own dtype whatever ``dtype`` (a compact solver's)
        asks: as for the step (:meth:`step_buffer`), rounding would add a vertical part."""
        return self.zeros()


class ProductBall:
    """The product of components with one combined norm ‖ξ‖² = Σ_c ‖ξ_c‖² (docs/maths.md §6.3)."""

    def __init__(self, components: Sequence):
        if not components:
            raise InvalidArgument("a ball needs at least one component")
        self.components = list(components)

    def zeros(self) -> Tangent:
        return [c.zeros() for c in self.components]

    def solver_vectors(self, dtype: Optional[torch.dtype] = None) -> Tangent:
        """A zero vector of the solver's (an iterate, the worst point, a gradient): each
        component's in ``dtype`` where its coordinates allow (the elementwise ones), in its own
        dtype otherwise (the quotient ones); ``None``: :meth:`zeros`."""
        return [c.solver_vector(dtype) for c in self.components]

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
        on = sum(v if getattr(c, "quotient", False) else
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

    def on_every_rank(self, flag: bool, device: Union[str, torch.device] = "cpu") -> bool:
        """Whether ``flag`` holds on every process over which the ball's components are sharded
        (the count of ranks where it does not, :meth:`sum_over_ranks`; the vote is made on
        ``device``, that of the ball's vectors); ``flag`` itself for a ball of one process. Every
        rank must call it, as a collective: a decision that changes the passes a run takes must be
        the same on all."""
        check.flag("flag", flag)
        vote = torch.tensor(0.0 if flag else 1.0, dtype=torch.float64, device=device)
        return bool(self.sum_over_ranks(vote) == 0)

    def sum_over_ranks(self, values: Tensor) -> Tensor:
        """``values`` (a float64 tensor) summed over the processes over which the ball is sharded
        (one collective, through the first component that has ``sum_over_ranks(value)``: a sharded
        component's sum over its processes, the same group for all of a ball's components);
        ``values`` itself for a ball of one process. Every rank must call it."""
        for comp in self.components:
            summed = getattr(comp, "sum_over_ranks", None)
            if summed is not None:
                return summed(values)
        return values

    @property
    def has_quotients(self) -> bool:
        return any(getattr(c, "quotient", False) for c in self.components)

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
