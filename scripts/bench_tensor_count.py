#!/usr/bin/env python3
"""What a conversion pays per tensor: a MoE checkpoint with Qwen3-30B-A3B's tensor count (48 layers of 128 experts,
18,867 tensors) but small matrices (299 MB), each run traced by scripts/trace_timeline.py.

Usage::

    python3 scripts/bench_tensor_count.py [--layers 48] [--experts 128] [--scheme NVFP4A16] [--device cpu] [--repeat 2]
        [--tree DIR ...] [--workdir /tmp/bench-tensor-count]

Per run: the call's seconds, when the executor started (planning, opening the shard headers and beginning the
source hashes come before it: nothing is read for the conversion until then), the executor's span, the time after
it (flushes, the index, the provenance), and milliseconds per source tensor. ``--tree DIR`` (repeatable) also runs
the ctconvert package of another tree of the project (e.g. ``git archive`` of an earlier commit), interleaved with this
checkout's; every output is compared with this checkout's, file for file (``identical`` is null without a
``--tree``). Minimum over ``--repeat`` runs. Exit 1 when two outputs differ.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_checkpoint(path: Path, layers: int, experts: int) -> Path:
    """A Qwen3-MoE checkpoint of ``layers`` x ``experts`` experts (hidden 128, expert width 64, vocab 1024; bf16,
    N(0, 0.02), seed 0) in 4 shards; made once."""
    if (path / "model.safetensors.index.json").exists():
        return path
    import torch
    from safetensors.torch import save_file

    h, i, v, hd = 128, 64, 1024, 32
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": h, "intermediate_size": 256,
        "moe_intermediate_size": i, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hd,
        "num_hidden_layers": layers, "vocab_size": v, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "num_experts_per_tok": 8, "num_experts": experts, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    }  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict] = [{} for _ in range(4)]
    shards[0].update({"model.embed_tokens.weight": w(v, h), "model.norm.weight": ones(h), "lm_head.weight": w(v, h)})
    for layer in range(layers):
        p, d = f"model.layers.{layer}.", shards[layer * 4 // layers]
        d.update({p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h)})
        d.update({p + "self_attn.q_proj.weight": w(4 * hd, h), p + "self_attn.k_proj.weight": w(2 * hd, h)})
        d.update({p + "self_attn.v_proj.weight": w(2 * hd, h), p + "self_attn.o_proj.weight": w(h, 4 * hd)})
        d.update({p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd), p + "mlp.gate.weight": w(experts, h)})
        for x in range(experts):
            q = f"{p}mlp.experts.{x}."
            d.update({q + "gate_proj.weight": w(i, h), q + "up_proj.weight": w(i, h), q + "down_proj.weight": w(h, i)})
    weight_map = {}
    for k, d in enumerate(shards):
        name = f"model-{k + 1:05d}-of-00004.safetensors"
        save_file(d, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(d, name))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tmp.rename(path)
    return path


def run(tree: Path, src: Path, out: Path, a) -> dict:
    """One traced conversion with the package of ``tree``: the figures of its timeline."""
    shutil.rmtree(out, ignore_errors=True)
    trace = out.with_suffix(".trace.json")
    script = tree / "scripts" / "trace_timeline.py"
    if not script.exists():  # another tree without the script: this checkout's, run there (it imports the tree's package)
        script = tree / "scripts" / "trace_timeline.py"
        script.parent.mkdir(exist_ok=True)
        shutil.copy(HERE / "trace_timeline.py", script)
    cmd = [sys.executable, str(script), "--bins", "1", "--out", str(trace), "--", "--json", "quantize", str(src), "-o", str(out)]
    p = subprocess.run([*cmd, "--scheme", a.scheme, "--device", a.device], capture_output=True, text=True, cwd=tree)
    if p.returncode:
        raise SystemExit(f"{tree}: exit {p.returncode}: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    k = json.loads(trace.read_text())
    trace.unlink()
    ex = k["kinds"]["executor"]
    return {"call": k["call_seconds"], "executor_start": ex["first_start"], "executor": ex["summed"], "after": round(k["call_seconds"] - ex["last_end"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48, help="decoder layers of the generated checkpoint (default 48)")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer (default 128)")
    ap.add_argument("--scheme", default="NVFP4A16", help="the scheme converted to (default NVFP4A16)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each tree; the minimum is kept (default 2)")
    ap.add_argument("--tree", type=Path, action="append", default=[], help="another tree of the project to compare")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-tensor-count"), help="the checkpoint and the outputs")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    src = make_checkpoint(a.workdir / f"src-{a.layers}x{a.experts}", a.layers, a.experts)
    count = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    trees = {"this": HERE.parent, **{f"tree{i}": t.resolve() for i, t in enumerate(a.tree)}}
    best: dict[str, dict] = {}
    same = True
    for rep in range(a.repeat):
        for label, tree in trees.items():
            r = run(tree, src, a.workdir / f"out-{label}", a)
            print(f"[rep {rep + 1}] {label}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()), file=sys.stderr, flush=True)
            if label not in best or r["call"] < best[label]["call"]:
                best[label] = r
            if label != "this":
                cmp = filecmp.dircmp(a.workdir / "out-this", a.workdir / f"out-{label}")
                _, bad, err = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files, shallow=False)
                differ = [*cmp.left_only, *cmp.right_only, *bad, *err]
                same &= not differ
                if differ:
                    print(f"[rep {rep + 1}] {label}: output differs ({', '.join(differ[:4])})", file=sys.stderr)
    for r in best.values():
        r["ms_per_tensor"] = round(r["call"] / count * 1e3, 3)
    print(
        json.dumps(
            {"source": str(src), "tensors": count, "scheme": a.scheme, "device": a.device, "identical": same if len(trees) > 1 else None, "min_by_call": best},
            indent=2,
        )
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
