r"""The elementwise (adaptive) component of the perturbation ball: every weight that no GL block
holds, in the metric Σ ξ²/w² (docs/maths.md §6.2), with the passes of the solver over vectors of
any size (:data:`KERNEL_LIMIT`, :func:`add_dot_`) and the streaming evaluation that never copies
the weights (:class:`StreamedPoint`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from quotient_manifolds._validation import choice
from quotient_manifolds.errors import InvalidArgument

if TYPE_CHECKING:
    from .streaming import LazyWeight

Tensor = torch.Tensor

#: the ascent directions of the elementwise (adaptive) weights: ``"riemannian"`` ∇⊙w² (the paper's
#: Alg. 1) or ``"andriushchenko"`` ∇⊙|w| (their code)
ADAPTIVE_DIRECTIONS: Tuple[str, ...] = ("riemannian", "andriushchenko")

#: Elements per piece of the elementwise component's loops on the CPU: a reduction re-reads the
#: piece its operation just wrote from cache, and the pieces are few (each call costs tens of µs
#: to start its threads). 2**20 was fastest on MiniLM's 23M weights (2 threads; 2**17: +40 %,
#: whole tensors: +35 %).
CHUNK = 2 ** 20
#: Most elements one kernel call gets (accelerators: the pieces of a pass; both devices: at most):
#: BLAS reductions index with 32-bit integers (``torch.dot`` refuses vectors past 2³¹ elements),
#: and a bound on every call keeps a pass over a model of billions of weights possible.
KERNEL_LIMIT = 2 ** 28
#: Reductions (‖·‖², ⟨·,·⟩) add up partial sums over blocks of this many elements, aligned to the
#: start of each piece's tensor (or of the flat vector), in order: the result does not depend on
#: how a pass is cut into kernel calls (:data:`CHUNK`, :data:`KERNEL_LIMIT`, both multiples of it).
REDUCTION_BLOCK = 2 ** 18
#: The dtype in which the solver's last step d = ξ − ξ⁻ (Auto-PGD's momentum) of an elementwise
#: component is kept compact, per iterate dtype: bfloat16 for float32 (2 bytes per weight instead
#: of 4); any other dtype (float64) keeps its own.
COMPACT_STEP_DTYPES: Dict[torch.dtype, torch.dtype] = {torch.float32: torch.bfloat16}
#: dtypes of two bytes, which the passes over a solver's vectors read in float32
HALF_DTYPES = (torch.bfloat16, torch.float16)
#: One-dimensional tensors of at most this many elements (biases, norm scales) get their streaming
#: points formed together, in one autograd node per evaluation, before the model reads them: per
#: tensor, the host work of a recipe and a node of its own costs more than holding the values.
#: Such vectors grow with a model's width, not its square (a few hundred kB for a 7B decoder's
#: biases and norms), so the weights are still never copied.
SMALL_TENSOR = 2 ** 16


def add_dot_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out += ⟨a, b⟩`` (``out`` a 0-d float64 tensor; ``a``, ``b`` 1-D and contiguous), summed
    block by block (:data:`REDUCTION_BLOCK`) in a fixed order: on the CPU one BLAS dot per block,
    on an accelerator one batched product per call for all whole blocks (few launches)."""
    n, block = a.numel(), REDUCTION_BLOCK
    # a compact (bfloat16) solver vector is read in float32, one block at a time: its products
    # then carry float32's precision, and no float32 copy of the whole vector is formed
    wide = torch.float32 if a.dtype in HALF_DTYPES or b.dtype in HALF_DTYPES else None
    if a.device.type == "cpu" or wide is not None:
        for s in range(0, n, block):
            x, y = a[s:s + block], b[s:s + block]
            out += torch.dot(x, y) if wide is None else torch.dot(x.to(wide), y.to(wide))
        return out
    whole = n - n % block
    if whole:
        rows = whole // block
        out += torch.linalg.vecdot(a[:whole].view(rows, block), b[:whole].view(rows, block)
                                   ).sum(dtype=torch.float64)
    if n > whole:
        out += torch.dot(a[whole:], b[whole:])
    return out


class _StreamedPoint(torch.autograd.Function):
    """w(1 + r) (second order: w(1 + r + r²/2)) of one tensor in the compute dtype, whose backward
    writes the Riemannian gradient h of that tensor into the evaluation's gradient buffer
    (:meth:`ElementwiseComponent.accumulate_`) instead of returning it: autograd then holds no
    gradient per tensor, and the weights are never copied."""

    @staticmethod
    def forward(ctx, r: Tensor, w: Tensor, comp: "ElementwiseComponent", index: int,
                point: "StreamedPoint") -> Tensor:
        ctx.comp, ctx.index, ctx.point, ctx.r = comp, index, point, r.detach()
        return comp.moved(w, r)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.comp.accumulate_(ctx.point, ctx.index, grad, ctx.r)
        return None, None, None, None, None


class _StreamedSmall(torch.autograd.Function):
    """The points w(1 + r) of many small tensors (:data:`SMALL_TENSOR`) in one node: the forward
    forms them all, the backward writes the Riemannian gradient of each into the evaluation's
    gradient buffer as :class:`_StreamedPoint` does for one."""

    @staticmethod
    def forward(ctx, comp: "ElementwiseComponent", point: "StreamedPoint", indices: List[int],
                *rs: Tensor) -> Tuple[Tensor, ...]:
        ctx.comp, ctx.point, ctx.indices = comp, point, indices
        ctx.rs = [r.detach() for r in rs]
        ws = [comp.tensors[i] for i in indices]
        if not comp.second_order and all(t.dtype == comp.dtype for t in (*ws, *rs)):
            return tuple(torch._foreach_addcmul(ws, ws, list(rs)))  # one call for all of them
        return tuple(comp.moved(w, r) for w, r in zip(ws, rs))

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        for index, grad, r in zip(ctx.indices, grads, ctx.rs):
            if grad is not None:
                ctx.comp.accumulate_(ctx.point, index, grad, r)
        return (None, None, None, *(None for _ in grads))


class _StreamedRows(torch.autograd.Function):
    """Rows ``ids`` of the point w(1 + r) of one two-dimensional tensor, as an embedding lookup
    reads them (``F.embedding(ids, w(1 + r), padding_idx)``), formed from those rows alone; the
    backward adds the Riemannian gradient of the rows into the evaluation's gradient buffer
    (:meth:`ElementwiseComponent.accumulate_rows_`). The rows a batch does not read are never
    formed, and their gradient is a zero fill."""

    @staticmethod
    def forward(ctx, ids: Tensor, r: Tensor, comp: "ElementwiseComponent", index: int,
                point: "StreamedPoint", padding_idx: Optional[int]) -> Tensor:
        rows = ids.reshape(-1)
        w = comp.tensors[index]
        # only the row indices are kept: r stays unchanged until the backward has run (the
        # solver's buffer), so the backward gathers its rows and w's again
        ctx.comp, ctx.index, ctx.point, ctx.padding_idx = comp, index, point, padding_idx
        ctx.rows, ctx.r = rows, r.detach()
        return comp.moved(w.index_select(0, rows), ctx.r.index_select(0, rows)
                          ).reshape(*ids.shape, w.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.comp.accumulate_rows_(ctx.point, ctx.index, ctx.rows, grad.reshape(ctx.rows.numel(), -1),
                                  ctx.r, ctx.padding_idx)
        return None, None, None, None, None, None


class StreamedPoint:
    """The elementwise point of one evaluation in the streaming layout: per tensor a recipe
    (:class:`~quotient_manifolds.adapters.streaming.LazyWeight`) computing w(1 + r) when the model
    reads it, and the buffer its backward fills with the Riemannian gradient in r (``into``: a
    free buffer of the solver's, else a new one)."""

    def __init__(self, comp: "ElementwiseComponent", leaves: List[Tensor], need_grad: bool,
                 into: Optional[Tensor] = None):
        self.comp, self.leaves = comp, leaves
        dtype = leaves[0].dtype if leaves else comp.dtype  # the solver's vectors' (compact or not)
        if into is not None and (into.shape != (comp.numel,) or into.dtype != dtype):
            raise InvalidArgument(f"the gradient buffer must be a flat {dtype} vector of "
                                  f"{comp.numel} elements, got {tuple(into.shape)} {into.dtype}")
        self.gradient = None if not need_grad else (
            into if into is not None else torch.empty(comp.numel, dtype=dtype, device=comp.device))
        self.written = [False] * len(leaves)

    def weights(self) -> Dict[str, "LazyWeight"]:
        """A recipe per tensor: the small vectors (:data:`SMALL_TENSOR`) formed now, together,
        and returned as they are; the others formed at each read, and for a matrix read by an
        embedding lookup only the rows it reads (``rows``, where :attr:`ElementwiseComponent.row_reads`)."""
        from .streaming import LazyWeight

        comp = self.comp
        small = [i for i, (size, shape) in enumerate(zip(comp.sizes, comp.shapes))
                 if size <= SMALL_TENSOR and len(shape) <= 1]
        formed = dict(zip(small, _StreamedSmall.apply(comp, self, small,
                                                      *(self.leaves[i] for i in small))
                          if small else ()))
        return {name: LazyWeight(lambda t=formed[i]: t) if i in formed else
                LazyWeight(lambda i=i: _StreamedPoint.apply(self.leaves[i], comp.tensors[i], comp,
                                                            i, self),
                           rows=(lambda ids, padding_idx, i=i: _StreamedRows.apply(
                               ids, self.leaves[i], comp, i, self, padding_idx))
                           if comp.row_reads and len(comp.shapes[i]) == 2 else None)
                for i, name in enumerate(comp.names)}


class ElementwiseComponent:
    r"""Adaptive-sharpness geometry of plain weight tensors w (c = |w|; docs/maths.md §6.2, §10).

    Metric ⟨ξ, η⟩ = Σ ξη/w², Riemannian gradient ∇⊙w², point w + ξ. Entries with w = 0 (or |w| so
    small that w² underflows, or outside their ``mask``) have infinite cost and are kept fixed
    (ξ = 0 there; docs/maths.md §12.12). With ``direction="andriushchenko"`` the ascent direction is ∇⊙|w|
    (their code) instead of ∇⊙w². ``second_order=True`` adds the elementwise Christoffel term (docs/maths.md
    §12.10; default off, as the paper's App. C.1 keeps "the recipe of adaptive sharpness" for these
    weights).

    A tangent vector is ONE flat vector over all tensors given (this part holds most scalars of a
    transformer: embeddings, MLPs), in ``dtype`` (default: the weights'; a half-precision model's
    iterates are float32); :meth:`unflatten` returns differentiable views per name. The trained
    weights are read in place (no copy), and the solver works in the coordinates r = ξ/w, in which

        ‖ξ‖² = Σ ξ²/w² = ‖r‖²,   point w(1 + r),   Riemannian gradient h = ∂L/∂r = ∇⊙w
        (∇⊙|w| in ξ is ∇⊙sign(w) in r),

    all Euclidean, one pass over memory per operation. Entries with w = 0 are fixed by these
    formulas (h = 0 there); only tensors with other fixed entries keep a boolean mask. ``x0``,
    ``abs_w`` and ``inv_w2`` are formed on demand for other callers. Reductions add up fixed
    blocks (:func:`add_dot_`), and no kernel call gets more than :data:`KERNEL_LIMIT` elements:
    any number of weights works, past 2³¹ too.

    Layouts of the passes and of the point handed to the model:

    * piecewise (the CPU's default): pieces of :data:`CHUNK` elements per tensor, so that a
      reduction follows its operation in cache; the point is one flat buffer kept across
      iterations, per-tensor leaves of it go to autograd;
    * ``flat=True`` (an accelerator's default unless streaming): one contiguous copy of the weights
      (a parameter-sized vector more), one flat leaf and gradient, pieces of :data:`KERNEL_LIMIT`:
      the passes are bound by kernel launches there, not memory;
    * ``streaming=True``: no point is stored at all. The model reads each tensor's w(1 + r)
      through a recipe (:meth:`leaf_point` returns a :class:`StreamedPoint`; the evaluation
      substitutes it with :func:`~quotient_manifolds.adapters.streaming.substituted`), and the
      backward writes h straight into one gradient buffer; the passes of the solver over its own
      buffers run flat in pieces of :data:`KERNEL_LIMIT` (:data:`CHUNK` on the CPU). Beyond the
      model and the solver's iterates, nothing of the model's size is held. A weight used by
      several modules (tied embeddings) adds up its gradients. The small vectors (biases, norm
      scales: :data:`SMALL_TENSOR`) are formed together before the model reads them, in one
      autograd node.
    """

    quotient = False
    #: whether an embedding lookup may form the rows of a tensor's point it reads alone (the
    #: tensors are whole weights, indexed as the model indexes them)
    row_reads = True

    def __init__(self, tensors: Dict[str, Tensor], *, masks: Optional[Dict[str, Tensor]] = None,
                 direction: str = "riemannian", second_order: bool = False,
                 name: str = "elementwise", flat: Optional[bool] = None,
                 streaming: bool = False, dtype: Optional[torch.dtype] = None):
        if not tensors:
            raise InvalidArgument("an elementwise component needs at least one tensor")
        self.name = name
        self.names = list(tensors)
        self.tensors = [tensors[n].detach() for n in self.names]
        self.shapes = [t.shape for t in self.tensors]
        self.sizes = [t.numel() for t in self.tensors]
        self.weights = [t.reshape(-1) for t in self.tensors]  # views, no copy
        self.dtype = dtype or self.weights[0].dtype
        self.device = self.weights[0].device
        self.numel = sum(self.sizes)
        self.direction = choice("direction", direction, ADAPTIVE_DIRECTIONS)
        self.second_order = second_order
        self.streaming = bool(streaming)
        tiny = torch.finfo(self.dtype).tiny
        self.fixed: List[Optional[Tensor]] = []
        for n, w in zip(self.names, self.weights):
            # w = 0 is fixed by the formulas themselves (∇⊙w = 0 there); what else is fixed
            # (w² ≤ tiny: 1/w² would overflow; outside the mask) needs the mask
            mask = None if not masks or masks.get(n) is None else masks[n].reshape(-1)
            fixed = torch.cat([(q * q <= tiny) & (q != 0) for q in
                               (p.to(self.dtype) for p in w.split(self._chunk()))])
            if mask is not None:
                fixed |= ~mask.to(w.device)
            self.fixed.append(fixed if bool(fixed.any()) else None)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.flat = (self.device.type != "cpu" and not self.streaming) if flat is None else bool(flat)
        if self.flat and self.streaming:
            raise InvalidArgument("an elementwise component is either flat (one copy of the weights) or "
                                  "streaming (none): pass one of flat=True, streaming=True")
        if self.flat:  # one vector over a contiguous copy (see the class docstring)
            self._piece_weights = [self._flat_from(self.weights)]
            self._piece_fixed = [None if all(f is None for f in self.fixed) else self._flat_from(
                [torch.zeros(w.shape, dtype=torch.bool, device=w.device) if f is None else f
                 for w, f in zip(self.weights, self.fixed)])]
            self._pieces = [(0, a, min(a + KERNEL_LIMIT, self.numel), a)
                            for a in range(0, self.numel, KERNEL_LIMIT)]
        else:  # (tensor index, start, stop, offset in the flat vector) of every piece
            chunk = self._chunk()
            self._piece_weights, self._piece_fixed = self.weights, self.fixed
            self._pieces = [(i, a, min(a + chunk, size), offset + a)
                            for i, (size, offset) in enumerate(zip(self.sizes, self.offsets))
                            for a in range(0, size, chunk)]
        self._point: Optional[Tensor] = None
        self._live: Optional[Tuple[Tensor, List[Tensor]]] = None
        self._stream: Optional[StreamedPoint] = None  # the evaluation under way (streaming)

    def _chunk(self) -> int:
        return min(CHUNK, KERNEL_LIMIT) if self.device.type == "cpu" else KERNEL_LIMIT

    # -- pieces
    def _over(self, *vectors):
        """(w, fixed, *pieces of ``vectors``) per piece; a vector is flat or a list per tensor
        (with ``flat``, a list of the one flat vector)."""
        for i, a, b, s in self._pieces:
            fixed = self._piece_fixed[i]
            yield (self._piece_weights[i][a:b], None if fixed is None else fixed[a:b],
                   *(v[i][a:b] if isinstance(v, list) else v[s:s + b - a] for v in vectors))

    def _flat_over(self, *vectors):
        """Pieces of flat vectors of the solver's own (no weights needed): the streaming layout
        cuts them only by size, so a pass costs few kernel calls."""
        if not self.streaming:
            for _, _, *parts in self._over(*vectors):
                yield parts
            return
        chunk = self._chunk()
        for a in range(0, self.numel, chunk):
            yield [v[a:a + chunk] for v in vectors]

    @staticmethod
    def _relative(u: Tensor, w: Tensor, fixed: Optional[Tensor]) -> Tensor:
        """u/w, with 0 on fixed entries (where 0/0 or u/tiny would appear)."""
        t = torch.div(u, w).nan_to_num_(0.0, 0.0, 0.0)
        return t if fixed is None else t.masked_fill_(fixed, 0.0)

    def _flat_from(self, parts: Sequence[Tensor]) -> Tensor:
        return torch.cat([p.reshape(-1) for p in parts])

    def _zero(self) -> Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.device)

    # -- geometry
    @property
    def x0(self) -> Tensor:
        """The trained weights as one flat vector (a copy, formed on demand)."""
        return self._flat_from(self.weights)

    @property
    def abs_w(self) -> Tensor:
        """c = |w|, 0 on fixed entries (formed on demand)."""
        return self._flat_from([w.abs().masked_fill_(f, 0) if f is not None else w.abs()
                                for w, f in zip(self.weights, self.fixed)])

    @property
    def inv_w2(self) -> Tensor:
        """1/w², 0 on fixed entries (formed on demand)."""
        return self._flat_from([_inverse_square(w).masked_fill_(f, 0) if f is not None else
                                _inverse_square(w) for w, f in zip(self.weights, self.fixed)])

    def unflatten(self, flat: Tensor) -> Dict[str, Tensor]:
        if self._live is not None and flat is self._live[0]:
            return dict(zip(self.names, self._live[1]))  # per-tensor leaves: see leaf_point
        return {n: t.view(shape) for n, t, shape in
                zip(self.names, torch.split(flat, self.sizes), self.shapes)}

    def zeros(self) -> Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def solver_vector(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """A zero vector for one of the solver's iterates (ξ, the worst point, a gradient) in r =
        ξ/w, in ``dtype`` (a compact solver's bfloat16: r's relative rounding is ξ's, whatever the
        scale of each weight; the points and passes still compute in :attr:`dtype`), or the
        iterates' dtype."""
        return torch.zeros(self.numel, dtype=dtype or self.dtype, device=self.device)

    def inner(self, u: Tensor, v: Tensor) -> Tensor:
        out = self._zero()
        for w, fixed, a, b in self._over(u, v):
            ta = self._relative(a, w, fixed)
            add_dot_(out, ta, ta if u is v else self._relative(b, w, fixed))
        return out

    def sq_norm_on(self, u: Tensor, masks: Mapping[str, Tensor]) -> float:
        """The part of ‖u‖² = Σ u²/w² on the entries that ``masks`` marks (parameter name → boolean
        tensor of the parameter's shape; names not given count nothing)."""
        flat_u = u if isinstance(u, Tensor) else self._flat_from(u)
        total = self._zero()
        chunk = self._chunk()
        for name, w, fixed, offset, size in zip(self.names, self.weights, self.fixed, self.offsets,
                                                 self.sizes):
            mask = masks.get(name)
            if mask is None:
                continue
            mask = mask.reshape(-1)
            for a in range(0, size, chunk):
                b = min(a + chunk, size)
                t = self._relative(flat_u[offset + a:offset + b], w[a:b],
                                   None if fixed is None else fixed[a:b])
                add_dot_(total, t, t * mask[a:b].to(device=t.device, dtype=t.dtype))
        return float(total)

    def project(self, u: Tensor) -> Tensor:
        # Every vector the solver forms is a combination of gradients ∇⊙w², already 0 where w is
        # fixed; random directions are masked in :meth:`random`. Nothing to project.
        return u

    def _direction_factor(self, w: Tensor) -> Tensor:
        """What ∇ is multiplied by for the ascent direction in r: w, or sign(w) for
        ``"andriushchenko"``."""
        return w if self.direction == "riemannian" else w.sign()

    def _direction_(self, g: Tensor, w: Tensor, fixed: Optional[Tensor]) -> Tensor:
        """h = ∇⊙w (or ∇⊙sign(w)) in place, 0 on fixed entries: the Riemannian gradient in r
        (in ξ it is h⊙w)."""
        g.mul_(self._direction_factor(w))
        return g if fixed is None else g.masked_fill_(fixed, 0.0)

    def rgrad(self, egrad: Tensor) -> Tensor:
        """∇⊙w² (or ∇⊙|w|); in place when ``egrad`` is a plain contiguous tensor (it is consumed)."""
        g = egrad if egrad.is_contiguous() else egrad.contiguous()
        for w, fixed, piece in self._over(g):
            self._direction_(piece, w, fixed).mul_(w)
        return g

    def moved(self, w: Tensor, r: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """w(1 + r), or with ``second_order`` w(1 + r + r²/2), in the component's dtype (the point
        at ξ = w r; ``out`` receives it)."""
        if self.second_order:
            r = r.to(self.dtype)  # a compact solver's r: the point is formed in the compute dtype
            return torch.addcmul(r, r, r, value=0.5, out=out).add_(1.0).mul_(w)
        if w.dtype != self.dtype:  # half-precision weights: the point is formed in float32, in place
            base = w.to(self.dtype) if out is None else out.copy_(w)
            return base.addcmul_(w, r)
        return torch.addcmul(w, w, r, out=out)

    def point(self, xi: Tensor, retraction: Optional[str] = None, exact_steps: Optional[int] = None, *,
              out: Optional[Tensor] = None) -> Tensor:
        """w + ξ (``retraction`` and ``exact_steps`` concern the quotient components: this one keeps
        its own, :class:`BallComponent`), or with ``second_order`` the second-order geodesic of the elementwise metric
        Σ ξ²/w², w + ξ − ½Γ(ξ, ξ) = w + ξ + ξ²/(2w) (Γ^w_ww = −1/w; docs/maths.md §10, §12.10).
        Differentiable in ξ; ``out`` (may be ``xi`` itself) receives the point without a
        full-size temporary. The solver fills a reused buffer instead (:meth:`leaf_point`)."""
        parts = []
        for w, fixed, x, *dest in self._over(xi, *(() if out is None else (out,))):
            if self.second_order:  # x = 0 on fixed entries; 1 there keeps the derivative finite
                safe = torch.where((w == 0) if fixed is None else (w == 0) | fixed, 1.0, w)
                moved = w + x + 0.5 * x * x / safe
            else:
                moved = w + x
            if dest:
                dest[0].copy_(moved)
            else:
                parts.append(moved)
        return out if out is not None else torch.cat(parts)

    def random(self, generator: Optional[torch.Generator]) -> Tensor:
        u = torch.randn(self.numel, dtype=self.dtype, device=self.device, generator=generator)
        for w, fixed, piece in self._over(u):
            piece.mul_(w.abs())
            if fixed is not None:
                piece.masked_fill_(fixed, 0.0)
        return u

    # -- solver protocol (see the comment above QuotientComponent), in the coordinates r = ξ/w:
    # there the metric Σ ξ²/w² = ‖r‖² is Euclidean, so no step of the solver divides or masks
    def to_coords(self, xi: Tensor, out: Tensor) -> None:
        for w, fixed, x, r in self._over(xi, out):
            r.copy_(self._relative(x, w, fixed))

    def from_coords_(self, r: Tensor) -> Tensor:
        for w, _, piece in self._over(r):
            piece.mul_(w)
        return r

    def leaf_point(self, r: Tensor, need_grad: bool, into: Optional[Tensor] = None):
        """The point at r for the closure and the tensors autograd differentiates.

        Streaming: per-tensor leaves (views of r) and a :class:`StreamedPoint` of recipes; its
        backward fills the gradient buffer that :meth:`gradient` returns. Otherwise w(1 + r)
        (second order: w(1 + r + r²/2)) written into a buffer kept across iterations; the closure
        gets it as one flat leaf, and :meth:`unflatten` of that leaf returns per-tensor leaves
        (views of the buffer), so autograd returns per-tensor gradients: splitting a flat leaf
        would make it concatenate them into a fresh full-size vector, which costs more than a pass
        over it."""
        if self.streaming:
            leaves = [t.view(shape).detach().requires_grad_(need_grad) for t, shape in
                      zip(torch.split(r, self.sizes), self.shapes)]
            self._stream = StreamedPoint(self, leaves, need_grad, into)
            return leaves, self._stream
        if self._point is None:
            self._point = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for w, _, x, p in self._over(r, self._point):
                self.moved(w, x, out=p)
        flat = self._point.detach().requires_grad_(need_grad)
        if self.flat:  # unflatten's views of the one leaf: autograd returns one flat gradient
            self._live = None
            return [flat], flat
        parts = [t.view(shape).detach().requires_grad_(need_grad) for t, shape in
                 zip(torch.split(self._point, self.sizes), self.shapes)]
        self._live = (flat, parts)
        return [flat, *parts], flat

    def accumulate_(self, point: StreamedPoint, index: int, grad: Tensor, r: Tensor) -> None:
        """The streaming backward of tensor ``index``: h = ∂L/∂r = ∇⊙w (second order ∇⊙w⊙(1 + r);
        ``"andriushchenko"``: sign(w) for w), 0 on fixed entries, written into (or, for a tensor
        read twice, added to) its piece of the evaluation's gradient buffer."""
        if point.gradient is None:
            return
        start, size = self.offsets[index], self.sizes[index]
        dest, w = point.gradient[start:start + size], self.weights[index]
        g = grad.reshape(-1)
        if self.second_order:
            g = torch.addcmul(g, g, r.reshape(-1))
        scale = self._direction_factor(w)
        if point.written[index]:
            dest.addcmul_(g, scale)
        else:
            torch.mul(g, scale, out=dest)
            point.written[index] = True
        if self.fixed[index] is not None:
            dest.masked_fill_(self.fixed[index], 0.0)

    def accumulate_rows_(self, point: StreamedPoint, index: int, rows: Tensor, grad: Tensor,
                         r: Tensor, padding_idx: Optional[int]) -> None:
        """The streaming backward of an embedding lookup of tensor ``index`` (``rows``: the row of
        each looked-up entry, ``grad`` its gradient, ``r`` the tensor's coordinates): h = ∇⊙w of
        those rows (as :meth:`accumulate_`), summed into the tensor's piece of the gradient
        buffer, which is zero elsewhere (or, already written, keeps what it holds); the
        ``padding_idx`` row gets none, as in ``F.embedding``."""
        if point.gradient is None:
            return
        start, size = self.offsets[index], self.sizes[index]
        dest = point.gradient[start:start + size].view(self.shapes[index])
        g = torch.addcmul(grad, grad, r.index_select(0, rows)) if self.second_order else grad
        h = g * self._direction_factor(self.tensors[index].index_select(0, rows))
        if padding_idx is not None:
            h.masked_fill_((rows == padding_idx).unsqueeze(1), 0.0)
        if self.fixed[index] is not None:
            h.masked_fill_(self.fixed[index].view(self.shapes[index]).index_select(0, rows), 0.0)
        if not point.written[index]:
            dest.zero_()
            point.written[index] = True
        dest.index_add_(0, rows, h.to(dest.dtype))

    def gradient(self, grads: List[Optional[Tensor]], r: Tensor
                 ) -> Tuple[Union[Tensor, List[Tensor]], Tensor, Tensor]:
        """The Riemannian gradient in r: h = ∂L/∂r = ∇⊙w (second order: ∇⊙w⊙(1 + r)), or
        ∇⊙sign(w) (⊙(1 + r)) for "andriushchenko" (∇⊙|w| in ξ); ‖h‖², ⟨h, r⟩. The Euclidean
        gradients are consumed where autograd returned tensors of their own; streaming, ``point``
        already holds h (tensors the loss never read get 0)."""
        if self.streaming:
            point, self._stream = self._stream, None
            h = point.gradient
            for i, done in enumerate(point.written):
                if not done:
                    h[self.offsets[i]:self.offsets[i] + self.sizes[i]].zero_()
            sq, dot = self._zero(), self._zero()
            for g, x in self._flat_over(h, r):
                add_dot_(sq, g, g)
                add_dot_(dot, g, x)
            return h, sq, dot
        flat, parts = grads[0], grads[1:]
        if self.flat:  # the one flat leaf (leaf_point): its gradient is already one vector
            h = [self.zeros() if flat is None else flat.contiguous()]
        else:
            h = self._tensor_gradients(flat, parts)
        sq, dot = self._zero(), self._zero()
        for w, fixed, x, g in self._over(r, h):
            if self.second_order:
                g.addcmul_(g, x)  # ∂/∂r w(1 + r + r²/2) = w(1 + r)
            self._direction_(g, w, fixed)
            add_dot_(sq, g, g)
            add_dot_(dot, g, x)
        return h, sq, dot

    def _tensor_gradients(self, flat: Optional[Tensor], parts: Sequence[Optional[Tensor]]
                          ) -> List[Tensor]:
        """One contiguous gradient per tensor, owned by the caller: the per-tensor leaves' plus the
        flat leaf's piece (a closure may use either), zero where autograd returned None."""
        h, seen = [], set()
        for i, (g, size) in enumerate(zip(parts, self.sizes)):
            g = None if g is None else g.reshape(-1)
            if flat is not None:
                piece = flat[self.offsets[i]:self.offsets[i] + size]
                g = piece.clone() if g is None else g + piece
            elif g is None:
                g = torch.zeros(size, dtype=self.dtype, device=self.device)
            elif not g.is_contiguous() or g.untyped_storage().data_ptr() in seen:
                g = g.contiguous().clone()  # expanded, or shared with another gradient
            seen.add(g.untyped_storage().data_ptr())
            h.append(g)
        return h

    def combine(self, out: Tensor, r: Tensor, d: Optional[Tensor], h: Union[Tensor, List[Tensor]],
                a: Tensor, c: Tensor, b: Tensor) -> Tensor:
        sq = self._zero()
        for o, x, g, *step in self._flat_over(out, r, h, *(() if d is None else (d,))):
            # a compact vector's piece is combined in the compute dtype and rounded once
            y = torch.mul(g, b, out=o) if o.dtype == self.dtype else g.to(self.dtype).mul_(b)
            y.addcmul_(x, a)  # after g: ``out`` may be the gradient's own buffer
            if step:
                y.addcmul_(step[0], c)
            if y is not o:
                o.copy_(y)
            add_dot_(sq, o, o)
        return sq

    def finish_step_(self, out: Tensor, factor: Tensor, r: Tensor, d: Tensor) -> None:
        for o, x, step in self._flat_over(out, r, d):
            o.mul_(factor)
            torch.sub(o, x, out=step)

    def step_buffer(self, compact: bool) -> Tensor:
        """A zero vector for the solver's last step d in r = ξ/w, with ``compact`` in
        :data:`COMPACT_STEP_DTYPES` of the iterates' dtype: a relative rounding of r is one of
        ξ, whatever the scale of each weight."""
        dtype = COMPACT_STEP_DTYPES.get(self.dtype, self.dtype) if compact else self.dtype
        return torch.zeros(self.numel, dtype=dtype, device=self.device)


def _inverse_square(w: Tensor) -> Tensor:
    """1/w² where that is finite, else 0 (such weights are kept fixed)."""
    w2 = w * w
    ok = w2 > torch.finfo(w.dtype).tiny
    return torch.where(ok, 1 / torch.where(ok, w2, torch.ones_like(w2)), torch.zeros_like(w2))
