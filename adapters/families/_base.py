"""What a model family is: the :class:`Family` interface, the :class:`Match` it returns and the
:class:`Context` it is given (see the package docstring of ``adapters.families``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from quotient_manifolds.errors import InvalidArgument

from ..blocks import GLBlock, canonical_names

__all__ = ["Match", "Family", "Context"]


@dataclass
class Match:
    """What one family found in one module.

    ``module``: path of the module the blocks belong to (may differ from the matched module: the
    ``hf-bert`` family matches ``BertSelfAttention`` and claims its parent, which also holds the
    output projection); nothing inside a claimed module is matched again, except by nested families.
    ``blocks``: the GL blocks (possibly none).  ``unsupported``: ``(part, reason)`` pairs, ``part`` ""
    for the whole module (then ``blocks`` must be empty) or a block kind such as ``"qk"`` when only
    that half has no verified symmetry.  ``notes``: deliberate modelling choices worth telling the
    user (they end up in ``Layout.notes``).
    """

    module: str
    family: str
    cls: str
    blocks: List[GLBlock] = field(default_factory=list)
    unsupported: List[Tuple[str, str]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def reject(self, reason: str, part: str = "") -> "Match":
        """Record ``reason`` against ``part`` ("" = the whole module) and return ``self``."""
        self.unsupported.append((part, reason))
        return self

    @property
    def whole_module_unsupported(self) -> bool:
        return any(part == "" for part, _ in self.unsupported)


@dataclass
class Context:
    """The model as detection sees it, shared by all families (nothing here is modified).

    ``canonical``: ``id(parameter) -> canonical name`` (tied parameters get one name);
    ``shapes``: canonical name -> shape; ``modules``: path -> module (``model.named_modules()``);
    ``by_name``: False in the first pass (structural matches), True in the second pass, where
    modules that look like attention only by their class name are reported too.
    """

    model: nn.Module
    canonical: Dict[int, str]
    shapes: Dict[str, Tuple[int, ...]]
    modules: Dict[str, nn.Module]
    by_name: bool = False

    @classmethod
    def of(cls, model: nn.Module) -> "Context":
        canonical, _ = canonical_names(model)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        return cls(model, canonical, shapes, dict(model.named_modules()))

    def name(self, tensor: torch.Tensor) -> str:
        """Canonical name of a parameter of the model."""
        try:
            return self.canonical[id(tensor)]
        except KeyError:
            raise InvalidArgument("a projection tensor is not a parameter of the model (a buffer or a "
                                  "computed weight?): declare the block by hand") from None


class Family:
    """A model family: recognises its attention (or adapter) modules and returns their blocks.

    Subclass, set ``name`` (unique, shown in layouts) and implement :meth:`match`; register with
    :func:`quotient_manifolds.adapters.families.register_family`.  ``nested = True`` makes detection also try the
    family on modules inside modules already claimed by another family (LoRA layers live inside
    attention modules).
    """

    name: str = ""
    nested: bool = False

    def match(self, ctx: Context, path: str, module: nn.Module) -> Optional[Match]:
        """A :class:`Match` if ``module`` (at ``path``) belongs to this family, else None."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<family {self.name!r}{' (nested)' if self.nested else ''}>"
