"""NaN/inf in the executor's inputs: the scan of a copied chunk, and the one-line error naming the first one.

A quantized weight's NaN/inf is found from its absmax (or its scales, :attr:`Scheme.scale_flags_nonfinite`);
a copied floating tensor's by :func:`copy_nonfinite` on the reader thread (small ones read together:
:func:`read_copies`). Either way the tensor is then read
again on the CPU by :func:`raise_nonfinite`, which says how many values are not finite and where the first is.
"""

from __future__ import annotations

import torch

from ..checkpoint.safetensors_io import TensorInfo, iter_row_chunks, read_whole
from ..errors import BadInputError
from ..formats import native

__all__ = ["CHECKED_COPY", "DeviceFlags", "copy_nonfinite", "raise_nonfinite", "read_copies"]

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


def read_copies(infos: list[TensorInfo], native_checks: bool) -> list[tuple[torch.Tensor, bool]]:
    """Whole copied tensors read together (:func:`~ctconvert.checkpoint.safetensors_io.read_whole`: each span of a
    file once), each as ``(bytes, whether they hold NaN/inf)`` (:func:`copy_nonfinite`). A run of one dtype is scanned
    once; where it is finite so is every tensor taken from it, and only a run holding NaN/inf has its tensors scanned
    one by one (a scan through the C kernels, like a read, lets the GIL go)."""
    got = read_whole(infos)
    clean: dict[int, bool] = {}
    out = []
    for info, data, r in zip(infos, got.pieces, got.run_of):
        if r >= 0 and got.runs[r][1] == info.dtype:
            if r not in clean:
                clean[r] = not copy_nonfinite(info, got.runs[r][0], native_checks)
            if clean[r]:
                out.append((data, False))
                continue
        out.append((data, copy_nonfinite(info, data, native_checks)))
    return out


class DeviceFlags:
    """A GPU run's NaN/inf flags, never waited for: per unit (or batch of units), the absmaxes of its inputs are
    reduced to one flag on the device and copied to pinned host memory behind an event (:meth:`add`); flags whose
    copy is done are read by :meth:`resolve` (after later units, and at the end of the run), so that no unit waits
    for the device. The output stays in its temporary folder until the run ends, so an error found a few units
    late loses nothing. ``tensors``: the checkpoint's tensors by name; ``units``: the number of flags (the plan's
    units)."""

    def __init__(self, tensors: dict, units: int):
        self.tensors, self.units = tensors, units
        self.pending: list = []  # (flag index, set absmax or None, [(TensorInfo, absmax)] or (infos, absmax [n]), sources, event)
        self.host: torch.Tensor | None = None  # pinned, one flag per unit: its inputs are finite

    def add(self, ui: int, amax: torch.Tensor | None, checks: list, sources: list[str], stream) -> None:
        """Flag ``ui``: finite iff ``amax`` (a fused set's 0-d absmax; NaN/inf there is looked for in ``sources``)
        and every ``checks`` absmax (0-d, each with the :class:`TensorInfo` it names) are finite."""
        flags = ([amax] if amax is not None else []) + [a for _, a in checks]
        if not flags:
            return
        if self.host is None:
            self.host = torch.ones(self.units, dtype=torch.bool, pin_memory=True)
        ok = torch.isfinite(torch.stack([a.reshape(()) for a in flags])).all()
        self.host[ui : ui + 1].copy_(ok.reshape(1), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        self.pending.append((ui, amax, list(checks), sources, ev))

    def add_stacked(self, ui: int, infos: list[TensorInfo], amax: torch.Tensor, stream, ok: torch.Tensor | None = None) -> None:
        """Flag ``ui`` for a batch of tensors: finite iff every value of ``amax`` (fp32 ``[n]``, the absmax of each of
        ``infos``, in order) is; one reduction (``ok``: bool ``[1]``, that reduction done already, on the device), and
        the first non-finite one is named when the flag is read."""
        if self.host is None:
            self.host = torch.ones(self.units, dtype=torch.bool, pin_memory=True)
        self.host[ui : ui + 1].copy_(torch.isfinite(amax).all().reshape(1) if ok is None else ok, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        self.pending.append((ui, None, (infos, amax), [], ev))

    def resolve(self) -> None:
        """Raise for the first flag (in the order added) that shows NaN/inf, naming the tensor; flags whose copy is
        not done yet stay pending (synchronise the device first to read them all)."""
        while self.pending and self.pending[0][4].query():
            ui, amax, checks, sources, _ = self.pending.pop(0)
            if bool(self.host[ui]):
                continue
            if amax is not None and not bool(torch.isfinite(amax)):
                for name in sources:
                    raise_nonfinite(self.tensors[name], only_if_found=True)
            if isinstance(checks, tuple):  # add_stacked: (infos, their absmax [n])
                checks = list(zip(checks[0], checks[1]))
            if checks:
                vals = torch.stack([a.reshape(()) for _, a in checks])
                if not bool(torch.isfinite(vals).all()):
                    raise_nonfinite(checks[int((~torch.isfinite(vals)).nonzero()[0])][0])


def raise_nonfinite(info: TensorInfo, only_if_found: bool = False, what: str = "weight", action: str = "refusing to quantize") -> None:
    """Find the first NaN/inf of a tensor (re-reading it on the CPU) and raise a one-line error. A weight dequantized
    from stored tensors (``info.virtual``: an FP8 weight and its ``weight_scale_inv``, say) names the stored tensor
    that holds the NaN/inf, where one does, else a stored ``*global_scale`` of 0 that it is divided by (a finite value
    that makes the weight's values NaN/inf), rather than the weight computed from them."""
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
        for part in info.virtual.stored():  # finite, but a divisor of zero: compressed-tensors' NVFP4 divides by it
            if part.name.endswith("global_scale") and any(bool((w == 0).any()) for _, w in iter_row_chunks(part)):
                raise BadInputError(
                    f"stored tensor is 0: {info.name} is dequantized by dividing its weight_scale by it (compressed-tensors "
                    f"0.20 nvfp4 decompress), which gives non-finite values; {action}",
                    file=str(part.file),
                    tensor=part.name,
                )
    total, first, kind = _scan(info)
    if total == 0 and only_if_found:
        return
    raise BadInputError(f"{what} {_count(total, kind, first, info)}; {action}", file=str(info.file), tensor=info.name)


def _scan(info: TensorInfo) -> tuple[int, tuple[int, int] | None, str]:
    """The number of NaN/inf values of ``info``, the (row, column) of the first, and what they are: ``NaN`` where
    there is one, else ``inf``, ``-inf`` or ``±inf``."""
    total, first, seen = 0, None, set()
    for r0, w in iter_row_chunks(info):
        w = w.float().reshape(w.shape[0] if w.dim() else 1, -1)  # E4M3 NaN -> NaN; 0-D and 1-D as rows
        bad = ~torch.isfinite(w)
        cnt = int(bad.sum())
        if cnt:
            if first is None:
                idx = bad.nonzero()[0].tolist()
                first = (r0 + idx[0], idx[1])
            seen.update(k for k, m in (("NaN", torch.isnan(w)), ("inf", w == float("inf")), ("-inf", w == float("-inf"))) if bool(m.any()))
            total += cnt
    kind = "NaN" if "NaN" in seen else "±inf" if {"inf", "-inf"} <= seen else "-inf" if "-inf" in seen else "inf"
    return total, first, kind


def _count(total: int, kind: str, first, info: TensorInfo) -> str:
    """``holds N non-finite values (KIND; first at WHERE)``: WHERE an element (1-D), a row and column (2-D), or a full
    index ``[i, j, k]`` (3-D and more: ``first``'s column is flat over the trailing dimensions, as :func:`_scan` reads them)."""
    if first is None:
        where = "nowhere"
    elif len(info.shape) <= 1:
        where = f"element {first[0]}"
    elif len(info.shape) == 2:
        where = f"row {first[0]}, column {first[1]}"
    else:
        rest, col = [], first[1]
        for n in reversed(info.shape[1:]):
            rest.append(col % n)
            col //= n
        where = f"index [{', '.join(map(str, [first[0], *reversed(rest)]))}]"
    return f"holds {total} non-finite value{'' if total == 1 else 's'} ({kind}; first at {where})"
