r"""The geometries of the perturbation ball, and the ball of a model.

:data:`GEOMETRY_TABLE` is the one table of the geometries the adapters know, name → :class:`Geometry`
(the metric of the GL blocks, whether a product ball is built at all); every public entry point
(``sharpness``, ``sharpness_sweep``, ``calibrate_rho``, ``riemannian_hessian``, ``GeodesicSAM``)
validates its ``geometry=`` once with :func:`geometry_of` and reads the maths from the entry:

=================  ==========  ==========================================================================
name               GL metric   ball
=================  ==========  ==========================================================================
``adaptive``       –           elementwise metric Σ ξ²/w² on every weight (Andriushchenko et al., Kwon et al.)
``geodesic-inv``   ``inv``     GL blocks on their quotient with the inv metric, every other weight adaptive
``geodesic-mix``   ``mix``     the same with the mix metric (its ρ has units: ‖·‖_mix scales like |w|⁴)
``sam``            –           no ball: plain Euclidean SAM (:class:`~quotient_manifolds.adapters.GeodesicSAM` only)
=================  ==========  ==========================================================================

:func:`build_ball` turns a model's parameters and :class:`~quotient_manifolds.adapters.Layout` into a
:class:`~quotient_manifolds.adapters.components.ProductBall` for one of the ball geometries
(:data:`GEOMETRIES`). The maths: docs/maths.md §6 (blocks, total norm, ε).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from functools import partial
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch

from quotient_manifolds._validation import choice
from quotient_manifolds.core.gl import GLQuotientGeometry
from quotient_manifolds.errors import InvalidArgument

from . import validation as check
from .components import ProductBall, QuotientComponent
from .elementwise import ElementwiseComponent, StreamedPoint
from .streaming import LazyWeight

Tensor = torch.Tensor


@dataclass(frozen=True)
class Geometry:
    """One geometry of the perturbation ball (an entry of :data:`GEOMETRY_TABLE`)."""

    #: the name users pass as ``geometry=``
    name: str
    #: the quotient metric of the GL blocks (``"inv"`` or ``"mix"``); ``None``: no quotient, every
    #: weight in the elementwise (adaptive) metric
    metric: Optional[str]
    #: whether the geometry has a :class:`~quotient_manifolds.adapters.components.ProductBall` (False only
    #: for plain Euclidean SAM)
    ball: bool = True
    #: the first radius :func:`~quotient_manifolds.adapters.calibrate_rho` tries: a few evaluations
    #: from most models' answer (mix's ρ has units of the weights)
    rho_start: float = 0.1

    @property
    def geodesic(self) -> bool:
        """Whether the attention blocks live on their GL(h) quotient (a layout is needed and verified)."""
        return self.metric is not None

    @property
    def adaptive(self) -> bool:
        """Whether every weight is in the elementwise metric Σ ξ²/w² (a ball without a quotient)."""
        return self.ball and self.metric is None


#: name → :class:`Geometry`: the one table of the geometries (module docstring)
GEOMETRY_TABLE: Mapping[str, Geometry] = MappingProxyType({g.name: g for g in (
    Geometry("adaptive", None),
    Geometry("geodesic-inv", "inv"),
    Geometry("geodesic-mix", "mix", rho_start=0.05),
    Geometry("sam", None, ball=False),
)})
#: the geometries of the sharpness ball (:func:`~quotient_manifolds.adapters.sharpness`,
#: :func:`build_ball`, the Hessian), in the order results list them
GEOMETRIES: Tuple[str, ...] = tuple(name for name, g in GEOMETRY_TABLE.items() if g.ball)


def geometry_of(name: object, allowed: Tuple[str, ...] = GEOMETRIES, argument: str = "geometry") -> Geometry:
    """The :class:`Geometry` called ``name``, refused (ValueError listing the valid names, and the
    one meant when ``name`` is a bare metric such as ``"mix"``) unless it is one of ``allowed``."""
    if isinstance(name, str) and name not in allowed:
        meant = [g for g in allowed if GEOMETRY_TABLE[g].metric == name]
        if meant:
            raise InvalidArgument(f"{argument} must be one of {', '.join(map(repr, allowed))}, got {name!r}: "
                                  f"for the {name} metric on the GL blocks pass {argument}={meant[0]!r}")
    return GEOMETRY_TABLE[choice(argument, name, allowed)]


def build_ball(model: torch.nn.Module, params0: Dict[str, Tensor], *, geometry: str,
               layout=None, retraction: str = "second_order", gram_eps: float = 0.0,
               use_metric_norm: bool = True, adaptive_direction: str = "riemannian",
               elementwise_second_order: bool = False, streaming: bool = False,
               compute_dtype: Optional[torch.dtype] = None) -> Tuple[ProductBall, "BallParameters"]:
    """The ball of perturbations and the map between ball points and the parameter dict
    (:class:`BallParameters`: call it on points; ``gather`` reads gradients into the ball).

    ``geometry``: one of :data:`GEOMETRIES`. A geodesic one (``"geodesic-inv"``, ``"geodesic-mix"``):
    blocks with equal :func:`_component_key` (n, m, h, symmetry group) are stacked into ONE batched
    GLQuotientGeometry over all their heads (e.g. all QK blocks of a BERT), so the geometry costs a
    few batched h×h factorisations per group; every weight not covered by a GL block (or the
    uncovered entries of a partially covered one) is elementwise. ``"adaptive"``: every trainable
    weight is elementwise. ``gram_eps``: the Gram relaxation GᵀG + εI of the quotient
    metrics (docs/maths.md §6.4).

    ``streaming=True`` gives the elementwise components the streaming layout
    (:class:`~quotient_manifolds.adapters.elementwise.ElementwiseComponent`): the ball parameters
    are then recipes (:class:`~quotient_manifolds.adapters.streaming.LazyWeight`) for
    :func:`~quotient_manifolds.adapters.streaming.substituted`, and no perturbed copy of the
    weights is formed. ``compute_dtype`` (e.g. float32 for a bfloat16 model whose ``params0`` are
    its own weights) is the dtype of the iterates and points; default: each weight's own.
    """
    metric = geometry_of(geometry).metric
    check.module("model", model)
    check.parameter_tensors("params0", params0, model)
    if metric is not None:
        check.layout_for_ball(layout, params0, geometry)
        layout.check_model(model, what="build_ball")
    return ball_of(params0, geometry=geometry, layout=layout, retraction=retraction, gram_eps=gram_eps,
                   use_metric_norm=use_metric_norm, adaptive_direction=adaptive_direction,
                   elementwise_second_order=elementwise_second_order, streaming=streaming,
                   compute_dtype=compute_dtype)


def ball_of(params0: Dict[str, Tensor], *, geometry: str, layout=None, retraction: str = "second_order",
            gram_eps: float = 0.0, use_metric_norm: bool = True, adaptive_direction: str = "riemannian",
            elementwise_second_order: bool = False, streaming: bool = False,
            compute_dtype: Optional[torch.dtype] = None) -> Tuple[ProductBall, "BallParameters"]:
    """:func:`build_ball` on arguments already checked against the model (the ball needs only the
    weights ``params0`` and the layout): what the entry points call after their gate. The layout is
    checked against ``params0`` here (a weight frozen or unfrozen since it was built is refused)."""
    metric = geometry_of(geometry).metric
    if metric is not None:
        check.layout_for_ball(layout, params0, geometry)
    trainable = list(params0)
    components: List = []
    groups: List[Tuple[List, List[int]]] = []  # (blocks, head counts) per quotient component
    if metric is not None:
        components, groups = quotient_components(
            layout.blocks, params0, metric=metric, retraction=retraction, gram_eps=gram_eps,
            use_metric_norm=use_metric_norm, streaming=streaming, compute_dtype=compute_dtype)
        masks = getattr(layout, "gl_masks", {})
        elementwise = [(n, ~masks[n].to(params0[n].device) if n in masks else None)
                       for n in layout.adaptive if n in params0]
    else:
        elementwise = [(n, None) for n in trainable]
    # one flat elementwise component per (dtype, device), so each solver step is one pass
    by_kind: "OrderedDict[Tuple, Dict[str, Tensor]]" = OrderedDict()
    mask_of = dict(elementwise)
    for name, _ in elementwise:
        kind = (compute_dtype or params0[name].dtype, params0[name].device)
        by_kind.setdefault(kind, {})[name] = params0[name]
    for (dtype, _), tensors in by_kind.items():
        components.append(ElementwiseComponent(tensors, masks={n: mask_of[n] for n in tensors},
                                               direction=adaptive_direction,
                                               second_order=elementwise_second_order,
                                               streaming=streaming, dtype=dtype))
    return ProductBall(components), BallParameters(params0, components, groups, compute_dtype)


def quotient_components(blocks: Sequence, params0: Mapping[str, Tensor], *, metric: str,
                        retraction: str = "second_order", gram_eps: float = 0.0,
                        use_metric_norm: bool = True, streaming: bool = False,
                        compute_dtype: Optional[torch.dtype] = None
                        ) -> Tuple[List[QuotientComponent], List[Tuple[List, List[int]]]]:
    """The quotient components of :func:`build_ball` for GL ``blocks`` (with the ``metric`` of
    the GL blocks, ``"inv"`` or ``"mix"``), and each component's (blocks, head counts): blocks
    of equal :func:`_component_key` are stacked, in runs of at most :data:`CPU_COMPONENT_BYTES`
    (:data:`ACCELERATOR_COMPONENT_BYTES` off the CPU) of float64 heads."""
    by_key: "OrderedDict[Tuple[int, int, int, Hashable], List]" = OrderedDict()
    for block in blocks:
        by_key.setdefault(_component_key(block), []).append(block)
    runs = [(key, run) for key, same in by_key.items()
            for run in _runs_of_blocks(same, key, params0[same[0].g_pieces[0].param])]
    components: List[QuotientComponent] = []
    groups: List[Tuple[List, List[int]]] = []
    for (n, m, h, group), run in runs:
        try:
            geom = GLQuotientGeometry(n, m, h, metric, retraction=retraction, eps=gram_eps,
                                      **({"group": group} if group is not None else {}))
        except ValueError as err:   # e.g. a head dimension h larger than n or m
            raise InvalidArgument(f"block(s) {', '.join(b.name for b in run)}: {err}; measure this "
                                  f"model with geometry='adaptive', or pass a layout= without these "
                                  f"blocks") from None
        counts = [block.num_heads for block in run]
        like = params0[run[0].g_pieces[0].param]
        dtype = compute_dtype or like.dtype
        # streaming (large models): the heads stay in the weights' dtype, and the frame
        # promotes them where it uses them (the same numbers, no float64 copy)
        x0 = _gather_heads(run, counts, params0, like.device,
                           like.dtype if streaming else torch.float64)
        frame = _frame_or_explain(geom, x0, run, counts, keep_dtype=streaming)
        name = f"GL(h={h}) n={n} m={m} [{len(run)} blocks]"
        # iterates in the model's dtype; the frame does its Gram-matrix work in float64
        components.append(QuotientComponent(name, frame, x0, retraction=retraction,
                                            use_metric_norm=use_metric_norm, dtype=dtype,
                                            recompute=streaming))
        groups.append((run, counts))
    return components, groups


class BallParameters:
    """The map between the points of a :func:`build_ball` ball and the model's parameters.

    ``ball_params(points)`` is the full parameter dict at those points (a scatter: elementwise
    components replace whole tensors, GL blocks their slices; differentiable in the points).
    ``ball_params.gather(tensors)`` reads parameter-shaped tensors (weights, or gradients with
    ``None`` for zero) into the ball's coordinates: the adjoint of the scatter, so for the gradient
    ∇ of a loss at the centre it is the Euclidean gradient of ξ ↦ L(R(ξ)) at ξ = 0 (DR₀ = id for
    every retraction). Entries of an elementwise component that a GL block owns are gathered too;
    the component keeps them fixed (its mask), so they never move.
    """

    def __init__(self, params0: Dict[str, Tensor], components: List, groups: List,
                 compute_dtype: Optional[torch.dtype] = None):
        self.params0 = params0
        self.compute_dtype = compute_dtype
        self._quotients = list(zip(groups, components[:len(groups)]))
        self._elementwise = components[len(groups):]

    def __call__(self, points: List[Any]) -> Dict[str, Any]:
        """The parameters at ``points``: tensors, or with streaming points
        (:class:`~quotient_manifolds.adapters.elementwise.StreamedPoint`) recipes
        (:class:`~quotient_manifolds.adapters.streaming.LazyWeight`) for every weight a point
        moves or that needs a cast to ``compute_dtype``."""
        n_quotient = len(self._quotients)
        params: Dict[str, Any] = dict(self.params0)
        streamed = False
        for comp, point in zip(self._elementwise, points[n_quotient:]):
            if isinstance(point, StreamedPoint):
                params.update(point.weights())
                streamed = True
            else:
                params.update(comp.unflatten(point))
        if not streamed:
            if self.compute_dtype is not None:  # weights of the model's own (half) precision
                params = {n: v.to(self.compute_dtype) if v.is_floating_point() else v
                          for n, v in params.items()}
            for ((blocks, counts), _), point in zip(self._quotients, points[:n_quotient]):
                for block, x in zip(blocks, torch.split(point, counts, dim=0)):
                    dtype = params[block.g_pieces[0].param].dtype
                    params = block.scatter(params, x.to(dtype))
            return params
        # streaming: each weight a GL block writes into becomes a recipe that writes the heads'
        # points into its own value when read (nothing of the weight's size is held in between)
        writes = head_writes([groups for groups, _ in self._quotients], points[:n_quotient],
                             self.params0)
        for name, value in params.items():
            if name in writes or (isinstance(value, Tensor) and self.compute_dtype is not None
                                  and value.dtype != self.compute_dtype and value.is_floating_point()):
                params[name] = LazyWeight(partial(_written, value, writes.get(name, ()),
                                                  self.compute_dtype))
        return params

    def gather(self, tensors: Mapping[str, Optional[Tensor]]) -> List[Tensor]:
        full = {n: torch.zeros_like(w) if tensors.get(n) is None else tensors[n]
                for n, w in self.params0.items()}
        out = [_gather_heads(blocks, counts, full, comp.x0.device)
               for (blocks, counts), comp in self._quotients]
        return out + [torch.cat([full[n].reshape(-1).to(comp.dtype) for n in comp.names])
                      for comp in self._elementwise]


def head_writes(groups: Sequence[Tuple[List, List[int]]], points: Sequence[Tensor],
                weights: Mapping[str, Tensor]) -> Dict[str, List[Tuple[Any, Tensor]]]:
    """Per weight, the (piece, heads' rows) that the points of the quotient components write into
    it: ``groups`` are the components' (blocks, head counts), ``weights`` give the weights' shapes."""
    writes: Dict[str, List[Tuple[Any, Tensor]]] = {}
    for (blocks, counts), point in zip(groups, points):
        for block, x in zip(blocks, torch.split(point, counts, dim=0)):
            for piece, rows in zip(block.pieces, block.split_rows(x, weights)):
                writes.setdefault(piece.param, []).append((piece, rows))
    return writes


def _written(base: Any, writes: Sequence[Tuple[Any, Tensor]], dtype: Optional[torch.dtype]) -> Tensor:
    """The value of a weight: ``base`` (a recipe or a tensor, cast to ``dtype``) with the GL heads
    ``writes`` (piece, value) written into it."""
    value = base.compute() if isinstance(base, LazyWeight) else base
    if dtype is not None and value.dtype != dtype:
        value = value.to(dtype)
    for piece, x in writes:
        value = piece.write(value, x)
    return value


def _gather_heads(blocks: List, counts: List[int], tensors: Mapping[str, Tensor],
                  device: torch.device, dtype: torch.dtype = torch.float64) -> Tensor:
    """The heads ``[G; H]`` of all ``blocks`` stacked, in ``dtype``, filled block by block (no
    copy per block)."""
    n, m, h = blocks[0].n, blocks[0].m, blocks[0].head_dim
    x = torch.empty((sum(counts), n + m, h), dtype=dtype, device=device)
    for block, part in zip(blocks, torch.split(x, counts)):
        part.copy_(block.gather(tensors))
    return x


#: On CPU, blocks of one shape are batched into components of at most this many bytes of float64
#: heads (whole blocks; a larger block is a component of its own): a temporary of the geometry
#: (tens per iteration) then stays in cache and in glibc's heap, which reuses it, instead of a
#: fresh mmap that page-faults on every touch (BERT-base, 1 thread: a pass over all 144 QK heads
#: at once ran at 0.5 GB/s; the geometry's share of an iteration fell from 9.9 s to 4.7–5.1 s).
#: On an accelerator the runs are :data:`ACCELERATOR_COMPONENT_BYTES` large.
CPU_COMPONENT_BYTES = 4 * 2 ** 20
#: On an accelerator, blocks of one shape are batched into components of at most this many bytes
#: of float64 heads: few launches per iteration (seven components for a 7B decoder's 6.6 GB of
#: attention heads), while the geometry's float64 temporaries stay a few of this size instead of
#: a few copies of all attention weights at once.
ACCELERATOR_COMPONENT_BYTES = 2 ** 30


def _runs_of_blocks(blocks: List, key: Tuple[int, int, int, Hashable], like: Tensor) -> List[List]:
    """``blocks`` (of one component key) cut into consecutive runs of at most
    :data:`CPU_COMPONENT_BYTES` (:data:`ACCELERATOR_COMPONENT_BYTES` off the CPU) of float64 heads."""
    limit = CPU_COMPONENT_BYTES if like.device.type == "cpu" else ACCELERATOR_COMPONENT_BYTES
    n, m, h, _ = key
    runs: List[List] = [[]]
    size = 0
    for block in blocks:
        nbytes = block.num_heads * (n + m) * h * 8
        if runs[-1] and size + nbytes > limit:
            runs.append([])
            size = 0
        runs[-1].append(block)
        size += nbytes
    return runs


def _component_key(block) -> Tuple[int, int, int, Hashable]:
    """Blocks with equal keys share one batched quotient geometry: the shapes (n, m, h) and the
    symmetry group (``None``: the full GL(h))."""
    return (block.n, block.m, block.head_dim, getattr(block, "group", None))


def _frame_or_explain(geom: GLQuotientGeometry, x0: Tensor, blocks, counts, keep_dtype: bool = False):
    try:
        return geom.frame(x0, keep_dtype=keep_dtype)
    except ValueError:
        for block, x in zip(blocks, torch.split(x0, counts)):
            try:
                geom.frame(x, keep_dtype=keep_dtype)
            except ValueError as err:
                raise InvalidArgument(f"GL block {block.name!r} ({block.num_heads} heads, G {block.n}×"
                                      f"{block.head_dim}, H {block.m}×{block.head_dim}): {err}") from None
        raise
