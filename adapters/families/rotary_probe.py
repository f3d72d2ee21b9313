r"""Which coordinates of a head the module's rotary function turns together, read by running it.

A rotary position encoding turns the pairs of coordinates of each query and key head by an angle
that grows with the position: q ↦ q R_t with R_t block-diagonal in 2×2 rotations.  Which
coordinates form the pairs decides the Q/K group (the commutant of the rotations,
``RotaryGroup(pairing, r)``): ``"half"`` pairs (i, i + r/2) (Hugging Face ``rotate_half``),
``"interleaved"`` pairs (2i, 2i + 1) (GPT-J, Mesh-TF), and partial rotary leaves the last h − r
coordinates unturned.  Class and config names do not say which; the function does.

:func:`probe_rotary` finds the function the module's ``forward`` calls (a global of its module whose
name contains ``rotary`` or starts a word with ``rope``), gives it the rows of the identity as the queries and keys of
h heads at two positions, with the ``(cos, sin)`` of the model's own rotary embedding module (a
submodule named like ``*Rotary*``; constant angles when there is none), and reads R_1 from the
result: the coordinates it moves, and each one's partner.  Nothing is modified; a function that
cannot be called this way gives ``None`` (the caller keeps its configuration-based guess, which
verification then checks).
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

from .structure import forward_owner

__all__ = ["probe_rotary", "rotary_function", "read_pairing"]

#: the angle of the constant (cos, sin) used when the model has no rotary embedding module
PROBE_ANGLE = 0.7
#: entries of R_1 below this are zero (the probe runs in float64 where it can)
ZERO = 1e-6


def rotary_function(mod: nn.Module) -> Optional[Callable]:
    """The rotary function that ``mod.forward`` calls: a callable global of its module named in the
    forward's code whose name contains ``rotary`` or ``rope`` (``apply_*`` first); ``None`` if none."""
    forward = vars(forward_owner(mod)).get("forward")
    try:
        forward = inspect.unwrap(forward)     # decorators (keyword deprecations) wrap HF forwards
    except (ValueError, TypeError):
        return None
    code, scope = getattr(forward, "__code__", None), getattr(forward, "__globals__", None)
    if code is None or scope is None:
        return None
    names = [n for n in code.co_names if re.search(r"rotary|(^|_)rope", n.lower())
             and callable(scope.get(n)) and not isinstance(scope.get(n), type)]
    names.sort(key=lambda n: not n.lower().startswith("apply"))
    return scope[names[0]] if names else None


def _position_embeddings(model: Optional[nn.Module], head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape (1, 2, ·) for positions 0 and 1, from the model's rotary embedding
    module (``forward(x, position_ids)``), else constant angles over ``head_dim`` coordinates."""
    positions = torch.arange(2).unsqueeze(0)
    for name, sub in ([] if model is None else model.named_modules()):
        if "rotary" not in type(sub).__name__.lower():
            continue
        try:
            with torch.no_grad():
                cos, sin = sub(torch.zeros(1, 2, head_dim), positions)
        except Exception:       # noqa: BLE001                     # another signature: try the next, else constant angles
            continue
        if (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.shape == sin.shape
                and cos.shape[-1] <= head_dim and cos.device.type != "meta"):
            return cos.to("cpu", torch.float64), sin.to("cpu", torch.float64)
    angles = torch.tensor([0.0, PROBE_ANGLE], dtype=torch.float64).view(1, 2, 1).expand(1, 2, head_dim)
    return angles.cos(), angles.sin()


def read_pairing(turn: torch.Tensor) -> Optional[Tuple[str, int]]:
    """``(pairing, r)`` of a rotary map R (h × h, row i = the image of coordinate i): the turned
    coordinates must be the first r, each paired with one other, as ``"half"`` (i, i + r/2) or
    ``"interleaved"`` (2i, 2i + 1) pairs; ``None`` for anything else."""
    h = turn.shape[0]
    off = turn - torch.diag(torch.diagonal(turn))
    moved = [i for i in range(h) if float(off[i].abs().max()) > ZERO]
    still = [i for i in range(h) if i not in moved]
    if any(float((turn[i] - torch.eye(h, dtype=turn.dtype)[i]).abs().max()) > ZERO for i in still):
        return None                           # a coordinate scaled, not turned: not a rotation
    r = len(moved)
    if r == 0:
        return "half", 0
    if moved != list(range(r)) or r % 2:
        return None
    partner = [int(off[i].abs().argmax()) for i in range(r)]
    if all(partner[i] == i ^ 1 for i in range(r)):
        return "interleaved", r
    if all(partner[i] == (i + r // 2) % r for i in range(r)):
        return "half", r
    return None


def probe_rotary(model: Optional[nn.Module], mod: nn.Module, head_dim: int) -> Optional[Tuple[str, int, str]]:
    """``(pairing, rotary_dim, function name)`` read by running the rotary function of ``mod``
    (module docstring), or ``None`` when there is none or it cannot be run on the probe."""
    fn = rotary_function(mod)
    if fn is None:
        return None
    cos, sin = _position_embeddings(model, head_dim)
    basis = torch.eye(head_dim, dtype=torch.float64).unsqueeze(1).expand(head_dim, 2, head_dim)
    q = basis.unsqueeze(0).contiguous()                    # (batch 1, heads h, positions 2, h)
    out: Any = None
    for call in (lambda: fn(q, q.clone(), cos, sin), lambda: fn(q, cos, sin), lambda: fn(q, sin, cos)):
        try:
            with torch.no_grad():
                out = call()
        except Exception:                     # another signature: try the next
            continue
        out = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(out, torch.Tensor) and out.shape == q.shape:
            break
        out = None
    if out is None or not bool(torch.isfinite(out).all()):
        return None
    if float((out[0, :, 0, :] - basis[:, 0, :]).abs().max()) > ZERO:
        return None                           # position 0 must not turn: the probe misread (cos, sin)
    turn = out[0, :, 1, :].to(torch.float64)
    found = read_pairing(turn)
    return None if found is None else (*found, getattr(fn, "__name__", "rotary function"))
