"""Convert a checkpoint in this process and report the peak RSS it added (JSON on stdout).

    python scripts/peak_memory.py SRC OUT SCHEME [--chunk-elems N]
    python scripts/peak_memory.py QUANTIZED OUT DTYPE --decompress [--chunk-elems N]

With ``--decompress`` the run is ``decompress`` of a quantized checkpoint to ``DTYPE``
(bf16, fp16, fp32, or ``model``: the model's own dtype).

The baseline is taken after every import and after building one config (so
library import costs are not counted); ``peak_rss_delta`` is what the
conversion itself added on top: a few row chunks, not the model.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def rss_now_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("scheme")
    ap.add_argument("--chunk-elems", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hold-bytes", type=int, default=None)
    ap.add_argument("--decompress", action="store_true", help="decompress SRC (SCHEME: the output dtype)")
    a = ap.parse_args()
    from ctconvert import api
    from ctconvert.checkpoint.config import build_quantization_config
    from ctconvert.plan.schemes import get_scheme

    api.preload()  # the engine (torch, the commands) imported before the baseline: the API loads it lazily
    s = get_scheme("W4A16" if a.decompress else a.scheme)
    build_quantization_config({"g": (s, ["Linear"])}, s.format, [])
    # reset the high-water mark so that only the conversion counts
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = rss_now_kib()
    kw = {"chunk_elems": a.chunk_elems} if a.chunk_elems else {}
    if a.hold_bytes is not None:
        kw["hold_bytes"] = a.hold_bytes
    t0 = time.perf_counter()
    if a.decompress:
        kw.pop("hold_bytes", None)
        from ctconvert.commands.decompress import decompress  # the command itself: api.decompress takes no chunk size

        d = decompress(a.src, a.out, dtype=None if a.scheme == "model" else a.scheme, **kw)
        res = argparse.Namespace(scheme=f"decompress to {d['dtype']}", input_bytes=d["input_bytes"], output_bytes=d["output_bytes"])
    else:
        res = api.quantize(a.src, a.out, a.scheme, device=a.device, **kw)
    dt = time.perf_counter() - t0
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    json.dump(
        {
            "scheme": res.scheme,
            "input_bytes": res.input_bytes,
            "output_bytes": res.output_bytes,
            "seconds": round(dt, 3),
            "baseline_rss_bytes": base * 1024,
            "peak_rss_bytes": hwm * 1024,
            "peak_rss_delta_bytes": (hwm - base) * 1024,
            "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
