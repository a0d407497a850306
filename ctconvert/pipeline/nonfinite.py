"""NaN/inf in the executor's inputs: the scan of a copied chunk, and the one-line error naming the first one.

A quantized weight's NaN/inf is found from its absmax (or its scales, :attr:`Scheme.scale_flags_nonfinite`);
a copied floating tensor's by :func:`copy_nonfinite` on the reader thread. Either way the tensor is then read
again on the CPU by :func:`raise_nonfinite`, which says how many values are not finite and where the first is.
"""

from __future__ import annotations

import torch

from ..checkpoint.safetensors_io import TensorInfo, iter_row_chunks
from ..errors import BadInputError
from ..formats import native

__all__ = ["CHECKED_COPY", "copy_nonfinite", "raise_nonfinite"]

CHECKED_COPY = ("BF16", "F16", "F32", "F64", "F8_E4M3")  # pass-through dtypes whose values are checked


def copy_nonfinite(info: TensorInfo, data: torch.Tensor, native_checks: bool) -> bool:
    """Whether a pass-through chunk ``data`` (bytes) of a floating tensor holds NaN/inf (an E4M3 byte NaN);
    ``native_checks``: scan with the C kernels (any device, when they are built)."""
    if info.dtype not in CHECKED_COPY or not data.numel():
        return False
    if info.dtype == "F8_E4M3":
        return bool(((data.view(torch.uint8) & 0x7F) == 0x7F).any())
    if native_checks and info.dtype != "F64":
        return native.absmax(data.view(info.torch_dtype).reshape(1, -1))[1] > 0
    return not bool(torch.isfinite(data.view(info.torch_dtype)).all())


def raise_nonfinite(info: TensorInfo, only_if_found: bool = False, what: str = "weight", action: str = "refusing to quantize") -> None:
    """Find the first NaN/inf of a tensor (re-reading it on the CPU) and raise a one-line error."""
    total = 0
    first = None
    kind = "inf"
    for r0, w in iter_row_chunks(info):
        w = w.float().reshape(w.shape[0] if w.dim() else 1, -1)  # E4M3 NaN -> NaN; 0-D and 1-D as rows
        bad = ~torch.isfinite(w)
        cnt = int(bad.sum())
        if cnt:
            if first is None:
                idx = bad.nonzero()[0].tolist()
                first = (r0 + idx[0], idx[1])
            if bool(torch.isnan(w).any()):
                kind = "NaN"
            total += cnt
    if total == 0 and only_if_found:
        return
    where = f"element {first[0]}" if len(info.shape) <= 1 else f"row {first[0]}, column {first[1]}"  # a 1-D tensor's rows are elements
    raise BadInputError(
        f"{what} holds {total} non-finite value{'' if total == 1 else 's'} ({kind}; first at {where}); {action}",
        file=str(info.file),
        tensor=info.name,
    )
