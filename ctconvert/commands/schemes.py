"""``ctconvert schemes``: every scheme, the other names it is accepted under, and the compressed-tensors format it writes."""

from __future__ import annotations

from ..plan.schemes import get_scheme, scheme_aliases

__all__ = ["list_schemes"]


def list_schemes() -> list[dict]:
    """One entry per scheme: ``{"name", "aliases", "format", "weights", "activations", "calibration"}``; an alias
    (``INT8`` of ``W8A8``) is listed with its scheme, not as a row of its own."""
    return [
        {
            "name": n,
            "aliases": a,
            "format": get_scheme(n).format.value,
            "weights": get_scheme(n).describe(),
            "activations": get_scheme(n).describe_activations(),
            "calibration": get_scheme(n).needs_calibration,
        }
        for n, a in scheme_aliases().items()
    ]
