"""The ``--target`` table: its rows, the one option check, kernel choice, and marlin-24 as a format the target packs."""

from __future__ import annotations

import re

import pytest
import torch

from ctconvert.errors import UsageError
from ctconvert.formats import FORMATS, CompressionFormat, WeightArgs
from ctconvert.layouts import kernels, marlin24
from ctconvert.plan import kernel_targets as kt

W4A16 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True}


def test_choice_lists_are_the_cli_spellings():
    assert kt.QUANTIZE_TARGETS == ("marlin", "cutlass-nvfp4", "cutlass-2of4", "cutlass-2of4-sm80", "marlin-24")
    assert kt.REPACK_TARGETS == ("marlin", "cutlass-nvfp4", "cutlass-2of4", "cutlass-2of4-sm80", "compressed-tensors")
    assert kt.CT_FORMAT_TARGETS == (CompressionFormat.MARLIN_24,)


def test_every_kernel_has_one_target_and_a_unique_name():
    owners = [k.name for t in kt.TARGETS.values() for k in t.kernels]
    assert len(owners) == len(set(owners)) == len(kt.KERNELS)
    assert kt.kernel_named("cutlass-2of4").layout is kt.sparse24.SM90
    assert kt.kernel_named("cutlass-2of4-sm80").layout is kt.sparse24.SM80
    with pytest.raises(ValueError, match="unknown kernel 'marlin-24'"):  # a format, not a kernel
        kt.kernel_named("marlin-24")


@pytest.mark.parametrize(
    "args, message",
    [
        (("tpu", "bf16", "0.33"), "unknown --target 'tpu'; choose one of marlin, cutlass-nvfp4, cutlass-2of4, cutlass-2of4-sm80, marlin-24, compressed-"),
        (("marlin", "fp8", "0.33"), "act"),
        (("marlin", "bf16", "0.1"), "unknown --layout-version '0.1'; choose one of 0.33, 0.32"),
        (("compressed-tensors", "bf16", "0.1"), "unknown --layout-version"),
    ],
)
def test_check_target_refuses(args, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        kt.check_target(*args)


def test_check_target_gives_the_activation_dtype():
    assert kt.check_target("marlin", "fp16", "0.29") == torch.float16
    assert kt.check_target(kt.INVERSE_TARGET, "bf16", kernels.DEFAULT_LAYOUT_VERSION) == torch.bfloat16


def test_choose_kernel_by_target_row():
    assert kt.choose_kernel("marlin", W4A16, {"weight_packed", "weight_scale", "weight_shape"}) is kernels.MARLIN_INT
    assert kt.choose_kernel("cutlass-nvfp4", W4A16, {"weight_packed", "weight_scale"}) is None
    assert kt.choose_kernel("cutlass-2of4-sm80", {"num_bits": 8}, {"compressed", "bitmask", "shape"}) is kt.CUTLASS_2OF4_SM80
    assert kt.choose_kernel("marlin-24", W4A16, {"weight", "weight_scale"}) is None  # no kernel: its format is packed
    assert kt.choose_kernel("nope", W4A16, {"weight"}) is None


def test_marlin24_is_a_format_the_target_packs():
    t = kt.TARGETS["marlin-24"]
    assert t.inverse is None and t.kernels == () and t.packs("marlin-24") and not t.packs("pack-quantized")
    n, k = 256, 512
    gen = torch.Generator().manual_seed(0)
    q = (torch.randint(-8, 8, (n, k), generator=gen) * (torch.arange(k) % 4 < 2)).to(torch.int8)
    s = torch.rand(n, k // 128, generator=gen).to(torch.float16)
    extra = torch.ones(3)
    out = t.pack({"weight": q, "weight_scale": s, "input_scale": extra}, W4A16)
    assert out.keys() == {"weight_packed", "meta", "scale_packed", "input_scale"} and out["input_scale"] is extra
    ref = marlin24.marlin24_pack(q, s, 128)
    assert all(torch.equal(out[p], ref[p]) for p in ref)
    planned = t.packed_outputs({"weight": None, "weight_scale": None, "input_scale": (torch.float32, (3,))}, (n, k), W4A16)
    assert {p: (x.dtype, tuple(x.shape)) for p, x in out.items()} == planned
    assert planned.keys() - {"input_scale"} == set(FORMATS[CompressionFormat.MARLIN_24].required)
    assert FORMATS[CompressionFormat.MARLIN_24].packed_outputs((n, k), WeightArgs.from_dict(W4A16))["scale_packed"] == (torch.float16, (4, n))


def test_format_releases_are_keyed_by_format():
    assert set(kt.FORMAT_RELEASES) == {CompressionFormat.SPARSE_24_BITMASK, CompressionFormat.MARLIN_24}
    assert [n for n, t in kt.TARGETS.items() if t.releases] == ["cutlass-2of4", "cutlass-2of4-sm80"]
