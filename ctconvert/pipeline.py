"""The streaming executor: read -> quantize -> write, one row chunk at a time.

Memory is bounded by a few row chunks (``chunk_elems`` elements each), never
by a tensor or a shard: inputs are read by row range, and every output tensor
is written at its final offset in its shard as soon as a chunk is done. This
is the only module that knows about devices, threads and progress.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .checkpoint.reader import Checkpoint
from .checkpoint.safetensors_io import ShardFile, TensorInfo, read_bytes, read_rows
from .errors import BadInputError
from .formats.common import tensor_absmax
from .formats.fp4 import nvfp4_global_scale
from .plan import Plan, Unit

COPY_CHUNK_BYTES = 64 * 2**20
DEFAULT_CHUNK_ELEMS = 4 * 2**20


@dataclass
class ExecOptions:
    device: torch.device
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    progress: object | None = None  # anything with .update(nbytes)


def resolve_device(spec: str | None) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``."""
    from .errors import UsageError

    s = (spec or "auto").strip().lower()
    if s == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(s)
    except RuntimeError:
        raise UsageError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {spec!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {spec!r}; use auto, cpu, cuda or cuda:N")
    return dev


def _chunk_rows(info: TensorInfo, unit: Unit, opts: ExecOptions) -> int:
    align = unit.scheme.row_align
    k = max(1, info.shape[1])
    rows = unit.chunk_rows or max(1, opts.chunk_elems // k)
    rows = max(align, rows // align * align)
    return rows


def _load(info: TensorInfo, r0: int, r1: int, device: torch.device) -> torch.Tensor:
    w = read_rows(info, r0, r1)
    if device.type != "cpu":
        w = w.pin_memory().to(device, non_blocking=True)
    return w


def _check_finite(w: torch.Tensor, info: TensorInfo, r0: int) -> None:
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        kind = "NaN" if bool(torch.isnan(w).any()) else "inf"
        raise BadInputError(
            f"weight holds {int(bad.sum())} non-finite values ({kind}; first at row {r0 + idx[0]}, column {idx[1]}); "
            "refusing to quantize",
            file=info.file.name, tensor=info.name,
        )


def run_unit(ckpt: Checkpoint, unit: Unit, shards: dict[str, ShardFile], opts: ExecOptions) -> None:
    """Execute one unit of the plan, writing its outputs into ``shards``."""
    if unit.kind == "copy":
        info = ckpt.tensors[unit.sources[0]]
        f = shards[info.name]
        pos = 0
        while pos < info.nbytes:
            n = min(COPY_CHUNK_BYTES, info.nbytes - pos)
            f.write(info.name, read_bytes(info, pos, n), pos)
            pos += n
            if opts.progress:
                opts.progress.update(n)
        return

    scheme = unit.scheme
    infos = [ckpt.tensors[s] for s in unit.sources]
    dev = opts.device
    gs = None
    cache: dict[tuple[str, int], torch.Tensor] = {}
    if scheme.global_scale:
        # One absmax over the whole fused set before any member is quantized (§9.1).
        total = sum(i.numel for i in infos)
        keep = total <= 4 * opts.chunk_elems
        amax = torch.zeros((), dtype=torch.float32, device=dev)
        for info in infos:
            step = _chunk_rows(info, unit, opts)
            for r0 in range(0, info.shape[0], step):
                w = _load(info, r0, min(r0 + step, info.shape[0]), dev)
                _check_finite(w, info, r0)
                amax = torch.maximum(amax, tensor_absmax(w))
                if keep:
                    cache[(info.name, r0)] = w
        gs = nvfp4_global_scale(amax, infos[0].torch_dtype)
    for info, module in zip(infos, unit.modules):
        prefix = module + "."
        cursors: dict[str, int] = {}
        step = _chunk_rows(info, unit, opts)
        for r0 in range(0, info.shape[0], step):
            r1 = min(r0 + step, info.shape[0])
            w = cache.pop((info.name, r0), None)
            if w is None:
                w = _load(info, r0, r1, dev)
                if gs is None:
                    _check_finite(w, info, r0)
            try:
                out = scheme.quantize_rows(w, gs)
            except ValueError as e:
                raise BadInputError(f"cannot quantize with {scheme.name}: {e}", file=info.file.name, tensor=info.name) from e
            for key, t in out.items():
                name = prefix + key
                shards[name].write(name, t.cpu() if t.device.type != "cpu" else t, cursors.get(key, 0))
                cursors[key] = cursors.get(key, 0) + t.numel() * t.element_size()
            if opts.progress:
                opts.progress.update((r1 - r0) * info.nbytes // max(1, info.shape[0]))
        if scheme.kind == "int" and scheme.format == "pack-quantized":
            name = prefix + "weight_shape"
            shards[name].write(name, torch.tensor(list(info.shape), dtype=torch.int64))
        if gs is not None:
            name = prefix + "weight_global_scale"
            shards[name].write(name, gs.cpu())


def execute(ckpt: Checkpoint, plan: Plan, shards: dict[str, ShardFile], opts: ExecOptions) -> None:
    """Run every unit of ``plan`` in order."""
    ctx = torch.inference_mode()
    with ctx, contextlib.ExitStack():
        for unit in plan.units:
            run_unit(ckpt, unit, shards, opts)
