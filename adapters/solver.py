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
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from quotient_manifolds._runtime import bounded_threads, threads_for
from quotient_manifolds.core.gl import check_choice

Tensor = torch.Tensor
Tangent = List[Tensor]

MOMENTUM_FORMS = ("apgd", "andriushchenko", "none")
STEP_NORMALISATIONS = ("metric", "none")


# ---------------------------------------------------------------------------------- components
class QuotientComponent:
    """One quotient-manifold piece of the ball, at the fixed point ``frame.x``.

    ``frame`` is a :class:`~quotient_manifolds.core.gl.GLFrame` (batched over heads) or a
    :class:`~quotient_manifolds.core.rescaling.RescalingFrame`.

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
                 use_metric_norm: bool = True):
        self.name = name
        self.frame = frame
        self.x0 = x0
        self.retraction = retraction
        self.elementwise_norm = None if use_metric_norm else _inverse_square(x0)
        self.elementwise_rgrad = None if use_metric_norm else x0 * x0 * (self.elementwise_norm > 0)
        self.threads = threads_for(x0.numel())

    def zeros(self) -> Tensor:
        return torch.zeros_like(self.x0)

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

    def point(self, xi: Tensor, retraction: Optional[str] = None,
              exact_steps: Optional[int] = None) -> Tensor:
        """The retraction of ξ at x0 (the component's own, or ``retraction`` to compare)."""
        with bounded_threads(self.threads):
            return self.frame.retract(xi, retraction or self.retraction, exact_steps=exact_steps)

    def random(self, generator: Optional[torch.Generator]) -> Tensor:
        u = torch.randn(self.x0.shape, dtype=self.x0.dtype, device=self.x0.device,
                        generator=generator)
        return self.project(u)


class ElementwiseComponent:
    """Adaptive-sharpness geometry of plain weight tensors w (c = |w|; docs/maths.md §6.2, §10).

    Metric ⟨ξ, η⟩ = Σ ξη/w², Riemannian gradient ∇⊙w², point w + ξ. Entries with w = 0 (or outside
    their ``mask``) have infinite cost and are kept fixed (ξ = 0 there; docs/maths.md §12.12). With
    ``direction="andriushchenko"`` the ascent direction is ∇⊙|w| (their code) instead of ∇⊙w².
    ``second_order=True`` adds the elementwise Christoffel term (docs/maths.md §12.10; default off, as the
    paper's App. C.1 keeps "the recipe of adaptive sharpness" for these weights).

    All tensors given are flattened into ONE vector so that every operation of the solver is a
    single pass over memory (this part holds most scalars of a transformer: embeddings, MLPs);
    :meth:`unflatten` returns differentiable views per name.
    """

    def __init__(self, tensors: Dict[str, Tensor], *, masks: Optional[Dict[str, Tensor]] = None,
                 direction: str = "riemannian", second_order: bool = False,
                 name: str = "elementwise"):
        if not tensors:
            raise ValueError("an elementwise component needs at least one tensor")
        self.name = name
        self.names = list(tensors)
        self.shapes = [tensors[n].shape for n in self.names]
        self.sizes = [tensors[n].numel() for n in self.names]
        self.x0 = torch.cat([tensors[n].reshape(-1) for n in self.names])
        inv_w2 = _inverse_square(self.x0)
        movable = inv_w2 > 0  # w = 0, or 1/w² overflowing, counts as zero (docs/maths.md §12.12: kept fixed)
        if masks:
            movable &= torch.cat([masks[n].reshape(-1) if masks.get(n) is not None else
                                  torch.ones(tensors[n].numel(), dtype=torch.bool,
                                             device=self.x0.device) for n in self.names])
        self.direction = check_choice(direction, ("riemannian", "andriushchenko"),
                                      "adaptive direction")
        self.abs_w = torch.where(movable, self.x0.abs(), torch.zeros_like(self.x0))
        self.w2 = self.abs_w * self.abs_w
        self.inv_w2 = torch.where(movable, inv_w2, torch.zeros_like(inv_w2))
        self.half_inv_w = (0.5 / torch.where(movable, self.x0, torch.ones_like(self.x0))
                           if second_order else None)

    def unflatten(self, flat: Tensor) -> Dict[str, Tensor]:
        return {n: t.view(shape) for n, t, shape in
                zip(self.names, torch.split(flat, self.sizes), self.shapes)}

    def zeros(self) -> Tensor:
        return torch.zeros_like(self.x0)

    def inner(self, u: Tensor, v: Tensor) -> Tensor:
        # a persistent scratch buffer: fresh 100 MB temporaries cost more (page faults) than the maths
        if getattr(self, "_scratch", None) is None:
            self._scratch = torch.empty_like(self.x0)
        return torch.dot(torch.mul(u, self.inv_w2, out=self._scratch), v).to(torch.float64)

    def project(self, u: Tensor) -> Tensor:
        # Every vector the solver forms is a combination of gradients ∇⊙w², already 0 where w is
        # fixed; random directions are masked in :meth:`random`. Nothing to project.
        return u

    def rgrad(self, egrad: Tensor) -> Tensor:
        """∇⊙w² (or ∇⊙|w|); in place when ``egrad`` is a plain contiguous tensor (it is consumed)."""
        weight = self.w2 if self.direction == "riemannian" else self.abs_w
        return egrad.mul_(weight) if egrad.is_contiguous() else egrad * weight

    def point(self, xi: Tensor) -> Tensor:
        """w + ξ, or with ``second_order`` the second-order geodesic of the elementwise metric
        Σ ξ²/w², w + ξ − ½Γ(ξ, ξ) = w + ξ + ξ²/(2w) (Γ^w_ww = −1/w; docs/maths.md §10, §12.10)."""
        if self.half_inv_w is None:
            return self.x0 + xi
        return self.x0 + xi + xi * xi * self.half_inv_w

    def random(self, generator: Optional[torch.Generator]) -> Tensor:
        u = torch.randn(self.x0.shape, dtype=self.x0.dtype, device=self.x0.device,
                        generator=generator)
        return u * self.abs_w


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

    def project(self, u: Tangent) -> Tangent:
        return [c.project(a) for c, a in zip(self.components, u)]

    def rgrad(self, egrads: Tangent) -> Tangent:
        return [c.rgrad(g) for c, g in zip(self.components, egrads)]

    def points(self, xi: Tangent, retraction: Optional[str] = None,
               exact_steps: Optional[int] = None) -> List[Tensor]:
        """Ball points → weights; ``retraction`` (and ``exact_steps``) override the quotient
        components' retraction (e.g. ``"exact"`` to check a second-order step)."""
        return [c.point(a, retraction, exact_steps) if isinstance(c, QuotientComponent)
                else c.point(a) for c, a in zip(self.components, xi)]

    @property
    def has_quotients(self) -> bool:
        return any(isinstance(c, QuotientComponent) for c in self.components)

    def random(self, generator: Optional[torch.Generator] = None) -> Tangent:
        return [c.random(generator) for c in self.components]

    def project_ball(self, xi: Tangent, rho: float, *, horizontal: bool = False,
                     inplace: bool = False) -> Tangent:
        """P_S: horizontal projection, then radial scaling into ‖ξ‖ ≤ ρ (exact, docs/maths.md §3.2).

        ``horizontal=True`` skips the projection for vectors that are horizontal by construction
        (linear combinations of horizontal vectors), which the solver's iterates are;
        ``inplace=True`` rescales ``xi`` itself (for temporaries)."""
        if not horizontal:
            xi = self.project(xi)
        nrm = float(self.norm(xi))
        if nrm <= rho:
            return xi
        if inplace:
            torch._foreach_mul_(xi, rho / nrm)
            return xi
        return scale(xi, rho / nrm)


def axpy(a: float, x: Tangent, y: Tangent) -> Tangent:
    """a·x + y (one fused pass per tensor)."""
    return torch._foreach_add(y, x, alpha=a)


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
    """
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho!r}")
    if not isinstance(n_iters, int) or n_iters < 1:
        raise ValueError(f"n_iters must be a positive integer, got {n_iters!r}")
    check_choice(momentum, MOMENTUM_FORMS, "momentum form")
    check_choice(step_normalisation, STEP_NORMALISATIONS, "step normalisation")
    checkpoints = set(apgd_checkpoints(n_iters))

    def evaluate(xi: Tangent, need_grad: bool):
        leaves = [t.detach().requires_grad_(need_grad) for t in xi]
        with torch.enable_grad() if need_grad else torch.no_grad():
            loss = closure(ball.points(leaves))
        if not torch.isfinite(loss.detach()):
            nrm = float(ball.norm(xi))
            where = ("at the unperturbed weights: check the model, its inputs and targets"
                     if nrm == 0 else f"at a perturbation of norm {nrm:.3g}: reduce rho")
            raise FloatingPointError(f"the loss is not finite ({float(loss.detach())}) {where}")
        if not need_grad:
            return float(loss.detach()), None
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
        return float(loss.detach()), ball.rgrad(grads)

    eta = 2 * rho * step_size_mult
    if start is None:
        xi = ball.zeros()
        loss0, grad = evaluate(xi, True)
        worst = loss0
    else:
        xi, loss0 = start
        if float(ball.norm(xi)) > rho * (1 + 1e-6):
            raise ValueError(f"the warm start has norm {float(ball.norm(xi)):.4g} > rho = {rho:.4g}: "
                             "start from a point of a smaller ball")
        worst, grad = evaluate(xi, True)
    xi_prev = xi
    n_fwd, n_bwd = 1, 1
    xi_worst, grad_worst = xi, grad
    history, steps = [worst], [eta]
    n_updates, last_ckpt, ckpt_eta, ckpt_worst = 0, 0, eta, worst
    for k in range(n_iters):
        if k in checkpoints:
            stalled = n_updates < min_update_ratio * (k - last_ckpt)
            frozen = ckpt_eta == eta and ckpt_worst == worst
            ckpt_eta, ckpt_worst = eta, worst
            if stalled or frozen:
                eta *= decay
                xi, xi_prev, grad = xi_worst, xi_worst, grad_worst
            n_updates, last_ckpt = 0, k
        gnorm = float(ball.norm(grad)) if step_normalisation == "metric" else 1.0
        step = eta / gnorm if gnorm > 0 else 0.0
        # ξ and g are horizontal (g from ball.rgrad), so are all their combinations below
        z = ball.project_ball(axpy(step, grad, xi), rho, horizontal=True, inplace=True)
        if momentum == "none" or k == 0:
            xi_new = z
        elif momentum == "apgd":
            # ξ + α(z−ξ) + (1−α)(ξ−ξ⁻) = lerp(2ξ − ξ⁻, z, α), with one allocation
            xi_new = torch._foreach_sub(xi, xi_prev)
            torch._foreach_add_(xi_new, xi)
            torch._foreach_lerp_(xi_new, z, alpha)
            xi_new = ball.project_ball(xi_new, rho, horizontal=True, inplace=True)
        else:
            xi_new = torch._foreach_lerp(xi_prev, z, 0.75)
        xi_prev, xi = xi, xi_new
        last = k == n_iters - 1
        loss, grad = evaluate(xi, not last)
        n_fwd += 1
        n_bwd += 0 if last else 1
        history.append(loss)
        steps.append(eta)
        if loss > worst:
            worst, xi_worst, grad_worst = loss, xi, grad
            n_updates += 1
        if on_iteration is not None:
            on_iteration(k, loss)
    return APGDResult(loss0, worst, xi_worst, float(ball.norm(xi_worst)), n_fwd, n_bwd, history,
                      steps)


def average_case(ball: ProductBall, closure: Callable[[List[Tensor]], Tensor], rho: float, *,
                 n_samples: int = 10, generator: Optional[torch.Generator] = None,
                 on_iteration: Optional[Callable[[int, float], None]] = None
                 ) -> Dict[str, float]:
    """E_ξ[L(R(ξ))] − L(w⁰) over random horizontal ξ on the sphere ‖ξ‖ = ρ (forward passes only).

    Directions are Gaussian in the metric's natural scaling (projected horizontally), rescaled to
    norm ρ; ``generator`` makes the draw deterministic. ``on_iteration(k, loss)`` is called after
    each sample k."""
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho!r}")
    with torch.no_grad():
        loss0 = float(closure(ball.points(ball.zeros())))
        losses = []
        for k in range(n_samples):
            u = ball.random(generator)
            u = scale(u, rho / float(ball.norm(u)))
            losses.append(float(closure(ball.points(u))))
            if on_iteration is not None:
                on_iteration(k, losses[-1])
    return {"init_loss": loss0, "mean_loss": sum(losses) / len(losses), "losses": losses}
