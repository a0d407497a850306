"""The observers by llm-compressor's registry names."""

from __future__ import annotations

from .imatrix import IMatrixMSEObserver
from .search import MinMaxObserver, MSEObserver, WeightObserver

__all__ = ["OBSERVERS", "get_observer"]

#: every observer by llm-compressor's name, with its defaults (``mse.py``, ``imatrix.py``, 0.14.0.1)
OBSERVERS: dict[str, WeightObserver] = {
    o.name: o
    for o in (
        MinMaxObserver(),
        MSEObserver("memoryless_mse", maxshrink=0.20, patience=5, grid=100.0, norm=2.4, expand=1.0),
        MSEObserver("nvfp4_expanded_mse", maxshrink=1 - 0.8 / 1.8, patience=1000, grid=200.0, norm=2.4, expand=1.8),
        IMatrixMSEObserver("imatrix_mse", maxshrink=0.95, patience=5, grid=20, norm=3.0, expand=1.0),
        IMatrixMSEObserver("nvfp4_expanded_imatrix", maxshrink=1 - 0.8 / 1.8, patience=1000, grid=200, norm=2.4, expand=1.8),
    )
}


def get_observer(name: str | None) -> WeightObserver:
    """The observer of a name (``None``, ``minmax`` and ``memoryless_minmax``: min/max); raises ``ValueError``
    naming the known ones for another."""
    if name in (None, "minmax", "memoryless_minmax"):
        return OBSERVERS["minmax"]
    try:
        return OBSERVERS[name]
    except KeyError:
        raise ValueError(f"unknown observer {name!r}: one of {', '.join(OBSERVERS)}") from None
