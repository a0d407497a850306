"""``ctconvert repack``: compressed-tensors <-> kernel-native layouts, module by module.

Forward (``--target marlin`` or ``cutlass-nvfp4``): every quantized module
whose weights the target kernel takes is rebuilt in the layout vLLM would
build at load time (:mod:`ctconvert.layouts.kernels`); other tensors are
copied; the output carries the kernel-native tag
(:mod:`ctconvert.checkpoint.kernel_native`). Inverse (``--target
compressed-tensors`` on such a checkpoint) rebuilds the compressed-tensors
tensors bit for bit from each module's record.

Reads top to bottom: check the input -> plan every output tensor (kernels
planned on meta tensors) -> run the copy and repack tasks -> write the config.
Modules of one kernel and shape are repacked together
(:mod:`ctconvert.layouts.batched`: one Triton launch per shape on a GPU,
module by module on the CPU), in batches of at most 1 GiB of source tensors
on a GPU (64 MiB on the CPU); memory is one batch, its output, and their host
copies.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from ..checkpoint.config import require_compressed_tensors
from ..checkpoint.conformance import contradictions, refuse
from ..checkpoint.kernel_native import is_kernel_native, kernel_native_config
from ..checkpoint.modules import Module, dense_shape, modules_of
from ..checkpoint.reader import CONFIG_NAME, Checkpoint, open_checkpoint
from ..checkpoint.safetensors_io import DTYPES, read_tensor
from ..checkpoint.shard_file import PlannedTensor
from ..checkpoint.writer import OutputFolder, assign_shards, check_output_path, parse_size
from ..errors import BadInputError, UsageError
from ..layouts import batched, kernels
from ..layouts.kernels import Kernel
from ..options import DEFAULT_SHARD_SIZE
from ..pipeline.devices import resolve_device
from ..pipeline.tasks import Compute, CopyTensor, run_tasks
from ..plan import kernel_targets
from ..plan.kernel_targets import INVERSE_TARGET, check_target
from ..stages.layout import KernelPlanner

__all__ = ["repack"]

_BATCH_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # source bytes repacked together per launch


def repack(
    src: str | Path,
    out: str | Path,
    target: str,
    *,
    layout_version: str = kernels.DEFAULT_LAYOUT_VERSION,
    act_dtype: str = "bf16",
    device: str = "auto",
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress=None,
) -> dict:
    """Rewrite ``src`` for ``target``; see :func:`ctconvert.api.repack`. Returns a summary dict.
    ``progress``: a callable ``(total_bytes) -> context manager with .update(n)``, told every output byte."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    check_target(target, act_dtype, layout_version)
    dev = resolve_device(device)
    ckpt = open_checkpoint(src, strict=True)
    qcfg = ckpt.quantization_config or {}
    inverse = _check_input(qcfg, target, src)
    check_output_path(src, out, overwrite)
    order = sorted(ckpt.tensors, key=lambda n: (str(ckpt.tensors[n].file), ckpt.tensors[n].start))
    records: dict[str, dict] = {}
    if inverse:
        planned, tasks = _plan_inverse(ckpt, order, qcfg.get("modules") or {}, dev)
    else:
        mods = modules_of(ckpt)
        refuse(contradictions(mods, qcfg), src / CONFIG_NAME)  # tensors that contradict the config (a 2:4 claim over plain FP8)
        planned, tasks = _plan_forward(ckpt, mods, order, KernelPlanner(target, layout_version, act_dtype, stand_ins="meta"), dev, records)

    def config():
        cfg = copy.deepcopy(ckpt.config)
        if inverse:
            cfg["quantization_config"] = qcfg["source_quantization_config"]
        else:
            cfg["quantization_config"] = kernel_native_config(qcfg, target, layout_version, act_dtype, records)
        return cfg

    total, limit = sum(t.nbytes for t in planned), parse_size(max_shard_size)
    with OutputFolder(out, overwrite=overwrite) as folder:
        run_tasks(tasks, folder.open_shards(assign_shards(planned, limit)), progress=progress, total=total)
        folder.copy_files(src, skip={CONFIG_NAME})
        folder.finish(config(), total)
    n = sum(isinstance(t, Compute) for t in tasks) if inverse else len(records)
    return {
        "output": str(out),
        "target": target,
        "layout_version": layout_version,
        "modules": n,
        "input_bytes": ckpt.total_bytes,
        "output_bytes": total,
        "device": str(dev),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _check_input(qcfg: dict, target: str, src: Path) -> bool:
    """Whether this is the inverse direction; :class:`UsageError` / :class:`UnsupportedError` for an input the target cannot take."""
    inverse = is_kernel_native(qcfg)
    if inverse and target != INVERSE_TARGET:
        raise UsageError("input is already kernel-native; repack --target compressed-tensors first", file=src)
    if not inverse:  # a dense input: quantize --target does both steps in one pass
        fix = f"quantize it with --target {target} (`ctconvert quantize SRC -o OUT -s W4A16 --target {target}`)"
        require_compressed_tensors(qcfg, src / CONFIG_NAME, "repack", fix)
    if not inverse and target == INVERSE_TARGET:
        raise UsageError("input is already compressed-tensors", file=src)
    return inverse


def _plan_inverse(ckpt: Checkpoint, order: list[str], records: dict, dev: torch.device):
    """Output tensors and tasks of kernel-native -> compressed-tensors: each module from its record, the rest copied."""
    owned = {f"{m}.{p}" for m, rec in records.items() for p in rec["tensors"]}
    planned: list[PlannedTensor] = []
    tasks: list = []
    seen: set[str] = set()
    for name in order:
        mod = name.rpartition(".")[0]
        if name not in owned:
            info = ckpt.tensors[name]
            planned.append(PlannedTensor(name, info.dtype, info.shape))
            tasks.append(CopyTensor(info))
        elif mod not in seen:
            seen.add(mod)
            rec = records[mod]
            planned += [PlannedTensor(f"{mod}.{p}", dt, tuple(shape)) for p, (dt, shape) in rec["source_tensors"].items()]
            tasks.append(Compute(lambda mod=mod, rec=rec: _invert(ckpt, mod, rec, dev)))
    return planned, tasks


def _invert(ckpt: Checkpoint, mod: str, rec: dict, dev: torch.device):
    vals = {p: read_tensor(ckpt.tensors[f"{mod}.{p}"]).to(dev) for p in rec["tensors"]}
    try:
        outs = kernel_targets.unrepack_module(vals, rec)
    except ValueError as e:
        raise BadInputError(f"cannot invert {rec.get('kernel')}: {e}", tensor=mod) from e
    for p, t in outs.items():
        yield f"{mod}.{p}", t, 0


def _plan_forward(ckpt: Checkpoint, mods: dict[str, Module], order: list[str], planner: KernelPlanner, dev: torch.device, records: dict):
    """Output tensors and tasks of compressed-tensors -> kernel layout; fills ``records`` (module -> record)."""
    planned: list[PlannedTensor] = []
    tasks: list = []
    batches: dict[tuple, tuple[Kernel, list[Module]]] = {}  # one plan (KernelPlanner's key): repacked together (layouts.batched)
    outputs: dict[str, dict] = {}  # module -> {part: (safetensors dtype, shape)} of its kernel tensors
    seen: set[str] = set()
    for name in order:
        mod = name.rpartition(".")[0]
        m = mods.get(mod)
        if m is None or not m.quantized or not m.group:
            info = ckpt.tensors[name]
            planned.append(PlannedTensor(name, info.dtype, info.shape))
            tasks.append(CopyTensor(info))
            continue
        if mod in seen:
            continue
        seen.add(mod)
        parts = {p: (i.dtype, tuple(i.shape)) for p, i in m.parts.items()}
        kernel, outs, rec, key = planner.plan(mod, m.format, m.weights or {}, parts, dense_shape(m), ckpt.tensors[name].file.name, name)
        records[mod], outputs[mod] = rec, outs
        planned += [PlannedTensor(f"{mod}.{p}", dt, shape) for p, (dt, shape) in outs.items()]
        batches.setdefault(key, (kernel, []))[1].append(m)
    cap = _BATCH_BYTES[dev.type]
    for kernel, ms in batches.values():
        step = max(1, cap // max(sum(i.nbytes for i in ms[0].parts.values()), 1))
        for i in range(0, len(ms), step):
            tasks.append(Compute(lambda kernel=kernel, ms=ms[i : i + step]: _repack_batch(kernel, ms, planner, outputs[ms[0].name], dev, records)))
    return planned, tasks


def _repack_batch(kernel: Kernel, ms: list[Module], planner: KernelPlanner, outputs: dict, dev: torch.device, records: dict):
    m = ms[0]
    v, act = planner.layout_version, planner.act
    if dev.type == "cpu":  # no batched kernels on the CPU: module by module, without stacking the batch in and out (two copies)
        for x in ms:
            outs, rec = kernels.repack_module(kernel, {p: read_tensor(i) for p, i in x.parts.items()}, x.weights or {}, v, act)
            records[x.name].update(rec)
            for p, t in outs.items():
                yield f"{x.name}.{p}", t, 0
        return
    vals = {p: torch.stack([read_tensor(x.parts[p]) for x in ms]).to(dev) for p in m.parts}
    planned = ({p: (DTYPES[dt][0], shape) for p, (dt, shape) in outputs.items()}, records[m.name])  # not planned again
    outs, recs = batched.repack_batch(kernel, vals, m.weights or {}, v, act, planned=planned)
    outs = {p: t.cpu() for p, t in outs.items()}
    for i, x in enumerate(ms):
        records[x.name].update(recs[i])  # value-dependent fields (e.g. scale factors) come from the real run
        for p, t in outs.items():
            yield f"{x.name}.{p}", t[i], 0
