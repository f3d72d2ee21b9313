r"""Tuple points / tangent vectors for the pymanopt faces, and the ONE numpy ↔ torch converter.

pymanopt represents a point of a ``point_layout=2`` manifold as a 2-sequence of arrays and needs
tangent vectors with arithmetic (``+``, ``-``, scalar ``*`` on both sides, ``/``, unary ``-``);
this follows ``pymanopt.manifolds.fixed_rank`` (docs/maths.md §A.5). The torch core works on
the two arrays stacked along rows, e.g. ``[G; H]`` of shape (n+m, h) or ``[u; v]`` of shape (2, d).
"""

from __future__ import annotations

import collections
from typing import Sequence, Tuple

import numpy as np
import torch
from pymanopt.tools import ndarraySequenceMixin, return_as_class_instance

from ..errors import InvalidArgumentType
from .._validation import all_finite, real_array_as_float64


class _PairArithmetic(ndarraySequenceMixin):
    """Elementwise arithmetic on a 2-tuple of arrays (``__array_ufunc__ = None`` makes numpy
    scalars defer to these methods instead of vectorising over the tuple)."""

    __slots__ = ()

    @return_as_class_instance
    def __add__(self, other):
        return [self[0] + other[0], self[1] + other[1]]

    @return_as_class_instance
    def __sub__(self, other):
        return [self[0] - other[0], self[1] - other[1]]

    @return_as_class_instance
    def __mul__(self, scalar):
        return [scalar * self[0], scalar * self[1]]

    __rmul__ = __mul__

    @return_as_class_instance
    def __truediv__(self, scalar):
        return [self[0] / scalar, self[1] / scalar]

    @return_as_class_instance
    def __neg__(self):
        return [-self[0], -self[1]]

    @return_as_class_instance
    def __pos__(self):
        return [+self[0], +self[1]]


class GLPoint(collections.namedtuple("GLPoint", ("G", "H"))):
    """A point (G, H) of the GL(h) quotient (any representative).

    Parameters
    ----------
    G, H : numpy arrays of shapes (n, h) and (m, h), of full column rank.

    Raises
    ------
    TypeError
        Not two parts (a namedtuple of G and H); the manifold checks shapes and rank where it
        uses the point.

    Examples
    --------
    >>> import numpy as np
    >>> from quotient_manifolds.pymanopt import GLPoint, GLQuotient
    >>> M = GLQuotient(3, 3, 2)
    >>> x = GLPoint(np.eye(3, 2), np.eye(3, 2))        # G = H = [I; 0]
    >>> u = M.projection(x, (np.ones((3, 2)), np.zeros((3, 2))))
    >>> type(u).__name__, u.G.shape
    ('GLTangentVector', (3, 2))
    """

    __slots__ = ()


class GLTangentVector(_PairArithmetic, collections.namedtuple("_GLTangent", ("G", "H"))):
    """A horizontal tangent vector (ξ_G, ξ_H), with arithmetic.

    Sums, differences, negation and products with scalars act on both parts, as pymanopt's
    optimizers need.

    Parameters
    ----------
    G, H : numpy arrays of the point's shapes (n, h) and (m, h).

    Raises
    ------
    TypeError
        Not two parts, or arithmetic with something that is neither a scalar nor a pair.

    Examples
    --------
    >>> import numpy as np
    >>> from quotient_manifolds.pymanopt import GLTangentVector
    >>> u = GLTangentVector(np.ones((3, 2)), np.zeros((3, 2)))
    >>> v = 2 * u - u / 2
    >>> type(v).__name__, float(v.G[0, 0]), float(v.H[0, 0])
    ('GLTangentVector', 1.5, 0.0)
    """

    __slots__ = ()


class RescalingPoint(collections.namedtuple("RescalingPoint", ("u", "v"))):
    """A point (u, v) of the rescaling quotient (any representative).

    Parameters
    ----------
    u, v : 1-D numpy arrays of d nonzero entries; β = u⊙v.

    Raises
    ------
    TypeError
        Not two parts (a namedtuple of u and v); the manifold checks them where it uses the point.

    Examples
    --------
    >>> import numpy as np
    >>> from quotient_manifolds.pymanopt import RescalingPoint
    >>> x = RescalingPoint(np.array([1.0, 2.0]), np.array([3.0, 0.5]))
    >>> (x.u * x.v).tolist()                            # β
    [3.0, 1.0]
    """

    __slots__ = ()


class RescalingTangentVector(_PairArithmetic,
                             collections.namedtuple("_RescalingTangent", ("u", "v"))):
    """A horizontal tangent vector (ξ_u, ξ_v), with arithmetic.

    Parameters
    ----------
    u, v : 1-D numpy arrays of d entries.

    Raises
    ------
    TypeError
        Not two parts, or arithmetic with something that is neither a scalar nor a pair.

    Examples
    --------
    >>> import numpy as np
    >>> from quotient_manifolds.pymanopt import RescalingTangentVector
    >>> u = RescalingTangentVector(np.array([1.0, 2.0]), np.array([0.0, 1.0]))
    >>> (u + u).u.tolist(), (-u).v.tolist()
    ([2.0, 4.0], [-0.0, -1.0])
    """

    __slots__ = ()


def _plain_float64(part, shape) -> bool:
    """A writable float64 numpy array of the expected shape, usable by torch as it is."""
    return (type(part) is np.ndarray and part.dtype == np.float64 and part.shape == shape
            and part.flags.writeable and all(s >= 0 for s in part.strides))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a float64 tensor outside autograd (no call where it is one already)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dtype == torch.float64 else t.to(torch.float64)


class PairConverter:
    """numpy 2-sequence ↔ one float64 torch tensor with the two parts stacked along rows.

    ``shapes`` are the numpy shapes of the two parts (``(n, h), (m, h)`` or ``(d,), (d,)``) and
    ``parts`` their names (``("G", "H")`` or ``("u", "v")``); each part is viewed as a matrix with
    the last dimension as columns and the two are concatenated.
    """

    def __init__(self, shapes: Tuple[Tuple[int, ...], Tuple[int, ...]],
                 parts: Tuple[str, str] = ("G", "H")):
        self.shapes = tuple(tuple(s) for s in shapes)
        self.parts = tuple(parts)
        self.rows = tuple(int(np.prod(s[:-1], dtype=int)) for s in self.shapes)

    def to_torch(self, pair: Sequence[np.ndarray], name: str = "point", *,
                 tangent: bool = False, stacked: bool = True) -> torch.Tensor:
        """The pair ``name`` as one float64 tensor; a part of another shape, or holding anything but
        real numbers, is refused naming it (``name.G``), and so is a non-finite ``tangent`` vector
        (the checks of :mod:`quotient_manifolds._validation`, shared with the geoopt faces).
        ``stacked=False`` returns the two parts as a pair of matrices instead (no copy when they
        are float64 arrays already)."""
        # tuples (what pymanopt passes) are decided without the slower Sequence check
        if not isinstance(pair, tuple) and (
                isinstance(pair, (str, bytes, np.ndarray, torch.Tensor))
                or not isinstance(pair, Sequence)) or len(pair) != 2:
            got = (f"{len(pair)} items" if isinstance(pair, Sequence) and not isinstance(pair, str)
                   else type(pair).__name__)
            raise InvalidArgumentType(f"{name} must be a pair ({', '.join(self.parts)}) of arrays of shapes "
                                      f"{self.shapes[0]} and {self.shapes[1]}, got {got}")
        tensors = []
        for part, label, shape, rows in zip(pair, self.parts, self.shapes, self.rows):
            if _plain_float64(part, shape):
                # what pymanopt passes (our own results, or sums of them): no conversion, and the
                # finiteness test in numpy (a fifth of torch's cost on arrays of this size)
                t = torch.from_numpy(part)
                if tangent and not np.isfinite(part).all():
                    all_finite(f"{name}.{label}", t)
            else:
                t = real_array_as_float64(f"{name}.{label}", part, shape)
                if tangent:
                    all_finite(f"{name}.{label}", t)
            tensors.append(t if t.ndim == 2 else t.reshape(rows, shape[-1]))
        return torch.cat(tensors, dim=0) if stacked else tuple(tensors)

    def to_numpy(self, t: "torch.Tensor | Tuple[torch.Tensor, torch.Tensor]", cls):
        # split and reshaped in numpy: one torch call per tensor (numpy's slicing is cheaper)
        if isinstance(t, tuple):
            first, second = (_plain(part).numpy() for part in t)
        else:
            stacked = _plain(t).numpy()
            first, second = stacked[:self.rows[0]], stacked[self.rows[0]:]
        return cls(first.reshape(self.shapes[0]), second.reshape(self.shapes[1]))
