"""``ctconvert repack``: compressed-tensors <-> kernel-native layouts, module by module.

Forward (``--target marlin`` or ``cutlass-nvfp4``): every quantized module
whose format the target kernel takes is rebuilt in the layout vLLM would build
at load time (:mod:`ctconvert.layouts.targets`); other tensors are copied.
The output carries its own tag so that no loader mistakes it for plain
compressed-tensors (it would repack a second time, kernel-layouts.md §10):

    "quantization_config": {
        "quant_method": "ctconvert-kernel-native", "format": "kernel-native",
        "target": ..., "layout_version": ..., "act_dtype": ...,
        "modules": {module: {"kernel": ..., sizes, padding, ...}},
        "source_quantization_config": {the compressed-tensors config}}

Inverse (``--target compressed-tensors`` on such a checkpoint) rebuilds the
compressed-tensors tensors bit for bit from each module's record.

Modules of one kernel and shape are repacked together (:mod:`.layouts.batched`:
one Triton launch per shape on a GPU, module by module on the CPU), in batches
of at most 1 GiB of source tensors on a GPU (64 MiB on the CPU); memory is one
batch, its output, and their host copies.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from .checkpoint.reader import CONFIG_NAME, open_checkpoint
from .checkpoint.safetensors_io import DTYPES, TORCH_TO_ST, PlannedTensor, copy_tensor, read_tensor
from .checkpoint.writer import check_output_path, parse_size, write_checkpoint
from .errors import BadInputError, UnsupportedError, UsageError
from .layouts import batched, targets
from .modules import modules_of
from .pipeline import resolve_device

KERNEL_NATIVE = "ctconvert-kernel-native"
TARGETS = ("marlin", "cutlass-nvfp4", "compressed-tensors")
_BATCH_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # source bytes repacked together per launch
ACT_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def is_kernel_native(qcfg: dict | None) -> bool:
    """Whether a ``quantization_config`` is ctconvert's kernel-native tag."""
    return (qcfg or {}).get("quant_method") == KERNEL_NATIVE


def kernel_native_config(qcfg: dict, target: str, layout_version: str, act_dtype: str, records: dict) -> dict:
    """The ``quantization_config`` of a kernel-native checkpoint (module docstring)."""
    return {
        "quant_method": KERNEL_NATIVE,
        "format": "kernel-native",
        "target": target,
        "layout_version": layout_version,
        "act_dtype": str(ACT_DTYPES[act_dtype]).replace("torch.", ""),
        "note": "tensors are already in the kernel's layout: a compressed-tensors loader must not repack them; "
                "`ctconvert repack --target compressed-tensors` restores the source",
        "modules": records,
        "source_quantization_config": qcfg,
    }


def _check_options(target: str, act_dtype: str, layout_version: str) -> None:
    if target not in TARGETS:
        raise UsageError(f"unknown --target {target!r}; choose one of {', '.join(TARGETS)}")
    if act_dtype not in ACT_DTYPES:
        raise UsageError(f"unknown --act-dtype {act_dtype!r}; choose bf16 or fp16")
    if layout_version not in targets.LAYOUT_VERSIONS:
        raise UsageError(f"unknown --layout-version {layout_version!r}; choose one of {', '.join(targets.LAYOUT_VERSIONS)}")


class KernelTarget:
    """``quantize --target`` in one pass: each module is repacked as soon as it is quantized.

    :meth:`plan` rewrites a quantize plan so that each quantized module's
    compressed-tensors outputs are replaced, in place, by its kernel tensors
    (planned on meta tensors, as ``repack`` does); the executor then hands each
    finished module's tensors (on its device) to the instance, which returns the
    kernel tensors. The tensors and config equal ``quantize`` followed by
    ``repack``, bit for bit, without the intermediate checkpoint (tensors may
    sit at other offsets: the plan's order is kept).
    """

    def __init__(self, target: str, layout_version: str = targets.DEFAULT_LAYOUT_VERSION, act_dtype: str = "bf16"):
        _check_options(target, act_dtype, layout_version)
        if target == "compressed-tensors":
            raise UsageError("--target compressed-tensors is what quantize writes already; leave --target out")
        self.target, self.layout_version, self.act_dtype = target, layout_version, act_dtype
        self.records: dict[str, dict] = {}
        self.kernels: dict[str, tuple[str, dict, str]] = {}

    def plan(self, plan, ckpt, qcfg: dict):
        """A copy of ``plan`` whose quantize units output kernel tensors. Raises :class:`UnsupportedError`."""
        import dataclasses

        units = []
        for u in plan.units:
            if u.kind != "quantize":
                units.append(u)
                continue
            grp = qcfg["config_groups"][u.group]
            weights, fmt = grp.get("weights") or {}, grp.get("format") or qcfg.get("format")
            by_mod: dict[str, list] = {}
            for o in u.outputs:
                by_mod.setdefault(o[0].rpartition(".")[0], []).append(o)
            outputs = []
            for mod, outs in by_mod.items():
                src = ckpt.tensors[u.sources[u.modules.index(mod)]]
                parts = {name.rpartition(".")[2]: (dt, tuple(shape)) for name, dt, shape in outs}
                kernel = _kernel_for(self.target, mod, fmt, weights, set(parts), src.file.name)
                meta = {p: torch.empty(shape, dtype=DTYPES[dt][0], device="meta") for p, (dt, shape) in parts.items()}
                if "weight_shape" in meta:
                    meta["weight_shape"] = torch.tensor(list(src.shape), dtype=torch.int64)
                kouts, rec = _plan_kernel(kernel, meta, parts, weights, fmt, self.layout_version, ACT_DTYPES[self.act_dtype],
                                          src.file.name, src.name)
                self.records[mod] = rec
                self.kernels[mod] = (kernel, weights, fmt)
                outputs += [(f"{mod}.{p}", TORCH_TO_ST[t.dtype], tuple(t.shape)) for p, t in kouts.items()]
            units.append(dataclasses.replace(u, outputs=outputs))
        return dataclasses.replace(plan, units=units)

    def __call__(self, module: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Kernel tensors of one quantized module (its compressed-tensors tensors, whole, on any device)."""
        kernel, weights, fmt = self.kernels[module]
        outs, recs = batched.repack_batch(kernel, {p: t.unsqueeze(0) for p, t in tensors.items()}, weights, fmt,
                                          self.layout_version, ACT_DTYPES[self.act_dtype])
        self.records[module].update(recs[0])
        return {p: t[0] for p, t in outs.items()}

    def config(self, qcfg: dict) -> dict:
        return kernel_native_config(qcfg, self.target, self.layout_version, self.act_dtype, self.records)


def _load(parts: dict, device: torch.device) -> dict[str, torch.Tensor]:
    return {p: read_tensor(i).to(device) for p, i in parts.items()}


def _kernel_for(target: str, module: str, fmt: str | None, weights: dict, parts: set[str], file: str) -> str:
    """The kernel ``target`` gives this module; :class:`UnsupportedError` naming the module when there is none."""
    kernel = targets.choose_kernel(target, fmt, weights, parts)
    if kernel is None:
        desc = f"{fmt}, {weights.get('type')} {weights.get('num_bits')}-bit {weights.get('strategy')}"
        raise UnsupportedError(f"module {module!r} ({desc}): target {target!r} does not take it; "
                               f"marlin takes int4/int8, FP8 channel/tensor and NVFP4, cutlass-nvfp4 takes NVFP4 W4A4", file=file)
    return kernel


def _plan_kernel(kernel: str, meta_in: dict[str, torch.Tensor], source: dict[str, tuple[str, tuple[int, ...]]], weights: dict,
                 fmt: str | None, layout_version: str, act_dtype: torch.dtype, file: str, tensor: str, values=None):
    """One module's kernel outputs (shapes, dtypes) and its record, planned without reading data when possible.

    The layouts are index math, so they run on the meta tensors ``meta_in``; a layout that needs values
    (e.g. to sort act-order indices) runs on ``values()`` when given. ``source``: part -> (safetensors
    dtype, shape) of the compressed-tensors tensors, kept in the record for the inverse. Raises
    :class:`UnsupportedError` for a shape the kernel rejects.
    """
    try:
        try:
            outs, rec = targets.repack_module(kernel, meta_in, weights, fmt, layout_version, act_dtype)
        except (ValueError, NotImplementedError):
            raise
        except Exception:  # noqa: BLE001 - meta tensors cannot run value-dependent code: use the values
            if values is None:
                raise
            outs, rec = targets.repack_module(kernel, values(), weights, fmt, layout_version, act_dtype)
    except (ValueError, NotImplementedError) as e:
        raise UnsupportedError(f"cannot repack for {kernel}: {e}", file=file, tensor=tensor) from e
    rec["source_tensors"] = {p: [dt, list(shape)] for p, (dt, shape) in source.items()}
    rec["tensors"] = sorted(outs)
    return outs, rec


def repack(src: str | Path, out: str | Path, target: str, *, layout_version: str = targets.DEFAULT_LAYOUT_VERSION,
           act_dtype: str = "bf16", device: str = "auto", max_shard_size: str | int = "5GB", overwrite: bool = False) -> dict:
    """Rewrite ``src`` for ``target``; see the module docstring. Returns a summary dict.

    Raises :class:`UsageError` (unknown target or dtype), :class:`UnsupportedError`
    (a module the target kernel cannot take, or an input that is neither
    compressed-tensors nor ctconvert kernel-native) and the usual I/O errors.
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    _check_options(target, act_dtype, layout_version)
    dev = resolve_device(device)
    ckpt = open_checkpoint(src, strict=True)
    qcfg = ckpt.quantization_config or {}
    inverse = is_kernel_native(qcfg)
    if inverse and target != "compressed-tensors":
        raise UsageError("input is already kernel-native; repack --target compressed-tensors first", file=src)
    if not inverse and qcfg.get("quant_method") != "compressed-tensors":
        raise UnsupportedError("input is neither compressed-tensors nor ctconvert kernel-native", file=src / CONFIG_NAME)
    if not inverse and target == "compressed-tensors":
        raise UsageError("input is already compressed-tensors", file=src)
    check_output_path(src, out, overwrite)

    jobs: list[tuple[str, object]] = []
    planned: list[PlannedTensor] = []
    records: dict[str, dict] = {}
    order = sorted(ckpt.tensors, key=lambda n: (str(ckpt.tensors[n].file), ckpt.tensors[n].start))
    if inverse:
        records_in = qcfg.get("modules") or {}
        owned = {f"{m}.{p}" for m, rec in records_in.items() for p in rec["tensors"]}
        seen = set()
        for name in order:
            mod = name.rpartition(".")[0]
            if name in owned:
                if mod in seen:
                    continue
                seen.add(mod)
                rec = records_in[mod]
                shapes = rec["source_tensors"]
                for p, (dt, shape) in shapes.items():
                    planned.append(PlannedTensor(f"{mod}.{p}", dt, tuple(shape)))
                jobs.append(("inverse", (mod, rec)))
                continue
            info = ckpt.tensors[name]
            planned.append(PlannedTensor(name, info.dtype, info.shape))
            jobs.append(("copy", info))
    else:
        mods = modules_of(ckpt)
        batches: dict[tuple, list] = {}  # same kernel and shapes: repacked together (layouts.batched)
        seen = set()
        for name in order:
            mod, _, part = name.rpartition(".")
            m = mods.get(mod)
            if m is not None and m.quantized and m.group:
                if mod in seen:
                    continue
                seen.add(mod)
                file = ckpt.tensors[name].file.name
                kernel = _kernel_for(target, mod, m.format, m.weights or {}, set(m.parts), file)
                with torch.device("meta"):
                    meta_in = {p: torch.empty(i.shape, dtype=i.torch_dtype) for p, i in m.parts.items()}
                outs, rec = _plan_kernel(kernel, meta_in, {p: (i.dtype, i.shape) for p, i in m.parts.items()}, m.weights or {}, m.format,
                                         layout_version, ACT_DTYPES[act_dtype], file, name,
                                         values=lambda m=m: _load(m.parts, torch.device("cpu")))
                records[mod] = rec
                for p, t in outs.items():
                    planned.append(PlannedTensor(f"{mod}.{p}", TORCH_TO_ST[t.dtype], tuple(t.shape)))
                sig = (kernel, m.format, json.dumps(m.weights or {}, sort_keys=True), rec["size_n"], rec["size_k"],
                       tuple(sorted((p, i.dtype, tuple(i.shape)) for p, i in m.parts.items())))
                batches.setdefault(sig, []).append(m)
                continue
            info = ckpt.tensors[name]
            planned.append(PlannedTensor(name, info.dtype, info.shape))
            jobs.append(("copy", info))
        cap = _BATCH_BYTES[dev.type]
        for sig, ms in batches.items():
            size = sum(i.nbytes for i in ms[0].parts.values())
            step = max(1, cap // max(size, 1))
            jobs.extend(("forward", (sig[0], ms[i:i + step])) for i in range(0, len(ms), step))

    def fill(shards):
        with torch.inference_mode():
            for kind, job in jobs:
                if kind == "copy":
                    copy_tensor(job, shards[job.name])
                    continue
                if kind == "forward":
                    kernel, ms = job
                    m = ms[0]
                    vals = {p: torch.stack([read_tensor(x.parts[p]) for x in ms]).to(dev) for p in m.parts}
                    outs, recs = batched.repack_batch(kernel, vals, m.weights or {}, m.format, layout_version, ACT_DTYPES[act_dtype])
                    outs = {p: t.cpu() for p, t in outs.items()}
                    for i, x in enumerate(ms):
                        records[x.name].update(recs[i])  # value-dependent fields (e.g. scale factors) come from the real run
                        for p, t in outs.items():
                            shards[f"{x.name}.{p}"].write(f"{x.name}.{p}", t[i])
                    continue
                else:
                    mod, rec = job
                    vals = {p: read_tensor(ckpt.tensors[f"{mod}.{p}"]).to(dev) for p in rec["tensors"]}
                    try:
                        outs = targets.unrepack_module(vals, rec)
                    except ValueError as e:
                        raise BadInputError(f"cannot invert {rec.get('kernel')}: {e}", tensor=mod) from e
                for p, t in outs.items():
                    name = f"{mod}.{p}"
                    shards[name].write(name, t.cpu())

    def config():
        cfg = copy.deepcopy(ckpt.config)
        if inverse:
            cfg["quantization_config"] = qcfg["source_quantization_config"]
        else:
            cfg["quantization_config"] = kernel_native_config(qcfg, target, layout_version, act_dtype, records)
        return cfg

    total = write_checkpoint(src, out, planned, max_shard_size=parse_size(max_shard_size), overwrite=overwrite, fill=fill, config=config)
    n = len(records) if not inverse else sum(1 for k, _ in jobs if k == "inverse")
    return {"output": str(out), "target": target, "layout_version": layout_version, "modules": n, "input_bytes": ckpt.total_bytes,
            "output_bytes": total, "device": str(dev), "seconds": round(time.perf_counter() - t0, 3)}
