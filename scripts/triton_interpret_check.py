"""Check the Triton quantize kernels on the CPU, through Triton's interpreter (no GPU needed).

    TRITON_INTERPRET=1 python scripts/triton_interpret_check.py [SCHEME,...] [--programs N]

Runs every kernel of ``ctconvert/formats/gpu.py`` on the awkward weights of
``tests/formats/test_bit_exact.py`` (every scheme, dtype and case) and compares
the bytes with the torch reference. ``--programs N`` caps the programs of the
tile-looping kernels, so that each program loops over several tiles.

Needs the ``triton`` package (CPU-only installs lack it: ``pip install
triton``). The interpreter's own fp32 -> bf16/fp16/fp8 conversion is not
round-to-nearest-even (it rounds half up and drops the carry), so this script
replaces it with torch's conversion; its ``fma`` is exact. A pass here is a
strong hint, not a proof: the H200 tests (``tests/formats``) are the check.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from formats.test_bit_exact import CASES, DTYPES, SCHEMES, make_weight, shape_for  # noqa: E402

from ctconvert.formats import gpu  # noqa: E402
from ctconvert.formats.common import tensor_absmax  # noqa: E402
from ctconvert.formats.fp4 import nvfp4_global_scale  # noqa: E402
from ctconvert.plan.schemes import get_scheme  # noqa: E402

_TORCH = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float32: torch.float32, tl.float8e4nv: torch.float8_e4m3fn}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_convert = interp._convert_float


def _rne_convert(data, src, dst, rounding_mode):
    """Float conversions through torch (round to nearest even), others as the interpreter does them."""
    if src not in _TORCH or dst not in _TORCH:
        return _convert(data, src, dst, rounding_mode)
    a, b = _TORCH[src], _TORCH[dst]
    t = torch.from_numpy(np.ascontiguousarray(data).view(_NP[a.itemsize]).astype(np.int64)).to(_INT[a.itemsize]).view(a).to(b)
    return t.view(_INT[b.itemsize]).numpy().view(_NP[b.itemsize])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("schemes", nargs="?", default=",".join(SCHEMES))
    ap.add_argument("--programs", type=int, default=0, help="cap the programs of the looping kernels (0: one per tile)")
    a = ap.parse_args()
    interp._convert_float = _rne_convert
    gpu._prep = lambda w: (w.contiguous(), gpu._DT[w.dtype])  # CPU tensors are fine under the interpreter
    gpu._programs = lambda w, tiles, cfg: min(tiles, a.programs) if a.programs else tiles
    bad = 0
    for name in a.schemes.split(","):
        s = get_scheme(name)
        try:
            s.weight_format._fused(gpu, make_weight(CASES[0], DTYPES[0], *shape_for(name), seed=1), s.weights, None)
        except NotImplementedError:
            print(f"{name}: no Triton kernel (the torch reference runs on CUDA)")
            continue
        except Exception:  # noqa: BLE001 - only probing whether a kernel exists
            pass
        for dtype in DTYPES:
            for case in CASES:
                w = make_weight(case, dtype, *shape_for(name), seed=1)
                gs = nvfp4_global_scale(tensor_absmax(w), dtype) if s.global_scale else None
                ref = s.quantize_rows(w, gs, impl="torch")
                got = s.weight_format._fused(gpu, w, s.weights, gs)  # the Triton kernels, forced (CPU tensors)
                for key in ref:
                    x, y = (t.contiguous().view(torch.uint8) if t.element_size() == 1 else t for t in (ref[key], got[key]))
                    if not torch.equal(x, y):
                        bad += 1
                        print(f"DIFF {name} {dtype} {case} {key}: {(x != y).sum().item()} of {x.numel()}")
        print(f"{name}: checked")
    print("all equal" if not bad else f"{bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
