"""numpy-2 fix for pymanopt 2.2.1 diagnostics, for the tests: the library's
:func:`quotient_manifolds.pymanopt.diagnostics.identify_linear_piece`, installed through pytest's
``monkeypatch`` (undone after the test)."""

import pymanopt.tools.diagnostics as diagnostics

from quotient_manifolds.pymanopt.diagnostics import identify_linear_piece


def patch_diagnostics(monkeypatch):
    """Install the patched ``identify_linear_piece``; returns the diagnostics module."""
    monkeypatch.setattr(diagnostics, "identify_linear_piece", identify_linear_piece)
    return diagnostics
