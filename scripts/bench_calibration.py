"""Calibration benchmark: wall time and peak memory of ctconvert's layer-by-layer calibration.

    python3 scripts/bench_calibration.py                                  # the 1.2B benchmark checkpoint (scripts/bench.py --make-model)
    python3 scripts/bench_calibration.py --model SRC --samples 8 --seq-len 256 --device cuda --quantize /tmp/out

Each measurement runs in a child process, so that its peak RSS (``ru_maxrss``) is its own; on a GPU the
peak of ``torch.cuda.max_memory_allocated`` is reported too. The tokens are random ids from a fixed seed
(the benchmark checkpoint has no tokenizer; the statistics do not matter here, only the cost). With
``--quantize OUT`` the child runs the whole ``quantize --scheme NVFP4`` (calibration + conversion) instead.
One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(a) -> None:
    import torch

    from ctconvert.calibration.model import calibrate, calibrate_whole_model
    from ctconvert.checkpoint.reader import open_checkpoint

    ckpt = open_checkpoint(a.model)
    vocab = ckpt.config.get("vocab_size", 32000)
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    if a.quantize:
        from ctconvert import api

        ids = Path(a.quantize).with_suffix(".ids.txt")
        g = torch.Generator().manual_seed(0)
        ids.write_text(" ".join(map(str, torch.randint(0, vocab, (a.samples * a.seq_len,), generator=g).tolist())))
        r = api.quantize(
            a.model, a.quantize, "NVFP4", overwrite=True, device=a.device, calibration=ids, calibration_samples=a.samples, calibration_seq_len=a.seq_len
        )
        what = {"run": "quantize NVFP4", "calibration_s": r.calibration["seconds"], "output_bytes": r.output_bytes}
    else:
        tokens = torch.randint(0, vocab, (a.samples, a.seq_len), generator=torch.Generator().manual_seed(0))
        fn = calibrate_whole_model if a.whole else calibrate
        stats = fn(ckpt, tokens, dev, kv_cache=True, batch_tokens=a.batch_tokens)
        what = {"run": "whole model (all layers loaded)" if a.whole else "calibrate, layer by layer", "observed_linears": len(stats.inputs)}
    wall = time.perf_counter() - t0
    out = {
        **what,
        "model": str(a.model),
        "device": str(dev),
        "tokens": a.samples * a.seq_len,
        "wall_s": round(wall, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "input_gib": round(ckpt.total_bytes / 2**30, 2),
    }
    if dev.type == "cuda":
        out["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/ctbench/model")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--device", default="cpu", help="cpu, cuda, or 'both' (cpu then cuda when present)")
    p.add_argument("--quantize", default=None, help="output folder: time the whole quantize --scheme NVFP4 instead")
    p.add_argument("--whole", action="store_true", help="the same observation with the whole model loaded (the memory a whole-model pass needs)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    if not Path(a.model, "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--make-model", a.model], check=True)
    devices = [a.device] if a.device != "both" else ["cpu", "cuda"]
    for dev in devices:
        args = [sys.executable, __file__, "--child", "--model", a.model, "--samples", str(a.samples), "--seq-len", str(a.seq_len)]
        args += ["--batch-tokens", str(a.batch_tokens), "--device", dev] + (["--quantize", a.quantize] if a.quantize else [])
        args += ["--whole"] if a.whole else []
        subprocess.run(args, check=True)


if __name__ == "__main__":
    main()
