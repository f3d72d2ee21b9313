r"""GL(r)-invariant LoRA training: each peft LoRA pair as one point of the GL(r) quotient.

A LoRA layer adds ``ΔW = s·B A`` (``B = lora_B.weight`` out×r, ``A = lora_A.weight`` r×in,
``s = lora_alpha / r``). ``ΔW`` is unchanged by ``(B, A) ↦ (B M, M⁻¹ A)`` for every M ∈ GL(r): with
``G = B``, ``H = Aᵀ`` this is the two-factor action ``(G M, H M⁻ᵀ)`` of docs/maths.md §1 and §13.6.
:func:`lora_quotient_parameters` turns every pair into ONE geoopt ``ManifoldParameter``
``x = [B; Aᵀ]`` of shape ``(out + in, r)`` on ``GLQuotient(out, in, r, metric)`` and points the LoRA
modules at it, so geoopt's Riemannian optimizers train ``ΔW`` and not a representative of it::

    import geoopt, peft
    from quotient_manifolds.adapters import InvariantRiemannianSGD, lora_quotient_parameters, merge_back

    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    # peft starts B at 0 (rank 0): gram_eps > 0 relaxes the metric to BᵀB + εI. Exactly invariant
    # with gram_eps=0 once B and A have full rank (e.g. after lora_B.weight.normal_(0, 1e-3)).
    groups = lora_quotient_parameters(model, metric="mix", gram_eps=1e-6)   # [B; Aᵀ] points + the rest
    opt = geoopt.optim.RiemannianAdam(groups, lr=1e-3)   # or InvariantRiemannianSGD(groups, lr, momentum=0.9)
    for batch in loader:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    model.save_pretrained("out")     # peft's own adapter format (lora_A / lora_B keys)
    merge_back(model)                # plain lora_A / lora_B parameters again

**How the modules are re-pointed.** ``lora_A[adapter].weight`` and ``lora_B[adapter].weight``
become ``torch.nn.utils.parametrize`` parametrizations without an original tensor: the property
returns the view ``x[:out]`` (B) or ``x[out:]ᵀ`` (A) of the shared point, whose ``LoRAQuotientPoint``
module is registered inside both parametrizations (``model.parameters()``, ``.to()``, ``.half()``
see it; named parameters deduplicate it). peft's forward, ``merge_adapter``/``merge_and_unload``
and ``get_delta_weight`` read ``.weight`` and work unchanged; assigning ``lora_A[...].weight = t``
writes t into x. State-dict hooks on the two ``nn.Linear`` modules make ``model.state_dict()`` hold
exactly peft's keys (``…lora_A.default.weight``, contiguous copies) and no ``x``, and
``load_state_dict`` writes such keys back into x, so peft's ``save_pretrained`` and checkpoints of
the plain model load either way. The geoopt optimizer updates x in place (``point.copy_``), so the
views always see the current values. :func:`merge_back` undoes everything: B and A become plain
``nn.Parameter`` s again with the trained values (a new optimizer is then needed).
``torch.save(model)`` (pickling) of a parametrized module is not supported by torch: save the
state dict, or call :func:`merge_back` first.

**Why the optimizers are invariant** (docs/maths.md §2, §4, §A.3). Write x·M = (B M, Aᵀ M⁻ᵀ) for the
action and f for the (GL-invariant) loss of the point. The metric is invariant,
g_{x·M}(u·M, v·M) = g_x(u, v), so the Riemannian gradient is equivariant, grad f(x·M) = grad f(x)·M
(the Euclidean gradient is not: it transforms as a covector, (∇_B M⁻ᵀ, ∇_{Aᵀ} M)). The horizontal
projection at y, hence the vector transport, and the retractions x + ξ and x + ξ − ½Γ_x(ξ, ξ) are
equivariant too. By induction over the steps, a momentum buffer m_t (a sum of transported
gradients) satisfies m_t(x₀·M) = m_t(x₀)·M, and RiemannianAdam's second moment, ONE scalar per point

    v_t = β₂ v_{t−1} + (1 − β₂) g_x(grad, grad)          (geoopt's component_inner = inner, keepdim)

is invariant, because g_x(grad, grad) is. The step −lr · m̂_t / (√v̂_t + ε) is therefore a vector
that transforms like x, every iterate satisfies x_t(x₀·M) = x_t(x₀)·M, and B_t A_t, the loss and
all the other trainable parameters follow identical trajectories from every representative.
A per-coordinate second moment v_ij = grad_ij² breaks this: (grad·M)_ij mixes the columns, and even
for M = D diagonal the Adam step m_ij D_jj / |grad_ij D_jj| = sign(D_jj) m_ij/|grad_ij| does not
scale like a vector (it would need D_jj): only signed permutations survive. This is why AdamW on
(A, B), and peft's ``create_riemannian_optimizer`` (which preconditions g_A by (BᵀB + δI)⁻¹ and
g_B by (AAᵀ + δI)⁻¹, equivariant for δ = 0, then hands the result to AdamW's per-coordinate
moments), follow different trajectories from (B M, M⁻¹ A).

Two details of geoopt 0.5.1 would break the invariance and are handled here:

* ``RiemannianSGD`` starts its momentum buffer with the *Euclidean* gradient (``grad.clone()``
  before ``egrad2rgrad``), a covector; its first step adds ``momentum · ∇`` to the Riemannian
  gradient. Use :class:`InvariantRiemannianSGD` (the library's
  :class:`~quotient_manifolds.geoopt.RiemannianSGD`: the buffer started from the Riemannian
  gradient, as ``torch.optim.SGD`` starts from its gradient), or call
  :func:`quotient_manifolds.geoopt.init_momentum_buffers` once
  after building a ``geoopt.optim.RiemannianSGD``.
* Both optimizers add ``weight_decay · x`` to the Euclidean gradient: ‖B‖² + ‖A‖² is not
  invariant (it pulls towards the balanced representative, not towards small ΔW). The group of
  points therefore carries ``weight_decay = 0``; for an invariant penalty add λ‖s B A‖²_F to the
  loss.

**Metric, scale and ε.** ``metric="mix"`` (default) has Riemannian gradient
(∇_B (AAᵀ)⁻¹, ∇_{Aᵀ} (BᵀB)⁻¹): the "scaled GD" / Riemannian-preconditioned LoRA direction
(Mishra & Sepulchre 2016; Zhang & Pilanci 2024). An SGD step of size lr moves
δ(s B A) ≈ −lr s² (∇_W Π_A + Π_B ∇_W) (Π the orthogonal projectors on the row space of A and the
column space of B), independent of how the factors are scaled or conditioned. Its norm is
‖ξ‖²_x = ‖ξ_B A‖²_F + ‖B ξ_A‖²_F (ξ_A = ξ_Hᵀ), the two first-order changes of B A; RiemannianAdam
steps have ‖ξ‖_x ≈ lr, so its lr is a Frobenius length of the change of B A per pair and step.
``"inv"`` weights by BᵀB and AAᵀ instead (its step grows with |w|⁴).
``retraction="first_order"`` (x + ξ, default) is invariant and cheap; ``"second_order"`` adds
−½Γ(ξ, ξ), whose mix form divides by BᵀB and misbehaves near B = 0. The quotient needs B and A
of full rank r: peft's default initialisation B = 0 is refused with an error unless ``gram_eps > 0``;
then P = BᵀB + εI, Q = AAᵀ + εI everywhere (the damping of Riemannian-preconditioned LoRA), and
invariance holds up to O(ε / eigenvalues of the Gram matrices) (docs/maths.md §6.4).
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence

import geoopt
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from quotient_manifolds._validation import choice
from quotient_manifolds.core.gl import METRICS, RETRACTIONS
from quotient_manifolds.geoopt import GLQuotient, RiemannianSGD
from quotient_manifolds.errors import InvalidArgument

from . import validation as check
from .detection import detect
from .families import family

__all__ = ["LoRAQuotientPoint", "lora_quotient_parameters", "lora_quotient_points", "merge_back",
           "InvariantRiemannianSGD"]


# --------------------------------------------------------------------------------------------------
# the point and the two views
# --------------------------------------------------------------------------------------------------


class LoRAQuotientPoint(nn.Module):
    r"""One LoRA pair as a point ``x = [B; Aᵀ]`` (shape ``(out + in, r)``) of ``GLQuotient(out, in, r)``.

    ``x`` is a ``geoopt.ManifoldParameter``; :attr:`B` (out×r) and :attr:`A` (r×in) are views of
    it, ``s · B A`` the LoRA update. ``name`` is the block name of the layout
    (``"<layer path>/lora[<adapter>]"``).
    """

    def __init__(self, x: Tensor, manifold: GLQuotient, name: str):
        super().__init__()
        self.name = name
        self.out_features, self.in_features, self.rank = manifold.n, manifold.m, manifold.h
        self.x = geoopt.ManifoldParameter(x, manifold=manifold, requires_grad=True)
        self._hooks: list = []

    @property
    def manifold(self) -> GLQuotient:
        return self.x.manifold

    @property
    def B(self) -> Tensor:
        """``lora_B.weight`` = G = x[:out] (out×r), a view."""
        return self.x[: self.out_features]

    @property
    def A(self) -> Tensor:
        """``lora_A.weight`` = Hᵀ = x[out:]ᵀ (r×in), a view."""
        return self.x[self.out_features:].mT

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # x is written through the lora_A/lora_B ``weight`` keys (see _FactorView); a state dict
        # without an ``x`` key is the normal case, not a missing key.
        if prefix + "x" in state_dict:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"{self.name}: out={self.out_features}, in={self.in_features}, r={self.rank}"


class _FactorView(nn.Module):
    """Parametrization of ``lora_B.weight`` (``factor="B"``) or ``lora_A.weight`` (``"A"``) as a view
    of the shared point. It owns no original tensor (``right_inverse`` returns ``()``); assigning
    the weight writes into x."""

    def __init__(self, point: LoRAQuotientPoint, factor: str):
        super().__init__()
        self.point, self.factor = point, factor

    def forward(self) -> Tensor:
        return self.point.B if self.factor == "B" else self.point.A

    @torch.no_grad()
    def right_inverse(self, value: Tensor):
        target = self.forward()
        if tuple(value.shape) != tuple(target.shape):
            raise InvalidArgument(f"{self.point.name}: lora_{self.factor}.weight must have shape "
                                  f"{tuple(target.shape)}, got {tuple(value.shape)}")
        target.copy_(value)
        return ()


def _views(model: nn.Module):
    """``(linear module, _FactorView)`` for every re-pointed LoRA factor of ``model``."""
    for mod in model.modules():
        if parametrize.is_parametrized(mod, "weight"):
            plist = mod.parametrizations["weight"]
            if len(plist) == 1 and isinstance(plist[0], _FactorView):
                yield mod, plist[0]


def lora_quotient_points(model: nn.Module) -> Dict[str, LoRAQuotientPoint]:
    """The re-pointed LoRA pairs of ``model``: block name -> :class:`LoRAQuotientPoint`."""
    out: Dict[str, LoRAQuotientPoint] = {}
    for _, view in _views(model):
        out.setdefault(view.point.name, view.point)
    return out


# --------------------------------------------------------------------------------------------------
# state-dict hooks: peft's keys, contiguous copies, no ``x``
# --------------------------------------------------------------------------------------------------


def _save_hook(module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(prefix + "parametrizations.")]:
        del state_dict[key]
    state_dict[prefix + "weight"] = module.weight.detach().clone(memory_format=torch.contiguous_format)


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
               error_msgs):
    value = state_dict.pop(prefix + "weight", None)
    if value is None:
        if not any(k.startswith(prefix + "parametrizations.") for k in state_dict):
            missing_keys.append(prefix + "weight")
        return
    try:
        module.weight = value          # parametrize -> _FactorView.right_inverse -> into x
    except ValueError as err:
        error_msgs.append(f"size mismatch for {prefix}weight: {err}")


# --------------------------------------------------------------------------------------------------
# re-pointing and undo
# --------------------------------------------------------------------------------------------------


def _adapter_of(block) -> str:
    """The peft adapter name of a ``peft-lora`` block (its name ends in ``/lora[adapter]``)."""
    return block.name.rsplit("/lora[", 1)[-1][:-1]


def lora_quotient_parameters(model: nn.Module, *, metric: str = "mix", retraction: str = "first_order",
                             gram_eps: float = 0.0, adapters: Optional[Sequence[str]] = None
                             ) -> List[dict]:
    r"""Re-point every trainable peft LoRA pair of ``model`` at one GL(r)-quotient point
    ``x = [B; Aᵀ]`` and return optimizer parameter groups.

    ``model`` is modified (that is the point of the call): ``lora_A[adapter].weight`` and
    ``lora_B[adapter].weight`` become views of x (module docstring); its forward, merging and
    ``state_dict`` keys are unchanged. Pairs are found by the ``peft-lora`` family of
    :func:`quotient_manifolds.adapters.detect` (``G = lora_B.weight``, ``H = lora_A.weightᵀ``);
    adapters that family does not model (DoRA and other variants, LoRA on embeddings or
    convolutions) stay plain parameters, with a warning.

    Parameters
    ----------
    metric, retraction, gram_eps:
        Passed to :class:`~quotient_manifolds.geoopt.GLQuotient` for every pair (``gram_eps`` as its
        ``eps``; module docstring: ``"mix"``, ``"first_order"``, ε = 0 keep exact invariance; ε > 0
        is needed for a rank-deficient B or A, e.g. peft's initialisation B = 0).
    adapters:
        Names of the adapters to re-point (default: every adapter whose two factors are trainable).

    Returns
    -------
    ``[{"params": [x, ...], "weight_decay": 0.0}, {"params": [other trainable parameters]}]``
    (the second group only if there are others, e.g. a classifier head in ``modules_to_save``): pass
    it to ``geoopt.optim.RiemannianAdam`` or :class:`InvariantRiemannianSGD`. ``weight_decay`` is 0 on
    the points because ‖B‖² + ‖A‖² is not invariant (module docstring).

    Raises
    ------
    ValueError
        A LoRA pair of rank below r with ``gram_eps`` = 0 (peft initialises B at zero: pass
        ``gram_eps`` > 0 or give B full rank first), an unknown adapter name, an unknown ``metric``
        or ``retraction``, or a model without trainable LoRA pairs.
    TypeError
        ``model`` is not an ``nn.Module``.

    Examples
    --------
    >>> import peft, torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> base = torch.nn.Sequential(torch.nn.Linear(4, 4)).double()
    >>> model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))
    >>> groups = adapters.lora_quotient_parameters(model, gram_eps=1e-6)   # peft starts at B = 0
    >>> [tuple(x.shape) for x in groups[0]["params"]]  # x = [B; Aᵀ], (4 + 4) × 2
    [(8, 2)]
    >>> opt = adapters.InvariantRiemannianSGD(groups, lr=0.1, momentum=0.9)
    >>> model(torch.randn(3, 4, dtype=torch.float64)).pow(2).mean().backward()
    >>> opt.step()
    >>> adapters.merge_back(model)                      # plain parameters again
    1
    """
    check.module("model", model)
    choice("metric", metric, METRICS)
    choice("retraction", retraction, RETRACTIONS)
    gram_eps = check.non_negative_finite("gram_eps", gram_eps)
    wanted = None if adapters is None else set(check.names("adapters", adapters))
    if any(True for _ in _views(model)):
        raise InvalidArgument("the LoRA pairs of this model are already re-pointed at quotient points: use the "
                              "parameter groups of the first call (or lora_quotient_points(model)), or call "
                              "merge_back(model) first")
    params = dict(model.named_parameters())
    # build and check every point before touching the model
    built = [(b_name, a_name, _quotient_point(block, b_name, a_name, params, metric, retraction, gram_eps))
             for block, b_name, a_name in _trainable_pairs(model, params, wanted)]
    points = []
    for b_name, a_name, point in built:
        for name, factor in ((b_name, "B"), (a_name, "A")):
            module = model.get_submodule(name.rsplit(".", 1)[0])
            parametrize.register_parametrization(module, "weight", _FactorView(point, factor))
            point._hooks.append(module.register_state_dict_post_hook(_save_hook))
            point._hooks.append(module.register_load_state_dict_pre_hook(_load_hook))
        points.append(point.x)
    ids = {id(p) for p in points}
    others = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": points, "weight_decay": 0.0}]
    if others:
        groups.append({"params": others})
    return groups


def _trainable_pairs(model: nn.Module, params: Dict[str, Tensor], wanted: Optional[set]) -> List[tuple]:
    """(block, B's name, A's name) of every peft LoRA pair of ``wanted`` adapters (default: all) whose
    two factors are trainable, refused when there is none; a note of detection is a warning."""
    found = detect(model, families=[family("peft-lora")])
    for note in found.notes:
        warnings.warn(f"{note}; such factors are trained as plain parameters, not GL(r)-invariantly",
                      stacklevel=3)
    pairs = []
    for block in found.blocks:
        adapter = _adapter_of(block)
        b_name, a_name = block.g_pieces[0].param, block.h_pieces[0].param
        if wanted is not None and adapter not in wanted:
            continue
        if not (params[b_name].requires_grad and params[a_name].requires_grad):
            continue            # an inactive adapter: nothing to train
        pairs.append((block, b_name, a_name))
    found_adapters = {_adapter_of(block) for block in found.blocks}
    if wanted is not None and wanted - found_adapters:
        raise InvalidArgument(f"no trainable peft LoRA pair for adapters {sorted(wanted - found_adapters)}: "
                              f"the model has no such adapter (its LoRA adapters: {sorted(found_adapters)}); "
                              f"pass adapters= names from that list, or None for all")
    if not pairs:
        raise InvalidArgument("no trainable peft LoRA pair (lora_A/lora_B nn.Linear of matching rank) was found"
                              + (f" for adapters {sorted(wanted)}" if wanted is not None else "")
                              + ": build the model with peft.get_peft_model(base, LoraConfig(...)) and make "
                              "sure the adapter is active and trainable")
    return pairs


def _quotient_point(block, b_name: str, a_name: str, params: Dict[str, Tensor], metric: str,
                    retraction: str, gram_eps: float) -> "LoRAQuotientPoint":
    """The point ``[B; Aᵀ]`` of one pair (a copy of its factors) on its GL(r) quotient, refused with
    what to do when the factors are not of full rank (the model is not touched)."""
    with torch.no_grad():
        x = block.gather(params)[0].detach().clone()
    try:
        manifold = GLQuotient(block.n, block.m, block.head_dim, metric=metric, retraction=retraction,
                              eps=gram_eps)
    except ValueError as err:
        raise InvalidArgument(f"{block.name}: cannot be a GL(r) quotient point: {err}") from None
    ok, reason = manifold.check_point_on_manifold(x, explain=True)
    if not ok:
        zero = [f for f, t in (("lora_B", params[b_name]), ("lora_A", params[a_name]))
                if not bool(t.detach().any())]
        hint = (f" ({' and '.join(zero)} is all zeros: peft initialises lora_B at zero)" if zero else "")
        raise InvalidArgument(
            f"{block.name}: the LoRA factors must have full rank r = {block.head_dim} for the exact "
            f"quotient{hint}. Either pass gram_eps > 0 (relaxed metric BᵀB + εI, AAᵀ + εI: the damping of "
            f"Riemannian-preconditioned LoRA, invariant up to O(ε); e.g. gram_eps=1e-6), or give B and A "
            f"full rank first (e.g. lora_B.weight.normal_(0, 1e-3)). Core message: {reason}")
    return LoRAQuotientPoint(x, manifold, block.name)


def merge_back(model: nn.Module) -> int:
    """Undo :func:`lora_quotient_parameters`: every re-pointed ``lora_A``/``lora_B`` weight becomes a
    plain trainable ``nn.Parameter`` again, holding the current (trained) values as contiguous
    tensors; the hooks and points are removed. Returns the number of pairs restored (0 if none).
    Optimizers built on the groups refer to the points and must be rebuilt.

    Parameters
    ----------
    model:
        A model passed to :func:`lora_quotient_parameters` (any other model: nothing to do).

    Returns
    -------
    int
        The number of LoRA pairs restored.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``.

    Examples
    --------
    >>> import peft, torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> base = torch.nn.Sequential(torch.nn.Linear(4, 4)).double()
    >>> model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))
    >>> groups = adapters.lora_quotient_parameters(model, gram_eps=1e-6)   # peft starts at B = 0
    >>> adapters.merge_back(model), adapters.merge_back(model)
    (1, 0)
    >>> type(model.base_model.model[0].lora_A["default"].weight).__name__
    'Parameter'
    """
    check.module("model", model)
    restored = set()
    for module, view in list(_views(model)):
        value = module.weight.detach().clone(memory_format=torch.contiguous_format)
        for handle in view.point._hooks:
            handle.remove()
        # leave_parametrized=True is the only mode for an original-free parametrization; the
        # parameter it leaves shares x's storage, so it is replaced by a copy right after.
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        module.weight = nn.Parameter(value, requires_grad=True)
        restored.add(id(view.point))
    return len(restored)


# --------------------------------------------------------------------------------------------------
# momentum: the library's optimizer (one implementation of the buffer fix)
# --------------------------------------------------------------------------------------------------


class InvariantRiemannianSGD(RiemannianSGD):
    r"""``geoopt.optim.RiemannianSGD`` whose momentum buffer starts from the Riemannian gradient:
    :class:`quotient_manifolds.geoopt.RiemannianSGD` under the name the LoRA docs use.

    Same arguments and update (``buffer ← momentum · transp(buffer) + (1 − dampening) · grad``,
    step ``−lr · buffer`` or Nesterov), except that the first buffer is the Riemannian gradient, as
    in ``torch.optim.SGD``, instead of geoopt's Euclidean ``grad.clone()``. With a GL-invariant
    metric the iterates are then exactly equivariant (module docstring). ``step(closure)`` works as
    in torch.

    Parameters
    ----------
    params:
        Parameters or parameter groups, e.g. those of :func:`lora_quotient_parameters`.
    lr, momentum, dampening, weight_decay, nesterov, stabilize:
        As ``geoopt.optim.RiemannianSGD``.

    Raises
    ------
    ValueError
        A negative ``lr``, ``momentum`` or ``weight_decay``, or ``nesterov`` without momentum.
    TypeError
        ``step`` is given a ``closure`` that is not callable.

    Examples
    --------
    >>> import geoopt, torch
    >>> from quotient_manifolds import GLQuotient, adapters
    >>> M = GLQuotient(4, 4, 2)
    >>> x = geoopt.ManifoldParameter(M.random(dtype=torch.float64), manifold=M)
    >>> opt = adapters.InvariantRiemannianSGD([x], lr=0.05, momentum=0.9)
    >>> def closure():
    ...     opt.zero_grad()
    ...     G, H = M.split(x)
    ...     loss = (G @ H.T - torch.eye(4, dtype=torch.float64)).pow(2).sum()
    ...     loss.backward()
    ...     return loss
    >>> first = opt.step(closure).item()
    >>> opt.step(closure).item() < first
    True
    """
