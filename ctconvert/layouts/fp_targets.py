"""Module-level adapters for the FP8/NVFP4 kernels (``marlin-fp8``, ``marlin-nvfp4``, ``cutlass-nvfp4``).

Kernel tensors keep vLLM's parameter names after processing. Where vLLM's
processing loses information (scales cast or folded into the activation
dtype, the fused shards' global-scale divisors reduced to one reciprocal;
see :mod:`.marlin_fp` and :mod:`.cutlass`), the source tensor is kept beside
the kernel tensors under ``<name>_source`` so that the inverse is exact; a
kernel never reads those.
"""

from __future__ import annotations

import torch

from . import cutlass as C
from . import marlin_fp as F


def _strategy(weights: dict) -> str:
    return weights.get("strategy") or "channel"


def repack(kernel: str, t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
    if kernel == "marlin-fp8":
        w = t["weight"]
        n, k = w.shape
        k_out = F.marlin_fp8_repack(w, t["weight_scale"], act_dtype, v)
        out = {"weight": k_out["marlin_q_w"], "weight_scale": k_out["marlin_scales"], "weight_scale_source": t["weight_scale"]}
        if "bias" in t:
            out["bias"] = t["bias"]
        rec = {"kernel": kernel, "size_n": n, "size_k": k, "strategy": _strategy(weights), "layout_version": v,
               "scale_dtype": str(t["weight_scale"].dtype)}
        return out, rec
    if kernel == "marlin-nvfp4":
        wp = t["weight_packed"]
        n, k = wp.shape[0], wp.shape[1] * 2
        k_out = F.marlin_nvfp4_repack(wp, t["weight_scale"], t["weight_global_scale"], act_dtype, v)
        out = {"weight_packed": k_out["marlin_q_w"], "weight_scale": k_out["marlin_scales"],
               "weight_global_scale": k_out["marlin_global_scale"],
               "weight_scale_source": t["weight_scale"], "weight_global_scale_source": t["weight_global_scale"]}
        sf = k_out["scale_factor"]
        rec = {"kernel": kernel, "size_n": n, "size_k": k, "layout_version": v, "act_dtype": str(act_dtype).replace("torch.", ""),
               "scale_factor": float(sf) if sf.device.type != "meta" else None}
        return out, rec
    if kernel == "cutlass-nvfp4":
        wp = t["weight_packed"]
        n, k = wp.shape[0], wp.shape[1] * 2
        k_out = C.nvfp4_cutlass_layer(wp, t["weight_scale"], t["weight_global_scale"], t["input_global_scale"])
        out = {"weight_packed": k_out["weight"], "weight_scale": k_out["weight_scale"], "alpha": k_out["alpha"],
               "input_global_scale_inv": k_out["input_global_scale_inv"],
               "weight_global_scale_source": t["weight_global_scale"], "input_global_scale_source": t["input_global_scale"]}
        rec = {"kernel": kernel, "size_n": n, "size_k": k, "layout_version": v,
               "weights_padding_bytes": int(k_out["weights_padding_bytes"]) if wp.device.type != "meta" else None}
        return out, rec
    raise ValueError(f"unknown kernel {kernel!r}")


def unrepack(t: dict[str, torch.Tensor], rec: dict) -> dict[str, torch.Tensor]:
    kernel, n, k, v = rec["kernel"], rec["size_n"], rec["size_k"], rec["layout_version"]
    if kernel == "marlin-fp8":
        back = F.marlin_fp8_unrepack({"marlin_q_w": t["weight"], "marlin_scales": t["weight_scale"]}, n, k, v, strategy=rec["strategy"],
                                     scale_dtype=getattr(torch, rec["scale_dtype"].replace("torch.", "")))
        out = {"weight": back["weight"], "weight_scale": t["weight_scale_source"]}
        if "bias" in t:
            out["bias"] = t["bias"]
        return out
    if kernel == "marlin-nvfp4":
        act = torch.float16 if rec.get("act_dtype") == "float16" else torch.bfloat16
        back = F.marlin_nvfp4_unrepack({"marlin_q_w": t["weight_packed"], "marlin_scales": t["weight_scale"],
                                        "marlin_global_scale": t["weight_global_scale"],
                                        "scale_factor": torch.tensor(rec["scale_factor"] or 1.0)},
                                       n, k, act, v, weight_global_scale=t["weight_global_scale_source"])
        return {"weight_packed": back["weight_packed"], "weight_scale": t["weight_scale_source"],
                "weight_global_scale": t["weight_global_scale_source"]}
    if kernel == "cutlass-nvfp4":
        back = C.nvfp4_cutlass_unlayer({"weight": t["weight_packed"], "weight_scale": t["weight_scale"], "alpha": t["alpha"],
                                        "input_global_scale_inv": t["input_global_scale_inv"]}, n, k,
                                       weight_global_scale=t["weight_global_scale_source"])
        return {"weight_packed": back["weight_packed"], "weight_scale": back["weight_scale"],
                "weight_global_scale": t["weight_global_scale_source"], "input_global_scale": t["input_global_scale_source"]}
    raise ValueError(f"unknown kernel {kernel!r}")
