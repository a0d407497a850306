"""``ctconvert convert``: ModelOpt NVFP4, AutoAWQ and GPTQ re-expressed in compressed-tensors without rounding.

The proof of losslessness: every output weight, dequantized by compressed-tensors' own ``decompress``,
equals the source weight dequantized by the independent reference of ``tests/foreign_formats.py``, bit
for bit; where compressed-tensors ships a converter for the source (``AutoAWQConverter``,
``ModelOptNvfp4Converter``), the output tensors equal its output too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import foreign_formats as ff
import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from safetensors.torch import load_file, save_file

from ctconvert import api
from ctconvert.cli import main
from ctconvert.errors import BadInputError, UnsupportedError, UsageError

from helpers import bitwise_equal


def _out(path) -> dict[str, torch.Tensor]:
    t = {}
    for f in sorted(path.glob("*.safetensors")):
        t.update(load_file(f))
    return t


def _ct_dequantized(out, module: str) -> torch.Tensor:
    """``module``'s weight from the output, through compressed-tensors' decompress with the output's own config group."""
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qcfg)
    group = qcfg["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"], input_activations=group["input_activations"])
    t = _out(out)
    parts = {k.rpartition(".")[2]: v for k, v in t.items() if k.rpartition(".")[0] == module}
    return BaseCompressor.get_value_from_registry(group["format"]).decompress(parts, scheme)["weight"]


def _lossless(out, refs) -> None:
    for mod, ref in refs.items():
        got = _ct_dequantized(out, mod)
        assert got.dtype == ref.dtype and bitwise_equal(got, ref), mod


def _check_common(out, src_cfg: dict) -> dict:
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["quantization_status"] == "compressed"
    assert "lm_head" in q["ignore"]
    t = _out(out)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert name in t
    prov = json.loads((out / "ctconvert-provenance.json").read_text())
    assert prov["conversion"] == "lossless" and prov["derived_from"]["quant_method"] == src_cfg["quant_method"]
    assert api.verify(out)["ok"]
    return q


@pytest.mark.parametrize("group", [128, 64])
def test_awq_converts_losslessly_and_equals_compressed_tensors_converter(tmp_path, group):
    src, refs = ff.awq_checkpoint(tmp_path / "awq", group=group)
    res = api.convert(src, tmp_path / "out")
    assert res.format == "pack-quantized" and res.quantized_modules == len(refs)
    assert res.scheme == ("W4A16_ASYM" if group == 128 else "W4A16_ASYM (group 64)")
    _lossless(tmp_path / "out", refs)
    q = _check_common(tmp_path / "out", {"quant_method": "awq"})
    assert q["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4,
        "type": "int",
        "symmetric": False,
        "group_size": group,
        "strategy": "group",
        "dynamic": False,
    }
    conv = AutoAWQConverter(group_size=group)
    ref = conv.process(dict(load_file(src / "model.safetensors")))
    got = _out(tmp_path / "out")
    assert set(ref) == set(got)
    for k in ref:
        assert bitwise_equal(got[k], ref[k].to(got[k].dtype) if k.endswith("weight_shape") else ref[k]), k


@pytest.mark.parametrize("kw", [{}, {"bits": 8}, {"sym": False}, {"v1": False}, {"group": 64}], ids=str)
def test_gptq_converts_losslessly(tmp_path, kw):
    src, refs = ff.gptq_checkpoint(tmp_path / "gptq", **kw)
    res = api.convert(src, tmp_path / "out")
    names = {(): "W4A16", ("bits",): "W8A16", ("sym",): "W4A16_ASYM", ("v1",): "W4A16", ("group",): "W4A16 (group 64)"}
    assert res.scheme == names[tuple(kw)]
    _lossless(tmp_path / "out", refs)
    _check_common(tmp_path / "out", {"quant_method": "gptq"})
    assert not any(k.endswith(("g_idx", "qweight", "qzeros", "scales")) for k in _out(tmp_path / "out"))  # a trivial g_idx is not needed


def test_gptq_act_order_is_refused_naming_tensor_and_feature(tmp_path):
    src, _ = ff.gptq_checkpoint(tmp_path / "gptq", act_order=True)
    with pytest.raises(UnsupportedError, match=r"qweight'?: act-order \(desc_act") as e:
        api.convert(src, tmp_path / "out")
    assert e.value.tensor and e.value.tensor.endswith(".qweight")
    assert not (tmp_path / "out").exists()


def test_gptq_sym_with_another_zero_point_is_refused_and_nothing_is_written(tmp_path):
    src, _ = ff.gptq_checkpoint(tmp_path / "gptq")
    t = load_file(src / "model.safetensors")
    z = t["model.layers.0.mlp.up_proj.qzeros"]
    z[0, 0] = z[0, 0] + 1  # one zero point (v1: stored - 1) is not 8 any more
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedError, match="symmetric") as e:
        api.convert(src, tmp_path / "out")
    assert e.value.tensor == "model.layers.0.mlp.up_proj.qweight"
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


@pytest.mark.parametrize("in_config", [True, False], ids=["config.json", "hf_quant_config.json"])
def test_modelopt_nvfp4_converts_losslessly(tmp_path, in_config):
    src, refs = ff.modelopt_checkpoint(tmp_path / "mo", in_config=in_config)
    res = api.convert(src, tmp_path / "out")
    assert (res.scheme, res.format) == ("NVFP4", "nvfp4-pack-quantized")
    _lossless(tmp_path / "out", refs)
    q = _check_common(tmp_path / "out", {"quant_method": "modelopt"})
    assert q["config_groups"]["group_0"]["input_activations"]["strategy"] == "tensor_group"
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    # compressed-tensors' converter: the same bytes, the same input global scales; global scales equal or, where
    # 1 / weight_scale_2 would round a dequantized value differently, the neighbour that does not
    src_t = dict(load_file(src / "model.safetensors"))
    ref = ModelOptNvfp4Converter(targets=list(refs)).process(dict(src_t))
    got = _out(tmp_path / "out")
    assert set(ref) == set(got)
    for k in ref:
        if k.endswith("weight_global_scale"):
            g, r = float(got[k].reshape(-1)[0]), float(ref[k].reshape(-1)[0])
            assert g == r or abs(g - r) <= 4 * abs(r) * 2**-23, k
        else:
            assert bitwise_equal(got[k], ref[k].reshape(got[k].shape).to(got[k].dtype)), k


def test_modelopt_nvfp4a16_drops_the_input_scales(tmp_path):
    src, refs = ff.modelopt_checkpoint(tmp_path / "mo")
    res = api.convert(src, tmp_path / "out", scheme="NVFP4A16")
    assert res.scheme == "NVFP4A16"
    assert not any(k.endswith("input_global_scale") for k in _out(tmp_path / "out"))
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    from ctconvert.plan.schemes import get_scheme

    assert q["config_groups"]["group_0"] == get_scheme("NVFP4A16").config_group(["Linear"])
    _lossless(tmp_path / "out", refs)


def test_modelopt_fused_members_with_different_global_scales_are_requantized_to_one(tmp_path):
    """q/k/v and gate/up with their own weight_scale_2 (vLLM keeps one global scale per fused layer; vllm#54974):
    ``convert`` (lossless) refuses and names the command that helps; ``quantize --scheme NVFP4A16`` requantizes,
    byte for byte what quantizing the source's dequantized weights (ModelOpt's own math) gives, one global scale
    per fused set."""
    src, refs = ff.modelopt_checkpoint(tmp_path / "mo", fused_scale_2=False)
    with pytest.raises(UnsupportedError, match="fused set .*different weight_scale_2") as e:
        api.convert(src, tmp_path / "out")
    assert "`ctconvert quantize SRC -o OUT --scheme NVFP4A16` requantizes each fused set to one shared global scale" in e.value.message
    assert e.value.tensor.endswith(".weight_scale_2")
    res = api.quantize(src, tmp_path / "q", "NVFP4A16")
    assert not res.lossless and any(n.startswith("not converted losslessly (") and "one shared global scale): requantized" in n for n in res.notes)
    dense = {**ff.dense_extras(torch.bfloat16), **{m + ".weight": w for m, w in refs.items()}}
    ff.save(tmp_path / "dense", dense, {**ff.CONFIG, "torch_dtype": "bfloat16"})
    api.quantize(tmp_path / "dense", tmp_path / "d", "NVFP4A16")
    got, want = _out(tmp_path / "q"), _out(tmp_path / "d")
    assert got.keys() == want.keys()
    assert all(bitwise_equal(got[k], want[k]) for k in got), [k for k in got if not bitwise_equal(got[k], want[k])]
    for members in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        p = "model.layers.0." + ("self_attn." if "q_proj" in members else "mlp.")
        scales = {float(got[p + m + ".weight_global_scale"]) for m in members}
        assert len(scales) == 1, (members, scales)


def test_quantize_with_the_sources_own_scheme_converts(tmp_path):
    src, refs = ff.awq_checkpoint(tmp_path / "awq")
    res = api.quantize(src, tmp_path / "out", "w4a16_asym")
    assert res.notes[0].startswith("lossless conversion of the awq source")
    _lossless(tmp_path / "out", refs)
    with pytest.raises(UsageError, match="--ignore"):
        api.quantize(src, tmp_path / "out2", "W4A16_ASYM", ignore=["model.layers.0.mlp.down_proj"])
    res = api.quantize(src, tmp_path / "req", "NVFP4A16")  # another scheme: requantized
    assert any(n.startswith("requantize:") for n in res.notes)
    assert api.verify(tmp_path / "req", reference=src)["ok"]


def test_convert_refuses_what_it_cannot_convert(tmp_path, tiny_llama):
    with pytest.raises(BadInputError, match="not a quantized checkpoint"):  # exit 3, as verify/decompress/repack of a dense folder
        api.convert(tiny_llama, tmp_path / "x")
    api.quantize(tiny_llama, tmp_path / "ct", "W4A16")
    with pytest.raises(UnsupportedError, match="already a compressed-tensors checkpoint"):
        api.convert(tmp_path / "ct", tmp_path / "y")
    src, _ = ff.awq_checkpoint(tmp_path / "awq")
    with pytest.raises(UsageError, match="losslessly to W4A16_ASYM only"):
        api.convert(src, tmp_path / "z", scheme="NVFP4A16")
    assert not any((tmp_path / n).exists() for n in "xyz")


def _cli(*args):
    import os

    env = {**os.environ, "COLUMNS": "300"}  # wide enough that no plan column is dropped
    return subprocess.run([sys.executable, "-m", "ctconvert", *map(str, args)], capture_output=True, text=True, env=env)


def test_cli_convert_dry_run_and_errors(tmp_path):
    src, _ = ff.gptq_checkpoint(tmp_path / "gptq")
    r = _cli("convert", src, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "convert" in r.stdout and "gptq int4 group 128" in r.stdout and "converted losslessly" in r.stdout
    r = _cli("--json", "convert", src, "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["lossless"] and doc["scheme"] == "W4A16"
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "bitnet"
    (src / "config.json").write_text(json.dumps(cfg))
    r = _cli("convert", src, "-o", tmp_path / "out2")
    assert r.returncode == 4 and r.stderr.count("\n") == 1 and "unknown quant_method 'bitnet'" in r.stderr
    r = _cli("inspect", tmp_path / "out")
    assert r.returncode == 0 and "converted losslessly from" in r.stdout


def _drop(src, name=None, config=None, replace=None):
    t = load_file(src / "model.safetensors")
    if name:
        del t[name]
    t.update(replace or {})
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "make, edit, words",
    [
        (ff.awq_checkpoint, {"name": "model.layers.0.mlp.up_proj.scales"}, "up_proj.scales is missing (scales missing)"),
        (ff.awq_checkpoint, {"config": {"version": "gemv"}}, "only GEMM packing"),
        (ff.gptq_checkpoint, {"replace": {"model.layers.0.mlp.up_proj.scales": torch.ones(3, 384, dtype=torch.float16)}}, "shapes inconsistent"),
        (ff.gptq_checkpoint, {"config": {"checkpoint_format": "marlin"}}, "checkpoint_format 'marlin'"),
        (ff.gptq_checkpoint, {"config": {"bits": 3}}, "3-bit GPTQ"),
        (ff.modelopt_checkpoint, {"name": "model.layers.0.mlp.up_proj.weight_scale_2"}, "weight_scale_2 is missing"),
        (ff.modelopt_checkpoint, {"config": {"quant_algo": "W4A8_AWQ"}}, "quant_algo 'W4A8_AWQ'"),
    ],
    ids=["awq-scales", "awq-gemv", "gptq-shape", "gptq-marlin", "gptq-3bit", "modelopt-scale2", "modelopt-algo"],
)
def test_bad_sources_are_one_line_errors_naming_the_file(tmp_path, make, edit, words):
    src, _ = make(tmp_path / "src")
    _drop(src, **edit)
    for fn in (lambda: api.convert(src, tmp_path / "out"), lambda: api.quantize(src, tmp_path / "out", "FP8_DYNAMIC")):
        with pytest.raises((UnsupportedError, BadInputError), match=words.replace("(", r"\(").replace(")", r"\)")) as e:
            fn()
        assert "\n" not in str(e.value) and str(src) in str(e.value)
    assert not (tmp_path / "out").exists()


def test_convert_warns_of_what_verify_fails_in_the_source(tmp_path):
    """convert of an AWQ source whose config contradicts its tensors (hidden_size edited): the same warning quantize
    gives (the dense view's loadability list), printed as `warning:`; verify fails the output with that problem. An
    unedited source gets none."""
    src, _ = ff.awq_checkpoint(tmp_path / "awq")
    assert api.convert(src, tmp_path / "ok").warnings == []
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] += 64
    (src / "config.json").write_text(json.dumps(cfg))
    width = f"config.json's hidden_size is {cfg['hidden_size']}"
    res = api.convert(src, tmp_path / "out")
    assert len(res.warnings) == 1 and res.warnings[0].startswith(f"the source {src}: ") and width in res.warnings[0], res.warnings
    assert res.warnings[0] in res.notes
    rep = api.verify(tmp_path / "out")
    assert not rep["ok"] and any(width in p["message"] for p in rep["problems"] if p["severity"] == "error")
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "cli")])
    assert r.exit_code == 0 and f"warning: {res.warnings[0]}" in r.output
