#!/usr/bin/env python3
"""Make the llm-compressor reference of requantization: ``tests/data/requantize/llmc_reference.json``.

Run with a venv that has llm-compressor (``python3 -m venv V && V/bin/pip install torch==2.13.0 &&
V/bin/pip install llmcompressor==0.14.0.1``), from the repository root:

    V/bin/python scripts/llmc_requantize_reference.py

For each case it builds the tiny source checkpoint the test builds (``tests/foreign_formats.py``,
fixed seeds), runs llm-compressor's ``model_free_ptq`` with compressed-tensors' converter for that
source (``FP8BlockDequantizer`` for Hugging Face FP8 block, ``CompressedTensorsDequantizer`` for a
compressed-tensors FP8_BLOCK checkpoint written the way compressed-tensors writes it) and records
the sha256 of every source tensor and of every output tensor, so that the test can check that it
rebuilt the same input and that ctconvert's requantized tensors are the same bytes (an FP8 -0 is 0x80
in both: symmetric weights have no zero point). One known difference is recorded so the test can
account for it: llm-compressor 0.14's fused-set rules for NVFP4 global scales do not cover MoE experts'
gate/up nor Hugging Face's MLA names (``global_scales``). ``output_plus_zero`` (E4M3 hashes with -0
written as +0) is kept in the record for older readers; the test no longer uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / "tests" / "data" / "requantize" / "llmc_reference.json"

#: what ctconvert keeps dense by default in the DeepSeek-shaped source (llm-compressor selects by name only)
DEEPSEEK_IGNORE = ["lm_head", r"re:.*embed_tokens$", r"re:.*mlp\.gate$", r"re:.*eh_proj$", r"re:.*shared_head\.head$"]


def sha(t) -> str:
    import torch

    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def hashes(folder: Path, plus_zero: bool = False) -> dict[str, str]:
    """sha256 of every tensor; with ``plus_zero``, of E4M3 tensors with -0 (0x80) written as +0 (0x00)."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(f).items():
            if plus_zero and v.dtype == torch.float8_e4m3fn:
                b = v.view(torch.uint8).clone()
                b[b == 0x80] = 0
                v = b
            out[k] = sha(v)
    return dict(sorted(out.items()))


def global_scales(folder: Path) -> dict[str, float]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: float(v.reshape(-1)[0]) for k, v in load_file(f).items() if k.endswith("weight_global_scale")})
    return dict(sorted(out.items()))


def main() -> None:
    os.environ.setdefault("CT_ENFORCE_EAGER", "1")
    import foreign_formats as ff
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from llmcompressor import __version__ as llmc_version
    from llmcompressor.entrypoints.model_free import model_free_ptq

    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for scheme in ("NVFP4A16", "W4A16", "FP8_DYNAMIC"):
            # whole 128x128 blocks: llm-compressor 0.14 (compressed-tensors 0.19) fails on partial ones (it
            # saves the non-contiguous slice FP8BlockDequantizer returns)
            src = ff.deepseek_checkpoint(tmp / f"ds-{scheme}", seed=0, partial=False)
            out = tmp / f"out-{scheme}"
            from safetensors import safe_open

            with safe_open(str(src / "model.safetensors"), "pt") as f:
                targets = sorted(n.removesuffix(".weight_scale_inv") for n in f.keys() if n.endswith(".weight_scale_inv"))
            conv = FP8BlockDequantizer(targets=targets)  # compressed-tensors 0.19 (llm-compressor 0.14's pin) has no from_pretrained
            ignore = DEEPSEEK_IGNORE
            model_free_ptq(str(src), str(out), scheme=scheme, ignore=ignore, converter=conv, device="cpu")
            cases[f"deepseek-fp8-block/{scheme}"] = {
                "source": hashes(src),
                "ignore": ignore,
                "output": hashes(out),
                "output_plus_zero": hashes(out, plus_zero=True),
                "global_scales": global_scales(out),
            }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"llmcompressor": llmc_version, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} cases")


if __name__ == "__main__":
    main()
