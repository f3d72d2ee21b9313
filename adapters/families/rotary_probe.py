r"""Which coordinates of a head the module's rotary function turns together, read by running it.

A rotary position encoding turns the pairs of coordinates of each query and key head by an angle
that grows with the position: q ↦ q R_t with R_t block-diagonal in 2×2 rotations.  Which
coordinates form the pairs decides the Q/K group (the commutant of the rotations,
``RotaryGroup(pairing, r)``): ``"half"`` pairs (i, i + r/2) (Hugging Face ``rotate_half``),
``"interleaved"`` pairs (2i, 2i + 1) (GPT-J, Mesh-TF), and partial rotary leaves the last h − r
coordinates unturned.  Class and config names do not say which; the function does.

:func:`probe_rotary` finds the function the module's ``forward`` calls (a global of its module whose
name contains ``rotary`` or starts a word with ``rope``), gives it the rows of the identity as the
queries and keys of h heads at a few positions (:data:`PROBE_POSITIONS`), with the model's own
rotary embedding (a submodule named like ``*Rotary*``, giving ``(cos, sin)`` or Llama 4's complex
``freqs_cis``; constant angles when there is none), and reads the maps R_t from the result: the
coordinates they move, and each one's partner.  Several positions, because the lowest frequencies
of a long-context model barely turn in one step.  Nothing is modified; a function that cannot be
called this way gives ``None`` (the caller keeps its configuration-based guess, which verification
then checks).
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from .structure import forward_owner

__all__ = ["probe_rotary", "rotary_function", "read_pairing"]

#: where the probe records the calls it tried that failed (at DEBUG level)
LOG = logging.getLogger(__name__)
#: what a call with arguments of another signature or layout raises (too many or too few arguments,
#: shapes that do not broadcast, an index past a dimension): the probe tries the next way. Any other
#: error (an AttributeError, a KeyboardInterrupt) is not a mismatch and propagates.
CALL_MISMATCH = (TypeError, ValueError, RuntimeError, IndexError)

#: the angle of the constant (cos, sin) used when the model has no rotary embedding module
PROBE_ANGLE = 0.7
#: entries of R_1 below this are zero (the probe runs in float64 where it can)
ZERO = 1e-6


def _rotary_functions(mod: nn.Module) -> List[Callable]:
    """The rotary functions that ``mod.forward`` may call: the callable globals of its module named
    in the forward's code whose name contains ``rotary`` or ``rope`` (``apply_*`` first)."""
    forward = vars(forward_owner(mod)).get("forward")
    try:
        forward = inspect.unwrap(forward)     # decorators (keyword deprecations) wrap HF forwards
    except (ValueError, TypeError):
        return []
    code, scope = getattr(forward, "__code__", None), getattr(forward, "__globals__", None)
    if code is None or scope is None:
        return []
    names = [n for n in code.co_names if re.search(r"rotary|(^|_)rope", n.lower())
             and callable(scope.get(n)) and not isinstance(scope.get(n), type)]
    names.sort(key=lambda n: not n.lower().startswith("apply"))
    return [scope[n] for n in names]


def rotary_function(mod: nn.Module) -> Optional[Callable]:
    """The first of the rotary functions that ``mod.forward`` may call, or ``None``."""
    return next(iter(_rotary_functions(mod)), None)


def _interleave_flag(mod: nn.Module) -> Optional[bool]:
    """The module's or its config's ``rope_interleave`` (DeepSeek-V3: which of two rotary functions
    ``forward`` calls), or ``None``."""
    for owner in (mod, getattr(mod, "config", None)):
        v = getattr(owner, "rope_interleave", None)
        if isinstance(v, bool):
            return v
    return None


#: the positions the probe turns the basis to: 0 (no turn) and others far enough apart that every
#: frequency of a long-context model turns measurably at one of them (θ_min ≈ 1e-7 per position
#: with a YaRN factor of 32 on base 5e5), at an odd count so the (positions, heads) axes never match
PROBE_POSITIONS = (0, 1, 37, 1000, 65536)


def _position_embeddings(model: Optional[nn.Module], head_dim: int) -> Tuple[torch.Tensor, ...]:
    """The model's rotary embedding (a submodule named like ``*Rotary*``, ``forward(x, position_ids)``)
    at :data:`PROBE_POSITIONS`: ``(cos, sin)`` of shape (1, positions, ·), or one complex tensor
    ``freqs_cis`` (Llama 4's ``e^{iθ}``); constant steps of angle when there is none."""
    positions = torch.tensor([PROBE_POSITIONS])
    x = torch.zeros(1, len(PROBE_POSITIONS), head_dim)
    for name, sub in ([] if model is None else model.named_modules()):
        if "rotary" not in type(sub).__name__.lower():
            continue
        try:
            with torch.no_grad():
                out = sub(x, positions)
        except CALL_MISMATCH as err:            # another signature: try the next, else constant angles
            LOG.debug("rotary probe: %s at %r does not take (x, position_ids): %s: %s",
                      type(sub).__name__, name, type(err).__name__, err)
            continue
        emb = (out,) if isinstance(out, torch.Tensor) and out.is_complex() else tuple(out) if isinstance(
            out, (tuple, list)) and len(out) == 2 else ()
        if (emb and all(isinstance(t, torch.Tensor) and t.shape == emb[0].shape for t in emb)
                and emb[0].dim() == 3 and emb[0].shape[1] == len(PROBE_POSITIONS) and emb[0].shape[-1] <= head_dim
                and emb[0].device.type != "meta"):
            wide = torch.complex128 if emb[0].is_complex() else torch.float64
            return tuple(t.to("cpu", wide) for t in emb)
    angles = PROBE_ANGLE * torch.arange(len(PROBE_POSITIONS), dtype=torch.float64).view(1, -1, 1)
    angles = angles.expand(1, len(PROBE_POSITIONS), head_dim)
    return angles.cos(), angles.sin()


def read_pairing(turn: torch.Tensor) -> Optional[Tuple[str, int]]:
    """``(pairing, r)`` of a rotary map R (h × h, row i = the image of coordinate i), or of several
    (T × h × h, the maps at several positions, read together): the turned coordinates must be the
    first r, each paired with one other, as ``"half"`` (i, i + r/2) or ``"interleaved"`` (2i, 2i + 1)
    pairs; ``None`` for anything else."""
    turns = turn.unsqueeze(0) if turn.dim() == 2 else turn
    h = turns.shape[-1]
    eye = torch.eye(h, dtype=turns.dtype)
    off = (turns - torch.diag_embed(torch.diagonal(turns, dim1=-2, dim2=-1))).abs().amax(0)
    moved = [i for i in range(h) if float(off[i].max()) > ZERO]
    still = [i for i in range(h) if i not in moved]
    if any(float((turns[:, i] - eye[i]).abs().max()) > ZERO for i in still):
        return None                           # a coordinate scaled, not turned: not a rotation
    r = len(moved)
    if r == 0:
        return "half", 0
    if moved != list(range(r)) or r % 2:
        return None
    partner = [int(off[i].argmax()) for i in range(r)]
    if all(partner[i] == i ^ 1 for i in range(r)):
        return "interleaved", r
    if all(partner[i] == (i + r // 2) % r for i in range(r)):
        return "half", r
    return None


def _calls(fn: Callable, emb: Tuple[torch.Tensor, ...], head_dim: int):
    """``(call, seq_major)``: the ways the probe tries to call ``fn`` on the basis ``q`` (the rows of
    the identity as the queries and keys of h heads at every probe position): head-major ``(batch,
    heads, positions, h)`` with ``(cos, sin)`` (HF), or, for a complex ``freqs_cis``, position-major
    ``(batch, positions, heads, h)`` (Llama 4) and head-major."""
    T = len(PROBE_POSITIONS)
    basis = torch.eye(head_dim, dtype=torch.float64).unsqueeze(1).expand(head_dim, T, head_dim)
    q = basis.unsqueeze(0).contiguous()                     # (1, h, T, h)
    if len(emb) == 2:
        cos, sin = emb
        return q, [(lambda: fn(q, q.clone(), cos, sin), False), (lambda: fn(q, cos, sin), False),
                   (lambda: fn(q, sin, cos), False)]
    qs = q.transpose(1, 2).contiguous()                     # (1, T, h, h)
    return q, [(lambda: fn(qs, qs.clone(), emb[0]), True), (lambda: fn(q, q.clone(), emb[0]), False)]


def _probe_one(fn: Callable, model: Optional[nn.Module], head_dim: int) -> Optional[Tuple[str, int]]:
    """``(pairing, rotary_dim)`` of the rotary function ``fn``, or ``None``."""
    q, calls = _calls(fn, _position_embeddings(model, head_dim), head_dim)
    out: Any = None
    for call, seq_major in calls:
        try:
            with torch.no_grad():
                out = call()
        except CALL_MISMATCH as err:          # another signature: try the next
            LOG.debug("rotary probe: %s does not take the probe's arguments this way: %s: %s",
                      getattr(fn, "__name__", fn), type(err).__name__, err)
            continue
        out = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(out, torch.Tensor) and seq_major:
            out = out.transpose(1, 2)
        if isinstance(out, torch.Tensor) and out.shape == q.shape:
            break
        out = None
    if out is None or not bool(torch.isfinite(out).all()):
        return None
    turns = out[0].transpose(0, 1).to(torch.float64)         # (T, h, h): the map at each position
    # position 0 must not turn: its map is c·P with P orthogonal (the identity, or a fixed reordering
    # of the coordinates, as DeepSeek's interleaved function writes its output in rotate_half order),
    # which q Pᵀ... kᵀ cancels; the turns in the input's coordinates are then P R_t Pᵀ = M_t M_0ᵀ / c²
    first = turns[0]
    square = float((first @ first.T).diagonal().mean())
    eye = torch.eye(head_dim, dtype=torch.float64)
    if square <= 0 or float((first @ first.T / square - eye).abs().max()) > ZERO:
        return None                           # not c·orthogonal: the probe misread the embedding
    return read_pairing(turns[1:] @ first.T / square)


def probe_rotary(model: Optional[nn.Module], mod: nn.Module, head_dim: int) -> Optional[Tuple[str, int, str]]:
    """``(pairing, rotary_dim, function name)`` read by running the rotary function of ``mod``
    (module docstring), or ``None`` when there is none or it cannot be run on the probe.

    A rotary embedding that scales as it turns (YaRN's ``attention_scaling``: c·R) is read as R
    (the scale commutes with every A, the commutant is that of R), and one that also reorders the
    coordinates by a fixed P (DeepSeek-V3's interleaved function returns them in ``rotate_half``
    order: P R_t) as the turns P R_t Pᵀ of the input's coordinates (the scores see only those).
    When ``forward`` names several rotary functions that turn differently, the module's (or its
    config's) ``rope_interleave`` flag picks the one with that pairing; without it the answer is
    ``None``."""
    found = {}
    for fn in _rotary_functions(mod):
        read = _probe_one(fn, model, head_dim)
        if read is not None:
            found.setdefault(read, getattr(fn, "__name__", "rotary function"))
    if len(found) > 1:
        flag = _interleave_flag(mod)
        found = {} if flag is None else {k: v for k, v in found.items() if (k[0] == "interleaved") == flag}
    if len(found) != 1:
        return None
    (pairing, r), name = next(iter(found.items()))
    return pairing, r, name
