"""The fault suite: every case gives a clear error or a correct result, never touches the input,
and never leaves a folder at the output path that a loader would take for a checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ctconvert import api
from ctconvert.checkpoint.writer import JOURNAL, finished_shards, partial_output
from ctconvert.cli import main

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint
from helpers import tree_hash

ROOT = Path(__file__).resolve().parents[1]
#: the CLI with delayed shard writes (slow enough to interrupt), see slow_ctconvert.py
SLOW_CTCONVERT = [sys.executable, str(Path(__file__).with_name("slow_ctconvert.py"))]


def run_cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def assert_no_checkpoint(out: Path):
    assert not out.exists() or not (out / "config.json").exists()


def _mutate(case: str, m: Path) -> None:
    shard = m / "model-00002-of-00003.safetensors"
    if case == "truncated":
        shard.write_bytes(shard.read_bytes()[:-1000])
    elif case == "corrupt_header":
        b = bytearray(shard.read_bytes())
        b[8:20] = b"#garbage####"
        shard.write_bytes(bytes(b))
    elif case == "oversized_header":
        b = bytearray(shard.read_bytes())
        b[0:8] = (2**50).to_bytes(8, "little")
        shard.write_bytes(bytes(b))
    elif case == "missing_shard":
        shard.unlink()
    elif case == "unindexed_shard":
        (m / "extra.safetensors").write_bytes((m / "model-00001-of-00003.safetensors").read_bytes())
    elif case == "duplicate_tensor":
        idx = json.loads((m / "model.safetensors.index.json").read_text())
        from safetensors.torch import load_file, save_file

        t = load_file(shard)
        name = next(n for n in idx["weight_map"] if idx["weight_map"][n] == "model-00001-of-00003.safetensors")
        t[name] = torch.zeros(1)
        save_file(t, shard)
    elif case == "config_missing":
        (m / "config.json").unlink()
    elif case == "config_invalid":
        (m / "config.json").write_text("{not json")


@pytest.mark.parametrize(
    "case,code,msg",
    [
        ("truncated", 3, "truncated"),
        ("corrupt_header", 3, "not valid JSON"),
        ("oversized_header", 3, "exceeds"),
        ("missing_shard", 3, "does not exist"),
        ("unindexed_shard", 3, "not listed in the index"),
        ("duplicate_tensor", 3, "also stored in"),
        ("config_missing", 3, "config.json is missing"),
        ("config_invalid", 3, "not valid JSON"),
    ],
)
def test_bad_input(tiny_llama, tmp_path, case, code, msg):
    _mutate(case, tiny_llama)
    before = tree_hash(tiny_llama)
    out = tmp_path / "o"
    c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", out)
    assert c == code and msg in err and "Traceback" not in err and err.count("\n") == 1, err
    assert tree_hash(tiny_llama) == before
    assert not out.exists() and not list(tmp_path.glob(".o.ctconvert-*"))


@pytest.mark.parametrize("case", ["truncated", "corrupt_header", "config_invalid"])
def test_inspect_names_the_file_once(tiny_llama, case):
    """inspect lists a bad file as a problem: exit 3, the file named once (in its own field), not in the message too."""
    _mutate(case, tiny_llama)
    c, out, _ = run_cli("--json", "inspect", tiny_llama)
    problems = [p for p in json.loads(out)["problems"] if p["severity"] == "error"]
    assert c == 3 and problems
    for p in problems:
        assert p["file"] and p["file"] not in p["message"], p


def test_output_under_a_file(tiny_llama, tmp_path):
    (tmp_path / "afile").write_text("x")
    c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "afile" / "sub")
    assert c == 6 and "afile is a file, not a folder" in err and err.count("\n") == 1, err


def test_interrupt_message_names_an_output_only_for_writing_commands():
    from ctconvert.errors import INTERRUPTED_MESSAGE, interrupted_message

    assert interrupted_message(["--json", "quantize", "m", "-o", "o"]) == INTERRUPTED_MESSAGE
    assert interrupted_message(["batch", "jobs.yaml"]) == "interrupted"  # earlier jobs may have written theirs: the hint says what
    assert interrupted_message(["verify", "quantize"]) == "interrupted"  # a folder named like a command
    assert interrupted_message(["--debug", "inspect", "m"]) == "interrupted"
    assert interrupted_message([]) == "interrupted"


@pytest.mark.parametrize("shape,msg", [((256,), "1-D weight"), ((2, 256, 256), "3-D weight")])
def test_wrong_rank_weight(tmp_path, shape, msg):
    src = llama_tensors(LLAMA_CONFIG)
    src["model.layers.0.mlp.down_proj.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    m = write_checkpoint(tmp_path / "m", src, LLAMA_CONFIG)
    c, _, err = run_cli("quantize", m, "-s", "W4A16", "-o", tmp_path / "o", "--targets", "re:.*_proj$")
    assert c == 4 and msg in err
    assert_no_checkpoint(tmp_path / "o")


@pytest.mark.parametrize("row", ["zeros", "tiny"])
def test_zero_and_tiny_rows_convert(tmp_path, row):
    src = llama_tensors(LLAMA_CONFIG)
    w = src["model.layers.0.mlp.down_proj.weight"]
    w[0] = 0
    w[1] = 1e-30 if row == "tiny" else 0
    m = write_checkpoint(tmp_path / "m", src, LLAMA_CONFIG)
    for s in ("NVFP4A16", "W4A16_ASYM", "FP8_DYNAMIC"):
        api.quantize(m, tmp_path / s, s)
        assert api.verify(tmp_path / s, m)["ok"]


def test_output_exists(tiny_llama, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text("{}")
    c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o")
    assert c == 6 and (tmp_path / "o" / "config.json").read_text() == "{}"


def _mount_tmpfs(path: Path, size: str, ro: bool = False) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


def test_read_only_output_folder(tiny_llama, tmp_path):
    mnt = tmp_path / "ro"
    if not _mount_tmpfs(mnt, "4m", ro=True):
        pytest.skip("cannot mount a read-only filesystem here")
    try:
        before = tree_hash(tiny_llama)
        c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", mnt / "o")
        assert c == 6 and "Read-only" in err and "Traceback" not in err
        assert f"{mnt / 'o'}: cannot create the output folder (-o)" in err and "ctconvert-partial" not in err, err  # names -o
        assert tree_hash(tiny_llama) == before
        assert not (mnt / "o").exists()
    finally:
        _umount(mnt)


def test_disk_full(tiny_llama, tmp_path):
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "300k"):
        pytest.skip("cannot mount a small filesystem here")
    try:
        before = tree_hash(tiny_llama)
        c, _, err = run_cli("quantize", tiny_llama, "-s", "W8A16", "-o", mnt / "o", "--max-shard-size", "100KB")
        assert c == 6 and "Traceback" not in err, err
        assert "not enough free space" in err or "No space left" in err, err  # checked up front, or met while writing
        assert tree_hash(tiny_llama) == before
        assert not list(mnt.iterdir()), list(mnt.iterdir())  # nothing left to keep the disk full
    finally:
        _umount(mnt)


def _big_model(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(5)
    t = {
        f"model.layers.{i}.mlp.{m}.weight": (torch.randn(1024, 2048, generator=g) * 0.02).to(torch.bfloat16)
        for i in range(12)
        for m in ("gate_proj", "up_proj", "down_proj")
    }
    return write_checkpoint(tmp_path / "m", t, {"architectures": ["LlamaForCausalLM"]}, shards=2)


def test_sigkill_then_resume_is_identical(tmp_path):
    m = _big_model(tmp_path)
    before = tree_hash(m)
    ref = tmp_path / "ref"
    api.quantize(m, ref, "NVFP4A16", max_shard_size="8MB")
    out = tmp_path / "o"
    partial = tmp_path / ".o.ctconvert-partial"
    args = ["quantize", str(m), "-s", "NVFP4A16", "-o", str(out), "--max-shard-size", "8MB"]
    cmd = [sys.executable, "-m", "ctconvert", *args]
    p = subprocess.Popen([*SLOW_CTCONVERT, "0.05", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        j = partial / "ctconvert-journal.json"
        if j.exists() and len(json.loads(j.read_text() or "{}").get("shards", {})) >= 2:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not out.exists() and partial.exists() and not (partial / "config.json").exists()
    r = subprocess.run([*cmd, "--resume", "--json"], capture_output=True, text=True, env={k: v for k, v in os.environ.items()})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["reused_shards"]) >= 2
    assert tree_hash(out) == tree_hash(ref)
    assert tree_hash(m) == before
    assert not partial.exists()


def test_refresh_rewrites_only_changed_shards(tmp_path):
    m = _big_model(tmp_path)
    out = tmp_path / "o"
    api.quantize(m, out, "W4A16", max_shard_size="4MB")
    prov = json.loads((out / "ctconvert-provenance.json").read_text())
    rec = prov["tensors"]["model.layers.3.mlp.up_proj.weight_packed"]
    assert rec[0]["tensor"] == "model.layers.3.mlp.up_proj.weight" and len(rec[0][prov["hash"]]) > 8
    # a fine-tuning step changes one tensor

    _refresh_after_one_tensor_changed(m, out, tmp_path)
    with pytest.raises(Exception, match="same options"):
        api.quantize(m, out, "W8A16", max_shard_size="4MB", refresh=True)


def test_refresh_from_a_format_1_provenance(tmp_path):
    """An output of an earlier release (provenance format 1: one XXH3-128 over each tensor's bytes) still
    refreshes: the sources are compared with format-1 hashes, only the changed shard is rewritten, and the
    new provenance is of the current format (block hashes, equal to a fresh conversion's)."""
    import xxhash

    from ctconvert.checkpoint.hashing import HASH_BLOCK_BYTES, hash_tensor_bytes
    from ctconvert.checkpoint.provenance import PROVENANCE_FORMAT
    from ctconvert.checkpoint.reader import open_checkpoint

    m = _big_model(tmp_path)
    out = tmp_path / "o"
    api.quantize(m, out, "W4A16", max_shard_size="4MB")
    p = out / "ctconvert-provenance.json"
    prov = json.loads(p.read_text())
    assert prov["provenance_format"] == PROVENANCE_FORMAT and prov["hash_block_bytes"] == HASH_BLOCK_BYTES
    ckpt = open_checkpoint(m)
    info = ckpt.tensors["model.layers.3.mlp.up_proj.weight"]
    with open(info.file, "rb") as f:  # format 1 is the plain XXH3-128 of the bytes, independently computed here
        f.seek(info.start)
        assert hash_tensor_bytes(info, legacy=True) == xxhash.xxh3_128(f.read(info.nbytes)).hexdigest()
    for srcs in prov["tensors"].values():
        for s in srcs:
            s["xxh3_128"] = hash_tensor_bytes(ckpt.tensors[s["tensor"]], legacy=True)
    del prov["provenance_format"], prov["hash_block_bytes"]
    p.write_text(json.dumps(prov))
    _refresh_after_one_tensor_changed(m, out, tmp_path)
    assert json.loads(p.read_text())["provenance_format"] == PROVENANCE_FORMAT


def _refresh_after_one_tensor_changed(m, out, tmp_path) -> None:
    """A fine-tuning step changes one tensor of ``m``; ``--refresh`` of ``out`` rewrites only some shards and
    then equals a full conversion, byte for byte."""
    from safetensors.torch import load_file, save_file

    idx = json.loads((m / "model.safetensors.index.json").read_text())
    f = m / idx["weight_map"]["model.layers.3.mlp.up_proj.weight"]
    t = load_file(f)
    t["model.layers.3.mlp.up_proj.weight"] = t["model.layers.3.mlp.up_proj.weight"] * 1.01
    save_file(t, f, metadata={"format": "pt"})
    res = api.quantize(m, out, "W4A16", max_shard_size="4MB", refresh=True)
    assert 1 <= len(res.rewritten_shards) < len(res.shards)
    assert sorted(res.reused_shards + res.rewritten_shards) == sorted(res.shards)  # the unchanged ones kept, and said so
    full = tmp_path / "full"
    api.quantize(m, full, "W4A16", max_shard_size="4MB")
    assert tree_hash(out) == tree_hash(full)


def _ctrl_c(args: list[str], after: float, twice: bool = False, slow_write: str = "0.05", timeout: float = 60) -> tuple[int, str]:
    """Run ``ctconvert *args``, press Ctrl-C after ``after`` seconds (and again 0.05 s later with ``twice``);
    returns (exit code, stderr). Fails if the process does not end within ``timeout`` seconds."""
    p = subprocess.Popen([*SLOW_CTCONVERT, slow_write, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    if twice:
        time.sleep(0.05)
        p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("ctconvert did not exit after Ctrl-C") from None
    return p.returncode, err


def _only_start_up_frames(err: str) -> bool:
    """Whether every frame of a traceback is Python's start-up (runpy, importlib) or the module level of the package's
    light entry modules (``ctconvert/__init__.py``, ``__main__.py``, ``errors.py``): no ctconvert code had run yet."""
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', err)
    light = (f"{os.sep}ctconvert{os.sep}__init__.py", f"{os.sep}ctconvert{os.sep}__main__.py", f"{os.sep}ctconvert{os.sep}errors.py")
    light += (f"{os.sep}tests{os.sep}slow_ctconvert.py",)  # the test's own launcher, still importing its hook (before ctconvert)
    stdlib = f"{os.sep}lib{os.sep}python3.{sys.version_info.minor}{os.sep}importlib{os.sep}"  # the launcher's own `import importlib.abc`
    return bool(frames) and all(f.startswith("<frozen ") or ((f.endswith(light) or stdlib in f) and fn == "<module>") for f, fn in frames)


@pytest.mark.parametrize("delay", [0.1, 0.2, 0.3, 0.4, 0.6, 0.9])
def test_ctrl_c_is_never_lost(tiny_llama, tmp_path, delay):
    """Ctrl-C at any moment of start-up (torch importing, planning, converting): exit 130 with one line and no
    checkpoint, or, if the conversion had already finished, exit 0 with the whole checkpoint. Never a
    swallowed interrupt (a KeyboardInterrupt raised inside torch's import can be lost), never a traceback."""
    out = tmp_path / "o"
    code, err = _ctrl_c(["quantize", str(tiny_llama), "-s", "W4A16", "-o", str(out)], delay, twice=True, slow_write="0.01")
    if code == -signal.SIGINT and not err.strip():
        # The signal came before the interpreter installed its handler: the default action ended it.
        assert_no_checkpoint(out)
        return
    if err.startswith("Fatal Python error: init_import_site"):
        # On a loaded machine the signal can come while the interpreter itself still starts (its ``site``
        # import, before any ctconvert code runs): Python reports that itself. Nothing may exist then.
        assert code != 0 and f"{os.sep}ctconvert{os.sep}" not in err, err  # no frame of the package
        assert_no_checkpoint(out)
        return
    if err.rstrip().endswith("KeyboardInterrupt") and _only_start_up_frames(err):
        # On a loaded machine the signal can come while runpy still imports the package (``python -m``), before
        # ``__main__.main`` installs its handlers: Python's own report, as for any Python program. Nothing may exist.
        assert code != 0
        assert_no_checkpoint(out)
        return
    assert "Traceback" not in err
    if code == 0:
        assert (out / "config.json").exists() and delay >= 0.9, err  # finished before the signal: then it counts
    else:
        assert code == 130, err
        assert err.strip().splitlines()[-1].startswith("interrupted: nothing was written")
        assert ("--resume" in err) == (finished_shards(out) > 0), err  # the hint only where a shard would be kept
        assert_no_checkpoint(out)


def test_partial_output_counts_the_bytes_on_disk(tmp_path):
    """A shard is created at its full size and filled in place: the interrupt message's size is what is on disk
    (``du``), not the files' lengths (a new user saw the whole output's size after an early Ctrl-C)."""
    out = tmp_path / "o"
    partial = tmp_path / ".o.ctconvert-partial"
    partial.mkdir()
    with open(partial / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(256 * 2**20)
        f.write(b"x" * 8192)
    assert partial_output(out)["bytes"] < 2**20


def test_finished_shards_reads_the_partial_journal(tmp_path):
    out = tmp_path / "o"
    assert finished_shards(out) == 0  # no partial folder
    partial = tmp_path / ".o.ctconvert-partial"
    partial.mkdir()
    (partial / JOURNAL).write_text("{not json")
    assert finished_shards(out) == 0
    (partial / JOURNAL).write_text(json.dumps({"fingerprint": "f", "shards": {}}))
    assert finished_shards(out) == 0
    (partial / JOURNAL).write_text(json.dumps({"fingerprint": "f", "shards": {"a.safetensors": {}, "b.safetensors": {}}}))
    assert finished_shards(out) == 2


def test_ctrl_c_twice_exits_130_promptly(tmp_path):
    m = _big_model(tmp_path)
    out = tmp_path / "o"
    code, err = _ctrl_c(["quantize", str(m), "-s", "NVFP4A16", "-o", str(out), "--max-shard-size", "8MB"], 2.5, twice=True, timeout=30)
    assert code == 130, err
    assert "interrupted" in err
    assert_no_checkpoint(out)


def test_ctrl_c_with_target_leaves_nothing(tmp_path):
    """quantize --target cannot be resumed: an interrupted run leaves no partial folder and does not advise --resume."""
    m = _big_model(tmp_path)
    out = tmp_path / "o"
    code, err = _ctrl_c(["quantize", str(m), "-s", "W4A16", "-o", str(out), "--target", "marlin", "--max-shard-size", "8MB"], 2.5)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "interrupted: nothing was written to the output path"
    assert not out.exists() and not list(tmp_path.glob(".o.ctconvert-*"))


def test_ctrl_c_stops_a_batch(tmp_path):
    """Ctrl-C during `batch` (after its jobs file was read) interrupts the running job: exit 130, no checkpoint."""
    m = _big_model(tmp_path)
    jobs = tmp_path / "jobs.json"
    jobs.write_text(
        json.dumps(
            {
                "defaults": {"scheme": "W8A16", "max_shard_size": "8MB"},
                "jobs": [{"model": str(m), "output": str(tmp_path / "a")}, {"model": str(m), "output": str(tmp_path / "b")}],
            }
        )
    )
    code, err = _ctrl_c(["batch", str(jobs)], 2.5)
    assert code == 130, err
    assert_no_checkpoint(tmp_path / "a")
    assert_no_checkpoint(tmp_path / "b")
    last = err.strip().splitlines()[-1]
    left = (tmp_path / ".a.ctconvert-partial").exists()
    if left or "was stopped" in last:  # (on a loaded machine the signal may come before the first job starts)
        assert f"job 0 ({tmp_path / 'a'}) was stopped, nothing was written at its output path" in last, err  # which job, and what it left
    else:
        assert last in ("interrupted", "interrupted; no job had started"), err  # (before or while the jobs file is read)
    assert "nothing was written to the output path" not in last  # earlier jobs may have written theirs
    assert ("partial data" in last) == left, err


# -- never lose data, never write a checkpoint that lies (issue 16) ----------------------------------


def test_overwrite_refuses_a_folder_ctconvert_did_not_write(tiny_llama, tmp_path):
    """`-o ~/models --overwrite` must not wipe a model store, nor a downloaded model."""
    store = tmp_path / "models"
    for name in ("modelA", "modelB"):
        (store / name).mkdir(parents=True)
        (store / name / "config.json").write_text("{}")
    hf = write_checkpoint(tmp_path / "hf", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)  # a model as downloaded: no ctconvert marker
    before = {p: tree_hash(p) for p in (store, hf, tiny_llama)}
    for out in (store, hf):
        c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", out, "--overwrite")
        assert c == 6 and "replaces only an earlier ctconvert output or an empty folder" in err and "Traceback" not in err, err
    assert {p: tree_hash(p) for p in before} == before
    out = tmp_path / "o"
    for scheme in ("W4A16", "FP8_DYNAMIC"):  # an earlier ctconvert output is replaced, again and again
        c, _, err = run_cli("quantize", tiny_llama, "-s", scheme, "-o", out, "--overwrite")
        assert c == 0, err
    dense = tmp_path / "dense"
    assert run_cli("decompress", out, "-o", dense)[0] == 0
    assert run_cli("decompress", out, "-o", dense, "--overwrite")[0] == 0  # decompress outputs carry the marker too
    assert json.loads((dense / "model.safetensors.index.json").read_text())["metadata"]["ctconvert"]


def test_overwrite_never_deletes_a_file_ctconvert_did_not_write(tiny_llama, tmp_path):
    """A file the user put into an earlier output (MY_NOTES.txt, a sub-folder's file) is named and the run refused
    (exit 6): the old output and the file stay as they were. Every file ctconvert wrote, the copies of the source's
    files included, is replaced without a word, and an output of a release without the file list (its index lacks
    ``ctconvert_files``) counts the source's files as its own."""
    out = tmp_path / "o"
    assert run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", out)[0] == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["metadata"]["ctconvert_files"]) == {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    (out / "MY_NOTES.txt").write_text("mine")
    (out / "eval").mkdir()
    (out / "eval" / "scores.json").write_text("{}")
    before = tree_hash(out)
    c, _, err = run_cli("quantize", tiny_llama, "-s", "FP8_DYNAMIC", "-o", out, "--overwrite")
    assert c == 6 and "would delete 2 files that ctconvert did not write (MY_NOTES.txt, eval/scores.json)" in err, err
    assert "Traceback" not in err and tree_hash(out) == before
    (out / "MY_NOTES.txt").unlink()
    shutil.rmtree(out / "eval")
    dense = tmp_path / "dense"  # decompress (and repack, convert) write through the same folder
    assert run_cli("decompress", out, "-o", dense)[0] == 0
    (dense / "MY_NOTES.txt").write_text("mine")
    c, _, err = run_cli("decompress", out, "-o", dense, "--overwrite")
    assert c == 6 and "1 file that ctconvert did not write (MY_NOTES.txt); move it out" in err, err
    assert (dense / "MY_NOTES.txt").read_text() == "mine"
    assert run_cli("quantize", tiny_llama, "-s", "FP8_DYNAMIC", "-o", out, "--overwrite")[0] == 0
    del index["metadata"]["ctconvert_files"]  # an output written before the list: the source's names are its own
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "tokenizer_config.json").write_text("{}")  # a copy of a source file (the fixture has one) ...
    (out / "MY_NOTES.txt").write_text("mine")  # ... and the user's file
    c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", out, "--overwrite")
    assert c == 6 and "(MY_NOTES.txt)" in err, err
    (out / "MY_NOTES.txt").unlink()
    assert run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", out, "--overwrite")[0] == 0


def _killed_after_a_shard(tmp_path: Path) -> tuple[Path, Path, Path, list[str]]:
    """A slowed NVFP4A16 run of the big model in 8 MB shards, SIGKILLed once it journaled a finished shard:
    ``(model, output path, partial folder, the command's arguments)``."""
    m = _big_model(tmp_path)
    out = tmp_path / "o"
    args = ["quantize", str(m), "-s", "NVFP4A16", "-o", str(out), "--max-shard-size", "8MB"]
    p = subprocess.Popen([*SLOW_CTCONVERT, "0.05", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and finished_shards(out) < 1:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    return m, out, tmp_path / ".o.ctconvert-partial", args


def _resumed_as_uninterrupted(m: Path, out: Path, args: list[str], tmp_path: Path) -> dict:
    """Resume ``args`` (``--json``): it succeeds and its output equals an uninterrupted run's, file for file. Its JSON."""
    r = subprocess.run([sys.executable, "-m", "ctconvert", "--json", *args, "--resume"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    full = tmp_path / "full"
    api.quantize(m, full, "NVFP4A16", max_shard_size="8MB")
    assert tree_hash(out) == tree_hash(full)
    return json.loads(r.stdout)


def test_resume_rewrites_a_shard_whose_source_changed(tmp_path):
    """Interrupt after a shard, change 2 bytes of its source keeping size and mtime, resume: that shard is made
    again from the new bytes, and the provenance records the bytes each shard was made from."""
    m, out, partial, args = _killed_after_a_shard(tmp_path)
    journal = json.loads((partial / JOURNAL).read_text())
    first = sorted(journal["shards"])[0]
    src = sorted(journal["shards"][first]["sources"])[0]  # a source tensor of a finished shard
    idx = json.loads((m / "model.safetensors.index.json").read_text())
    f = m / idx["weight_map"][src]
    st = f.stat()
    from ctconvert.checkpoint.safetensors_io import read_header

    info = read_header(f)[0][src]
    with open(f, "r+b") as fh:  # two bytes of the tensor's data, in place
        fh.seek(info.start + 10)
        b = fh.read(2)
        fh.seek(info.start + 10)
        fh.write(bytes([b[0] ^ 0x01, b[1] ^ 0x01]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    doc = _resumed_as_uninterrupted(m, out, args, tmp_path)
    assert first not in doc["reused_shards"] and any("written again" in n for n in doc["notes"]), doc


def test_resume_says_which_finished_shard_it_writes_again_because_its_bytes_changed(tmp_path):
    """Interrupt after a shard, flip a byte of that finished shard in the partial folder, resume: the shard fails its
    journaled hash and is written again, and the run says so, naming it (it was rewritten silently); the output is
    the uninterrupted run's."""
    m, out, partial, args = _killed_after_a_shard(tmp_path)
    first = sorted(json.loads((partial / JOURNAL).read_text())["shards"])[0]
    data = bytearray((partial / first).read_bytes())
    data[-7] ^= 0x10
    (partial / first).write_bytes(bytes(data))
    doc = _resumed_as_uninterrupted(m, out, args, tmp_path)
    assert first not in doc["reused_shards"] and first in doc["rewritten_shards"]
    assert sorted(doc["reused_shards"] + doc["rewritten_shards"]) == sorted(doc["shards"]), doc
    assert any(n.startswith(f"--resume: {first}") and "changed, damaged, linked or removed" in n for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize("tensor", ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pass_through_tensor_is_refused(tmp_path, tensor, bad):
    t = llama_tensors(LLAMA_CONFIG)
    flat = t[tensor].reshape(-1)
    flat[7] = bad
    m = write_checkpoint(tmp_path / "m", t, LLAMA_CONFIG)
    before = tree_hash(m)
    out = tmp_path / "o"
    c, _, err = run_cli("quantize", m, "-s", "W4A16", "-o", out)
    assert c == 3 and tensor in err and "non-finite" in err and "--allow-non-finite" in err and "Traceback" not in err, err
    assert_no_checkpoint(out)
    assert not out.exists()
    c, _, err = run_cli("quantize", m, "-s", "W4A16", "-o", out, "--allow-non-finite")
    assert c == 0 and f"note: {tensor}: holds non-finite values" in err, err
    assert tree_hash(m) == before


def test_other_weight_formats_are_not_copied(tiny_llama, tmp_path):
    m = tmp_path / "m"
    import shutil

    shutil.copytree(tiny_llama, m)
    (m / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    (m / "original").mkdir()
    (m / "original" / "consolidated.00.pth").write_bytes(b"\0" * 1000)
    (m / "tokenizer.model").write_bytes(b"spm")  # not weights: copied
    res = api.quantize(m, tmp_path / "o", "W4A16")
    assert not (tmp_path / "o" / "pytorch_model.bin").exists() and not (tmp_path / "o" / "original").exists()
    assert (tmp_path / "o" / "tokenizer.model").read_bytes() == b"spm"
    assert any("original/consolidated.00.pth" in n and "pytorch_model.bin" in n for n in res.notes), res.notes
    api.quantize(m, tmp_path / "k", "W4A16", keep_other_weights=True)
    assert (tmp_path / "k" / "pytorch_model.bin").exists() and (tmp_path / "k" / "original" / "consolidated.00.pth").exists()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_stop_like_ctrl_c(tmp_path, sig):
    """Batch schedulers send SIGTERM: the run stops with one line naming the signal and the partial data, and
    its finished shards are resumable."""
    m = _big_model(tmp_path)
    out = tmp_path / "o"
    args = ["quantize", str(m), "-s", "W4A16", "-o", str(out), "--max-shard-size", "8MB"]
    p = subprocess.Popen([*SLOW_CTCONVERT, "0.05", "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and finished_shards(out) < 1:
        time.sleep(0.05)
    p.send_signal(getattr(signal, sig))
    stdout, err = p.communicate(timeout=60)
    assert p.returncode == 128 + getattr(signal, sig), err
    last = err.strip().splitlines()[-1]
    doc = json.loads(stdout)  # --json: the document of a failure, its error the line on stderr
    assert doc == {"ok": False, "error": last, "exit_code": p.returncode, "type": "Interrupted"}
    assert last.startswith(f"{sig}: interrupted: nothing was written") and ".o.ctconvert-partial" in last and "MiB" in last, err
    assert "--resume" in last and "Traceback" not in err
    assert_no_checkpoint(out)
    r = subprocess.run([sys.executable, "-m", "ctconvert", "--json", *args, "--resume"], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["reused_shards"], r.stderr


@pytest.mark.parametrize("sig", ["SIGHUP", "SIGINT"])
def test_a_signal_the_run_was_started_ignoring_stays_ignored(tmp_path, sig):
    """nohup starts a command with SIGHUP ignored (a background job of a script: SIGINT): the run must not install a
    handler over that. Signalled every 20 ms from its start to its end (the import window, the conversion, the
    commit), it completes and writes the same output as a run left alone."""
    m = _big_model(tmp_path)
    args = ["quantize", str(m), "-s", "W4A16", "--max-shard-size", "8MB"]
    num = getattr(signal, sig)
    p = subprocess.Popen(  # started ignoring it, as nohup starts a command (the child's disposition before its exec)
        [*SLOW_CTCONVERT, "0.02", *args, "-o", str(tmp_path / "o")], stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(num, signal.SIG_IGN)
    )
    sent = 0
    while p.poll() is None:
        p.send_signal(num)
        sent += 1
        time.sleep(0.02)
    err = p.stderr.read()
    assert p.returncode == 0 and sent > 10, (sent, err)
    r = subprocess.run([sys.executable, "-m", "ctconvert", *args, "-o", str(tmp_path / "ref")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert tree_hash(tmp_path / "o") == tree_hash(tmp_path / "ref")


def test_free_space_is_checked_before_writing(tiny_llama, tmp_path, monkeypatch):
    import shutil

    from ctconvert.checkpoint import writer

    monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    before = tree_hash(tiny_llama)
    c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o")
    assert c == 6 and "not enough free space" in err, err
    assert "has 1000 B free" in err and "needs 980.72 KiB" in err and "0.00 GiB" not in err, err  # sizes in units that show them
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.ctconvert-*"))
    assert tree_hash(tiny_llama) == before


def _failing_pwrite(monkeypatch, err: int, after: int) -> None:
    """Shard writes (``pwrite`` and ``pwritev``) fail with ``err`` after ``after`` successful ones (a disk that fills up,
    a dying disk)."""
    import os as _os

    from ctconvert.checkpoint import shard_file

    pwrite, pwritev = _os.pwrite, _os.pwritev
    calls = []

    def failing(real):
        def call(fd, data, offset):
            calls.append(1)
            if len(calls) > after:
                raise OSError(err, _os.strerror(err))
            return real(fd, data, offset)

        return call

    monkeypatch.setattr(shard_file.os, "pwrite", failing(pwrite))
    monkeypatch.setattr(shard_file.os, "pwritev", failing(pwritev))
    native = shard_file.write_item  # a writer's item in one C call (native_write): it fails as its pwritev would

    def failing_item(fd, whole, runs):
        calls.append(1)
        if len(calls) > after:
            e = OSError(err, _os.strerror(err))
            e.run = len(runs) - 1
            raise e
        return native(fd, whole, runs)

    monkeypatch.setattr(shard_file, "write_item", failing_item)


def test_disk_full_while_writing_removes_the_partial_output(tiny_llama, tmp_path, monkeypatch):
    import errno

    _failing_pwrite(monkeypatch, errno.ENOSPC, 3)
    c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o")
    assert c == 6 and "No space left" in err and "partial output was removed" in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.ctconvert-*"))


def test_a_failed_write_names_the_partial_data(tiny_llama, tmp_path, monkeypatch):
    import errno

    _failing_pwrite(monkeypatch, errno.EIO, 3)
    c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o")
    assert c == 6 and "Input/output error" in err and ".o.ctconvert-partial" in err and "remove that folder" in err, err
    assert_no_checkpoint(tmp_path / "o")


def test_dry_run_reports_the_output_size(tiny_llama, tmp_path):
    res = api.quantize(tiny_llama, None, "W4A16", dry_run=True)
    real = api.quantize(tiny_llama, tmp_path / "o", "W4A16")
    assert res.output_bytes == real.output_bytes > 0


def test_refresh_checks_room_for_the_shards_it_copies_too(tiny_llama, tmp_path, monkeypatch):
    """--refresh with nothing changed copies every shard of the earlier output into its partial folder: without room
    for them it stops before any file is made (exit 6, what it needs), the earlier output intact; with room it runs."""
    import shutil

    from ctconvert.checkpoint import writer

    assert run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o", "--max-shard-size", "200KB")[0] == 0
    before = tree_hash(tmp_path / "o")
    real = writer.shutil.disk_usage
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    c, _, err = run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o", "--max-shard-size", "200KB", "--refresh")
    assert c == 6 and "not enough free space: the output needs 980.72 KiB" in err, err
    assert tree_hash(tmp_path / "o") == before and not list(tmp_path.glob(".o.ctconvert-*"))
    monkeypatch.setattr(writer.shutil, "disk_usage", real)
    assert run_cli("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o", "--max-shard-size", "200KB", "--refresh")[0] == 0
    assert tree_hash(tmp_path / "o") == before


def test_resume_keeps_no_file_put_in_the_partial_folder_meanwhile(tmp_path):
    """Interrupt after a shard, put files into the partial folder (a generation config the source lacks, a stray in a
    subfolder), resume: they are removed, the run names them in a note, and the output is the uninterrupted run's (a
    trial's planted ``generation_config.json`` was recorded as the run's and passed verify)."""
    m, out, partial, args = _killed_after_a_shard(tmp_path)
    (partial / "generation_config.json").write_text('{"temperature": 5.0}')
    (partial / "sub").mkdir()
    (partial / "sub" / "evil.txt").write_text("x")
    doc = _resumed_as_uninterrupted(m, out, args, tmp_path)
    assert not (out / "generation_config.json").exists() and not (out / "sub").exists()
    (note,) = [n for n in doc["notes"] if n.startswith("--resume: removed from the interrupted run's folder")]
    assert note.endswith("generation_config.json, sub"), note
    assert api.verify(out)["ok"]


def test_resume_writes_again_a_finished_shard_replaced_by_a_link(tmp_path):
    """A finished shard in the partial folder replaced by a symlink to the same bytes elsewhere is not kept: it is
    written again and named (a trial's link ended up in the output, pointing outside it, and verify passed)."""
    m, out, partial, args = _killed_after_a_shard(tmp_path)
    first = sorted(json.loads((partial / JOURNAL).read_text())["shards"])[0]
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(partial / first, outside)
    (partial / first).unlink()
    (partial / first).symlink_to(outside)
    doc = _resumed_as_uninterrupted(m, out, args, tmp_path)
    assert not (out / first).is_symlink() and first in doc["rewritten_shards"]
    assert any(n.startswith(f"--resume: {first}") and "changed, damaged, linked or removed" in n for n in doc["notes"]), doc["notes"]


def test_resume_writes_again_a_finished_shard_hard_linked_outside(tmp_path):
    """A finished shard that gained a hard link outside the partial folder shares its bytes with that file (an edit there
    would edit the output): it is written again, named, and the outside file is left as it is."""
    m, out, partial, args = _killed_after_a_shard(tmp_path)
    first = sorted(json.loads((partial / JOURNAL).read_text())["shards"])[0]
    outside = tmp_path / "outside.safetensors"
    os.link(partial / first, outside)
    doc = _resumed_as_uninterrupted(m, out, args, tmp_path)
    assert first in doc["rewritten_shards"] and (out / first).stat().st_nlink == 1 and outside.stat().st_nlink == 1
    assert any(n.startswith(f"--resume: {first}") and "changed, damaged, linked or removed" in n for n in doc["notes"]), doc["notes"]


def test_resume_names_a_removed_file_named_like_a_shard_that_the_run_does_not_write(tmp_path):
    """A ``.safetensors`` file in the partial folder that is none of the run's shards is removed and named in the note
    (the run's own unfinished shards are removed without a word: they are written again)."""
    m, out, partial, args = _killed_after_a_shard(tmp_path)
    (partial / "model-00099-of-00099.safetensors").write_bytes(b"\0" * 16)
    doc = _resumed_as_uninterrupted(m, out, args, tmp_path)
    (note,) = [n for n in doc["notes"] if n.startswith("--resume: removed from the interrupted run's folder")]
    assert note.endswith(": model-00099-of-00099.safetensors"), note
    assert not (out / "model-00099-of-00099.safetensors").exists() and api.verify(out)["ok"]


def test_resume_says_when_the_interrupted_runs_journal_is_gone(tmp_path):
    """Without its journal no finished shard can be trusted: the run starts over and says why (before, silently)."""
    m, out, partial, args = _killed_after_a_shard(tmp_path)
    (partial / JOURNAL).unlink()
    doc = _resumed_as_uninterrupted(m, out, args, tmp_path)
    assert any(n.startswith(f"--resume: the interrupted run's journal ({JOURNAL}) is missing or unreadable") for n in doc["notes"]), doc["notes"]
    assert not doc["reused_shards"]


def test_resume_names_a_link_at_an_unfinished_shards_name_and_leaves_its_target(tmp_path):
    """A symlink at the name of a shard the run had not finished is removed (the shard is written again), named in the
    note as a link, and its target is left as it is: before, it went unnamed with the run's unfinished shards."""
    m, out, partial, args = _killed_after_a_shard(tmp_path)
    finished = sorted(json.loads((partial / JOURNAL).read_text())["shards"])
    total = int(finished[0].split("-of-")[1].split(".")[0])
    unfinished = next(n for n in (f"model-{k:05d}-of-{total:05d}.safetensors" for k in range(1, total + 1)) if n not in finished)
    (partial / unfinished).unlink(missing_ok=True)
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"keep me")
    (partial / unfinished).symlink_to(target)
    doc = _resumed_as_uninterrupted(m, out, args, tmp_path)
    (note,) = [n for n in doc["notes"] if n.startswith("--resume: removed from the interrupted run's folder")]
    assert note.endswith(f": {unfinished} (a symlink; its target left as it is)"), note
    assert target.read_bytes() == b"keep me" and not (out / unfinished).is_symlink() and api.verify(out)["ok"]


@pytest.mark.parametrize("resume", [False, True])
def test_a_symlink_in_place_of_the_partial_folder_is_removed_never_written_through(tiny_llama, tmp_path, resume):
    """A symlink at the partial folder's name pointing at another folder (a user's model, say): before, the run emptied
    that folder (it removes what it did not write) and the output became a link into it. Now the link is removed, its
    target left as it is, and the run writes a folder of its own, with a note."""
    target = tmp_path / "precious"
    target.mkdir()
    (target / "weights.safetensors").write_bytes(b"keep me")
    (tmp_path / ".o.ctconvert-partial").symlink_to(target)
    args = ["--json", "quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o", *(["--resume"] if resume else [])]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert (target / "weights.safetensors").read_bytes() == b"keep me" and sorted(p.name for p in target.iterdir()) == ["weights.safetensors"]
    assert not (tmp_path / "o").is_symlink() and (tmp_path / "o").is_dir() and api.verify(tmp_path / "o")["ok"]
    assert any("was a symlink: removed (its target left as it is); starting over" in n for n in json.loads(out)["notes"])
