"""Custom schemes (issue 17): --group-size, --symmetric/--asymmetric and QuantizationScheme files, bit for bit
like compressed-tensors for every combination accepted; the rest refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from formats.test_bit_exact import assert_same_bytes, make_weight

from ctconvert.checkpoint.config import build_quantization_config
from ctconvert.cli import main
from ctconvert.errors import UsageError
from ctconvert.formats import native
from ctconvert.plan.schemes import custom_scheme, get_scheme, resolve_scheme

from ct_reference import ct_compress
from helpers import stable_seed

COMBOS = [(base, g, sym) for base in ("W4A16", "W8A16") for g in (32, 64, 256) for sym in (True, False)]
IMPLS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not native.available(), reason="no C compiler"))]


def ct_scheme(base: str, group_size: int, symmetric: bool):
    from compressed_tensors.quantization import preset_name_to_scheme

    s = preset_name_to_scheme(base, ["Linear"])
    s.weights.group_size, s.weights.symmetric = group_size, symmetric
    s.format = "pack-quantized"
    return s


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["randn", "zeros", "huge", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("base,group_size,symmetric", COMBOS)
def test_custom_group_and_symmetry_bit_exact(base, group_size, symmetric, dtype, case, impl):
    w = make_weight(case, dtype, 48, 512, stable_seed(base, group_size, symmetric, case, dtype))
    s = custom_scheme(base, group_size, symmetric)
    got = {k: v for k, v in s.quantize_rows(w, None, impl=impl).items()}
    got["weight_shape"] = torch.tensor(list(w.shape))
    assert_same_bytes(ct_compress(w, ct_scheme(base, group_size, symmetric)), got)


@pytest.mark.parametrize("base,group_size,symmetric", COMBOS)
def test_custom_config_matches_compressed_tensors(base, group_size, symmetric):
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig

    s = custom_scheme(base, group_size, symmetric)
    ours = build_quantization_config({"group_0": (s, ["Linear"])}, s.format, ["lm_head"])
    q = QuantizationConfig(
        config_groups={"group_0": ct_scheme(base, group_size, symmetric)}, format="pack-quantized", ignore=["lm_head"], quantization_status="compressed"
    )
    ref = {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors", "sparsity_config": {}, "transform_config": {}}
    assert ours == {**ref, **q.model_dump(exclude=["quant_method"])}


def test_custom_names_and_refusals():
    assert custom_scheme("W4A16", 64, False).name == "W4A16[group_size=64,asymmetric]"
    assert custom_scheme("W4A16", 128, True) is get_scheme("W4A16")  # nothing changed: the preset itself
    assert custom_scheme("W4A16_ASYM", None, True).name == "W4A16_ASYM[symmetric]"
    for name in ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "NVFP4A16", "MXFP4A16"):
        with pytest.raises(UsageError, match=f"apply to the integer weight-only schemes W4A16, W4A16_ASYM, W8A16; {name} fixes its granularity"):
            custom_scheme(name, 64)


def test_scheme_file_json_and_yaml(tmp_path):
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "group_size": 64, "strategy": "group"}
    (tmp_path / "s.json").write_text(json.dumps({"targets": ["Linear"], "weights": weights}))
    (tmp_path / "s.yaml").write_text("weights:\n  num_bits: 4\n  type: int\n  symmetric: false\n  group_size: 64\n  strategy: group\n")
    want = custom_scheme("W4A16", 64, False)
    assert resolve_scheme(str(tmp_path / "s.json")) == want and resolve_scheme(str(tmp_path / "s.yaml")) == want
    (tmp_path / "preset.yaml").write_text(
        "weights: {num_bits: 8, type: int, strategy: channel, symmetric: true}\n"
        "input_activations: {num_bits: 8, type: int, strategy: token, dynamic: true, symmetric: true}\n"
    )
    assert resolve_scheme(str(tmp_path / "preset.yaml")) is get_scheme("W8A8")
    (tmp_path / "bad.yaml").write_text("weights: {num_bits: 3, type: int, strategy: group, group_size: 64}\n")
    with pytest.raises(UsageError, match="is not one ctconvert writes: use a preset"):
        resolve_scheme(str(tmp_path / "bad.yaml"))
    (tmp_path / "invalid.yaml").write_text("weights: {num_bits: 4, type: nope}\n")
    with pytest.raises(UsageError, match="not a valid compressed-tensors QuantizationScheme"):
        resolve_scheme(str(tmp_path / "invalid.yaml"))


def test_cli_group_size_takes_layers_a_576_hidden_size_leaves_dense(tmp_path):
    """SmolLM-style hidden size 576: not a multiple of 128, so at the default group most Linear layers cannot
    be quantized; --group-size 64 takes all of them, and the config says group_size 64."""
    from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

    cfg = dict(LLAMA_CONFIG, hidden_size=576, intermediate_size=1536, head_dim=64, num_attention_heads=9, num_key_value_heads=3)
    m = write_checkpoint(tmp_path / "m", llama_tensors(cfg), cfg)
    r = CliRunner().invoke(main, ["--json", "quantize", str(m), "-s", "W4A16", "--dry-run", "--skip-incompatible"])
    assert r.exit_code == 0 and json.loads(r.stdout)["quantized_modules"] == 2  # only down_proj (K=1536)
    r = CliRunner().invoke(main, ["--json", "quantize", str(m), "-s", "W4A16", "--group-size", "64", "-o", str(tmp_path / "o")])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["quantized_modules"] == 14 and doc["scheme"] == "W4A16[group_size=64]"
    w = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert w["group_size"] == 64 and w["symmetric"] is True
    r = CliRunner().invoke(main, ["quantize", str(m), "-s", "NVFP4A16", "--asymmetric", "-o", str(tmp_path / "o2")])
    assert r.exit_code == 2 and "NVFP4A16 fixes its granularity" in r.stderr
