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
    """Find the first NaN/inf of a tensor (re-reading it on the CPU) and raise a one-line error. A weight dequantized
    from stored tensors (``info.virtual``: an FP8 weight and its ``weight_scale_inv``, say) names the stored tensor
    that holds the NaN/inf, where one does, rather than the weight computed from it."""
    if info.virtual is not None:
        for part in info.virtual.stored():
            total, first, kind = _scan(part)
            if total:
                own = part.name == info.name  # the stored values under the weight's own name (E4M3 bytes)
                msg = (
                    f"{what} {_count(total, kind, first, part)} in its stored {part.dtype} values"
                    if own
                    else (f"stored tensor {_count(total, kind, first, part)}: {info.name} is dequantized from it")
                )
                raise BadInputError(f"{msg}; {action}", file=str(part.file), tensor=part.name)
    total, first, kind = _scan(info)
    if total == 0 and only_if_found:
        return
    raise BadInputError(f"{what} {_count(total, kind, first, info)}; {action}", file=str(info.file), tensor=info.name)


def _scan(info: TensorInfo) -> tuple[int, tuple[int, int] | None, str]:
    """The number of NaN/inf values of ``info``, the (row, column) of the first, and ``NaN`` or ``inf``."""
    total, first, kind = 0, None, "inf"
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
    return total, first, kind


def _count(total: int, kind: str, first, info: TensorInfo) -> str:
    where = "nowhere" if first is None else f"element {first[0]}" if len(info.shape) <= 1 else f"row {first[0]}, column {first[1]}"
    return f"holds {total} non-finite value{'' if total == 1 else 's'} ({kind}; first at {where})"
