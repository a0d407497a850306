"""Fused 3-D experts: ctconvert's int and FP8 output equals llm-compressor's ``model_free_ptq`` byte for byte.

The reference (tests/data/llmc_model_free_moe.json, made by scripts/llmc_moe_reference.py with llm-compressor
0.14 in its own venv) holds the recipe of each checkpoint (names, shapes, seed) and the sha256 of every tensor
llm-compressor wrote. model_free_ptq splits fused ``[E, 2I, H]`` experts gate first, as these families store
them (for transposed or interleaved families, gpt-oss and Llama-4, it does not apply)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ctconvert import api

REF = json.loads((Path(__file__).parents[1] / "data" / "llmc_model_free_moe.json").read_text())


def _build(case: str, path: Path) -> Path:
    c = REF["cases"][case]
    g = torch.Generator().manual_seed(REF["seed"])
    tensors = {n: (torch.randn(c["tensors"][n], generator=g) * REF["std"]).to(torch.bfloat16) for n in sorted(c["tensors"])}
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c["config"]))
    return path


def _hashes(path: Path) -> dict[str, str]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                out[k] = hashlib.sha256(s.get_tensor(k).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


@pytest.mark.parametrize("key", sorted(REF["hashes"]))
def test_fused_experts_equal_llm_compressor_model_free_ptq(tmp_path, key):
    case, scheme = key.split("/")
    src = _build(case, tmp_path / "m")
    api.quantize(src, tmp_path / "q", scheme)
    want, got = REF["hashes"][key], _hashes(tmp_path / "q")
    experts = [n for n in want if ".experts." in n]
    parts = 3 if scheme == "W4A16" else 2  # weight_packed, weight_scale, weight_shape | weight, weight_scale
    assert len(experts) == 4 * 3 * parts  # 4 experts x (gate, up, down), every one quantized
    assert set(want) == set(got)
    assert {n for n in want if want[n] != got[n]} == set()
