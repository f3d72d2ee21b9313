r"""The gate on a model sharded with FSDP2: a layout's blocks verified, and a failing block's group
derived, without ever holding the whole model in one process (the checks run module by module:
:mod:`~quotient_manifolds.adapters.sharded_verify`).

A GL block lives inside one attention module: its weights are that module's, and the model's
output depends on them only through that module's output. So checking a block needs only the
module, its weights and the inputs it receives in the model's forward pass:

1. one sharded forward pass of the model on the first batch records the inputs of every module
   that holds a block (every rank its own batch, FSDP2 gathering and freeing the layers as in
   training);
2. each such module is given to one rank (balanced by size); for each module in turn its weights
   are gathered (``DTensor.full_tensor``: one module at a time, about one layer's attention) and
   its owner runs, on a plain copy of the module alone with the inputs it recorded, the same
   checks as for a model in one process (:func:`~quotient_manifolds.adapters.accept.accept_layout`:
   random ill-conditioned actions at five scales, the failing blocks' groups derived and checked
   again, what still fails treated elementwise);
3. the outcomes are shared by every rank (one ``all_gather_object``), merged in the layout's block
   order, and settled by the gate as in one process (:meth:`~quotient_manifolds.adapters.gate.Gate.settle`:
   a layout passed in of which no block verifies is refused, derived groups are named in a
   warning); every warning and error is raised alike on every rank.

Why this is as strong as the whole-model check: if the module's output is unchanged under an
action on its weights, for the inputs it receives in the forward pass, everything after it
computes the same numbers, so the model's output is unchanged too; and conversely a change of the
model's output under the action can only come through this module's output. The check is the same
statement about the same forward pass, made where the action happens; its tolerance is relative to
the module's output instead of the model's (the rounding of the check, not its power, differs).
It needs the block's weights to be used by this module alone: a weight tied to another module is
refused, naming it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .accept import accept_layout
from .derive import with_blocks
from .gate import Gate
from .layouts import Layout
from .sharded_verify import checked_on_owners
from .verify import record_verification, verified_before_sharding

__all__ = ["accept_on_shards"]


def accept_on_shards(gate: Gate, example_inputs: Any, on_reference: Optional[Callable[[Any], None]],
                     stacklevel: int) -> Layout:
    """The layout of ``gate`` accepted on the first inputs of a model sharded with FSDP2 (module
    docstring): its blocks verified module by module, a failing block's group derived, the outcome
    the same on every rank. A collective: every rank of the model's process group calls it, each
    with its own first inputs. ``on_reference`` checks the model's output at its own weights (the
    batch's targets) on every rank; ``stacklevel``: of the warnings, as in :meth:`Gate.accept`."""
    model, layout = gate.model, gate.layout
    if gate.pending and verified_before_sharding(model, layout):
        record_verification(model, layout, True)   # the whole model's check stands for the shards
    if not gate.pending:   # verified on this model before, or run unchecked with unsafe=True
        return gate.accept(example_inputs, on_reference=on_reference, stacklevel=stacklevel + 1)

    def accept(alone, sub, inputs) -> Dict[str, Any]:
        accepted, _ = accept_layout(alone, sub, inputs, what=gate.what)
        return dict(blocks=list(accepted.blocks), failed=list(sub.verify_failed),
                    unsupported=[u for u in accepted.unsupported if u not in sub.unsupported])

    merged = checked_on_owners(model, layout, example_inputs, accept, what=gate.what,
                               on_reference=on_reference, stacklevel=stacklevel + 1)
    return _settled(gate, layout, list(merged), merged, stacklevel + 1)


def _settled(gate: Gate, layout: Layout, paths: List[str], merged: Dict[str, Dict[str, Any]],
             stacklevel: int) -> Layout:
    """The modules' outcomes as one layout of the whole model (blocks in the layout's order),
    recorded as verified on the sharded model and settled by the gate."""
    accepted_blocks = {b.name: b for path in paths for b in merged[path]["blocks"]}
    failed = [name for path in paths for name in merged[path]["failed"]]
    unsupported = list(layout.unsupported) + [u for path in paths for u in merged[path]["unsupported"]]
    if not failed:
        record_verification(gate.model, layout, True)
        layout.verify_failed = []
        return gate.settle(layout, None, stacklevel=stacklevel + 1)
    layout.verify_failed = failed
    blocks = [accepted_blocks[b.name] for b in layout.blocks if b.name in accepted_blocks]
    accepted = with_blocks(layout, blocks, unsupported, list(layout.notes))
    record_verification(gate.model, accepted, True)
    return gate.settle(accepted, None, stacklevel=stacklevel + 1)
