"""The errors the library raises on purpose, one family: every one is a
:class:`QuotientManifoldsError`, so ``except QuotientManifoldsError`` catches all of them (and no
bug of the library's own, nor an error raised inside a user's model or loss).

Each is also the built-in exception it replaces, so code written against the built-in types keeps
working: a bad argument is a ``ValueError`` (:class:`InvalidArgument`) or a ``TypeError``
(:class:`InvalidArgumentType`), a run that ran out of memory a ``MemoryError`` and torch's
``OutOfMemoryError`` (:class:`SharpnessOutOfMemoryError`).

* :class:`InvalidArgument`: an argument has a value the call cannot take (``ValueError``);
  :class:`InvalidArgumentType`: a type it cannot take (``TypeError``);
  :class:`UnknownName`: a name (a block, a parameter, a family) that is not there (``ValueError``
  and ``KeyError``).
* :class:`StepTooLarge`: a step left the manifold (``ValueError``); :class:`GeodesicLeftManifold`:
  the exact geodesic did. :class:`LogNotFound`: no geodesic joins two points (``ValueError``).
* :class:`SymmetryError`: a block of a layout is not a symmetry of the model.
* :class:`UnsupportedModel`: no layout of the model's attention can be built (``ValueError``);
  :class:`OutputNotFound`: its output holds no tensor to compare (also a ``TypeError``).
* :class:`NotSupported`: a combination the library does not implement, such as a sharded model's
  Hessian (``NotImplementedError``).
* :class:`SharpnessOutOfMemoryError`: a run did not fit in its device's memory.
* :class:`NonFiniteLoss`: a loss or gradient became NaN or infinite (``FloatingPointError``).
* :class:`UsageError`: an object was used out of order (``RuntimeError``).
* :class:`CheckpointError`: a saved checkpoint or its data cannot be measured (``ValueError``).

This module imports only torch: every module of the library may use it.

Example
-------
>>> from quotient_manifolds import GLQuotient, InvalidArgument, QuotientManifoldsError
>>> try:
...     GLQuotient(6, 4, 0)
... except InvalidArgument as err:
...     print(isinstance(err, ValueError), isinstance(err, QuotientManifoldsError))
True True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "QuotientManifoldsError", "InvalidArgument", "InvalidArgumentType", "UnknownName", "StepTooLarge",
    "GeodesicLeftManifold", "LogNotFound", "SymmetryError", "UnsupportedModel", "OutputNotFound",
    "NotSupported", "SharpnessOutOfMemoryError", "NonFiniteLoss", "UsageError", "CheckpointError",
]


class QuotientManifoldsError(Exception):
    """The base of every error the library raises on purpose; the message says what was wrong
    and how to fix it. Catch it to handle any of them (an error raised by a user's model, loss or
    data passes through as it was raised)."""


class InvalidArgument(QuotientManifoldsError, ValueError):
    """An argument has a value the call cannot take (out of range, not finite, of the wrong shape,
    not one of the allowed names); the message names the argument. A ``ValueError``."""


class InvalidArgumentType(QuotientManifoldsError, TypeError):
    """An argument has a type the call cannot take (a string for a number, an integer tensor for a
    floating one, a module where a layout is expected); the message names the argument. A
    ``TypeError``."""


class UnknownName(InvalidArgument, KeyError):
    """A name that is not there (a block of the layout, a parameter of the model, a registered
    family): an :class:`InvalidArgument` (``ValueError``) and the ``KeyError`` it was raised as
    before (for ``except KeyError``)."""

    __str__ = ValueError.__str__    # KeyError's would quote the message


class StepTooLarge(QuotientManifoldsError, ValueError):
    """A move left the manifold: the new point has non-finite values or a factor that lost
    rank. The step (the optimiser's learning rate times its direction) was too large. Line searches
    (:class:`quotient_manifolds.geoopt.RiemannianLineSearch`) reject such a trial step instead of
    failing.

    Example
    -------
    >>> import torch
    >>> from quotient_manifolds import RescalingQuotient, StepTooLarge
    >>> M = RescalingQuotient(1, metric="mix", retraction="exact")
    >>> x, u = torch.ones(2, 1, dtype=torch.float64), torch.full((2, 1), -0.6, dtype=torch.float64)
    >>> try:
    ...     M.retr(x, u)
    ... except StepTooLarge as err:
    ...     print(type(err).__name__)
    GeodesicLeftManifold
    """


class GeodesicLeftManifold(StepTooLarge):
    """The exact geodesic left the manifold (a factor lost full rank, or the closed form passed its
    end, as the incomplete mix geodesic does at 1 + 2b = 0) or diverged within the step asked for:
    the step is too long for this point."""


class LogNotFound(QuotientManifoldsError, ValueError):
    """No geodesic from x to y was found: the logarithm log_x(y) (and so dist(x, y)) is not known.

    The points lie in different components of the quotient (the sign of β = u⊙v differs for the
    rescaling quotient), or the shooting method did not converge: y is too far from x, beyond where
    the geodesics from x stay on the manifold (the mix metric is incomplete). ``report`` is the
    :class:`~quotient_manifolds.core.logmap.LogResult` of the failed solve, or ``None``."""

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


class SymmetryError(QuotientManifoldsError):
    """A declared or detected GL block is not a symmetry of the model: the output changed under
    random elements of its group. ``.report`` is the
    :class:`~quotient_manifolds.adapters.VerifyReport` with each block's deviation. Catch it to
    fall back to the adaptive geometry, or fix the block's declaration (``group=``,
    ``num_kv_heads=``)."""

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


class UnsupportedModel(QuotientManifoldsError, ValueError):
    """No layout of the model's attention can be built: an attention-like module that cannot be
    mapped to GL blocks, or none found. Declare the blocks by hand
    (:func:`~quotient_manifolds.adapters.declare_block`) or pass ``allow_unsupported=True`` for
    the adaptive geometry on those weights. A ``ValueError``."""


class OutputNotFound(UnsupportedModel, TypeError):
    """No output tensor to compare was found in the model's output (a structure the check cannot
    read): pass ``output_fn=`` to ``Layout.verify``. A ``TypeError``."""


class NotSupported(QuotientManifoldsError, NotImplementedError):
    """A combination the library does not implement (a Hessian of a sharded model, a tensor-parallel
    placement, the logarithm of a subgroup's quotient); the message says what to do instead. A
    ``NotImplementedError``."""


#: torch's out-of-memory error (a ``RuntimeError``): torch.OutOfMemoryError from torch 2.5 on
_TORCH_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


class SharpnessOutOfMemoryError(QuotientManifoldsError, MemoryError, _TORCH_OUT_OF_MEMORY):
    """A sharpness run did not fit in the memory of its device; the message says how much the run
    needs and what to do. The model is left as it was. A ``MemoryError`` and a
    ``torch.OutOfMemoryError``, so a loop that catches either (to retry with a smaller batch)
    still catches it."""


class NonFiniteLoss(QuotientManifoldsError, FloatingPointError):
    """A loss or a gradient norm became NaN or infinite (at the unperturbed weights, or at a point
    of the ball); the message says where. A ``FloatingPointError``."""


class UsageError(QuotientManifoldsError, RuntimeError):
    """An object was used out of order or in a state it cannot serve (``GeodesicSAM.second_step``
    before ``first_step``, a distributed call with no process group); the message says which call
    comes first. A ``RuntimeError``."""


class CheckpointError(InvalidArgument):
    """A saved checkpoint, its data file or an option of
    :func:`~quotient_manifolds.adapters.checkpoint_sharpness` that cannot be measured; the message
    says what to do. A ``ValueError``."""
