#!/usr/bin/env python3
"""Make the llm-compressor reference of the weight observers: ``tests/data/observers/llmc_observers.safetensors``.

Run with a venv that has llm-compressor (``python3 -m venv V && V/bin/pip install torch==2.13.0 &&
V/bin/pip install llmcompressor==0.14.0.1``), from the repository root:

    V/bin/python scripts/llmc_observer_reference.py

For each case (a tiny random Llama built with transformers from a fixed seed, with a few awkward rows
written into its Linear weights: a row of zeros, a constant row (ties), a row of tiny values, one outlier)
and each (scheme, observer) it runs llm-compressor's own ``oneshot(model=..., recipe=QuantizationModifier(
config_groups={"group_0": {"targets": ["Linear"], "weights": {..., "observer": NAME}}}, ignore=["lm_head"]))``
on the CPU (``CT_ENFORCE_EAGER=1``: the eager path of ``_grid_search_mse``) and saves, in one safetensors file:

- ``{case}/source/{module}.weight``: the Linear weights the test feeds to ctconvert;
- ``{case}/{scheme}/{observer}/{module}.{tensor}``: every compressed tensor of those modules as written by
  ``oneshot(..., output_dir=...)`` (``weight_packed``, ``weight_scale``, ``weight_global_scale``,
  ``weight_shape``, ``weight``, ``weight_zero_point``);

and in the file's metadata (key ``reference``) a JSON document: the llm-compressor, compressed-tensors and
torch versions, and per case/scheme/observer the ``quantization_config`` of the output's ``config.json``
(where the ``observer`` field of the weights' QuantizationArgs is recorded).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "observers" / "llmc_observers.safetensors"

#: (scheme preset, observer) pairs the reference holds
RUNS = [
    ("NVFP4A16", "nvfp4_expanded_mse"),
    ("NVFP4A16", "memoryless_minmax"),  # the harness: ctconvert's min/max bytes (bf16 case only)
    ("W4A16", "memoryless_mse"),
    ("W4A16_ASYM", "memoryless_mse"),
    ("FP8_DYNAMIC", "memoryless_mse"),
    ("MXFP4A16", "memoryless_mse"),  # bf16 case only
]
#: case name -> (dtype, hidden, intermediate, layers, seed)
CASES = {
    "llama-bf16": ("bfloat16", 128, 256, 2, 0),
    "llama-fp16": ("float16", 128, 128, 1, 1),
}


def tiny_llama(dtype: str, hidden: int, inter: int, layers: int, seed: int):
    """A random LlamaForCausalLM (fixed seed) with awkward rows in its first layer's weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                # a heavier tail than the init's normal, so that the search has something to find
                p.copy_((torch.randn_like(p, dtype=torch.float32) * 0.02 * (1 + 3 * torch.rand_like(p, dtype=torch.float32) ** 8)).to(p.dtype))
        attn = model.model.layers[0].self_attn
        mlp = model.model.layers[0].mlp
        attn.q_proj.weight[0].zero_()  # a row of zeros
        attn.q_proj.weight[1].fill_(0.015625)  # a constant row: every candidate ties
        attn.k_proj.weight[0].mul_(1e-4)  # tiny values (subnormal in fp16)
        attn.v_proj.weight[0, 5] = 0.5  # one outlier
        mlp.up_proj.weight[2, :16] = 0  # a zero group
        mlp.down_proj.weight[3].abs_()  # a row without negative values
    return model


def run(model, scheme: str, observer: str, out: Path):
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    preset = preset_name_to_scheme(scheme, ["Linear"])
    group = preset.model_dump(exclude_none=True)
    group["weights"]["observer"] = observer
    recipe = QuantizationModifier(config_groups={"group_0": group}, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, output_dir=str(out))


def saved_weights(out: Path, modules: list[str]) -> dict:
    """The compressed tensors of ``modules`` in the output folder ``out`` (``weight_packed``, ``weight_scale`` ...)."""
    from safetensors.torch import load_file

    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    return {k: v.contiguous() for m in modules for k, v in got.items() if k.startswith(f"{m}.") and k[len(m) + 1 :].startswith("weight")}


def main() -> None:
    os.environ["CT_ENFORCE_EAGER"] = "1"
    import compressed_tensors
    import llmcompressor
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__, "torch": torch.__version__, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case, spec in CASES.items():
            src = tiny_llama(*spec)
            modules = sorted(n for n, m in src.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
            state = src.state_dict()
            for m in modules:
                tensors[f"{case}/source/{m}.weight"] = state[f"{m}.weight"].clone().contiguous()
            meta["cases"][case] = {"dtype": spec[0], "modules": modules, "runs": {}}
            for scheme, observer in RUNS:
                if (observer == "memoryless_minmax" or scheme.startswith("MX")) and case != "llama-bf16":
                    continue  # the harness check and MX once are enough (keeps the file near 2 MB)
                model = tiny_llama(*spec)  # a fresh model: oneshot changes it in place
                folder = Path(tmp) / f"{case}-source"
                model.save_pretrained(str(folder))  # oneshot reads the model's config from its name_or_path
                model.config._name_or_path = str(folder)
                out = Path(tmp) / f"{case}-{scheme}-{observer}"
                run(model, scheme, observer, out)
                tensors.update({f"{case}/{scheme}/{observer}/{k}": v for k, v in saved_weights(out, modules).items()})
                qc = json.loads((out / "config.json").read_text())["quantization_config"]
                meta["cases"][case]["runs"][f"{scheme}/{observer}"] = qc
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"reference": json.dumps(meta, sort_keys=True)})
    print(f"wrote {OUT}: {len(tensors)} tensors, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
