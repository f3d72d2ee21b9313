r"""Geodesic SAM: sharpness-aware minimisation whose ascent step is taken on the GL(h) quotient.

SAM (Foret et al. 2021) minimises max_{‖ε‖ ≤ ρ} L(w + ε) with one ascent step per update:

    ε = ρ g / ‖g‖,      w_adv = R_w(ε),      w ← base_step(w, ∇L(w_adv)),

with g the steepest-ascent direction of the norm that defines the ball. :class:`GeodesicSAM` takes
that step in the geometry of geodesic sharpness (docs/maths.md §6), i.e. the first iterate of the
ascent of §7.3 from ξ = 0 with the metric step normalisation of §12.6, at the *current* weights:

* ``geometry="geodesic-mix"`` / ``"geodesic-inv"``: on every attention block (§6.2) g is the
  horizontal Riemannian gradient of the quotient metric (§4: (∇_G N_G, ∇_H N_H), projected, §3.2),
  the norm is the combined metric norm of §6.3, and R is the second-order geodesic
  x + ξ − ½Γ(ξ, ξ) (§5; ``retraction=`` also ``"first_order"`` or ``"exact"``); every other weight
  follows the adaptive recipe (metric Σ ξ²/w², g = ∇ ⊙ w², R(ξ) = w + ξ);
* ``geometry="adaptive"``: the elementwise metric everywhere. With ``retraction="first_order"`` this
  is ASAM (Kwon et al. 2021) with T = |w|: the metric norm of g = ∇ ⊙ w² is ‖g ⊘ |w|‖ = ‖T∇‖, so

      ε = ρ g / ‖g‖_w = ρ T²∇ / ‖T∇‖₂,

  exactly Kwon et al.'s ascent step (their code adds an offset, T = |w| + η, which is not used
  here; weights with w = 0 stay fixed, §12.12). With ``"second_order"`` (the default) R is the
  second-order geodesic of the elementwise metric, w + ξ + ξ²/(2w) (§10);
* ``geometry="sam"``: plain SAM, the Euclidean ε = ρ ∇ / ‖∇‖₂ and w_adv = w + ε.

Why: on the quotient, the ascent direction, its norm and the retraction are all GL-equivariant
(§2, §4, §5.4). If w' = A·w is a reparametrisation of w by per-head GL actions (the same function),
then w'_adv = A·w_adv: the perturbed *function* f(w_adv), the SAM loss L(w_adv) and the gradient
handed to the base optimizer (transformed contragrediently, (∇_G A⁻ᵀ, ∇_H A)) do not depend on the
representative. SAM perturbs a different function for every representative, ASAM for every one
beyond elementwise rescalings. Only the ascent is equivariant: the descent is the base
optimizer's own (SGD or AdamW on the representative are not GL-equivariant).

The ball is rebuilt from the current weights at every step (one :func:`~quotient_manifolds.adapters.ball.build_ball`
call: a few batched h×h factorisations per block shape); the layout of the model is found once.
"""

from __future__ import annotations

import itertools
import math
import numbers
import warnings
from typing import Any, Callable, Dict, Iterator, Optional, Type, Union

import torch
from torch import Tensor, nn

from quotient_manifolds._validation import choice, flag
from quotient_manifolds.core.gl import RETRACTIONS
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, NonFiniteLoss, NotSupported, UsageError

from . import validation as check
from .ball import GEOMETRY_TABLE, build_ball, geometry_of
from .evaluation import as_compute
from .losses import HALF_DTYPES
from .options import as_rho
from .sam_parallel import AscentPiece, ParallelAscent, _is_ddp, _local
from .sharded import group_of
from .verify import verified_before_sharding
from .validation import materialised

#: why a layout whose blocks fail verification is refused (``unsafe=True``: the warning's reason)
SAM_CONSEQUENCE = "the ascent would not be invariant"

#: The ascent geometries of :class:`GeodesicSAM`: those of the sharpness ball, and plain SAM (every
#: entry of :data:`~quotient_manifolds.adapters.ball.GEOMETRY_TABLE`).
SAM_GEOMETRIES = tuple(GEOMETRY_TABLE)


#: Hyperparameters of a base optimizer's param groups that must be finite and >= 0 (the names of
#: torch.optim's optimizers); NaN is refused in every setting, ±inf in these and in ``betas``
NON_NEGATIVE_HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "dampening", "eps", "alpha",
                                "lr_decay", "initial_accumulator_value", "initial_lr")
#: Settings that must be finite, of any sign
FINITE_HYPERPARAMETERS = NON_NEGATIVE_HYPERPARAMETERS + ("betas",)


def _check_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a base optimizer whose param groups hold NaN in any setting (``lr=nan``, a NaN in
    ``betas`` ...), ±inf in a learning rate, weight decay, momentum, eps or betas, or a negative
    one of these (but betas): the base step would write NaN into the model, or ascend. Torch's
    own checks let NaN through (``nan < 0`` is False). Other settings may be infinite (a custom
    optimizer's threshold)."""
    for index, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            for v in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(v, bool) or not isinstance(v, (numbers.Real, Tensor)):
                    continue
                if isinstance(v, Tensor) and (v.numel() != 1 or v.dtype == torch.bool or v.is_complex()):
                    continue
                x = float(v)
                if math.isnan(x) or (key in FINITE_HYPERPARAMETERS and math.isinf(x)):
                    need = "a finite number"
                elif key in NON_NEGATIVE_HYPERPARAMETERS and x < 0:
                    need = "a number >= 0"
                else:
                    continue
                raise InvalidArgument(
                    f"the base optimizer's param group {index} has {key}={value!r}: {need} is "
                    f"needed (the base step would write NaN into the model, or ascend); set it when "
                    f"constructing the optimizer, e.g. GeodesicSAM(model, torch.optim.SGD, lr=0.1), "
                    f"or fix the learning-rate schedule")


class GeodesicSAM(ParallelAscent, torch.optim.Optimizer):
    r"""SAM with the ascent step on the GL(h) quotient, around any base optimizer (module docstring).

    Parameters
    ----------
    model: the ``nn.Module`` being trained; its attention blocks are found once
        (:func:`quotient_manifolds.adapters.layout`) unless ``layout`` is given.
    base_optimizer: an optimizer class (constructed as ``base_optimizer(params, **base_kwargs)`` on
        the model's trainable parameters), or an optimizer instance over parameters of ``model``.
        The parameters it updates (and that require grad) are the ones perturbed.
    rho: radius of the ball, in the geometry's norm (docs/maths.md §6.3). Not comparable across
        geometries: inv and adaptive are scale-free (relative), mix scales like |w|⁴ and SAM like
        |w| (§2, §12.14), so tune ρ per geometry.
    geometry: ``"geodesic-mix"`` (default), ``"geodesic-inv"``, ``"adaptive"`` or ``"sam"``.
    layout: a precomputed :class:`~quotient_manifolds.adapters.Layout` of ``model`` (geodesic geometries); one
        built for another model (other parameters, shapes or head counts) is refused.
    retraction: ``"second_order"`` (default), ``"first_order"`` (no Γ) or ``"exact"`` (geodesic ODE,
        GL blocks only). Ignored by ``"sam"`` (Euclidean geodesics are straight lines).
    gram_eps: Gram relaxation GᵀG + εI of the quotient metrics (§6.4); raise it if a block becomes
        rank-deficient during training.
    elementwise_second_order: whether weights in the elementwise metric move along its second-order
        geodesic w + ξ + ξ²/(2w) (§10, §12.10). Default: for ``"adaptive"`` whenever ``retraction``
        is not ``"first_order"``; for the geodesic geometries no (w + ξ, the adaptive recipe of the
        paper's App. C.1).
    allow_unsupported: passed to layout detection (attention modules that cannot be mapped are then
        treated elementwise).
    unsafe: use a layout whose last ``verify`` found blocks that are not symmetries of the model.
    base_kwargs: hyperparameters of the base optimizer class (``lr``, ``momentum``, ``eps`` ...).

    Use
    ---
    Two passes per update, as in the usual SAM implementations::

        loss_fn(model(x), y).backward()      # gradient at w
        opt.first_step(zero_grad=True)       # w ← w_adv (in place)
        loss_fn(model(x), y).backward()      # gradient at w_adv
        opt.second_step(zero_grad=True)      # w restored exactly, base step with ∇L(w_adv)

    or ``opt.step(closure)`` with a closure that computes the loss and calls ``backward()``. The
    perturbation reads the gradients in ``.grad`` (``None`` counts as zero). ``param_groups`` and
    ``state_dict`` are the base optimizer's, so learning-rate schedulers work on the wrapper. The
    base optimizer's settings are checked at construction and at every ``first_step`` (a schedule
    may change them): NaN in any setting (``lr=nan``), and an infinite or negative learning rate,
    weight decay, momentum or eps, are refused before any weight moves. A non-finite gradient is refused
    (ValueError) by ``first_step`` (nothing written) and by ``second_step`` (the weights restored
    to w, no base step taken).

    **Distributed training and mixed precision.** Every rank takes the same ascent step, the one
    of the single-process run on the global batch: g, ‖g‖ and ε come from the gradient averaged
    over the ranks (docs/distributed.md).

    * **DistributedDataParallel**: pass the DDP-wrapped model (``GeodesicSAM(ddp_model, ...)``; its
      ``module`` is the model whose blocks are found). The backward passes synchronise the
      gradients as usual. When the first (ascent) pass runs inside ``ddp_model.no_sync()``, as in
      many SAM recipes, each rank holds its own gradient: ``first_step`` then averages them itself
      (one all-reduce per dtype) before the norm, so the ranks never perturb differently.
    * **FSDP2** (``torch.distributed.fsdp.fully_shard``: parameters and gradients are DTensors
      sharded on dim 0 of one 1-D mesh; apply ``fully_shard`` to the root module too). The
      elementwise part of the ball (every weight outside the GL blocks; all weights for
      ``"adaptive"`` and ``"sam"``) is computed on each rank's shard, and ‖g‖² is summed over the
      ranks (one all-reduce of a scalar). A GL block needs whole heads, whose rows may straddle
      shard boundaries and whose G and H live in different parameters: the parameters of one
      attention module are assembled whole (``DTensor.full_tensor()``, one parameter at a time),
      the heads' ascent direction is formed identically on every rank (the h×h Gram matrices need
      no collective), and each rank writes back its own shard. Memory: at most one attention
      module's weights and gradients are whole at a time (transient: 2× its parameters in the
      compute dtype, plus a few float64 copies of its heads), on top of FSDP2's own; the
      attention weights are all-gathered twice per step (once for ‖g‖, once for the point).
      The layout must be verified on the whole model before ``fully_shard`` (``lay =
      adapters.layout(model); lay.verify(model, inputs)``): a sharded forward pass gathers its
      weights itself, so the symmetry check cannot run on it. Gradient synchronisation must be on
      in both passes (``set_requires_gradient_sync(True)``, the default).
    * **bfloat16 autocast** (float32 weights): nothing to do; the step is finite, and a
      non-finite gradient is refused as above.
    * **float16 with a** ``torch.amp.GradScaler``: ``scaler.scale(loss).backward()`` in both
      passes and ``first_step(scaler=scaler)``: the gradients are unscaled before the norm and the
      base step; an overflow skips the update (weights unchanged, :attr:`skipped` True) and
      ``second_step`` calls ``scaler.update()``, which lowers the scale. Not with FSDP2 (use
      bfloat16 there).

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``, ``base_optimizer`` is neither an optimizer class nor an
        instance over the model's parameters, or ``layout`` is not a Layout.
    ValueError
        An unknown ``geometry`` or ``retraction``, ``rho`` not a finite positive number, a layout
        built for another model, a base optimizer setting that is NaN, infinite or negative; from
        :meth:`first_step` / :meth:`second_step`, a non-finite gradient.
    SymmetryError
        A block of the layout fails verification (unless ``unsafe``).
    RuntimeError
        :meth:`step` without a closure.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double()
    >>> x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    >>> opt = adapters.GeodesicSAM(model, torch.optim.SGD, rho=0.05, geometry="geodesic-mix", lr=0.1)
    >>> loss_fn = torch.nn.MSELoss()
    >>> loss_fn(model(x), y).backward()                 # gradient at w
    >>> opt.first_step(zero_grad=True)                  # w ← w_adv
    >>> loss_fn(model(x), y).backward()                 # gradient at w_adv
    >>> opt.second_step(zero_grad=True)                 # w restored, SGD step with ∇L(w_adv)
    >>> bool(loss_fn(model(x), y) < 2.05)
    True
    """

    def __init__(self, model: nn.Module, base_optimizer: Union[Type[torch.optim.Optimizer],
                                                               torch.optim.Optimizer],
                 rho: float = 0.05, geometry: str = "geodesic-mix", layout=None,
                 retraction: str = "second_order", *, gram_eps: float = 0.0,
                 elementwise_second_order: Optional[bool] = None, allow_unsupported: bool = False,
                 unsafe: bool = False, **base_kwargs):
        if not isinstance(model, nn.Module):
            raise InvalidArgumentType(f"GeodesicSAM needs the model (an nn.Module) to find its attention "
                                      f"blocks, got {type(model).__name__}; pass GeodesicSAM(model, "
                                      f"torch.optim.SGD, lr=...)")
        #: the DistributedDataParallel wrapper when ``model`` is one (its module is the model)
        self._ddp = model if _is_ddp(model) else None
        model = model.module if self._ddp is not None else model
        materialised(model, "GeodesicSAM")
        self.model = model
        self.rho = as_rho(rho)
        spec = geometry_of(geometry, SAM_GEOMETRIES)
        self.geometry = spec.name
        self.retraction = choice("retraction", retraction, RETRACTIONS)
        if spec.adaptive and retraction == "exact":
            raise InvalidArgument("retraction='exact' integrates the geodesic of GL blocks, and "
                                  "geometry='adaptive' has none: use 'first_order' (ASAM) or "
                                  "'second_order' (w + ξ + ξ²/(2w))")
        if elementwise_second_order is None:
            # the adaptive geometry is the elementwise metric itself: its geodesic by default
            elementwise_second_order = spec.adaptive and retraction != "first_order"
        self.elementwise_second_order = flag("elementwise_second_order", elementwise_second_order)
        self.gram_eps = check.non_negative_finite("gram_eps", gram_eps)
        check.optional_layout("layout", layout)
        flag("allow_unsupported", allow_unsupported)
        flag("unsafe", unsafe)

        trainable = [p for p in model.parameters() if p.requires_grad]
        if isinstance(base_optimizer, torch.optim.Optimizer):
            if base_kwargs:
                raise InvalidArgumentType(f"base optimizer hyperparameters {sorted(base_kwargs)} were given "
                                          f"with an optimizer instance: set them when constructing it, or "
                                          f"pass its class, e.g. GeodesicSAM(model, torch.optim.AdamW, "
                                          f"lr=1e-3)")
            self.base_optimizer = base_optimizer
        elif isinstance(base_optimizer, type) and issubclass(base_optimizer, torch.optim.Optimizer):
            if not trainable:
                raise InvalidArgument("the model has no trainable parameter (requires_grad=True)")
            self.base_optimizer = base_optimizer(trainable, **base_kwargs)
        else:
            raise InvalidArgumentType(f"base_optimizer must be a torch.optim.Optimizer class or instance, "
                                      f"got {base_optimizer!r}")

        names = {id(p): n for n, p in model.named_parameters()}
        opt_params = [p for g in self.base_optimizer.param_groups for p in g["params"]]
        foreign = [i for i, p in enumerate(opt_params) if id(p) not in names]
        if foreign:
            raise InvalidArgument(f"{len(foreign)} parameter(s) of the base optimizer (positions "
                                  f"{foreign[:5]}) are not parameters of the model: build the base "
                                  f"optimizer on model.parameters()")
        #: name → parameter, for the perturbed parameters (updated by the base optimizer, trainable)
        self._perturbed: Dict[str, nn.Parameter] = {names[id(p)]: p for p in opt_params
                                                     if p.requires_grad}
        if not self._perturbed:
            raise InvalidArgument("the base optimizer updates no parameter with requires_grad=True")
        _check_hyperparameters(self.base_optimizer)
        #: the process group of FSDP2-sharded parameters (DTensors), ``None`` when not sharded
        self._shard_group = group_of(self._perturbed, "GeodesicSAM")
        #: whether the DDP model's last forward pass with autograd synchronised gradients (outside
        #: ``no_sync()``); the first backward of the SAM recipe often runs inside it
        self._ddp_state = {"synced": True}
        if self._ddp is not None:
            state = self._ddp_state

            def record_sync(module, args):
                if torch.is_grad_enabled():
                    state["synced"] = bool(getattr(module, "require_backward_grad_sync", True))

            self._ddp_hook = self._ddp.register_forward_pre_hook(record_sync)
        #: the inputs of the model's first forward pass after construction, until the layout is verified
        self._first_inputs: Dict[str, Any] = {}
        self._capture = None
        self.layout = self._checked_layout(layout, allow_unsupported, unsafe)

        # the wrapper shares the base optimizer's groups (lr schedulers, zero_grad)
        super().__init__(list(self._perturbed.values()), {})
        self.param_groups = self.base_optimizer.param_groups
        self.defaults = self.base_optimizer.defaults
        self._saved: Optional[Dict[str, Tensor]] = None
        #: the norm of the ascent direction g at the last ``first_step`` (metric norm, or
        #: Euclidean for ``"sam"``)
        self.grad_norm: Optional[float] = None
        #: whether the last update was skipped because a GradScaler's scaled gradients overflowed
        #: (``None`` between a skipping ``first_step`` and its ``second_step``)
        self.skipped: Optional[bool] = False
        self._scaler = None

    # ------------------------------------------------------------------ set-up
    def _checked_layout(self, layout, allow_unsupported: bool, unsafe: bool):
        if not GEOMETRY_TABLE[self.geometry].geodesic:
            return None
        from .accept import capture_first_call
        from .gate import Gate

        #: the layout verified and accepted on the first batch's inputs (adapters.gate)
        self._gate = Gate(self.model, layout, geometry=self.geometry, what=f"GeodesicSAM({self.geometry})",
                          consequence=SAM_CONSEQUENCE, unsafe=unsafe, allow_unsupported=allow_unsupported)
        layout = self._gate.layout
        pending = self._gate.pending
        if pending and self._shard_group is not None and verified_before_sharding(self.model, layout):
            # the whole model's verification before fully_shard stands for the sharded one
            pending, self._gate = False, None
        if pending:
            # verified on the inputs of the model's next forward pass (the first batch)
            self._capture = capture_first_call(self.model, self._first_inputs)
        elif self._gate is not None:   # verified already, or unsafe=True with a failed one (warns)
            layout = self._gate.accept(None, stacklevel=3)
        outside = sorted({p for b in layout.blocks for p in b.params} - set(self._perturbed))
        if outside:
            raise InvalidArgument(f"GL blocks of the layout touch parameter(s) {outside[:4]} that the "
                                  f"base optimizer does not update (or that do not require grad): a "
                                  f"block is perturbed as a whole. Include them in the base optimizer "
                                  f"or pass a layout without those blocks")
        if not layout.blocks:
            warnings.warn(f"the layout has no GL block: geometry={self.geometry!r} is then "
                          f"adaptive SAM", UserWarning, stacklevel=3)
        return layout

    # ------------------------------------------------------------------ the two steps
    @torch.no_grad()
    def first_step(self, zero_grad: bool = False, *, scaler=None) -> None:
        """Perturb the model's weights in place, w ← w_adv = R_w(ρ g/‖g‖), from the gradients in
        ``.grad`` (taken at w); ``zero_grad=True`` then clears them for the pass at w_adv.

        Under DistributedDataParallel, a backward pass run inside ``model.no_sync()`` left each rank
        its own gradient: they are averaged here first (one all-reduce), so that every rank takes
        the same ascent step. Non-finite gradients are refused (ValueError) before any weight is
        written.

        ``scaler``: the ``torch.amp.GradScaler`` of a float16 mixed-precision loop (the loss was
        ``scaler.scale(loss).backward()``). The gradients are unscaled first (``scaler.unscale_``),
        so ‖g‖ and the base step see the true gradient; non-finite ones are then the scaler's
        overflow signal, not an error: the update is skipped (the weights stay at w,
        :attr:`skipped` is True) and :meth:`second_step` lowers the scale.

        Parameters
        ----------
        zero_grad:
            Clear the gradients after the step (for the pass at w_adv).
        scaler:
            The ``torch.amp.GradScaler`` of a float16 loop, or None.

        Raises
        ------
        ValueError
            Non-finite gradients (without a scaler), a layout whose blocks fail verification on
            the first batch, or a scaler with an FSDP2-sharded model.
        RuntimeError
            No gradient in ``.grad``, sparse gradients, parameters replaced since construction,
            or ``first_step`` called twice without ``second_step``.
        TypeError
            ``scaler`` is not a ``torch.amp.GradScaler``.

        Examples
        --------
        See the class's example (``opt.first_step(zero_grad=True)``).
        """
        if self._saved is not None or self.skipped is None:
            raise UsageError("first_step() was called twice without second_step(): the weights "
                             "are at w_adv; call second_step() to restore them first")
        _check_hyperparameters(self.base_optimizer)
        current = dict(self.model.named_parameters())
        replaced = [n for n, p in self._perturbed.items() if current.get(n) is not p]
        if replaced:
            raise UsageError(f"the model's parameter(s) {', '.join(replaced[:3])} were replaced "
                             f"after GeodesicSAM was built (e.g. by fully_shard, or by assigning "
                             f"a new nn.Parameter): the base optimizer would update the old ones; "
                             f"build the optimizer and GeodesicSAM after sharding the model")
        self._scaler = self._checked_scaler(scaler)
        if self._scaler is not None:
            self._scaler.unscale_(self)
        grads = self._synchronised_gradients()
        if all(g is None for g in grads.values()):
            raise UsageError("no gradient in .grad: compute the loss at the current weights and "
                             "call loss.backward() before first_step()"
                             + (" (under FSDP2, with gradient synchronisation on: "
                                  "model.set_requires_gradient_sync(True))"
                                  if self._shard_group is not None else ""))
        if any(g is not None and g.is_sparse for g in grads.values()):
            raise NotSupported("sparse gradients are not supported by GeodesicSAM; use dense "
                               "embeddings (sparse=False)")
        bad = self._non_finite(grads)
        if bad is not None and self._scaler is not None:   # the scale overflowed: skip the update
            self.skipped, self.grad_norm = None, None          # None until second_step: pending
            if zero_grad:
                self.zero_grad()
            return
        if bad is not None:  # refused before any write: the elementwise norm would hide them (nan_to_num)
            raise InvalidArgument(f"non-finite values (NaN/inf) in .grad{bad} at the current weights: the "
                                  "weights were left unchanged; check the loss for NaN/inf (lower the "
                                  "learning rate, or clip gradients before first_step())")
        if self._capture is not None:
            self._verify_layout_on_every_rank()
        self._saved = {n: p.detach().clone() for n, p in self._perturbed.items()}
        try:
            if not GEOMETRY_TABLE[self.geometry].ball:
                self._euclidean_ascent_(grads)
            else:
                self._ball_ascent_(grads)
        except BaseException:
            self._restore()
            raise
        self.skipped = False
        if zero_grad:
            self.zero_grad()

    def _checked_scaler(self, scaler):
        if scaler is None or not scaler.is_enabled():
            return None
        if not callable(getattr(scaler, "unscale_", None)):
            raise InvalidArgumentType(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if self._shard_group is not None:
            raise InvalidArgument("GeodesicSAM with a GradScaler on an FSDP2-sharded model is not supported "
                                  "(the scaler's overflow record is per rank): train in bfloat16 autocast, "
                                  "which needs no scaler")
        return scaler


    def _verify_layout(self) -> None:
        """Verify the layout on the first batch's inputs (once; see :mod:`quotient_manifolds.adapters.accept`)."""
        captured = self._first_inputs
        what = f"GeodesicSAM({self.geometry})"
        if not captured:
            raise UsageError(
                f"{what} verifies the layout's blocks on the model's first forward pass after the "
                f"optimizer was built, and none was seen: build GeodesicSAM before the first forward "
                f"pass, or verify the layout yourself (lay.verify(model, inputs)) and pass layout=lay")
        self._capture.remove()
        if captured.get("mixed"):
            raise InvalidArgument(
                f"{what} verifies the layout's blocks on the model's first forward pass, but the model "
                f"was called with both positional and keyword arguments, which Layout.verify cannot "
                f"replay. Verify the layout yourself once (lay = adapters.layout(model); "
                f"lay.verify(model, {{...keyword inputs...}})) and pass layout=lay")
        if self._shard_group is not None:   # FSDP2: checked module by module on the shards
            from .sharded_gate import accept_on_shards

            self.layout = accept_on_shards(self._gate, captured["inputs"], None, 2)
        else:
            self.layout = self._gate.accept(captured["inputs"], stacklevel=3)
        self._first_inputs, self._capture = {}, None  # after a refusal the next step verifies again

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False, *, scaler=None) -> None:
        """Restore w exactly (bit for bit) and take the base optimizer's step with the gradients in
        ``.grad`` (taken at w_adv). Non-finite gradients are refused (ValueError) with the weights
        restored to w and no base step taken.

        ``scaler``: the GradScaler given to :meth:`first_step` (the default): the gradients are
        unscaled before the step; an overflow skips the base step (the weights stay at w,
        :attr:`skipped` is True); ``scaler.update()`` is called in every case.

        Parameters
        ----------
        zero_grad:
            Clear the gradients after the step.
        scaler:
            The GradScaler given to :meth:`first_step`.

        Raises
        ------
        ValueError
            Non-finite gradients at w_adv (without a scaler; the weights are restored to w), or
            another GradScaler than :meth:`first_step`'s.
        RuntimeError
            No :meth:`first_step` before it.

        Examples
        --------
        See the class's example (``opt.second_step(zero_grad=True)``).
        """
        if scaler is not None and self._scaler is not None and scaler is not self._scaler:
            raise InvalidArgument("second_step(scaler=...) got another GradScaler than first_step: pass "
                                  "the same one (or none: first_step's is used)")
        scaler = self._scaler
        if self.skipped is None:   # first_step skipped the update: the scaler lowers its scale
            self.skipped, self._scaler = True, None
            if zero_grad:
                self.zero_grad()
            scaler.update()
            return
        if self._saved is None:
            raise UsageError("second_step() without first_step(): call first_step() after the "
                             "backward pass at w, then backward at w_adv, then second_step()")
        self._restore()
        self._scaler = None
        if scaler is not None:
            scaler.unscale_(self.base_optimizer)   # its own record: the scaler allows one per optimizer
        grads = self._synchronised_gradients()
        bad = self._non_finite(grads)
        if bad is not None and scaler is not None:
            self.skipped = True
            if zero_grad:
                self.zero_grad()
            scaler.update()
            return
        if bad is not None:  # the weights are back at w: the base step must not write NaN into them
            raise InvalidArgument(f"non-finite values (NaN/inf) in .grad{bad} at the perturbed weights "
                                  f"w_adv: the weights were restored to w and the base step was not "
                                  f"taken; the loss overflows within the ball: lower rho (now "
                                  f"{self.rho:g}) or the learning rate, or clip gradients before "
                                  f"second_step()")
        if scaler is not None:
            scaler.step(self.base_optimizer)
            scaler.update()
        else:
            self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Tensor:
        """One SAM update with ``closure()`` = forward + ``loss.backward()`` (gradients are zeroed
        before each call): the pass at w, :meth:`first_step`, the pass at w_adv,
        :meth:`second_step`. Returns the loss at w.

        Parameters
        ----------
        closure:
            Computes the loss and calls ``backward()``; evaluated at w and at w_adv.

        Returns
        -------
        Tensor
            The loss at w.

        Raises
        ------
        RuntimeError
            No closure.
        ValueError
            As :meth:`first_step` and :meth:`second_step`.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds import adapters
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
        ...                                          batch_first=True).double()
        >>> x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
        >>> opt = adapters.GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.1)
        >>> def closure():
        ...     loss = torch.nn.functional.mse_loss(model(x), y)
        ...     loss.backward()
        ...     return loss
        >>> first = opt.step(closure).item()
        >>> opt.step(closure).item() < first
        True
        """
        if closure is None:
            raise UsageError("GeodesicSAM.step needs a closure that computes the loss and calls "
                             "backward() (it is evaluated at w and at w_adv); or call "
                             "first_step() and second_step() around your own backward passes")
        with torch.enable_grad():
            self.zero_grad()
            loss = closure()
            self.first_step(zero_grad=True)
            try:
                closure()
            except BaseException:
                self._restore()
                raise
        self.second_step()
        return loss

    def _restore(self) -> None:
        with torch.no_grad():
            for n, w in (self._saved or {}).items():
                self._perturbed[n].copy_(w)
        self._saved = None

    # ------------------------------------------------------------------ ascent directions
    def _euclidean_ascent_(self, grads: Dict[str, Optional[Tensor]]) -> None:
        """Plain SAM, in place: w ← w + ρ∇/‖∇‖₂ (per-tensor norms in one fused pass, half
        precision accumulated in float32; sharded parameters: each rank's shard, ‖∇‖² summed over
        the ranks)."""
        present = [(_local(self._perturbed[n]), _local(g)) for n, g in grads.items() if g is not None]
        norms = [torch._foreach_norm([g for _, g in present if g.dtype == dtype], 2,
                                     torch.float32 if dtype in HALF_DTYPES else None)
                 for dtype in {g.dtype for _, g in present}]
        norms = [n.double() for part in norms for n in part]
        if self._shard_group is None:
            norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        else:
            norm = math.sqrt(max(self._sum_over_ranks(float(sum(n * n for n in norms))), 0.0))
        self.grad_norm = self._checked_norm(norm)
        if norm > 0:
            for p, g in present:
                p.add_(g, alpha=self.rho / norm)

    def _ball_ascent_(self, grads: Dict[str, Optional[Tensor]]) -> None:
        r"""w ← R(ε), ε = ρ g/‖g‖ in the ball of the current weights: one ascent for a model in one
        process and for an FSDP2-sharded one, over the pieces of the ball (:meth:`_pieces`). A
        first pass forms each piece's Riemannian gradient and ‖g‖² (the shards' summed over the
        ranks), a second scales the gradient to ε and writes each piece's point R(ε) back.

        The Euclidean gradient in ball coordinates is the gather of ∇ into the blocks' and the
        elementwise layout (:class:`~quotient_manifolds.adapters.ball.BallParameters`), the gradient of
        ξ ↦ L(R(ξ)) at ξ = 0 since DR₀ = id for every retraction."""
        upcast = any(p.dtype in HALF_DTYPES for p in self._perturbed.values())
        kept, summed, once = [], 0.0, 0.0
        for piece in self._pieces(grads, upcast):
            value = float(piece.ball.inner(piece.rgrad, piece.rgrad))
            summed, once = (summed + value, once) if piece.summed else (summed, once + value)
            if piece.kept:
                kept.append(piece)
        norm = math.sqrt(max(self._sum_over_ranks(summed) + once, 0.0))
        self.grad_norm = self._checked_norm(norm)
        if norm == 0:
            return
        for piece in itertools.chain(kept, self._pieces(grads, upcast, rebuilt_only=True)):
            torch._foreach_mul_(piece.rgrad, self.rho / norm)  # ε, in place: rgrad is a fresh gather
            piece.write(piece.ball_params(piece.ball.points(piece.rgrad, consume=True)))

    def _pieces(self, grads: Dict[str, Optional[Tensor]], upcast: bool,
                rebuilt_only: bool = False) -> Iterator[AscentPiece]:
        """The pieces of the ascent's ball: in one process one, the ball of every perturbed weight
        (kept between the passes); sharded, this rank's shards and each attention module whole
        (:meth:`_sharded_pieces`). ``rebuilt_only``: only the pieces not kept."""
        if self._shard_group is not None:
            yield from self._sharded_pieces(grads, upcast, rebuilt_only)
            return
        if rebuilt_only:
            return
        params0 = {n: as_compute(p.detach(), upcast) for n, p in self._perturbed.items()}
        ball, ball_params = self._ball_of(params0, self.layout)

        def write(params: Dict[str, Tensor]) -> None:
            for n, p in self._perturbed.items():
                if params[n] is not params0[n]:
                    p.copy_(params[n])

        yield AscentPiece(ball, ball_params, ball.rgrad(ball_params.gather(grads)), write,
                          summed=True, kept=True)

    def _ball_of(self, params0: Dict[str, Tensor], layout):
        return build_ball(self.model, params0, geometry=self.geometry, layout=layout,
                          retraction=self.retraction, gram_eps=self.gram_eps,
                          elementwise_second_order=self.elementwise_second_order)


    # ------------------------------------------------------------------ ranks

    def _non_finite(self, grads: Dict[str, Optional[Tensor]]) -> Optional[str]:
        """``None`` when every gradient is finite on every rank; else a description of where not."""
        bad = [n for n, g in grads.items() if g is not None and not g.is_sparse
               and not bool(torch.isfinite(_local(g)).all())]
        if self._shard_group is not None:
            if self._sum_over_ranks(float(len(bad))) == 0:
                return None
            return (f" of {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}" if bad else
                    " on another rank")
        return None if not bad else f" of {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"


    @staticmethod
    def _checked_norm(norm: float) -> float:
        if not math.isfinite(norm):
            raise NonFiniteLoss(f"the gradient norm is not finite ({norm}): the loss or its "
                                f"gradient overflowed at the current weights (lower the "
                                f"learning rate, or clip gradients before first_step)")
        return norm

    # ------------------------------------------------------------------ state
    def state_dict(self):
        """The base optimizer's state dict (the wrapper keeps no state between updates)."""
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups

    def __repr__(self) -> str:
        return (f"GeodesicSAM(geometry={self.geometry!r}, rho={self.rho:g}, "
                f"retraction={self.retraction!r}, base={self.base_optimizer!r})")
