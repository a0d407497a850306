"""End-to-end benchmark: ctconvert vs the I/O floor vs llm-compressor's model_free_ptq.

    python scripts/bench.py [--workdir /tmp/ctbench] [--device cpu|cuda] [--repeat 2]
                            [--schemes FP8_DYNAMIC,W4A16,NVFP4A16] [--peer-python /work/venvs/llmc/bin/python]

Generates (once, cached in --workdir) a ~1B-parameter Llama-shaped bf16
checkpoint in several shards, or takes one with --model. Then, for each scheme
and repeat, interleaved, it runs three separate processes and records wall
seconds and peak RSS (from ``wait4``):

* floor: read every tensor with safetensors and write the same number of
  output bytes as ctconvert wrote, with safetensors, fsynced;
* ctconvert: ``python -m ctconvert quantize SRC -o OUT --scheme S --device D``;
* peer: llm-compressor's ``model_free_ptq`` with the same preset (when
  ``--peer-python`` points at an environment that has it; see peer_llmc.py).

Prints a table (stderr) and one JSON document (stdout) with medians and the
ratios ctconvert/floor and ctconvert/peer. The input is read from the page
cache after the first run (the machine has more RAM than the checkpoint), for
all three alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

FLOOR = r"""
import json, os, sys, math
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import save_file
src, out, nbytes, device = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
device = "cpu" if device == "cpu" else "cuda"  # the floor uses one device
files = sorted(src.glob("*.safetensors"))
total = 0
for f in files:
    with safe_open(f, "pt", device="cpu") as h:
        for k in h.keys():
            t = h.get_tensor(k)
            if device != "cpu":
                t = t.to(device)
            total += t.numel() * t.element_size()
if device != "cpu":
    torch.cuda.synchronize()
out.mkdir(parents=True, exist_ok=True)
shard = 5 * 10**9
left, i = nbytes, 0
while left > 0:
    n = min(shard, left)
    save_file({"data": torch.zeros(n, dtype=torch.uint8)}, str(out / f"floor-{i}.safetensors"))
    fd = os.open(out / f"floor-{i}.safetensors", os.O_RDONLY); os.fsync(fd); os.close(fd)
    left -= n; i += 1
"""


def make_model(path: Path, shards: int = 4) -> Path:
    """A random bf16 Llama-shaped checkpoint (~1.2B parameters), written shard by shard."""
    if (path / "model.safetensors.index.json").exists():
        return path
    import torch
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    c = CONFIG
    h, i, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    names = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        names += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for n, shape in names[s * per : (s + 1) * per]:
            part[n] = torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            weight_map[n] = fname
            total += part[n].numel() * 2
        save_file(part, str(tmp / fname), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    os.replace(tmp, path)
    return path


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; wall seconds and its peak RSS (bytes) from wait4.

    A child's peak RSS starts at its parent's RSS at fork time (Linux keeps the
    high-water mark across fork and exec), so this process never imports torch.
    """
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = b"", b""
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    out, err = p.stdout.read(), p.stderr.read()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({p.returncode}): {err.decode()[-2000:]}")
    return {"seconds": dt, "peak_rss_bytes": ru.ru_maxrss * 1024, "stdout": out.decode()}


COMPARE = r"""
import json, sys, torch
from pathlib import Path
from safetensors import safe_open
a, b = Path(sys.argv[1]), Path(sys.argv[2])
ia = json.loads((a / "model.safetensors.index.json").read_text())["weight_map"]
ib = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
same = set(ia) == set(ib)
for n in ia if same else []:
    with safe_open(a / ia[n], "pt") as f:
        x = f.get_tensor(n)
    with safe_open(b / ib[n], "pt") as f:
        y = f.get_tensor(n)
    if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
        same = False
        break
print(json.dumps({"identical": same, "tensors": len(ia)}))
"""


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/ctbench")
    ap.add_argument("--model", default=None, help="an existing bf16 checkpoint instead of the generated one")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--schemes", default="FP8_DYNAMIC,W4A16,NVFP4A16")
    ap.add_argument("--peer-python", default=os.environ.get("CTCONVERT_PEER_PYTHON", "/work/venvs/llmc/bin/python"))
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--make-model", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.make_model:  # run in a child so that this process stays small (children inherit its peak RSS)
        make_model(Path(a.make_model))
        return
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = Path(a.model) if a.model else work / "llama-1b-bf16"
    if not a.model and not (src / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, __file__, "--make-model", str(src)], check=True)
    in_bytes = dir_bytes(src)
    peer_ok = not a.no_peer and Path(a.peer_python).exists()
    py = sys.executable
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs: dict[tuple[str, str], list[dict]] = {}
    # warm the page cache and the compiled kernels once, untimed
    timed([py, "-c", FLOOR, str(src), str(work / "warm"), "1", "cpu"], env)
    for rep in range(a.repeat):
        for scheme in a.schemes.split(","):
            out = work / f"out-{scheme}"
            shutil.rmtree(out, ignore_errors=True)
            r = timed([py, "-m", "ctconvert", "--json", "quantize", str(src), "-o", str(out), "--scheme", scheme, "--device", a.device], env)
            r["output_bytes"] = dir_bytes(out)
            r["call_seconds"] = json.loads(r["stdout"])["seconds"]  # the conversion itself, without process start-up
            runs.setdefault((scheme, "ctconvert"), []).append(r)
            fl = work / "floor"
            shutil.rmtree(fl, ignore_errors=True)
            runs.setdefault((scheme, "floor"), []).append(timed([py, "-c", FLOOR, str(src), str(fl), str(r["output_bytes"]), a.device], env))
            if peer_ok:
                po = work / f"peer-{scheme}"
                shutil.rmtree(po, ignore_errors=True)
                pr = timed([a.peer_python, str(ROOT / "scripts" / "peer_llmc.py"), str(src), str(po), "--scheme", scheme, "--device", a.device])
                doc = json.loads(pr["stdout"].strip().splitlines()[-1])
                pr["call_seconds"] = doc.get("seconds")
                if rep == 0:  # every tensor byte-identical to llm-compressor's?
                    cmp = timed([py, "-c", COMPARE, str(out), str(po)], env)
                    pr["identical"] = json.loads(cmp["stdout"].strip().splitlines()[-1])["identical"]
                runs.setdefault((scheme, "peer"), []).append(pr)
            print(
                f"[rep {rep + 1}] {scheme}: "
                + ", ".join(f"{k}={runs[(scheme, k)][-1]['seconds']:.2f}s" for k in ("floor", "ctconvert", "peer") if (scheme, k) in runs),
                file=sys.stderr,
            )
    results = []
    for scheme in a.schemes.split(","):
        row = {"scheme": scheme, "device": a.device, "input_bytes": in_bytes}
        for who in ("floor", "ctconvert", "peer"):
            rs = runs.get((scheme, who))
            if not rs:
                continue
            sec = statistics.median(r["seconds"] for r in rs)
            row[who] = {"seconds": round(sec, 3), "GBps_input": round(in_bytes / sec / 1e9, 3), "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs)}
            if who in ("peer", "ctconvert"):
                row[who]["call_seconds"] = round(statistics.median(r["call_seconds"] for r in rs), 3)
            if who == "peer":
                row["outputs_identical_to_peer"] = rs[0].get("identical")
        c = row["ctconvert"]
        row["ctconvert"]["output_bytes"] = runs[(scheme, "ctconvert")][-1]["output_bytes"]
        row["ratio_ctconvert_over_floor"] = round(c["seconds"] / row["floor"]["seconds"], 3)
        if "peer" in row:
            row["ratio_wall_ctconvert_over_peer"] = round(c["seconds"] / row["peer"]["seconds"], 3)
            row["ratio_wall_ctconvert_over_peer_call"] = round(c["seconds"] / row["peer"]["call_seconds"], 3)
            row["ratio_rss_ctconvert_over_peer"] = round(c["peak_rss_bytes"] / row["peer"]["peak_rss_bytes"], 3)
        results.append(row)
    _table(results)
    json.dump({"model": str(src), "input_bytes": in_bytes, "repeat": a.repeat, "results": results}, sys.stdout, indent=2)
    print()


def _table(results: list[dict]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        return
    t = Table(title="ctconvert benchmark (median wall seconds, GB/s of bf16 input, peak RSS)")
    for col in ("scheme", "device", "floor", "ctconvert (process / call)", "peer (process / call)", "ct/floor", "ct/peer", "RSS ct/peer"):
        t.add_column(col)

    def cell(r, k):
        if k not in r:
            return "-"
        return f"{r[k]['seconds']:.2f}s {r[k]['GBps_input']:.2f}GB/s {r[k]['peak_rss_bytes'] / 2**20:.0f}MiB"

    for r in results:
        peer = f"{cell(r, 'peer')} / {r['peer']['call_seconds']:.2f}s" if "peer" in r else "-"
        ct = f"{cell(r, 'ctconvert')} / {r['ctconvert']['call_seconds']:.2f}s"
        t.add_row(
            r["scheme"],
            r["device"],
            cell(r, "floor"),
            ct,
            peer,
            str(r["ratio_ctconvert_over_floor"]),
            str(r.get("ratio_wall_ctconvert_over_peer", "-")),
            str(r.get("ratio_rss_ctconvert_over_peer", "-")),
        )
    Console(stderr=True, width=200).print(t)


if __name__ == "__main__":
    main()
