r"""Relative flatness (Petzka, Kamp, Adilova, Sminchisescu, Boley, NeurIPS 2021): the trace measure
of one feature layer, a curvature measure at the trained weights that rescalings of the layer's
neurons do not change.

Definition
----------
For a linear layer with weight matrix W ∈ R^{m×n} (rows w_s, one per output unit: the weight of an
``nn.Linear``, the transposed weight of a Hugging Face ``Conv1D``) and the loss L of the model on
the given data,

    κ(W) = Σ_{s,s'=1}^{m} ⟨w_s, w_s'⟩ · Tr H_{s,s'},        H_{s,s'} = ∂²L / ∂w_s ∂w_s'ᵀ ∈ R^{n×n},

so Tr H_{s,s'} = Σ_j ∂²L / ∂W_sj ∂W_s'j. With G = W Wᵀ and H the Hessian of L with respect to
W (entries indexed by (s, j)), this is one trace,

    κ(W) = Σ_j Σ_{s,s'} G_{ss'} H_{(s,j),(s',j)} = Tr((G ⊗ I_n) H).

Invariance: multiplying the rows of W by λ_s > 0 and the matching columns of the next layer by
1/λ_s (a neuron-wise rescaling through a ReLU: the function is unchanged) multiplies G_{ss'} by
λ_s λ_s' and H_{(s,j),(s',j)} by 1/(λ_s λ_s'), so κ is unchanged; so does multiplying the layer
before by λ > 0 and W by 1/λ (a layer-wise rescaling). The Hessian trace of the layer, Tr H, and
sharpness in the Euclidean norm change under both.

Computation
-----------
Write G = F Fᵀ with F ∈ R^{m×r}, r = min(m, n): F = W when n ≤ m, else F = V Λ^{1/2} from the
eigendecomposition G = V Λ Vᵀ. Then G ⊗ I = (F ⊗ I)(F ⊗ I)ᵀ and, the trace being cyclic,

    κ(W) = Tr((F ⊗ I)ᵀ H (F ⊗ I)) = Σ_{k<r, j<n} ⟨F_k e_jᵀ, H[F_k e_jᵀ]⟩                (exact)
         = E_Z ⟨F Z, H[F Z]⟩,   Z ∈ {±1}^{r×n} with independent Rademacher entries  (stochastic)

(F_k the k-th column of F, e_j the j-th unit vector of R^n, H[U] the Hessian-vector product with a
direction U of W's shape). The exact form takes r·n Hessian-vector products per batch; the
stochastic one, Hutchinson's estimator of the trace of the symmetric matrix (F ⊗ I)ᵀ H (F ⊗ I),
one per probe and is unbiased (E[vec Z vec Zᵀ] = I), with the standard error of the mean over the
probes. The estimator never forms G when n ≤ m (a language-model head: m the vocabulary).

Data: L = Σ_b c_b L_b over the batches, c_b = |b|/N (``reduction="mean"``: each batch loss L_b a
mean, N the number of data points) or c_b = 1 (``"sum"``), as in
:func:`~quotient_manifolds.adapters.hessian.riemannian_hessian`; κ is linear in H, so
κ = Σ_b c_b κ_b with κ_b the measure of batch b's own loss (``per_batch``). Hessian-vector
products come from a double backward through ``torch.func.functional_call`` with only the layer's
weight swapped for a leaf (the model is never modified), in eval mode and with
``scaled_dot_product_attention`` on its math kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from quotient_manifolds._validation import choice, integer_at_least
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, NonFiniteLoss

from . import validation as check
from .evaluation import ModelClosure, weighted_batches
from .families.structure import Projection, join_path, projection
from .losses import HALF_DTYPES
from .modes import second_order_mode

__all__ = ["RelativeFlatness", "relative_flatness", "default_layer", "HEAD_NAMES", "METHODS"]

Tensor = torch.Tensor

METHODS = ("auto", "exact", "stochastic")
REDUCTIONS = ("mean", "sum")
#: where common models keep their output layer (Hugging Face: BERT/ViT ``classifier``, Llama/Qwen
#: sequence classifiers ``score``, causal LMs ``lm_head``, timm/our ViT ``head``, torchvision
#: ResNets ``fc``); a head module that is no linear layer itself (RoBERTa's ``classifier``: dense →
#: out_proj) gives its last linear layer
HEAD_NAMES = ("classifier", "score", "lm_head", "head", "fc")
#: ``method="auto"`` computes κ exactly when the layer's Hessian, (m·n)², has at most this many entries
EXACT_LIMIT = 10 ** 7
#: Hessian-vector products run as one vectorised backward of at most 64 directions and this many
#: entries together (the backward's intermediate tensors grow with the number of directions)
CHUNK_ENTRIES = 2 ** 22


@dataclass(frozen=True)
class RelativeFlatness:
    """The relative flatness κ(W) of one layer (:func:`~quotient_manifolds.adapters.relative_flatness`).

    Attributes
    ----------
    value, per_batch, layer, shape, method, n_products, std_error, loss, num_data:
        Each described at its field below.


    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    >>> batches = [(torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,)))]
    >>> res = adapters.relative_flatness(model, batches, layer="2")
    >>> res.layer, res.shape, res.method, res.num_data, res.per_batch == [res.value]
    ('2', (2, 4), 'exact', 8, True)
    """

    #: κ(W) of the loss over all batches: Σ_b c_b ``per_batch[b]`` (c_b = |b|/N, or 1 for ``"sum"``)
    value: float
    #: κ of each batch's own loss L_b, in the order of the batches
    per_batch: List[float]
    #: the module path of the layer
    layer: str
    #: (m, n) of W, one row per output unit (an HF ``Conv1D``'s weight transposed)
    shape: Tuple[int, int]
    #: ``"exact"`` or ``"stochastic"``
    method: str
    #: Hessian-vector products per batch: min(m, n)·n exact, the number of probes stochastic
    n_products: int
    #: standard error of ``value`` over the probes (0.0 for ``"exact"``)
    std_error: float
    #: the loss L at the trained weights
    loss: float
    #: N, the number of data points
    num_data: int


def relative_flatness(model: nn.Module, batches: Iterable[Union[Tuple[Any, Any], Mapping[str, Any]]], *,
                      layer: Optional[str] = None, loss_fn: Optional[Callable] = None,
                      method: str = "auto", n_probes: int = 64, seed: Optional[int] = 0,
                      reduction: Optional[str] = None,
                      batch_size_fn: Optional[Callable[[Any], int]] = None,
                      exact_limit: int = EXACT_LIMIT) -> RelativeFlatness:
    r"""Relative flatness κ(W) = Σ_{s,s'} ⟨w_s, w_s'⟩ Tr H_{s,s'} of the layer ``layer`` of
    ``model`` on ``batches`` (Petzka et al. 2021; module docstring), at the trained weights.

    Parameters
    ----------
    model: any ``torch.nn.Module`` in float32 or float64; never modified (evaluated in eval mode,
        every submodule's train flag restored).
    batches: a re-iterable of ``(inputs, targets)`` pairs or Hugging Face dict batches (as in
        :func:`~quotient_manifolds.adapters.sharpness`); an iterator is materialised once.
    layer: the module path of an ``nn.Linear`` or Hugging Face ``Conv1D`` of the model (e.g.
        ``"classifier"``, ``"bert.pooler.dense"``). Default: the model's output layer, the first of
        :data:`~quotient_manifolds.adapters.flatness.HEAD_NAMES` it has
        (:func:`~quotient_manifolds.adapters.flatness.default_layer`).
    loss_fn: ``loss_fn(outputs, targets)`` (default mean cross-entropy; the model's own
        ``outputs.loss`` for dict batches without ``loss_fn``).
    method: ``"exact"`` (r·n Hessian-vector products per batch, r = min(m, n)), ``"stochastic"``
        (Hutchinson, ``n_probes`` products per batch, with a standard error) or ``"auto"``
        (default: exact when the layer's Hessian has at most ``exact_limit`` entries, (m·n)² ≤
        ``exact_limit``, else stochastic).
    n_probes: Rademacher probes of the stochastic estimate, an integer >= 2.
    seed: seed of the probes (drawn from a generator of their own: the global one is untouched);
        None draws one from the global generator.
    reduction: ``"mean"`` (L = Σ_b |b|/N · L_b, the mean over all N points) or ``"sum"``
        (L = Σ_b L_b). Default: ``loss_fn.reduction`` if it has one, else ``"mean"``.
    batch_size_fn: ``batch_size_fn(inputs)`` = |b| for ``"mean"`` (default: the leading dimension
        of the inputs or targets).
    exact_limit: the size of the layer's Hessian up to which ``"auto"`` computes κ exactly.

    Returns
    -------
    :class:`~quotient_manifolds.adapters.RelativeFlatness`: ``value``, ``per_batch``, the layer's name and shape, the method,
    the products per batch and the standard error.

    Raises
    ------
    TypeError, ValueError: an argument of the wrong kind, a layer that is no linear layer, a
        half-precision layer. FloatingPointError: a non-finite loss at the trained weights.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,)))]
    >>> res = adapters.relative_flatness(model, batches, layer="2")
    >>> res.method, res.shape, res.n_products
    ('exact', (3, 8), 24)
    """
    check.module("model", model)
    check.batches("batches", batches)
    if layer is not None and not isinstance(layer, str):
        raise InvalidArgumentType(f"layer must be the module path of a linear layer (a string such as "
                                  f"'classifier'), or None for the model's output layer; got "
                                  f"{type(layer).__name__}")
    check.optional_callable("loss_fn", loss_fn, "loss_fn(outputs, targets) -> scalar tensor")
    check.optional_callable("batch_size_fn", batch_size_fn, "batch_size_fn(inputs) -> int")
    choice("method", method, METHODS)
    n_probes = integer_at_least("n_probes", n_probes, 2)
    exact_limit = integer_at_least("exact_limit", exact_limit, 1)
    if seed is not None:
        seed = integer_at_least("seed", seed, 0)
    if reduction is None:
        reduction = getattr(loss_fn, "reduction", "mean")
    choice("reduction", reduction, REDUCTIONS)
    check.materialised(model, "relative_flatness")

    proj = _layer(model, layer)
    weight = proj.weight.detach()
    if weight.dtype in HALF_DTYPES or not weight.is_floating_point():
        raise InvalidArgumentType(f"relative_flatness: the weight of {proj.path!r} is {weight.dtype}; second "
                                  f"derivatives in half precision lose the measure to rounding. Measure a "
                                  f"float32 copy of the model (copy.deepcopy(model).float())")
    m, n = proj.out_features, proj.in_features
    if method == "auto":
        method = "exact" if (m * n) ** 2 <= exact_limit else "stochastic"

    data, num_data = weighted_batches(check.TokenInputs(model), batches, loss_fn, reduction,
                                      batch_size_fn, weight.device, False)
    rows = weight.T if proj.transposed else weight            # W ∈ R^{m×n}, rows per output unit
    factor = _gram_factor(rows)                               # G = F Fᵀ, F ∈ R^{m×r}
    chunk = max(1, min(64, CHUNK_ENTRIES // (m * n)))
    if method == "exact":
        probes = _unit_probes(factor, n, chunk)
        n_products = factor.shape[1] * n
    else:
        probes = _rademacher_probes(factor, n, n_probes, seed, chunk)
        n_products = n_probes

    name = join_path(proj.path, "weight")
    closure = ModelClosure(model, {name: weight}, {}, lambda points: {name: points[0]}, None, False)
    # quad[b, k] = ⟨U_k, H_b[U_k]⟩ for batch b and direction k
    quad = torch.zeros(len(data), n_products, dtype=torch.float64, device=weight.device)
    loss_total = 0.0
    with second_order_mode(model):
        for b, (inputs, targets, batch_loss_fn, c_b) in enumerate(data):
            closure.inputs, closure.targets, closure.loss_fn = inputs, targets, batch_loss_fn
            leaf = weight.clone().requires_grad_(True)
            loss = closure([leaf])
            if not torch.isfinite(loss.detach()):
                raise NonFiniteLoss(f"relative_flatness: the loss of batch {b} is not finite "
                                    f"({float(loss.detach())}) at the trained weights: check the "
                                    f"model, its inputs and targets")
            loss_total += c_b * float(loss.detach())
            (grad,) = torch.autograd.grad(loss, leaf, create_graph=True)
            if not grad.requires_grad:        # the loss is linear in W: H = 0
                continue
            k = 0
            for U in probes():                # a chunk of directions (c, m, n)
                stored = U.mT if proj.transposed else U
                hvp = _hvps(grad, leaf, stored)
                quad[b, k:k + len(U)] = (stored * hvp).sum((1, 2), dtype=torch.float64)
                k += len(U)
    quad = quad.cpu()
    weights = torch.tensor([d[3] for d in data], dtype=torch.float64)
    if method == "exact":
        per_batch = quad.sum(1)
        value, std_error = float(weights @ per_batch), 0.0
    else:
        per_batch = quad.mean(1)
        per_probe = weights @ quad                 # κ̂_k of the whole loss, one per probe
        value = float(per_probe.mean())
        std_error = float(per_probe.std() / n_products ** 0.5)
    return RelativeFlatness(value=value, per_batch=[float(v) for v in per_batch], layer=proj.path,
                            shape=(m, n), method=method, n_products=n_products,
                            std_error=std_error, loss=loss_total, num_data=num_data)


def default_layer(model: nn.Module) -> str:
    """The module path of ``model``'s output layer: the first of :data:`HEAD_NAMES` that is a
    linear layer (``nn.Linear`` or HF ``Conv1D``), or the last linear layer inside it; refused
    with the linear layers the model has when there is none."""
    check.module("model", model)
    for name in HEAD_NAMES:
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            continue
        found = [p for sub, child in mod.named_modules()
                 if (p := projection(join_path(name, sub) if sub else name, child)) is not None]
        if found:
            return found[-1].path
    linear = [p.path for path, mod in model.named_modules() if (p := projection(path, mod)) is not None]
    shown = ", ".join(repr(p) for p in linear[-5:]) or "none"
    raise InvalidArgument(f"relative_flatness: {type(model).__name__} has no output layer under the usual "
                          f"names ({', '.join(HEAD_NAMES)}); pass layer='path.of.a.linear.layer' (its "
                          f"last linear layers: {shown})")


def _layer(model: nn.Module, layer: Optional[str]) -> Projection:
    """The linear layer named ``layer`` (default :func:`default_layer`), refused unless it is an
    ``nn.Linear`` or HF ``Conv1D`` without adapters."""
    path = default_layer(model) if layer is None else layer
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        linear = [p for p, mod in model.named_modules() if projection(p, mod) is not None]
        raise InvalidArgument(f"relative_flatness: {type(model).__name__} has no module {path!r}; pass the "
                              f"path of one of its linear layers, e.g. {', '.join(map(repr, linear[-3:]))}"
                              ) from None
    proj = projection(path, mod)
    if proj is None:
        raise InvalidArgumentType(f"relative_flatness: {path!r} is a {type(mod).__name__}, not a linear layer "
                                  f"(nn.Linear or Hugging Face Conv1D): κ is defined for a weight matrix with "
                                  f"one row per output unit; name a linear layer inside it")
    if proj.adapted:
        raise InvalidArgument(f"relative_flatness: {path!r} carries LoRA adapters, so its weight is not "
                              f"one matrix of the model; merge them first (peft's merge_and_unload())")
    return proj


def _gram_factor(rows: Tensor) -> Tensor:
    """F with F Fᵀ = W Wᵀ and r = min(m, n) columns, in W's dtype: W itself when n ≤ m (no copy,
    no m×m Gram matrix: m may be a vocabulary), else V Λ^{1/2} of the eigendecomposition of
    G = W Wᵀ (in float64)."""
    m, n = rows.shape
    if n <= m:
        return rows
    W = rows.double()
    lam, V = torch.linalg.eigh(W @ W.T)
    return (V * lam.clamp_min(0.0).sqrt()).to(rows.dtype)


def _hvps(grad: Tensor, leaf: Tensor, directions: Tensor) -> Tensor:
    """H[U] for a stack of directions U (c, *leaf.shape), H the Jacobian of ``grad`` with respect
    to ``leaf``: one vectorised backward (``is_grads_batched``), or one backward per direction
    where an operation of the graph has no batching rule."""
    try:
        (hvp,) = torch.autograd.grad(grad, leaf, grad_outputs=directions, retain_graph=True,
                                     allow_unused=True, is_grads_batched=True)
    except RuntimeError:
        hvp = torch.stack([_hvp(grad, leaf, U) for U in directions])
    return torch.zeros_like(directions) if hvp is None else hvp


def _hvp(grad: Tensor, leaf: Tensor, direction: Tensor) -> Tensor:
    (hvp,) = torch.autograd.grad(grad, leaf, grad_outputs=direction, retain_graph=True, allow_unused=True)
    return torch.zeros_like(direction) if hvp is None else hvp


def _unit_probes(factor: Tensor, n: int, chunk: int) -> Callable[[], Iterable[Tensor]]:
    """The directions F_k e_jᵀ (k < r, j < n) of the exact form, ``chunk`` at a time (c, m, n)."""
    pairs = [(k, j) for k in range(factor.shape[1]) for j in range(n)]

    def probes() -> Iterable[Tensor]:
        for start in range(0, len(pairs), chunk):
            block = pairs[start:start + chunk]
            U = torch.zeros(len(block), factor.shape[0], n, dtype=factor.dtype, device=factor.device)
            for i, (k, j) in enumerate(block):
                U[i, :, j] = factor[:, k]
            yield U
    return probes


def _rademacher_probes(factor: Tensor, n: int, count: int, seed: Optional[int], chunk: int
                       ) -> Callable[[], Iterable[Tensor]]:
    """``count`` directions F Z with Rademacher Z ∈ {±1}^{r×n}, the same for every batch, ``chunk``
    at a time (drawn on the CPU from a generator of their own, so that every device draws the
    same probes)."""
    generator = torch.Generator()
    generator.manual_seed(int(torch.randint(0, 2 ** 62, ()).item()) if seed is None else seed)
    signs = torch.randint(0, 2, (count, factor.shape[1], n), generator=generator)
    Z = (2.0 * signs - 1.0).to(factor.dtype)

    def probes() -> Iterable[Tensor]:
        for start in range(0, count, chunk):
            yield factor @ Z[start:start + chunk].to(factor.device)
    return probes
