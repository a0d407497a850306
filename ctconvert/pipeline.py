"""The streaming executor: read -> quantize -> write, one row chunk at a time.

Memory is bounded by a few row chunks, never by a tensor or a shard: inputs are
read by row range, and every output tensor is written at its final offset in
its shard as soon as a chunk is done. A reader thread reads the next chunks
(into pinned host buffers when the device is a GPU) while the current one is
quantized, so disk, host-to-device copies and compute overlap.

NVFP4 needs one absmax over each fused set before any member is quantized
(compressed-tensors-format.md §9.1): a set of up to ``hold_bytes`` is read
once and held (on the device) until its global scale is known; a larger set
is read twice (absmax pass, then quantize pass).

This is the only module that knows about devices, threads and progress.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from .checkpoint.reader import Checkpoint
from .checkpoint.safetensors_io import ShardFile, TensorInfo, iter_row_chunks, map_rows, read_bytes, read_rows
from .errors import BadInputError, UsageError
from .formats import native
from .formats.common import tensor_absmax
from .formats.fp4 import nvfp4_global_scale
from .plan import Plan, Unit

COPY_CHUNK_BYTES = 64 * 2**20
DEFAULT_CHUNK_ELEMS = 4 * 2**20
DEFAULT_HOLD_BYTES = 1 << 30
READ_AHEAD = 3
MAP_INPUT = os.environ.get("CTCONVERT_MMAP", "1") != "0"  # CPU: chunks are views of the file, not copies
WRITE_BEHIND = 8


@dataclass
class ExecOptions:
    device: torch.device
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    hold_bytes: int = DEFAULT_HOLD_BYTES
    progress: object | None = None  # anything with .update(nbytes)
    impl: str = "auto"
    hashes: dict | None = None  # source tensor name -> hasher, fed as the bytes stream by
    post: object | None = None  # (module, {part: whole tensor}) -> {part: tensor}: e.g. a kernel layout (repack.KernelTarget)


def resolve_devices(spec: str | None) -> list[torch.device]:
    """Parse ``--device``: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, a list (``cuda:0,1`` or
    ``cuda:0,cuda:1``), or ``all`` (every CUDA device). Raises :class:`UsageError`."""
    s = (spec or "auto").strip().lower()
    if s == "all":
        if not torch.cuda.is_available():
            raise UsageError("--device all needs CUDA devices, and none is available")
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if "," in s:
        parts = [p.strip() for p in s.split(",") if p.strip()]
        out = []
        for p in parts:
            if p.isdigit():
                p = f"cuda:{p}"
            out.append(resolve_device(p))
        if len(set(out)) != len(out) and any(d.type == "cuda" for d in out):
            raise UsageError(f"device {spec!r} names a GPU twice")
        return out
    return [resolve_device(s)]


def resolve_device(spec: str | None) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``."""
    s = (spec or "auto").strip().lower()
    if s == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(s)
    except RuntimeError:
        raise UsageError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {spec!r}; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {spec!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device {spec!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return dev


@dataclass
class Job:
    """One read: a byte range of a copied tensor, or a row range of a quantized member."""

    unit: int
    kind: str  # copy | amax | quant
    member: int = 0
    start: int = 0  # byte offset (copy) or first row
    stop: int = 0
    hold: bool = False  # keep the chunk until the set's global scale is known
    end_of_pass: bool = False  # last job of an amax pass / of a unit


def _chunk_rows(info: TensorInfo, unit: Unit, chunk_elems: int) -> int:
    align = unit.scheme.row_align
    rows = unit.chunk_rows or max(1, chunk_elems // max(1, info.shape[1]))
    return max(align, rows // align * align)


def make_jobs(ckpt: Checkpoint, plan: Plan, opts: ExecOptions):
    """The reads of the whole conversion, in order."""
    for ui, unit in enumerate(plan.units):
        if unit.kind == "copy":
            info = ckpt.tensors[unit.sources[0]]
            for b0 in range(0, info.nbytes, COPY_CHUNK_BYTES):
                yield Job(ui, "copy", 0, b0, min(info.nbytes, b0 + COPY_CHUNK_BYTES))
            if info.nbytes == 0:
                yield Job(ui, "copy", 0, 0, 0)
            continue
        infos = [ckpt.tensors[s] for s in unit.sources]
        chunks = [(m, r0, min(r0 + step, info.shape[0]))
                  for m, info in enumerate(infos)
                  for step in [_chunk_rows(info, unit, opts.chunk_elems)]
                  for r0 in range(0, info.shape[0], step)]
        if unit.scheme.global_scale:
            hold = sum(i.nbytes for i in infos) <= opts.hold_bytes
            for j, (m, r0, r1) in enumerate(chunks):
                yield Job(ui, "amax", m, r0, r1, hold=hold, end_of_pass=j == len(chunks) - 1)
            if hold:
                continue
        for j, (m, r0, r1) in enumerate(chunks):
            yield Job(ui, "quant", m, r0, r1, end_of_pass=j == len(chunks) - 1)


class _PinnedPool:
    """Reusable pinned host buffers for host-to-device copies (pageable copies are ~8x slower)."""

    def __init__(self, count: int):
        self.free: queue.Queue = queue.Queue()
        self.count = count
        self.made = 0
        self.lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            if self.made < self.count:
                self.made += 1
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buf, event = self.free.get()
        if event is not None:
            event.synchronize()
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf

    def put(self, buf: torch.Tensor, event) -> None:
        self.free.put((buf, event))


@dataclass
class _UnitState:
    cursors: dict = field(default_factory=dict)  # (member, key) -> byte offset
    amax: torch.Tensor | None = None
    gs: torch.Tensor | None = None
    held: list = field(default_factory=list)
    checks: list = field(default_factory=list)  # device amax per chunk, checked at the end (GPU)
    parts: dict = field(default_factory=dict)  # with ExecOptions.post: member -> {part: [chunks]}


class Executor:
    """Runs the jobs of a plan: a reader thread feeds a bounded queue; this thread computes and writes."""

    def __init__(self, ckpt: Checkpoint, plan: Plan, shards: dict[str, ShardFile], opts: ExecOptions):
        self.ckpt, self.plan, self.shards, self.opts = ckpt, plan, shards, opts
        self.dev = opts.device
        self.cuda = self.dev.type == "cuda"
        self.pool = _PinnedPool(READ_AHEAD + 2) if self.cuda else None
        self.stream = torch.cuda.Stream(self.dev) if self.cuda else None
        self.use_native = not self.cuda and opts.impl in ("auto", "native") and native.available()
        self.wq: queue.Queue = queue.Queue(maxsize=WRITE_BEHIND)
        self.write_error: BaseException | None = None

    # -- writing (a thread of its own: output bytes go to disk while the next chunks compute) --
    def _writer(self) -> None:
        delay = float(os.environ.get("CTCONVERT_TEST_SLOW_WRITE", "0") or 0)  # fault-injection hook for the kill tests
        while True:
            item = self.wq.get()
            if item is None:
                return
            if self.write_error is not None:
                continue
            name, t, pos = item
            if delay:
                time.sleep(delay)
            try:
                self.shards[name].write(name, t, pos)
            except BaseException as e:  # noqa: BLE001 - re-raised by the computing thread
                self.write_error = e

    def _write(self, name: str, t: torch.Tensor, pos: int = 0) -> None:
        if self.write_error is not None:
            raise self.write_error
        self.wq.put((name, t, pos))

    # -- reading ---------------------------------------------------------------
    def _read(self, job: Job):
        unit = self.plan.units[job.unit]
        info = self.ckpt.tensors[unit.sources[job.member]]
        if job.kind == "copy":
            return read_bytes(info, job.start, job.stop - job.start)
        if not self.cuda:
            if MAP_INPUT:
                return map_rows(info, job.start, job.stop)
            return read_rows(info, job.start, job.stop)
        row_bytes = info.nbytes // info.shape[0]
        n = (job.stop - job.start) * row_bytes
        buf = self.pool.get(n)
        read_bytes(info, job.start * row_bytes, n, out=buf)
        return buf

    def _hash(self, job: Job, data: torch.Tensor) -> None:
        """Feed a source tensor's hash: every byte once, in order (not on the second NVFP4 pass)."""
        unit = self.plan.units[job.unit]
        if job.kind == "quant" and unit.scheme.global_scale:
            return
        info = self.ckpt.tensors[unit.sources[job.member]]
        h = self.opts.hashes.get(info.name)
        if h is None:
            return
        if job.kind == "copy":
            n = job.stop - job.start
        else:
            n = (job.stop - job.start) * (info.nbytes // max(1, info.shape[0]))
        raw = data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(-1)
        h.update(raw[:n].numpy())

    def _reader(self, jobs, q: queue.Queue, stop: threading.Event):
        try:
            for job in jobs:
                if stop.is_set():
                    return
                data = self._read(job)
                if self.opts.hashes is not None:
                    self._hash(job, data)
                q.put((job, data))
            q.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    # -- computing ---------------------------------------------------------------
    def run(self) -> None:
        q: queue.Queue = queue.Queue(maxsize=READ_AHEAD)
        stop = threading.Event()
        t = threading.Thread(target=self._reader, args=(make_jobs(self.ckpt, self.plan, self.opts), q, stop), daemon=True, name="ctconvert-reader")
        t.start()
        wt = threading.Thread(target=self._writer, daemon=True, name="ctconvert-writer")
        wt.start()
        states: dict[int, _UnitState] = {}
        try:
            with torch.inference_mode(), (torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()):
                while True:
                    item = q.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    job, data = item
                    self._handle(job, data, states.setdefault(job.unit, _UnitState()))
                    if job.end_of_pass and job.kind == "quant":
                        states.pop(job.unit, None)
        finally:
            stop.set()
            while t.is_alive():
                try:
                    q.get_nowait()
                except queue.Empty:
                    t.join(0.05)
            self.wq.put(None)
            wt.join()
        if self.write_error is not None:
            raise self.write_error
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def _to_device(self, job: Job, info: TensorInfo, data: torch.Tensor) -> torch.Tensor:
        shape = (job.stop - job.start, *info.shape[1:])
        if not self.cuda:
            return data.view(info.torch_dtype).reshape(shape)
        n = (job.stop - job.start) * (info.nbytes // info.shape[0])
        w = data[:n].to(self.dev, non_blocking=True).view(info.torch_dtype).reshape(shape)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.pool.put(data, ev)
        return w

    def _handle(self, job: Job, data: torch.Tensor, st: _UnitState) -> None:
        unit = self.plan.units[job.unit]
        info = self.ckpt.tensors[unit.sources[job.member]]
        if job.kind == "copy":
            self._write(info.name, data, job.start)
            self._progress(job.stop - job.start)
            return
        w = self._to_device(job, info, data)
        if job.kind == "amax":
            a = self._absmax(w, info, job)
            st.amax = a if st.amax is None else torch.maximum(st.amax, a)
            if job.hold:
                st.held.append((job, w))
            if job.end_of_pass:
                self._check_unit(unit, st)
                st.gs = nvfp4_global_scale(st.amax, info.torch_dtype)
                for hjob, hw in st.held:
                    self._quantize(unit, hjob, hw, st)
                st.held.clear()
            return
        if not unit.scheme.global_scale and not self._scales_show_nonfinite(unit):
            self._absmax(w, info, job, st)  # NaN/inf scan
        self._quantize(unit, job, w, st)
        if job.end_of_pass:
            self._check_unit(unit, st)

    def _absmax(self, w: torch.Tensor, info: TensorInfo, job: Job, st: _UnitState | None = None) -> torch.Tensor:
        """fp32 0-d absmax of the chunk; NaN/inf are reported (on the GPU: at the end of the unit)."""
        if self.use_native:
            amax, bad = native.absmax(w)
            if bad:
                _raise_nonfinite(info)
            return torch.tensor(amax, dtype=torch.float32)
        a = tensor_absmax(w)
        if self.cuda:
            if st is not None:
                st.checks.append((info, a))
            return a
        if not bool(torch.isfinite(a)):
            _raise_nonfinite(info)
        return a

    def _check_unit(self, unit: Unit, st: _UnitState) -> None:
        if self.cuda:
            if st.amax is not None and not bool(torch.isfinite(st.amax)):
                for name in unit.sources:
                    _raise_nonfinite(self.ckpt.tensors[name], only_if_found=True)
            if st.checks:
                vals = torch.stack([a for _, a in st.checks])
                if not bool(torch.isfinite(vals).all()):
                    _raise_nonfinite(st.checks[int((~torch.isfinite(vals)).nonzero()[0])][0])
                st.checks.clear()

    def _quantize(self, unit: Unit, job: Job, w: torch.Tensor, st: _UnitState) -> None:
        info = self.ckpt.tensors[unit.sources[job.member]]
        prefix = unit.modules[job.member] + "."
        try:
            out = unit.scheme.quantize_rows(w, st.gs, impl=self.opts.impl)
        except ValueError as e:
            self._check_unit(unit, st)  # on a GPU the NaN/inf checks are still pending: they explain a failure first
            raise BadInputError(f"cannot quantize with {unit.scheme.name}: {e}", file=str(info.file), tensor=info.name) from e
        if self._scales_show_nonfinite(unit) and not bool(torch.isfinite(out["weight_scale"]).all()):
            _raise_nonfinite(info)
        last = job.stop == info.shape[0]
        if self.opts.post is None:  # row chunks go straight to their offsets
            for key, t in out.items():
                pos = st.cursors.get((job.member, key), 0)
                self._write(prefix + key, t.cpu(), pos)
                st.cursors[(job.member, key)] = pos + t.numel() * t.element_size()
            if last:
                for key, t in self._whole_tensor_outputs(unit, info, st).items():
                    self._write(prefix + key, t.cpu())
        else:  # whole modules go through post (on the device), then are written
            chunks = st.parts.setdefault(job.member, {})
            for key, t in out.items():
                chunks.setdefault(key, []).append(t)
            if last:
                whole = {key: torch.cat(ts) if len(ts) > 1 else ts[0] for key, ts in st.parts.pop(job.member).items()}
                whole.update(self._whole_tensor_outputs(unit, info, st))
                for key, t in self.opts.post(unit.modules[job.member], whole).items():
                    self._write(prefix + key, t.cpu().contiguous())
        self._progress((job.stop - job.start) * info.nbytes // max(1, info.shape[0]))

    @staticmethod
    def _whole_tensor_outputs(unit: Unit, info: TensorInfo, st: _UnitState) -> dict[str, torch.Tensor]:
        """The outputs that belong to the whole tensor, known once its last chunk is done."""
        out = {}
        if unit.scheme.kind == "int" and unit.scheme.format == "pack-quantized":
            out["weight_shape"] = torch.tensor(list(info.shape), dtype=torch.int64)
        if st.gs is not None:
            out["weight_global_scale"] = st.gs.reshape(1)
        return out

    def _scales_show_nonfinite(self, unit: Unit) -> bool:
        """NaN/inf are found from the scales the C kernels return, not by a separate scan (Scheme.scale_flags_nonfinite)."""
        return self.use_native and unit.scheme.scale_flags_nonfinite

    def _progress(self, n: int) -> None:
        if self.opts.progress is not None:
            self.opts.progress.update(n)


def _raise_nonfinite(info: TensorInfo, only_if_found: bool = False) -> None:
    """Find the first NaN/inf of a tensor (re-reading it on the CPU) and raise a one-line error."""
    total = 0
    first = None
    kind = "inf"
    for r0, w in iter_row_chunks(info):
        bad = ~torch.isfinite(w)
        cnt = int(bad.sum())
        if cnt:
            if first is None:
                idx = bad.nonzero()[0].tolist()
                first = (r0 + idx[0], idx[1] if len(idx) > 1 else 0)
            if bool(torch.isnan(w).any()):
                kind = "NaN"
            total += cnt
    if total == 0 and only_if_found:
        return
    raise BadInputError(
        f"weight holds {total} non-finite values ({kind}; first at row {first[0]}, column {first[1]}); refusing to quantize",
        file=str(info.file), tensor=info.name,
    )


def unit_bytes(ckpt: Checkpoint, unit: Unit) -> int:
    return sum(ckpt.tensors[s].nbytes for s in unit.sources)


def split_units(ckpt: Checkpoint, units: list[Unit], parts: int) -> list[list[Unit]]:
    """Deal units (fused sets, tensors) to ``parts`` workers, largest first, to the least loaded."""
    load = [0] * parts
    out: list[list[Unit]] = [[] for _ in range(parts)]
    for u in sorted(units, key=lambda u: -unit_bytes(ckpt, u)):
        i = load.index(min(load))
        out[i].append(u)
        load[i] += unit_bytes(ckpt, u)
    order = {id(u): k for k, u in enumerate(units)}
    return [sorted(p, key=lambda u: order[id(u)]) for p in out]


def execute(ckpt: Checkpoint, plan: Plan, shards: dict[str, ShardFile], opts: ExecOptions,
            devices: list[torch.device] | None = None) -> None:
    """Run every unit of ``plan``, writing into ``shards``.

    With several devices, units (a fused set or a tensor: the unit of work)
    are dealt to one executor per device by size; all write into the same
    shard files at disjoint offsets, so the output is the same bytes.
    """
    import dataclasses

    devices = devices or [opts.device]
    if len(devices) == 1:
        Executor(ckpt, plan, shards, dataclasses.replace(opts, device=devices[0])).run()
        return
    errors: list[BaseException] = []

    def work(units: list[Unit], dev: torch.device) -> None:
        try:
            Executor(ckpt, dataclasses.replace(plan, units=units), shards, dataclasses.replace(opts, device=dev)).run()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(part, dev), name=f"ctconvert-{dev}", daemon=True)
               for part, dev in zip(split_units(ckpt, plan.units, len(devices)), devices) if part]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
