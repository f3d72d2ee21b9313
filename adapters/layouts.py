"""Layouts: which parameter slices of a model form the GL(h) blocks of its attention layers.

A :class:`Layout` is plain data built from a model without modifying or wrapping it
(docs/maths.md §6.2; §13 for rotary, grouped-query and LoRA blocks):

* every attention layer and every head ``i`` gives two GL(d_head) blocks, with ``r_i = i*dh:(i+1)*dh``
  and PyTorch ``Linear.weight`` of shape ``(out, in)``::

      QK:  G = [W_q[r_i,:]^T ; b_q[r_i]]  (d+1, dh)     H = [W_k[r_i,:]^T ; b_k[r_i]]  (d+1, dh)
      VO:  G = [W_v[r_i,:]^T ; b_v[r_i]]  (d+1, dh)     H = W_o[:, r_i]               (d, dh)

  biases are an extra row because the input is ``[X 1]``; ``b_o`` is not in any block;
* everything else (and the part of a parameter no block covers) is *adaptive* (elementwise).

A block (:mod:`~quotient_manifolds.adapters.blocks`) is a list of :class:`FactorPiece` objects for ``G``
and for ``H``.  The GL action used throughout is ``(G, H) -> (G A, H A^{-T})`` (docs/maths.md §1; the
paper's ``(G A^{-1}, H A^T)`` is the same action with ``A -> A^{-1}``).

:meth:`Layout.verify` (:mod:`~quotient_manifolds.adapters.verify`) checks numerically that the
declared/detected blocks really are symmetries of the model (random ill-conditioned per-head actions,
model output unchanged), and names the block that is not.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from quotient_manifolds._validation import floating_dtype, optional_generator
from quotient_manifolds.core.gl import group_action
from quotient_manifolds.errors import InvalidArgument, SymmetryError, UnknownName

from . import validation as check
from .blocks import GLBlock
from .families.structure import HEAD_DIM_ATTRS, HEADS_ATTRS
from .families.structural import KV_HEADS_ATTRS
from .sharded import is_sharded
from .verify import VerifyReport, record, verify_layout

__all__ = ["Layout", "Unsupported", "head_structure"]

#: Attribute names of head counts, key/value head counts and head sizes, as detection reads them.
HEAD_ATTRS = (HEADS_ATTRS, KV_HEADS_ATTRS + ("num_key_value_groups",), HEAD_DIM_ATTRS)


def _apply_action(block: GLBlock, params: Mapping[str, Tensor], A: Tensor) -> Dict[str, Tensor]:
    x = block.gather(params)
    ct = torch.promote_types(x.dtype, A.dtype)
    x = x.to(ct)
    A = A.to(dtype=ct, device=x.device)
    if tuple(A.shape) != (block.num_heads, block.head_dim, block.head_dim):
        raise InvalidArgument(
            f"action for block {block.name!r} has shape {tuple(A.shape)}, expected "
            f"{(block.num_heads, block.head_dim, block.head_dim)}"
        )
    return block.scatter(params, torch.cat(group_action(*block.split(x), A), dim=-2))


class Unsupported(NamedTuple):
    """An attention-like module that could not be mapped to GL blocks."""

    module: str
    cls: str
    reason: str


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _head_count_text(attr: str, value: int) -> str:
    """``"4 heads"``, ``"2 key/value heads"``, ``"head size 8"`` ... for a :func:`head_structure` entry."""
    heads, kv_heads, _ = HEAD_ATTRS
    name = attr.rsplit(".", 1)[-1]
    if name == "num_key_value_groups":
        return f"{value} query heads per key/value head"
    if name in heads:
        return f"{value} heads"
    return f"{value} key/value heads" if name in kv_heads else f"head size {value}"


def head_structure(model: nn.Module, modules: Iterable[str]) -> Dict[str, Dict[str, int]]:
    """Per module path (missing paths are left out): the integer head counts and head sizes that the
    module, its submodules and their Hugging Face ``config`` declare, keyed by relative attribute
    path, e.g. ``{"encoder.layer.0.attention": {"self.num_attention_heads": 4,
    "self.attention_head_size": 2, "self.config.num_attention_heads": 4}}``.  Weight shapes do not
    fix the heads (4 heads of 2 and 2 heads of 4 have the same projections); these attributes do."""
    heads, kv_heads, dims = HEAD_ATTRS
    names = heads + kv_heads + dims
    out: Dict[str, Dict[str, int]] = {}
    for path in dict.fromkeys(modules):
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        found: Dict[str, int] = {}
        for rel, sub in mod.named_modules():
            prefix = f"{rel}." if rel else ""
            for holder, where in ((sub, prefix), (getattr(sub, "config", None), f"{prefix}config.")):
                if holder is None:
                    continue
                for attr in names:
                    value = getattr(holder, attr, None)
                    if isinstance(value, int) and not isinstance(value, bool):
                        found[where + attr] = value
        out[path] = found
    return out


@dataclass(eq=False)
class Layout:
    """The GL blocks and elementwise (adaptive) parameters of a model.  Pure data: it holds parameter
    names and slices, never the model or its tensors (only the boolean ``gl_masks``).

    It also records which model it belongs to (``param_shapes``, ``head_structure``): every measure
    that takes ``layout=`` (``sharpness``, ``sharpness_sweep``, ``distributed_sharpness``,
    ``GeodesicSAM``, ``riemannian_hessian``) and :meth:`verify` refuse it for a model with other
    parameters or other head counts (:meth:`check_model`), since its blocks would then not be
    that model's symmetry group.

    Made by :func:`~quotient_manifolds.adapters.layout`; check it with :meth:`verify`.

    Attributes
    ----------
    blocks:
        The :class:`~quotient_manifolds.adapters.blocks.GLBlock` s (per-head G, H factors).
    adaptive:
        Names of the parameters (or their non-GL parts) treated elementwise.
    gl_masks:
        Per parameter, a boolean mask of its GL entries.
    frozen:
        Names of the frozen parameters, outside the ball.
    unsupported:
        Attention-like modules no family maps, with the reason.
    param_shapes, head_structure, model_name:
        The model the layout belongs to (see :meth:`check_model`).
    notes:
        What detection dropped or decided, in words (``verify_failed``, below: the blocks that
        failed the last :meth:`verify`).

    Raises
    ------
    ValueError
        From :meth:`check_model` (and every measure given ``layout=``): the layout belongs to a
        model with other parameters or head counts.
    SymmetryError
        From :meth:`verify`: a block is not a symmetry of the model.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds import adapters
    >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
    ...                                          batch_first=True).double().eval()
    >>> lay = adapters.layout(model)
    >>> lay.block_names
    ['self_attn/qk', 'self_attn/vo']
    >>> lay.block("self_attn/qk").group
    GLGroup()
    >>> lay.verify(model, torch.randn(3, 5, 4, dtype=torch.float64)).passed
    True
    """

    blocks: List[GLBlock]
    adaptive: List[str]
    gl_masks: Dict[str, Tensor]
    frozen: List[str]
    unsupported: List[Unsupported]
    param_shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    model_name: str = ""
    notes: List[str] = field(default_factory=list)
    #: blocks that failed the last :meth:`verify` (all blocks if the joint check failed and no single
    #: block was named); ``sharpness()`` refuses such a layout unless ``unsafe=True``
    verify_failed: List[str] = field(default_factory=list)
    #: the head structure of the model the layout was built for (see :func:`head_structure`): per
    #: block module, its head counts and head sizes as the model declares them; with
    #: ``param_shapes`` the identity :meth:`check_model` compares. ``None``: not recorded (a layout
    #: built by hand), then only parameter names and shapes are compared.
    head_structure: Optional[Dict[str, Dict[str, int]]] = None

    # -- identity ----------------------------------------------------------------------------------

    def check_model(self, model: nn.Module, *, what: str = "layout") -> None:
        """Raise ``ValueError`` unless ``model`` is the model this layout was built for: the same
        parameter names and shapes (``param_shapes``), the same head counts and head sizes of every
        block's module (``head_structure``), and every block's slices in range.  A layout of a
        4-head attention used on a 2-head one with the same weight shapes would act with a smaller
        group than the model's symmetry (its geodesic sharpness is then not invariant), and a layout
        of another architecture would fail on a missing parameter; both are refused here, naming
        what differs.  ``what`` names the argument in the message.

        Parameters
        ----------
        model:
            The model to check the layout against.
        what:
            The argument's name in the message.

        Raises
        ------
        ValueError
            ``model`` has other parameters, shapes or head counts than the layout's model.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds import adapters
        >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
        ...                                          batch_first=True).double().eval()
        >>> lay = adapters.layout(model)
        >>> lay.check_model(model)                      # the same model: nothing to say
        >>> other = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=8, batch_first=True)
        >>> try:
        ...     lay.check_model(other)
        ... except ValueError as err:
        ...     print("refused:", str(err)[:40])
        refused: ...
        """
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        problems: List[str] = []
        if self.head_structure:
            now = head_structure(model, self.head_structure)
            for path, attrs in self.head_structure.items():
                where = f"block {path or '<root>'}"
                if path not in now:
                    problems.append(f"{where}: this model has no module {path!r}")
                    continue
                differs: Dict[Tuple[str, str], List[str]] = {}   # (built, has) -> attributes
                for attr, built in attrs.items():
                    has = now[path].get(attr)
                    if has != built:
                        has_text = _head_count_text(attr, has) if has is not None else f"no {attr}"
                        differs.setdefault((_head_count_text(attr, built), has_text), []).append(attr)
                problems += [f"{where}: built for {built}, this model has {has} ({', '.join(attrs_)})"
                             for (built, has), attrs_ in differs.items()]
        recorded = {n: tuple(s) for n, s in self.param_shapes.items()}
        used_by: Dict[str, List[str]] = {}
        for b in self.blocks:
            for name in b.params:
                used_by.setdefault(name, []).append(b.name)
        for n in dict.fromkeys([*recorded, *used_by]):
            if n not in shapes:
                users = f" (used by block {', '.join(used_by[n])})" if n in used_by else ""
                problems.append(f"parameter {n!r}{users} is missing from this model")
        if recorded:
            problems += [f"parameter {n!r}: built for shape {recorded[n]}, this model has {shapes[n]}"
                         for n in recorded if n in shapes and recorded[n] != shapes[n]]
            problems += [f"parameter {n!r} of this model is not in the layout (added after the layout "
                         f"was built?)" for n in shapes if n not in recorded]
        if not problems:
            for b in self.blocks:
                try:
                    b.validate(shapes)
                except ValueError as err:
                    problems.append(str(err))
        if problems:
            shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
            built_for = f" of {self.model_name}" if self.model_name else ""
            raise InvalidArgument(
                f"{what}: the layout{built_for} was built for another model than this "
                f"{type(model).__name__}:\n" + "\n".join(f"  - {p}" for p in shown) + "\n"
                "Build the layout from this model (adapters.layout(model), declaring blocks with "
                "quotient_manifolds.adapters.declare_block(model, ...) on this model), or pass the model it was built for.")

    # -- lookup ------------------------------------------------------------------------------------

    def block(self, name: str) -> GLBlock:
        for b in self.blocks:
            if b.name == name:
                return b
        raise UnknownName(f"the layout has no block named {name!r}; its blocks are {self.block_names}")

    @property
    def block_names(self) -> List[str]:
        return [b.name for b in self.blocks]

    @property
    def gl_params(self) -> List[str]:
        """Parameters touched by at least one block (keys of ``gl_masks``)."""
        return list(self.gl_masks)

    def counts(self) -> Dict[str, int]:
        """Numbers of scalars: ``gl``, ``adaptive``, ``frozen``, ``total`` (parameters whose shape is
        unknown, i.e. missing from ``param_shapes`` and ``gl_masks``, count as 0)."""
        def numel(n: str) -> int:
            if n in self.param_shapes:
                return math.prod(self.param_shapes[n])
            return int(self.gl_masks[n].numel()) if n in self.gl_masks else 0

        gl = sum(int(m.sum()) for m in self.gl_masks.values())
        frozen = sum(numel(n) for n in self.frozen)
        adaptive = sum(int((~self.gl_masks[n]).sum()) if n in self.gl_masks else numel(n) for n in self.adaptive)
        names = set(self.param_shapes) | set(self.gl_masks) | set(self.adaptive) | set(self.frozen)
        total = sum(numel(n) for n in names)
        return {"gl": gl, "adaptive": adaptive, "frozen": frozen, "total": total}

    # -- printing ----------------------------------------------------------------------------------

    def __str__(self) -> str:
        modules: Dict[str, List[GLBlock]] = {}
        for b in self.blocks:
            modules.setdefault(b.module, []).append(b)
        head = f"Layout of {self.model_name}" if self.model_name else "Layout"
        lines = [f"{head}: {len(self.blocks)} GL blocks in {len(modules)} modules"]
        for mod, bl in modules.items():
            fam = ", ".join(dict.fromkeys(b.family for b in bl))
            lines.append(f"  {mod or '<root>'}  [{fam}]")
            for b in bl:
                lines += ["      " + line for line in b.describe().splitlines()]
        c = self.counts()
        partial = [n for n in self.adaptive if n in self.gl_masks]
        n_gl_params = len(self.gl_masks)
        lines += [
            f"Scalars: total {_fmt_int(c['total'])} | GL {_fmt_int(c['gl'])} (in {n_gl_params} parameters) | "
            f"frozen {_fmt_int(c['frozen'])} (in {len(self.frozen)} parameters)",
            f"         adaptive {_fmt_int(c['adaptive'])} (in {len(self.adaptive)} parameters, "
            f"{len(partial)} of them partly GL)"]
        if partial:
            shown = ", ".join(partial[:6]) + (", ..." if len(partial) > 6 else "")
            lines.append(f"Partly GL parameters (rest adaptive): {shown}")
        if self.unsupported:
            lines.append(f"Unsupported attention-like modules (treated adaptively): {len(self.unsupported)}")
            for u in self.unsupported:
                lines.append(f"  {u.module} [{u.cls}]: {u.reason}")
        else:
            lines.append("Unsupported attention-like modules: none")
        for note in self.notes:
            lines.append(f"Note: {note}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        c = self.counts()
        return (f"Layout(model={self.model_name!r}, blocks={len(self.blocks)}, gl_scalars={c['gl']}, "
                f"adaptive={len(self.adaptive)}, frozen={len(self.frozen)}, unsupported={len(self.unsupported)})")

    # -- actions -----------------------------------------------------------------------------------

    def act(self, params: Mapping[str, Tensor], actions: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """Apply per-block per-head GL actions ``A`` (``(heads, h, h)``, keyed by block name):
        ``(G, H) -> (G A, H A^{-T})``.  Blocks without an entry are left alone.  Computed in the
        promoted dtype of the parameters and ``A`` (pass float64 ``A`` for an accurate action on float32
        weights); written back in the parameters' dtype.  Returns a new dict.

        Parameters
        ----------
        params:
            Parameter tensors by name (e.g. ``dict(model.named_parameters())``).
        actions:
            Per block name, a ``(heads, h, h)`` tensor of invertible matrices.

        Returns
        -------
        dict
            The acted parameters (the others as given).

        Raises
        ------
        ValueError
            An unknown block name, or a matrix of the wrong shape.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds import adapters
        >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
        ...                                          batch_first=True).double().eval()
        >>> lay = adapters.layout(model)
        >>> params = {name: p.detach() for name, p in model.named_parameters()}
        >>> acted = lay.act(params, lay.random_actions(params, scale=1.0))
        >>> bool((acted["self_attn.in_proj_weight"] != params["self_attn.in_proj_weight"]).any())
        True
        """
        check.group_actions(self.blocks, actions)
        out = dict(params)
        for b in self.blocks:
            A = actions.get(b.name)
            if A is not None:
                out = _apply_action(b, out, A)
        return out

    def reparametrised(self, model: nn.Module, actions: Mapping[str, Tensor]) -> nn.Module:
        """A copy of ``model`` whose blocks are acted on by ``actions`` (as in :meth:`act`): the same
        function, another representative of its point on the quotient. ``model`` is left alone; the
        copy is a ``copy.deepcopy`` with new parameter values, so buffers, hooks and train/eval
        flags come along. With :meth:`random_actions` this is the invariance check's
        reparametrisation.

        Parameters
        ----------
        model:
            The model the layout was built for; left alone.
        actions:
            Per block name, a ``(heads, h, h)`` tensor (as :meth:`act`).

        Returns
        -------
        nn.Module
            The reparametrised copy.

        Raises
        ------
        ValueError
            As :meth:`act`.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds import adapters
        >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
        ...                                          batch_first=True).double().eval()
        >>> lay = adapters.layout(model)
        >>> x = torch.randn(2, 3, 4, dtype=torch.float64)
        >>> copy = lay.reparametrised(model, lay.random_actions(scale=10.0))
        >>> torch.allclose(copy(x), model(x))           # the same function
        True
        """
        params = {name: p.detach() for name, p in model.named_parameters()}
        new = self.act(params, actions)
        clone = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in clone.named_parameters():
                p.copy_(new[name])
        return clone

    def random_actions(self, params: Optional[Mapping[str, Tensor]] = None, *, scale: float,
                       cond: Optional[float] = 1e2, generator: Optional[torch.Generator] = None,
                       dtype: torch.dtype = torch.float64) -> Dict[str, Tensor]:
        """Per block a ``(heads, h, h)`` element of the block's group, times ``scale``: for the full
        GL(h) ``U diag(s) Vᵀ`` with Haar-random orthogonal ``U, V`` and singular values ``s``
        log-spaced in ``[cond^{-1/2}, cond^{1/2}]`` (condition number exactly ``cond``), or ``N(0, 1)``
        entries when ``cond is None`` (the paper's §6.2 check); for the rotary group a random
        rotation-scaling per frequency pair (moduli spread over the same range) and such a matrix on
        the non-rotated block (see ``Group.random_element``).
        Sampled on the CPU with ``generator`` (reproducible), returned on the parameters' device.
        ``scale`` must be a finite number > 0 (0 or nan would give singular or NaN "elements").

        Parameters
        ----------
        params:
            The model's parameters by name (for their device), or None (CPU).
        scale:
            The factor of every element.
        cond:
            The condition number of the elements (None: Gaussian entries).
        generator:
            A CPU ``torch.Generator`` (None: the global one).
        dtype:
            The dtype of the elements.

        Returns
        -------
        dict
            Per block name, a ``(heads, h, h)`` tensor.

        Raises
        ------
        ValueError
            ``scale`` not finite and positive, ``cond`` < 1, a non-float ``dtype``, or ``params``
            without a block's parameter.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds import adapters
        >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
        ...                                          batch_first=True).double().eval()
        >>> lay = adapters.layout(model)
        >>> actions = lay.random_actions(scale=1.0, cond=10.0, generator=torch.Generator().manual_seed(0))
        >>> {name: tuple(A.shape) for name, A in actions.items()}
        {'self_attn/qk': (2, 2, 2), 'self_attn/vo': (2, 2, 2)}
        >>> round(float(torch.linalg.cond(actions["self_attn/qk"][0])), 6)
        10.0
        """
        scale = check.positive_finite("scale", scale)
        cond = check.condition_number("cond", cond)
        floating_dtype("dtype", dtype)
        optional_generator("generator", generator)
        missing = [b.g_pieces[0].param for b in self.blocks
                   if params is not None and b.g_pieces[0].param not in params]
        if missing:
            raise InvalidArgument(f"params has no entry for {', '.join(missing[:3])}: pass the model's "
                                  f"parameters ({{n: p for n, p in model.named_parameters()}}) or None")
        out: Dict[str, Tensor] = {}
        for b in self.blocks:
            device = params[b.g_pieces[0].param].device if params is not None else torch.device("cpu")
            # a group without the positive scalars (orthogonal) is sampled at scale 1: its
            # elements times another scale are not in it
            s = scale if getattr(b.group, "has_scalars", True) else 1.0
            A = b.group.random_element(b.head_dim, (b.num_heads,), scale=s, cond=cond,
                                       generator=generator)
            out[b.name] = A.to(dtype=dtype, device=device)
        return out

    # -- symmetry self-check -----------------------------------------------------------------------

    def verify(self, model: nn.Module, example_inputs: Any, *,
               scales: Sequence[float] = (1e-2, 1e-1, 1.0, 1e1, 1e2), cond: Optional[float] = 1e2,
               rtol: Optional[float] = None, atol: Optional[float] = None, seed: int = 0,
               per_block: Union[bool, str] = "auto", raise_on_failure: bool = True,
               output_fn: Optional[Callable[[Any], Tensor]] = None,
               compute_dtype: Optional[torch.dtype] = None) -> VerifyReport:
        """Check that every block of the layout is a symmetry of ``model``: the output must not change
        under random per-head GL actions (see :meth:`random_actions`; ``cond=None`` for Gaussian
        actions) at each of ``scales``.

        The model is never modified: the acted parameters go through ``torch.func.functional_call``;
        the model is put in eval mode for the check (every submodule's ``training`` flag is restored
        afterwards) and no gradients are recorded.  The actions are computed in float64 and written
        back in the compute dtype, which is the model's dtype, or float32 for float16/bfloat16 models
        (whose own rounding, ~1e-2, would hide a broken block); ``compute_dtype=`` overrides it (all
        floating parameters, buffers and inputs are then cast for the check).

        ``example_inputs``: a tensor, a tuple/list of positional arguments, or a dict of keyword
        arguments.  The compared tensor is ``output_fn(output)`` or
        :func:`~quotient_manifolds.adapters.verify.primary_output` (``logits``, ``last_hidden_state`` or the
        first tensor).

        Deviation ``max|y' - y| / max|y|``; a check passes when ``max|y' - y| <= atol + rtol * max|y|``.
        Defaults: ``rtol = default_tolerance(compute_dtype, cond)`` (with ``cond=None`` the largest
        condition number of the sampled actions), ``atol = 0``.  All blocks are acted on together (one
        forward pass per scale, plus one at the model's own weights: 6 with the default scales); with
        ``per_block="auto"`` (default) a failing set is bisected, each half acted on in turn down to
        the single blocks that fail (about 2·log₂(#blocks) more passes per failing block), which names
        the culprit; ``per_block=True`` checks every block on its own as well (5 passes per block),
        ``per_block=False`` only the joint action.  Raises
        :class:`~quotient_manifolds.adapters.SymmetryError` naming the failing block(s) unless
        ``raise_on_failure=False``.

        On a model sharded with FSDP2 (call it on every rank, each with its own inputs) each attention
        module's blocks are checked on that module alone, its weights gathered one module at a time,
        with the inputs it receives in a sharded forward pass: as strong as the whole-model check (the
        model's output depends on a block's weights only through its module's output); the report's
        deviations are relative to each module's output.

        The outcome is recorded: ``verify_failed`` lists the failing blocks (all blocks when only the
        joint check failed), and a layout that passed is not verified again by the geodesic entry points
        on this model in its current state (:func:`~quotient_manifolds.adapters.verify.record`).

        Parameters
        ----------
        model:
            The model the layout was built for; never modified.
        example_inputs:
            A tensor, a tuple/list of positional arguments or a dict of keyword arguments.
        scales, cond, seed:
            The scales of the random actions, their condition number (None: Gaussian) and seed.
        rtol, atol:
            The tolerance (defaults above).
        per_block:
            ``"auto"``, True or False (see above).
        raise_on_failure:
            Raise on a failing block (False: return the failing report).
        output_fn:
            The tensor to compare, from the model's output.
        compute_dtype:
            The dtype of the check (default: the model's; float32 for half precision).

        Returns
        -------
        VerifyReport
            The deviations per scale, per block, the tolerance and ``passed``.

        Raises
        ------
        SymmetryError
            A block is not a symmetry of the model (unless ``raise_on_failure=False``).
        ValueError
            The layout belongs to another model, the model's output has no tensor to compare (pass
            ``output_fn``), or an option is out of range.
        TypeError
            An argument of the wrong kind.

        Examples
        --------
        >>> import torch
        >>> from quotient_manifolds import adapters
        >>> model = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0,
        ...                                          batch_first=True).double().eval()
        >>> report = adapters.layout(model).verify(model, torch.randn(3, 5, 4, dtype=torch.float64))
        >>> report.passed, report.failing, report.max_rel_dev < 1e-12
        (True, [], True)
        """
        options = dict(scales=scales, cond=cond, rtol=rtol, atol=atol, seed=seed, per_block=per_block,
                       raise_on_failure=raise_on_failure, output_fn=output_fn, compute_dtype=compute_dtype)
        try:
            if isinstance(model, nn.Module) and is_sharded(model):   # module by module on the shards
                from .sharded_verify import verify_on_shards

                report = verify_on_shards(self, model, example_inputs, **options)
            else:
                report = verify_layout(self, model, example_inputs, **options)
        except SymmetryError as err:
            record(model, self, err.report)
            raise
        record(model, self, report)
        return report
