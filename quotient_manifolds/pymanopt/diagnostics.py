r"""pymanopt 2.2.1's diagnostics on numpy 2, and with curves that reach exact zeros.

``pymanopt.tools.diagnostics.identify_linear_piece`` (the slope finder of ``check_gradient``,
``check_hessian``, ``check_directional_derivative`` and ``check_retraction``) does
``residues[k] = np.sqrt(residuals)`` with a length-1 array, which numpy ≥ 2 refuses ("setting an
array element with a sequence"), so those checks crash. It also fits windows that contain
log10(0) = −∞ (an error curve that reaches an exact 0, as ``check_retraction``'s does where the
retraction and the exponential agree to the last bit): their residue is NaN, ``np.argmin`` picks
it and the slope printed is ``nan``. :func:`identify_linear_piece` is the same fit, skipping windows
with non-finite values; :func:`patched_diagnostics` installs it while its block runs::

    from pymanopt.tools.diagnostics import check_gradient, check_retraction
    from quotient_manifolds.pymanopt import RescalingQuotient, patched_diagnostics

    with patched_diagnostics():
        check_retraction(RescalingQuotient(4, metric="mix"))   # "the slope is: 2.9998…"
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Tuple

import numpy as np

__all__ = ["identify_linear_piece", "patched_diagnostics"]


def identify_linear_piece(x: np.ndarray, y: np.ndarray, window_length: int
                          ) -> Tuple[np.ndarray, np.ndarray]:
    """The window of ``window_length + 1`` consecutive points of the curve (x, y) best fitted by a
    line (least residual; windows with a non-finite value are skipped), and that line's
    coefficients (slope first), as pymanopt's function of the same name returns them.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.linspace(-6, 0, 31)
    >>> y = np.concatenate([np.full(10, -np.inf), 3 * x[10:]])   # exact zeros, then slope 3
    >>> segment, poly = identify_linear_piece(x, y, 10)
    >>> round(float(poly[0]), 6)
    3.0
    """
    residues = np.full(len(x) - window_length, np.inf)
    polys = np.zeros((2, len(residues)))
    for k in range(len(residues)):
        segment = np.arange(k, k + window_length + 1)
        if not (np.all(np.isfinite(x[segment])) and np.all(np.isfinite(y[segment]))):
            continue
        poly, residuals, *_ = np.polyfit(x[segment], y[segment], 1, full=True)
        residues[k] = np.sqrt(residuals[0]) if len(residuals) else 0.0
        polys[:, k] = poly
    best = int(np.argmin(residues))
    return np.arange(best, best + window_length + 1), polys[:, best]


@contextmanager
def patched_diagnostics() -> Iterator[None]:
    """Use :func:`identify_linear_piece` in ``pymanopt.tools.diagnostics`` inside the block (the
    original is restored after it, also on an exception); log10 of exact zeros is not warned
    about.

    Returns
    -------
    context manager
        Use it in a ``with`` statement; it yields nothing.

    Examples
    --------
    >>> import pymanopt.tools.diagnostics as diagnostics
    >>> from quotient_manifolds.pymanopt import patched_diagnostics
    >>> original = diagnostics.identify_linear_piece
    >>> with patched_diagnostics():
    ...     diagnostics.identify_linear_piece is original
    False
    >>> diagnostics.identify_linear_piece is original
    True
    """
    import pymanopt.tools.diagnostics as diagnostics

    original = diagnostics.identify_linear_piece
    diagnostics.identify_linear_piece = identify_linear_piece
    try:
        with np.errstate(divide="ignore"):
            yield
    finally:
        diagnostics.identify_linear_piece = original
