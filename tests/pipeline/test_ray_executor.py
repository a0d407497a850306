"""The Ray executor (``--executor ray``) on a local multi-node Ray cluster (a head and two worker nodes, one CPU each).

Every output is compared, file by file (``tree_hash``: names and bytes), with the local executor's output of the
same command: the outputs carry no timestamps, so the two folders are equal. Skipped without Ray, except the tests
of a missing Ray (a subprocess where ``import ray`` fails) and of the pure grouping of shards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ctconvert import api
from ctconvert.checkpoint.writer import JOURNAL, partial_folder
from ctconvert.cli import main
from ctconvert.errors import BadInputError
from ctconvert.pipeline.ray_executor import INSTALL_HINT, TMP_MARK, shard_groups

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint
from helpers import tree_hash

ROOT = Path(__file__).resolve().parents[2]
SHARD = "300KB"  # the tiny Llama's output in 4 to 9 shards (a fused set straddles a shard boundary in some)
#: 6 layers: enough shards and chunks (CHUNK elements each) that tasks are still running when a node is removed
BIG = dict(LLAMA_CONFIG, num_hidden_layers=6)
CHUNK = 4096


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head and two worker nodes (``num_cpus=1`` each), the test process connected as the driver. The second
    worker node (``cluster.doomed``) turns slow once ``cluster.slow`` exists: each shard write sleeps, and each
    shard it opens is listed in ``cluster.marker`` (what the test that removes it mid-run waits for)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    gpus = 1 if torch.cuda.is_available() else 0  # the GPU test's: one task on the head's GPU
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": gpus, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.marker = tmp_path_factory.mktemp("doomed") / "opened"
    c.slow = c.marker.with_name("slow")
    c.doomed = c.add_node(num_cpus=1, env_vars={"CT_TEST_MARKER": str(c.marker)})
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR", runtime_env={"worker_process_setup_hook": _slow_node_hook()})
    yield c
    ray.shutdown()
    c.shutdown()


def _slow_node_hook():
    """Run in every Ray worker: on the doomed node (``CT_TEST_MARKER`` set), once the test says so, every shard write
    sleeps and every shard opened is listed. (A closure: Ray pickles it by value.)"""

    def hook():
        import os
        import time

        marker = os.environ.get("CT_TEST_MARKER")
        if not marker:
            return
        import ctconvert.checkpoint.shard_file as io

        init, write, slow = io.ShardFile.__init__, io.ShardFile.write_many, os.path.join(os.path.dirname(marker), "slow")

        def opened(self, *a, **k):
            init(self, *a, **k)
            if os.path.exists(slow):
                with open(marker, "a") as f:
                    f.write(self.path.name + "\n")

        def slow_write(self, *a, **k):
            if os.path.exists(slow):
                time.sleep(0.1)
            return write(self, *a, **k)

        io.ShardFile.__init__, io.ShardFile.write_many = opened, slow_write  # write_many: every write of a shard

    return hook


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ray") / "src", llama_tensors(BIG), BIG, shards=3)


@pytest.fixture(scope="module")
def local(src) -> dict:
    """The local executor's outputs, by scheme: the reference."""
    outs = {}
    for scheme in ("W4A16", "NVFP4A16"):
        outs[scheme] = src.parent / f"local-{scheme}"
        api.quantize(src, outs[scheme], scheme, max_shard_size=SHARD)
    return outs


class Bar:
    """A progress factory recording the total and the updates; ``on_update(bar)`` runs at each update."""

    def __init__(self, on_enter=None, on_update=None):
        self.total, self.done, self.on_enter, self.on_update = None, 0, on_enter, on_update

    @contextmanager
    def __call__(self, total):
        self.total = total
        if self.on_enter is not None:
            self.on_enter()
        yield self

    def update(self, n):
        self.done += n
        if self.on_update is not None:
            self.on_update(self)


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_same_bytes_as_local_and_nodes_say_who_did_what(cluster, src, local, scheme, tmp_path):
    bar = Bar()
    r = api.quantize(src, tmp_path / "out", scheme, max_shard_size=SHARD, executor="ray", progress=bar)
    assert len(r.shards) >= 3
    assert tree_hash(tmp_path / "out") == tree_hash(local[scheme])
    assert sum(n["shards"] for n in r.nodes) == len(r.shards) and all(n["resident_shards"] == 0 for n in r.nodes)  # plain tasks
    assert sum(n["bytes"] for n in r.nodes) == bar.total == bar.done  # cluster-wide progress: every source byte, once
    import ray

    assert {n["node_id"] for n in r.nodes} <= {n["NodeID"] for n in ray.nodes()}  # (which nodes: whichever had a worker ready)
    doc = json.loads(json.dumps(r.to_dict()))
    assert doc["nodes"] == r.nodes and "nodes" not in api.quantize(src, tmp_path / "l", scheme, dry_run=True).to_dict()
    assert not list(partial_folder(tmp_path / "out").parent.glob(".*ctconvert-partial"))


@contextmanager
def only_on(cluster, node, release: Path):
    """Every node's CPU but ``node``'s held (by tasks that wait for ``release`` to exist), so that the conversion's
    tasks go to ``node`` one at a time; released on leaving (or earlier, by touching ``release``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def hold(path, started):  # defined here: Ray pickles it by value
        import os
        import time

        open(started, "w").close()
        while not os.path.exists(path):
            time.sleep(0.05)

    hold = ray.remote(num_cpus=1)(hold)
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != node.node_id]
    started = [release.with_name(f"{release.name}-held-{i}") for i in range(len(others))]
    holds = [hold.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(str(release), str(s)) for n, s in zip(others, started)]
    deadline = time.monotonic() + 60  # the holds running before the conversion's tasks are scheduled: else those may take the other CPUs
    while not all(s.exists() for s in started):
        assert time.monotonic() < deadline, "the holding tasks did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        release.touch()
        ray.get(holds)


def test_an_interrupted_driver_resumes_like_a_local_run(cluster, src, local, tmp_path):
    """Ctrl-C on the driver once a shard is journaled (the tasks run one at a time on one node, so more follow):
    the partial folder keeps the finished shards, and --resume reuses them and gives the same bytes."""
    out = tmp_path / "out"

    def stop(bar):
        if json.loads((partial_folder(out) / JOURNAL).read_text())["shards"]:
            raise KeyboardInterrupt

    with only_on(cluster, cluster.doomed, tmp_path / "release"), pytest.raises(KeyboardInterrupt):
        api.quantize(src, out, "W4A16", max_shard_size=SHARD, executor="ray", progress=Bar(on_update=stop))
    assert not out.exists()
    kept = json.loads((partial_folder(out) / JOURNAL).read_text())["shards"]
    assert kept
    left = sorted(p.name for p in partial_folder(out).iterdir())  # a shard under its final name is a journaled one; no temporary files
    assert [n for n in left if n.endswith(".safetensors")] == sorted(kept) and not [n for n in left if TMP_MARK in n]
    r = api.quantize(src, out, "W4A16", max_shard_size=SHARD, executor="ray", resume=True)
    assert set(kept) <= set(r.reused_shards)
    assert tree_hash(out) == tree_hash(local["W4A16"])


def test_a_shard_under_its_final_name_is_a_journaled_one(cluster, src, local, tmp_path):
    """While the tasks run (one at a time, slowly, on one node) and after a driver interrupt, the partial folder
    holds a shard under its final name only once the driver journaled it: no stubs, no worker's unjournaled shard
    (the workers' files keep their temporary names until the driver renames them; an interrupt removes those)."""
    out, seen = tmp_path / "out", []

    def check(bar):
        journaled = sorted(json.loads((partial_folder(out) / JOURNAL).read_text())["shards"])
        seen.append((sorted(p.name for p in partial_folder(out).glob("*.safetensors") if not p.name.startswith(".")), journaled))
        if journaled:
            raise KeyboardInterrupt

    cluster.slow.touch()
    try:
        with only_on(cluster, cluster.doomed, tmp_path / "release"), pytest.raises(KeyboardInterrupt):
            api.quantize(src, out, "W4A16", max_shard_size=SHARD, executor="ray", chunk_elems=CHUNK, progress=Bar(on_update=check))
    finally:
        cluster.slow.unlink()
        cluster.marker.unlink(missing_ok=True)  # the node-lost test waits for this node's next shards
    assert seen and all(files == journaled for files, journaled in seen), seen
    total = len(json.loads((partial_folder(out) / JOURNAL).read_text())["shards"])
    left = sorted(p.name for p in partial_folder(out).iterdir())
    shards = len(list(local["W4A16"].glob("*.safetensors")))
    assert 0 < total == len([n for n in left if n.endswith(".safetensors")]) < shards and not [n for n in left if TMP_MARK in n]


def test_a_node_lost_mid_run_is_retried_elsewhere(cluster, src, local, tmp_path):
    """A worker node removed while its task runs: the task runs again on another node, the same bytes."""
    release = tmp_path / "release"
    gone = []

    def remove(bar):
        if not gone and cluster.marker.exists():
            gone.append(cluster.doomed.node_id)
            cluster.remove_node(cluster.doomed)
            release.touch()

    cluster.slow.touch()
    with only_on(cluster, cluster.doomed, release):
        r = api.quantize(src, tmp_path / "out", "W4A16", max_shard_size=SHARD, executor="ray", chunk_elems=CHUNK, progress=Bar(on_update=remove))
    assert gone and cluster.marker.read_text().split()  # the doomed node's task had opened its shards when the node went
    assert cluster.doomed.node_id not in {n["node_id"] for n in r.nodes}  # ... and was done again elsewhere
    assert tree_hash(tmp_path / "out") == tree_hash(local["W4A16"])


def test_a_node_that_cannot_read_the_source_is_named(cluster, src, tmp_path):
    """A source file missing where the workers look (not on shared storage): one error naming the node and the file."""
    hidden = src / "model-00002-of-00003.safetensors"
    aside = src.parent / "aside.safetensors"

    def hide():
        hidden.rename(aside)

    try:
        with pytest.raises(BadInputError) as e:
            api.quantize(src, tmp_path / "out", "W4A16", max_shard_size=SHARD, executor="ray", progress=Bar(on_enter=hide))
    finally:
        if aside.exists():
            aside.rename(hidden)
    msg = str(e.value)
    assert e.value.exit_code == 3 and "\n" not in msg
    assert str(hidden) in msg and "Ray node " in msg and "every node sees" in msg
    assert not (tmp_path / "out").exists() and not partial_folder(tmp_path / "out").exists()


def test_batch_on_ray_gives_the_lines_and_outputs_of_a_local_batch(cluster, src, local, tmp_path):
    def jobs(name: str) -> Path:
        doc = {"defaults": {"max_shard_size": SHARD}, "jobs": [{"model": str(src), "output": str(tmp_path / name / s), "scheme": s} for s in local]}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        return tmp_path / f"{name}.json"

    lines = {}
    for name, args in (("local", []), ("ray", ["--executor", "ray"])):
        r = CliRunner().invoke(main, ["batch", str(jobs(name)), *args])
        assert r.exit_code == 0, r.output
        lines[name] = [json.loads(x) for x in r.stdout.splitlines()]
    for a, b in zip(*lines.values(), strict=True):
        for k in ("seconds", "output"):
            a.pop(k, None), b.pop(k, None)
        assert "nodes" not in a  # a local job's line: no nodes; a Ray job's: who did what, every shard and source byte once
        if b["status"] != "summary":
            nodes = b.pop("nodes")
            assert sum(n["shards"] for n in nodes) == b["shards"] and sum(n["bytes"] for n in nodes) == b["input_bytes"]
            assert {n["node_id"] for n in nodes} <= {n["NodeID"] for n in pytest.importorskip("ray").nodes()}
        assert a == b
    for s in local:
        assert tree_hash(tmp_path / "ray" / s) == tree_hash(local[s])


#: how a new process runs the CLI: click's command itself, or the console script (``python -m ctconvert``: the cluster
#: joined and its workers started before the heavy imports)
ENTRIES = {"cli": "from ctconvert.cli import main; main()", "console": "import runpy; runpy.run_module('ctconvert', run_name='__main__', alter_sys=True)"}


def _cli(*args, env=None, block_ray=False, entry="cli"):
    """The CLI in a new process (no Ray connection yet); ``block_ray``: ``import ray`` fails there."""
    pre = "import sys; sys.modules['ray'] = None; " if block_ray else ""
    code = pre + ENTRIES[entry]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("entry", ENTRIES)
def test_without_ray_the_error_says_how_to_install_it(tiny_llama, tmp_path, entry):
    r = _cli("quantize", tiny_llama, "-o", tmp_path / "out", "-s", "W4A16", "--executor", "ray", block_ray=True, entry=entry)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: --executor ray needs Ray, which is not installed: {INSTALL_HINT}"]
    assert not (tmp_path / "out").exists() and not partial_folder(tmp_path / "out").exists()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("how", ["option", "RAY_ADDRESS"])
def test_a_wrong_address_is_one_line_and_exit_2(tiny_llama, tmp_path, how, entry):
    pytest.importorskip("ray")
    addr = "127.0.0.1:9"  # discard: nothing listens there
    args = ["quantize", tiny_llama, "-o", tmp_path / "out", "-s", "W4A16", "--executor", "ray"]
    r = _cli(*args, "--ray-address", addr, entry=entry) if how == "option" else _cli(*args, env={"RAY_ADDRESS": addr}, entry=entry)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach the Ray cluster at {addr}") and "ray start --head" in lines[0]
    assert not (tmp_path / "out").exists() and not partial_folder(tmp_path / "out").exists()


class _Unit:
    def __init__(self, *outputs):
        self.outputs = [(o, "BF16", (1,)) for o in outputs]


def test_shard_groups_keep_each_unit_in_one_group():
    """Groups are the shards still to write, joined where a unit writes into two; finished shards are left out."""
    units = [_Unit("a"), _Unit("b", "c"), _Unit("d"), _Unit("e", "f")]
    shard = {"a": "s1", "b": "s1", "c": "s2", "d": "s3", "e": "s3", "f": "s4"}
    assert shard_groups(units, shard, set()) == [(["s1", "s2"], [0, 1]), (["s3", "s4"], [2, 3])]
    assert shard_groups(units, shard, {"s3"}) == [(["s1", "s2"], [0, 1]), (["s4"], [3])]
    assert shard_groups(units, shard, {"s1"}) == [(["s2"], [1]), (["s3", "s4"], [2, 3])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_same_bytes_as_the_local_gpu_run(cluster, src, tmp_path):
    """--device cuda: each task takes one GPU of its node (the test cluster's nodes have none, so a GPU host's own Ray)."""
    local_out = tmp_path / "local"
    api.quantize(src, local_out, "NVFP4A16", max_shard_size=SHARD, device="cuda")
    r = api.quantize(src, tmp_path / "out", "NVFP4A16", max_shard_size=SHARD, device="cuda", executor="ray")
    assert r.nodes and tree_hash(tmp_path / "out") == tree_hash(local_out)


@pytest.mark.parametrize("entry", ENTRIES)
def test_with_no_address_a_new_local_instance_converts(tiny_llama, tmp_path, entry):
    """Neither --ray-address nor RAY_ADDRESS: a new local Ray instance, whose daemons (started with
    PR_SET_PDEATHSIG) must outlive the thread that joins, and are gone when the command has returned; the bytes
    of a local run. (The console script starts it before its heavy imports, on its main thread.)"""
    pytest.importorskip("ray")
    ray_tmp = tempfile.mkdtemp(prefix="ctr", dir="/tmp")  # its own Ray folder (no cluster there to join); a short path for Ray's sockets
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp, "CTCONVERT_TRACE": "1"}
    args = ["quantize", str(tiny_llama), "-s", "W4A16"]
    try:
        cmd = [sys.executable, "-c", ENTRIES[entry], "--json", *args, "-o", str(tmp_path / "ray"), "--executor", "ray"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        left = [p for p in _processes() if ray_tmp in p]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert left == []  # the Ray instance the run started is stopped
    assert ("ctconvert-trace ray " in r.stderr) == (entry == "console")
    doc = json.loads(r.stdout)
    assert [n["shards"] for n in doc["nodes"]] == [1] and doc["nodes"][0]["bytes"] == doc["input_bytes"]
    assert _cli(*args, "-o", tmp_path / "local").returncode == 0
    assert tree_hash(tmp_path / "ray") == tree_hash(tmp_path / "local")


def _processes() -> list[str]:
    """Every process's command line (``ps``)."""
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()


def test_the_console_script_joins_the_cluster_early_and_writes_the_same_bytes(cluster, src, local, tmp_path):
    """``python -m ctconvert quantize --executor ray --ray-address A``: the join begun before the heavy imports
    (the ``ray`` trace step) is the run's; the bytes of the local executor."""
    out = tmp_path / "out"
    r = _cli(
        "--json",
        "quantize",
        src,
        "-o",
        out,
        "-s",
        "W4A16",
        "--max-shard-size",
        SHARD,
        "--executor",
        "ray",
        "--ray-address",
        cluster.address,
        env={"CTCONVERT_TRACE": "1"},
        entry="console",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [line.split()[1] for line in r.stderr.splitlines() if line.startswith("ctconvert-trace ")]
    assert steps.index("ray") < steps.index("engine")  # joining began before torch was imported
    assert sum(n["shards"] for n in json.loads(r.stdout)["nodes"]) == len(list(out.glob("*.safetensors")))
    assert tree_hash(out) == tree_hash(local["W4A16"])


def test_the_console_scripts_batch_joins_early_and_writes_the_same_bytes(cluster, src, local, tmp_path):
    """``python -m ctconvert batch JOBS --executor ray --ray-address A``: the join begun early is the first job's."""
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps({"defaults": {"max_shard_size": SHARD}, "jobs": [{"model": str(src), "output": str(tmp_path / "o"), "scheme": "W4A16"}]}))
    r = _cli("batch", jobs, "--executor", "ray", "--ray-address", cluster.address, env={"CTCONVERT_TRACE": "1"}, entry="console")
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [line.split()[1] for line in r.stderr.splitlines() if line.startswith("ctconvert-trace ")]
    assert steps.index("ray") < steps.index("engine")
    line, summary = [json.loads(x) for x in r.stdout.splitlines()]
    assert (line["status"], summary["ok"], summary["exit_code"]) == ("ok", 1, 0)
    assert line["shards"] == len(list((tmp_path / "o").glob("*.safetensors")))
    assert tree_hash(tmp_path / "o") == tree_hash(local["W4A16"])


class _LateKillRay:
    """A stand-in for the ``ray`` module whose ``cancel`` kills a running task late, as Ray's does (the kill is a
    message to the worker): the worker still creates its shard's temporary file 0.2 s after ``cancel`` returns, and
    only then does its ref resolve. The first ``wait`` (the driver's poll) is interrupted by a Ctrl-C."""

    def __init__(self, folder: Path):
        import threading

        self.folder, self.dead, self.polls, self.threading = folder, threading.Event(), 0, threading

    def remote(self, *args):  # ray.remote(fn), and the task's .remote(common, spec, progress): its ref
        return self if len(args) == 1 else "ref"

    def options(self, **_):
        return self

    def put(self, obj):
        return obj

    def nodes(self):
        return [{"Alive": True, "Resources": {"CPU": 1}}]

    class util:  # no residents on this stand-in cluster (a run without --ray-keep-workers retires any it finds)
        @staticmethod
        def list_named_actors(all_namespaces=False):
            return []

    def wait(self, refs, num_returns=1, timeout=None):
        self.polls += 1
        if self.polls == 1:
            raise KeyboardInterrupt
        self.dead.wait(timeout)
        return (list(refs), []) if self.dead.is_set() else ([], list(refs))

    def cancel(self, ref, force=False):
        import time

        def die():
            time.sleep(0.2)
            (self.folder / f".model-00001-of-00001.safetensors{TMP_MARK}late").write_bytes(b"x")
            self.dead.set()

        self.threading.Thread(target=die, daemon=True).start()


def test_an_interrupt_removes_the_file_a_worker_made_while_it_was_being_killed(tmp_path, monkeypatch):
    """The driver waits for the cancelled tasks to end (their workers killed) before it removes their temporary
    files, so a file a worker created after the cancel is not left behind (CI once found two)."""
    import dataclasses
    from types import SimpleNamespace

    from ctconvert.pipeline import ray_executor as rx
    from ctconvert.pipeline.executor import ExecOptions

    folder = tmp_path / "partial"
    folder.mkdir()
    fake = _LateKillRay(folder)
    ex = rx.RayExecutor()
    ex.ray = fake
    spec = rx.TaskSpec(("run", 0), {"model-00001-of-00001.safetensors": []}, [], [], str(folder), False, False)
    monkeypatch.setattr(rx.RayExecutor, "_specs", lambda self, *a: [spec])
    plan = dataclasses.make_dataclass("P", ["units", "rows", "notes"])([], [], [])
    out = rx.ShardOutput(SimpleNamespace(tmp=str(folder), completed=set()), {})
    with pytest.raises(KeyboardInterrupt):
        ex.run(None, plan, {}, ExecOptions(device=torch.device("cpu")), None, out)
    assert fake.dead.is_set() and not [p.name for p in folder.iterdir()]


@pytest.fixture
def no_residents(cluster):
    """Every resident ended after the test, and the cluster's CPUs free again (a resident holds its node's CPU)."""
    import ray

    from ctconvert.pipeline.ray_residents import stop_residents

    yield ray
    stop_residents(ray)
    _wait_until(lambda: not _residents(ray) and ray.available_resources().get("CPU", 0) >= ray.cluster_resources()["CPU"])


def _residents(ray) -> dict:
    """The residents alive, by name: ``(pid, node id, groups converted)``, each waited for until it answers (one still
    starting on a loaded 2-core machine takes a while)."""
    from ctconvert.pipeline.ray_residents import NAMESPACE, PREFIX

    out = {}
    for e in ray.util.list_named_actors(all_namespaces=True):
        if e.get("namespace") == NAMESPACE and e["name"].startswith(PREFIX):
            try:
                out[e["name"]] = ray.get(ray.get_actor(e["name"], namespace=NAMESPACE).where.remote(), timeout=300)
            except (ValueError, ray.exceptions.RayActorError):  # ended meanwhile
                pass
    return out


def _wait_until(ok, seconds=120.0):
    import time

    deadline = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_residents_serve_a_new_driver_with_the_same_bytes_and_end_when_idle(cluster, src, local, tmp_path, no_residents):
    """``--ray-keep-workers``: the first run leaves one resident per node; a new driver (another process) converts in
    those same processes and writes the local executor's bytes; told to keep 0.3 s, they end by themselves."""
    ray = no_residents
    r = api.quantize(src, tmp_path / "a", "W4A16", max_shard_size=SHARD, executor="ray", ray_keep_workers=120)
    assert tree_hash(tmp_path / "a") == tree_hash(local["W4A16"]) and sum(n["shards"] for n in r.nodes) == len(r.shards)
    # one per live node (each with its one CPU), placed as the node's CPU came free: on a loaded 2-core machine one may
    # still be starting when the run returns (the test once read none there), and may have converted nothing yet
    _wait_until(lambda: bool(_residents(ray)))
    before = _residents(ray)
    assert len({node for _, node, _ in before.values()}) == len(before)  # one per node
    args = ["--json", "quantize", src, "-o", tmp_path / "b", "-s", "W4A16", "--max-shard-size", SHARD, "--executor", "ray"]
    p = _cli(*args, "--ray-address", cluster.address, "--ray-keep-workers", "120", entry="console")
    assert p.returncode == 0, p.stderr[-2000:]
    assert tree_hash(tmp_path / "b") == tree_hash(local["W4A16"])
    after = _residents(ray)
    assert {k: after[k][:2] for k in before} == {k: v[:2] for k, v in before.items()}  # the same processes, still there
    groups = sum(n["shards"] for n in json.loads(p.stdout)["nodes"])
    served = sum(c for _, _, c in after.values()) - sum(c for _, _, c in before.values())
    assert 1 <= served <= groups  # and they did the work, which --json says
    assert 1 <= sum(n["resident_shards"] for n in json.loads(p.stdout)["nodes"]) <= groups
    from ctconvert.pipeline.ray_residents import NAMESPACE

    for name in after:
        ray.get(ray.get_actor(name, namespace=NAMESPACE).keep_for.remote(0.3))
    _wait_until(lambda: not _residents(ray), seconds=120)


def test_residents_lost_before_a_run_leave_the_work_to_new_ones_or_tasks(cluster, src, local, tmp_path, no_residents):
    """Residents killed between two runs (a node restarted, an operator): the next run still writes the local bytes."""
    from ctconvert.pipeline.ray_residents import stop_residents

    ray = no_residents
    api.quantize(src, tmp_path / "a", "NVFP4A16", max_shard_size=SHARD, executor="ray", ray_keep_workers=120)
    assert _residents(ray)
    assert stop_residents(ray) >= 1
    api.quantize(src, tmp_path / "b", "NVFP4A16", max_shard_size=SHARD, executor="ray", ray_keep_workers=120)
    assert tree_hash(tmp_path / "b") == tree_hash(local["NVFP4A16"])


def test_a_negative_keep_is_a_usage_error(tiny_llama, tmp_path):
    r = _cli("quantize", tiny_llama, "-o", tmp_path / "out", "-s", "W4A16", "--executor", "ray", "--ray-keep-workers", "-1", "--ray-address", "127.0.0.1:9")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --ray-keep-workers takes seconds >= 0, not -1"], r.stderr


def test_residents_of_other_code_or_left_behind_are_retired_so_a_run_gets_the_nodes(cluster, src, local, tmp_path, no_residents):
    """A resident of other ctconvert code (an upgrade) holding a node's CPU would make a run wait out its keep: a run
    with --ray-keep-workers tells it to end when idle and converts; a run without it does the same to every resident."""
    from ctconvert.pipeline.ray_cluster import on_node
    from ctconvert.pipeline.ray_residents import NAMESPACE, PREFIX, Resident

    ray = no_residents
    stale = []
    for node in (n for n in ray.nodes() if n["Alive"]):
        name = f"{PREFIX}-0000000000000000-cpu-{node['NodeID']}-0"
        opts = dict(name=name, namespace=NAMESPACE, lifetime="detached", max_concurrency=4, scheduling_strategy=on_node(ray, node["NodeID"]), num_cpus=1)
        stale.append(ray.remote(Resident).options(**opts).remote(False, 3600))
    ray.get([h.keep_for.remote(3600) for h in stale], timeout=300)  # every node's CPU held by another code's resident
    args = ["--json", "quantize", src, "-o", tmp_path / "a", "-s", "W4A16", "--max-shard-size", SHARD, "--executor", "ray", "--ray-address", cluster.address]
    p = _cli(*args, "--ray-keep-workers", "120", entry="console")  # (a 120 s limit: waiting out the stale keep would fail it)
    assert p.returncode == 0, p.stderr[-2000:]
    assert tree_hash(tmp_path / "a") == tree_hash(local["W4A16"])
    assert not any("0000000000000000" in name for name in _residents(ray))
    assert _residents(ray)  # this code's, left for the next run
    p = _cli(*args[:4], tmp_path / "b", *args[5:], entry="console")  # no --ray-keep-workers: tasks, the residents retired
    assert p.returncode == 0, p.stderr[-2000:]
    assert tree_hash(tmp_path / "b") == tree_hash(local["W4A16"])
    _wait_until(lambda: not _residents(ray))
