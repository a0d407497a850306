"""The kernel-native artifact: ctconvert's tag for a checkpoint whose tensors are already in a kernel's layout.

Such a checkpoint is not compressed-tensors: a compressed-tensors loader would
repack it a second time (docs/kernel-layouts.md §10). Its
``quantization_config`` says so and keeps what the inverse needs::

    "quantization_config": {
        "quant_method": "ctconvert-kernel-native", "format": "kernel-native",
        "target": ..., "layout_version": ..., "act_dtype": ...,
        "modules": {module: {"kernel": ..., sizes, padding, "tensors": [...], "source_tensors": {...},
                             "copied": [...]}},  # (only when some: the module's tensors kept as they are)
        "source_quantization_config": {the compressed-tensors config}}

``tensors`` lists every tensor the module has in the checkpoint, ``source_tensors``
every compressed-tensors tensor (name -> dtype, shape) the inverse writes back,
``copied`` those of them the kernel does not use, stored unchanged under their
own names (:func:`ctconvert.layouts.kernels.repack_module`).

``repack`` writes it, ``quantize --target`` writes it in one pass, ``inspect``
and ``verify`` read it, ``repack --target compressed-tensors`` undoes it.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from .reader import Checkpoint, Problem

__all__ = ["ACT_DTYPES", "KERNEL_NATIVE", "check_act_dtype", "is_kernel_native", "kernel_native_config", "missing_tensors"]

KERNEL_NATIVE = "ctconvert-kernel-native"
#: ``--act-dtype`` names
ACT_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def is_kernel_native(qcfg: dict | None) -> bool:
    """Whether a ``quantization_config`` is ctconvert's kernel-native tag."""
    return (qcfg or {}).get("quant_method") == KERNEL_NATIVE


def check_act_dtype(act_dtype: str) -> torch.dtype:
    """The torch dtype of an ``--act-dtype`` name. Raises :class:`UsageError`."""
    if act_dtype not in ACT_DTYPES:
        raise UsageError(f"unknown --act-dtype {act_dtype!r}; choose bf16 or fp16")
    return ACT_DTYPES[act_dtype]


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


def missing_tensors(ckpt: Checkpoint, module: str, record: dict) -> Problem | None:
    """An error when a kernel-native module lacks a tensor its record lists."""
    missing = [p for p in record.get("tensors", []) if f"{module}.{p}" not in ckpt.tensors]
    if missing:
        return Problem("error", f"kernel-native module lacks {', '.join(missing)}", tensor=module)
    return None
