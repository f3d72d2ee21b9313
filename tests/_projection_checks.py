"""The properties every horizontal projection must have, shared by the property tests of the
groups (rotary, closed forms, subalgebras)."""

from __future__ import annotations

import torch


def check_projection(frame, u: torch.Tensor) -> torch.Tensor:
    """P = ``frame.project`` is idempotent (P(Pu) = Pu) and metric-orthogonal (⟨Pu, u − Pu⟩ = 0,
    relative to ‖Pu‖·‖u − Pu‖ in the metric, so that the bound holds at ill-conditioned points
    too); returns Pu."""
    p = frame.project(u)
    scale = float(u.abs().max())
    assert float((frame.project(p) - p).abs().max()) <= 1e-8 * scale
    vertical = u - p
    norms = (frame.inner(p, p).clamp_min(0) * frame.inner(vertical, vertical).clamp_min(0)).sqrt()
    assert bool((frame.inner(p, vertical).abs() <= 1e-8 * norms + 1e-300).all())
    return p
