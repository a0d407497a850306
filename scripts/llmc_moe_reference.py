#!/usr/bin/env python3
"""Make tests/data/llmc_model_free_moe.json: llm-compressor's model_free_ptq output for fused 3-D experts, as hashes.

Run with the interpreter of a separate venv that has llmcompressor installed (never the project's own):

    /work/venvs/llmc13/bin/python scripts/llmc_moe_reference.py tests/data/llmc_model_free_moe.json

For each case of the recipe (a fused-expert checkpoint of a family whose experts llm-compressor's
``split_fused_moe_experts`` lays out as ctconvert does: ``[E, 2I, H]``, gate first), it writes the checkpoint
from seeded random tensors, runs ``model_free_ptq`` with each scheme and records the sha256 of every output
tensor's bytes. tests/plan/test_llmc_reference.py rebuilds the same checkpoints and checks ctconvert's
tensors against these hashes. The recipe (names, shapes, seed) is in the JSON; this script only fills in
``hashes`` and the llm-compressor version.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path


def _moe_case(model_type: str, arch: str, experts: str) -> dict:
    """A one-layer checkpoint of 4 fused experts (H = I = 128, under ``experts``) and one attention projection."""
    return {
        "config": {"model_type": model_type, "architectures": [arch], "hidden_size": 128, "num_experts": 4, "num_hidden_layers": 1},
        "tensors": {f"{experts}.gate_up_proj": [4, 256, 128], f"{experts}.down_proj": [4, 128, 128], "model.layers.0.self_attn.o_proj.weight": [128, 128]},
    }


RECIPE = {
    "seed": 11,
    "std": 0.05,
    "schemes": ["FP8_DYNAMIC", "W4A16"],
    "cases": {
        "qwen3_moe": _moe_case("qwen3_moe", "Qwen3MoeForCausalLM", "model.layers.0.mlp.experts"),
        "gemma4": _moe_case("gemma4_text", "Gemma4ForCausalLM", "model.layers.0.experts"),
    },
}


def build(recipe: dict, case: str, path: Path) -> None:
    """Write the case's checkpoint: tensors in name order from one seeded generator (the test does the same)."""
    import torch
    from safetensors.torch import save_file

    c = recipe["cases"][case]
    g = torch.Generator().manual_seed(recipe["seed"])
    tensors = {n: (torch.randn(c["tensors"][n], generator=g) * recipe["std"]).to(torch.bfloat16) for n in sorted(c["tensors"])}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c["config"]))


def tensor_hashes(path: Path) -> dict[str, str]:
    """sha256 of every tensor's bytes, by name, over a folder's shards."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                t = s.get_tensor(k).contiguous()
                out[k] = hashlib.sha256(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()
    return out


def main(out_json: str) -> int:
    saved = os.dup(1)
    os.dup2(2, 1)  # llm-compressor logs to stdout
    try:
        from llmcompressor import __version__
        from llmcompressor.entrypoints.model_free import model_free_ptq

        doc = dict(RECIPE, llmcompressor=__version__, hashes={})
        with tempfile.TemporaryDirectory() as tmp:
            for case in RECIPE["cases"]:
                src = Path(tmp) / case
                build(RECIPE, case, src)
                for scheme in RECIPE["schemes"]:
                    dst = Path(tmp) / f"{case}-{scheme}"
                    model_free_ptq(model_stub=str(src), save_directory=str(dst), scheme=scheme, ignore=[], max_workers=1, device="cpu")
                    doc["hashes"][f"{case}/{scheme}"] = tensor_hashes(dst)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    Path(out_json).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
