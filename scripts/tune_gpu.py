"""Sweep the Triton kernels' launch configurations on one large bf16 weight (CUDA only).

    python scripts/tune_gpu.py [--rows 28672 --cols 8192]

For each scheme and configuration: median kernel time over 20 runs (CUDA
events, after warm-up), bf16 input TB/s, and whether the bytes equal the
default configuration's (they must: a configuration changes only speed).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json

import torch

from ctconvert.formats import gpu
from ctconvert.formats.common import tensor_absmax
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.plan.schemes import get_scheme

from timing import median_seconds

SPACE = {
    "fp8_row": [
        {"max_single": m, "num_warps": nw, "ctas_per_sm": c, "recip": r}
        for (m, nw, c), r in itertools.product([(0, 8, 0), (16384, 4, 4), (16384, 8, 2), (16384, 8, 0)], [True, False])
    ],
    "fp8_block": [{"num_warps": nw, "recip": r} for nw, r in itertools.product([4, 8], [True, False])],
    "int_group": [{"elems": e, "num_warps": nw, "ctas_per_sm": c} for e, nw, c in itertools.product([2048, 4096], [4], [0, 2, 3, 4, 5, 6])]
    + [{"elems": e, "num_warps": 8, "ctas_per_sm": c} for e, c in itertools.product([4096, 8192], [0, 2, 3])],
    "fp4": [{"br": br, "cols": c, "num_warps": 4, "ctas_per_sm": n} for br, c, n in itertools.product([4, 8], [256, 512], [0, 2, 3, 4])],
}
USES = {
    "FP8_DYNAMIC": "fp8_row",
    "FP8_BLOCK": "fp8_block",
    "W4A16": "int_group",
    "W4A16_ASYM": "int_group",
    "W8A16": "int_group",
    "NVFP4A16": "fp4",
    "MXFP4A16": "fp4",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=28672)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--schemes", default=",".join(USES))
    a = ap.parse_args()
    w = (torch.randn(a.rows, a.cols, device="cuda") * 0.02).to(torch.bfloat16)
    default = copy.deepcopy(gpu.TUNE)
    best = {}
    for scheme in a.schemes.split(","):
        kernel = USES[scheme]
        s = get_scheme(scheme)
        gs = nvfp4_global_scale(tensor_absmax(w), w.dtype) if s.global_scale else None
        ref = {k: v.clone() for k, v in s.quantize_rows(w, gs).items()}
        for cfg in SPACE[kernel]:
            gpu.TUNE[kernel] = cfg
            try:
                dt = median_seconds(lambda: s.quantize_rows(w, gs), 20)
                out = s.quantize_rows(w, gs)
                same = all(
                    torch.equal(
                        out[k].view(torch.uint8) if out[k].element_size() == 1 else out[k], ref[k].view(torch.uint8) if ref[k].element_size() == 1 else ref[k]
                    )
                    for k in ref
                )
            except Exception as e:  # noqa: BLE001
                print(json.dumps({"scheme": scheme, "config": cfg, "error": str(e)[:200]}))
                continue
            tbps = w.numel() * 2 / dt / 1e12
            print(json.dumps({"scheme": scheme, "kernel": kernel, "config": cfg, "seconds": dt, "TBps": round(tbps, 3), "same_bytes": same}))
            if same and tbps > best.get(scheme, (0, None))[0]:
                best[scheme] = (tbps, cfg)
        gpu.TUNE[kernel] = default[kernel]
    print(json.dumps({"best": best}))


if __name__ == "__main__":
    main()
