"""End-to-end benchmark: ctconvert against the machine's I/O floor, its quantize kernels and llm-compressor.

    python scripts/bench.py [--workdir /tmp/ctbench] [--size 1b|8b] [--model DIR] [--device cpu|cuda]
                            [--repeat 2] [--schemes FP8_DYNAMIC,W4A16,NVFP4A16] [--peer-python /work/venvs/llmc/bin/python]
                            [--cold [--drop-caches]] [--family llama|qwen3_moe|qwen3_moe_fused|gpt_oss [--scale 1.0]] [--source-scheme FP8_BLOCK]
                            [--peer-cache FILE]

Generates (once, cached in --workdir) a Llama-shaped bf16 checkpoint, ~1.2B
parameters (``--size 1b``, the default) or Llama-3-8B's shape (``--size 8b``,
16 GB: for machines with the disk for it), or takes one with --model. Then, for
each scheme and repeat, interleaved, in separate processes:

* read floor: every input byte read from the page cache as fast as the machine
  allows (several threads, 64 MiB ``preadv`` into reused buffers);
* write floor: the output's byte count written (several threads, 64 MiB
  ``pwrite``) into 5 GB files and fsynced;
* concurrent floor: both at once, as a conversion must do them: every input
  byte read (``--io-threads`` threads) while as many threads write the output's
  byte count and fsync it; its time is the later of the two to finish
  (``concurrent_seconds``, with each side's own time beside it);
* kernels: the quantize kernels' own time over the same weights on the same
  device (weights read beforehand, absmax + quantize per row chunk, no I/O);
* ctconvert: ``python -m ctconvert --json quantize SRC -o OUT --scheme S --device D``:
  the whole process (wall, peak RSS from ``wait4``) and its call (``--json`` ``seconds``);
* peer: llm-compressor's ``model_free_ptq`` with the same preset (when
  ``--peer-python`` points at an environment that has it; see peer_llmc.py).

``--cold`` evicts the input from the page cache before every ctconvert run and
every read (and concurrent) floor: ``fsync`` + ``posix_fadvise(DONTNEED)`` on
each input file (no root needed); with ``--drop-caches`` also
``/proc/sys/vm/drop_caches`` where it is writable (the whole machine's cache:
not on a shared machine). Without ``--cold`` the input is read once, untimed,
so every run finds it in the page cache (warm).

``--family qwen3_moe`` generates a Qwen3-MoE-shaped checkpoint (per-expert
``experts.N.{gate,up,down}_proj``, ~10 GB at ``--scale 1``: 8 layers of 128
experts of Qwen3-30B-A3B's shape), ``--family qwen3_moe_fused`` the same experts fused as transformers 5 saves
them (``experts.gate_up_proj [E, 2I, H]`` gate first, ``down_proj [E, H, I]``), ``--family gpt_oss`` a gpt-oss-shaped one
(fused 3-D ``experts.gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` with
biases, quantized with ``--targets`` naming the experts and ``--allow-unloadable``: vLLM 0.33 cannot load them); ``--scale`` shrinks
the experts and the vocabulary for a CPU run (0.125: ~1.4 GB).
``--source-scheme FP8_BLOCK`` quantizes the generated checkpoint to that scheme
once and benchmarks requantizing it (input bytes: the FP8 checkpoint's); the
kernels figure is then skipped (it reads dense weights).

Outputs are deleted after each run (disk). Each figure is the minimum over the
repeats (a shared machine only ever makes a run slower); the table (stderr) and
the JSON document (stdout) give ctconvert's call and process time against
``max(read, write)`` (and ``max(read, write, kernels)``) and ``read + write``, the
resource that bounds the run, and the ratios to the peer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
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

FLOORS = r"""
import json, os, sys, threading, time
from pathlib import Path
what, threads = sys.argv[1], int(sys.argv[2])
CH = 64 * 2**20
def run(ranges, fn, mode):
    # ranges: (path, offset, nbytes) pieces of at most CH; dealt round-robin to the threads
    errs = []
    def work(part):
        buf = bytearray(CH)
        view = memoryview(buf)
        fds = {}
        try:
            for path, off, n in part:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, mode)
                fn(fd, view[:n], off)
        except BaseException as e:
            errs.append(e)
        finally:
            for fd in fds.values():
                os.close(fd)
    ts = [threading.Thread(target=work, args=(ranges[i::threads],)) for i in range(threads)]
    for t in ts: t.start()
    for t in ts: t.join()
    if errs: raise errs[0]
def pieces(files):
    return [(f, o, min(CH, s - o)) for f, s in files for o in range(0, s, CH)]
def rd(fd, v, off):
    got = 0
    while got < len(v):
        k = os.preadv(fd, [v[got:]], off + got)
        if k <= 0: raise OSError("short read")
        got += k
def wr(fd, v, off):
    done = 0
    while done < len(v):
        done += os.pwrite(fd, v[done:], off + done)
def read_all(src):
    files = [(str(p), p.stat().st_size) for p in sorted(Path(src).glob("*.safetensors"))]
    run(pieces(files), rd, os.O_RDONLY)
    return sum(s for _, s in files)
def write_all(out, nbytes):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files, left = [], nbytes
    while left > 0:
        n = min(5 * 10**9, left)
        p = out / f"floor-{len(files)}.bin"
        with open(p, "wb") as f: f.truncate(n)
        files.append((str(p), n)); left -= n
    run(pieces(files), wr, os.O_WRONLY)
    for p, _ in files:
        fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
    return nbytes
t0 = time.perf_counter()
doc = {"what": what, "threads": threads}
if what == "read":
    doc["bytes"] = read_all(sys.argv[3])
elif what == "write":
    doc["bytes"] = write_all(sys.argv[3], int(sys.argv[4]))
else:  # both: read the input while writing the output's bytes, each side on its own threads
    took = {}
    def side(name, fn, *args):
        fn(*args)
        took[name] = time.perf_counter() - t0
    ts = [threading.Thread(target=side, args=("read_seconds", read_all, sys.argv[3]))]
    ts.append(threading.Thread(target=side, args=("write_seconds", write_all, sys.argv[4], int(sys.argv[5]))))
    for t in ts: t.start()
    for t in ts: t.join()
    if len(took) < 2: raise SystemExit("a side of the concurrent floor failed")
    doc.update(took)
doc["seconds"] = time.perf_counter() - t0
print(json.dumps(doc))
"""

KERNELS = r"""
import json, sys, time
import torch
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import read_tensor
from ctconvert.formats.common import tensor_absmax
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.pipeline.executor import DEFAULT_CHUNK_ELEMS
from ctconvert.plan.planner import make_plan
src, scheme, device = sys.argv[1], sys.argv[2], torch.device(sys.argv[3])
ckpt = open_checkpoint(src, strict=True)
plan = make_plan(ckpt, scheme)
total, nbytes = 0.0, 0
def sync():
    if device.type == "cuda": torch.cuda.synchronize(device)
with torch.inference_mode():
    for u in plan.units:
        if u.kind == "copy":
            continue
        ws = [read_tensor(ckpt.tensors[s]).to(device) for s in u.sources]  # not timed: the weights are in memory first
        sync()
        t0 = time.perf_counter()
        gs = None
        if u.scheme.global_scale:
            amax = torch.stack([tensor_absmax(w).to(device) for w in ws]).amax()
            gs = nvfp4_global_scale(amax, ws[0].dtype)
        for w in ws:
            step = max(1, DEFAULT_CHUNK_ELEMS // max(1, w.shape[1]))
            align = u.scheme.row_align
            step = max(align, step // align * align)
            for r0 in range(0, w.shape[0], step):
                u.scheme.quantize_rows(w[r0 : r0 + step], gs)
        sync()
        total += time.perf_counter() - t0
        nbytes += sum(w.numel() * w.element_size() for w in ws)
        del ws
print(json.dumps({"seconds": total, "bytes": nbytes}))
"""


#: Qwen3-30B-A3B's expert shape (hidden 2048, moe_intermediate 768, 128 experts, 8 of them per token), 8 layers:
#: ~10 GB of bf16 at --scale 1 (the H200 run); gpt-oss uses the same sizes in its fused 3-D layout
CONFIG_MOE = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "num_experts_per_tok": 8,
}
MOE_EXPERTS = 128


SCALE_LLAMA = "--scale and --layers size the MoE families; a Llama is sized by --size 1b|8b"


def model_config(family: str, size: str, scale: float, layers: int | None = None) -> dict:
    """The config.json of the generated checkpoint; ``layers`` the MoE families' decoder layers (default 8; each ~1.25 GB
    of bf16 at ``scale`` 1: 12 layers make ~16.2 GB, the dense 8B's size). Raises ``ValueError`` for a Llama with a
    ``scale`` or ``layers`` (it has neither), or an odd ``layers`` for gpt-oss (its sliding and full layers alternate)."""
    if family == "llama":
        if scale != 1.0 or layers is not None:
            raise ValueError(SCALE_LLAMA)
        return CONFIG_8B if size == "8b" else CONFIG
    c = dict(CONFIG_MOE, vocab_size=max(1024, int(CONFIG_MOE["vocab_size"] * scale) // 64 * 64))
    if layers is not None:
        if layers < 2 or (family == "gpt_oss" and layers % 2):
            raise ValueError(f"--layers {layers}: a MoE family needs at least 2 layers, gpt-oss an even count")
        c["num_hidden_layers"] = layers
    experts = max(4, int(MOE_EXPERTS * scale))
    c["num_experts_per_tok"] = min(c["num_experts_per_tok"], experts)  # a scaled-down MoE routes to the experts it has
    if family in ("qwen3_moe", "qwen3_moe_fused"):
        extra = {"num_experts": experts, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
        fused = {"fused_experts": True} if family == "qwen3_moe_fused" else {}  # read by model_tensors only; dropped from config.json
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **c, **extra, **fused}
    c["intermediate_size"] = c.pop("moe_intermediate_size")
    c["layer_types"] = ["sliding_attention", "full_attention"] * (c["num_hidden_layers"] // 2)
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **c, "num_local_experts": experts, "sliding_window": 128}


def model_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of the generated checkpoint, in the order they are stored."""
    h, v, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    names = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        names += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        names += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h))]
        names += [(p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]
        if c["model_type"] == "llama":
            i = c["intermediate_size"]
            names += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i))]
        elif c["model_type"] == "qwen3_moe":
            e, i = c["num_experts"], c["moe_intermediate_size"]
            names += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)), (p + "mlp.gate.weight", (e, h))]
            if c.get("fused_experts"):  # transformers 5's own save (save_original_format=False): [E, 2I, H] gate first, [E, H, I]
                names += [(p + "mlp.experts.gate_up_proj", (e, 2 * i, h)), (p + "mlp.experts.down_proj", (e, h, i))]
                continue
            for x in range(e):
                x = f"{p}mlp.experts.{x}."
                names += [(x + "gate_proj.weight", (i, h)), (x + "up_proj.weight", (i, h)), (x + "down_proj.weight", (h, i))]
        else:  # gpt_oss: fused 3-D experts used as x @ W, gate/up interleaved (transformers GptOssExperts)
            e, i = c["num_local_experts"], c["intermediate_size"]
            names += [(p + f"self_attn.{m}_proj.bias", (n,)) for m, n in (("q", q), ("k", kv), ("v", kv), ("o", h))]
            names += [(p + "self_attn.sinks", (c["num_attention_heads"],)), (p + "mlp.router.weight", (e, h)), (p + "mlp.router.bias", (e,))]
            names += [(p + "mlp.experts.gate_up_proj", (e, h, 2 * i)), (p + "mlp.experts.gate_up_proj_bias", (e, 2 * i))]
            names += [(p + "mlp.experts.down_proj", (e, i, h)), (p + "mlp.experts.down_proj_bias", (e, h))]
    return names


def make_model(path: Path, shards: int = 4, size: str = "1b", family: str = "llama", scale: float = 1.0, layers: int | None = None) -> Path:
    """A random bf16 checkpoint, written shard by shard: Llama-shaped with ~1.2B parameters (``1b``: every weight
    drawn from N(0, 0.02), seed 0) or Llama-3-8B's shape (``8b``), or a MoE (``family``: :func:`model_config`); the
    8B's and the MoE's weights are cut from one 256 MiB N(0, 0.02) pool at random offsets and scales, so that
    gigabytes are made at memory speed. 1-D tensors are ones (norms) or, for biases and sinks, pool values."""
    if (path / "model.safetensors.index.json").exists():
        return path
    import torch
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    c = model_config(family, size, scale, layers)
    pooled = size == "8b" or family != "llama"
    pool = (torch.randn(2**27, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16) if pooled else None
    rng = torch.Generator().manual_seed(2)

    def weight(shape, g):
        if pool is None:
            return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        n = math.prod(shape)
        out = torch.empty(n, dtype=torch.bfloat16)
        pos = 0
        while pos < n:
            o = int(torch.randint(0, pool.numel() // 2, (1,), generator=rng))
            k = min(n - pos, pool.numel() - o)
            out[pos : pos + k] = pool[o : o + k] * (0.5 + float(torch.rand((), generator=rng)))
            pos += k
        return out.reshape(shape)

    names = model_tensors(c)
    total_bytes = sum(math.prod(shape) * 2 for _, shape in names)
    weight_map, total, s, part, part_bytes = {}, 0, 0, {}, 0
    g = torch.Generator().manual_seed(0)
    per = -(-len(names) // shards)
    for k, (n, shape) in enumerate(names):  # the Llama's shards: equal tensor counts; a MoE's: equal bytes
        norm = len(shape) == 1 and n.endswith("norm.weight")
        part[n] = torch.ones(shape, dtype=torch.bfloat16) if norm else weight(shape, g)
        part_bytes += part[n].numel() * 2
        last = k == len(names) - 1
        full = (k + 1) % per == 0 if family == "llama" else part_bytes >= total_bytes / shards
        if last or full:
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
            total += part_bytes
            s, part, part_bytes = s + 1, {}, 0
    if s != shards:  # the last shard came early: name them by the count there is
        for old in sorted(tmp.glob("*.safetensors")):
            new = old.name.replace(f"-of-{shards:05d}", f"-of-{s:05d}")
            old.rename(tmp / new)
        weight_map = {n: f.replace(f"-of-{shards:05d}", f"-of-{s:05d}") for n, f in weight_map.items()}
    c.pop("fused_experts", None)
    (tmp / "config.json").write_text(json.dumps(c, indent=2))
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


def _json(r: dict) -> dict:
    """The JSON document a child printed: its whole stdout, or else its last line."""
    try:
        return json.loads(r["stdout"])
    except ValueError:
        return json.loads(r["stdout"].strip().splitlines()[-1])


def evict(src: Path, drop_caches: bool = False) -> None:
    """Take ``src``'s files out of the page cache: fsync (dirty pages cannot be dropped) and
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file, which needs no root; with ``drop_caches`` also
    ``/proc/sys/vm/drop_caches`` (3: page cache, dentries, inodes) where this process may write it."""
    for f in sorted(src.rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    if drop_caches and os.access("/proc/sys/vm/drop_caches", os.W_OK):
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _source(a, work: Path, py: str, env: dict) -> Path:
    """The checkpoint the runs read: --model, else the generated one (made once), else (--source-scheme) the
    generated one quantized to that scheme (made once)."""
    if a.model:
        src = Path(a.model)
    else:
        name = {"llama": "llama-1b-bf16" if a.size == "1b" else "llama3-8b-bf16"}.get(
            a.family, f"{a.family}-x{a.scale:g}{f'-l{a.layers}' if a.layers else ''}-bf16"
        )
        src = work / name
        if not (src / "model.safetensors.index.json").exists():
            subprocess.run(
                [py, __file__, "--make-model", str(src), "--size", a.size, "--family", a.family, "--scale", str(a.scale)]
                + (["--layers", str(a.layers)] if a.layers else []),
                check=True,
            )
    if not a.source_scheme:
        return src
    q = work / f"{src.name}-{a.source_scheme.lower()}"
    if not (q / "config.json").exists():
        timed([py, "-m", "ctconvert", "--json", "quantize", str(src), "-o", str(q), "--scheme", a.source_scheme, "--device", a.device, "--overwrite"], env)
    return q


def _args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/ctbench")
    ap.add_argument("--model", default=None, help="an existing checkpoint instead of the generated one")
    ap.add_argument("--size", default="1b", choices=("1b", "8b"), help="the generated Llama: ~1.2B parameters or Llama-3-8B's shape")
    families = ("llama", "qwen3_moe", "qwen3_moe_fused", "gpt_oss")
    ap.add_argument("--family", default="llama", choices=families, help="the generated checkpoint's family (MoE: see above)")
    ap.add_argument("--scale", type=float, default=1.0, help="MoE families: the share of the 128 experts and of the vocabulary (0.125 for a CPU run)")
    ap.add_argument("--layers", type=int, default=None, help="MoE families: decoder layers (default 8, ~11.2 GB; 12: ~16.2 GB, the dense 8B's size)")
    ap.add_argument("--source-scheme", default="", help="benchmark requantizing: the generated checkpoint quantized to this scheme first (FP8_BLOCK)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--schemes", default="FP8_DYNAMIC,W4A16,NVFP4A16")
    ap.add_argument("--io-threads", type=int, default=min(8, os.cpu_count() or 1), help="threads of the read and write floors")
    ap.add_argument("--cold", action="store_true", help="evict the input from the page cache before every run and read floor")
    ap.add_argument("--drop-caches", action="store_true", help="with --cold: also write /proc/sys/vm/drop_caches where writable (whole machine)")
    ap.add_argument("--peer-python", default=os.environ.get("CTCONVERT_PEER_PYTHON", "/work/venvs/llmc/bin/python"))
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-cache", default=None, help="JSON file of the peer's figures: runs it holds are reused, new ones added")
    ap.add_argument("--no-kernels", action="store_true", help="skip timing the quantize kernels on their own")
    ap.add_argument("--extra", default="", help="extra ctconvert quantize arguments, e.g. '--target marlin'")
    ap.add_argument("--code", default=None, help="run the ctconvert of this checkout (default: this script's), e.g. a baseline for an A/B")
    ap.add_argument("--make-model", default=None, metavar="DIR", help="only write the generated checkpoint (--size, --family, --scale) into DIR and exit")
    return ap.parse_args()


#: quantize arguments a generated family needs: gpt-oss experts are left dense unless targeted (vLLM cannot load them
#: quantized), and this benchmark is about converting them
FAMILY_ARGS = {"gpt_oss": ["--allow-unloadable", "--targets", "Linear", "--targets", r"re:.*mlp\.experts\.\d+\..*"]}  # a rate, not a vLLM output


WHO = ("read", "write", "concurrent", "kernels", "ctconvert", "peer")


def main() -> None:
    a = _args()
    if (a.scale != 1.0 or a.layers is not None) and a.family == "llama":
        sys.exit(f"bench.py: {SCALE_LLAMA}")
    if a.make_model:  # run in a child so that this process stays small (children inherit its peak RSS)
        make_model(Path(a.make_model), size=a.size, family=a.family, scale=a.scale, layers=a.layers)
        return
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    code = Path(a.code).resolve() if a.code else ROOT  # the ctconvert the runs use (an A/B against another checkout)
    env = dict(os.environ, PYTHONPATH=str(code) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    src = _source(a, work, py, env)
    in_bytes = dir_bytes(src)
    peer_ok = not a.no_peer and not a.source_scheme and a.family == "llama" and Path(a.peer_python).exists()
    kernels = not a.no_kernels and not a.source_scheme
    runs: dict[tuple[str, str], list[dict]] = {}
    threads = str(a.io_threads)
    if not a.cold:
        timed([py, "-c", FLOORS, "read", threads, str(src)], env)  # warm the page cache, untimed
    extra = [*(FAMILY_ARGS.get(a.family, []) if not a.model else []), *a.extra.split()]
    schemes = a.schemes.split(",")
    for rep in range(a.repeat):
        for scheme in schemes:
            _measure(a, scheme, src, work, py, env, extra, kernels, peer_ok and rep == 0 and not a.extra, runs)
            if peer_ok:
                _peer(a, scheme, src, work, py, env, rep == 0 and not a.extra, runs)
            shutil.rmtree(work / f"out-{scheme}", ignore_errors=True)
            print(
                f"[rep {rep + 1}] {scheme}: "
                + ", ".join(
                    f"{k}={runs[(scheme, k)][-1]['seconds']:.2f}s"
                    for k in ("read", "write", "concurrent", "kernels", "ctconvert", "peer")
                    if (scheme, k) in runs
                )
                + f", call={runs[(scheme, 'ctconvert')][-1]['call_seconds']:.2f}s",
                file=sys.stderr,
            )
    results = [_row(scheme, a, in_bytes, runs) for scheme in schemes]
    _table(results)
    doc = {"model": str(src), "size": a.size if not a.model else None, "family": a.family if not a.model else None, "input_bytes": in_bytes}
    doc.update({"cold": a.cold, "source_scheme": a.source_scheme or None, "code": str(a.code or ROOT), "repeat": a.repeat, "statistic": "min"})
    doc["results"] = results
    json.dump(doc, sys.stdout, indent=2)
    print()


def _measure(a, scheme: str, src: Path, work: Path, py: str, env: dict, extra: list, kernels: bool, keep: bool, runs: dict) -> None:
    """One repeat of one scheme: ctconvert, the read, write and concurrent floors, the kernels (each cold with --cold).
    ``keep``: leave the output for the peer's comparison."""
    out = work / f"out-{scheme}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [py, "-m", "ctconvert", "--json", "quantize", str(src), "-o", str(out), "--scheme", scheme, "--device", a.device, *extra]
    if a.cold:
        evict(src, a.drop_caches)
    r = timed(cmd, env)
    r["output_bytes"] = dir_bytes(out)
    r["call_seconds"] = _json(r)["seconds"]  # the conversion itself, without process start-up
    runs.setdefault((scheme, "ctconvert"), []).append(r)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    threads = str(a.io_threads)
    fl = work / "floor"
    for what, args in (("read", [str(src)]), ("write", [str(fl), str(r["output_bytes"])]), ("concurrent", [str(src), str(fl), str(r["output_bytes"])])):
        shutil.rmtree(fl, ignore_errors=True)
        if a.cold and what != "write":
            evict(src, a.drop_caches)
        f = timed([py, "-c", FLOORS, "read" if what == "read" else "write" if what == "write" else "both", threads, *args], env)
        f.update(_json(f))
        runs.setdefault((scheme, what), []).append(f)
    shutil.rmtree(fl, ignore_errors=True)
    if kernels:
        k = timed([py, "-c", KERNELS, str(src), scheme, a.device], env)
        k["seconds"] = _json(k)["seconds"]
        runs.setdefault((scheme, "kernels"), []).append(k)


def _peer(a, scheme: str, src: Path, work: Path, py: str, env: dict, compare: bool, runs: dict) -> None:
    """llm-compressor's model_free_ptq on the same input; ``compare``: every tensor against ctconvert's output. With
    ``--peer-cache`` the cached figures of this model, scheme, device and repeat when the cache has them (the peer is
    slow; its figures do not change with ctconvert's code), else the run's figures are added to it."""
    key = f"{Path(src).resolve()}|{scheme}|{a.device}|{'cold' if a.cold else 'warm'}"
    cache = json.loads(Path(a.peer_cache).read_text()) if a.peer_cache and Path(a.peer_cache).exists() else {}
    rep = len(runs.get((scheme, "peer"), []))
    if len(cache.get(key, [])) > rep:
        runs.setdefault((scheme, "peer"), []).append(cache[key][rep])
        return
    out, po = work / f"out-{scheme}", work / f"peer-{scheme}"
    shutil.rmtree(po, ignore_errors=True)
    if a.cold:
        evict(src, a.drop_caches)
    pr = timed([a.peer_python, str(ROOT / "scripts" / "peer_llmc.py"), str(src), str(po), "--scheme", scheme, "--device", a.device])
    pr["call_seconds"] = _json(pr).get("seconds")
    if compare:  # every tensor byte-identical to llm-compressor's?
        pr["identical"] = _json(timed([py, "-c", COMPARE, str(out), str(po)], env))["identical"]
    shutil.rmtree(po, ignore_errors=True)
    runs.setdefault((scheme, "peer"), []).append(pr)
    if a.peer_cache:
        cache.setdefault(key, []).append(pr)
        Path(a.peer_cache).write_text(json.dumps(cache, indent=1))


def _row(scheme: str, a, in_bytes: int, runs: dict) -> dict:
    """One scheme's figures (minimum over the repeats) and ratios."""

    def best(who: str, key: str = "seconds"):
        rs = runs.get((scheme, who))
        return round(min(r[key] for r in rs), 3) if rs else None

    row = {"scheme": scheme, "device": a.device, "extra": a.extra, "input_bytes": in_bytes}
    row["read_seconds"], row["write_seconds"], row["kernels_seconds"] = best("read"), best("write"), best("kernels")
    row["cold"] = a.cold
    conc = runs[(scheme, "concurrent")]
    row["concurrent_seconds"] = best("concurrent")  # read every input byte while writing the output's bytes (fsync)
    row["concurrent_read_seconds"] = round(min(r["read_seconds"] for r in conc), 3)
    row["concurrent_write_seconds"] = round(min(r["write_seconds"] for r in conc), 3)
    row["output_bytes"] = runs[(scheme, "ctconvert")][-1]["output_bytes"]
    call, proc = best("ctconvert", "call_seconds"), best("ctconvert")
    row["ctconvert"] = {"call_seconds": call, "process_seconds": proc, "peak_rss_bytes": min(r["peak_rss_bytes"] for r in runs[(scheme, "ctconvert")])}
    row["ctconvert"]["GBps_input_call"] = round(in_bytes / call / 1e9, 3)
    io_max = max(row["read_seconds"], row["write_seconds"])
    row["floor_max_read_write"] = io_max
    row["floor_sum_read_write"] = round(row["read_seconds"] + row["write_seconds"], 3)
    bounds = {"read": row["read_seconds"], "write": row["write_seconds"]}
    if row["kernels_seconds"] is not None:
        bounds["kernels"] = row["kernels_seconds"]
    row["floor_max_read_write_kernels"] = max(bounds.values())
    row["bound_by"] = max(bounds, key=bounds.get)
    row["ratio_call_over_max_read_write"] = round(call / io_max, 3)
    row["ratio_call_over_max_read_write_kernels"] = round(call / row["floor_max_read_write_kernels"], 3)
    row["ratio_call_over_sum_read_write"] = round(call / row["floor_sum_read_write"], 3)
    row["ratio_call_over_concurrent"] = round(call / row["concurrent_seconds"], 3)
    row["ratio_call_over_concurrent_kernels"] = round(call / max(row["concurrent_seconds"], row["kernels_seconds"] or 0), 3)
    row["GBps_input_concurrent"] = round(in_bytes / row["concurrent_seconds"] / 1e9, 3)
    row["ratio_process_over_max_read_write"] = round(proc / io_max, 3)
    row["process_minus_call_seconds"] = round(proc - call, 3)
    # what the call spends beyond the slowest resource: pipeline and Python (start-up is process - call)
    row["beyond_bound_seconds"] = round(call - row["floor_max_read_write_kernels"], 3)
    rs = runs.get((scheme, "peer"))
    if rs:
        row["peer"] = {
            "process_seconds": best("peer"),
            "call_seconds": round(min(r["call_seconds"] for r in rs if r["call_seconds"] is not None), 3),
            "peak_rss_bytes": min(r["peak_rss_bytes"] for r in rs),
        }
        row["outputs_identical_to_peer"] = rs[0].get("identical")
        row["ratio_process_ctconvert_over_peer"] = round(proc / row["peer"]["process_seconds"], 3)
        row["ratio_rss_ctconvert_over_peer"] = round(row["ctconvert"]["peak_rss_bytes"] / row["peer"]["peak_rss_bytes"], 3)
    return row


def _table(results: list[dict]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        return
    t = Table(title="ctconvert against the floor (min seconds over the repeats; peak RSS)")
    cols = ("scheme", "device", "read", "write", "r&w", "kernels", "call", "GB/s", "process", "RSS", "call/max(r,w)", "call/max(r,w,k)", "call/(r+w)")
    cols += ("call/r&w", "bound")
    cols += ("peer", "proc/peer", "RSS/peer", "same bytes")
    for col in cols:
        t.add_column(col)

    def f(x, unit="s"):
        return "-" if x is None else f"{x:.2f}{unit}"

    for r in results:
        c, p = r["ctconvert"], r.get("peer")
        t.add_row(
            r["scheme"] + (f" {r['extra']}" if r["extra"] else ""),
            r["device"] + (" cold" if r["cold"] else ""),
            f(r["read_seconds"]),
            f(r["write_seconds"]),
            f(r["concurrent_seconds"]),
            f(r["kernels_seconds"]),
            f(c["call_seconds"]),
            f(c["GBps_input_call"], ""),
            f(c["process_seconds"]),
            f"{c['peak_rss_bytes'] / 2**20:.0f}MiB",
            f(r["ratio_call_over_max_read_write"], ""),
            f(r["ratio_call_over_max_read_write_kernels"], ""),
            f(r["ratio_call_over_sum_read_write"], ""),
            f(r["ratio_call_over_concurrent"], ""),
            r["bound_by"] + ("" if r["ratio_call_over_max_read_write_kernels"] <= 1.5 else " (+pipeline/Python)"),
            f"{p['process_seconds']:.2f}s {p['peak_rss_bytes'] / 2**20:.0f}MiB" if p else "-",
            f(r.get("ratio_process_ctconvert_over_peer"), ""),
            f(r.get("ratio_rss_ctconvert_over_peer"), ""),
            str(r.get("outputs_identical_to_peer", "-")),
        )
    Console(stderr=True, width=250).print(t)


if __name__ == "__main__":
    main()
