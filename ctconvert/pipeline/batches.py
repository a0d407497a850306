"""A batch of small units quantized together: the device work of a ``batch`` read (:func:`.reads.unit_order`).

A MoE checkpoint holds thousands of expert tensors of a few MiB; one at a time, each pays the executor's
per-tensor work (a host-to-device copy and its event, an absmax, a NaN/inf flag, NVFP4's global scale, the
zero-row scan, a staging copy and its event), which on an H200 took more time than the quantize kernels
themselves. A batch is ``B`` units of ``M`` members of one shape ``[R, K]`` and dtype, read into one buffer
(member after member, unit after unit; for fused 3-D experts, each unit's region of the fused tensor, whose members
are gathered for the whole batch at once: :func:`batch_values`): here one absmax reduction gives every member's absmax, the scales
of every unit come from one elementwise computation on those vectors, and the outputs of every member are
stacked per output name, so that the executor stages and checks the batch once.

The bytes are the same as each unit's alone: a member is quantized by the same ``Scheme.quantize_rows`` call,
with the same global scale or per-tensor scale (:func:`~ctconvert.formats.fp4.nvfp4_global_scale` and
:func:`~ctconvert.pipeline.scales.fp8_tensor_scale` are elementwise, so a vector of absmaxes gives each unit's
scale bit for bit), and an absmax is exact whatever the reduction's shape (a maximum of stored values).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..checkpoint.safetensors_io import TensorInfo, read_span, region_bytes
from ..checkpoint.transpose import transposed
from ..plan.planner import WorkUnit
from .nonfinite import raise_nonfinite
from .scales import fp8_tensor_scale, per_tensor_scale
from .zeros import stacked_candidates

__all__ = [
    "BatchError",
    "BatchResult",
    "batch_infos",
    "batch_nbytes",
    "batch_values",
    "one_launch",
    "quantize_batch",
    "raise_first_nonfinite",
    "read_batch",
    "warm_batch",
]


class BatchError(Exception):
    """A member's quantizer raised ``ValueError``: ``unit`` (index into the batch), ``member``, ``error``, and the
    batch's members' absmax ``amax`` (for :func:`raise_first_nonfinite`: a NaN/inf explains a failure first)."""

    def __init__(self, unit: int, member: int, error: ValueError, amax: torch.Tensor):
        super().__init__(str(error))
        self.unit, self.member, self.error, self.amax = unit, member, error, amax


def raise_first_nonfinite(infos: list[list[TensorInfo]], amax: torch.Tensor) -> None:
    """Raise :class:`~ctconvert.errors.BadInputError` for the first member (unit after unit) whose absmax in
    ``amax`` (fp32 ``[B * M]``) is NaN/inf, naming it (:func:`~.nonfinite.raise_nonfinite`); nothing if all are finite."""
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        j, m = int(bad.nonzero()[0]), len(infos[0])
        raise_nonfinite(infos[j // m][j % m])


@dataclass
class BatchResult:
    """The outputs of a batch of ``B`` units of ``M`` members, member ``j = b * M + m`` (unit ``b``'s member ``m``).

    ``amax``: fp32 ``[B * M]``, each member's absmax (NaN/inf where the member holds one: the NaN/inf flags);
    ``prefixes``: each member's module name and a dot; ``outputs``: output name (``weight_packed``, ``weight_scale``,
    ``weight_global_scale`` ...) -> the ``B * M`` members' tensors stacked ``[B * M, *shape]`` (on the batch's
    device, or on the CPU for a format's host-made outputs such as ``weight_shape``); ``global_scales``: each
    member's NVFP4 global scale ``[1]`` (its unit's; None for other schemes); ``scales``: the stacked
    ``weight_scale`` the quantizer returned (what the zero-row scan reads; None where it returned none);
    ``set_amax``: each member's unit's absmax ``[1]`` that its global scale came from (None for other schemes);
    ``unit_scales`` and ``unit_amax``: the same per unit, fp32 ``[B]`` (None for other schemes)."""

    amax: torch.Tensor
    prefixes: list[str]
    outputs: dict[str, torch.Tensor]
    global_scales: list = None
    scales: torch.Tensor | None = None
    set_amax: list = None
    unit_scales: torch.Tensor | None = None
    unit_amax: torch.Tensor | None = None

    def writes(self) -> list[tuple[str, list[str], torch.Tensor]]:
        """``(output name, the members' tensor names, the stacked tensor)`` per output name."""
        return [(key, [p + key for p in self.prefixes], t) for key, t in self.outputs.items()]


def batch_infos(tensors: dict, units: list[WorkUnit]) -> list[list[TensorInfo]]:
    """Each unit's members' :class:`TensorInfo` (``tensors``: the checkpoint's, by name)."""
    return [[tensors[s] for s in unit.sources] for unit in units]


def batch_nbytes(infos: list[list[TensorInfo]]) -> int:
    """The bytes :func:`read_batch` reads: each member's, or each unit's region where its members are views of one."""
    if infos[0][0].view is not None:
        return len(infos) * region_bytes(infos[0][0])
    return sum(i.nbytes for unit in infos for i in unit)


def read_batch(infos: list[list[TensorInfo]], out: torch.Tensor) -> torch.Tensor:
    """Read a batch's bytes, unit after unit, into ``out`` (uint8, contiguous, at least :func:`batch_nbytes`; pinned on
    a GPU) and return that prefix of it: every member's bytes, or, where the members are views of fused 3-D experts
    (:class:`~ctconvert.checkpoint.safetensors_io.SliceView`), each unit's region once (gpt-oss's gate and up are
    columns of one). Pieces that lie back to back in one file are read by one ``preadv``. Raises
    :class:`~ctconvert.errors.BadInputError` on a short read (naming the run's first tensor)."""
    if infos[0][0].view is not None:
        flat, n = [unit[0] for unit in infos], region_bytes(infos[0][0])
    else:
        flat, n = [info for unit in infos for info in unit], infos[0][0].nbytes
    j = 0
    while j < len(flat):
        k = j + 1
        while k < len(flat) and flat[k].file == flat[j].file and flat[k].start == flat[k - 1].start + n:
            k += 1
        read_span(flat[j], flat[j].start, (k - j) * n, out[j * n : k * n])
        j = k
    return out[: len(flat) * n]


def batch_values(infos: list[list[TensorInfo]], data: torch.Tensor) -> torch.Tensor:
    """The batch's values D ``[B, M, R, K]`` from the bytes :func:`read_batch` read (on any device; the members' own
    bytes are a view of them, views of fused experts are gathered: for each member index one strided copy of every
    unit's region, the values :func:`~ctconvert.checkpoint.safetensors_io.rows_of_region` gives each alone)."""
    first = infos[0][0]
    b, m = len(infos), len(infos[0])
    if first.view is None:
        return data.view(first.torch_dtype).reshape(b, m, *first.shape)
    v0 = first.view
    regions = data.view(first.torch_dtype).reshape(b, v0.rows, v0.cols)
    x = torch.empty((b, m, *first.shape), dtype=first.torch_dtype, device=data.device)
    for mm, info in enumerate(infos[0]):
        v = info.view
        a1 = v.offset + v.step * (first.shape[0] - 1) + 1
        if not v.transpose:
            x[:, mm] = regions[:, v.offset : a1 : v.step]
        elif data.device.type == "cpu":  # tiled, in C: a strided transposing copy runs at ~0.5 GB/s on a CPU
            for ub in range(b):
                transposed(regions[ub, :, v.offset : a1 : v.step], out=x[ub, mm])
        else:
            x[:, mm] = regions[:, :, v.offset : a1 : v.step].transpose(1, 2)
    return x


def quantize_batch(units: list[WorkUnit], infos: list[list[TensorInfo]], x: torch.Tensor, impl: str, check_now: bool) -> BatchResult:
    """Quantize ``B`` units at once. ``units``: the batch's units (one scheme); ``infos``: their members' tensors
    (``M`` each, one shape ``[R, K]`` and dtype D); ``x``: D ``[B, M, R, K]``, the members' values on the device
    that computes; ``impl``: the quantizer implementation (``WeightFormat.quantize``); ``check_now``: raise for
    a member holding NaN/inf here (the CPU; a GPU run reads :attr:`BatchResult.amax` behind an event instead).

    Raises :class:`~ctconvert.errors.BadInputError` (NaN/inf, ``check_now``), :class:`BatchError` (a
    quantizer's ``ValueError``)."""
    scheme = units[0].scheme
    b, m = x.shape[0], x.shape[1]
    flat = x.reshape(b * m, -1)
    amax = torch.linalg.vector_norm(flat, float("inf"), dim=1).to(torch.float32) if flat.shape[1] else torch.zeros(b * m, device=x.device)
    if check_now:
        raise_first_nonfinite(infos, amax)
    gs = ws = unit_amax = None
    if scheme.global_scale:
        from ..formats.fp4 import nvfp4_global_scale

        unit_amax = amax.reshape(b, m).amax(dim=1)
        gs = nvfp4_global_scale(unit_amax, x.dtype)  # [B]: each unit's set scale
    if per_tensor_scale(scheme):
        ws = fp8_tensor_scale(amax, x.dtype)  # [B * M]: each member's scale
    outputs = _one_call(scheme, x, gs, impl) if one_launch(scheme, x.shape[2]) else None
    if outputs is not None:
        quantized = set(outputs)
        per_key = {}
        for ub in range(b):
            for key, t in scheme.whole_tensor_outputs(tuple(x.shape[2:]), gs[ub : ub + 1] if gs is not None else None).items():
                per_key.setdefault(key, []).extend([t] * m)
    else:
        per_key, quantized = _member_calls(scheme, x, gs, ws, impl, amax)
    outputs = {**(outputs or {}), **{key: torch.stack(ts) for key, ts in per_key.items()}}
    prefixes = [unit.modules[mm] + "." for unit in units for mm in range(m)]
    per_member_gs = [gs[j // m : j // m + 1] if gs is not None else None for j in range(b * m)]
    per_member_amax = [unit_amax[j // m : j // m + 1] if unit_amax is not None else None for j in range(b * m)]
    scales = outputs["weight_scale"] if "weight_scale" in quantized else None
    return BatchResult(amax, prefixes, outputs, per_member_gs, scales, per_member_amax, gs, unit_amax)


def warm_batch(scheme, info: TensorInfo, rows: int, impl: str, device: torch.device) -> None:
    """A batch's device work done once on zeros (the warm-up of a GPU run: :mod:`.warm`), so that every kernel a batch
    of ``scheme`` members like ``info`` (its first member) launches is compiled and loaded before the first batch
    arrives: the gather of a fused expert's view (:func:`batch_values`), the absmax and scales, the quantizer's tall
    launch of ``rows`` rows (the whole batch's, so that its Triton specialisation is the batch's), the NaN/inf flag
    and the zero-row scan. Nothing is kept."""
    r, k = info.shape
    if info.view is not None:  # the gather of a fused expert's view
        batch_values([[info]], torch.zeros(region_bytes(info), dtype=torch.uint8, device=device))
    x = torch.zeros((rows // r, 1, r, k), dtype=info.torch_dtype, device=device)
    units = [WorkUnit("quantize", [info.name], ["warm-up"], scheme)] * (rows // r)
    res = quantize_batch(units, [[info]] * (rows // r), x, impl, check_now=False)
    torch.isfinite(res.amax).all()
    stacked_candidates(res.scales, scheme.weight_format, scheme.weights, info.torch_dtype, r)


def member_writes(rows: list[tuple[str, list[str], torch.Tensor]], staged: list[np.ndarray]) -> list[tuple[str, np.ndarray, int]]:
    """The writes ``(output name, bytes, 0)`` of a batch's outputs: ``rows`` as :meth:`BatchResult.writes` gives them
    (each output stacked over the members, names in member order), ``staged`` each one's bytes on the host (uint8
    arrays); each member's share is an equal slice of its output's bytes (a view). Raises ``ValueError`` where the
    bytes do not split evenly."""
    return [(name, part, 0) for (_, names, _), h in zip(rows, staged) for name, part in zip(names, np.split(h, len(names)))]


def one_launch(scheme, rows: int) -> bool:
    """Whether a batch of ``scheme`` members of ``rows`` rows each is quantized as one tall weight (:func:`_one_call`),
    not member by member: no per-tensor weight scale (each member's own), and members of whole row chunks (``rows`` a
    multiple of the format's ``row_align``). (A quantizer's ``ValueError`` also sends a batch member by member.)"""
    return not per_tensor_scale(scheme) and rows % scheme.row_align == 0


def _one_call(scheme, x: torch.Tensor, gs: torch.Tensor | None, impl: str) -> dict[str, torch.Tensor] | None:
    """The batch ``x`` ``[B, M, R, K]`` quantized as one tall ``[B * M * R, K]`` weight: the quantizer's outputs
    as ``[B * M, ...]``, each member's the bits it gets alone (a format's rows are quantized independently in
    chunks starting at multiples of its ``row_align``, which R is; NVFP4 takes one global scale per row, its
    unit's). None where the members must be quantized one by one: a quantizer's ``ValueError`` (then each
    member's call says which one), or an output whose rows do not divide into the members."""
    n = x.shape[0] * x.shape[1]
    g = None if gs is None else gs.repeat_interleave(x.shape[1] * x.shape[2]).reshape(-1, 1)
    try:
        out = scheme.quantize_rows(x.reshape(n * x.shape[2], x.shape[3]), g, impl=impl)
    except ValueError:
        return None
    if any(t.dim() == 0 or t.shape[0] % n for t in out.values()):
        return None
    return {key: t.reshape(n, t.shape[0] // n, *t.shape[1:]) for key, t in out.items()}


def _member_calls(scheme, x: torch.Tensor, gs, ws, impl: str, amax: torch.Tensor) -> tuple[dict[str, list], set]:
    """Each member of ``x`` ``[B, M, R, K]`` quantized alone (its unit's global scale ``gs[b]``, its per-tensor
    ``ws[j]``): ``(output name -> the members' tensors, the names the quantizer returned)``. Raises
    :class:`BatchError` for a quantizer's ``ValueError``."""
    b, m = x.shape[0], x.shape[1]
    per_key: dict[str, list[torch.Tensor]] = {}
    quantized: set = set()
    for ub in range(b):
        g = gs[ub : ub + 1] if gs is not None else None
        for mm in range(m):
            j = ub * m + mm
            wsj = ws[j : j + 1] if ws is not None else None
            try:
                out = scheme.quantize_rows(x[ub, mm], g, impl=impl, weight_scale=wsj)
            except ValueError as e:
                raise BatchError(ub, mm, e, amax) from e
            quantized.update(out)
            out.update(scheme.whole_tensor_outputs(tuple(x.shape[2:]), g))
            if wsj is not None:
                out["weight_scale"] = wsj
            for key, t in out.items():
                per_key.setdefault(key, []).append(t)
    return per_key, quantized
