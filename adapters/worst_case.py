r"""Adaptive and geodesic worst-case (and average-case) sharpness of a real model.

``sharpness(model, batches, geometry=..., rho=...)`` turns a :class:`~quotient_manifolds.adapters.Layout` into a
:class:`~quotient_manifolds.adapters.components.ProductBall` (one batched GL(h) quotient per block shape, the elementwise
adaptive geometry for every other weight) and runs :func:`~quotient_manifolds.adapters.solver.auto_pgd` per batch with a
closure that evaluates the model through ``torch.func.functional_call``. The user's model is never
modified: parameters and buffers are read once, detached; every submodule's train/eval flag is
restored even after an exception or KeyboardInterrupt; no ``.grad`` is written (gradients come from
``torch.autograd.grad`` with respect to the perturbation only).

The maths: docs/maths.md §6 (blocks, total norm, ε), §7.3 (algorithm), §12 (the choices made).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from typing_extensions import Unpack

from quotient_manifolds._runtime import bounded_threads
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType

from . import validation as check
from .components import ProductBall
from .evaluation import raise_explained, split_batch, to_device
from .gate import Prepared
from .losses import default_loss
from .memory import explained_out_of_memory
from .options import SharpnessKwargs, SharpnessOptions, as_rho, document_options
from .placement import LocalPlacement, Placement, ShardedPlacement
from .sharded import is_sharded
from .solver import APGDResult, auto_pgd, average_case
from .validation import materialised

__all__ = ["sharpness", "sharpness_sweep", "run_sharpness", "SharpnessResult"]

Tensor = torch.Tensor

#: the most RK4 steps of the exact geodesic in the retraction check: the check needs the loss to a
#: few per cent, and RK4's error falls as steps⁻⁴ (32 steps reach 1e-6 at t = 1 on trained weights)
CHECK_EXACT_STEPS = 8
#: the check doubles the steps from 1 until two successive endpoints agree to this fraction of
#: their distance from the second-order point (the gap it measures)
CHECK_AGREEMENT = 0.05


@dataclass
class SharpnessResult:
    """Outcome of :func:`sharpness` (one per radius of :func:`sharpness_sweep`); the same fields
    for a model in one process and a sharded one, and the same on every rank of a sharded run.

    Attributes
    ----------
    value, per_batch, init_losses, worst_losses, norms:
        The loss rise, overall and per batch, and its parts (each field is described below).
    rho, geometry, measure, n_iters, options:
        How it was measured.
    n_forward, n_backward, time_s:
        What it cost.
    retraction_gaps, gl_norm_shares, attention_norm_shares:
        Per batch, the checks and shares of the worst perturbation.


    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> res = adapters.sharpness(model, batches, rho=0.1, loss_fn=torch.nn.MSELoss(), n_iters=5)
    >>> print(res)                      # doctest: +ELLIPSIS
    worst-case geodesic-mix sharpness (rho=0.1): 0.11... over 1 batch(es); initial loss 2.05..., ...
    >>> res.per_batch == [res.value], res.norms     # the worst point lies on the sphere here
    (True, [0.1])
    >>> 0 < res.attention_norm_shares[0] < 1        # its share on the attention weights
    True
    """

    #: the sharpness: the mean over batches of (worst − initial) loss, or of (mean − initial) loss
    #: over the random directions for ``measure="average"``
    value: float
    #: per batch, worst (or mean) − initial loss, in batch order
    per_batch: List[float]
    #: per batch, the loss at the trained weights
    init_losses: List[float]
    #: per batch, the largest loss found in the ball (the mean over directions for average-case)
    worst_losses: List[float]
    #: per batch, the norm of the worst perturbation in the ball's metric (≤ ``rho``; ``rho`` for
    #: average-case, whose directions lie on the sphere)
    norms: List[float]
    #: the radius of the ball
    rho: float
    #: the geometry of the ball (``"adaptive"``, ``"geodesic-inv"``, ``"geodesic-mix"``)
    geometry: str
    #: ``"worst"`` (Auto-PGD) or ``"average"``
    measure: str
    #: the Auto-PGD iterations per batch
    n_iters: int
    #: forward passes of the model in all, the retraction check's included
    n_forward: int
    #: backward passes of the model in all
    n_backward: int
    #: seconds of the whole call (its set-up shared among the radii of a sweep)
    time_s: float
    #: the options the value was computed with (every option of :func:`sharpness` but ``layout``,
    #: ``loss_fn`` and ``progress``), ``compute_dtype`` (``"model"``, or float32 upcast from half
    #: precision) and ``world_size`` (the processes of a sharded run; 1 in one process): enough to
    #: repeat it
    options: Dict[str, Any] = field(default_factory=dict)
    #: per batch (S_exact − S)/S at the worst perturbation, for the second-order retraction with
    #: ``check_retraction`` (empty otherwise); −inf where the exact geodesic left the manifold
    retraction_gaps: List[float] = field(default_factory=list)
    #: per batch (worst case), the share of the worst perturbation's squared metric norm that lies
    #: in the GL (quotient) blocks, the rest being in the elementwise blocks
    #: (``ProductBall.quotient_share``); empty for average-case sharpness
    gl_norm_shares: List[float] = field(default_factory=list)
    #: per batch (worst case), the share of the worst perturbation's squared metric norm on the
    #: weights of the layout's GL blocks (the attention weights), in every geometry: for the
    #: geodesic ones it is ``gl_norm_shares``; for adaptive the blocks are those detected from the
    #: model (or of ``layout=``), which says where an adaptive perturbation lives on the same
    #: weights. Empty where no attention block is found, and for average-case sharpness
    attention_norm_shares: List[float] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.measure}-case {self.geometry} sharpness (rho={self.rho:g}): {self.value:.6g} "
                f"over {len(self.per_batch)} batch(es); initial loss "
                f"{sum(self.init_losses) / len(self.init_losses):.4g}, {self.n_forward} forward / "
                f"{self.n_backward} backward passes in {self.time_s:.2f} s")



@document_options
def sharpness(model: torch.nn.Module, batches: Iterable[Union[Tuple[Any, Any], Mapping[str, Any]]], *,
              rho: float, **options: Unpack[SharpnessKwargs]) -> SharpnessResult:
    r"""Worst-case (Auto-PGD) or average-case sharpness of ``model`` on ``batches``.

    Parameters
    ----------
    model: any ``torch.nn.Module``; never modified. A float16 / bfloat16 model is evaluated in
        float32 at its trained weights: the value is the sharpness of the same weights in float32
        (half precision would round the perturbations away). A model sharded with FSDP2
        (``fully_shard``) is measured sharded: call this on every rank, each with its own batches
        (the loss is the mean over the ranks); its layout is detected and verified on the shards,
        and the result is the same on every rank (docs/distributed.md).
    batches: iterable of either

        * ``(inputs, targets)``: ``inputs`` is a tensor (``model(inputs)``) or a dict of tensors
          (``model(**inputs)``); the loss is ``loss_fn(outputs, targets)``;
        * a dict of keyword arguments (a Hugging Face batch as the DataLoader yields it, e.g.
          ``{"input_ids", "attention_mask", "labels"}``): ``model(**batch)``, and the loss is
          ``loss_fn(outputs, batch["labels"])`` when ``loss_fn`` is given, else the model's own
          ``outputs.loss``. For causal LMs ``loss_fn=next_token_loss`` is the shifted next-token
          cross-entropy, the loss HF computes from ``labels``.
    rho: radius of the ball in the combined norm (docs/maths.md §6.3): a finite number > 0 (a Python or
        numpy scalar or a 0-d array / tensor). Not comparable across geometries: mix is not
        scale-free (docs/maths.md §12.14).
    {options}

    The options (all but ``model``, ``batches`` and ``rho``) are the fields of
    :class:`~quotient_manifolds.adapters.options.SharpnessOptions`, checked before any work: an
    unknown name or an out-of-range value is refused, naming it. Their names and types are also
    :class:`~quotient_manifolds.adapters.options.SharpnessKwargs`, which type checkers (mypy,
    pyright) and editors read: a misspelt option is flagged before the call runs.

    For sharpness as a function of rho use :func:`sharpness_sweep`: it warm-starts each radius
    from the worst point of the previous one, so a larger ball never returns a smaller maximum.

    Returns
    -------
    SharpnessResult
        ``value`` (the mean over the batches of max L(w ⊕ ξ) − L(w), or of the average rise for
        ``measure="average"``), with the per-batch values, losses, norms and the options used.

    Raises
    ------
    InvalidArgument, InvalidArgumentType
        A bad ``rho``, option, batch or loss (``ValueError`` / ``TypeError`` subclasses), before any
        work; an input the model's first layer cannot take, naming the batch.
    SymmetryError
        A geodesic geometry on a model whose detected layout does not verify (its blocks' group
        would change the function); ``allow_unsupported=True`` measures the verified blocks only.
    UnsupportedModel
        A geodesic geometry on a model with no GL block.
    SharpnessOutOfMemoryError
        The run does not fit the device; the message says what would.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> result = adapters.sharpness(model, batches, geometry="geodesic-inv", rho=0.1, n_iters=5,
    ...                             loss_fn=torch.nn.MSELoss())
    >>> round(result.value, 3), len(result.per_batch)
    (0.108, 1)
    """
    rho = as_rho(rho)
    return run_sharpness(model, batches, [rho], SharpnessOptions.from_keywords(options), stacklevel=3)[0]


@document_options
def sharpness_sweep(model: torch.nn.Module, batches: Iterable[Any], rhos: Sequence[float],
                    **options: Unpack[SharpnessKwargs]) -> List[SharpnessResult]:
    """Worst-case sharpness at increasing radii ``rhos`` (options as :func:`sharpness`).

    The ball's frames are built once; on every batch the Auto-PGD run at ρ_k starts from the worst
    perturbation found at ρ_{k−1} (inside the larger ball), so the values never decrease along the
    sweep, which independent single-start runs do not guarantee. Costs one Auto-PGD run per
    radius and batch, like separate calls, minus the repeated set-up.

    Parameters
    ----------
    model, batches:
        As for :func:`sharpness`.
    rhos:
        The radii, finite, > 0 and increasing.
    options:
        The options of :func:`sharpness` (:class:`~quotient_manifolds.adapters.options.SharpnessKwargs`);
        ``measure`` must be ``"worst"``.

    Returns
    -------
    list of SharpnessResult
        One result per radius, in the order of ``rhos``; the values never decrease.

    Raises
    ------
    InvalidArgument, InvalidArgumentType
        Radii that are not increasing positive numbers, or a bad option, batch or loss.
    SymmetryError, UnsupportedModel, SharpnessOutOfMemoryError
        As for :func:`sharpness`.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> results = adapters.sharpness_sweep(model, batches, [0.05, 0.1], geometry="geodesic-inv",
    ...                                    n_iters=5, loss_fn=torch.nn.MSELoss())
    >>> [round(r.value, 3) for r in results]
    [0.053, 0.108]
    """
    args = SharpnessOptions.from_keywords(options)
    if isinstance(rhos, (str, bytes)) or not isinstance(rhos, Iterable) or getattr(rhos, "ndim", 1) != 1:
        raise InvalidArgumentType(f"rhos must be a sequence of radii, got {rhos!r} ({type(rhos).__name__})")
    radii = [as_rho(r, f"rhos[{i}]") for i, r in enumerate(rhos)]
    if not radii or any(b <= a for a, b in zip(radii, radii[1:])):
        raise InvalidArgument(f"rhos must be a non-empty, strictly increasing sequence of radii, got "
                              f"{list(rhos)!r}")
    if args.measure != "worst":
        raise InvalidArgument("sharpness_sweep chains worst-case runs; for average-case sharpness call "
                              "sharpness(..., measure='average') per radius")
    return run_sharpness(model, batches, radii, args, stacklevel=3)


def run_sharpness(model: torch.nn.Module, batches: Iterable[Any], rhos: Sequence[float],
                  options: SharpnessOptions, *, stacklevel: int = 2) -> List[SharpnessResult]:
    """One :class:`SharpnessResult` per radius of ``rhos`` (each > 0, increasing: on every batch the
    run at a radius starts from the worst point at the one before), with ``options`` checked: the
    body of :func:`sharpness` and :func:`sharpness_sweep`. ``stacklevel`` is that of the warnings
    as if this function's caller issued them.

    The model passes each module of the set-up once, in this order: its checks (``validation``),
    whether it is sharded, its placement (:mod:`~quotient_manifolds.adapters.placement`: where the
    run's tensors live), the memory guard and eval mode for the whole call, the gate (weights,
    layout detected or checked, verified on the first batch), then the closure that evaluates it."""
    check.module("model", model)
    check.batches("batches", batches)
    what = f"{options.geometry} sharpness"
    materialised(model, what)
    tokens = check.TokenInputs(model)
    # the placement (module placement): whether the model is sharded decides where tensors live
    placement: Placement = ShardedPlacement(model, what) if is_sharded(model) else LocalPlacement(model)
    with explained_out_of_memory(model, what, options.solver_dtype), placement.session():
        prepared = placement.prepare(batches, options, tokens, stacklevel + 1)
        started = time.perf_counter()
        with bounded_threads(prepared.num_threads):
            ball, closure = placement.build(prepared, options)
            runs = _run_batches(ball, closure, prepared, tokens, rhos, options, placement)
    setup = time.perf_counter() - started - sum(r["time"] for at in runs for r in at)
    results = []
    for rho, at in zip(rhos, runs):  # a loop, not a comprehension: its frame would shift the warnings
        result = _result(rho, at, options, setup / len(rhos), prepared.upcast, stacklevel + 1)
        result.options["world_size"] = placement.world_size
        results.append(result)
    return results


def _run_batches(ball: ProductBall, closure: Any, prepared: Prepared, tokens: check.TokenInputs,
                 rhos: Sequence[float], options: SharpnessOptions, placement: Placement
                 ) -> List[List[Dict[str, Any]]]:
    """The runs (dicts of losses, norms, pass counts, shares, time) per radius and per batch, on
    ``ball`` with ``closure`` (the batch set per batch); the progress bar (``options.progress``)
    in the placement's main process, the random directions of ``measure="average"`` from its
    generator seed."""
    runs: List[List[Dict[str, Any]]] = [[] for _ in rhos]
    bar = None
    try:
        check_gap = (options.check_retraction and options.retraction == "second_order"
                     and options.measure == "worst" and ball.has_quotients)
        generator = torch.Generator(device=prepared.device).manual_seed(placement.seed_of(options.seed))
        on_iteration = None
        if options.progress and placement.is_main:
            from tqdm.auto import tqdm
            steps = options.n_iters if options.measure == "worst" else options.n_samples
            bar = tqdm(total=None if prepared.n_batches is None else prepared.n_batches * steps * len(rhos),
                       desc=f"{options.geometry} sharpness", unit="it")
            on_iteration = lambda k, loss: bar.update(1)  # noqa: E731
        for index, batch in enumerate(prepared.batches):
            inputs, targets, own_loss = split_batch(tokens, batch, index, options.loss_fn, options.normalize_logits)
            closure.loss_fn = None if own_loss else (options.loss_fn or default_loss)
            closure.inputs = to_device(inputs, prepared.device, prepared.upcast)
            closure.targets = to_device(targets, prepared.device, prepared.upcast)
            if bar is not None:
                bar.set_postfix(batch=index)
            previous = None
            for runs_at, rho in zip(runs, rhos):
                started_at = time.perf_counter()
                try:
                    if options.measure == "worst":
                        previous, run = _worst_case_run(ball, closure, rho, options, previous, prepared,
                                                        check_gap, on_iteration)
                    else:
                        res = average_case(ball, closure, rho, n_samples=options.n_samples,
                                           generator=generator, on_iteration=on_iteration)
                        run = dict(init=res.init_loss, worst=res.mean_loss, norm=rho,
                                   fwd=1 + options.n_samples, bwd=0, gap=None)
                except RuntimeError as err:   # inputs the model cannot take, named
                    raise_explained(err, placement.model, index)
                run["time"] = time.perf_counter() - started_at
                runs_at.append(run)
        if not runs[0]:
            raise InvalidArgument("`batches` is empty: pass at least one (inputs, targets) pair or "
                                  "dict batch")
    finally:
        if bar is not None:
            bar.close()
    return runs


def _worst_case_run(ball: ProductBall, closure: Any, rho: float, options: SharpnessOptions,
                    previous: Optional[APGDResult], prepared: Prepared, check_gap: bool,
                    on_iteration: Optional[Callable[[int, float], None]]) -> Tuple[APGDResult, Dict[str, Any]]:
    """One Auto-PGD run on the closure's batch, warm-started at ``previous`` (the run at the radius
    before): its result and its record."""
    res = auto_pgd(ball, closure, rho, n_iters=options.n_iters, momentum=options.momentum,
                   step_normalization=options.step_normalization, step_size_mult=options.step_size_mult,
                   on_iteration=on_iteration, keep_worst_gradient=options.keep_worst_gradient,
                   solver_dtype=options.solver_dtype,
                   start=None if previous is None else (previous.xi, previous.init_loss))
    check.ascent_found(res, rho, stacklevel=5)  # as if sharpness() warned
    share = ball.quotient_share(res.xi)
    covered = prepared.covered
    attention = (share if options.spec.geodesic and prepared.layout.blocks else
                 ball.share_on(res.xi, covered) if covered else None)
    run = dict(init=res.init_loss, worst=res.worst_loss, norm=res.norm, fwd=res.n_forward,
               bwd=res.n_backward, gap=None, share=share, attention=attention)
    if check_gap:
        run["gap"] = _retraction_gap(ball, closure, res)
        run["fwd"] += 1
    return res, run


def _result(rho: float, runs: List[Dict[str, Any]], options: SharpnessOptions, setup_s: float,
            upcast: bool, stacklevel: int) -> SharpnessResult:
    """The :class:`SharpnessResult` of the runs at ``rho`` (one per batch), with a warning when the
    second-order step is off the exact geodesic beyond ``retraction_tolerance``."""
    per_batch = [r["worst"] - r["init"] for r in runs]
    gaps = [r["gap"] for r in runs] if runs[0]["gap"] is not None else []
    tolerance = options.retraction_tolerance
    bad = [(i, g) for i, g in enumerate(gaps) if not abs(g) <= tolerance]
    if bad:
        i, g = max(bad, key=lambda item: abs(item[1]) if math.isfinite(item[1]) else math.inf)
        worst_gap = (f"sharpness {g:+.0%} relative on batch {i}" if math.isfinite(g) else
                     f"on batch {i} the exact geodesic leaves the manifold before reaching it")
        warnings.warn(
            f"{options.geometry} sharpness at rho={rho:g}: the second-order geodesic step is off the "
            f"exact geodesic at the worst perturbation ({worst_gap}; "
            f"{len(bad)} of {len(gaps)} batches beyond {tolerance:.0%}). "
            f"rho is past the range where x + ξ − ½Γ(ξ, ξ) approximates the geodesic for this "
            f"model; use retraction='exact' or a smaller rho", UserWarning, stacklevel=stacklevel)
    recorded = {k: v for k, v in options.as_dict().items() if k not in ("layout", "loss_fn", "progress")}
    recorded["compute_dtype"] = "float32 (upcast from half precision)" if upcast else "model"
    if options.solver_dtype is not None:  # a record stays plain data (JSON)
        recorded["solver_dtype"] = str(options.solver_dtype)
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=per_batch,
        init_losses=[r["init"] for r in runs], worst_losses=[r["worst"] for r in runs],
        norms=[r["norm"] for r in runs], rho=rho, geometry=options.geometry, measure=options.measure,
        n_iters=options.n_iters, n_forward=sum(r["fwd"] for r in runs),
        n_backward=sum(r["bwd"] for r in runs), time_s=setup_s + sum(r["time"] for r in runs),
        options=recorded, retraction_gaps=gaps, gl_norm_shares=[r["share"] for r in runs if "share" in r],
        attention_norm_shares=[r["attention"] for r in runs if r.get("attention") is not None])


def _exact_points(ball: ProductBall, xi) -> list:
    """The ball's points at the exact geodesic of ``xi``, integrated with the fewest RK4 steps
    (1, 2, 4, …, at most :data:`CHECK_EXACT_STEPS`) whose endpoint agrees with the previous one to
    :data:`CHECK_AGREEMENT` of its distance from the second-order point, or to the rounding of
    the weights. On trained weights one or two steps agree (the check then costs a fraction of a
    fixed number of steps); where the geodesic bends fast, the most steps are taken. A ValueError
    (the integration left the manifold) is raised only at the most steps. On a sharded ball every
    decision is taken alike on all ranks (sums and votes over them)."""
    quotients = {i: c for i, c in enumerate(ball.components) if getattr(c, "quotient", False)}
    second = {i: c.point(xi[i]) for i, c in quotients.items()}
    steps, previous = 1, None
    while True:
        try:
            current = {i: c.point(xi[i], "exact", steps) for i, c in quotients.items()}
        except ValueError:
            current = None
        if not ball.on_every_rank(current is not None, xi[0].device):  # left the manifold on a rank
            if steps >= CHECK_EXACT_STEPS:
                raise InvalidArgument("the exact geodesic leaves the manifold")
            current = None
        if steps >= CHECK_EXACT_STEPS or (
                previous is not None and current is not None
                and _endpoints_agree(ball, previous, current, second, xi[0].device)):
            break
        previous, steps = current, 2 * steps
    return [current[i] if i in current else c.point(a, "exact", steps)
            for i, (c, a) in enumerate(zip(ball.components, xi))]


def _endpoints_agree(ball: ProductBall, previous: dict, current: dict, second: dict,
                     device: torch.device) -> bool:
    """‖current − previous‖ ≤ CHECK_AGREEMENT·‖current − second‖ + (the rounding of the weights),
    over all quotient components' points (float64 sums, over every rank of a sharded ball)."""
    def flat(points):
        for p in points.values():
            yield from (p if isinstance(p, (list, tuple)) else [p])

    sums = torch.zeros(3, dtype=torch.float64, device=device)  # a collective's tensor: on the ball's device
    floor_eps = 1e-6
    for p, c, s2 in zip(flat(previous), flat(current), flat(second)):
        c64 = c.double()
        sums += torch.stack([(c64 - p.double()).square().sum(), (c64 - s2.double()).square().sum(),
                             c64.square().sum()]).to(device)
        floor_eps = max(floor_eps, 4 * torch.finfo(c.dtype).eps)
    change, gap, size = (float(v) for v in ball.sum_over_ranks(sums))
    if not math.isfinite(change + gap + size):   # a blown-up integration agrees with nothing
        return False
    return math.sqrt(change) <= CHECK_AGREEMENT * math.sqrt(gap) + floor_eps * math.sqrt(size)


def _retraction_gap(ball: ProductBall, closure: Callable, res) -> float:
    """Relative gap (S_exact − S)/S between the sharpness at the exact geodesic of the worst ξ and
    the second-order value S; ±inf when the geodesic leaves the manifold (G or H lose rank)."""
    try:
        with torch.no_grad():
            exact = float(closure(_exact_points(ball, res.xi)))
    except ValueError:
        return -math.inf
    rise = res.worst_loss - res.init_loss
    return (exact - res.init_loss) / rise - 1 if rise > 0 else 0.0
