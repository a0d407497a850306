"""The ``--dense-dtype`` cast of a copied tensor (:mod:`ctconvert.plan.dense_dtype` plans it), chunk by chunk.

The cast is :meth:`torch.Tensor.to` (IEEE round to nearest even), on the host
bytes as the executor copies them: the same on every device. A finite value
the target dtype cannot hold (beyond fp16's 65504, or bf16's largest finite
value, about 3.39e38) is refused naming the file and tensor rather than written
as inf; NaN/inf already in the source are handled as without the option
(``--allow-non-finite``).
"""

from __future__ import annotations

import torch

from ..checkpoint.safetensors_io import DTYPES
from ..errors import BadInputError
from ..plan.dense_dtype import short_name

__all__ = ["cast_chunk"]


def cast_chunk(data: torch.Tensor, src_dtype: str, dst_dtype: str, file: str, tensor: str, start: int) -> tuple[torch.Tensor, int]:
    """One copied chunk's bytes (``data``: uint8, whole elements of ``src_dtype``, at byte ``start`` of the
    tensor) cast to ``dst_dtype``; returns the new bytes and their byte offset in the output tensor.

    Raises :class:`BadInputError` naming ``file`` and ``tensor`` when a finite value overflows the target
    dtype (it would be written as inf); NaN/inf of the source stay NaN/inf."""
    src_t, src_size = DTYPES[src_dtype]
    dst_t, dst_size = DTYPES[dst_dtype]
    values = data.view(src_t)
    out = values.to(dst_t)
    if dst_size < src_size or dst_dtype == "F16":
        overflow = torch.isinf(out) & torch.isfinite(values)
        if bool(overflow.any()):
            i = int(overflow.nonzero()[0])
            v = float(values[i])
            raise BadInputError(
                f"--dense-dtype {short_name(dst_dtype)}: value {v:g} (element {start // src_size + i}) is beyond the range of "
                f"{short_name(dst_dtype)} and would become inf; keep this tensor's dtype (--dense-dtype keep or bf16)",
                file=file,
                tensor=tensor,
            )
    return out.view(torch.uint8), start // src_size * dst_size
