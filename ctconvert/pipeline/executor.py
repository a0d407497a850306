"""The streaming executor: read -> quantize -> write, one row chunk at a time.

Memory is bounded by a few row chunks, never by a tensor or a shard: inputs are
read by row range, and every output tensor is written at its final offset in
its shard as soon as a chunk is done. The threads of one :class:`Executor`:

* a dispatcher (``ctconvert-reader``) walks :func:`make_reads` and hands each
  :class:`Read` to a pool of reader threads (``ctconvert-read-*``;
  :data:`READERS`), putting their futures into a bounded queue in plan order
  (:data:`READ_AHEAD`). A reader fills a pinned host buffer on a GPU (reused
  once its host-to-device copy is done), maps the rows on the CPU (and reads
  their pages in, so that a cold page cache holds the reader, not this
  thread), and scans copied chunks for NaN/inf; the reads of a plan, in order,
  are :mod:`.reads`;
* a read-ahead thread (``ctconvert-readahead``; :mod:`.readahead`) asks the
  kernel to read the input a window (:attr:`ExecOptions.read_ahead` bytes)
  ahead of the readers into the page cache, so that with a cold cache the disk
  reads on while chunks compute and the writers write;
* the computing thread (the caller's) takes the futures in order and runs
  ``_handle``: host-to-device copy, absmax, quantize (and repack) on the device's
  stream; on a GPU the outputs go to a pinned staging buffer on the stream and on
  with a CUDA event, never synchronised here;
* writer threads (``ctconvert-writer-*``; :data:`WRITERS`) take the writes from
  one queue (bounded on a GPU by bytes, :data:`WRITE_BUDGET`, so that a module's
  outputs never hold the computing thread; on the CPU by items), the next free
  writer the next write (a large tensor's chunks in parallel, no write behind a
  slow one): wait for the staging copy's event, write the pieces into their shard
  (neighbours in the file by one ``pwritev``), which hashes them as they come and
  hands dirty pages to the disk (:class:`~ctconvert.checkpoint.shard_file.ShardFile`).

So reading, host-device copies, device work and writing overlap, and the
computing thread's work per chunk does not depend on the model's size.
Provenance hashes of the sources are computed beside the executor, by the
caller (:class:`~ctconvert.checkpoint.hashing.SourceHashes`), not here.

NVFP4 needs one absmax over each fused set before any member is quantized
(docs/compressed-tensors-format.md §9.1), the FP8 preset one per tensor
(:mod:`.scales`): a set of up to ``hold_bytes`` is read once and held (on the
device) until its scales are known; a larger set is read twice (absmax pass,
then quantize pass). Calibrated tensors (:attr:`ExecOptions.calibrated`) are
written with their module. A weight observer (:attr:`ExecOptions.observer`) searches
each chunk's ranges, in the same pass where the chunk alone decides them, else in
the absmax pass (its pre-pass: :mod:`.scales`).

With a kernel-native target (``quantize --target``) each module's finished tensors go through
:attr:`ExecOptions.repack` on the device before they are written. This package is the only place that
knows about devices, threads and progress.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import REGIONS, TensorInfo, map_bytes, map_rows, read_bytes, read_region, read_rows, region_bytes, rows_of_region
from ..checkpoint.shard_file import ShardFile, host_bytes
from ..errors import BadInputError
from ..formats import native
from ..formats.common import tensor_absmax
from ..formats.mx import GroupOverflow
from ..options import DEFAULT_CHUNK_ELEMS, DEFAULT_HOLD_BYTES
from ..plan.planner import Plan, WorkUnit
from .batches import BatchError, batch_infos, batch_nbytes, batch_values, member_writes, quantize_batch, raise_first_nonfinite, read_batch
from .buffers import ByteBudget, PinnedPool
from .calibrated import CalibratedWrites
from .casting import cast_chunk
from .graphs import BatchGraphs, graphs_default
from .nonfinite import DeviceFlags, copy_nonfinite, raise_nonfinite, read_copies
from .readahead import READ_AHEAD_BYTES, WindowReadAhead, unit_pieces
from .reads import COPY_CHUNK_BYTES, Read, make_reads, split_units, unit_bytes, warm_up_shapes
from .scales import UnitScales, needs_absmax_pass, observer_of
from .stored import StoredRows, on_device, read_stored
from .warm import WarmUp

__all__ = [
    "COPY_CHUNK_BYTES",
    "DEFAULT_CHUNK_ELEMS",
    "DEFAULT_HOLD_BYTES",
    "ExecOptions",
    "Read",
    "make_reads",
    "split_units",
    "unit_bytes",
    "warm_up_shapes",
]

READ_AHEAD = 4  # chunks read ahead of the one being computed
WRITE_BEHIND = 2  # CPU: writes queued per writer thread, all in one queue (a copy chunk is 64 MiB)
WRITE_BUDGET = 192 * 2**20  # GPU: bytes queued for the writers, all writers together (buffers.ByteBudget)
READERS = {"cuda": 4, "cpu": 2}  # reader threads (preadv releases the GIL; CPU runs that map the input use 1 unless sources need work)
WRITERS = {"cuda": 4, "cpu": 2}  # writer threads, taking from one queue (a large tensor's chunks in parallel)


def map_input_default() -> bool:
    """Whether CPU runs map the input files (chunks are views of the page cache, not copies): yes, unless ``CTCONVERT_MMAP=0``."""
    return os.environ.get("CTCONVERT_MMAP", "1") != "0"


def batch_default() -> bool | None:
    """Whether runs batch small units (:mod:`.batches`): as ``CTCONVERT_BATCH=1``/``0`` says, else None (on a GPU)."""
    v = os.environ.get("CTCONVERT_BATCH", "")
    return None if v == "" else v != "0"


@dataclass
class ExecOptions:
    """How the executor runs. ``impl``: quantizer implementation (see ``WeightFormat.quantize``);
    ``map_input``: on the CPU, read row chunks as views of the mapped file; ``repack``: the
    kernel-layout step, ``(module, {part: whole tensor}) -> {part: tensor}``
    (:class:`ctconvert.stages.layout.LayoutStage`), or None to write compressed-tensors tensors;
    ``calibrated``: module -> {part: tensor}, the calibrated tensors (:class:`ctconvert.calibration.apply.Calibrated`),
    each written once with the unit whose outputs name it; a mapping whose ``get`` may wait for a module's layer
    (:class:`ctconvert.calibration.feed.CalibratedFeed`, calibration running beside the executor)."""

    device: torch.device
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    hold_bytes: int = DEFAULT_HOLD_BYTES
    progress: object | None = None  # anything with .update(nbytes)
    impl: str = "auto"
    repack: object | None = None
    map_input: bool = field(default_factory=map_input_default)
    allow_nonfinite: bool = False  # copy pass-through tensors that hold NaN/inf (listed in nonfinite) instead of refusing
    nonfinite: list = field(default_factory=list)  # pass-through tensors found holding NaN/inf (with allow_nonfinite)
    zeros: object | None = None  # a ctconvert.pipeline.zeros.ZeroTracker: rows quantized to all zeros from non-zero values
    calibrated: dict = field(default_factory=dict)  # module -> {part: tensor} (input scales, k_scale/v_scale)
    observer: object | None = None  # --observer other than minmax: a ctconvert.formats.observers.WeightObserver (scales.py)
    group_observers: dict = field(default_factory=dict)  # config group -> its WeightObserver other than minmax (wins over observer)
    read_ahead: int = READ_AHEAD_BYTES  # input bytes the kernel is asked to read ahead of the readers (pipeline/readahead.py; 0: none)
    batch: bool | None = field(default_factory=batch_default)  # quantize small units together (pipeline/batches.py); None: on a GPU
    computed: threading.Event | None = None  # set when a computing thread's loop ends (the write stage's provenance waits for it)
    warm: WarmUp | None = None  # begun ahead (the quantize stage's, while the output is opened): its device's executor adopts it


@dataclass
class _UnitState:
    cursors: dict = field(default_factory=dict)  # (member, key) -> byte offset
    scales: UnitScales = field(default_factory=UnitScales)  # the absmax pass (pipeline/scales.py)
    held: list = field(default_factory=list)
    checks: list = field(default_factory=list)  # device amax per chunk, checked at the end (GPU)
    parts: dict = field(default_factory=dict)  # with ExecOptions.repack: member -> {part: [chunks]}


class Executor:
    """Runs the jobs of a plan: a reader thread feeds a bounded queue; this thread computes and writes."""

    def __init__(self, ckpt: Checkpoint, plan: Plan, shards: dict[str, ShardFile], opts: ExecOptions):
        self.ckpt, self.plan, self.shards, self.opts = ckpt, plan, shards, opts
        self.dev = opts.device
        self.cuda = self.dev.type == "cuda"
        kind = "cuda" if self.cuda else "cpu"
        self.readers = 1 if not self.cuda and opts.map_input and not _sources_need_work(ckpt, plan) else READERS[kind]
        self.ahead = WindowReadAhead(unit_pieces(ckpt, plan.units), opts.read_ahead) if opts.read_ahead > 0 else None
        self.pool = PinnedPool(READ_AHEAD + self.readers + 2) if self.cuda else None
        self.budget = ByteBudget(WRITE_BUDGET) if self.cuda else None  # bytes queued for the writers
        self.stream = torch.cuda.Stream(self.dev) if self.cuda else None
        self.use_native = not self.cuda and opts.impl in ("auto", "native") and native.available()
        self.native_checks = opts.impl in ("auto", "native") and native.available()  # C scans of host bytes
        self.nwriters = WRITERS[kind]
        # one queue for all the writers: the next free writer takes the next write (the shards hash pieces in any order)
        self.wq: queue.Queue = queue.Queue(maxsize=0 if self.cuda else WRITE_BEHIND * self.nwriters)
        self.write_error: BaseException | None = None
        self.calibrated = CalibratedWrites(opts.calibrated, defer=opts.repack is None)  # written later when not known yet
        self.flags = DeviceFlags(ckpt.tensors, len(plan.units))  # GPU: the NaN/inf flags of each unit, read behind events
        self.warm: WarmUp | None = None  # GPU: the warm-up (what it launched, why it stopped early)
        self.graphs = BatchGraphs(self.dev, opts.impl, opts.zeros is not None, ready=self._warm_done) if self.cuda and graphs_default() else None

    # -- writing (threads of their own: output bytes go to disk while the next chunks compute) --
    def _writer(self) -> None:
        while True:
            item = self.wq.get()
            if item is None:
                return
            nbytes = item[2]
            if self.write_error is None:
                self._write_item(*item)
            item = None  # the staging buffer goes back to torch's pinned cache before the budget frees
            if self.budget is not None:
                self.budget.release(nbytes)

    def _write_item(self, writes: list, event, nbytes: int) -> None:
        try:
            if event is not None:
                event.synchronize()  # the device-to-host copies into the staging buffer are done
            by_shard: dict[ShardFile, list] = {}  # pieces of one shard written together (back to back: one pwritev)
            for w in writes:
                by_shard.setdefault(self.shards[w[0]], []).append(w)
            for shard, pieces in by_shard.items():
                shard.write_many(pieces)
        except BaseException as e:  # noqa: BLE001 - re-raised by the computing thread
            self.write_error = e

    def _write(self, name: str, t: torch.Tensor, pos: int = 0) -> None:
        """Queue one host tensor's bytes for ``name`` at byte ``pos``."""
        self._write_many([(name, t, pos)])

    def _write_many(self, writes: list, event=None, reserved: int | None = None) -> None:
        """Queue ``writes`` for the writers (the next free one writes them). On a GPU they count against the write
        budget: ``reserved`` bytes already taken by the caller, else the tensors' bytes, taken here (waiting)."""
        if self.write_error is not None:
            raise self.write_error
        nbytes = 0
        if self.budget is not None:
            nbytes = sum(t.nbytes for _, t, _ in writes) if reserved is None else reserved
            if reserved is None:
                self.budget.acquire(nbytes)
        self.wq.put((writes, event, nbytes))

    def _write_device(self, writes: list) -> None:
        """Write device tensors ``[(name, tensor, byte offset)]`` (a chunk's or a module's outputs): on a GPU they are
        copied into one pinned staging buffer on the stream and written by a writer thread once the copy is done,
        while this thread goes on (no synchronisation here); host tensors are queued as they are."""
        if not self.cuda:  # one queued item, as on a GPU: a chunk's tensors to one writer, the next chunk's to the next
            self._write_many([(name, t.cpu(), pos) for name, t, pos in writes])
            return
        staged, ev, reserved = self._stage([t for _, t, _ in writes])
        self._write_many([(name, h, pos) for (name, _, pos), h in zip(writes, staged)], ev, reserved=reserved)

    def _stage(self, tensors: list) -> tuple[list, object, int]:
        """GPU: copy ``tensors`` (device or host) into one pinned staging buffer on the stream, within the write budget:
        ``(their bytes as uint8 NumPy views of the buffer, the copies' event, the bytes reserved)``; no synchronisation here."""
        flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        sizes = [-(-t.numel() // 64) * 64 for t in flat]  # 64-byte aligned slices
        self.budget.acquire(sum(sizes))  # before the pinned buffer exists: memory stays within the budget
        buf = torch.empty(max(1, sum(sizes)), dtype=torch.uint8, pin_memory=True)
        staged, off, host = [], 0, buf.numpy()  # the writers get array views (host_bytes): no torch call a piece there
        for t, size in zip(flat, sizes):
            if t.numel():
                buf[off : off + t.numel()].copy_(t, non_blocking=True)
            staged.append(host[off : off + t.numel()])
            off += size
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return staged, ev, sum(sizes)  # the staged slices keep the buffer alive until written

    # -- reading ---------------------------------------------------------------
    def _read(self, job: Read):
        if job.kind == "batch":  # every member of the batch's units, into one buffer (pipeline/batches.py)
            infos = batch_infos(self.ckpt.tensors, [self.plan.units[u] for u in job.units])
            n = batch_nbytes(infos)
            buf = self.pool.get(n) if self.cuda else torch.empty(n, dtype=torch.uint8)
            read_batch(infos, buf)
            return buf  # the whole pooled buffer goes back to the pool, not the prefix read
        if job.kind == "copies":  # small copied tensors, whole: [(bytes, whether they hold NaN/inf)]; each span once
            infos = [self.ckpt.tensors[self.plan.units[u].sources[0]] for u in job.units]
            return [self._read_copy(i, 0, None) for i in infos] if not self.cuda and self.opts.map_input else read_copies(infos, self.native_checks)
        unit = self.plan.units[job.unit]
        info = self.ckpt.tensors[unit.sources[job.member]]
        if job.kind == "copy":  # (bytes, whether they hold NaN/inf)
            return self._read_copy(info, job.start, job.stop)
        if not self.cuda:
            if self.opts.map_input:
                return map_rows(info, job.start, job.stop)
            return read_rows(info, job.start, job.stop)
        if on_device(info):  # a quantized source's stored rows, dequantized on the device (pipeline/stored.py)
            return read_stored(info, job.start, job.stop, self.pool)
        if info.view is not None and info.view.transpose:  # the whole region, transposed on the device (_to_device)
            return read_region(info, out=self.pool.get(region_bytes(info)))
        row_bytes = info.nbytes // info.shape[0]
        n = (job.stop - job.start) * row_bytes
        buf = self.pool.get(n)
        read_bytes(info, job.start * row_bytes, n, out=buf)
        return buf

    def _read_copy(self, info: TensorInfo, start: int, stop: int | None) -> tuple[torch.Tensor, bool]:
        """Bytes ``[start, stop)`` of a copied tensor (``stop`` None: to its end) and whether they hold NaN/inf."""
        n = (info.nbytes if stop is None else stop) - start
        data = (map_bytes if not self.cuda and self.opts.map_input else read_bytes)(info, start, n)
        return data, copy_nonfinite(info, data, self.native_checks)

    def _reader(self, jobs, q: queue.Queue, stop: threading.Event):
        """Hand the reads, in order, to ``self.readers`` reader threads; the queue gets their futures in order
        (bounded: at most READ_AHEAD chunks wait for the computing thread)."""
        ex = ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="ctconvert-read")
        try:
            for job in jobs:
                if stop.is_set():
                    return
                if self.ahead is not None:
                    self.ahead.reached(job.unit)
                q.put((job, ex.submit(self._read, job)))
            q.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)
        finally:
            ex.shutdown(wait=True, cancel_futures=stop.is_set())  # a finished loop leaves its last reads running

    # -- computing ---------------------------------------------------------------
    def _warm_up(self) -> threading.Thread | None:
        """GPU: the run's kernels launched once on a thread of their own while the first units are read (:mod:`.warm`)."""
        if not self.cuda or self.opts.impl == "torch":
            return None
        self.warm = WarmUp.adopt_or_start(self.opts.warm, self.ckpt, self.plan, self.opts, self.dev)
        return self.warm.thread

    def _warm_done(self) -> bool:
        return self.warm is None or self.warm.done

    def run(self) -> None:
        """Run the plan (the threads of the module docstring); the page-cache read-ahead and the region cache of fused
        experts (:data:`~ctconvert.checkpoint.safetensors_io.REGIONS`) live as long as the run."""
        with REGIONS.active(), contextlib.closing(self.ahead.start()) if self.ahead is not None else contextlib.nullcontext():
            self._run()

    def _run(self) -> None:
        warm = self._warm_up()
        q: queue.Queue = queue.Queue(maxsize=READ_AHEAD)
        stop = threading.Event()
        t = threading.Thread(target=self._reader, args=(make_reads(self.ckpt, self.plan, self.opts), q, stop), daemon=True, name="ctconvert-reader")
        t.start()
        writers = [threading.Thread(target=self._writer, daemon=True, name=f"ctconvert-writer-{i}") for i in range(self.nwriters)]
        for wt in writers:
            wt.start()
        states: dict[int, _UnitState] = {}
        try:
            with torch.inference_mode(), torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                while True:
                    item = q.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    job, fut = item
                    data = fut.result()
                    st = None
                    if job.kind in ("amax", "quant"):  # a unit's state lives from its first read to its last
                        st = states.get(job.unit) or states.setdefault(
                            job.unit, _UnitState(scales=UnitScales(observer_of(self.opts, self.plan.units[job.unit])))
                        )
                    self._handle(job, data, st)
                    if job.end_of_pass and job.kind == "quant":
                        states.pop(job.unit, None)
                    if self.calibrated.pending:
                        self.calibrated.flush(self._write, wait=False)
                self.calibrated.flush(self._write, wait=True)
        finally:
            if self.opts.computed is not None:  # (a failed run too: nothing waits on it for ever)
                self.opts.computed.set()
            stop.set()
            for p in (self.pool, self.budget):
                if p is not None:
                    p.closed = True
            while t.is_alive():
                try:
                    q.get_nowait()
                except queue.Empty:
                    t.join(0.05)
            for _ in writers:
                self.wq.put(None)
            for wt in writers:
                wt.join()
        if warm is not None:
            warm.join()  # a finished run leaves no work of its own on the device (a failed one does not wait)
        if self.write_error is not None:
            raise self.write_error
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            self.flags.resolve()
            if self.opts.zeros is not None:  # the candidate rows the device left (pipeline/zeros.py: no sync per chunk)
                self.opts.zeros.resolve(self.dev)

    def _to_device(self, job: Read, info: TensorInfo, data: torch.Tensor) -> torch.Tensor:
        shape = (job.stop - job.start, *info.shape[1:])
        if not self.cuda:
            return data.view(info.torch_dtype).reshape(shape)
        if isinstance(data, StoredRows):
            w, data = data.to_device(self.dev), data.buf
        elif info.view is not None and info.view.transpose:  # a gpt-oss expert: its columns gathered here, not on a reader
            w = rows_of_region(info, data[: region_bytes(info)].to(self.dev, non_blocking=True), job.start, job.stop)
        else:
            n = (job.stop - job.start) * (info.nbytes // info.shape[0])
            w = data[:n].to(self.dev, non_blocking=True).view(info.torch_dtype).reshape(shape)
        self._release(data)
        return w

    def _handle(self, job: Read, data, st: _UnitState | None) -> None:
        if job.kind == "batch":
            self._handle_batch(job, data)
            return
        if job.kind in ("copy", "copies"):  # a chunk of one copied tensor, or small copied tensors whole: one queued write
            pieces = [(job.unit, job.start, data)] if job.kind == "copy" else [(u, 0, d) for u, d in zip(job.units, data)]
            self._write_many([self._copy_write(u, start, bytes_, bad) for u, start, (bytes_, bad) in pieces])
            self._progress(sum(bytes_.numel() for _, _, (bytes_, _) in pieces))
            return
        unit = self.plan.units[job.unit]
        info = self.ckpt.tensors[unit.sources[job.member]]
        w = self._to_device(job, info, data)
        if job.kind == "amax":
            st.scales.observe(job.member, self._absmax(w, info, job))
            with self._refusing(unit, job, st):
                st.scales.search(job.member, job.start, w, unit.scheme, self.opts.impl, job.stop >= info.shape[0])  # the observer's pre-pass (none for min/max)
            if job.hold:
                st.held.append((job, w))
            if job.end_of_pass:
                self._check_unit(job.unit, st)
                st.scales.finish(unit.scheme, info.torch_dtype, [self.ckpt.tensors[s].torch_dtype for s in unit.sources])
                for hjob, hw in st.held:
                    self._quantize(unit, hjob, hw, st)
                st.held.clear()
            return
        if not needs_absmax_pass(unit.scheme, observer_of(self.opts, unit)) and not self._scales_show_nonfinite(unit):
            self._absmax(w, info, job, st)  # NaN/inf scan
        self._quantize(unit, job, w, st)
        if job.end_of_pass:
            self._check_unit(job.unit, st)

    def _handle_batch(self, job: Read, data: torch.Tensor) -> None:
        """A batch of small units (:mod:`.batches`): one host-to-device copy, one absmax and scale computation, one
        NaN/inf flag (on a GPU read behind an event, as a unit's), one zero-row scan and one staging copy; on a GPU,
        a batch of a kind seen before is one replay of its captured device work (:mod:`.graphs`)."""
        units = [self.plan.units[u] for u in job.units]
        infos = batch_infos(self.ckpt.tensors, units)
        got = self.graphs.run(units, infos, data) if self.graphs is not None else None
        if got is None:
            res = self._batch_eager(job, units, infos, data)
        else:
            self._release(data)
            res, ok, mask = got
            members = _flat(infos)
            self.flags.add_stacked(job.unit, members, res.amax, self.stream, ok=ok)
            self.flags.resolve()
            if self.opts.zeros is not None and mask is not None:
                self.opts.zeros.observe_mask(members, mask, units[0].scheme, res.global_scales, res.set_amax)
        rows = res.writes()
        if self.cuda:
            staged, ev, reserved = self._stage([t for _, _, t in rows])
        else:
            staged, ev, reserved = [host_bytes(t) for _, _, t in rows], None, None
        self._write_many(member_writes(rows, staged), ev, reserved=reserved)
        self._progress(sum(i.nbytes for unit in infos for i in unit))

    def _release(self, data: torch.Tensor) -> None:
        """GPU: hand a pinned read buffer back to the pool once the copies queued from it so far are done."""
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.pool.put(data, ev)

    def _batch_eager(self, job: Read, units: list, infos: list, data: torch.Tensor):
        """A batch's device work launched op by op (:func:`~.batches.quantize_batch`), its flags and zero-row scan
        queued: its :class:`~.batches.BatchResult`."""
        first = infos[0][0]
        n = batch_nbytes(infos)
        x = batch_values(infos, data[:n].to(self.dev, non_blocking=True) if self.cuda else data[:n])
        if self.cuda:
            self._release(data)
        try:
            res = quantize_batch(units, infos, x, self.opts.impl, check_now=not self.cuda)
        except BatchError as e:
            if self.cuda:  # a NaN/inf found earlier, or in this batch, explains a failure first
                torch.cuda.synchronize(self.dev)
                self.flags.resolve()
            raise_first_nonfinite(infos, e.amax)
            info = infos[e.unit][e.member]
            raise BadInputError(f"cannot quantize with {units[0].scheme.name}: {e.error}", file=str(info.file), tensor=info.name) from e
        members = _flat(infos)
        if self.cuda:
            self.flags.add_stacked(job.unit, members, res.amax, self.stream)
            self.flags.resolve()
        if self.opts.zeros is not None:
            self.opts.zeros.observe_stacked(members, x.reshape(len(members), *first.shape), res.scales, units[0].scheme, res.global_scales, res.set_amax)
        return res

    def _copy_write(self, ui: int, start: int, data: torch.Tensor, bad: bool) -> tuple[str, torch.Tensor, int]:
        """The write ``(name, bytes, position)`` of copied bytes ``data`` read from byte ``start`` of unit ``ui``'s tensor,
        checked for NaN/inf (``bad``: :meth:`_check_copy`) and cast where the unit says (``--dense-dtype``: pipeline/casting.py)."""
        unit = self.plan.units[ui]
        info = self.ckpt.tensors[unit.sources[0]]
        self._check_copy(info, bad)
        if unit.cast is not None:
            data, start = cast_chunk(data, info.dtype, unit.cast, str(info.file), info.name, start)
        return info.name, data, start

    def _check_copy(self, info: TensorInfo, bad: bool) -> None:
        """A pass-through chunk of a floating tensor must be finite, checked on the bytes in memory as they are
        copied; else the tensor is refused by name, or listed with ``allow_nonfinite`` (in plan order)."""
        if not bad or info.name in self.opts.nonfinite:
            return
        if not self.opts.allow_nonfinite:
            raise_nonfinite(info, what="tensor", action="refusing to copy it (--allow-non-finite copies it with a note)")
        self.opts.nonfinite.append(info.name)

    def _absmax(self, w: torch.Tensor, info: TensorInfo, job: Read, st: _UnitState | None = None) -> torch.Tensor:
        """fp32 0-d absmax of the chunk; NaN/inf are reported (on the GPU: at the end of the unit)."""
        if self.use_native:
            amax, bad = native.absmax(w)
            if bad:
                raise_nonfinite(info)
            return torch.tensor(amax, dtype=torch.float32)
        a = tensor_absmax(w)
        if self.cuda:
            if st is not None:
                st.checks.append((info, a))
            return a
        if not bool(torch.isfinite(a)):
            raise_nonfinite(info)
        return a

    def _check_unit(self, ui: int, st: _UnitState, now: bool = False) -> None:
        """On a GPU: queue the unit's NaN/inf flags (its set absmax, its chunks' absmax: :class:`DeviceFlags`) and read
        those whose copy is done. ``now``: wait and read every pending flag (a quantizer failed: a NaN/inf found
        earlier explains it first)."""
        if not self.cuda:
            return
        self.flags.add(ui, st.scales.amax, st.checks, self.plan.units[ui].sources, self.stream)
        st.checks = []
        if now:
            torch.cuda.synchronize(self.dev)
        self.flags.resolve()

    def _quantize(self, unit: WorkUnit, job: Read, w: torch.Tensor, st: _UnitState) -> None:
        info = self.ckpt.tensors[unit.sources[job.member]]
        prefix = unit.modules[job.member] + "."
        gs = st.scales.global_scale
        if job.member == 0 and job.start == 0:  # calibrated tensors of modules that are not members (k_scale/v_scale)
            for name, t in self._calibrated_others(unit):
                self._write(name, t.cpu())
        with self._refusing(unit, job, st):
            ranges = st.scales.ranges(job.member, job.start, w, unit.scheme, self.opts.impl)  # None for min/max
            out = unit.scheme.quantize_rows(w, gs, impl=self.opts.impl, weight_scale=st.scales.weight_scale.get(job.member), ranges=ranges)
        if self._scales_show_nonfinite(unit) and not bool(torch.isfinite(out["weight_scale"]).all()):
            raise_nonfinite(info)
        if self.opts.zeros is not None:
            self.opts.zeros.observe(info, job.start, w, out, unit.scheme, gs, st.scales.global_amax)
        last = job.stop == info.shape[0]
        if self.opts.repack is None:  # row chunks go straight to their offsets
            writes = []
            for key, t in out.items():
                pos = st.cursors.get((job.member, key), 0)
                writes.append((prefix + key, t, pos))
                st.cursors[(job.member, key)] = pos + t.numel() * t.element_size()
            if last:
                writes += [(prefix + key, t, 0) for key, t in self._whole_outputs(unit, job.member, info, st).items()]
            self._write_device(writes)
        else:  # whole modules go through the kernel layout (on the device), then are written
            chunks = st.parts.setdefault(job.member, {})
            for key, t in out.items():
                chunks.setdefault(key, []).append(t)
            if last:
                whole = {key: torch.cat(ts) if len(ts) > 1 else ts[0] for key, ts in st.parts.pop(job.member).items()}
                whole.update(self._whole_outputs(unit, job.member, info, st))
                self._write_device([(prefix + key, t, 0) for key, t in self.opts.repack(unit.modules[job.member], whole).items()])
        self._progress((job.stop - job.start) * info.nbytes // max(1, info.shape[0]))

    @contextlib.contextmanager
    def _refusing(self, unit: WorkUnit, job: Read, st: _UnitState):
        """A quantizer's or observer's ``ValueError`` as :class:`BadInputError` naming the file and tensor."""
        try:
            yield
        except ValueError as e:
            self._check_unit(job.unit, st, now=True)  # on a GPU the NaN/inf checks are still pending: they explain a failure first
            info = self.ckpt.tensors[unit.sources[job.member]]
            why = e.shifted(job.start) if isinstance(e, GroupOverflow) else e  # a chunk's row is the tensor's row job.start + r
            raise BadInputError(f"cannot quantize with {unit.scheme.name}: {why}", file=str(info.file), tensor=info.name) from e

    def _whole_outputs(self, unit: WorkUnit, member: int, info: TensorInfo, st: _UnitState) -> dict[str, torch.Tensor]:
        """A member's tensors known once its last chunk is done: the format's whole-tensor outputs (NVFP4's
        ``weight_global_scale``, ``weight_shape``), its calibrated tensors, then the FP8 preset's ``weight_scale``."""
        whole = {**unit.scheme.whole_tensor_outputs(info.shape, st.scales.global_scale), **self.calibrated.now(unit.modules[member])}
        if (ws := st.scales.weight_scale.get(member)) is not None:
            whole["weight_scale"] = ws
        return whole

    def _calibrated_others(self, unit: WorkUnit):
        """``(name, tensor)`` of the calibrated tensors the unit's outputs name for modules that are not its
        members (an attention module's ``k_scale``/``v_scale``, planned with the unit that holds its ``k_proj``)."""
        if not self.calibrated:
            return
        others: dict[str, dict[str, str]] = {}
        for name, _, _ in unit.outputs:
            mod, _, part = name.rpartition(".")
            if mod not in unit.modules and mod in self.calibrated:
                others.setdefault(mod, {})[part] = name
        for mod, names in others.items():
            got = self.calibrated.now(mod, names)
            for part, name in names.items():
                if part in got:
                    yield name, got[part]

    def _scales_show_nonfinite(self, unit: WorkUnit) -> bool:
        """NaN/inf are found from the scales the C kernels return, not by a separate scan (Scheme.scale_flags_nonfinite)."""
        return self.use_native and unit.scheme.scale_flags_nonfinite and observer_of(self.opts, unit) is None  # an observer's ranges: torch's quantizer

    def _progress(self, n: int) -> None:
        if self.opts.progress is not None:
            self.opts.progress.update(n)


def _flat(infos: list[list[TensorInfo]]) -> list[TensorInfo]:
    return [i for unit in infos for i in unit]


def _sources_need_work(ckpt: Checkpoint, plan: Plan) -> bool:
    """Whether reading a quantized unit's sources is more than mapping them: slices of fused experts, dequantized weights."""
    return any(ckpt.tensors[s].view is not None or ckpt.tensors[s].virtual is not None for u in plan.units if u.kind != "copy" for s in u.sources)
