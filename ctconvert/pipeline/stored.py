"""A quantized source's weights dequantized on the GPU: :class:`StoredRows`.

Requantizing a quantized checkpoint (an FP8-block DeepSeek or Qwen3 checkpoint to NVFP4A16, say) reads its stored
tensors and computes the dense weight they stand for (:class:`~ctconvert.sources.base.VirtualDense`). On the CPU the
fused C kernel does that on the reader threads; for a GPU run that puts the dequantization of every weight (twice the
stored bytes, as bf16) on a few host threads, and the run at their rate instead of the storage's (an H200, 8B
FP8-block source to NVFP4A16: 1.8x its concurrent read-and-write floor, against 1.07x for the bf16 source).

For a format whose dequantization is elementwise IEEE arithmetic (:attr:`~ctconvert.sources.base.SourceModule.on_device`:
FP8 block, compressed-tensors ``float-quantized``) a GPU run instead reads the *stored* rows of a chunk (E4M3 codes and
their scales) into one page-locked buffer on a reader thread (:func:`read_stored`), copies that buffer to the device and
dequantizes there with the source's torch reference (:meth:`StoredRows.to_device`): the bytes the CPU kernel gives
(tested on both), half the bytes over PCIe, and no dequantization on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checkpoint.safetensors_io import TensorInfo, read_bytes, row_span

__all__ = ["StoredRows", "on_device", "read_stored"]

_ALIGN = 64  # bytes: every part of the buffer starts aligned for any dtype


def on_device(info: TensorInfo) -> bool:
    """Whether ``info`` is a virtual dense weight whose source dequantizes on a GPU (:attr:`VirtualDense.on_device`)."""
    return info.virtual is not None and bool(getattr(info.virtual, "on_device", False))


@dataclass
class StoredRows:
    """The stored rows of dense rows ``[r0, r1)`` of ``info`` (a virtual weight), in ``buf`` (page-locked uint8): per
    part its name, byte offset, bytes, dtype and shape."""

    info: TensorInfo
    r0: int
    r1: int
    buf: torch.Tensor
    parts: list[tuple[str, int, int, torch.dtype, tuple[int, ...]]]

    def to_device(self, device: torch.device) -> torch.Tensor:
        """Dense rows ``[r0, r1)`` on ``device`` (the weight's dtype): the buffer copied asynchronously (from page-locked
        memory, on the current stream), the parts viewed in it and dequantized by the source there. The caller hands
        ``buf`` back to its pool behind an event recorded after this. Raises :class:`BadInputError` naming the
        tensor for what the source's reference refuses."""
        total = self.parts[-1][1] + self.parts[-1][2] if self.parts else 0
        dev = self.buf[: max(1, total)].to(device, non_blocking=True)
        parts = {name: dev[off : off + n].view(dtype).reshape(shape) for name, off, n, dtype, shape in self.parts}
        return self.info.virtual.dense_from(parts, self.r0, self.r1)


def read_stored(info: TensorInfo, r0: int, r1: int, pool) -> StoredRows:
    """Read the stored rows behind dense rows ``[r0, r1)`` of ``info`` (:meth:`VirtualDense.stored_spans`) into one
    buffer of ``pool`` (a :class:`~.buffers.PinnedPool`), each part at a 64-byte aligned offset, straight from the
    files (``preadv`` into the buffer: no tensor of their own first, no second copy). Raises
    :class:`BadInputError` (a short file, a shape the source's tensors do not have) naming the tensor.

    Reading each part into a new tensor and copying it over took a reader thread 1.6 s for an 8B FP8-block
    source on an H100 (its fresh pages faulted in as the file was copied into them), against 0.7 s for the
    dense source's twice as many bytes read into pooled buffers."""
    layout, reads, off = [], [], 0
    for name, (src, a, b) in info.virtual.stored_spans(r0, r1).items():
        skip, n, shape = row_span(src, a, b)
        layout.append((name, off, n, src.torch_dtype, shape))
        reads.append((src, skip, off, n))
        off += -(-n // _ALIGN) * _ALIGN
    buf = pool.get(max(1, off))
    for src, skip, start, n in reads:
        if n:
            read_bytes(src, skip, n, out=buf[start : start + n])
    return StoredRows(info, r0, r1, buf, layout)
