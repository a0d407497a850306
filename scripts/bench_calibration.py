"""Calibration benchmark: wall time and peak memory of ctconvert's layer-by-layer calibration, and what calibrated
NVFP4 costs against NVFP4A16 (the same conversion without calibration).

    python3 scripts/bench_calibration.py                                  # the 1.2B benchmark checkpoint (scripts/bench.py --make-model)
    python3 scripts/bench_calibration.py --baseline /tmp/base --repeat 3  # A/B: this tree against another ctconvert tree, interleaved
    python3 scripts/bench_calibration.py --size 8b --device cuda --ratio --repeat 2 [--baseline DIR]
    python3 scripts/bench_calibration.py --model SRC --samples 8 --seq-len 256 --device cuda --quantize /tmp/out

Each measurement runs in a child process, so that its peak RSS (``ru_maxrss``) is its own; on a GPU the
peak of ``torch.cuda.max_memory_allocated`` is reported too. The tokens are random ids from a fixed seed
(the benchmark checkpoint has no tokenizer; the statistics do not matter here, only the cost).

* default: ``calibrate`` (layer by layer, KV cache observed) in a child; ``--whole``: the whole model loaded instead.
* ``--ratio``: the whole process ``python -m ctconvert --json quantize SRC -o OUT --scheme NVFP4A16`` and then
  ``--scheme NVFP4 --calibration IDS`` (the same tokens), each repeat; the process wall time (and peak RSS, from
  ``wait4``), the call (``--json`` ``seconds``) and calibration's own seconds; the ratio NVFP4 / NVFP4A16 of the
  minima (the issue-27 target on the H200, 8B: <= 1.5 warm). The page cache is warmed first (one read of the input).
* ``--quantize OUT``: the whole ``quantize --scheme NVFP4`` in the child (calibration + conversion).
* ``--baseline DIR``: every measurement also with the ctconvert package of DIR (a checkout of another commit),
  interleaved with this tree's, and the ratio this / baseline of the minima.

One JSON line per run, then one summary line (minimum over the repeats: a shared machine only ever makes a run slower).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(a) -> None:
    sys.path.insert(0, str(Path(a.code).resolve()))
    import torch

    from ctconvert.calibration.model import calibrate, calibrate_whole_model
    from ctconvert.checkpoint.reader import open_checkpoint

    if a.read_threads:  # this tree's prefetcher only (a baseline tree has none)
        from ctconvert.calibration import model

        model.default_threads = lambda device: a.read_threads
    ckpt = open_checkpoint(a.model)
    vocab = ckpt.config.get("vocab_size", 32000)
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    if a.quantize:
        from ctconvert import api

        ids = Path(a.quantize).with_suffix(".ids.txt")
        write_ids(ids, vocab, a.samples * a.seq_len)
        r = api.quantize(
            a.model, a.quantize, "NVFP4", overwrite=True, device=a.device, calibration=ids, calibration_samples=a.samples, calibration_seq_len=a.seq_len
        )
        what = {"run": "quantize NVFP4", "calibration_s": r.calibration["seconds"], "output_bytes": r.output_bytes}
    else:
        tokens = torch.randint(0, vocab, (a.samples, a.seq_len), generator=torch.Generator().manual_seed(0))
        fn = calibrate_whole_model if a.whole else calibrate
        stats = fn(ckpt, tokens, dev, kv_cache=True, batch_tokens=a.batch_tokens)
        what = {"run": "whole model (all layers loaded)" if a.whole else "calibrate, layer by layer", "observed_linears": len(stats.inputs)}
    wall = time.perf_counter() - t0
    out = {
        **what,
        "code": str(a.code),
        "model": str(a.model),
        "device": str(dev),
        "tokens": a.samples * a.seq_len,
        "wall_s": round(wall, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "input_gib": round(ckpt.total_bytes / 2**30, 2),
    }
    if dev.type == "cuda":
        out["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
    print(json.dumps(out), flush=True)


def write_ids(path: Path, vocab: int, n: int) -> Path:
    """``n`` random token ids below ``vocab`` (seed 0), space-separated: a ``--calibration`` file."""
    import torch

    g = torch.Generator().manual_seed(0)
    path.write_text(" ".join(map(str, torch.randint(0, vocab, (n,), generator=g).tolist())))
    return path


def run_process(cmd: list[str], env: dict, cwd: str) -> dict:
    """Run ``cmd`` in ``cwd`` (output to files: no pipe to fill); its wall seconds, peak RSS (MiB, ``wait4``) and stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{' '.join(cmd[:6])} failed: {err.read().decode()[-2000:]}")
        return {"wall_s": round(wall, 3), "peak_rss_mib": round(ru.ru_maxrss / 1024, 1), "stdout": out.read().decode()}


def code_env(code: str) -> dict:
    """The environment of a process that imports ``code``'s ctconvert (run it with ``cwd=code``: ``python -m`` puts
    the working directory first on ``sys.path``, before ``PYTHONPATH``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [code, os.environ.get("PYTHONPATH")])))
    got = subprocess.run([sys.executable, "-c", "import ctconvert; print(ctconvert.__file__)"], env=env, cwd=code, capture_output=True, text=True, check=True)
    if not Path(got.stdout.strip()).resolve().is_relative_to(Path(code).resolve()):
        raise SystemExit(f"{code}: a process run there imports {got.stdout.strip()}, not this tree's ctconvert")
    return env


def quantize_run(a, code: str, scheme: str, ids: Path, out: Path) -> dict:
    """One ``python -m ctconvert --json quantize`` process with the package of ``code`` (run in ``code``)."""
    cmd = [sys.executable, "-m", "ctconvert", "--json", "quantize", a.model, "-o", str(out), "--scheme", scheme, "--device", a.device, "--overwrite"]
    if scheme == "NVFP4":
        cmd += ["--calibration", str(ids), "--calibration-samples", str(a.samples), "--calibration-seq-len", str(a.seq_len)]
    r = run_process(cmd, code_env(code), code)
    doc = json.loads(r.pop("stdout"))
    subprocess.run(["rm", "-rf", str(out)], check=False)
    cal = doc.get("calibration") or {}
    return {"run": f"quantize {scheme}", "code": code, **r, "call_s": doc["seconds"], "calibration_s": cal.get("seconds"), "model_s": cal.get("model_seconds")}


def warm(model: str) -> None:
    """Read every byte of the input once (warm page cache, as the H200 figures are taken)."""
    for f in sorted(Path(model).glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def ratio(a, codes: list[str]) -> None:
    warm(a.model)
    from ctconvert.checkpoint.reader import open_checkpoint  # noqa: PLC0415 - this tree's, only for the vocabulary

    cfg = open_checkpoint(a.model).config
    vocab = (cfg.get("text_config") or cfg).get("vocab_size", 32000)
    work = Path(tempfile.mkdtemp(prefix="ctbench-calib-"))
    ids = write_ids(work / "ids.txt", vocab, a.samples * a.seq_len)
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(a.repeat):
        for code in codes:
            for scheme in ("NVFP4A16", "NVFP4"):
                r = quantize_run(a, code, scheme, ids, work / "out")
                print(json.dumps(r), flush=True)
                runs.setdefault((code, scheme), []).append(r)
    summary = {}
    for code in codes:
        best = {s: {k: min(r[k] for r in runs[(code, s)]) for k in ("wall_s", "call_s", "peak_rss_mib")} for s in ("NVFP4A16", "NVFP4")}
        best["NVFP4"]["calibration_s"] = min(r["calibration_s"] for r in runs[(code, "NVFP4")])
        best["ratio_wall"] = round(best["NVFP4"]["wall_s"] / best["NVFP4A16"]["wall_s"], 2)
        best["ratio_call"] = round(best["NVFP4"]["call_s"] / best["NVFP4A16"]["call_s"], 2)
        summary[code] = best
    print(json.dumps({"summary": "min over repeats; ratio = NVFP4 / NVFP4A16", "repeat": a.repeat, "device": a.device, **summary}), flush=True)


def calibrations(a, codes: list[str]) -> None:
    runs: dict[tuple[str, str], list[dict]] = {}
    devices = [a.device] if a.device != "both" else ["cpu", "cuda"]
    for _ in range(a.repeat):
        for dev in devices:
            for code in codes:
                args = [sys.executable, __file__, "--child", "--code", code, "--model", a.model, "--samples", str(a.samples), "--seq-len", str(a.seq_len)]
                args += ["--batch-tokens", str(a.batch_tokens), "--device", dev] + (["--quantize", a.quantize] if a.quantize else [])
                args += (["--whole"] if a.whole else []) + (["--read-threads", str(a.read_threads)] if a.read_threads and code == str(ROOT) else [])
                line = subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                print(line, flush=True)
                runs.setdefault((dev, code), []).append(json.loads(line))
    for dev in devices:
        keys = [k for k in ("wall_s", "peak_rss_mib", "peak_gpu_mib") if k in runs[(dev, codes[0])][0]]
        best = {code: {k: min(r[k] for r in runs[(dev, code)]) for k in keys} for code in codes}
        doc = {"summary": "min over repeats", "device": dev, "repeat": a.repeat, **best}
        if len(codes) == 2:
            doc["ratio_wall"] = round(best[codes[0]]["wall_s"] / best[codes[1]]["wall_s"], 3)
        print(json.dumps(doc), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a bf16 checkpoint (default: the generated one of --size)")
    p.add_argument("--size", default="1b", choices=("1b", "8b"), help="the generated checkpoint (scripts/bench.py --make-model): ~1.2B or Llama-3-8B's shape")
    p.add_argument("--workdir", default="/tmp/ctbench")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--device", default="cpu", help="cpu, cuda, or 'both' (cpu then cuda when present)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--baseline", default=None, help="another ctconvert tree (a checkout of another commit): A/B in the same run")
    p.add_argument("--ratio", action="store_true", help="time quantize NVFP4 against NVFP4A16 (whole processes)")
    p.add_argument("--quantize", default=None, help="output folder: time the whole quantize --scheme NVFP4 instead")
    p.add_argument("--whole", action="store_true", help="the same observation with the whole model loaded (the memory a whole-model pass needs)")
    p.add_argument("--read-threads", type=int, default=None, help="the prefetcher's reader threads (default: calibration.prefetch.default_threads)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code", default=str(ROOT), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    a.model = str(Path(a.model or Path(a.workdir) / ("model" if a.size == "1b" else "llama3-8b-bf16")).resolve())
    if not Path(a.model, "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--make-model", a.model, "--size", a.size], check=True)
    codes = [str(ROOT)] + ([str(Path(a.baseline).resolve())] if a.baseline else [])
    sys.path.insert(0, str(ROOT))
    (ratio if a.ratio else calibrations)(a, codes)


if __name__ == "__main__":
    main()
