"""Compare ctconvert's calibrated scales with llm-compressor ``oneshot`` on the same tokens.

Two halves, because llm-compressor pins other versions (run it from its own virtualenv):

    # 1. in the llm-compressor environment: oneshot on token ids, saved compressed
    /work/venvs/llmc/bin/python scripts/compare_llmcompressor.py oneshot MODEL IDS.json OUT_LLMC --scheme NVFP4 [--kv-cache [--kv-observer static_minmax]]
    # 2. here: ctconvert on the same ids, then the comparison of every calibrated tensor
    python3 scripts/compare_llmcompressor.py compare MODEL IDS.json OUT_LLMC OUT_CT --scheme NVFP4 [--kv-cache]

``IDS.json`` is a JSON array of arrays of token ids (one calibration sample each; oneshot runs them
with batch size 1, ctconvert with one sample per micro-batch). Prints one JSON document: per calibrated
tensor kind, how many tensors are bit-identical, and the largest relative difference otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("input_global_scale", "input_scale", "input_zero_point", "k_scale", "v_scale", "weight_global_scale")


def oneshot(a) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot as run
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    ids = json.loads(Path(a.ids).read_text())
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
    kw = {}
    if a.kv_cache:
        kw["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        if a.kv_observer:  # llm-compressor's default for a kv_cache_scheme without one is "minmax" (a moving average)
            kw["kv_cache_scheme"]["observer"] = a.kv_observer
    recipe = QuantizationModifier(targets="Linear", scheme=a.scheme, ignore=["lm_head"], **kw)
    run(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ids), max_seq_length=len(ids[0]), output_dir=a.out)


def compare(a) -> None:
    import torch
    from safetensors.torch import load_file

    from ctconvert import api

    ids = json.loads(Path(a.ids).read_text())
    f = Path(a.out_ct).with_suffix(".ids.json")
    f.write_text(json.dumps(ids))
    api.quantize(
        a.model,
        a.out_ct,
        a.scheme,
        overwrite=True,
        calibration=f,
        calibration_samples=len(ids),
        calibration_seq_len=len(ids[0]),
        kv_cache="fp8" if a.kv_cache else "none",
        device="cpu",
    )
    theirs, ours = {}, {}
    for p in Path(a.out_llmc).glob("*.safetensors"):
        theirs.update(load_file(p))
    for p in Path(a.out_ct).glob("*.safetensors"):
        ours.update(load_file(p))
    report = {}
    for part in PARTS:
        names = sorted(n for n in ours if n.endswith("." + part))
        if not names:
            continue
        missing = [n for n in names if n not in theirs]
        same = [n for n in names if n in theirs and ours[n].shape == theirs[n].shape and torch.equal(ours[n], theirs[n])]
        rel = max(
            ((ours[n].float() - theirs[n].float()).abs().max() / theirs[n].float().abs().max().clamp(min=1e-30)).item()
            for n in names
            if n in theirs and ours[n].numel() == theirs[n].numel()
        )
        report[part] = {"tensors": len(names), "identical": len(same), "missing_in_llmcompressor": len(missing), "max_rel_diff": rel}
    print(json.dumps(report, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["oneshot", "compare"])
    p.add_argument("model")
    p.add_argument("ids")
    p.add_argument("out_llmc")
    p.add_argument("out_ct", nargs="?")
    p.add_argument("--scheme", default="NVFP4")
    p.add_argument("--kv-cache", action="store_true")
    p.add_argument("--kv-observer", default=None, help="oneshot: the KV cache observer (static_minmax: ctconvert's statistic)")
    a = p.parse_args()
    if a.what == "oneshot":
        a.out = a.out_llmc
        oneshot(a)
    else:
        compare(a)


if __name__ == "__main__":
    main()
