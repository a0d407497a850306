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
