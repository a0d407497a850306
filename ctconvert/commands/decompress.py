"""``ctconvert decompress``: a quantized checkpoint -> a dense checkpoint (bf16 by default).

The input is a compressed-tensors checkpoint, or any other source
:mod:`ctconvert.sources` reads (Hugging Face FP8 block: bf16 from it
is exact; ModelOpt NVFP4, AutoAWQ, GPTQ), dequantized with its format's own math.

Every quantized Linear (any format of :data:`ctconvert.formats.FORMATS`:
float-, int-, naive-, pack-, nvfp4-pack- and mxfp4-pack-quantized) becomes a
dense ``weight`` computed as compressed-tensors' own ``decompress`` computes it
(the format's ``dequantize``), row chunk by row chunk; activation scales are
dropped, and so are the KV cache's ``k_scale``/``v_scale`` of a ``kv_cache_scheme`` (the dense output has no
quantization config to explain them; the summary's ``left_out`` names each). The dequantized weights take ``dtype`` (default: the model's own dtype,
``config.json``'s ``torch_dtype``/``dtype``, else that of most stored floating bytes, else bf16); the other tensors keep
their stored dtype, unless ``dtype`` is given, in which case every floating-point
tensor is cast to it and ``config.json`` says so. ``config.json`` loses its
``quantization_config``. Written atomically like ``quantize``.

On the CPU a chunk is dequantized and cast by one fused C kernel
(:mod:`ctconvert.formats.native.dequant`, the same bytes as the torch
reference) from rows mapped from the input into reused buffers, while writer
threads put the previous chunks into the shards (:func:`~ctconvert.pipeline.tasks.run_tasks`).

Reads top to bottom: check the input -> plan every output tensor -> run the
copy, cast and dequantize tasks -> write the config.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from ..checkpoint.config import require_compressed_tensors
from ..checkpoint.conformance import module_problems, refuse, sparsity_problems
from ..checkpoint.families import is_expert, transformers_per_expert_reason
from ..checkpoint.modules import ACT_PARTS, KV_PARTS, QUANT_PARTS, Module, dense_row_chunks, dense_shape, modules_of
from ..checkpoint.provenance import PROVENANCE
from ..checkpoint.reader import CONFIG_NAME, Checkpoint, open_checkpoint
from ..checkpoint.safetensors_io import TORCH_TO_ST, read_rows
from ..checkpoint.shard_file import PlannedTensor
from ..checkpoint.writer import OutputFolder, assign_shards, check_output_path, parse_size
from ..errors import BadInputError, UnsupportedError, UsageError
from ..formats import CompressionFormat, get_format
from ..options import DEFAULT_SHARD_SIZE
from ..pipeline.memory import fix_mmap_threshold
from ..pipeline.tasks import CastTensor, ChunkBuffers, Compute, CopyTensor, run_tasks
from ..sources import SOURCE_CONFIG_FILES, Source, open_source
from ..sources.compressed_tensors import COMPRESSED_TENSORS

__all__ = ["DTYPES", "decompress"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FLOAT = ("F32", "F16", "BF16")
_DTYPE_KEYS = ("torch_dtype", "dtype")
_TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _model_dtype(ckpt: Checkpoint) -> str:
    """The model's own dtype as a ``--dtype`` name: ``config.json``'s ``torch_dtype`` or ``dtype`` (also in
    ``text_config``); where the config names none of bf16/fp16/fp32 (all-MiniLM-L6-v2's has none), the dtype
    that most bytes of the stored floating tensors have (the norms, embeddings and biases the quantizer kept as
    they were); bf16 when there are none."""
    by_name = {v: k for k, v in _TORCH_NAMES.items()}
    config = ckpt.config
    for c in (config, config.get("text_config")):
        for key in _DTYPE_KEYS:
            if isinstance(c, dict) and str(c.get(key, "")).removeprefix("torch.") in by_name:
                return by_name[str(c[key]).removeprefix("torch.")]
    stored = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
    counts: dict[str, int] = {}
    for info in ckpt.tensors.values():
        if info.dtype in stored:
            counts[stored[info.dtype]] = counts.get(stored[info.dtype], 0) + info.nbytes
    return max(counts, key=counts.get) if counts else "bf16"


def decompress(
    src: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    chunk_elems: int = 4 * 2**20,
    progress=None,
) -> dict:
    """Write a dense copy of ``src`` at ``out``; see :func:`ctconvert.api.decompress`. Returns a summary dict."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    ckpt = open_checkpoint(src, strict=True)
    skip = {PROVENANCE}
    ct = (ckpt.quantization_config or {}).get("quant_method") == COMPRESSED_TENSORS.quant_method  # decompressed module by module here
    source = None if ct else open_source(ckpt)
    name = dtype or _model_dtype(ckpt)
    od = DTYPES[name]
    buffers = ChunkBuffers()
    left_out: dict[str, str] = {}
    if source is not None and source.quantized:  # HF FP8 block, ModelOpt, AWQ, GPTQ: through their readers
        check_output_path(src, out, overwrite)
        planned, tasks, n_modules = _plan_view(source, od, chunk_elems, cast_all=dtype is not None)
        skip |= set(SOURCE_CONFIG_FILES)
    else:
        _check_input(ckpt, src)
        check_output_path(src, out, overwrite)
        planned, tasks, n_modules = _plan(ckpt, od, chunk_elems, cast_all=dtype is not None, buffers=buffers, left_out=left_out)
    fix_mmap_threshold()  # chunk temporaries freed on the writer threads would otherwise fragment the heaps (pipeline/memory.py)

    def config():
        cfg = copy.deepcopy(ckpt.config)
        for c in (cfg, cfg.get("text_config")):
            if isinstance(c, dict):
                c.pop("quantization_config", None)
                if dtype is not None:  # every float tensor is cast: the config says so (transformers reads either key)
                    for key in [k for k in _DTYPE_KEYS if k in c] or ["torch_dtype"]:
                        c[key] = _TORCH_NAMES[dtype]
        return cfg

    total, limit = sum(t.nbytes for t in planned), parse_size(max_shard_size)
    with OutputFolder(out, overwrite=overwrite) as folder:
        run_tasks(tasks, folder.open_shards(assign_shards(planned, limit)), progress=progress, total=total, buffers=buffers)
        folder.copy_files(src, skip={CONFIG_NAME, *skip})
        folder.finish(config(), total)
    return {
        "output": str(out),
        "modules_decompressed": n_modules,
        "dtype": name,
        "cast_all": dtype is not None,
        "input_bytes": ckpt.total_bytes,
        "output_bytes": total,
        "seconds": round(time.perf_counter() - t0, 3),
        "left_out": left_out,
        "notes": _notes(ckpt, planned),
    }


def _notes(ckpt: Checkpoint, planned: list[PlannedTensor]) -> list[str]:
    """What the dense copy cannot do that a user would expect of it: experts one Linear each where transformers
    loads the family's experts only fused (:func:`ctconvert.checkpoint.families.transformers_per_expert_reason`)."""
    per_expert = [t.name for t in planned if is_expert(t.name)]
    why = transformers_per_expert_reason(ckpt.config) if per_expert else None
    return [f"experts written one Linear each ({per_expert[0]} ...): {why}"] if why else []


def _check_input(ckpt: Checkpoint, src: Path) -> None:
    qcfg = ckpt.quantization_config
    require_compressed_tensors(qcfg, src / CONFIG_NAME, "decompress", "this one is dense already")
    if (qcfg.get("sparsity_config") or {}).get("format") not in (None, CompressionFormat.DENSE.value, CompressionFormat.SPARSE_24_BITMASK.value):
        raise UnsupportedError(f"sparse format {qcfg['sparsity_config']['format']!r} cannot be decompressed", file=src / CONFIG_NAME)
    refuse(sparsity_problems(modules_of(ckpt), qcfg), src / CONFIG_NAME)  # a config that claims 2:4 over plain tensors


def _check_module(m: Module, info, qcfg: dict) -> None:
    """Raise for a quantized module that cannot be dequantized, or whose tensors contradict its config group
    (:func:`ctconvert.checkpoint.conformance.module_problems`: :class:`BadInputError` naming the file and tensor)."""
    where = dict(file=info.file.name, tensor=info.name)
    if m.group is None:
        raise BadInputError("quantized tensors that no config group targets", **where)
    if get_format(m.format) is None:
        raise UnsupportedError(f"format {m.format!r} cannot be decompressed", **where)
    if found := module_problems(m, qcfg):
        p = found[0]
        raise BadInputError(p.message, file=Path(p.file).name if p.file else where["file"], tensor=p.tensor or info.name)
    if "weight_g_idx" in m.parts:
        raise UnsupportedError("act-order weights (weight_g_idx) cannot be decompressed", **where)


def _plan(ckpt: Checkpoint, od: torch.dtype, chunk_elems: int, cast_all: bool, buffers: ChunkBuffers, left_out: dict):
    """``(output tensors, tasks, modules dequantized)``: one dense weight per quantized module, and copies of
    the other tensors (``cast_all``: floating-point ones cast to ``od``); the KV cache scales of a
    ``kv_cache_scheme`` are not written, each put in ``left_out`` (name -> reason)."""
    mods = modules_of(ckpt)
    kv_cache = bool((ckpt.quantization_config or {}).get("kv_cache_scheme"))
    planned: list[PlannedTensor] = []
    tasks: list = []
    done: set[str] = set()
    checked: set[str] = set()
    for name in sorted(ckpt.tensors, key=lambda n: (str(ckpt.tensors[n].file), ckpt.tensors[n].start)):
        mod, _, part = name.rpartition(".")
        m = mods.get(mod)
        info = ckpt.tensors[name]
        if kv_cache and part in KV_PARTS:
            left_out[name] = "KV-cache scale of the source's kv_cache_scheme (a dense checkpoint has none)"
            continue
        if m is not None and m.quantized:
            if mod not in checked:
                checked.add(mod)
                _check_module(m, info, ckpt.quantization_config)
            if part in QUANT_PARTS or part in ACT_PARTS or part == "weight":
                if mod not in done:
                    done.add(mod)
                    planned.append(PlannedTensor(mod + ".weight", TORCH_TO_ST[od], dense_shape(m)))
                    tasks.append(Compute(lambda m=m: _dequantize(m, od, chunk_elems, buffers)))
                continue
        _pass_through(name, info, od, cast_all, planned, tasks)
    return planned, tasks, len(done)


def _plan_view(source: Source, od: torch.dtype, chunk_elems: int, cast_all: bool = False):
    """Like :func:`_plan` for the other sources: every quantized module's dense weight is read through its
    reader (:mod:`ctconvert.sources`: the source format's own math), cast to ``od``."""
    view = source.view
    planned: list[PlannedTensor] = []
    tasks: list = []
    for name in sorted(view.tensors, key=lambda n: (str(view.tensors[n].file), view.tensors[n].start)):
        info = view.tensors[name]
        if info.virtual is not None:
            planned.append(PlannedTensor(name, TORCH_TO_ST[od], info.shape))
            tasks.append(Compute(lambda info=info: _dense_rows(info, od, chunk_elems)))
        else:
            _pass_through(name, info, od, cast_all, planned, tasks)
    return planned, tasks, len(source.modules)


def _pass_through(name: str, info, od: torch.dtype, cast_all: bool, planned: list, tasks: list) -> None:
    """A tensor that was not quantized: cast to ``od`` when ``cast_all`` and it is another float dtype, else copied."""
    if cast_all and info.dtype in _FLOAT and info.dtype != TORCH_TO_ST[od]:
        planned.append(PlannedTensor(name, TORCH_TO_ST[od], info.shape))
        tasks.append(CastTensor(info, od))
    else:
        planned.append(PlannedTensor(name, info.dtype, info.shape))
        tasks.append(CopyTensor(info))


def _dense_rows(info, od: torch.dtype, chunk_elems: int):
    pos, (n, k) = 0, info.shape
    step = max(128, (chunk_elems // max(1, k)) // 128 * 128)  # whole blocks and packed zero points per chunk
    for r0 in range(0, n, step):
        rows = read_rows(info, r0, min(n, r0 + step)).to(od)
        yield info.name, rows, pos
        pos += rows.numel() * rows.element_size()


def _dequantize(m: Module, od: torch.dtype, chunk_elems: int, buffers: ChunkBuffers):
    """The dense weight of ``m`` in ``od``, chunk by chunk: rows read as views of the mapped input, dequantized
    and cast (one fused CPU kernel: :mod:`ctconvert.formats.native.dequant`) into reused buffers."""
    name, pos = m.name + ".weight", 0
    try:
        for _, _, dense in dense_row_chunks(m, chunk_elems, dtype=od, alloc=buffers.take, mapped=True):
            yield name, dense, pos
            pos += dense.numel() * dense.element_size()
    except (KeyError, ValueError, RuntimeError) as e:
        raise BadInputError(f"cannot dequantize ({m.format}): {e}", file=m.file, tensor=name) from e
