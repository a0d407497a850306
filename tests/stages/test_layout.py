"""The layout stage: one planner (one cache key per module shape) for repack and quantize --target, and marlin-24 packed as a format."""

from __future__ import annotations

import pytest

from ctconvert.errors import UnsupportedError, UsageError
from ctconvert.layouts import kernels
from ctconvert.stages.layout import KernelPlanner, LayoutStage, ModulePlan

W4A16 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True}


def _parts(n: int, k: int) -> dict:
    return {"weight_packed": ("I32", (n, k // 8)), "weight_scale": ("BF16", (n, k // 128)), "weight_shape": ("I64", (2,))}


@pytest.mark.parametrize("stand_ins", ["meta", "zeros"])
def test_one_plan_and_one_key_per_module_shape(stand_ins):
    planner = KernelPlanner("marlin", stand_ins=stand_ins)
    a = planner.plan("a", "pack-quantized", W4A16, _parts(256, 512), (256, 512), "f", "a.weight_packed")
    b = planner.plan("b", "pack-quantized", W4A16, _parts(256, 512), (256, 512), "f", "b.weight_packed")
    c = planner.plan("c", "pack-quantized", W4A16, _parts(256, 1024), (256, 1024), "f", "c.weight_packed")
    assert isinstance(a, ModulePlan) and a.kernel is kernels.MARLIN_INT
    assert a.key == b.key != c.key and a.outputs == b.outputs and a.record == b.record
    a.record["size_n"] = -1  # each caller gets its own copy
    assert b.record["size_n"] == 256 and len(planner._plans) == 2


def test_a_module_the_target_does_not_take_is_named():
    with pytest.raises(UnsupportedError, match="module 'm' .*target 'cutlass-nvfp4' does not take it; marlin takes"):
        KernelPlanner("cutlass-nvfp4").plan("m", "pack-quantized", W4A16, _parts(256, 512), (256, 512), "f", "m.weight_packed")


def test_layout_stage_options():
    with pytest.raises(UsageError, match="is what quantize writes already"):
        LayoutStage("compressed-tensors")
    with pytest.raises(UsageError, match="unknown --target"):
        LayoutStage("tpu")
    stage = LayoutStage("marlin-24")
    assert stage.spec.ct_format == "marlin-24" and stage.config({"format": "marlin-24"}) == {"format": "marlin-24"}
