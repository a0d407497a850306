"""quantize vs decompress vs CPU repack of the same checkpoint, as a user runs them (issue 17).

    python scripts/bench_commands.py [--model SRC] [--workdir /tmp/ctcmd] [--schemes FP8_DYNAMIC,NVFP4A16,W4A16] [--repeat 3]
                                     [--commands quantize,decompress,repack_cpu] [--code CHECKOUT] [--hash]

Without ``--model`` a Llama-shaped bf16 checkpoint is made in the workdir
(``--hidden 1024 --intermediate 2816 --layers 4 --vocab 8192``: about 123 MB);
``--model /tmp/ctbench/model`` is the 1.2B one ``scripts/bench.py --make-model`` makes.
For each scheme: ``ctconvert quantize`` once, then each of ``--commands``
(``quantize``, ``decompress``, ``repack --target marlin --device cpu``) ``--repeat``
times as separate processes, round-robin (so a change of load on a shared machine
touches every command alike), each into an output folder removed beforehand;
reported is each command's own time (its ``--json`` ``seconds``, the median;
process start-up, mostly importing torch, is left out) and the ratio to
``quantize``. ``--code``: the checkout whose ``ctconvert`` runs (put first on
``PYTHONPATH``; default: the one importable here), to time two versions with the
same script; ``--hash``: the sha256 of each decompressed shard, to compare two
versions' outputs byte for byte. One JSON line per scheme.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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


def _seconds(code: str | None, out: Path, *args: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    if code:  # first on the path, and the working directory (``python -m`` puts it before PYTHONPATH)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(code).resolve()), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "ctconvert", "--json", *args, "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(Path(code).resolve()) if code else None)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return float(json.loads(res.stdout)["seconds"])


def _sha256(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(64 * 2**20):
                h.update(block)
        out[f.name] = h.hexdigest()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--workdir", default="/tmp/ctcmd")
    ap.add_argument("--schemes", default="FP8_DYNAMIC,NVFP4A16,W4A16")
    ap.add_argument("--commands", default="quantize,decompress,repack_cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--code", help="checkout to run (first on PYTHONPATH)")
    ap.add_argument("--hash", action="store_true", help="sha256 of the decompressed shards")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    work = Path(a.workdir)
    src = Path(a.model) if a.model else work / "model"
    if not a.model and not (src / "model.safetensors").exists():
        _make_model(src, a.hidden, a.intermediate, a.layers, a.vocab)
    commands = a.commands.split(",")
    for scheme in a.schemes.split(","):
        q, o = work / f"q-{scheme}", work / f"o-{scheme}"
        argv = {
            "quantize": ("quantize", str(src), "-s", scheme),
            "decompress": ("decompress", str(q)),
            "repack_cpu": ("repack", str(q), "--target", "marlin", "--device", "cpu"),
        }
        _seconds(a.code, q, "quantize", str(src), "-s", scheme)
        times: dict[str, list[float]] = {c: [] for c in commands}
        for _ in range(a.repeat):
            for c in commands:
                times[c].append(_seconds(a.code, o, *argv[c]))
        med = {k: round(statistics.median(v), 3) for k, v in times.items()}
        line = {"scheme": scheme, **med}
        for c in commands:
            if c != "quantize" and "quantize" in med:
                line[f"{c}_vs_quantize"] = round(med[c] / med["quantize"], 2)
        if a.hash and "decompress" in commands:
            _seconds(a.code, o, *argv["decompress"])
            line["decompress_sha256"] = _sha256(o)
        print(json.dumps(line), flush=True)
        for p in (q, o):
            shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    main()
