r"""The Q/K group under a weightless normalisation of q and k (Llama 4's ``qk_norm``: an RMS/L2 norm
of each head's query and key, without a learned gain), read by running the norm.

With ``N(u) = u / sqrt(mean(u²) + ε)`` applied to ``u = x G R`` and ``v = y H R`` (``R`` the rotary
map, before or after the norm: it is orthogonal and commutes with the A below), the scores
``N(u) N(v)ᵀ`` are kept by ``(G A, H A⁻ᵀ)`` for every orthogonal A that commutes with the rotary
maps: ``N(u A) = N(u) A`` and ``A⁻ᵀ = A``.  No larger group keeps them: ``rms(u A) = rms(u)`` for
all u forces ``A`` orthogonal up to a scale, and ``ε > 0`` forbids the scale (``N(c u) ≠ N(u)``);
with ``ε = 0`` (``F.normalize``) the scale acts on q and k separately and ``c A`` is kept too.
Hence the rotary commutant intersected with the orthogonal group: a rotation on each frequency pair
(SO(2) = the unit circle of GL(1, ℂ)), SO(h − r) on the coordinates that are not rotated, and the
positive scalars when ε = 0.  Without rotary positions: SO(h) (R₊·SO(h) when ε = 0).

The norm is recognised by what it does, not by its class: :func:`probe_weightless_norm` runs it on
random rows and their rotations.  A norm with a learned gain (Qwen3, Gemma 3, OLMo2) has a smaller
group that depends on the gain (see ``adapters.derive``); it is not handled here.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from quotient_manifolds.core.groups import Group, GLGroup, RotaryGroup
from quotient_manifolds.core.subalgebra import OrthogonalGroup, ScaledOrthogonalGroup, SubalgebraGroup

from .rotary_probe import CALL_MISMATCH

__all__ = ["probe_weightless_norm", "normalised_rotary_group"]

#: relative agreement the probe asks for (norms that compute in float32 inside a float64 model)
PROBE_RTOL = 1e-5
#: the probe's small scale: mean(u²) ≈ 1e-12 lets any ε ≥ 1e-14 show
SMALL = 1e-6


def probe_weightless_norm(norm: nn.Module, head_dim: int) -> Optional[bool]:
    """Whether ``norm`` (a module without parameters) commutes with rotations of a head's
    coordinates, ``N(u Q) = N(u) Q`` for a random orthogonal Q: ``None`` if not (or if it cannot be
    run on ``(rows, head_dim)``), else whether it also forgets the scale (``N(c u) = N(u)``: ε = 0)."""
    if any(True for _ in norm.parameters()):
        return None
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(3, head_dim, generator=gen, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    try:
        with torch.no_grad():
            base, turned, small = norm(u), norm(u @ Q), norm(SMALL * u)
    except CALL_MISMATCH as err:                   # not a norm of the last dimension
        logging.getLogger(__name__).debug("%s is not a norm of a head's coordinates: %s: %s",
                                          type(norm).__name__, type(err).__name__, err)
        return None
    if not all(isinstance(t, torch.Tensor) and t.shape == u.shape for t in (base, turned, small)):
        return None
    base, turned, small = (t.to(torch.float64) for t in (base, turned, small))
    size = float(base.abs().max())
    if not size > 0 or float((turned - base @ Q).abs().max()) > PROBE_RTOL * size:
        return None
    return float((small - base).abs().max()) <= PROBE_RTOL * size


def _pair_rotations_basis(rotary: RotaryGroup, h: int) -> torch.Tensor:
    """J_j (the quarter turn of pair j) for each rotary pair, then so(h − r) on the free coordinates."""
    r = rotary.rotated(h)
    mats = []
    for p, q in rotary.pairs(h):
        J = torch.zeros(h, h, dtype=torch.float64)
        J[q, p], J[p, q] = 1.0, -1.0
        mats.append(J)
    for i in range(r, h):
        for j in range(i + 1, h):
            E = torch.zeros(h, h, dtype=torch.float64)
            E[i, j], E[j, i] = 1.0, -1.0
            mats.append(E)
    return torch.stack(mats)


def normalised_rotary_group(group: Group, h: int, scalars: bool) -> Optional[Group]:
    """The group of Q/K under a weightless q/k norm (module docstring), from ``group``, the one
    without the norm: the full GL(h) gives SO(h) (R₊·SO(h) with ``scalars``); a ``RotaryGroup`` its
    intersection with the orthogonal group, SO(2)^{r/2} × SO(h − r) (× R₊); None for other groups."""
    if isinstance(group, GLGroup):
        return ScaledOrthogonalGroup() if scalars else OrthogonalGroup()
    if not isinstance(group, RotaryGroup):
        return None
    basis = _pair_rotations_basis(group, h)
    if scalars:
        basis = torch.cat((basis, torch.eye(h, dtype=torch.float64)[None]))
    r = group.rotated(h)
    label = (f"SO(2)^{r // 2} [{group.pairing} pairs]" + (f" x SO({h - r})" if r < h else "")
             + (" x R+" if scalars else ""))
    return SubalgebraGroup(basis, label=label)
