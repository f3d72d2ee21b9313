"""Model families: the registry that :func:`quotient_manifolds.adapters.detect` walks to find GL blocks.

Detection visits the modules of a model in ``named_modules()`` order and asks the families of
:data:`FAMILIES`, in order, to :meth:`Family.match` each one; the first :class:`Match` wins and
claims its ``module``.  Modules inside a claimed module are only offered to *nested* families
(``peft-lora``: LoRA layers inside attention modules).  A second pass offers the remaining modules
again with ``Context.by_name = True``, where the last family also reports modules that look like
attention only by their class name.  Families and the maths of their groups are described in
``adapters.detection``; each file here is one family:

``torch_mha``       ``torch-mha``  ``nn.MultiheadAttention``
``peft_lora``       ``peft-lora``  peft LoRA layers, one GL(r) block per adapter (nested)
``hf_gpt2``         ``hf-gpt2``    ``GPT2Attention`` (``Conv1D``, packed ``c_attn``)
``hf_rotary``       ``hf-rotary``  HF rotary decoders (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi, Phi-3,
                                   GPT-NeoX): RoPE commutant on Q/K, grouped-query gauges, QK-norm
``latent``          ``latent``     multi-head latent attention (DeepSeek-V2/V3): no-rope Q/K, shared
                                   rotary key, V/O, each by structure + config
``differential``    ``differential`` differential attention (DiffLlama): Q/K as without it, V/O SO(2h) per
                                   value pair (two key/value heads normalised together)
``structural``      ``structural`` any HF attention by structure + config: packed q/k/v (three packings),
                                   grouped-query, rotary / ALiBi evidence, QK-norm (V/O only)
``qkvo``            ``qkvo``       four q/k/v/o projection children (T5's score bias, ALBERT's norm)
``hf_bert``         ``hf-bert``    q/k/v children + sibling ``output.dense`` (DeBERTa-v2's pairs)
``attention_like``  ``unknown``    anything else that looks like attention: unsupported

Adding a family for your own attention class: subclass :class:`Family`, build its blocks with the
helpers of ``quotient_manifolds.adapters.families.structure`` (``projection`` reads a
linear child, ``attention_blocks`` assembles the Q/K and V/O blocks, grouped-query
and rotary groups included), and register it::

    from quotient_manifolds import adapters
    from quotient_manifolds.adapters.families import Family, Match, register_family
    from quotient_manifolds.adapters.families.structure import attention_blocks, projection

    class MyAttentionFamily(Family):
        name = "my-attention"

        def match(self, ctx, path, module):
            if not isinstance(module, MyAttention):
                return None
            res = Match(path, self.name, type(module).__name__)
            lin = {n: projection(f"{path}.{n}", getattr(module, n)) for n in ("wq", "wk", "wv", "wo")}
            attention_blocks(ctx, res, q=lin["wq"], k=lin["wk"], v=lin["wv"], o=lin["wo"],
                             num_heads=module.heads, head_dim=module.head_dim)
            return res

    register_family(MyAttentionFamily())        # tried before the built-in families
    layout = adapters.layout(model); layout.verify(model, inputs)   # always check a new family
"""

from __future__ import annotations

from typing import List, Optional

from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UnknownName

from ._base import Context, Family, Match
from .attention_like import UnknownAttention
from .hf_bert import HFBertSelfAttention
from .hf_gpt2 import HFGPT2Attention
from .hf_rotary import ROTARY_CLASSES, HFRotaryAttention, RotaryClass
from .differential import DifferentialAttention
from .latent import LatentAttention
from .peft_lora import PeftLoRA
from .structural import PACKING_HINTS, StructuralAttention
from .qkvo import PlainQKVO
from .torch_mha import TorchMultiheadAttention

__all__ = ["Family", "Match", "Context", "FAMILIES", "register_family", "unregister_family", "family",
           "ROTARY_CLASSES", "RotaryClass", "PACKING_HINTS"]

#: The families in the order detection tries them (first match wins).  Change it with
#: :func:`register_family` / :func:`unregister_family`.
FAMILIES: List[Family] = [
    TorchMultiheadAttention(),
    PeftLoRA(),
    HFGPT2Attention(),
    HFRotaryAttention(),
    LatentAttention(),
    DifferentialAttention(),
    StructuralAttention(),
    PlainQKVO(),
    HFBertSelfAttention(),
    UnknownAttention(),
]


def family(name: str) -> Family:
    """The registered family called ``name``."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise UnknownName(f"no family named {name!r}; registered: {', '.join(f.name for f in FAMILIES)}")


def register_family(fam: Family, before: Optional[str] = None) -> Family:
    """Add ``fam`` to :data:`FAMILIES`: tried before the family named ``before``, or, by default,
    before every family registered so far (so a user family wins over the built-in ones).
    Returns ``fam``; undo with :func:`unregister_family`."""
    if not isinstance(fam, Family):
        raise InvalidArgumentType(f"register_family() needs a Family instance (subclass adapters.families.Family and "
                                  f"implement match()), got {type(fam).__name__}")
    if not fam.name:
        raise InvalidArgument(f"{type(fam).__name__} has no name: set the class attribute `name` to a unique string")
    if any(f.name == fam.name for f in FAMILIES):
        raise InvalidArgument(f"a family named {fam.name!r} is already registered: choose another name or call "
                              f"unregister_family({fam.name!r}) first")
    index = 0 if before is None else FAMILIES.index(family(before))
    FAMILIES.insert(index, fam)
    return fam


def unregister_family(name: str) -> Family:
    """Remove the family called ``name`` from :data:`FAMILIES` and return it."""
    fam = family(name)
    FAMILIES.remove(fam)
    return fam
