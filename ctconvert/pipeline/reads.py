"""The reads of a conversion, in the executor's order: what is read, in which row chunks and passes.

A copied tensor is read in byte ranges of :data:`COPY_CHUNK_BYTES`; a quantized unit's members in row chunks of
about ``chunk_elems`` elements (:func:`chunk_rows`), once, or twice where the unit's scales need an absmax pass
over the whole set first and the set is larger than ``hold_bytes`` (:mod:`.scales`). The executor
(:mod:`.executor`) hands these reads to its reader threads in this order.

On a GPU, small units of one shape (a MoE's experts: Qwen3-30B-A3B has 6,144 expert tensors of 3 MiB per 48
layers) are read and quantized together, a *batch* of up to :data:`BATCH_BYTES` gathered from
:data:`BATCH_WINDOW` consecutive units (:func:`batch_key`; the work is :mod:`.batches`): one host-to-device
copy, one absmax, one NaN/inf flag, one quantize launch and one staging copy per batch instead of per tensor. The bytes written are
the same: each member is quantized by the same call with the same scales as alone.

Small copied tensors (up to :data:`SMALL_COPY_BYTES`: gpt-oss has three bias vectors per expert, 3,072 per 8 layers)
are read together, on any device, in *copies* reads of up to :data:`SMALL_COPIES` tensors or
:data:`SMALL_COPIES_BYTES`, from at most :data:`BATCH_WINDOW` consecutive units and :data:`SMALL_COPIES_SPAN` bytes of
the plan (so that an output shard, a run of consecutive tensors, still finishes soon after its last one is read, as
``--resume`` needs): one read, one NaN/inf scan per tensor, one queued write; alone, each paid the executor's
round trip (a future, a queue item, a writer's wake-up), which held an H100's gpt-oss NVFP4A16 run at 2.15x its I/O
floor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import TensorInfo
from ..options import DEFAULT_CHUNK_ELEMS
from ..plan.planner import Plan, WorkUnit
from .batches import one_launch
from .scales import needs_absmax_pass, observer_of

__all__ = [
    "BATCH_BYTES",
    "COPY_CHUNK_BYTES",
    "Read",
    "SMALL_COPY_BYTES",
    "batch_key",
    "batching",
    "chunk_rows",
    "make_reads",
    "split_units",
    "unit_bytes",
    "unit_order",
    "warm_up_batches",
    "warm_up_shapes",
]

COPY_CHUNK_BYTES = 64 * 2**20
MAPPED_COPY_CHUNK_BYTES = 4 * 2**20  # CPU, mapped input: a view of the page cache; ~10 wait in the queues (RSS)
#: source bytes of one batch of small units (.batches), at most. Each reader buffer of the pool is pinned at that size
#: when first needed, and pinning host memory stalls the device's copies meanwhile (an H100: 2.6 GiB/s pinned; twenty
#: 128 MiB host-to-device copies took 0.29 s beside it, 0.05 s alone): with 32 MiB instead of 128 MiB Qwen3-MoE's
#: NVFP4A16 call took 2.27 s instead of 2.51 s, gpt-oss's 2.66 s instead of 2.75 s (64 MiB: 2.34 s; min of 3, the same
#: bytes; ``scripts/bench_batches.py --variants``), though ~4x as many batches launch
BATCH_BYTES = 32 * 2**20
BATCH_MEMBER_BYTES = 16 * 2**20  # a larger member is read and quantized alone (its launches are small against its bytes)
BATCH_WINDOW = 128  # consecutive units a batch is gathered from: reads stay near the plan's order (the read-ahead window)
BATCH_DTYPES = ("BF16", "F16", "F32")
SMALL_COPY_BYTES = 2**20  # a copied tensor up to this size is read with others (a "copies" read)
SMALL_COPIES = 512  # tensors of one "copies" read, at most
SMALL_COPIES_BYTES = 16 * 2**20  # bytes of one "copies" read, at most
SMALL_COPIES_SPAN = 256 * 2**20  # source bytes of the plan a "copies" read's tensors come from, at most


@dataclass
class Read:
    """One read: a byte range of a copied tensor, or a row range of a quantized member."""

    unit: int
    kind: str  # copy | amax | quant | batch | copies
    member: int = 0
    start: int = 0  # byte offset (copy) or first row
    stop: int = 0
    hold: bool = False  # keep the chunk until the set's global scale is known
    end_of_pass: bool = False  # last job of an amax pass / of a unit
    units: tuple[int, ...] = ()  # kinds "batch" and "copies": the units read together (``unit`` is the first)


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
    (``device``, ``map_input``, ``chunk_elems``, ``hold_bytes``, ``batch`` and the observers are read). Small copied
    tensors are gathered into "copies" reads (:data:`SMALL_COPY_BYTES`) from at most :data:`BATCH_WINDOW` consecutive
    units and :data:`SMALL_COPIES_SPAN` bytes of the plan, each yielded where it fills or where the plan moved past
    either, the last at the end."""
    small: list[int] = []
    small_bytes = 0
    done = 0  # source bytes of the units met so far
    small_from = 0  # ``done`` when the pending "copies" read took its first tensor
    for ui in unit_order(ckpt, plan, opts):
        first = ui[0] if isinstance(ui, tuple) else ui
        if small and (first - small[0] >= BATCH_WINDOW or done - small_from >= SMALL_COPIES_SPAN):  # near the plan's order
            yield Read(small[0], "copies", units=tuple(small), end_of_pass=True)
            small, small_bytes = [], 0
        if isinstance(ui, tuple):
            done += sum(unit_bytes(ckpt, plan.units[u]) for u in ui)
            yield Read(ui[0], "batch", units=ui, end_of_pass=True)
            continue
        unit = plan.units[ui]
        n = unit_bytes(ckpt, unit)
        if unit.kind == "copy" and 0 < n <= SMALL_COPY_BYTES:
            if not small:
                small_from = done
            small.append(ui)
            small_bytes += n
            done += n
            if len(small) >= SMALL_COPIES or small_bytes >= SMALL_COPIES_BYTES:
                yield Read(small[0], "copies", units=tuple(small), end_of_pass=True)
                small, small_bytes = [], 0
            continue
        done += n
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
    if small:
        yield Read(small[0], "copies", units=tuple(small), end_of_pass=True)


def batching(opts) -> bool:
    """Whether a run with executor options ``opts`` batches small units: ``opts.batch`` (None: on a GPU), for a
    data-free run written as compressed-tensors (no calibrated tensors, no kernel layout)."""
    on = opts.device.type == "cuda" if opts.batch is None else opts.batch
    return bool(on) and opts.repack is None and isinstance(opts.calibrated, dict) and not opts.calibrated


def batch_key(ckpt: Checkpoint, unit: WorkUnit, opts) -> tuple | None:
    """What units batched together share (their scheme, members' shapes, dtypes and views), or None where ``unit`` is
    read alone: a copy, an observer's unit, a member that is not a stored 2-D float tensor (a weight dequantized from
    stored tensors) or larger than :data:`BATCH_MEMBER_BYTES`, or read in more than one chunk; members of one shape (a
    fused set of another shape is read alone); members that are views of fused 3-D experts (:class:`SliceView`) all
    views of one expert's region (gpt-oss's interleaved gate and up), or none (their batched gather and CUDA tests ran on
    an H100, 2026-12-06: the same bytes as each unit alone, gpt-oss NVFP4A16 call 8.32 -> 6.60 s)."""
    if unit.kind == "copy" or observer_of(opts, unit) is not None:
        return None
    infos = [ckpt.tensors[s] for s in unit.sources]
    first = infos[0]
    for info in infos:
        if info.virtual is not None or info.dtype not in BATCH_DTYPES or len(info.shape) != 2:
            return None
        if info.shape != first.shape or info.dtype != first.dtype or not 0 < info.nbytes <= BATCH_MEMBER_BYTES:
            return None
        if info.view is None and chunk_rows(info, unit, opts.chunk_elems) < info.shape[0]:
            return None
    views = [i.view for i in infos]
    if any(v is not None for v in views):  # fused experts' views: every member a view of one region (gpt-oss's gate/up)
        if any(v is None for v in views) or len({(i.file, i.start) for i in infos}) != 1 or len({(v.rows, v.cols) for v in views}) != 1:
            return None
    return (id(unit.scheme), len(infos), tuple(first.shape), first.dtype, tuple(views))


def unit_order(ckpt: Checkpoint, plan: Plan, opts):
    """The plan's unit indices in read order: an int for a unit read alone, a tuple for a batch (:func:`batch_key`;
    units of one key within :data:`BATCH_WINDOW` consecutive units, up to :data:`BATCH_BYTES`), each batch where its
    last unit joined it, where the next unit of its key would take it past :data:`BATCH_BYTES`, or where the window
    moved past its first. Within the limit, a batch's pinned read buffer is one block of torch's caching host
    allocator of that size (it rounds a request up to a power of two: batches that ended one unit past 128 MiB took
    256 MiB blocks, 2.5 GB for the pool's ten buffers)."""
    if not batching(opts):
        yield from range(len(plan.units))
        return
    open_: dict[tuple, list[int]] = {}  # key -> units, in the order the batches opened
    size: dict[tuple, int] = {}

    def done(key):
        units = open_.pop(key)
        size.pop(key)
        return tuple(units) if len(units) > 1 else units[0]

    for ui, unit in enumerate(plan.units):
        key = batch_key(ckpt, unit, opts)
        for k in [k for k, us in open_.items() if key is None or ui - us[0] >= BATCH_WINDOW]:
            yield done(k)
        if key is None:
            yield ui
            continue
        n = unit_bytes(ckpt, unit)
        if key in open_ and size[key] + n > BATCH_BYTES:  # a batch stays within BATCH_BYTES (a pinned block of that size)
            yield done(key)
        open_.setdefault(key, []).append(ui)
        size[key] = size.get(key, 0) + n
        if size[key] >= BATCH_BYTES:
            yield done(key)
    for k in list(open_):
        yield done(k)


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


def warm_up_batches(ckpt: Checkpoint, plan: Plan, opts, limit: int = 8) -> list:
    """The first batch of each batch key of a run with executor options ``opts`` (:func:`unit_order`), in read order:
    ``[(scheme, TensorInfo of its first member, rows of the whole batch)]``, at most ``limit``; empty where the run
    does not batch. A batch is quantized as one tall weight of that many rows (:mod:`.batches`), a launch whose
    kernel the whole tensors' shapes need not compile (a Triton kernel is compiled per ``constexpr``, such as
    whether its programs loop over tiles, which depends on the rows: on an H100 the first Qwen3-MoE batch waited
    0.55 s for it with a warm kernel cache, 2.2 s with a cold one). A key whose members are quantized one by one (a
    per-tensor weight scale, or rows that are not a multiple of the format's ``row_align``) has no tall launch to
    compile and is left out, as are keys first met more than ``2 * BATCH_WINDOW`` units after the last new one (a
    thousand-layer MoE is not read through for them)."""
    if not batching(opts):
        return []
    seen, jobs, last_new = set(), [], None
    for ui in unit_order(ckpt, plan, opts):
        if not isinstance(ui, tuple):
            continue
        if last_new is not None and ui[0] - last_new > 2 * BATCH_WINDOW:  # no new key for a while (a MoE's layers repeat)
            break
        unit = plan.units[ui[0]]
        key = batch_key(ckpt, unit, opts)
        if key in seen:
            continue
        seen.add(key)
        last_new = ui[0]
        info = ckpt.tensors[unit.sources[0]]
        if not one_launch(unit.scheme, info.shape[0]):
            continue  # its members are quantized one by one (batches.quantize_batch): the tensors' own launches
        jobs.append((unit.scheme, info, len(ui) * len(unit.sources) * info.shape[0]))
        if len(jobs) >= limit:
            break
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
