"""Tiny checkpoints in other tools' published layouts, and independent reference dequantizers.

Written from the formats' own descriptions (not from ctconvert's code):

- AutoAWQ GEMM (casper-hansen/AutoAWQ ``awq/modules/linear/gemm.py``, ``WQLinear_GEMM.from_linear``):
  ``qweight [K, N/8]`` int32, column ``8c + order[i]`` in nibble ``i`` with ``order = [0, 2, 4, 6, 1, 3, 5, 7]``;
  ``qzeros [K/G, N/8]`` the same way; fp16 ``scales [K/G, N]``; ``w = (q - z) * s``.
- GPTQ (AutoGPTQ ``qlinear_cuda_old.py`` ``QuantLinear.pack``): ``qweight [K*B/32, N]`` packed along K,
  ``qzeros [G, N*B/32]`` packed along N, value ``i`` of a word at bits ``i*B``; v1 stores ``zero - 1``;
  ``w[k, n] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])`` in fp16.
- ModelOpt NVFP4 (NVIDIA/Model-Optimizer ``nvfp4_tensor.py``): uint8 ``weight [N, K/2]`` (even column in the
  low nibble), E4M3 ``weight_scale [N, K/16]``, fp32 ``weight_scale_2``; ``w = e2m1 * (scale * scale_2)`` in fp32.
- Hugging Face FP8 block: E4M3 ``weight``, fp32 ``weight_scale_inv [ceil(N/128), ceil(K/128)]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 1,
    "vocab_size": 320,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}
#: module -> (N, K) of the one-layer model above
LINEARS = {
    "model.layers.0.self_attn.q_proj": (256, 256),
    "model.layers.0.self_attn.k_proj": (128, 256),
    "model.layers.0.self_attn.v_proj": (128, 256),
    "model.layers.0.self_attn.o_proj": (256, 256),
    "model.layers.0.mlp.gate_proj": (384, 256),
    "model.layers.0.mlp.up_proj": (384, 256),
    "model.layers.0.mlp.down_proj": (256, 384),
}


def dense_extras(dtype=torch.float16, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
    return {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(dtype),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "model.layers.0.input_layernorm.weight": torch.ones(h, dtype=dtype),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).to(dtype),
    }


def save(path: Path, tensors: dict[str, torch.Tensor], config: dict, extra_files: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, data in (extra_files or {}).items():
        (path / name).write_text(json.dumps(data))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# -- AutoAWQ GEMM --------------------------------------------------------------------------------


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """``q [R, C]`` 4-bit values (C a multiple of 8) -> int32 ``[R, C/8]`` in AutoAWQ's order."""
    r, c = q.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        out |= q[:, AWQ_ORDER[i] :: 8].to(torch.int64) << (4 * i)
    return out.to(torch.int64).where(out < 2**31, out - 2**32).to(torch.int32)


def make_awq_module(n: int, k: int, group: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AWQ tensors of one Linear and the reference fp16 dense weight ``[N, K]``."""
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // group, n), generator=gen)
    s = (torch.rand(k // group, n, generator=gen) * 0.01 + 1e-4).to(torch.float16)
    zk = z.repeat_interleave(group, 0)
    sk = s.repeat_interleave(group, 0)
    dense = ((q - zk).to(torch.float16) * sk).t().contiguous()  # AutoAWQ's fp16 arithmetic
    return {"qweight": awq_pack(q), "qzeros": awq_pack(z), "scales": s}, dense


def awq_checkpoint(path: Path, group: int = 128, seed: int = 0, in_config: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tensors, refs = dense_extras(), {}
    for mod, (n, k) in LINEARS.items():
        parts, refs[mod] = make_awq_module(n, k, group, gen)
        tensors.update({f"{mod}.{p}": t for p, t in parts.items()})
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    cfg = {**CONFIG, "quantization_config": qcfg} if in_config else dict(CONFIG)
    extra = None if in_config else {"quant_config.json": {"zero_point": True, "q_group_size": group, "w_bit": 4, "version": "GEMM"}}
    return save(path, tensors, cfg, extra), refs


# -- GPTQ ------------------------------------------------------------------------------------------


def pack_along(v: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Values ``v`` (unsigned, < 2^bits) packed ``32/bits`` per int32 along ``dim``, value ``i`` at bit ``i*bits``."""
    per = 32 // bits
    v = v.to(torch.int64)
    if dim == 1:
        v = v.t()
    rows = v.shape[0] // per
    out = torch.zeros(rows, v.shape[1], dtype=torch.int64)
    for i in range(per):
        out |= v[i::per] << (bits * i)
    out = out.where(out < 2**31, out - 2**32).to(torch.int32)
    return out.t().contiguous() if dim == 1 else out


def make_gptq_module(n, k, group, bits, gen, *, sym=True, act_order=False, v1=True):
    """GPTQ tensors of one Linear and the reference fp16 dense weight ``[N, K]``."""
    groups = k // group
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    if sym:
        z = torch.full((groups, n), 2 ** (bits - 1))
    else:
        z = torch.randint(0, 2**bits, (groups, n), generator=gen)
    s = (torch.rand(groups, n, generator=gen) * 0.01 + 1e-4).to(torch.float16)
    if act_order:
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // group).to(torch.int32)
    stored_z = (z - 1) % (2**bits) if v1 else z
    gi = g_idx.long()
    dense = (s[gi] * (q - z[gi]).to(torch.float16)).t().contiguous()  # AutoGPTQ's fp16 arithmetic
    parts = {"qweight": pack_along(q, bits, 0), "qzeros": pack_along(stored_z, bits, 1), "scales": s, "g_idx": g_idx}
    return parts, dense


def gptq_checkpoint(path: Path, *, bits=4, group=128, sym=True, act_order=False, v1=True, seed=0) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tensors, refs = dense_extras(), {}
    for mod, (n, k) in LINEARS.items():
        parts, refs[mod] = make_gptq_module(n, k, group, bits, gen, sym=sym, act_order=act_order, v1=v1)
        tensors.update({f"{mod}.{p}": t for p, t in parts.items()})
    qcfg = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": act_order,
        "sym": sym,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
        "damp_percent": 0.01,
    }
    return save(path, tensors, {**CONFIG, "quantization_config": qcfg}), refs


# -- ModelOpt NVFP4 ---------------------------------------------------------------------------------


def modelopt_reference(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.long)
    codes[:, 0::2] = (packed & 0x0F).long()
    codes[:, 1::2] = (packed >> 4).long()
    vals = lut[codes]
    per_block = scale.to(torch.float32) * scale_2
    n, k = vals.shape
    return (vals.view(n, k // 16, 16) * per_block.unsqueeze(-1)).reshape(n, k).to(torch.bfloat16)


def modelopt_checkpoint(path: Path, seed=0, in_config=True, fused_scale_2=True) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tensors, refs = dense_extras(torch.bfloat16), {}
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    good = e4m3[torch.isfinite(e4m3.float()) & (e4m3.float() > 0)]
    shared = {}
    for mod, (n, k) in LINEARS.items():
        parent, leaf = mod.rsplit(".", 1)
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
        scale = good[torch.randint(0, good.numel(), (n, k // 16), generator=gen)]
        s2 = torch.rand(1, generator=gen).to(torch.float32) * 1e-3 + 1e-5
        key = parent if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") and fused_scale_2 else mod
        s2 = shared.setdefault(key, s2)
        tensors[f"{mod}.weight"] = packed
        tensors[f"{mod}.weight_scale"] = scale
        tensors[f"{mod}.weight_scale_2"] = s2.reshape(()).clone()
        # one input scale per fused set, as an export calibrates it: the members read the same input (verify fails members that differ)
        inp = (torch.rand(1, generator=gen) * 0.1 + 0.01).reshape(())
        tensors[f"{mod}.input_scale"] = shared.setdefault(("input", key), inp).clone()
        refs[mod] = modelopt_reference(packed, scale, s2.reshape(()))
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
    cfg = {**CONFIG, "torch_dtype": "bfloat16"}
    extra = None
    if in_config:
        cfg["quantization_config"] = {"quant_method": "modelopt", **quant}
    else:
        extra = {"hf_quant_config.json": {"producer": {"name": "modelopt", "version": "0.46.0"}, "quantization": quant}}
    return save(path, tensors, cfg, extra), refs


# -- Hugging Face FP8 block (DeepSeek-V3 layout) -------------------------------------------------------------

DEEPSEEK_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "n_routed_experts": 2,
    "topk_method": "noaux_tc",  # the Hub's: vLLM 0.33 builds the router's e_score_correction_bias only so (deepseek_v2.py)
    "vocab_size": 320,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
}


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization of ``w`` (fp32) -> (E4M3 weight, fp32 weight_scale_inv)."""
    n, k = w.shape
    rb, cb = -(-n // 128), -(-k // 128)
    pad = torch.zeros(rb * 128, cb * 128)
    pad[:n, :k] = w
    blocks = pad.view(rb, 128, cb, 128)
    s = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / s[:, None, :, None]).view(rb * 128, cb * 128)[:n, :k].to(torch.float8_e4m3fn)
    return q, s.to(torch.float32)


def deepseek_checkpoint(path: Path, seed=0, static=False, partial=True) -> Path:
    """Two decoder layers (dense MLP, then MoE with shared experts) and the MTP layer (layer 2).

    ``partial``: MLA shapes that are not multiples of the 128x128 block (192, 160 rows; K = 192)."""
    qa, kva = (192, 160) if partial else (256, 128)
    gen = torch.Generator().manual_seed(seed)
    h, v = 256, 320

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    fp8 = {}
    dense = {
        "model.embed_tokens.weight": r(v, h).bfloat16(),
        "model.norm.weight": torch.ones(h).bfloat16(),
        "lm_head.weight": r(v, h).bfloat16(),
    }
    for layer in range(3):
        p = f"model.layers.{layer}."
        dense[p + "input_layernorm.weight"] = torch.ones(h).bfloat16()
        dense[p + "post_attention_layernorm.weight"] = torch.ones(h).bfloat16()
        fp8[p + "self_attn.q_a_proj"] = r(qa, h)  # 192: a partial block of rows
        fp8[p + "self_attn.kv_a_proj_with_mqa"] = r(kva, h)
        dense[p + "self_attn.q_a_layernorm.weight"] = torch.ones(qa).bfloat16()
        fp8[p + "self_attn.q_b_proj"] = r(256, qa)
        fp8[p + "self_attn.o_proj"] = r(h, 256)
        if layer == 0:
            for m in ("gate_proj", "up_proj"):
                fp8[p + f"mlp.{m}"] = r(384, h)
            fp8[p + "mlp.down_proj"] = r(h, 384)
        else:
            dense[p + "mlp.gate.weight"] = r(2, h).bfloat16()
            dense[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(2)
            for e in ("experts.0", "experts.1", "shared_experts"):
                fp8[p + f"mlp.{e}.gate_proj"] = r(128, h)
                fp8[p + f"mlp.{e}.up_proj"] = r(128, h)
                fp8[p + f"mlp.{e}.down_proj"] = r(h, 128)
    mtp = "model.layers.2."
    dense[mtp + "enorm.weight"] = torch.ones(h).bfloat16()
    dense[mtp + "hnorm.weight"] = torch.ones(h).bfloat16()
    dense[mtp + "eh_proj.weight"] = r(h, 2 * h).bfloat16()
    dense[mtp + "embed_tokens.weight"] = r(v, h).bfloat16()
    dense[mtp + "shared_head.norm.weight"] = torch.ones(h).bfloat16()
    dense[mtp + "shared_head.head.weight"] = r(v, h).bfloat16()
    tensors = dict(dense)
    for mod, w in fp8.items():
        q, s = fp8_block(w)
        tensors[mod + ".weight"] = q
        tensors[mod + ".weight_scale_inv"] = s
        if static:
            tensors[mod + ".input_scale"] = torch.tensor(0.05)
    cfg = json.loads(json.dumps(DEEPSEEK_CONFIG))
    cfg.update(q_lora_rank=qa, kv_lora_rank=kva - 32, qk_rope_head_dim=32)  # the MLA ranks of these tensors (else transformers' defaults)
    if static:
        cfg["quantization_config"]["activation_scheme"] = "static"
    return save(path, tensors, cfg)
