"""OutputFolder.commit: the rename into place is one step that Ctrl-C cannot split."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ctconvert import api
from ctconvert.checkpoint import writer


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
