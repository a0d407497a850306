"""What the zero-row check (ctconvert/pipeline/zeros.py) costs quantize: per chunk and end to end (JSON on stdout).

    python scripts/bench_zero_check.py [--device cpu|cuda] [--schemes W4A16,NVFP4A16,FP8_DYNAMIC] [--repeat 5]

Per chunk: the median time of ``candidate_rows`` on the outputs of one 4 Mi-element chunk, beside the
time of quantizing that chunk. End to end: a synthetic bf16 Llama-shaped checkpoint (4 layers, hidden
1024) converted with the check and with it switched off, alternately, the median of each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ctconvert import api  # noqa: E402
from ctconvert.commands import quantize as quantize_cmd  # noqa: E402
from ctconvert.formats.common import tensor_absmax  # noqa: E402
from ctconvert.formats.fp4 import nvfp4_global_scale  # noqa: E402
from ctconvert.pipeline.zeros import ZeroTracker, candidate_rows  # noqa: E402
from ctconvert.plan.schemes import get_scheme  # noqa: E402

from timing import median_seconds  # noqa: E402

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 4,
    "vocab_size": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def per_chunk(scheme_name: str, device: str, repeat: int) -> dict:
    scheme = get_scheme(scheme_name)
    w = (torch.randn(1024, 4096) * 0.02).to(torch.bfloat16).to(device)
    gs = nvfp4_global_scale(tensor_absmax(w), w.dtype) if scheme.global_scale else None
    out = scheme.quantize_rows(w, gs)
    q = median_seconds(lambda: scheme.quantize_rows(w, gs), repeat, device)
    c = median_seconds(lambda: candidate_rows(out, scheme.weight_format, scheme.weights, w.dtype, w.shape[0]), repeat, device)
    return {"quantize_chunk_ms": q * 1e3, "check_chunk_ms": c * 1e3, "check_fraction": c / q}


def end_to_end(src: Path, work: Path, scheme: str, device: str, repeat: int) -> dict:
    times: dict[str, list[float]] = {"with_check": [], "without_check": []}
    for i in range(2 * repeat + 1):
        mode = "with_check" if i % 2 else "without_check"
        quantize_cmd.ZeroTracker = ZeroTracker if mode == "with_check" else (lambda: None)
        out = work / f"o{i}"
        t0 = time.perf_counter()
        api.quantize(src, out, scheme, device=device)
        if i:  # the first run warms the page cache and the kernels
            times[mode].append(time.perf_counter() - t0)
        shutil.rmtree(out)
    quantize_cmd.ZeroTracker = ZeroTracker
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**{f"{k}_s": v for k, v in med.items()}, "overhead": med["with_check"] / med["without_check"] - 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--schemes", default="W4A16,NVFP4A16,FP8_DYNAMIC")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    from conftest import llama_tensors, write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = write_checkpoint(work / "src", llama_tensors({**CONFIG}), CONFIG)
        report = {"device": a.device, "schemes": {}}
        for s in a.schemes.split(","):
            report["schemes"][s] = {**per_chunk(s, a.device, a.repeat), **end_to_end(src, work, s, a.device, a.repeat)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
