"""Rows that quantize to all zeros although their source is not zero (values too small for the format).

fp16 rows with values of about 1e-7 get a group scale that rounds to zero,
which compressed-tensors replaces by ``eps(D)`` (docs/compressed-tensors-format.md
§6.1): every value then quantizes to 0, and the layer's outputs for those rows
are zero. The bytes are compressed-tensors' own and are not changed; the rows
are reported by tensor name (``quantize`` notes and ``zero_quantized``).

Kept off the hot path: a row can only quantize to all zeros when every one of
its group scales is the format's substitute for a zero scale
(:meth:`ctconvert.formats.base.WeightFormat.zero_scale`; any other scale maps
its group's largest value to a non-zero level). Per chunk that is one compare
over the scales (1/16 to 1/128 of the weight's elements) on the device that
holds them; on a GPU the candidate masks stay there until the run ends. Only
candidate rows (rare: all-zero or tiny rows) are examined further: re-read
on the CPU, quantized again with the torch reference (the same bytes), and
dequantized.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..checkpoint.safetensors_io import TensorInfo, read_rows
from ..formats.fp4 import nvfp4_global_scale_overflows

__all__ = ["ZeroRows", "ZeroTracker", "candidate_rows", "stacked_candidates", "zero_rows"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def candidate_rows(out: dict[str, torch.Tensor], fmt, args, dtype: torch.dtype, rows: int) -> torch.Tensor | None:
    """Bool ``[rows]`` on the scales' device: the rows of a quantized chunk (``out``: its tensors, ``fmt``
    its :class:`~ctconvert.formats.base.WeightFormat`, ``args`` its WeightArgs, ``dtype`` the dense
    weight's) whose every ``weight_scale`` is the format's zero-scale substitute. None: the format has
    none, or no scale is stored. For block scales the unit is the block: a row counts when every block
    it lies in has the substitute scale (values rounding to zero beside larger values of their own
    group or block are ordinary quantization error, not counted)."""
    s = out.get("weight_scale")
    got = stacked_candidates(None if s is None else s.unsqueeze(0), fmt, args, dtype, rows)
    return None if got is None else got[0]


def stacked_candidates(s: torch.Tensor | None, fmt, args, dtype: torch.dtype, rows: int) -> torch.Tensor | None:
    """:func:`candidate_rows` of ``n`` chunks of one shape at once: ``s`` their ``weight_scale`` stacked ``[n, *shape]``
    (None: none stored); bool ``[n, rows]``, or None."""
    sub = fmt.zero_scale(args, dtype)
    if sub is None or s is None or s[0].numel() == 0:
        return None
    # compared as bit patterns (the substitute is a positive normal number: equal bits <=> equal values)
    n = s.shape[0]
    ref = _substitute_bits(sub, s.dtype)  # a Python scalar: no host-to-device copy (and no sync) on a GPU
    raw = s.view(_BITS[s.element_size()])
    if raw.device.type == "cpu":  # numpy: one thread, so no thread-pool wake-up per chunk
        hit = raw.numpy() == ref
        if s[0].numel() == 1:
            return torch.from_numpy(hit.reshape(n, 1)).expand(n, rows)
        per = torch.from_numpy(hit.reshape(n, s.shape[1], -1).all(axis=2))
    else:
        hit = raw == ref
        if s[0].numel() == 1:
            return hit.reshape(n, 1).expand(n, rows)
        per = hit.reshape(n, s.shape[1], -1).all(dim=2)
    if args.strategy == "block":  # one scale row per block of rows
        per = per.repeat_interleave(args.block_structure[0], dim=1)
    return per[:, :rows]


@functools.lru_cache(maxsize=64)
def _substitute_bits(sub: float, dtype: torch.dtype) -> int:
    """The bit pattern of the zero-scale substitute ``sub`` stored as ``dtype`` (an int; once per pair, not per chunk)."""
    t = torch.tensor(sub, dtype=torch.float32).to(dtype) if dtype.is_floating_point else torch.tensor(int(sub), dtype=dtype)
    return int(t.view(_BITS[t.element_size()]).item())


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Sorted row indices as ``[a, b)`` runs of consecutive rows (one read each)."""
    runs: list[tuple[int, int]] = []
    for i in idx:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _key(dev: torch.device) -> str:
    """``cuda:N`` of a device (``cuda`` alone is the current device, as torch places tensors)."""
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def zero_rows(deq: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows all zero in deq, of those the rows not all zero in src)``: bool ``[r]`` each, for ``[r, K]`` tensors."""
    zero = (deq == 0).all(dim=1)
    return zero, zero & (src != 0).any(dim=1)


@dataclass
class ZeroRows:
    """What one tensor lost: ``zero_rows`` rows quantized to all zeros from non-zero values."""

    tensor: str
    rows: int  # the tensor's rows
    zero_rows: int = 0  # rows quantized to all zeros whose source is not all zero
    all_zero_rows: int = 0  # rows quantized to all zeros (the above, and rows that were zero already)
    max_abs: float = 0.0  # the largest |value| among the zero_rows
    dtype: str = ""  # the source weight's dtype (its scales underflow there, without a global scale)
    set_max: float | None = None  # NVFP4: the largest |value| of the tensor or fused set that set the global scale
    saturated: bool = False  # NVFP4: that global scale (2688 / set_max) is beyond the dtype's range, so stored as 1

    def cause(self) -> str:
        """Why these rows' values fall below the smallest step of their scales: the global scale that the tensor's
        or its fused set's largest value sets (NVFP4: E4M3 group scales relative to it), or, where that global scale
        is beyond the dtype's range and stored as 1 (fp16 sets of largest value under ~0.04), or without a global scale,
        the range of scales computed for a weight of this dtype (compressed-tensors then substitutes a small scale)."""
        if self.saturated:
            return (
                f"below the smallest step of their E4M3 group scales: the global scale 2688 / {self.set_max:.3g} that the "
                f"largest |value| of the tensor or its fused set needs is beyond {self.dtype}'s range, so it is stored as 1"
            )
        if self.set_max is not None:
            return (
                f"below the smallest step of their E4M3 group scales under the global scale that the largest |value| "
                f"{self.set_max:.3g} of the tensor or its fused set sets"
            )
        return f"below the smallest step that scales computed for a {self.dtype} weight can take"

    @property
    def whole(self) -> bool:
        """Every quantized value of the tensor is zero, and its source is not."""
        return self.zero_rows > 0 and self.all_zero_rows == self.rows

    def to_dict(self) -> dict:
        return {
            "tensor": self.tensor,
            "rows": self.rows,
            "zero_rows": self.zero_rows,
            "all_zero": self.whole,
            "max_abs": self.max_abs,
            "cause": "global_scale" if self.set_max is not None and not self.saturated else "scale_range",
            "set_max": self.set_max,
        }

    def note(self) -> str:
        if self.whole:
            return (
                f"{self.tensor}: every quantized value is zero although the source is not (largest |value| {self.max_abs:.3g}, "
                f"{self.cause()}): the layer computes zeros; keep it dense with --ignore"
            )
        return (
            f"{self.tensor}: {self.zero_rows} of {self.rows} rows quantize to all zeros although their source is not "
            f"(largest |value| {self.max_abs:.3g}, {self.cause()})"
        )


@dataclass
class ZeroTracker:
    """Collects :class:`ZeroRows` over a conversion (shared by the executors of every device)."""

    found: dict[str, ZeroRows] = field(default_factory=dict)
    pending: dict[str, list] = field(default_factory=dict)  # device -> [(info, r0, mask, scheme, gs, set_amax)], resolved at the end
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, info: TensorInfo, r0: int, w: torch.Tensor, out: dict[str, torch.Tensor], scheme, gs: torch.Tensor | None, set_amax=None) -> None:
        """One quantized chunk (rows ``r0 ..`` of ``info``): ``w`` its source rows, ``out`` its outputs, ``gs`` NVFP4's
        global scale and ``set_amax`` the absmax (fp32, one value) it came from (None for other schemes)."""
        mask = candidate_rows(out, scheme.weight_format, scheme.weights, info.torch_dtype, w.shape[0])
        if mask is None:
            return
        if mask.device.type != "cpu":  # no sync on the device: looked at once the run is over
            with self.lock:
                self.pending.setdefault(_key(mask.device), []).append((info, r0, mask, scheme, gs, set_amax))
            return
        if mask.numpy().any():
            idx = mask.nonzero().flatten()
            self._examine(info, idx + r0, w[idx], scheme, gs, set_amax)

    def observe_stacked(self, infos: list[TensorInfo], w: torch.Tensor, scales: torch.Tensor | None, scheme, gs: list, set_amax: list | None = None) -> None:
        """:meth:`observe` of ``n`` whole tensors of one shape (a batch, :mod:`.batches`): ``infos`` theirs, ``w``
        ``[n, R, K]`` their values, ``scales`` their ``weight_scale`` outputs stacked ``[n, ...]`` (None: none),
        ``gs`` each one's NVFP4 global scale ``[1]`` (or None), ``set_amax`` the absmax each came from (or None)."""
        set_amax = set_amax or [None] * len(infos)
        mask = stacked_candidates(scales, scheme.weight_format, scheme.weights, infos[0].torch_dtype, w.shape[1])
        if mask is None:
            return
        if mask.device.type != "cpu":
            self.observe_mask(infos, mask, scheme, gs, set_amax)
            return
        for j in mask.numpy().any(axis=1).nonzero()[0].tolist():
            idx = mask[j].nonzero().flatten()
            self._examine(infos[j], idx, w[j][idx], scheme, gs[j], set_amax[j])

    def observe_mask(self, infos: list[TensorInfo], mask: torch.Tensor, scheme, gs: list, set_amax: list | None = None) -> None:
        """:meth:`observe_stacked` with the candidates already found on a device (:func:`stacked_candidates`: bool
        ``[n, R]``, a replayed batch's, :mod:`.graphs`): kept, with each one's ``gs`` and ``set_amax``, until
        :meth:`resolve`."""
        set_amax = set_amax or [None] * len(infos)
        with self.lock:
            self.pending.setdefault(_key(mask.device), []).extend((info, 0, mask[j], scheme, gs[j], set_amax[j]) for j, info in enumerate(infos))

    def resolve(self, device: torch.device) -> None:
        """Examine the candidate rows the chunks on ``device`` left (after the device is synchronized)."""
        with self.lock:
            entries = self.pending.pop(_key(torch.device(device)), [])
        if not entries:
            return
        # one transfer for the whole run, and one search for the candidate rows (rare): no torch call per entry
        flags = torch.cat([e[2].reshape(-1) for e in entries]).cpu().numpy()
        ends = np.cumsum([e[2].numel() for e in entries])
        for k in np.unique(np.searchsorted(ends, np.flatnonzero(flags), side="right")).tolist():
            info, r0, mask, scheme, gs, set_amax = entries[k]
            start = int(ends[k]) - mask.numel()
            idx = torch.from_numpy(np.flatnonzero(flags[start : int(ends[k])]))
            rows = torch.cat([read_rows(info, r0 + a, r0 + b) for a, b in _runs(idx.tolist())])
            self._examine(info, idx + r0, rows, scheme, gs.cpu() if gs is not None else None, set_amax)

    def _examine(self, info: TensorInfo, idx: torch.Tensor, w: torch.Tensor, scheme, gs: torch.Tensor | None, set_amax=None) -> None:
        """Quantize the candidate rows again on the CPU (torch reference: the same bytes) and count the
        rows whose dequantized values are all zero, and among them those whose source is not. ``set_amax``: the
        absmax NVFP4's global scale ``gs`` came from (given with ``gs``)."""
        w = w.cpu().contiguous()
        gs = gs.cpu() if gs is not None else None
        nonzero = (w != 0).any(dim=1)
        w = w[nonzero]  # a zero row quantizes to zeros: only the others are quantized again
        zero_q = lost = torch.zeros(0, dtype=torch.bool)
        if w.shape[0]:
            parts = scheme.quantize_rows(w, gs, impl="torch")
            parts.update(scheme.whole_tensor_outputs(tuple(w.shape), gs))
            zero_q, lost = zero_rows(scheme.weight_format.dequantize(parts, scheme.weights), w)
        with self.lock:
            rec = self.found.setdefault(info.name, ZeroRows(info.name, info.shape[0], dtype=str(info.torch_dtype).removeprefix("torch.")))
            if gs is not None:  # NVFP4's global scale: D(D(1 / amax) * 2688) (formats.fp4.nvfp4_global_scale)
                a = float(set_amax.reshape(-1)[0])
                rec.set_max = a
                # beyond D's range the global scale is stored as 1 (compressed-tensors' generate_gparam): the dtype's range is the cause
                rec.saturated = nvfp4_global_scale_overflows(a, info.torch_dtype)
            rec.all_zero_rows += int((~nonzero).sum()) + int(zero_q.sum())
            rec.zero_rows += int(lost.sum())
            if bool(lost.any()):
                rec.max_abs = max(rec.max_abs, float(w[lost].abs().max()))

    def reports(self) -> list[ZeroRows]:
        """The tensors with rows lost, in name order."""
        return [r for _, r in sorted(self.found.items()) if r.zero_rows]
