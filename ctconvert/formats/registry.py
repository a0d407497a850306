"""The format objects by name: :data:`FORMATS` and :func:`get_format` (re-exported by :mod:`ctconvert.formats`).

Its own module because the objects bring in torch and the C kernels: ``ctconvert.formats`` itself (the names,
:class:`~.base.WeightArgs`) stays torch-free for the commands that need no tensors (``ctconvert schemes``).
"""

from __future__ import annotations

from .base import CompressionFormat, WeightFormat
from .fp4 import MXFP4PackQuantized, NVFP4PackQuantized
from .fp8 import FloatQuantized, MXFP8Quantized, NaiveQuantized
from .integer import IntQuantized, PackQuantized
from .sparse24 import SPARSE_PREFIX, Marlin24, sparse24_format

__all__ = ["FORMATS", "get_format"]

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
