"""compressed-tensors checkpoint -> dense checkpoint (bf16 by default).

Every quantized Linear (any format ctconvert writes: float-, int-, naive-,
pack-, nvfp4-pack- and mxfp4-pack-quantized) becomes a dense ``weight``
computed as compressed-tensors' own ``decompress`` computes it
(:mod:`ctconvert.formats.dequant`), row chunk by row chunk; activation
scales are dropped; other floating-point tensors are cast to the output dtype and the rest copied; ``config.json``
loses its ``quantization_config``. Written atomically like ``quantize``.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from .checkpoint.reader import CONFIG_NAME, open_checkpoint
from .checkpoint.safetensors_io import TORCH_TO_ST, PlannedTensor, copy_tensor, iter_row_chunks
from .checkpoint.writer import check_output_path, parse_size, write_checkpoint
from .errors import BadInputError, UnsupportedError, UsageError
from .modules import ACT_PARTS, QUANT_PARTS, dense_row_chunks, dense_shape, modules_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KNOWN_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")


def decompress(src: str | Path, out: str | Path, *, dtype: str = "bf16", max_shard_size: str | int = "5GB",
               overwrite: bool = False, chunk_elems: int = 16 * 2**20, progress=None) -> dict:
    """Write a dense copy of the compressed-tensors checkpoint ``src`` to ``out``.

    Raises :class:`UnsupportedError` for formats or features it cannot
    dequantize (sparse formats, ``weight_g_idx`` act-order), and the usual
    input/output errors. Returns a summary dict.
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise UsageError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    od = DTYPES[dtype]
    ckpt = open_checkpoint(src, strict=True)
    qcfg = ckpt.quantization_config
    if not qcfg or qcfg.get("quant_method") != "compressed-tensors":
        raise UnsupportedError("not a compressed-tensors checkpoint (no quantization_config with quant_method compressed-tensors)", file=src / CONFIG_NAME)
    if (qcfg.get("sparsity_config") or {}).get("format"):
        raise UnsupportedError(f"sparse format {qcfg['sparsity_config']['format']!r} cannot be decompressed", file=src / CONFIG_NAME)
    check_output_path(src, out, overwrite)
    mods = modules_of(ckpt)
    planned: list[PlannedTensor] = []
    jobs: list[tuple[str, object]] = []
    order = sorted(ckpt.tensors, key=lambda n: (str(ckpt.tensors[n].file), ckpt.tensors[n].start))
    done_modules: set[str] = set()
    for name in order:
        mod, _, part = name.rpartition(".")
        m = mods.get(mod)
        if m is not None and m.quantized:
            if m.group is None:
                raise BadInputError("quantized tensors that no config group targets", file=ckpt.tensors[name].file.name, tensor=name)
            if m.format not in KNOWN_FORMATS:
                raise UnsupportedError(f"format {m.format!r} cannot be decompressed", file=ckpt.tensors[name].file.name, tensor=name)
            if "weight_g_idx" in m.parts:
                raise UnsupportedError("act-order weights (weight_g_idx) cannot be decompressed", file=ckpt.tensors[name].file.name, tensor=name)
            if part in QUANT_PARTS or part in ACT_PARTS or part == "weight":
                if mod not in done_modules:
                    done_modules.add(mod)
                    n, k = dense_shape(m)
                    planned.append(PlannedTensor(mod + ".weight", TORCH_TO_ST[od], (n, k)))
                    jobs.append(("dequant", (m, n, k)))
                continue
        info = ckpt.tensors[name]
        if info.dtype in ("F32", "F16", "BF16") and info.dtype != TORCH_TO_ST[od]:
            planned.append(PlannedTensor(name, TORCH_TO_ST[od], info.shape))
            jobs.append(("cast", info))
        else:
            planned.append(PlannedTensor(name, info.dtype, info.shape))
            jobs.append(("copy", info))
    def fill(shards):
        with torch.inference_mode():
            for kind, job in jobs:
                if kind == "cast":
                    pos = 0
                    for _, t in iter_row_chunks(job):
                        t = t.to(od)
                        shards[job.name].write(job.name, t, pos)
                        pos += t.numel() * t.element_size()
                    continue
                if kind == "copy":
                    copy_tensor(job, shards[job.name])
                    continue
                m, n, k = job
                name = m.name + ".weight"
                pos = 0
                try:
                    for _, _, dense in dense_row_chunks(m, chunk_elems):
                        dense = dense.to(od)
                        shards[name].write(name, dense, pos)
                        pos += dense.numel() * dense.element_size()
                except (KeyError, ValueError, RuntimeError) as e:
                    raise BadInputError(f"cannot dequantize ({m.format}): {e}", file=str(next(iter(m.parts.values())).file), tensor=name) from e

    def config():
        cfg = copy.deepcopy(ckpt.config)
        cfg.pop("quantization_config", None)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"].pop("quantization_config", None)
        return cfg

    total = write_checkpoint(src, out, planned, max_shard_size=parse_size(max_shard_size), overwrite=overwrite, fill=fill,
                             config=config, skip={"ctconvert-provenance.json"})
    return {"output": str(out), "modules_decompressed": len(done_modules), "dtype": dtype, "input_bytes": ckpt.total_bytes,
            "output_bytes": total, "seconds": round(time.perf_counter() - t0, 3)}
