"""The protocol (ctconvert/sources/base.py): the lossless-or-requantize choice of each format, made from the
opened source (:meth:`Source.lossless_scheme`), the groups the lossless conversions write, the module attributes
that replace switches on the module kind."""

from __future__ import annotations

import foreign_formats as ff
import pytest

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import UnsupportedError
from ctconvert.formats import CompressionFormat
from ctconvert.sources import open_source
from ctconvert.sources.base import GroupSpec, preset_key


def _opened(path):
    return open_source(open_checkpoint(path, strict=True))


@pytest.mark.parametrize(
    "make, scheme, want",
    [
        (lambda p: ff.awq_checkpoint(p)[0], "W4A16_ASYM", (True, None)),
        (lambda p: ff.awq_checkpoint(p)[0], " w4a16_asym ", (True, None)),
        (lambda p: ff.awq_checkpoint(p)[0], "W4A16", (False, None)),
        (lambda p: ff.gptq_checkpoint(p)[0], "W4A16", (True, None)),
        (lambda p: ff.gptq_checkpoint(p, bits=8)[0], "W8A16", (True, None)),
        (lambda p: ff.gptq_checkpoint(p, sym=False)[0], "W4A16", (False, None)),
        (lambda p: ff.modelopt_checkpoint(p)[0], "NVFP4", (True, None)),
        (lambda p: ff.modelopt_checkpoint(p)[0], "NVFP4A16", (True, None)),
        (lambda p: ff.modelopt_checkpoint(p)[0], "W4A16", (False, None)),
        (lambda p: ff.deepseek_checkpoint(p), "FP8_BLOCK", (False, None)),
    ],
)
def test_the_lossless_choice_of_each_format(tmp_path, make, scheme, want):
    assert _opened(make(tmp_path / "src")).lossless_scheme(scheme) == want


def test_act_order_gptq_is_its_scheme_but_requantized(tmp_path):
    ok, why = _opened(ff.gptq_checkpoint(tmp_path / "src", act_order=True)[0]).lossless_scheme("W4A16")
    assert not ok and why.endswith("requantize with quantize --scheme instead") and ".qweight: act-order" in why


def test_modelopt_fused_members_with_different_global_scales_are_requantized(tmp_path):
    ok, why = _opened(ff.modelopt_checkpoint(tmp_path / "src", fused_scale_2=False)[0]).lossless_scheme("NVFP4A16")
    assert not ok and "has a different weight_scale_2 per member" in why and why.endswith("each fused set requantized to one shared global scale")


def test_the_groups_the_lossless_conversions_write(tmp_path):
    awq = _opened(ff.awq_checkpoint(tmp_path / "awq")[0])
    spec = awq.format.lossless(awq)
    assert (spec.name, spec.format, spec.inputs) == ("W4A16_ASYM", CompressionFormat.PACK_QUANTIZED.value, None)
    assert spec.weights == {"num_bits": 4, "type": "int", "symmetric": False, "group_size": 128, "strategy": "group", "dynamic": False}
    mo = _opened(ff.modelopt_checkpoint(tmp_path / "mo")[0])
    assert mo.format.lossless(mo).name == "NVFP4" and mo.format.lossless(mo, "NVFP4A16").inputs is None
    assert mo.format.lossless(mo, "W8A16") is None
    fp8 = _opened(ff.deepseek_checkpoint(tmp_path / "fp8"))
    assert fp8.format.lossless(fp8) is None and fp8.format.no_lossless


def test_modules_of_one_source_with_different_group_sizes_are_refused(tmp_path):
    awq = _opened(ff.awq_checkpoint(tmp_path / "awq")[0])
    first = next(iter(awq.modules.values()))
    first.args = {**first.args, "group_size": 64}
    with pytest.raises(UnsupportedError, match="awq modules with different bits/group sizes"):
        awq.lossless_scheme("W4A16_ASYM")


def test_module_bits_group_size_and_block(tmp_path):
    """What inspect reports and requantize's notes compare (no switch on the module kind)."""
    mods = {
        "awq": _opened(ff.awq_checkpoint(tmp_path / "awq")[0]),
        "gptq": _opened(ff.gptq_checkpoint(tmp_path / "gptq", bits=8)[0]),
        "modelopt": _opened(ff.modelopt_checkpoint(tmp_path / "mo")[0]),
        "fp8": _opened(ff.deepseek_checkpoint(tmp_path / "fp8")),
    }
    got = {k: {(m.bits, m.group_size, None if m.block is None else tuple(m.block)) for m in s.modules.values()} for k, s in mods.items()}
    assert got == {"awq": {(4, 128, None)}, "gptq": {(8, 128, None)}, "modelopt": {(4, 16, None)}, "fp8": {(8, None, (128, 128))}}


def test_group_spec_and_preset_key():
    spec = GroupSpec("W4A16", CompressionFormat.PACK_QUANTIZED.value, {"num_bits": 4})
    assert spec.config_group(["Linear"]) == {
        "targets": ["Linear"],
        "weights": {"num_bits": 4},
        "input_activations": None,
        "output_activations": None,
        "format": CompressionFormat.PACK_QUANTIZED.value,
    }
    assert preset_key(" nvfp4a16 ") == "NVFP4A16"
