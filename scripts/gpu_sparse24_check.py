"""Feed ctconvert's 2:4 layouts to real kernels on a CUDA GPU and compare with the dense product.

SM80 (PyTorch semi-structured, CUTLASS 2.x): ``layouts.sparse24.sm80_compress`` values and meta go
straight into ``torch._sparse_semi_structured_linear`` (the op behind
``torch.sparse.SparseSemiStructuredTensorCUTLASS``' ``F.linear``) and, when it can be built from
them, a ``SparseSemiStructuredTensorCUTLASS``; ``x @ W.T`` is compared with the dense product.
SM90 (CUTLASS 3.x, vLLM <= 0.18 ``cutlass_scaled_sparse_mm``): no such kernel ships with PyTorch;
the script reports whether cuSPARSELt (``torch._cslt_compress``) lays its buffer out the same way,
which would let ``torch._cslt_sparse_mm`` consume it, and multiplies through cuSPARSELt with a buffer
made of ctconvert's values and metadata. Writes a JSON report (argument 1, or stdout).

    python3 scripts/gpu_sparse24_check.py report.json [--cslt-only]

Seen on an NVIDIA H200 (torch 2.11.0+cu130, 2026-12-01): PyTorch's CUTLASS 2:4 GEMM
(``_sparse_semi_structured_linear``) refuses the GPU ("Supported only on GPUs with compute capability
8.x"), so no kernel there consumes the SM80 layout; ``to_sparse_semi_structured`` uses cuSPARSELt on
SM90. cuSPARSELt's compressed buffer starts with exactly ctconvert's SM90 values, but its metadata is
in another order (2-5 % of the bytes equal), and a buffer with ctconvert's metadata multiplies wrongly
(relative error ~1.1, against 2e-4 for its own): cuSPARSELt is not a consumer of the CUTLASS 3.x
layout. The SM90 layout is proven by the CUTLASS v4.2.1 compressor's own output
(``tests/data/testvectors/cutlass_sm90_2of4.safetensors``), not by a kernel run here.
"""

from __future__ import annotations

import json
import sys

import torch

from ctconvert.formats.sparse24 import prune24
from ctconvert.layouts import sparse24 as L


def weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = prune24(torch.randn(n, k, device="cuda", generator=g))
    w[0] = 0  # a row of zeros; groups with one non-zero:
    w[1, 1::4] = 0
    if dtype == torch.int8:
        return (w * 40).round().clamp(-127, 127).to(torch.int8)
    return w.to(dtype)


def sm80(report: dict) -> None:
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.int8):
        for n, k in ((128, 128), (256, 512), (4096, 4096)):
            w = weight(n, k, dtype, n + k)
            comp = L.sm80_compress(w)
            m = 64
            if dtype == torch.int8:
                x = torch.randint(-8, 8, (m, k), device="cuda", dtype=torch.int8)
                ref = (x.cpu().to(torch.int64) @ w.cpu().to(torch.int64).T).to(torch.float64).cuda()
            else:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                ref = x.double() @ w.double().T
            row = {"dtype": str(dtype), "N": n, "K": k}
            try:
                kw = {"out_dtype": torch.int32} if dtype == torch.int8 else {}
                y = torch._sparse_semi_structured_linear(x, comp["values"], comp["meta"], **kw).double()
                row["linear_rel_err"] = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
                row["linear_exact"] = bool(torch.equal(y, ref)) if dtype == torch.int8 else None
            except Exception as e:  # noqa: BLE001 - reported
                row["linear_error"] = repr(e)[:300]
            try:
                s = torch.sparse.to_sparse_semi_structured(w)
                row["torch_packed_equal"] = bool(torch.equal(s.packed.view(-1)[: comp["values"].numel()].view(comp["values"].shape), comp["values"]))
                row["torch_meta_equal"] = bool(torch.equal(s.meta, comp["meta"]))
                s2 = torch.sparse.SparseSemiStructuredTensorCUTLASS(w.shape, comp["values"], comp["meta"], None, None, None, False)
                y2 = torch.nn.functional.linear(x, s2, None).double() if dtype != torch.int8 else torch.mm(s2, x.T.contiguous()).T.double()
                row["tensor_class_rel_err"] = float((y2 - ref).norm() / ref.norm().clamp_min(1e-30))
            except Exception as e:  # noqa: BLE001 - reported
                row["tensor_class_error"] = repr(e)[:300]
            rows.append(row)
    report["sm80"] = rows


def sm90(report: dict) -> None:
    out = {"cusparselt_available": bool(getattr(torch.backends, "cusparselt", None) and torch.backends.cusparselt.is_available())}
    if out["cusparselt_available"]:
        rows = []
        for dtype in (torch.float16, torch.int8):
            w = weight(128, 128, dtype, 7)
            comp = L.sm90_compress(w)
            try:
                buf = torch._cslt_compress(w).view(torch.uint8)
                vals = comp["values"].reshape(-1).view(torch.uint8)
                meta = comp["meta"].reshape(-1)
                b = bytes(buf.cpu().numpy())
                rows.append(
                    {
                        "dtype": str(dtype),
                        "buffer_bytes": len(b),
                        "values_bytes": vals.numel(),
                        "meta_bytes": meta.numel(),
                        "values_prefix_equal": b[: vals.numel()] == bytes(vals.cpu().numpy()),
                        "meta_found_in_buffer": bytes(meta.cpu().numpy()) in b,
                    }
                )
            except Exception as e:  # noqa: BLE001 - reported
                rows.append({"dtype": str(dtype), "error": repr(e)[:300]})
        out["cusparselt"] = rows
    report["sm90"] = out


def full_weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Exactly two non-zeros in every group of 4 (no degenerate group)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = prune24(torch.randn(n, k, device="cuda", generator=g))
    w = torch.where(w == 0, w, w.sign() * (w.abs() + 0.1))
    return (w * 30).round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else w.to(dtype)


def sm90_cslt(report: dict) -> None:
    """Give cuSPARSELt a buffer made of ctconvert's SM90 values and metadata and multiply with it."""
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.int8):
        for n, k, kind in ((128, 128, "full"), (256, 512, "full"), (128, 256, "degenerate"), (512, 1024, "degenerate")):
            w = full_weight(n, k, dtype, n + k) if kind == "full" else weight(n, k, dtype, n + k)
            comp = L.sm90_compress(w)
            vals = comp["values"].reshape(-1).view(torch.uint8)
            meta = comp["meta"].reshape(-1)
            row = {"dtype": str(dtype), "N": n, "K": k, "groups": kind}
            try:
                cbuf = torch._cslt_compress(w)  # 2-D in torch 2.11
                buf = cbuf.reshape(-1).view(torch.uint8)
                tail = buf[vals.numel() :]
                row["cslt_values_equal"] = bool(torch.equal(buf[: vals.numel()], vals))
                row["cslt_meta_bytes"] = int(tail.numel())
                row["cslt_meta_equal"] = bool(tail.numel() == meta.numel() and torch.equal(tail, meta))
                if tail.numel() == meta.numel():
                    row["cslt_meta_equal_bytes"] = int((tail == meta).sum())
                ours = torch.cat([vals, meta, buf[vals.numel() + meta.numel() :]]).view(cbuf.dtype).reshape(cbuf.shape)
                m = 64
                if dtype == torch.int8:
                    x = torch.randint(-8, 8, (k, m), device="cuda", dtype=torch.int8)
                    ref = (w.cpu().to(torch.int64) @ x.cpu().to(torch.int64)).double()
                    kw = {"out_dtype": torch.int32}
                else:
                    x = torch.randn(k, m, device="cuda", dtype=dtype)
                    ref = (w.double() @ x.double()).cpu()
                    kw = {}
                y = torch._cslt_sparse_mm(ours, x, **kw).double().cpu()
                y_ref_buf = torch._cslt_sparse_mm(cbuf, x, **kw).double().cpu()
                row["ours_rel_err"] = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
                row["cslt_rel_err"] = float((y_ref_buf - ref).norm() / ref.norm().clamp_min(1e-30))
                row["ours_equals_cslt_output"] = bool(torch.equal(y, y_ref_buf))
            except Exception as e:  # noqa: BLE001 - reported
                row["error"] = repr(e)[:300]
            rows.append(row)
    report["sm90_cslt"] = rows


def main() -> None:
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability()}
    for part in (sm90_cslt,) if "--cslt-only" in sys.argv else (sm80, sm90, sm90_cslt):
        try:
            part(report)
        except Exception as e:  # noqa: BLE001 - reported
            report[part.__name__ + "_error"] = repr(e)[:300]
    text = json.dumps(report, indent=1)
    if len(sys.argv) > 1 and not sys.argv[1].startswith("--"):
        open(sys.argv[1], "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
