"""Numeric formats: pure, device-agnostic quantization math, one object per compressed-tensors format.

Nothing here imports from the rest of the package but :mod:`ctconvert.cbuild`
(the C build of :mod:`.native`). Every function computes in fp32 and rounds
to the model dtype ``D`` exactly where compressed-tensors' CPU path rounds
(docs/compressed-tensors-format.md §6), so the results are the same bytes on
any device.

:data:`FORMATS` maps each :class:`CompressionFormat` to its
:class:`WeightFormat` object (see :mod:`.base`).
"""

from __future__ import annotations

from .base import CompressionFormat, WeightArgs, WeightFormat
from .fp4 import MXFP4PackQuantized, NVFP4PackQuantized
from .fp8 import FloatQuantized, MXFP8Quantized, NaiveQuantized
from .integer import IntQuantized, PackQuantized
from .sparse24 import SPARSE_PREFIX, Marlin24, sparse24_format

__all__ = ["FORMATS", "CompressionFormat", "WeightArgs", "WeightFormat", "get_format"]

#: every weight format ctconvert reads, by name; ``writes`` says which it also produces
FORMATS: dict[CompressionFormat, WeightFormat] = {
    f.name: f
    for f in (
        FloatQuantized(),
        IntQuantized(),
        NaiveQuantized(),
        PackQuantized(),
        NVFP4PackQuantized(),
        MXFP4PackQuantized(),
        MXFP8Quantized(),
        Marlin24(),
    )
}


def get_format(name: str | None) -> WeightFormat | None:
    """The format object of a compressed-tensors format name, or None for an unknown (or missing) name."""
    if name and name.startswith(SPARSE_PREFIX):  # "sparse-24-bitmask" or "sparse-24-bitmask+<inner format>"
        inner = name[len(SPARSE_PREFIX) + 1 :]
        inner_fmt = get_format(inner) if inner else None
        return None if inner and inner_fmt is None else sparse24_format(inner_fmt)
    try:
        return FORMATS.get(CompressionFormat(name))
    except ValueError:
        return None
