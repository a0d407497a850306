"""OutputFolder.commit: the rename into place is one step that Ctrl-C cannot split."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ctconvert import api
from ctconvert.checkpoint import writer

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint


@pytest.mark.parametrize("where", ["rename", "rmtree"])
def test_ctrl_c_during_commit_is_held_off(tiny_llama, tmp_path, monkeypatch, where):
    """A SIGINT while an old output is moved aside, the new one renamed in, or the old one deleted:
    the commit completes (no KeyboardInterrupt), the new output is in place, nothing is left behind."""
    out = tmp_path / "o"
    api.quantize(tiny_llama, out, "W8A16")
    old_index = (out / "model.safetensors.index.json").read_text()
    real = getattr(writer.os if where == "rename" else writer.shutil, where)
    calls = []

    def interrupted(*a, **kw):
        calls.append(a)
        os.kill(os.getpid(), signal.SIGINT)  # delivered now, between the commit's steps
        return real(*a, **kw)

    monkeypatch.setattr(writer.os if where == "rename" else writer.shutil, where, interrupted)
    api.quantize(tiny_llama, out, "W4A16", overwrite=True)  # must not raise KeyboardInterrupt
    monkeypatch.undo()
    assert calls
    assert (out / "config.json").exists() and (out / "model.safetensors.index.json").read_text() != old_index
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert api.verify(out, tiny_llama)["ok"]
    # outside the commit, Ctrl-C still interrupts
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        torch.zeros(1)  # any bytecode after the signal


def test_a_shard_written_elsewhere_and_journaled_is_kept_by_resume(tmp_path):
    """journal_shard (the Ray executor's hand-off): a shard another process wrote under a temporary name and renamed
    into the folder, journaled with the hash that process took as it wrote, is kept by --resume: its file hashes the
    same when read back (the check of a resume), and its record says what it was made from."""
    from ctconvert.checkpoint.shard_file import PlannedTensor, ShardFile

    out = tmp_path / "o"
    planned = [[PlannedTensor("a", "BF16", (4, 8))], [PlannedTensor("b", "F32", (3,))]]
    folder = writer.OutputFolder(out, fingerprint="fp", shard_sources=lambda name: {"src." + name: "h"})
    shards = folder.open_shards(planned)
    shards["a"].abort()  # the driver's handle of a shard a worker writes
    elsewhere = ShardFile(folder.tmp / ".model-00001-of-00002.safetensors.part", planned[0])
    elsewhere.write("a", torch.arange(32, dtype=torch.bfloat16).reshape(4, 8))
    elsewhere.close()
    os.replace(elsewhere.path, folder.tmp / "model-00001-of-00002.safetensors")
    folder.journal_shard("model-00001-of-00002.safetensors", elsewhere.size, elsewhere.content_hash())
    folder.abort(keep=True)
    again = writer.OutputFolder(out, fingerprint="fp", resume=True)
    assert again.completed == {"model-00001-of-00002.safetensors"}
    assert again.journaled("model-00001-of-00002.safetensors")["sources"] == {"src.model-00001-of-00002.safetensors": "h"}
    again.abort()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd by /proc/self/fd")
@pytest.mark.parametrize("refresh", [False, True])
def test_every_file_and_folder_is_on_disk_before_the_rename(tmp_path, monkeypatch, refresh):
    """Before the partial folder is renamed into place, every file of it was fsynced (the index, config.json, the
    provenance, the model card, copied files in subfolders; the shards, also those --refresh copied from the old
    output) and so were its folders: a crash just after the rename cannot leave an output that looks complete with
    an empty file."""
    m = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG, shards=2, extra_files={"README.md": "# m\n", "sub/tok.txt": "x"})
    out = tmp_path / "o"
    if refresh:
        api.quantize(m, out, "W8A16", max_shard_size="100KB")
    synced, renamed = [], []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        synced.append((len(renamed), os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(how):
        return lambda a, b, *k, **kw: (renamed.append((str(a), str(b))), how(a, b, *k, **kw))[1]

    monkeypatch.setattr(writer.os, "fsync", fsync)
    monkeypatch.setattr(writer.os, "replace", rename(real_replace))
    monkeypatch.setattr(writer.os, "rename", rename(real_rename))
    res = api.quantize(m, out, "W8A16", max_shard_size="100KB", refresh=refresh)
    monkeypatch.undo()
    assert len(res.shards) > 1 and res.rewritten_shards == ([] if refresh else res.shards)  # refresh: every shard copied from the old output
    into_place = next(i for i, (_, b) in enumerate(renamed) if b == str(out))
    partial = renamed[into_place][0]
    before = {os.path.relpath(p, partial) for i, p in synced if i <= into_place and p.startswith(partial)}
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert files <= before, sorted(files - before)
    assert {".", "sub"} <= before
    assert {"config.json", "model.safetensors.index.json", "README.md", "sub/tok.txt"} <= files


def test_an_interrupt_while_the_folder_is_made_leaves_nothing_of_this_run(tmp_path, monkeypatch):
    """A Ctrl-C inside OutputFolder() (after its partial folder exists) removes the folder it created and releases its
    lock; a partial folder an earlier run left (for --resume) stays."""
    out = tmp_path / "o"

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.OutputFolder, "_save_journal", interrupted)
    with pytest.raises(KeyboardInterrupt):
        writer.OutputFolder(out)
    assert not writer.partial_folder(out).exists() and not out.exists()
    earlier = writer.partial_folder(out)
    earlier.mkdir()
    with pytest.raises(KeyboardInterrupt):
        writer.OutputFolder(out, resume=True)
    assert earlier.is_dir()
    monkeypatch.undo()
    with writer.OutputFolder(out, resume=True) as folder:  # the lock was released: a later run takes the folder
        folder.abort(keep=True)


def test_no_journal_is_written_once_the_folder_is_aborted(tmp_path):
    """A shard that finishes on a writer thread after abort() writes no journal (it would recreate entries in a folder
    being removed, which then stayed behind); abort() runs once."""
    folder = writer.OutputFolder(tmp_path / "o")
    folder.abort()
    assert not folder.tmp.exists()
    folder.journal["shards"]["late.safetensors"] = {"size": 1}
    folder._save_journal()  # what a late shard completion calls
    folder.abort()
    assert not folder.tmp.exists() and not (tmp_path / "o").exists()


def test_an_interrupt_between_the_folder_and_its_with_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    """The write stage makes its folder, then enters it: a Ctrl-C landing in between (here: in __enter__, which then
    never reaches __exit__) still removes the partial folder and reports the interrupt."""
    from ctconvert.errors import CTConvertError

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.OutputFolder, "__enter__", interrupted)
    out = tmp_path / "o"
    with pytest.raises((KeyboardInterrupt, CTConvertError)):
        api.quantize(tiny_llama, out, "W4A16")
    assert not out.exists() and not list(tmp_path.glob(".o.ctconvert-*"))


def test_resume_over_a_finished_output_says_there_is_nothing_to_resume(tiny_llama, tmp_path):
    """--resume where a finished conversion of the source is: exit 6, saying there is nothing to resume and what
    would update or replace it; without --resume the usual --overwrite advice; the output is left as it was."""
    from ctconvert.errors import OutputError

    out = tmp_path / "o"
    api.quantize(tiny_llama, out, "W8A16")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    with pytest.raises(OutputError, match="holds a finished conversion: nothing to resume; --refresh brings it up to date, --overwrite replaces it"):
        api.quantize(tiny_llama, out, "W8A16", resume=True)
    with pytest.raises(OutputError, match=r"output path exists; pass --overwrite"):
        api.quantize(tiny_llama, out, "W8A16")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before
