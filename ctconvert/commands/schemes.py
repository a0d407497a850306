"""``ctconvert schemes``: every scheme, the other names it is accepted under, and the compressed-tensors format it writes."""

from __future__ import annotations

from ..plan.schemes import get_scheme, scheme_aliases
from ..plan.sparsity import DENSE_SCHEME, sparse_scheme

__all__ = ["list_schemes"]


def list_schemes() -> list[dict]:
    """One entry per scheme, by name: ``{"name", "aliases", "format", "weights", "activations", "calibration",
    "needs"}``; an alias (``INT8`` of ``W8A8``) is listed with its scheme, not as a row of its own. ``DENSE``
    (2:4 pruning without quantization, :mod:`ctconvert.plan.sparsity`) is listed too: it needs ``--sparsity 2:4``
    (``needs``; None for the others)."""
    rows = [
        {
            "name": n,
            "aliases": a,
            "format": get_scheme(n).format.value,
            "weights": get_scheme(n).describe(),
            "activations": get_scheme(n).describe_activations(),
            "calibration": get_scheme(n).needs_calibration,
            "needs": None,
        }
        for n, a in scheme_aliases().items()
    ]
    dense = sparse_scheme(DENSE_SCHEME, "2:4")
    rows.append(
        {
            "name": DENSE_SCHEME,
            "aliases": [],
            "format": dense.output_format,
            "weights": f"{dense.describe()}; with --sparsity 2:4 only",
            "activations": "none (not quantized)",
            "calibration": False,
            "needs": "--sparsity 2:4",
        }
    )
    return sorted(rows, key=lambda r: r["name"])
