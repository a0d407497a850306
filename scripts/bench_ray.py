"""The Ray executor's overhead: the same conversion by the local executor and by ``--executor ray`` on one machine.

    python scripts/bench_ray.py [--workdir /tmp/ctbench] [--model DIR] [--device cpu|cuda]
                                [--repeat 2] [--schemes FP8_DYNAMIC,W4A16,NVFP4A16] [--max-shard-size 5GB]
                                [--base DIR]

Takes the ~1.2B-parameter bf16 checkpoint of scripts/bench.py (generated once in ``--workdir/model`` by its
generator when absent) or ``--model``. Starts a one-node Ray cluster on this machine (``ray start --head
--block``: every CPU, and with ``--device cuda`` one GPU, so one GPU worker), then for each scheme and repeat,
interleaved, in separate processes: ``python -m ctconvert --json quantize SRC -o OUT -s S --device D`` with the
local executor, with ``--executor ray --ray-address`` that cluster, and (``ray_warm``) twice in one driver process,
timing the second call: the Ray executor once its workers are started, as in a ``batch`` of jobs; then (``--keep``,
default 600 s; ``0``: not) a run with ``--ray-keep-workers`` that leaves residents, and in each repeat a local run
beside a new driver with ``--ray-keep-workers`` that they serve (``keep``: a new process per conversion, its
workers' start-up paid by the first run; residents hold the CPUs, so these run after the others). Each figure
is the minimum over the repeats (a shared machine only makes a run slower): the whole process (wall) and the call (``--json``
``seconds``: from the start of the conversion, joining the cluster included). The outputs of the first
repeat are compared file by file (sha256 of names and bytes: they must be identical). Prints a table (stderr)
and a JSON document (stdout); ``overhead`` = ray / local - 1 (the target: at most 0.10). The cluster is
stopped at the end (the ``ray start`` process this script started, by its id).

``--base DIR``: another checkout of ctconvert (``git archive REV | tar -x -C DIR``): its ``ray`` and ``ray_warm``
runs too (``ray_base``, ``ray_warm_base``), interleaved with this checkout's in the same repeats, for an A/B
comparison on a loaded machine; the rows then also give the base's figures and overheads. Each checkout gets its
own cluster (a Ray worker imports the code of its cluster's ``PYTHONPATH`` and of the driver's working directory,
so every run is started in its checkout's folder).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import _json, make_model, timed  # noqa: E402 - the generator and the timing of scripts/bench.py

ROOT = Path(__file__).resolve().parents[1]


def tree_sha(path: Path) -> str:
    """sha256 over every file (relative name and bytes) under ``path``."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()


def _env(root: Path = ROOT) -> dict:
    """The environment of the cluster and of every run: this checkout first; Ray's token authentication on for the
    head and its drivers alike (Ray >= 2.5x turns it on for a new head and a driver must say so: RAY_AUTH_MODE=token,
    the token in ~/.ray/auth_token), unless the caller's environment says otherwise."""
    return {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(cuda: bool, tmp: Path, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """``ray start --head --block`` on this machine (every CPU; one GPU with ``cuda``), its workers running the code
    of the checkout ``root`` (their ``PYTHONPATH``): the process and its address."""
    port = free_port()
    ray = Path(sys.executable).with_name("ray")
    cmd = [str(ray) if ray.exists() else "ray", "start", "--head", "--block", f"--port={port}", f"--num-cpus={os.cpu_count()}", "--include-dashboard=false"]
    cmd += [f"--num-gpus={1 if cuda else 0}", f"--temp-dir={tmp}", "--object-store-memory=500000000"]  # the tasks use little of it
    cmd += ["--node-ip-address=127.0.0.1", "--disable-usage-stats"]  # the address probed below (else the host's IP, where the head listens)
    env = _env(root)
    if env["RAY_AUTH_MODE"] == "token":  # a head in token mode refuses to start without a token (a fresh machine has none)
        subprocess.run([cmd[0], "get-auth-token", "--generate"], env=env, stdout=subprocess.DEVNULL, check=True)
    log = tmp / "head.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=root)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(3)  # the GCS listens before the raylet has registered
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
    raise SystemExit("the Ray head did not start within 120 s" + "".join(f"\n  {line}" for line in tail))


def convert(src: Path, out: Path, scheme: str, device: str, shard: str, ray_address: str | None, root: Path = ROOT, keep: int = 0) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "ctconvert", "--json", "quantize", str(src), "-o", str(out), "-s", scheme, "--device", device, "--max-shard-size", shard]
    if ray_address is not None:
        cmd += ["--executor", "ray", "--ray-address", ray_address]
    if keep:
        cmd += ["--ray-keep-workers", str(keep)]
    r = timed(cmd, env=_env(root))
    doc = _json(r)
    return {"wall": r["seconds"], "seconds": doc["seconds"], "nodes": doc.get("nodes"), "bytes": doc["input_bytes"]}


#: one driver, two conversions: the second call's time is the Ray executor's with its workers started (as in a batch)
WARM = r"""
import json, shutil, sys
from ctconvert import api
src, out, scheme, device, shard, address = sys.argv[1:7]
for _ in range(2):
    shutil.rmtree(out, ignore_errors=True)
    r = api.quantize(src, out, scheme, device=device, max_shard_size=shard, executor="ray", ray_address=address)
print(json.dumps({"seconds": r.seconds, "nodes": r.nodes, "input_bytes": r.input_bytes}))
"""


def convert_warm(src: Path, out: Path, scheme: str, device: str, shard: str, ray_address: str, root: Path = ROOT) -> dict:
    r = timed([sys.executable, "-c", WARM, str(src), str(out), scheme, device, shard, ray_address], env=_env(root))
    doc = _json(r)
    return {"wall": r["seconds"], "seconds": doc["seconds"], "nodes": doc["nodes"], "bytes": doc["input_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/ctbench")
    ap.add_argument("--model", default=None, help="an existing bf16 checkpoint instead of the generated one")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the Ray cluster then has one GPU: one GPU worker)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--schemes", default="FP8_DYNAMIC,W4A16,NVFP4A16")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--base", default=None, help="another ctconvert checkout whose Ray runs are interleaved with this one's (A/B)")
    ap.add_argument("--keep", type=int, default=600, help="then a new driver each run with --ray-keep-workers KEEP (residents of a first run; 0: not measured)")
    a = ap.parse_args()
    work = Path(a.workdir)
    src = Path(a.model) if a.model else make_model(work / "model")
    roots = [ROOT] + ([Path(a.base).resolve()] if a.base else [])
    tmps = [Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp")) for _ in roots]
    clusters: dict[Path, tuple[subprocess.Popen, str]] = {}
    runs: dict = {}
    try:
        for root, tmp in zip(roots, tmps):  # one cluster per checkout: a worker imports its cluster's code, not the driver's
            clusters[root] = start_cluster(a.device.startswith("cuda"), tmp, root)
        for rep in range(a.repeat):
            for scheme in a.schemes.split(","):
                for kind, addr, root in _kinds({r: c[1] for r, c in clusters.items()}, a.base):
                    out = work / f"out-ray-bench-{kind}"
                    run = convert_warm if kind.startswith("ray_warm") else convert
                    with _cwd(root):  # Ray puts the driver's working directory on its workers' sys.path
                        r = run(src, out, scheme, a.device, a.max_shard_size, addr, root)
                    if rep == 0:
                        r["tree"] = tree_sha(out)
                    runs.setdefault(scheme, {}).setdefault(kind, []).append(r)
                    shutil.rmtree(out, ignore_errors=True)
                    print(f"{scheme} {kind} #{rep}: {r['seconds']:.2f} s (process {r['wall']:.2f} s)", file=sys.stderr, flush=True)
        if a.keep:  # residents hold their nodes' CPUs (GPUs): measured after the task runs, each against a local run beside it
            addr, out = clusters[ROOT][1], work / "out-ray-bench-keep"
            with _cwd(ROOT):
                convert(src, out, a.schemes.split(",")[0], a.device, a.max_shard_size, addr, ROOT, a.keep)  # makes the residents
                for rep in range(a.repeat):
                    for scheme in a.schemes.split(","):
                        for kind in ("local_keep", "ray_keep"):
                            on_ray = kind == "ray_keep"
                            r = convert(src, out, scheme, a.device, a.max_shard_size, addr if on_ray else None, ROOT, a.keep if on_ray else 0)
                            if rep == 0:
                                r["tree"] = tree_sha(out)
                            runs[scheme].setdefault(kind, []).append(r)
                            shutil.rmtree(out, ignore_errors=True)
                            print(f"{scheme} {kind} #{rep}: {r['seconds']:.2f} s (process {r['wall']:.2f} s)", file=sys.stderr, flush=True)
    finally:
        for proc, _ in clusters.values():
            proc.terminate()
            proc.wait(60)
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = [_row(scheme, kinds) for scheme, kinds in runs.items()]
    head = f"{'scheme':12} {'local s':>8} {'ray s':>8} {'overhead':>9} {'process':>8} {'warm s':>7} {'warm':>7} {'identical':>9}"
    print(head + "  GB/s local / ray", file=sys.stderr)
    for r in rows:
        print(
            f"{r['scheme']:12} {r['local_seconds']:8.2f} {r['ray_seconds']:8.2f} {r['overhead']:+9.1%} {r['process_overhead']:+8.1%} "
            f"{r['ray_warm_seconds']:7.2f} {r['warm_overhead']:+7.1%} "
            f"{str(r['identical']):>9}  {r['local_gbps']:.3f} / {r['ray_gbps']:.3f}",
            file=sys.stderr,
        )
        if (k := r.get("keep")) is not None:
            print(
                f"{'  (keep)':12} {k['local_seconds']:8.2f} {k['ray_seconds']:8.2f} {k['overhead']:+9.1%} {k['process_overhead']:+8.1%} "
                f"{'':7} {'':7} {str(k['identical']):>9}   new driver, residents up (--ray-keep-workers)",
                file=sys.stderr,
            )
        if (b := r.get("base")) is not None:
            print(
                f"{'  (base)':12} {'':8} {b['ray_seconds']:8.2f} {b['overhead']:+9.1%} {b['process_overhead']:+8.1%} "
                f"{b['ray_warm_seconds']:7.2f} {b['warm_overhead']:+7.1%} {str(b['identical']):>9}",
                file=sys.stderr,
            )
    print(json.dumps({"model": str(src), "device": a.device, "repeat": a.repeat, "rows": rows}, indent=1))


def _kinds(addresses: dict[Path, str], base: str | None) -> list[tuple[str, str | None, Path]]:
    """The runs of one scheme and repeat: ``(kind, Ray address or None, the checkout whose code runs)``;
    ``addresses``: each checkout's cluster."""
    kinds = [("local", None, ROOT), ("ray", addresses[ROOT], ROOT), ("ray_warm", addresses[ROOT], ROOT)]
    if base is not None:
        b = Path(base).resolve()
        kinds += [("ray_base", addresses[b], b), ("ray_warm_base", addresses[b], b)]
    return kinds


@contextlib.contextmanager
def _cwd(path: Path):
    """This process (and so the runs it starts) in the folder ``path`` meanwhile."""
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _row(scheme: str, kinds: dict) -> dict:
    local, ray = kinds["local"], kinds["ray"]
    ls, rs, ws = min(r["seconds"] for r in local), min(r["seconds"] for r in ray), min(r["seconds"] for r in kinds["ray_warm"])
    lw, rw = min(r["wall"] for r in local), min(r["wall"] for r in ray)
    nbytes = local[0]["bytes"]
    row = {
        "scheme": scheme,
        "local_seconds": round(ls, 3),
        "ray_seconds": round(rs, 3),
        "overhead": round(rs / ls - 1, 4),
        "local_process": round(lw, 3),
        "ray_process": round(rw, 3),
        "process_overhead": round(rw / lw - 1, 4),
        "ray_warm_seconds": round(ws, 3),
        "warm_overhead": round(ws / ls - 1, 4),
        "identical": local[0]["tree"] == ray[0]["tree"] == kinds["ray_warm"][0]["tree"],
        "local_gbps": round(nbytes / ls / 1e9, 3),
        "ray_gbps": round(nbytes / rs / 1e9, 3),
        "nodes": ray[0]["nodes"],
    }
    if "ray_keep" in kinds:  # a new driver each run, served by residents (--ray-keep-workers), against local runs beside them
        lk, rk = kinds["local_keep"], kinds["ray_keep"]
        lks, rks, lkw, rkw = min(r["seconds"] for r in lk), min(r["seconds"] for r in rk), min(r["wall"] for r in lk), min(r["wall"] for r in rk)
        row["keep"] = {
            "local_seconds": round(lks, 3),
            "ray_seconds": round(rks, 3),
            "overhead": round(rks / lks - 1, 4),
            "local_process": round(lkw, 3),
            "ray_process": round(rkw, 3),
            "process_overhead": round(rkw / lkw - 1, 4),
            "identical": local[0]["tree"] == lk[0]["tree"] == rk[0]["tree"],
        }
    if "ray_base" in kinds:
        bs, bws = min(r["seconds"] for r in kinds["ray_base"]), min(r["seconds"] for r in kinds["ray_warm_base"])
        bw = min(r["wall"] for r in kinds["ray_base"])
        row["base"] = {
            "ray_seconds": round(bs, 3),
            "overhead": round(bs / ls - 1, 4),
            "ray_process": round(bw, 3),
            "process_overhead": round(bw / lw - 1, 4),
            "ray_warm_seconds": round(bws, 3),
            "warm_overhead": round(bws / ls - 1, 4),
            "identical": local[0]["tree"] == kinds["ray_base"][0]["tree"] == kinds["ray_warm_base"][0]["tree"],
        }
    return row


if __name__ == "__main__":
    main()
