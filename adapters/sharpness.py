r"""Adaptive and geodesic worst-case (and average-case) sharpness of a real model.

``sharpness(model, batches, geometry=..., rho=...)`` turns a :class:`~adapters.layout.Layout` into a
:class:`~adapters.solver.ProductBall` (one batched GL(h) quotient per block shape, the elementwise
adaptive geometry for every other weight) and runs :func:`~adapters.solver.auto_pgd` per batch with a
closure that evaluates the model through ``torch.func.functional_call``. The user's model is never
modified: parameters and buffers are read once, detached; the train/eval flag is restored even after
an exception or KeyboardInterrupt; no ``.grad`` is written (gradients come from
``torch.autograd.grad`` with respect to the perturbation only).

Spec: ``geodesic-sharpness-math.md`` §6 (blocks, total norm, ε), §7.3 (algorithm), §12 (choices).
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.func import functional_call

from quotient_manifolds.core.gl import RETRACTIONS, GLQuotientGeometry, check_choice

from .solver import (
    MOMENTUM_FORMS,
    STEP_NORMALISATIONS,
    ElementwiseComponent,
    ProductBall,
    QuotientComponent,
    auto_pgd,
    average_case,
)

Tensor = torch.Tensor

GEOMETRIES = ("adaptive", "geodesic-inv", "geodesic-mix")
MEASURES = ("worst", "average")


@dataclass
class SharpnessResult:
    """Outcome of :func:`sharpness`. ``value`` is the mean over batches of (worst − initial) loss
    (or mean − initial for ``measure="average"``)."""

    value: float
    per_batch: List[float]
    init_losses: List[float]
    worst_losses: List[float]
    norms: List[float]
    rho: float
    geometry: str
    measure: str
    n_iters: int
    n_forward: int
    n_backward: int
    time_s: float
    options: Dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"{self.measure}-case {self.geometry} sharpness (rho={self.rho:g}): {self.value:.6g} "
                f"over {len(self.per_batch)} batch(es); initial loss "
                f"{sum(self.init_losses) / len(self.init_losses):.4g}, {self.n_forward} forward / "
                f"{self.n_backward} backward passes in {self.time_s:.2f} s")


def default_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Mean cross-entropy on ``outputs`` or on ``outputs.logits`` (Hugging Face outputs)."""
    return F.cross_entropy(logits_of(outputs), targets)


def logits_of(outputs: Any) -> Tensor:
    if isinstance(outputs, Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    raise TypeError(f"cannot find logits in a model output of type {type(outputs).__name__}; pass "
                    f"loss_fn=callable(outputs, targets) -> scalar loss")


def normalize_logits(logits: Tensor) -> Tensor:
    """Andriushchenko et al.'s LogitNormalizationWrapper: centre, then divide by the L2 norm."""
    centred = logits - logits.mean(dim=-1, keepdim=True)
    return centred / centred.norm(dim=-1, keepdim=True).clamp_min(1e-10)


class _ModelClosure:
    """Evaluates the loss of ``model`` on one batch at the perturbed parameters given by a ball."""

    def __init__(self, model: torch.nn.Module, params0: Dict[str, Tensor],
                 buffers: Dict[str, Tensor], write_back: Callable[[List[Tensor]], Dict[str, Tensor]],
                 loss_fn: Callable, normalise: bool):
        self.model, self.params0, self.buffers = model, params0, buffers
        self.write_back, self.loss_fn, self.normalise = write_back, loss_fn, normalise
        self.inputs: Any = None
        self.targets: Any = None

    def __call__(self, points: List[Tensor]) -> Tensor:
        params = self.write_back(points)
        tensors = {**self.buffers, **params}
        if isinstance(self.inputs, Mapping):
            outputs = functional_call(self.model, tensors, args=(), kwargs=dict(self.inputs))
        else:
            outputs = functional_call(self.model, tensors, args=(self.inputs,))
        if self.normalise:
            outputs = normalize_logits(logits_of(outputs))
        return self.loss_fn(outputs, self.targets)


def build_ball(model: torch.nn.Module, params0: Dict[str, Tensor], *, geometry: str,
               layout=None, retraction: str = "second_order", eps: float = 0.0,
               use_metric_norm: bool = True, adaptive_direction: str = "riemannian",
               elementwise_second_order: bool = False
               ) -> Tuple[ProductBall, Callable[[List[Tensor]], Dict[str, Tensor]]]:
    """The ball of perturbations and the map from ball points to a full parameter dict.

    geodesic-*: blocks with equal (n, m, h) are stacked into ONE batched GLQuotientGeometry over all
    their heads (e.g. all QK blocks of a BERT), so the geometry costs a few batched h×h
    factorisations per group; every weight not covered by a GL block (or the uncovered entries of a
    partially covered one) is elementwise. adaptive: every trainable weight is elementwise.
    """
    trainable = list(params0)
    components: List = []
    groups: List[Tuple[List, List[int]]] = []  # (blocks, head counts) per quotient component
    if geometry != "adaptive":
        metric = geometry.split("-", 1)[1]
        by_shape: "OrderedDict[Tuple[int, int, int], List]" = OrderedDict()
        for block in layout.blocks:
            by_shape.setdefault((block.n, block.m, block.head_dim), []).append(block)
        for (n, m, h), blocks in by_shape.items():
            geom = GLQuotientGeometry(n, m, h, metric, retraction=retraction, eps=eps)
            xs = [block.gather(params0).detach().to(torch.float64) for block in blocks]
            x0 = torch.cat(xs, dim=0)
            frame = _frame_or_explain(geom, x0, blocks, xs)
            name = f"GL(h={h}) n={n} m={m} [{len(blocks)} blocks]"
            components.append(QuotientComponent(name, frame, x0, retraction=retraction,
                                                use_metric_norm=use_metric_norm))
            groups.append((blocks, [x.shape[0] for x in xs]))
        masks = getattr(layout, "gl_masks", {})
        elementwise = [(n, ~masks[n].to(params0[n].device) if n in masks else None)
                       for n in layout.adaptive if n in params0]
    else:
        elementwise = [(n, None) for n in trainable]
    # one flat elementwise component per (dtype, device), so each solver step is one pass
    by_kind: "OrderedDict[Tuple, Dict[str, Tensor]]" = OrderedDict()
    mask_of = dict(elementwise)
    for name, _ in elementwise:
        by_kind.setdefault((params0[name].dtype, params0[name].device), {})[name] = params0[name]
    for tensors in by_kind.values():
        components.append(ElementwiseComponent(tensors, masks={n: mask_of[n] for n in tensors},
                                               direction=adaptive_direction,
                                               second_order=elementwise_second_order))
    n_quotient = len(groups)

    def write_back(points: List[Tensor]) -> Dict[str, Tensor]:
        params = dict(params0)
        for comp, point in zip(components[n_quotient:], points[n_quotient:]):
            params.update(comp.unflatten(point))
        for (blocks, counts), point in zip(groups, points[:n_quotient]):
            for block, x in zip(blocks, torch.split(point, counts, dim=0)):
                dtype = params[block.g_pieces[0].param].dtype
                params = block.scatter(params, x.to(dtype))
        return params

    return ProductBall(components), write_back


def _frame_or_explain(geom: GLQuotientGeometry, x0: Tensor, blocks, xs):
    try:
        return geom.frame(x0)
    except ValueError:
        for block, x in zip(blocks, xs):
            try:
                geom.frame(x)
            except ValueError as err:
                raise ValueError(f"GL block {block.name!r} ({block.num_heads} heads, G {block.n}×"
                                 f"{block.head_dim}, H {block.m}×{block.head_dim}): {err}") from None
        raise


def sharpness(model: torch.nn.Module, batches: Iterable[Tuple[Any, Any]], *,
              geometry: str = "geodesic-mix", rho: float, n_iters: int = 20,
              retraction: str = "second_order", loss_fn: Optional[Callable] = None,
              measure: str = "worst", n_samples: int = 10, eps: float = 0.0,
              use_metric_norm: bool = True, momentum: str = "apgd",
              step_normalisation: str = "metric", adaptive_direction: str = "riemannian",
              elementwise_second_order: bool = False, normalize_logits: bool = False,
              step_size_mult: float = 1.0, layout=None,
              allow_unsupported: bool = False, seed: int = 0, progress: bool = False
              ) -> SharpnessResult:
    r"""Worst-case (Auto-PGD) or average-case sharpness of ``model`` on ``batches``.

    Parameters
    ----------
    model: any ``torch.nn.Module``; never modified.
    batches: iterable of ``(inputs, targets)``; ``inputs`` is a tensor (``model(inputs)``) or a dict
        of tensors (``model(**inputs)``).
    geometry: ``"geodesic-mix"`` (default), ``"geodesic-inv"`` (attention blocks on the GL(h)
        quotient with that metric, everything else adaptive) or ``"adaptive"`` (elementwise
        c = |w| everywhere, Andriushchenko et al. / Kwon et al.).
    rho: radius of the ball in the combined norm (spec §6.3). Not comparable across geometries:
        mix is not scale-free (spec §12.14).
    n_iters: Auto-PGD iterations (one forward + one backward each).
    retraction: ``"second_order"`` (x + ξ − ½Γ(ξ,ξ), default), ``"first_order"`` (x + ξ: the
        ablation "no second-order correction"), or ``"exact"`` (geodesic ODE).
    loss_fn: ``loss_fn(outputs, targets)``; default mean cross-entropy on the logits.
    measure: ``"worst"`` (Auto-PGD) or ``"average"`` (mean over ``n_samples`` random horizontal
        directions on the sphere of radius rho; seeded by ``seed``).
    eps: Gram relaxation GᵀG + εI (spec §6.4).
    use_metric_norm: False = ablation "no corrected norm": the GL blocks are measured with the
        elementwise adaptive norm (spec §7.3).
    momentum: ``"apgd"`` (paper Alg. 1), ``"andriushchenko"`` (their code), ``"none"``.
    step_normalisation: ``"metric"`` (step of metric length η) or ``"none"``.
    adaptive_direction: ``"riemannian"`` (∇⊙w², paper Alg. 1 line 12) or ``"andriushchenko"``
        (∇⊙|w|, their code).
    elementwise_second_order: also move the non-attention weights along the second-order geodesic
        w + ξ + ξ²/(2w) of the elementwise metric (spec §12.10; default off: w + ξ).
    normalize_logits: apply Andriushchenko et al.'s logit normalisation before the loss.
    layout: a precomputed :class:`~adapters.layout.Layout` (default: detected from the model).
    allow_unsupported: run even if the layout reports unsupported attention modules (they are
        then treated adaptively) or none at all.
    """
    from .detect import layout as detect_layout

    check_choice(geometry, GEOMETRIES, "geometry")
    check_choice(retraction, RETRACTIONS, "retraction")
    check_choice(measure, MEASURES, "measure")
    check_choice(momentum, MOMENTUM_FORMS, "momentum form")
    check_choice(step_normalisation, STEP_NORMALISATIONS, "step normalisation")
    if not isinstance(rho, (int, float)) or not rho > 0:
        raise ValueError(f"rho must be a number > 0, got {rho!r}")
    if geometry != "adaptive" and layout is None:
        layout = detect_layout(model, allow_unsupported=allow_unsupported)
    if geometry != "adaptive" and not layout.blocks:
        warnings.warn(f"the layout has no GL block (unsupported attention modules: "
                      f"{[u[0] for u in layout.unsupported] or 'none'}); every weight is treated "
                      f"adaptively, so this {geometry} value is adaptive sharpness with the "
                      f"geodesic settings", UserWarning, stacklevel=2)
    loss_fn = loss_fn or default_loss

    params0 = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    for name, p in params0.items():
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"parameter {name!r} contains non-finite values; sharpness is "
                             f"undefined at such weights")
    buffers = {**{n: b for n, b in model.named_buffers()}, **frozen}
    device = next(iter(params0.values())).device

    was_training = model.training
    started = time.perf_counter()
    try:
        model.eval()
        ball, write_back = build_ball(model, params0, geometry=geometry, layout=layout,
                                      retraction=retraction, eps=eps,
                                      use_metric_norm=use_metric_norm,
                                      adaptive_direction=adaptive_direction,
                                      elementwise_second_order=elementwise_second_order)
        closure = _ModelClosure(model, params0, buffers, write_back, loss_fn, normalize_logits)
        generator = torch.Generator(device=device).manual_seed(seed)
        per_batch, init, worst, norms = [], [], [], []
        n_fwd = n_bwd = 0
        iterator = batches
        if progress:
            from tqdm.auto import tqdm
            iterator = tqdm(batches, desc=f"{geometry} sharpness", unit="batch")
        for inputs, targets in iterator:
            closure.inputs = _to_device(inputs, device)
            closure.targets = _to_device(targets, device)
            if measure == "worst":
                res = auto_pgd(ball, closure, rho, n_iters=n_iters, momentum=momentum,
                               step_normalisation=step_normalisation,
                               step_size_mult=step_size_mult)
                init.append(res.init_loss)
                worst.append(res.worst_loss)
                norms.append(res.norm)
                n_fwd += res.n_forward
                n_bwd += res.n_backward
            else:
                res = average_case(ball, closure, rho, n_samples=n_samples, generator=generator)
                init.append(res["init_loss"])
                worst.append(res["mean_loss"])
                norms.append(float(rho))
                n_fwd += 1 + n_samples
            per_batch.append(worst[-1] - init[-1])
        if not per_batch:
            raise ValueError("`batches` is empty: pass at least one (inputs, targets) pair")
    finally:
        model.train(was_training)
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=per_batch, init_losses=init,
        worst_losses=worst, norms=norms, rho=float(rho), geometry=geometry, measure=measure,
        n_iters=n_iters, n_forward=n_fwd, n_backward=n_bwd,
        time_s=time.perf_counter() - started,
        options=dict(retraction=retraction, eps=eps, use_metric_norm=use_metric_norm,
                     momentum=momentum, step_normalisation=step_normalisation,
                     adaptive_direction=adaptive_direction,
                     elementwise_second_order=elementwise_second_order,
                     normalize_logits=normalize_logits,
                     step_size_mult=step_size_mult, n_samples=n_samples, seed=seed))


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
