r"""The gate on a model sharded with FSDP2: a layout's blocks verified, and a failing block's group
derived, without ever holding the whole model in one process.

:func:`accept_on_shards` is how a geodesic run on a sharded model
(:class:`~quotient_manifolds.adapters.placement.ShardedPlacement`, ``GeodesicSAM``) accepts its
layout on the first batch: the checks of one process
(:func:`~quotient_manifolds.adapters.accept.accept_layout`: random ill-conditioned actions at five
scales, the failing blocks' groups derived and checked again, what still fails treated
elementwise) run module by module, each attention module alone on its owner with the inputs it
received in a sharded forward pass (:mod:`~quotient_manifolds.adapters.sharded_verify`, which also
says why that is as strong as the whole-model check). The outcomes are merged in the layout's
block order and settled by the gate as in one process
(:meth:`~quotient_manifolds.adapters.gate.Gate.settle`: a layout passed in of which no block
verifies is refused, derived groups are named in a warning), alike on every rank.
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
