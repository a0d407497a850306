"""Verify a compressed-tensors checkpoint: structure, values, and (with a reference) error per tensor.

Structure: the folder validates (index, shards, no duplicates); the config
says ``quant_method: compressed-tensors`` and ``quantization_status:
compressed``; every quantized module is explained by a config group and has
its format's tensors; every dense Linear is in ``ignore``; NVFP4 fused sets
share one global scale (compressed-tensors-format.md §9.1); no float tensor
holds NaN/inf and no E4M3 byte is NaN (0x7F/0xFF, field-notes report 2).

With ``reference`` (the dense source): every quantized weight is dequantized
and compared (relative L2, max abs, SNR in dB) against a per-format threshold;
every other tensor must equal its source exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .checkpoint.reader import Problem, open_checkpoint
from .checkpoint.safetensors_io import iter_row_chunks, read_bytes, read_rows, read_tensor
from .errors import UsageError
from .modules import ACT_PARTS, QUANT_PARTS, dense_row_chunks, dense_shape, fused_global_scales, modules_of, natural_key
from .plan import _find_embedding
from .repack import is_kernel_native

#: largest relative L2 error accepted per (type, bits) of the weights
THRESHOLDS = {("float", 8): 0.08, ("int", 8): 0.04, ("int", 4): 0.25, ("float", 4): 0.30}
REQUIRED = {
    "pack-quantized": ("weight_packed", "weight_scale", "weight_shape"),
    "nvfp4-pack-quantized": ("weight_packed", "weight_scale", "weight_global_scale"),
    "mxfp4-pack-quantized": ("weight_packed", "weight_scale"),
    "float-quantized": ("weight", "weight_scale"),
    "int-quantized": ("weight", "weight_scale"),
    "naive-quantized": ("weight", "weight_scale"),
}
CHUNK = 16 * 2**20


def _threshold(weights: dict) -> float:
    return THRESHOLDS.get((weights.get("type"), int(weights.get("num_bits") or 0)), 0.3)


def verify_kernel_native(ckpt, path: Path, reference: str | Path | None) -> dict:
    """Round trip of every kernel-native module: invert, re-apply, compare bit for bit; with a reference
    (the compressed-tensors source), the inverse must equal it bit for bit."""
    from .layouts import targets

    problems: list[Problem] = list(ckpt.problems)
    q = ckpt.quantization_config
    ref = open_checkpoint(reference, strict=True) if reference is not None else None
    if ref is not None and (ref.quantization_config or {}).get("quant_method") != "compressed-tensors":
        raise UsageError("a kernel-native checkpoint is verified against its compressed-tensors source (the checkpoint "
                         "`repack` read or `quantize` would write), not a dense one; or verify "
                         "`repack --target compressed-tensors` of it against the dense model", file=reference)
    rows = []
    src_cfg = q.get("source_quantization_config") or {}
    groups = src_cfg.get("config_groups") or {}
    for mod, rec in (q.get("modules") or {}).items():
        try:
            stored = {p: read_tensor(ckpt.tensors[f"{mod}.{p}"]) for p in rec["tensors"]}
            back = targets.unrepack_module(stored, rec)
            g = next(iter(groups.values()), {}) if groups else {}
            from .modules import resolve_group

            gname = resolve_group(mod, src_cfg, True)
            g = groups.get(gname, g)
            again, _ = targets.repack_module(rec["kernel"], back, g.get("weights") or {}, g.get("format") or src_cfg.get("format"),
                                             rec["layout_version"], getattr(torch, q.get("act_dtype", "bfloat16")))
        except (KeyError, ValueError) as e:
            problems.append(Problem("error", f"cannot invert: {e}", tensor=mod))
            continue
        same = all(torch.equal(again[p].reshape(-1).view(torch.uint8), stored[p].contiguous().reshape(-1).view(torch.uint8)) for p in stored)
        if not same:
            problems.append(Problem("error", "round trip (invert, then repack) does not give the stored bytes", tensor=mod))
        ref_ok = None
        if ref is not None:
            ref_ok = True
            for p, t in back.items():
                r = ref.tensors.get(f"{mod}.{p}")
                if r is None or r.dtype != _st(t) or tuple(r.shape) != tuple(t.shape) or \
                        not torch.equal(read_tensor(r).reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)):
                    ref_ok = False
                    problems.append(Problem("error", f"inverse of {p} differs from the reference", tensor=mod))
                    break
        rows.append({"module": mod, "kernel": rec["kernel"], "round_trip": same, "equals_reference": ref_ok})
    errors = [p for p in problems if p.severity == "error"]
    return {"path": str(path), "reference": str(reference) if reference else None, "ok": not errors,
            "problems": [p.to_dict() for p in problems], "tensors": [], "modules": rows}


def _st(t: torch.Tensor) -> str:
    from .checkpoint.safetensors_io import TORCH_TO_ST

    return TORCH_TO_ST[t.dtype]


def verify(path: str | Path, reference: str | Path | None = None) -> dict:
    """Return the verification report (``ok`` is the verdict)."""
    path = Path(path)
    ckpt = open_checkpoint(path, strict=False)
    if is_kernel_native(ckpt.quantization_config):
        return verify_kernel_native(ckpt, path, reference)
    problems: list[Problem] = list(ckpt.problems)
    qcfg = ckpt.quantization_config

    def err(msg, tensor=None, file=None):
        problems.append(Problem("error", msg, file, tensor))

    if not qcfg:
        err("config.json has no quantization_config", file=str(path / "config.json"))
        qcfg = {}
    else:
        if qcfg.get("quant_method") != "compressed-tensors":
            err(f"quant_method is {qcfg.get('quant_method')!r}, not 'compressed-tensors'")
        if qcfg.get("quantization_status") != "compressed":
            err(f"quantization_status is {qcfg.get('quantization_status')!r}; transformers then initializes weights randomly")
    mods = modules_of(ckpt)
    for m in mods.values():
        if m.quantized:
            if m.group is None:
                err("quantized tensors that no config group explains (or listed in ignore)", tensor=m.name)
                continue
            missing = [p for p in REQUIRED.get(m.format or "", ()) if p not in m.parts]
            if m.format not in REQUIRED:
                err(f"unknown format {m.format!r}", tensor=m.name)
            elif missing:
                err(f"format {m.format} needs {', '.join(missing)}", tensor=m.name)
        elif m.group is not None and "weight" in m.parts:
            err(f"dense Linear weight matched by config group {m.group!r} but not in ignore", tensor=m.name)
    for fused_set, vals in fused_global_scales(mods).items():
        if len(set(vals.values())) > 1:
            err(f"fused set members have different NVFP4 global scales {vals}", tensor=fused_set)
    # values: NaN/inf in float tensors, NaN bytes in E4M3 tensors
    for name, info in ckpt.tensors.items():
        if info.dtype in ("BF16", "F16", "F32", "F64", "F8_E4M3"):
            bad = 0
            for _, t in iter_row_chunks(info, CHUNK):
                if info.dtype == "F8_E4M3":
                    b = t.view(torch.uint8)
                    bad += int(((b & 0x7F) == 0x7F).sum())
                else:
                    bad += int((~torch.isfinite(t)).sum())
            if bad:
                err(f"{bad} NaN/inf values" + (" (E4M3 NaN bytes 0x7F/0xFF)" if info.dtype == "F8_E4M3" else ""), tensor=name, file=str(info.file))
    rows_out = []
    if reference is not None:
        ref = open_checkpoint(reference, strict=True)
        emb = _find_embedding(ref.tensors)
        for m in sorted(mods.values(), key=lambda m: natural_key(m.name)):
            if not (m.quantized and m.group is not None and m.format in REQUIRED):
                continue
            src = ref.tensors.get(m.name + ".weight")
            if src is None and m.name.endswith("lm_head") and emb:
                src = ref.tensors[emb]
            if src is None:
                err("no reference weight for this module", tensor=m.name)
                continue
            n, k = dense_shape(m)
            if tuple(src.shape) != (n, k):
                err(f"shape {n}x{k} differs from the reference {list(src.shape)}", tensor=m.name)
                continue
            se = sr = 0.0
            mx = 0.0
            for r0, r1, got in dense_row_chunks(m, CHUNK):
                got = got.float()
                want = read_rows(src, r0, r1).float()
                d = got - want
                se += float((d * d).sum())
                sr += float((want * want).sum())
                mx = max(mx, float(d.abs().max()) if d.numel() else 0.0)
            rel = math.sqrt(se / sr) if sr > 0 else (0.0 if se == 0 else math.inf)
            snr = 10 * math.log10(sr / se) if se > 0 and sr > 0 else math.inf
            limit = _threshold(m.weights or {})
            ok = rel <= limit
            rows_out.append({"module": m.name, "format": m.format, "rel_l2": rel, "max_abs": mx, "snr_db": snr, "threshold": limit, "ok": ok})
            if not ok:
                err(f"relative L2 error {rel:.4f} exceeds {limit} for {m.format}", tensor=m.name)
        # tensors that are not quantized weights must equal the source
        for name, info in ckpt.tensors.items():
            mod, _, part = name.rpartition(".")
            mm = mods.get(mod)
            if mm is not None and mm.quantized and (part in QUANT_PARTS or part in ACT_PARTS or part == "weight"):
                continue
            s = ref.tensors.get(name)
            if s is None:
                err("tensor not in the reference", tensor=name)
                continue
            if s.dtype != info.dtype or s.shape != info.shape:
                err(f"{info.dtype}{list(info.shape)} differs from the reference {s.dtype}{list(s.shape)}", tensor=name)
                continue
            same = True
            for b0 in range(0, info.nbytes, CHUNK):
                nb = min(CHUNK, info.nbytes - b0)
                if not torch.equal(read_bytes(info, b0, nb), read_bytes(s, b0, nb)):
                    same = False
                    break
            if not same:
                err("bytes differ from the reference (a pass-through tensor was changed)", tensor=name)
        # and nothing of the reference is missing from the output
        quant_weights = {m.name + ".weight" for m in mods.values() if m.quantized}
        for name in ref.tensors:
            if name not in ckpt.tensors and name not in quant_weights:
                err("tensor of the reference is missing from the output", tensor=name)
    errors = [p for p in problems if p.severity == "error"]
    return {
        "path": str(path),
        "reference": str(reference) if reference else None,
        "ok": not errors,
        "problems": [p.to_dict() for p in problems],
        "tensors": rows_out,
    }
