"""Numeric formats: pure, device-agnostic quantization math, one object per compressed-tensors format.

Nothing here imports from the rest of the package but :mod:`ctconvert.cbuild`
(the C build of :mod:`.native`). Every function computes in fp32 and rounds
to the model dtype ``D`` exactly where compressed-tensors' CPU path rounds
(docs/compressed-tensors-format.md §6), so the results are the same bytes on
any device.

:data:`FORMATS` maps each :class:`CompressionFormat` to its
:class:`WeightFormat` object (see :mod:`.base`). The names and the weight arguments are
torch-free; :data:`FORMATS` and :func:`get_format` (:mod:`.registry`) load the format
objects, and with them torch, on first use.
"""

from __future__ import annotations

from .base import CompressionFormat, WeightArgs, WeightFormat

__all__ = ["FORMATS", "CompressionFormat", "WeightArgs", "WeightFormat", "get_format"]

_LAZY = ("FORMATS", "get_format")  # from .registry, on first use (PEP 562)


def __getattr__(name: str):
    if name in _LAZY:
        from . import registry

        value = globals()[name] = getattr(registry, name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
