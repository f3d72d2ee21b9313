r"""Calling a model at weights that are computed when its code reads them, and never stored whole.

Sharpness evaluates a model at perturbed weights w(ξ) many times. Materialising w(ξ) for every
parameter before the forward pass (as ``torch.func.functional_call`` needs) holds a second copy of
the model for the whole pass, in float32 even for a bfloat16 model: 4 bytes per parameter beyond
the model's own weights. Here each substituted weight is a :class:`LazyWeight`, a recipe that
:func:`substituted` attaches to every place the parameter lives (``module.weight``, tied aliases
included): each read runs the recipe, and the value lives only as long as the code that read it
holds it. A plain ``nn.Embedding`` whose recipe can form single rows (``LazyWeight.rows``) looks
up those rows alone instead of reading its table.

Operations that need the value again in the backward pass (a linear layer's weight, a norm's
scale) would keep it alive until then. While :func:`substituted` is active, such saved values are
replaced by their recipe (``torch.autograd.graph.saved_tensors_hooks``) and recomputed when the
backward pass unpacks them: one extra elementwise pass over a weight per use in the backward, in
exchange for not holding any perturbed weight between the two passes.

A recipe must be a pure function of tensors that stay unchanged until the backward pass has run
(the trained weights and the perturbation buffers of the solver), so that the recomputed value
equals the one the forward pass read, bit for bit.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UnknownName

__all__ = ["LazyWeight", "Slots", "parameter_slots", "substituted"]


class LazyWeight:
    """The value of one parameter during an evaluation, computed on every read by ``compute()``
    (differentiable in whatever it depends on); where an operation saves it for the backward
    pass, the backward pass recomputes it with ``compute`` under ``torch.no_grad``.

    ``rows(indices, padding_idx)``, where given, is ``F.embedding(indices, compute(),
    padding_idx)`` formed from the rows it reads alone: a plain ``nn.Embedding`` whose weight is
    substituted calls it instead of reading the whole table (a batch reads a few of its rows)."""

    __slots__ = ("compute", "rows", "__weakref__")

    def __init__(self, compute: Callable[[], Tensor],
                 rows: Optional[Callable[[Tensor, Optional[int]], Tensor]] = None):
        if not callable(compute):
            raise InvalidArgumentType(f"LazyWeight needs a callable returning the tensor, got {compute!r}")
        if rows is not None and not callable(rows):
            raise InvalidArgumentType(f"LazyWeight's rows must be callable (indices, padding_idx) -> rows of "
                                      f"the value, or None, got {rows!r}")
        self.compute, self.rows = compute, rows


class _Recompute:
    """What a saved weight (or a view of it) becomes between the forward and the backward pass."""

    __slots__ = ("recipe", "size", "stride", "offset", "dtype")

    def __init__(self, recipe: LazyWeight, view: Tensor):
        self.recipe, self.dtype = recipe, view.dtype
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def __call__(self) -> Tensor:
        with torch.no_grad():
            full = self.recipe.compute()
        return full.as_strided(self.size, self.stride, self.offset)


class _SavedWeights:
    """The pack/unpack hooks: a saved tensor whose storage is that of a value a recipe returned is
    stored as the recipe. The registry is keyed by storage address and holds a weak reference to
    the value: an address reused by a later tensor, once the value is freed, is never mistaken
    for a weight."""

    def __init__(self):
        self.by_storage: Dict[int, Tuple[weakref.ref, LazyWeight, int]] = {}

    def register(self, value: Tensor, recipe: LazyWeight) -> Tensor:
        storage = value.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or value.storage_offset() != 0 or not value.is_contiguous():
            return value  # an empty tensor or a view of something else: nothing worth dropping
        # no weakref callback (it would tie the registry into a reference cycle that only the
        # garbage collector frees, holding the recipes' buffers): a dead entry is recognised by
        # its weakref at lookup, and the registry is emptied when the substitution ends
        self.by_storage[key] = (weakref.ref(value), recipe, storage.nbytes())
        return value

    def pack(self, t: Tensor):
        # Anything else is kept detached: returning the tensor itself would, for a tensor that is
        # the output of the operation saving it (log_softmax keeps its result), tie the node to
        # itself through its saved tensor's grad_fn, and the whole graph of the evaluation would
        # outlive its backward pass. The backward reads only the values.
        if t.layout != torch.strided or t.is_sparse or t.device.type == "meta":
            return t.detach()
        entry = self.by_storage.get(t.untyped_storage().data_ptr())
        if entry is None or entry[0]() is None or t.untyped_storage().nbytes() != entry[2]:
            return t.detach()
        return _Recompute(entry[1], t)

    @staticmethod
    def unpack(packed):
        return packed() if isinstance(packed, _Recompute) else packed


_SUBCLASSES: Dict[Tuple[type, Tuple[str, ...]], type] = {}


def _embedding_rows_forward(self: nn.Embedding, input: Tensor) -> Tensor:
    """``nn.Embedding.forward`` with a substituted weight: the rows the lookup reads, from the
    recipe's ``rows`` where it has one and the lookup is a plain one (no ``max_norm``, which
    renormalises the table in place; dense gradients, unscaled)."""
    recipe = self.__dict__["_lazy_weights"]["weight"][0]
    if recipe.rows is None or self.max_norm is not None or self.sparse or self.scale_grad_by_freq:
        return nn.Embedding.forward(self, input)
    return recipe.rows(input, self.padding_idx)


def _lazy_class(cls: type, attrs: Tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose attributes ``attrs`` are read through the instance's recipes
    (``__dict__['_lazy_weights']``): a data descriptor on the class takes precedence over
    ``nn.Module.__getattr__``'s lookup in ``_parameters``, which stays untouched."""
    key = (cls, attrs)
    if key not in _SUBCLASSES:
        def reader(attr):
            def read(self):
                recipe, saved = self.__dict__["_lazy_weights"][attr]
                return saved.register(recipe.compute(), recipe)
            return property(read, doc=f"{attr}, computed by the active substitution")
        methods = {a: reader(a) for a in attrs}
        if issubclass(cls, nn.Embedding) and cls.forward is nn.Embedding.forward and "weight" in attrs:
            methods["forward"] = _embedding_rows_forward
        _SUBCLASSES[key] = type(cls)(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, **methods})
    return _SUBCLASSES[key]


#: where substituted parameters live: per module (by id), its (module, attribute, canonical name)
Slots = Dict[int, List[Tuple[nn.Module, str, str]]]


def parameter_slots(model: nn.Module, names: Iterable[str]) -> Slots:
    """(module, attribute, canonical name) of every place where the parameters ``names`` live,
    aliases of tied parameters included, grouped by module: what :func:`substituted` attaches
    recipes to. Computed once, it can be passed to every :func:`substituted` of the same
    parameters of an unchanged model (it walks all modules: milliseconds for a 12-layer model, at
    every evaluation otherwise)."""
    wanted = set(names)
    canonical = {id(p): n for n, p in model.named_parameters() if n in wanted}
    found: Dict[int, List[Tuple[nn.Module, str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and id(p) in canonical:
                found.setdefault(id(module), []).append((module, attr, canonical[id(p)]))
    missing = wanted - set(canonical.values())
    if missing:
        raise UnknownName(f"substituted: no parameter named {sorted(missing)[:3]} in the model")
    return found


@contextlib.contextmanager
def substituted(model: nn.Module, weights: Mapping[str, LazyWeight], *,
                slots: Optional[Slots] = None) -> Iterator[None]:
    """``with substituted(model, {name: LazyWeight(...)}):`` every read of those parameters, by
    their own module or any other code (``mha.out_proj.weight``, tied embeddings), returns the
    recipe's value; operations that save it for the backward pass store the recipe instead
    (module docstring). The model's classes are restored on exit, also after an exception.
    ``slots``: :func:`parameter_slots` of these names, computed earlier (default: now)."""
    if not isinstance(model, nn.Module):
        raise InvalidArgumentType(f"substituted: model must be a torch.nn.Module, got {type(model).__name__}")
    bad = [name for name, recipe in weights.items() if not isinstance(recipe, LazyWeight)]
    if bad:
        raise InvalidArgumentType(f"substituted: the values must be LazyWeight recipes; {bad[:3]} are not "
                                  f"(wrap a tensor t as LazyWeight(lambda: t))")
    saved = _SavedWeights()
    changed: List[Tuple[nn.Module, type]] = []
    try:
        if slots is None:
            slots = parameter_slots(model, weights)
        elif {name for places in slots.values() for _, _, name in places} != set(weights):
            raise InvalidArgument("substituted: slots= are those of other parameters than the weights "
                                  "given; pass parameter_slots(model, weights)")
        for places in slots.values():
            module = places[0][0]
            cls = type(module)
            attrs = tuple(sorted(attr for _, attr, _ in places))
            module.__dict__["_lazy_weights"] = {attr: (weights[name], saved) for _, attr, name in places}
            changed.append((module, cls))
            # (object's own setter: nn.Module.__setattr__'s checks are for parameters, modules and
            # buffers, and cost microseconds per module at every evaluation)
            object.__setattr__(module, "__class__", _lazy_class(cls, attrs))
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            yield
    finally:
        saved.by_storage.clear()  # the recipes (and what they hold) go with the evaluation
        for module, cls in reversed(changed):
            object.__setattr__(module, "__class__", cls)
            module.__dict__.pop("_lazy_weights", None)
