"""The reads of a conversion, in the executor's order: what is read, in which row chunks and passes.

A copied tensor is read in byte ranges of :data:`COPY_CHUNK_BYTES`; a quantized unit's members in row chunks of
about ``chunk_elems`` elements (:func:`chunk_rows`), once, or twice where the unit's scales need an absmax pass
over the whole set first and the set is larger than ``hold_bytes`` (:mod:`.scales`). The executor
(:mod:`.executor`) hands these reads to its reader threads in this order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import TensorInfo
from ..options import DEFAULT_CHUNK_ELEMS
from ..plan.planner import Plan, WorkUnit
from .scales import needs_absmax_pass, observer_of

__all__ = ["COPY_CHUNK_BYTES", "Read", "chunk_rows", "make_reads", "split_units", "unit_bytes", "warm_up_shapes"]

COPY_CHUNK_BYTES = 64 * 2**20
MAPPED_COPY_CHUNK_BYTES = 4 * 2**20  # CPU, mapped input: a view of the page cache; ~10 wait in the queues (RSS)


@dataclass
class Read:
    """One read: a byte range of a copied tensor, or a row range of a quantized member."""

    unit: int
    kind: str  # copy | amax | quant
    member: int = 0
    start: int = 0  # byte offset (copy) or first row
    stop: int = 0
    hold: bool = False  # keep the chunk until the set's global scale is known
    end_of_pass: bool = False  # last job of an amax pass / of a unit


def chunk_rows(info: TensorInfo, unit: WorkUnit, chunk_elems: int) -> int:
    """Rows per chunk of a quantized member: the unit's own ``chunk_rows`` or ``chunk_elems // K``, a multiple of the
    scheme's row alignment; a transposed expert (whose every chunk reads its whole region) in one chunk."""
    align = unit.scheme.row_align
    if info.view is not None and info.view.transpose:  # every chunk of a transposed expert reads its whole region: one chunk
        return max(align, -(-info.shape[0] // align) * align)
    rows = unit.chunk_rows or max(1, chunk_elems // max(1, info.shape[1]))
    return max(align, rows // align * align)


def make_reads(ckpt: Checkpoint, plan: Plan, opts):
    """The reads of the whole conversion, in order. ``opts``: the run's :class:`.executor.ExecOptions`
    (``device``, ``map_input``, ``chunk_elems``, ``hold_bytes`` and the observers are read)."""
    for ui, unit in enumerate(plan.units):
        if unit.kind == "copy":
            info = ckpt.tensors[unit.sources[0]]
            step = MAPPED_COPY_CHUNK_BYTES if opts.device.type == "cpu" and opts.map_input else COPY_CHUNK_BYTES
            for b0 in range(0, info.nbytes, step):
                yield Read(ui, "copy", 0, b0, min(info.nbytes, b0 + step))
            if info.nbytes == 0:
                yield Read(ui, "copy", 0, 0, 0)
            continue
        infos = [ckpt.tensors[s] for s in unit.sources]
        chunks = [
            (m, r0, min(r0 + step, info.shape[0]))
            for m, info in enumerate(infos)
            for step in [chunk_rows(info, unit, opts.chunk_elems)]
            for r0 in range(0, info.shape[0], step)
        ]
        if needs_absmax_pass(unit.scheme, observer_of(opts, unit)):
            hold = sum(i.nbytes for i in infos) <= opts.hold_bytes
            for j, (m, r0, r1) in enumerate(chunks):
                yield Read(ui, "amax", m, r0, r1, hold=hold, end_of_pass=j == len(chunks) - 1)
            if hold:
                continue
        for j, (m, r0, r1) in enumerate(chunks):
            yield Read(ui, "quant", m, r0, r1, end_of_pass=j == len(chunks) - 1)


def warm_up_shapes(ckpt: Checkpoint, plan: Plan, chunk_elems: int = DEFAULT_CHUNK_ELEMS, limit: int = 32) -> list:
    """The distinct first-chunk shapes of the plan's quantized tensors, in plan order: ``[(scheme, TensorInfo,
    rows)]``, one per (scheme, dtype, K, chunk rows), at most ``limit`` (what :meth:`.executor.Executor._warm_up` compiles)."""
    seen, jobs = set(), []
    for unit in plan.units:
        if unit.kind == "copy":
            continue
        for name in unit.sources:
            info = ckpt.tensors[name]
            if len(info.shape) != 2 or not info.shape[0]:
                continue
            rows = min(chunk_rows(info, unit, chunk_elems), info.shape[0])
            key = (id(unit.scheme), info.dtype, info.shape[1], rows)
            if key not in seen and len(jobs) < limit:
                seen.add(key)
                jobs.append((unit.scheme, info, rows))
    return jobs


def unit_bytes(ckpt: Checkpoint, unit: WorkUnit) -> int:
    """The source bytes a unit reads (its members' logical bytes)."""
    return sum(ckpt.tensors[s].nbytes for s in unit.sources)


def split_units(ckpt: Checkpoint, units: list[WorkUnit], parts: int) -> list[list[WorkUnit]]:
    """Deal units (fused sets, tensors) to ``parts`` workers, largest first, to the least loaded."""
    load = [0] * parts
    out: list[list[WorkUnit]] = [[] for _ in range(parts)]
    for u in sorted(units, key=lambda u: -unit_bytes(ckpt, u)):
        i = load.index(min(load))
        out[i].append(u)
        load[i] += unit_bytes(ckpt, u)
    order = {id(u): k for k, u in enumerate(units)}
    return [sorted(p, key=lambda u: order[id(u)]) for p in out]
