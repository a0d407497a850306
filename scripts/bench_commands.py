"""quantize vs decompress vs CPU repack of the same checkpoint, as a user runs them (issue 17).

    python scripts/bench_commands.py [--model SRC] [--workdir /tmp/ctcmd] [--schemes FP8_DYNAMIC,NVFP4A16,W4A16] [--repeat 3]

Without ``--model`` a Llama-shaped bf16 checkpoint is made in the workdir
(``--hidden 1024 --intermediate 2816 --layers 4 --vocab 8192``: about 123 MB).
For each scheme: ``ctconvert quantize`` once, then ``quantize``, ``decompress``
and ``repack --target marlin --device cpu`` each ``--repeat`` times as separate
processes; reported is each command's own time (its ``--json`` ``seconds``,
the median; process start-up, mostly importing torch, is left out) and the
ratio to ``quantize``. One JSON line per scheme.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def _make_model(path: Path, hidden: int, inter: int, layers: int, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    heads, kv = max(1, hidden // 128), max(1, hidden // 256)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16), "lm_head.weight": r(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, shape in (
            ("self_attn.q_proj", (heads * 128, hidden)),
            ("self_attn.k_proj", (kv * 128, hidden)),
            ("self_attn.v_proj", (kv * 128, hidden)),
            ("self_attn.o_proj", (hidden, heads * 128)),
            ("mlp.gate_proj", (inter, hidden)),
            ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ):
            t[p + name + ".weight"] = r(*shape)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})


def _seconds(*args: str) -> float:
    out = subprocess.run([sys.executable, "-m", "ctconvert", "--json", *args, "--overwrite"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--workdir", default="/tmp/ctcmd")
    ap.add_argument("--schemes", default="FP8_DYNAMIC,NVFP4A16,W4A16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    work = Path(a.workdir)
    src = Path(a.model) if a.model else work / "model"
    if not a.model and not (src / "model.safetensors").exists():
        _make_model(src, a.hidden, a.intermediate, a.layers, a.vocab)
    for scheme in a.schemes.split(","):
        q, d, m = work / f"q-{scheme}", work / f"d-{scheme}", work / f"m-{scheme}"
        _seconds("quantize", str(src), "-s", scheme, "-o", str(q))
        times = {
            "quantize": [_seconds("quantize", str(src), "-s", scheme, "-o", str(q)) for _ in range(a.repeat)],
            "decompress": [_seconds("decompress", str(q), "-o", str(d)) for _ in range(a.repeat)],
            "repack_cpu": [_seconds("repack", str(q), "-o", str(m), "--target", "marlin", "--device", "cpu") for _ in range(a.repeat)],
        }
        med = {k: round(statistics.median(v), 3) for k, v in times.items()}
        print(
            json.dumps(
                {
                    "scheme": scheme,
                    **med,
                    "decompress_vs_quantize": round(med["decompress"] / med["quantize"], 2),
                    "repack_vs_quantize": round(med["repack_cpu"] / med["quantize"], 2),
                }
            )
        )
        for p in (d, m):
            shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    main()
