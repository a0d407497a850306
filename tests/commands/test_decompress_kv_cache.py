"""``decompress`` of an output with a calibrated FP8 KV cache: the dense copy has no quantization config, so the
``k_scale``/``v_scale`` it would not explain are left out and named (found by tests/test_conservation.py)."""

from __future__ import annotations

import json

from click.testing import CliRunner
from safetensors import safe_open

from ctconvert import api
from ctconvert.cli import main


def _names(path):
    out = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            out |= set(s.keys())
    return out


def test_decompress_leaves_out_and_names_the_kv_cache_scales(tiny_llama, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str((i * 37 + 11) % 380) for i in range(256)))
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "FP8_DYNAMIC", kv_cache="fp8", calibration=str(ids), calibration_samples=2, calibration_seq_len=32)
    kv = {f"model.layers.{x}.self_attn.{p}" for x in (0, 1) for p in ("k_scale", "v_scale")}
    assert kv <= _names(q) and json.loads((q / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]

    res = api.decompress(q, tmp_path / "d")
    assert _names(tmp_path / "d") == _names(tiny_llama)  # the dense model's tensors, no more
    assert set(res["left_out"]) == kv
    assert all("kv_cache_scheme" in why for why in res["left_out"].values())
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())

    r = CliRunner().invoke(main, ["decompress", str(q), "-o", str(tmp_path / "d2")])
    assert r.exit_code == 0, r.output
    assert "note: left out 4 KV-cache scales (k_scale/v_scale: a dense checkpoint has no kv_cache_scheme)" in r.output
    r = CliRunner().invoke(main, ["--json", "decompress", str(q), "-o", str(tmp_path / "d3")])
    assert set(json.loads(r.stdout)["left_out"]) == kv
