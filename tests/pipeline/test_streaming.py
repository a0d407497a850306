"""Peak memory is bounded by row chunks, not by the model: convert more bytes than the memory we allow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16"])
def test_peak_rss_is_a_fraction_of_the_checkpoint(tmp_path, scheme):
    g = torch.Generator().manual_seed(0)
    t = {
        f"model.layers.{i}.mlp.{m}.weight": torch.randn(2048, 4096, generator=g).to(torch.bfloat16)
        for i in range(8)
        for m in ("gate_proj", "up_proj", "down_proj")
    }  # 24 x 16 MiB = 384 MiB
    src = write_checkpoint(tmp_path / "m", t, {"architectures": ["LlamaForCausalLM"]}, shards=3)
    del t
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "peak_memory.py"), str(src), str(tmp_path / "o"), scheme, "--chunk-elems", str(2**20), "--hold-bytes", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    budget = size // 4  # the conversion may use a quarter of the checkpoint's size
    assert doc["peak_rss_delta_bytes"] < budget, (doc, budget)
    assert doc["input_bytes"] > 3.9 * budget


def test_decompress_peak_rss_is_a_fraction_of_the_output(tmp_path):
    """decompress: dequantized chunks in reused buffers and the writers' queues, never the model."""
    g = torch.Generator().manual_seed(0)
    t = {
        f"model.layers.{i}.mlp.{m}.weight": torch.randn(2048, 4096, generator=g).to(torch.bfloat16)
        for i in range(8)
        for m in ("gate_proj", "up_proj", "down_proj")
    }
    src = write_checkpoint(tmp_path / "m", t, {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}, shards=3)
    del t
    from ctconvert import api

    api.quantize(src, tmp_path / "q", "W4A16")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "peak_memory.py"),
            str(tmp_path / "q"),
            str(tmp_path / "o"),
            "fp32",
            "--decompress",
            "--chunk-elems",
            str(2**20),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    budget = doc["output_bytes"] // 8  # 768 MiB of fp32 out: at most 96 MiB held
    assert doc["output_bytes"] > 700 * 2**20 and doc["peak_rss_delta_bytes"] < budget, (doc, budget)
