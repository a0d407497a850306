#!/usr/bin/env python3
"""Make the llm-compressor reference of ``--recipe``: ``tests/data/recipes/llmc_recipes.safetensors``.

Run with the venv of ``scripts/llmc_observer_reference.py`` (llm-compressor 0.14.0.1, torch 2.13.0), from the
repository root:

    V/bin/python scripts/llmc_recipe_reference.py

For each recipe file of ``tests/data/recipes/*.yaml`` it runs llm-compressor's own
``oneshot(model=..., recipe=FILE, output_dir=...)`` on the CPU (``CT_ENFORCE_EAGER=1``) on a tiny random Llama
(one layer, fixed seed, the heavier-tailed weights of the observer reference) and saves in one safetensors file:

- ``source/{module}.weight``: the Linear weights the test feeds to ctconvert;
- ``{recipe}/{module}.{tensor}``: every compressed tensor of those modules as ``oneshot`` wrote it;

and in the file's metadata (key ``reference``) a JSON document: the versions, the modules, and per recipe the
``quantization_config`` of the output's ``config.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "recipes"
OUT = DATA / "llmc_recipes.safetensors"


def tiny_llama(seed: int = 3):
    """A one-layer random bf16 LlamaForCausalLM (fixed seed), hidden 128, intermediate 256."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_((torch.randn_like(p, dtype=torch.float32) * 0.02 * (1 + 3 * torch.rand_like(p, dtype=torch.float32) ** 8)).to(p.dtype))
    return model


def main() -> None:
    os.environ["CT_ENFORCE_EAGER"] = "1"
    import compressed_tensors
    import llmcompressor
    import torch
    from llmcompressor import oneshot
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    src = tiny_llama()
    modules = sorted(n for n, m in src.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
    for m in modules:
        tensors[f"source/{m}.weight"] = src.state_dict()[f"{m}.weight"].clone().contiguous()
    meta: dict = {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__, "torch": torch.__version__}
    meta.update(modules=modules, recipes={})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "source"
        src.save_pretrained(str(folder))
        for recipe in sorted(DATA.glob("*.yaml")):
            model = tiny_llama()  # a fresh model: oneshot changes it in place
            model.config._name_or_path = str(folder)
            out = Path(tmp) / recipe.stem
            oneshot(model=model, recipe=str(recipe), output_dir=str(out))
            got = {}
            for f in sorted(out.glob("*.safetensors")):
                got.update(load_file(str(f)))
            for k, v in got.items():
                if any(k.startswith(f"{m}.") for m in modules):
                    tensors[f"{recipe.stem}/{k}"] = v.contiguous()
            meta["recipes"][recipe.stem] = json.loads((out / "config.json").read_text())["quantization_config"]
    save_file(tensors, str(OUT), metadata={"reference": json.dumps(meta, sort_keys=True)})
    print(f"wrote {OUT}: {len(tensors)} tensors, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
