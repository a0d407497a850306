"""An output checkpoint's tensors beyond its quantized modules, against the reference it was made from.

What ``verify --reference`` requires of every other tensor (:mod:`ctconvert.commands.verify` judges the quantized
modules by value): it comes from the reference with equal bytes, or holds the reference's values cast to another
float dtype (``quantize --dense-dtype``), bit for bit; nothing of the reference is missing but the dense weights of
the quantized modules. Read from the two checkpoints alone, never from the output's plan or provenance.
"""

from __future__ import annotations

import math

import torch

from ..errors import agree, plural
from .modules import ACT_PARTS, KV_PARTS, QUANT_PARTS, Module
from .reader import Checkpoint, Problem
from .safetensors_io import read_bytes

__all__ = ["CHUNK", "compare_others", "same_bytes"]

CHUNK = 16 * 2**20  # bytes compared at a time


_MISSING_SHOWN = 8  # reference tensors missing from the output that are listed one by one


_SHORT = {"F64": "fp64", "F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def compare_others(ckpt: Checkpoint, mods: dict[str, Module], ref: Checkpoint, bar=None) -> list[Problem]:
    """Every output tensor that is not a part of a quantized module must come from the reference: equal bytes,
    or (``quantize --dense-dtype``) the reference's values cast to its floating dtype, bit for bit (``torch``'s
    ``.to``); found from the two checkpoints alone, not from the output's provenance. The KV cache scales of a
    ``kv_cache_scheme`` are explained only on an attention module whose ``k_proj`` and ``v_proj`` the output
    holds. Nothing of the reference may be missing but the dense weights of the quantized modules."""
    out = []
    kv = bool((ckpt.quantization_config or {}).get("kv_cache_scheme"))
    cast = 0
    for name, info in ckpt.tensors.items():
        mod, _, part = name.rpartition(".")
        mm = mods.get(mod)
        if mm is not None and mm.quantized and (part in QUANT_PARTS or part in ACT_PARTS or part == "weight"):
            continue  # checked against the config group's format (verify's module and value checks)
        if part in KV_PARTS and kv and f"{mod}.k_proj" in mods and f"{mod}.v_proj" in mods:
            continue  # calibrated KV cache scales of an attention module
        s = ref.tensors.get(name)
        if s is None:
            why = "; a KV cache scale belongs to an attention module with k_proj and v_proj" if part in KV_PARTS and kv else ""
            out.append(Problem("error", f"tensor not in the reference, and the config does not explain it{why}", tensor=name))
        elif s.shape == info.shape and s.dtype != info.dtype and s.dtype in _SHORT and info.dtype in _SHORT:  # quantize --dense-dtype
            if _same_cast(info, s):
                cast += 1
            else:
                c = f"{_SHORT[s.dtype]}->{_SHORT[info.dtype]}"
                out.append(Problem("error", f"values differ from the reference cast to {info.dtype} ({c}, --dense-dtype)", tensor=name))
        elif s.dtype != info.dtype or s.shape != info.shape:
            out.append(Problem("error", f"{info.dtype}{list(info.shape)} differs from the reference {s.dtype}{list(s.shape)}", tensor=name))
        elif not same_bytes(info, s):
            out.append(Problem("error", "bytes differ from the reference (a pass-through tensor was changed)", tensor=name))
        if s is not None and bar is not None:
            bar.update(s.nbytes)
    if cast:
        held = agree(cast, "holds", "hold")
        out.append(Problem("note", f"{plural(cast, 'tensor')} {held} the reference's values cast to another float dtype (--dense-dtype), bit for bit"))
    quant_weights = {m.name + ".weight" for m in mods.values() if m.quantized}
    missing = [name for name in ref.tensors if name not in ckpt.tensors and name not in quant_weights]
    if len(missing) > _MISSING_SHOWN:  # another model (more layers, other names): one line, not one per tensor
        shown = ", ".join(missing[:3])
        out.append(
            Problem(
                "error",
                f"{len(missing)} tensors of the reference are missing from the output ({shown} ...): is --reference the checkpoint "
                f"this output was made from? (reference: {plural(len(ref.tensors), 'tensor')}, output: {len(ckpt.tensors)})",
            )
        )
    else:
        out += [Problem("error", "tensor of the reference is missing from the output", tensor=name) for name in missing]
    return out


def _same_cast(out, ref) -> bool:
    """``out`` holds ``ref``'s values cast to its dtype (``torch.Tensor.to``), bit for bit."""
    n = math.prod(ref.shape)
    step = max(1, CHUNK // ref.itemsize)
    for e0 in range(0, n, step):
        e1 = min(n, e0 + step)
        want = read_bytes(ref, e0 * ref.itemsize, (e1 - e0) * ref.itemsize).view(ref.torch_dtype).to(out.torch_dtype)
        if not torch.equal(read_bytes(out, e0 * out.itemsize, (e1 - e0) * out.itemsize), want.view(torch.uint8)):
            return False
    return True


def same_bytes(a, b) -> bool:
    for b0 in range(0, a.nbytes, CHUNK):
        nb = min(CHUNK, a.nbytes - b0)
        if not torch.equal(read_bytes(a, b0, nb), read_bytes(b, b0, nb)):
            return False
    return True
