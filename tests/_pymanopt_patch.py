"""numpy-2 fix for pymanopt 2.2.1 diagnostics (toolkit-apis §2.6–§2.7), for tests only.

``pymanopt.tools.diagnostics.identify_linear_piece`` does ``residues[k] = np.sqrt(residuals)``
with a length-1 array, which numpy ≥ 2 refuses ("setting an array element with a sequence");
this breaks ``check_directional_derivative``, ``check_gradient`` and ``check_hessian``. Apply the
patched copy with :func:`patch_diagnostics` (through pytest's ``monkeypatch``, so it is undone after
the test).
"""

import numpy as np
import pymanopt.tools.diagnostics as diagnostics


def identify_linear_piece(x, y, window_length):
    """Best-fitting window of the curve (x, y) and its first-order fit (slope first)."""
    residues = np.zeros(len(x) - window_length)
    polys = np.zeros((2, len(residues)))
    for k in range(len(residues)):
        segment = np.arange(k, k + window_length + 1)
        poly, residuals, *_ = np.polyfit(x[segment], y[segment], 1, full=True)
        residues[k] = np.sqrt(residuals[0]) if len(residuals) else 0.0
        polys[:, k] = poly
    best = int(np.argmin(residues))
    return np.arange(best, best + window_length + 1), polys[:, best]


def patch_diagnostics(monkeypatch):
    """Install the patched ``identify_linear_piece``; returns the diagnostics module."""
    monkeypatch.setattr(diagnostics, "identify_linear_piece", identify_linear_piece)
    return diagnostics
