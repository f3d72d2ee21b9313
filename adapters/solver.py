r"""Sharpness as Riemannian maximisation over a geodesic ball: a generic solver.

The solver knows manifolds and a loss closure, nothing about model families. The ball is a
:class:`~quotient_manifolds.adapters.components.ProductBall` of components (the GL(h) quotient
blocks and the elementwise adaptive geometry, :mod:`~quotient_manifolds.adapters.components`), and
:func:`auto_pgd` maximises L(retract(w⁽⁰⁾, ξ)) − L(w⁽⁰⁾) over it (docs/maths.md §7.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from quotient_manifolds._validation import choice, flag, optional_generator
from quotient_manifolds.errors import InvalidArgument, NonFiniteLoss

from . import validation as check
from .components import ProductBall, Tangent, ball_factor
from .memory import device_memory, room_for_two_more

Tensor = torch.Tensor

MOMENTUM_FORMS = ("apgd", "andriushchenko", "none")
#: The dtypes of the solver's vectors that :func:`auto_pgd`'s ``solver_dtype`` takes: ``None``
#: (the iterates' own, float32 for a float32 or half-precision model) or ``torch.bfloat16`` (the
#: compact solver: the elementwise weights' iterate, worst point, gradient and step in bfloat16)
SOLVER_DTYPES: Tuple[Optional[torch.dtype], ...] = (None, torch.bfloat16)
STEP_NORMALIZATIONS = ("metric", "none")
#: The default of :func:`auto_pgd`'s ``compact_step`` (and so of every sharpness run): the last
#: step of the elementwise components is stored in bfloat16 for float32 iterates
#: (:data:`~quotient_manifolds.adapters.elementwise.COMPACT_STEP_DTYPES`).
COMPACT_STEP = True

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
    with ‖g‖² and ⟨g, ξ⟩, and the solver's buffer that the evaluation was given for it (a
    streaming component wrote g there; the step may be written over it)."""

    parts: list
    sq: Tensor
    dot: Tensor
    buffer: Optional[Tangent] = None


def _evaluate(comps: Sequence, closure: Callable[[List[Tensor]], Tensor], xi: Tangent,
              need_grad: bool, xi_sq: Tensor, into: Optional[Tangent] = None
              ) -> Tuple[float, Optional[_Gradient]]:
    """ℓ at the point of ξ and, with ``need_grad``, the Riemannian gradient there (one forward,
    one backward; ``into``: a free buffer like ξ that components may write it into); a finite
    loss with a non-finite gradient is refused."""
    into = into if need_grad and into is not None else [None] * len(xi)
    inputs, points = zip(*(c.leaf_point(x, need_grad, t) for c, x, t in zip(comps, xi, into)))
    with torch.enable_grad() if need_grad else torch.no_grad():
        loss = closure(list(points))
    del points  # a GL block's retracted point is not needed by the backward
    if not need_grad:
        return finite_loss(loss, xi_sq), None
    flat = [t for ts in inputs for t in ts]
    # a closure that ran the backward itself (a sharded model) hands back a loss whose graph holds
    # only what is left to differentiate, possibly nothing
    grads = (list(torch.autograd.grad(loss, flat, allow_unused=True)) if loss.requires_grad
             else [None] * len(flat))
    loss = loss.detach()
    del flat
    parts, at = [], 0
    for c, x, ts in zip(comps, xi, inputs):
        parts.append(c.gradient(grads[at:at + len(ts)], x))
        grads[at:at + len(ts)] = [None] * len(ts)  # consumed: the component owns them now
        at += len(ts)
    sq = sum(p[1] for p in parts)
    # The loss and ‖g‖² are read in one host sync, after the backward: an accelerator is handed
    # the backward and the gradient's assembly before the host waits for the forward. ‖g‖² is
    # finite exactly when every entry of g is: one check of a scalar the step needs anyway, no
    # pass over the gradient. A non-finite loss is named first (its gradient is then no news).
    value, sq_value = torch.stack([loss.to(sq), sq]).tolist()
    _refuse_non_finite_loss(value, xi_sq)
    if not math.isfinite(sq_value):
        # a finite loss with a non-finite gradient is a kink of the model or loss (sqrt or log at
        # 0, a norm of a zero vector), not a step that went too far
        raise NonFiniteLoss(
            f"the loss is finite ({value}) but its gradient is not (nan or inf) at a perturbation "
            f"of norm {math.sqrt(float(xi_sq)):.3g}: the model or loss_fn is not differentiable "
            f"there (e.g. sqrt or log at 0, the norm of a zero vector); make it differentiable, "
            f"e.g. add a small epsilon inside sqrt/log")
    return value, _Gradient([p[0] for p in parts], sq, sum(p[2] for p in parts),
                            None if into[0] is None else into)


def _step_coefficients(momentum: str, first: bool, alpha: float, c: Tensor, s: Tensor):
    """(A, C, B, project) of ξ⁺ = A ξ + C ξ⁻ + B g for the momentum form (see :func:`auto_pgd`)."""
    if momentum == "none" or first:
        return c, 0.0, c * s, False
    if momentum == "apgd":
        return alpha * c + 2 * (1 - alpha), alpha - 1, alpha * c * s, True
    return 0.75 * c, 0.25, 0.75 * c * s, False


def auto_pgd(ball: ProductBall, closure: Callable[[List[Tensor]], Tensor], rho: float, *,
             n_iters: int = 20, step_size_mult: float = 1.0, alpha: float = 0.75,
             momentum: str = "apgd", step_normalization: str = "metric",
             min_update_ratio: float = 0.75, decay: float = 0.5,
             on_iteration: Optional[Callable[[int, float], None]] = None,
             start: Optional[Tuple[Tangent, float]] = None,
             keep_worst_gradient: Optional[bool] = None,
             compact_step: Optional[bool] = None,
             solver_dtype: Optional[torch.dtype] = None) -> APGDResult:
    r"""Maximise ``closure(ball.points(ξ))`` over horizontal ξ with ‖ξ‖ ≤ ρ (docs/maths.md §7.1, §7.3).

    Iterations k = 0..N−1 each cost exactly one forward and one backward: the pass at ξ_k gives both
    ℓ(ξ_k) (checked against the worst loss so far) and the gradient for the next step; the final
    iterate gets one extra forward. Per step: g = P_h(grad_g ℓ) (Riemannian gradient of ξ ↦ ℓ(R(ξ))
    in the metric at w⁽⁰⁾, autograd through the retraction, docs/maths.md §12.5), normalised by its norm
    (``step_normalization="metric"``, docs/maths.md §12.6), z = P_S(ξ + η g), and the momentum step
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

    The momentum needs ξ⁻ only through the last step d = ξ − ξ⁻, which is what the solver stores
    (y = (1 + C/A) ξ − (C/A) d + (B/A) g, ξ⁺ = A·y): with ``compact_step`` (default
    :data:`COMPACT_STEP`) each component keeps it as compact as its coordinates allow (the
    elementwise ones in bfloat16 for float32 iterates: d/w carries 8 significant bits, and
    ξ⁻ = ξ − d is off by at most 2⁻⁹|d| per entry, a fraction of one step; quotient components
    and float64 iterates keep d exact). Two more iterate buffers serve ξ
    and the worst point, and one receives the gradient at ξ, over which the next iterate is then
    written (roles change, values are not copied): beyond the model's own forward and backward a
    run holds three vectors of the ball's size and d (14 bytes per float32 weight with the
    compact step, 16 without; with a streaming elementwise component nothing else of the model's
    size). ``keep_worst_gradient`` keeps the gradient at an older worst point as one more vector,
    which saves a forward and backward at each restart from it (3 to 6 restarts in 20 iterations
    on MiniLM); without it the restart recomputes the gradient there (same values, one more pass
    of each). Default (``None``): decided after the first forward and backward, with ξ, its
    gradient and d allocated: the gradient is kept while the device's memory (CUDA; the CPU's on
    Linux) still holds the two vectors to come (the worst point and its gradient) beside that
    pass's peak and 5 % of the device to spare
    (:func:`~quotient_manifolds.adapters.memory.room_for_two_more`), the same on every rank of a
    sharded ball (:meth:`ProductBall.on_every_rank`); ``False`` never keeps it (the least memory),
    ``True`` always.

    ``solver_dtype=torch.bfloat16`` is the compact solver (:data:`SOLVER_DTYPES`): the
    elementwise components keep ξ, the worst point, the gradient (and the kept gradient) in
    bfloat16 in their coordinates r = ξ/w (2 bytes each instead of 4: 8 bytes per float32 weight
    instead of 14, 10 with the worst point's gradient). Each step is still formed in float32, a
    piece at a time, and rounded once; the points are formed in the compute dtype, so only ξ's
    own entries are rounded, by at most 2⁻⁹ relative: at ‖ξ‖ = ρ a change of the loss of order
    2⁻⁹ of the loss's rise along ξ, and the value returned is the loss at a point actually
    evaluated. The quotient components keep float32 iterates (rounding would add a vertical
    part), so the value stays invariant under the model's symmetries.
    """
    rho = check.radius(rho)
    n_iters = check.positive_integer("n_iters", n_iters)
    step_size_mult = check.positive_finite("step_size_mult", step_size_mult)
    alpha = check.in_interval("alpha", alpha, 0, 1, low_open=True, high_open=False,
                              meaning="the weight of the new step in the momentum update")
    min_update_ratio = check.in_interval("min_update_ratio", min_update_ratio, 0, 1, low_open=False,
                                         high_open=False, meaning="the share of improving steps below "
                                         "which the step size decays")
    decay = check.in_interval("decay", decay, 0, 1, low_open=True, high_open=True,
                              meaning="the factor of the step size at a decay")
    choice("momentum", momentum, MOMENTUM_FORMS)
    choice("step_normalization", step_normalization, STEP_NORMALIZATIONS)
    check.optional_callable("on_iteration", on_iteration, "on_iteration(k, loss)")
    check_solver_dtype(solver_dtype)
    for name, value in (("keep_worst_gradient", keep_worst_gradient), ("compact_step", compact_step)):
        if value is not None:
            flag(name, value)
    check.gradients_available("worst-case sharpness (auto_pgd)")
    check.ball_and_closure(ball, closure)
    if start is not None:
        check.warm_start(start, ball.zeros())
    closure = check.scalar_closure(closure)
    checkpoints = set(apgd_checkpoints(n_iters))
    comps = ball.components

    pool: List[Tangent] = []

    def free(*held: Optional[Tangent]) -> Tangent:
        """A buffer of the pool that none of ``held`` is (roles change, values are not copied);
        a new one when every buffer is held."""
        for buf in pool:
            if all(buf is not h for h in held):
                return buf
        pool.append(ball.solver_vectors(solver_dtype))
        return pool[-1]

    xi = free()
    compact_step = COMPACT_STEP if compact_step is None else compact_step
    last_step = [comp.step_buffer(compact_step) for comp in comps]
    eta = 2 * rho * step_size_mult
    if start is None:
        xi_sq = torch.zeros((), dtype=torch.float64, device=xi[0].device)
        loss0, grad = _evaluate(comps, closure, xi, True, xi_sq, free(xi))
        worst = loss0
    else:
        given, loss0 = start
        xi_sq = ball.inner(given, given)
        if math.sqrt(max(float(xi_sq), 0.0)) > rho * (1 + 1e-6):
            raise InvalidArgument(f"the warm start has norm {math.sqrt(float(xi_sq)):.4g} > rho = "
                                  f"{rho:.4g}: start from a point of a smaller ball")
        for comp, buf, t in zip(comps, xi, given):
            comp.to_coords(t, buf)
        worst, grad = _evaluate(comps, closure, xi, True, xi_sq, free(xi))
    if keep_worst_gradient is None:
        # now that ξ, its gradient and d are held and one forward+backward has shown its peak,
        # the worst point and its gradient are the two vectors still to come; every rank of a
        # sharded ball takes the same decision (a rank that recomputes alone would wait forever)
        keep_worst_gradient = ball.on_every_rank(
            room_for_two_more(sum(t.numel() * t.element_size() for t in xi),
                              device_memory(xi[0].device)), xi[0].device)
    has_step = False  # the last step d = ξ − ξ⁻ is 0 at the start and after a restart
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
                xi, grad, xi_sq, has_step = xi_worst, grad_worst, worst_sq, False
                if grad is None:  # not kept: recomputed at the worst point (the same values)
                    grad = grad_worst = _evaluate(comps, closure, xi, True, xi_sq, free(xi))[1]
                    n_fwd, n_bwd = n_fwd + 1, n_bwd + 1
            n_updates, last_ckpt = 0, k
        # scalars stay 0-d tensors (no host sync): the step s, z = P_S(ξ + s g) = c(ξ + s g)
        s = (torch.where(grad.sq > 0, eta / grad.sq.sqrt(), 0.0)
             if step_normalization == "metric" else torch.full_like(grad.sq, eta))
        z_sq = (xi_sq + 2 * s * grad.dot + s * s * grad.sq).clamp_min(0)
        c = ball_factor(z_sq.sqrt(), rho)
        A, C, B, project = _step_coefficients(momentum, k == 0, alpha, c, s)
        # ξ⁺ = A·y, y = ξ + (C/A) ξ⁻ + (B/A) g = (1 + C/A) ξ − (C/A) d + (B/A) g, written over
        # the gradient's buffer unless that is the kept gradient of the worst point
        worst_buffer = None if grad_worst is None else grad_worst.buffer
        out = (grad.buffer if grad.buffer is not None and grad.buffer is not worst_buffer
               else free(xi, xi_worst, grad.buffer, worst_buffer))
        y_sq = sum(comp.combine(o, x, d if has_step and C != 0 else None, g, 1 + C / A, -C / A,
                                B / A)
                   for comp, o, x, d, g in zip(comps, out, xi, last_step, grad.parts))
        factor = ball_factor(y_sq.sqrt(), rho, A) if project else A
        for comp, o, x, d in zip(comps, out, xi, last_step):
            comp.finish_step_(o, factor, x, d)
        grad, has_step = None, True  # only the worst point's gradient outlives its step, if kept
        if not keep_worst_gradient:
            grad_worst = None
        xi, xi_sq = out, factor * factor * y_sq
        last = k == n_iters - 1
        into = free(xi, xi_worst, None if grad_worst is None else grad_worst.buffer)
        loss, grad = _evaluate(comps, closure, xi, not last, xi_sq, into)
        n_fwd += 1
        n_bwd += 0 if last else 1
        history.append(loss)
        steps.append(eta)
        if loss > worst:
            worst, xi_worst, worst_sq, grad_worst = loss, xi, xi_sq, grad
            n_updates += 1
        if on_iteration is not None:
            on_iteration(k, loss)
    del pool, xi, grad, grad_worst, last_step  # only the worst point is returned
    xi_worst = [comp.from_coords_(u) for comp, u in zip(comps, xi_worst)]
    return APGDResult(loss0, worst, xi_worst, float(ball.norm(xi_worst)), n_fwd, n_bwd, history,
                      steps)


def check_solver_dtype(solver_dtype: Optional[torch.dtype], name: str = "solver_dtype"
                       ) -> Optional[torch.dtype]:
    """``solver_dtype`` if it is one of :data:`SOLVER_DTYPES`, else an InvalidArgument naming them."""
    if not any(solver_dtype is d for d in SOLVER_DTYPES):
        raise InvalidArgument(f"{name} must be None (the solver's vectors in the iterates' dtype) or "
                              f"torch.bfloat16 (the compact solver), got {solver_dtype!r}")
    return solver_dtype


def _points_at(ball: ProductBall, xi: Tangent) -> list:
    """The points of the closure at ξ (consumed: turned into the components' coordinates in place),
    as the solver forms them (:meth:`leaf_point`): a streaming component forms no copy."""
    for comp, x in zip(ball.components, xi):
        comp.to_coords(x, x)
    return [comp.leaf_point(x, False)[1] for comp, x in zip(ball.components, xi)]


def finite_loss(loss: Tensor, perturbation_sq: Union[float, Tensor]) -> float:
    """The loss as a float, refused (``FloatingPointError``, with where and what to do) when it is
    nan or inf: a mean or a maximum over such values would be a silent wrong number.
    ``perturbation_sq``: the squared norm of the perturbation (read only to name it)."""
    value = float(loss.detach())
    _refuse_non_finite_loss(value, perturbation_sq)
    return value


def _refuse_non_finite_loss(value: float, perturbation_sq: Union[float, Tensor]) -> None:
    """Refuses a loss ``value`` that is nan or inf (see :func:`finite_loss`)."""
    if not math.isfinite(value):
        norm = math.sqrt(max(float(perturbation_sq), 0.0))
        where = ("at the unperturbed weights: check the model, its inputs and targets"
                 if norm == 0 else f"at a perturbation of norm {norm:.3g}: reduce rho")
        raise NonFiniteLoss(f"the loss is not finite ({value}) {where}")


@dataclass
class AverageCaseResult:
    """Outcome of :func:`average_case`: the loss at the centre, the loss at each random point of the
    sphere ‖ξ‖ = ρ, and their mean. ``sharpness`` = ``mean_loss`` − ``init_loss``."""

    init_loss: float
    mean_loss: float
    losses: List[float] = field(default_factory=list)

    @property
    def sharpness(self) -> float:
        return self.mean_loss - self.init_loss


def average_case(ball: ProductBall, closure: Callable[[List[Tensor]], Tensor], rho: float, *,
                 n_samples: int = 10, generator: Optional[torch.Generator] = None,
                 on_iteration: Optional[Callable[[int, float], None]] = None
                 ) -> AverageCaseResult:
    """E_ξ[L(R(ξ))] − L(w⁰) over random horizontal ξ on the sphere ‖ξ‖ = ρ (forward passes only).

    Directions are Gaussian in the metric's natural scaling (projected horizontally), rescaled to
    norm ρ; ``generator`` makes the draw deterministic. ``on_iteration(k, loss)`` is called after
    each sample k."""
    rho = check.radius(rho)
    n_samples = check.positive_integer("n_samples", n_samples)
    check.optional_callable("on_iteration", on_iteration, "on_iteration(k, loss)")
    optional_generator("generator", generator)
    check.ball_and_closure(ball, closure)
    closure = check.scalar_closure(closure)
    with torch.no_grad():
        loss0 = finite_loss(closure(_points_at(ball, ball.zeros())), 0.0)
        losses = []
        for k in range(n_samples):
            u = ball.random(generator)
            torch._foreach_mul_(u, rho / float(ball.norm(u)))
            losses.append(finite_loss(closure(_points_at(ball, u)), rho * rho))
            del u
            if on_iteration is not None:
                on_iteration(k, losses[-1])
    return AverageCaseResult(loss0, sum(losses) / len(losses), losses)
