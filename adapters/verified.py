"""The record of verifications (which layouts passed :meth:`Layout.verify
<quotient_manifolds.adapters.Layout.verify>` on which model) lives in
:mod:`~quotient_manifolds.adapters.verify`, beside the check; these names stay importable here."""

from .verify import is_verified, record, record_verification, signature

__all__ = ["record_verification", "is_verified", "signature", "record"]
