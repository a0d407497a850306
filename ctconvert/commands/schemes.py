"""``ctconvert schemes``: every scheme name and the compressed-tensors format it writes."""

from __future__ import annotations

from ..plan.schemes import get_scheme, scheme_names

__all__ = ["list_schemes"]


def list_schemes() -> list[dict]:
    """One entry per accepted name (aliases included): ``{"name", "format", "weights"}``."""
    return [{"name": n, "format": get_scheme(n).format.value, "weights": get_scheme(n).describe()} for n in scheme_names()]
