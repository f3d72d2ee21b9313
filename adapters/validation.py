"""The argument checks of the public API (kept importable under this name): they live in
:mod:`quotient_manifolds._validation`, shared by the geometry core, the manifold faces, the
adapters and the studies."""
from __future__ import annotations

from quotient_manifolds._validation import *  # noqa: F401,F403
from quotient_manifolds._validation import (  # noqa: F401 - the names this module has always served
    LAYOUT_CLASS,
    TOKEN_INPUTS,
    TokenInputs,
    _finite_number,
    all_finite,
    batches,
    choice,
    flag,
    floating_tensor,
    integer_at_least,
    materialised,
    module,
    names,
    non_negative_finite,
    optional_callable,
    optional_layout,
    positive_finite,
    positive_finite_sequence,
    real_array_as_float64,
    same_shape,
    scalar_loss,
    tangent,
    token_inputs,
)
