r"""The Riemannian Hessian of the loss on the quotient at the trained weights, as a symmetric linear
operator for curvlinops (trace, top eigenvalues, spectral density).

Setting
-------
The coordinates are those of the sharpness ball (:func:`~quotient_manifolds.adapters.ball.build_ball`, docs/maths.md
§6.2–§6.3) at the trained weights w⁰: per quotient component c the stacked block heads
x_c = [G; H] ∈ R^{B_c×(n+m)×h}, and one flat vector w of every other trainable weight. The total
space carries the product metric

    g = ⊕_c g_c ⊕ diag(1/w²),        g_c the inv or mix metric of docs/maths.md §2,

whose Levi-Civita connection is the product of the components' connections. The loss is the
data-set loss of curvlinops' convention, f = Σ_b c_b L_b over the given batches, with c_b = |b|/N
(``reduction="mean"``: each L_b a batch mean, N the number of data points) or c_b = 1 (``"sum"``).

Riemannian Hessian
------------------
For a horizontal u the Hessian of the quotient, lifted, is (docs/maths.md §4)

    Hess f[u] = P_h( D grad[u] + Γ(grad, u) ),        grad = G⁻¹∇f (unprojected),

evaluated per component with that component's slice of the Euclidean Hessian-vector product
∇²f u (u over all components: the Euclidean Hessian couples them, the metric and Γ do not).
Equivalently, as a bilinear form, h(u, v) = g(Hess f[u], v) = uᵀ∇²f v − ∇f·Γ(u, v).

* GL(h) blocks: :meth:`GLFrame.ehess2rhess <quotient_manifolds.core.gl.GLFrame.ehess2rhess>`
  (D grad[u] = (∇²_G[u] N_G + ∇_G DN_G[u], …), Γ of §5.2/§5.3, P_h of the block's group, §13.2).
* Elementwise remainder, metric g_ii = 1/w_i² (adaptive, c = |w|): g_ii depends on w_i alone, so
  the only Christoffel symbol is

      Γ^i_ii = ½ g^{ii} ∂_i g_ii = ½ w_i² · (−2/w_i³) = −1/w_i

  (the Γ of the second-order step w + ξ + ξ²/(2w), docs/maths.md §12.10). With grad = w²⊙∇f,
  D grad[u] = w²⊙∇²f u + 2w⊙∇f⊙u and Γ(grad, u) = −w⊙∇f⊙u, hence

      Hess f[u] = w² ⊙ (∇²f u) + w ⊙ ∇f ⊙ u,       h(u, v) = uᵀ∇²f v + Σ_i u_i v_i ∂_i f / w_i

  (:func:`elementwise_rhess`). Entries with w = 0 have no tangent direction (docs/maths.md §12.12).

Hessian-vector products ∇²f u come from a double backward through
``torch.func.functional_call`` at the trained weights (the model is never modified): ∇f =
autograd.grad(f, x, create_graph=True), then ∇²f u = autograd.grad(∇f, x, grad_outputs=u), one
forward and one backward per batch and product set, one more backward per vector. The model runs in
eval mode, with ``scaled_dot_product_attention`` on its math kernel (the fused kernels have no
double backward).

Orthonormal coordinates: why and how
------------------------------------
h is symmetric on the horizontal space, but the map u ↦ Hess f[u] is self-adjoint for g, not in
Euclidean coordinates (G·Hess is symmetric, Hess is not), so Lanczos and Hutchinson cannot be run on
it directly. The operator therefore works in the coordinates η of an orthonormal frame given by the
metric square root S = N^{1/2}, N = G⁻¹ the inverse metric weights (g(Sη, Sη) = ‖η‖²):

    GL block:     S η = (η_G N_G^{1/2}, η_H N_H^{1/2})    (inv: N = (P, Q); mix: N = (Q⁻¹, P⁻¹))
    elementwise:  S η = |w| ⊙ η                           (0 on the fixed entries w = 0)

and the operator is

    A = Sᵀ G P_h Hess P_h S,    A η = Hess f[P_h(S η)] N^{-1/2}   (elementwise: Hess f[|w|η] / |w|).

Properties (P_h is the g-orthogonal projector, G P_h = P_hᵀ G, and S Sᵀ = G⁻¹):

* Π := Sᵀ G P_h S is a Euclidean orthogonal projector (symmetric and idempotent) of rank dim H, the
  horizontal dimension, and η ↦ P_h S η is an isometry from range Π onto H.
* ζᵀ A η = h(P_h S ζ, P_h S η): A is symmetric, and A = Π A Π.
* On range Π, A is the matrix of the Riemannian Hessian in a g-orthonormal basis of H: its
  eigenvalues are those of the Riemannian Hessian of the quotient and tr A = tr Hess f.
* **Vertical directions are kept and give exact zeros** (nothing is removed from the coordinate
  space): A η = 0 for η ∈ ker Π = S⁻¹V (P_h kills the vertical space V of each block's group) and
  for the coordinates of fixed elementwise entries (w = 0, or entries owned by a GL block).

Dimension count: ``op.shape = (D, D)`` with D the number of ball coordinates (Σ_c B_c(n+m)h plus
every entry of the elementwise vector); ``op.quotient_dim`` = Σ_c B_c((n+m)h − dim 𝔤_c) + #movable
elementwise entries = rank Π. Of the D eigenvalues, D − quotient_dim are these structural zeros; the
other quotient_dim are the Riemannian Hessian's (some may vanish too, e.g. for weights the loss
ignores). Traces need no correction: the structural zeros add nothing.

For ``geometry="adaptive"`` (every weight elementwise) this is the closed form
A = D_|w| ∇²f D_|w| + diag(w ⊙ ∇f). The Riemannian Hessian includes the connection term because
the gradient does not vanish at trained weights; with the invariant metrics and the group's
horizontal space its spectrum and trace do not depend on the representative of the orbit
(per-head reparametrisations of the attention blocks), unlike those of ∇²f. With a relaxation
ε > 0 the metric, and so the spectrum, is only approximately invariant (docs/maths.md §6.4).

curvlinops
----------
curvlinops' ``CurvatureLinearOperator`` is a map on the model's parameter space with ``(X, y)``
batches and a loss module carrying ``reduction``; this operator acts on the ball's coordinates and
accepts Hugging Face dict batches with the model's own loss, so it subclasses curvlinops' base
``PyTorchLinearOperator`` (custom ``_matmat``, ``SELF_ADJOINT = True``, ``device``, ``dtype``).
It works with ``curvlinops.hutchinson_trace``, ``hutchpp_trace``, ``lanczos_approximate_spectrum``
and ``op.to_scipy()`` for ``scipy.sparse.linalg.eigsh``; :func:`trace` and :func:`top_eigenvalues`
wrap them.
"""

from __future__ import annotations

import numbers
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch

try:
    from curvlinops._torch_base import PyTorchLinearOperator
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"the Riemannian Hessian operator needs curvlinops ({err}). Install what it needs, then "
        f"curvlinops itself without its requirements (one of them, backpack-for-pytorch, pulls "
        f"torchvision and with it a newer torch build): pip install linear_operator einops einconv "
        f"opt_einsum (or the [hessian] extra of quotient-manifolds) && pip install --no-deps "
        f"curvlinops-for-pytorch"
    ) from err

from quotient_manifolds._runtime import bounded_threads
from quotient_manifolds._validation import choice, flag
from quotient_manifolds.core.groups import sym
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, NonFiniteLoss, NotSupported

from . import validation as check
from .ball import ball_of, geometry_of
from .components import QuotientComponent
from .elementwise import ElementwiseComponent
from .evaluation import ModelClosure, weighted_batches
from .gate import pre_run_checks
from .modes import second_order_mode
from .sharded import is_sharded
from .validation import materialised

Tensor = torch.Tensor

REDUCTIONS = ("mean", "sum")
TRACE_METHODS = ("hutch++", "hutchinson", "exact")


def elementwise_rhess(w: Tensor, egrad: Tensor, ehess_u: Tensor, u: Tensor) -> Tensor:
    r"""Riemannian Hessian of the elementwise metric Σ ξ²/w² (module docstring):

        Hess f[u] = w² ⊙ (∇²f u) + w ⊙ ∇f ⊙ u,

    i.e. D grad[u] + Γ(grad, u) with grad = w²⊙∇f and the only Christoffel symbol Γ^i_ii = −1/w_i.
    ``w`` is 0 on fixed entries (their u is 0 too)."""
    return w * w * ehess_u + w * egrad * u


def _spd_sqrt_pair(N: Tensor) -> Tuple[Tensor, Tensor]:
    """(N^{1/2}, N^{-1/2}) of a batch of SPD matrices (symmetric square roots, eigh)."""
    lam, V = torch.linalg.eigh(0.5 * (N + N.mT))
    root = lam.clamp_min(torch.finfo(lam.dtype).tiny).sqrt()
    return (V * root[..., None, :]) @ V.mT, (V / root[..., None, :]) @ V.mT


class RiemannianHessian(PyTorchLinearOperator):
    r"""The Riemannian Hessian of the loss on the quotient in orthonormal-frame coordinates,
    A η = Hess f[P_h(Sη)] N^{-1/2} (module docstring). Build it with :func:`riemannian_hessian`.

    Symmetric (``SELF_ADJOINT``); acts on vectors of length ``shape[1]`` = the number of ball
    coordinates (or tensor lists with the shapes of ``components``' points, curvlinops' list format).
    Eigenvalues: those of the Riemannian Hessian (``quotient_dim`` of them) and exact zeros on the
    vertical directions and fixed entries. Attributes: ``loss`` and ``gradient`` (Euclidean, per
    component) of f at w⁰, ``num_data``, ``names`` of the components, ``quotient_dim``.

    Parameters
    ----------
    model, ball, write_back, params0, ...:
        Set up by :func:`riemannian_hessian`, which validates what the user passes; do not build
        it directly.

    Raises
    ------
    FloatingPointError
        The loss is not finite at the trained weights.
    TypeError
        A ball component of a kind the operator cannot act on.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> op = adapters.riemannian_hessian(model, batches, loss_fn=torch.nn.MSELoss())
    >>> op.shape, op.quotient_dim, op.num_data          # 172 weights, 144 quotient coordinates
    ((172, 172), 144, 3)
    >>> v = torch.randn(172, dtype=torch.float64)
    >>> torch.allclose(v @ (op @ (2 * v)), 2 * (v @ (op @ v)))   # a linear operator
    True
    """

    SELF_ADJOINT = True

    def __init__(self, model: torch.nn.Module, ball, write_back: Callable, params0: Dict[str, Tensor],
                 buffers: Dict[str, Tensor], data: List[Tuple[Any, Any, Optional[Callable], float]],
                 num_data: int, geometry: str):
        self.model = model
        self.ball = ball
        self.components = ball.components
        self.names = [c.name for c in self.components]
        self.geometry = geometry
        self.num_data = num_data
        self._closure = ModelClosure(model, params0, buffers, write_back, None, False)
        self._data = data
        self._dtype = params0[next(iter(params0))].dtype
        for p in params0.values():
            self._dtype = torch.promote_types(self._dtype, p.dtype)
        self._device = next(iter(params0.values())).device
        super().__init__([tuple(c.x0.shape) for c in self.components],
                         [tuple(c.x0.shape) for c in self.components])
        # metric square roots S = N^{1/2} and S⁻¹ = N^{-1/2}, per component
        self._roots: List[Any] = []
        dim = 0
        for c in self.components:
            if isinstance(c, QuotientComponent):
                with bounded_threads(c.threads):
                    N_G, N_H = c.frame.inverse_metric_weights
                    self._roots.append((_spd_sqrt_pair(N_G), _spd_sqrt_pair(N_H)))
                dim += c.x0.shape[0] * c.frame.geometry.dim
            elif isinstance(c, ElementwiseComponent):
                self._roots.append(c.inv_w2.sqrt())    # 1/|w|, 0 on fixed entries
                dim += int((c.inv_w2 > 0).sum())
            else:  # pragma: no cover - build_ball makes only these two kinds
                raise InvalidArgumentType(f"unsupported ball component {type(c).__name__}")
        self.quotient_dim = dim
        self.loss, self.gradient = self._loss_and_gradient()

    # ------------------------------------------------------------------ curvlinops interface
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def __repr__(self) -> str:
        return (f"RiemannianHessian(geometry={self.geometry!r}, shape={self.shape}, "
                f"quotient_dim={self.quotient_dim}, components={self.names})")

    # ------------------------------------------------------------------ data passes
    def _batch_loss(self, leaves: List[Tensor], batch) -> Tensor:
        inputs, targets, loss_fn, weight = batch
        self._closure.inputs, self._closure.targets, self._closure.loss_fn = inputs, targets, loss_fn
        loss = self._closure(leaves) * weight
        if not torch.isfinite(loss.detach()):
            raise NonFiniteLoss(f"the loss is not finite ({float(loss.detach())}) at the "
                                f"trained weights: check the model, its inputs and targets")
        return loss

    def _leaves(self) -> List[Tensor]:
        return [c.x0.detach().requires_grad_(True) for c in self.components]

    def _loss_and_gradient(self) -> Tuple[float, List[Tensor]]:
        total = 0.0
        grads = [torch.zeros_like(c.x0) for c in self.components]
        with second_order_mode(self.model):
            for batch in self._data:
                leaves = self._leaves()
                loss = self._batch_loss(leaves, batch)
                for acc, g in zip(grads, torch.autograd.grad(loss, leaves, allow_unused=True)):
                    if g is not None:
                        acc.add_(g)
                total += float(loss.detach())
        return total, grads

    def euclidean_hvp(self, us: List[Tensor]) -> List[Tensor]:
        """∇²f u by double backward, for K vectors at once: ``us[c]`` of shape ``(K, *x0_c.shape)``."""
        K = us[0].shape[0]
        out = [torch.zeros_like(u) for u in us]
        with second_order_mode(self.model):
            for batch in self._data:
                leaves = self._leaves()
                loss = self._batch_loss(leaves, batch)
                grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
                # gradients that do not depend on the weights have a zero Hessian row (and column)
                live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
                if not live:
                    continue
                for k in range(K):
                    hv = torch.autograd.grad([grads[i] for i in live], leaves,
                                             grad_outputs=[us[i][k].to(leaves[i].dtype) for i in live],
                                             retain_graph=k < K - 1, allow_unused=True)
                    for acc, h in zip(out, hv):
                        if h is not None:
                            acc[k].add_(h)
        return out

    # ------------------------------------------------------------------ the operator
    def lift(self, etas: List[Tensor]) -> List[Tensor]:
        """u = P_h(S η): orthonormal-frame coordinates ``(K, *shape)`` → horizontal tangent vectors."""
        us = []
        for c, root, eta in zip(self.components, self._roots, etas):
            if isinstance(c, QuotientComponent):
                (S_G, _), (S_H, _) = root
                e = eta.to(S_G.dtype)
                n = c.frame.geometry.n
                with bounded_threads(c.threads):
                    us.append(c.frame.project(torch.cat((e[..., :n, :] @ S_G, e[..., n:, :] @ S_H), -2)))
            else:
                us.append(eta.to(c.x0.dtype) * c.abs_w)
        return us

    def _matmat(self, X: List[Tensor]) -> List[Tensor]:
        etas = [x.movedim(-1, 0) for x in X]          # curvlinops' trailing column axis first
        us = self.lift(etas)
        hvps = self.euclidean_hvp(us)
        out = []
        for c, root, eta, u, hv, g in zip(self.components, self._roots, etas, us, hvps,
                                          self.gradient):
            if isinstance(c, QuotientComponent):
                (_, Si_G), (_, Si_H) = root
                n = c.frame.geometry.n
                with bounded_threads(c.threads):
                    r = c.frame.ehess2rhess(g, hv, u)          # horizontal, in float64
                y = torch.cat((r[..., :n, :] @ Si_G, r[..., n:, :] @ Si_H), -2)
            else:
                w = c.x0 * (root > 0)                           # signed w, 0 on fixed entries
                y = elementwise_rhess(w, g, hv, u) * root       # Hess f[|w|η] / |w|
            out.append(y.to(self._dtype).movedim(0, -1))
        return out


# ---------------------------------------------------------------------------------- public API
def riemannian_hessian(model: torch.nn.Module,
                       batches: Iterable[Union[Tuple[Any, Any], Mapping[str, Any]]], *,
                       geometry: str = "geodesic-mix", layout=None,
                       loss_fn: Optional[Callable] = None, reduction: Optional[str] = None,
                       batch_size_fn: Optional[Callable[[Any], int]] = None, gram_eps: float = 0.0,
                       allow_unsupported: bool = False, unsafe: bool = False) -> RiemannianHessian:
    r"""The Riemannian Hessian of the loss of ``model`` on ``batches`` at its trained weights, on the
    quotient of its attention blocks, as a symmetric curvlinops linear operator (module docstring).

    Parameters
    ----------
    model: any ``torch.nn.Module``; never modified (evaluated in eval mode through
        ``torch.func.functional_call``; every submodule's train flag is restored after each pass).
        Half-precision models are evaluated in float32, as in :func:`~quotient_manifolds.adapters.sharpness`.
    batches: a re-iterable of ``(inputs, targets)`` pairs or Hugging Face dict batches (as in
        :func:`~quotient_manifolds.adapters.sharpness`); an iterator is materialised once. The same batches
        are traversed for every product.
    geometry: ``"geodesic-mix"`` (default) or ``"geodesic-inv"``: GL blocks on their quotients (each
        block's group: GL(h), the rotary commutant, …) with that metric, every other trainable
        weight with the adaptive metric Σ ξ²/w²; ``"adaptive"``: every weight elementwise.
    layout: a :class:`~quotient_manifolds.adapters.Layout` of this model (default: detected from the model); one
        built for another model (other parameters, shapes or head counts) is refused.
    loss_fn: ``loss_fn(outputs, targets)`` (default mean cross-entropy; the model's own
        ``outputs.loss`` for dict batches without ``loss_fn``).
    reduction: how batch losses combine, as curvlinops does with a data loader: ``"mean"``
        (each batch loss is a mean; f = Σ_b |b|/N · L_b, the mean over all N data points) or
        ``"sum"`` (f = Σ_b L_b). Default: ``loss_fn.reduction`` if it has one, else ``"mean"``.
    batch_size_fn: ``batch_size_fn(inputs)`` = |b| for ``"mean"``, like curvlinops', an integer >= 1
        (default: the leading dimension of the input tensor, of the first tensor of a dict input, or
        of the targets; an empty batch is refused).
    gram_eps: Gram relaxation GᵀG + εI of the quotient metrics (docs/maths.md §6.4).
    allow_unsupported, unsafe: as in :func:`~quotient_manifolds.adapters.sharpness`.

    Returns
    -------
    :class:`RiemannianHessian` of shape (D, D); ``quotient_dim`` of its eigenvalues are the
    Riemannian Hessian's, the rest are exact zeros (vertical directions, fixed weights).
    Use :func:`trace`, :func:`top_eigenvalues`, or ``curvlinops.lanczos_approximate_spectrum(op, ncv)``.

    Raises
    ------
    ValueError, TypeError
        An argument of the wrong kind or out of range, a layout built for another model, or an
        unknown geometry.
    NotImplementedError
        A model sharded with FSDP2.
    SymmetryError
        A block of the layout fails verification (unless ``unsafe``).
    FloatingPointError
        The loss is not finite at the trained weights.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> op = adapters.riemannian_hessian(model, batches, loss_fn=torch.nn.MSELoss())
    >>> round(op.loss, 4)                               # f at the trained weights
    2.0517
    >>> round(float(adapters.top_eigenvalues(op, 1)[0]), 3)
    3.84
    """
    check.module("model", model)
    check.batches("batches", batches)
    check.optional_layout("layout", layout)
    check.optional_callable("loss_fn", loss_fn, "loss_fn(outputs, targets) -> scalar tensor")
    gram_eps = check.non_negative_finite("gram_eps", gram_eps)
    flag("allow_unsupported", allow_unsupported)
    flag("unsafe", unsafe)
    geodesic = geometry_of(geometry).geodesic
    materialised(model, f"{geometry} Hessian")
    if is_sharded(model):
        raise NotSupported(
            "riemannian_hessian on a model sharded with FSDP2 (its parameters are DTensors): the "
            "Hessian operator (curvlinops) multiplies vectors of the whole model in one process. "
            "Compute it on the unsharded model (e.g. on one rank, or a smaller model), or measure "
            "the sharded model with adapters.sharpness, which runs sharded")
    tokens = check.TokenInputs(model)
    if reduction is None:
        reduction = getattr(loss_fn, "reduction", "mean")
    choice("reduction", reduction, REDUCTIONS)
    what, consequence = f"{geometry} Hessian", "its quotient Hessian would be meaningless"
    params0, buffers, upcast, layout, _, gate = pre_run_checks(
        model, layout, geometry=geometry, what=what, consequence=consequence, unsafe=unsafe,
        allow_unsupported=allow_unsupported, undefined="the Hessian",
        no_params=("the Hessian is taken with respect to the trainable weights; set requires_grad=True on "
                   "the weights to include"))
    data, num_data = weighted_batches(tokens, batches, loss_fn, reduction, batch_size_fn,
                                      next(iter(params0.values())).device, upcast)
    if geodesic:           # a geodesic number never comes from an unverified block (adapters.gate)
        layout = gate.accept(data[0][0], stacklevel=2)
    ball, write_back = ball_of(params0, geometry=geometry, layout=layout, gram_eps=gram_eps)
    return RiemannianHessian(model, ball, write_back, params0, buffers, data, num_data, geometry)


def trace(op: PyTorchLinearOperator, *, method: str = "hutch++", num_matvecs: int = 99,
          distribution: str = "rademacher", seed: Optional[int] = 0) -> float:
    """Trace of a square operator (for :class:`RiemannianHessian`: the Riemannian trace).

    ``"hutch++"`` (curvlinops.hutchpp_trace, ``num_matvecs`` rounded down to a multiple of 3),
    ``"hutchinson"`` (curvlinops.hutchinson_trace), or ``"exact"`` (Σ_j (A e_j)_j, D products in
    chunks of 64). The estimators fall back to ``"exact"`` when ``num_matvecs`` ≥ D (curvlinops
    refuses them there, and the exact trace costs no more). ``seed`` fixes the random probes
    without touching the global generator (None: the global one).

    Parameters
    ----------
    op:
        A square operator, e.g. a :class:`RiemannianHessian`.
    method:
        ``"hutch++"`` (default), ``"hutchinson"`` or ``"exact"``.
    num_matvecs:
        Products of the estimators.
    distribution:
        ``"rademacher"`` or ``"normal"`` probes.
    seed:
        Seed of the probes (None: the global generator).

    Returns
    -------
    float
        The trace (estimate).

    Raises
    ------
    ValueError
        ``num_matvecs`` < 1 (< 3 for hutch++), an unknown ``method``, or (from curvlinops) an
        unknown ``distribution``.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> op = adapters.riemannian_hessian(model, batches, loss_fn=torch.nn.MSELoss())
    >>> round(adapters.trace(op, num_matvecs=9), 3)     # hutch++ with 9 products, seed 0
    4.218
    """
    import curvlinops

    choice("method", method, TRACE_METHODS)
    dim = op.shape[0]
    if method != "exact" and num_matvecs >= dim:
        method = "exact"
    if method == "exact":
        total = 0.0
        for start in range(0, dim, 64):
            cols = torch.arange(start, min(start + 64, dim), device=op.device)
            E = torch.zeros(dim, len(cols), dtype=op.dtype, device=op.device)
            E[cols, torch.arange(len(cols))] = 1
            total += float((op @ E)[cols, torch.arange(len(cols))].sum())
        return total
    if num_matvecs < 1 or (method == "hutch++" and num_matvecs < 3):
        raise InvalidArgument(f"num_matvecs must be ≥ 1 (≥ 3 for hutch++), got {num_matvecs}")
    with _seeded(seed, op.device):
        if method == "hutch++":
            return float(curvlinops.hutchpp_trace(op, num_matvecs - num_matvecs % 3, distribution))
        return float(curvlinops.hutchinson_trace(op, num_matvecs, distribution))


def top_eigenvalues(op: PyTorchLinearOperator, k: int = 1, *, which: str = "LA", tol: float = 0.0,
                    seed: Optional[int] = 0) -> Tensor:
    """The ``k`` largest (``which="LA"``; ``"SA"`` smallest, ``"LM"`` largest magnitude) eigenvalues
    of a symmetric operator by Lanczos (``scipy.sparse.linalg.eigsh`` on ``op.to_scipy()``;
    ``tol=0`` is machine precision), sorted in decreasing order, as a float64 tensor. For k ≥ D − 1
    (eigsh needs k < D) the operator is materialised and diagonalised densely.

    Parameters
    ----------
    op:
        A symmetric operator, e.g. a :class:`RiemannianHessian`.
    k:
        How many eigenvalues, 1 ≤ k ≤ D.
    which:
        ``"LA"`` (default), ``"SA"`` or ``"LM"``.
    tol:
        Relative accuracy of Lanczos (0: machine precision).
    seed:
        Seed of the start vector (None: scipy's default).

    Returns
    -------
    Tensor
        The ``k`` eigenvalues, decreasing, float64.

    Raises
    ------
    ValueError
        ``k`` outside [1, D] or an unknown ``which``.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> batches = [(torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    >>> op = adapters.riemannian_hessian(model, batches, loss_fn=torch.nn.MSELoss())
    >>> adapters.top_eigenvalues(op, 2)                 # doctest: +ELLIPSIS
    tensor([3.84..., 2.05...], dtype=torch.float64)
    """
    from scipy.sparse.linalg import eigsh

    choice("which", which, ("LA", "SA", "LM"))
    dim = op.shape[0]
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= dim:
        raise InvalidArgument(f"k must be an integer in [1, {dim}] (the operator's size), got {k!r}")
    k = int(k)       # a NumPy integer too
    if k >= dim - 1:
        eye = torch.eye(dim, dtype=op.dtype, device=op.device)
        vals = torch.linalg.eigvalsh(sym(op @ eye).double().cpu())
        order = {"LA": vals.argsort(descending=True), "SA": vals.argsort(),
                 "LM": vals.abs().argsort(descending=True)}[which]
        vals = vals[order[:k]]
    else:
        v0 = np.random.default_rng(seed).standard_normal(dim) if seed is not None else None
        vals = torch.as_tensor(eigsh(op.to_scipy(dtype=np.float64), k=k, which=which, tol=tol,
                                     v0=v0, return_eigenvectors=False), dtype=torch.float64)
    return vals.sort(descending=True).values


@contextmanager
def _seeded(seed: Optional[int], device: torch.device):
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
