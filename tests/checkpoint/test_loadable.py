"""The one list of header checks (:mod:`ctconvert.checkpoint.loadable`): what ``quantize`` warns of in a source and
``inspect`` shows is exactly what ``verify`` runs, so that the three commands cannot drift apart."""

from __future__ import annotations

import pytest
import torch

from ctconvert import api
from ctconvert.checkpoint.loadable import architecture_problems, header_problems, loadability_problems
from ctconvert.checkpoint.modules import modules_of
from ctconvert.checkpoint.reader import open_checkpoint
from tests.conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint


def _edited(edit: str) -> tuple[dict, dict]:
    cfg, t = dict(LLAMA_CONFIG), llama_tensors(LLAMA_CONFIG)
    if edit == "hidden_size":
        cfg["hidden_size"] = 512
    elif edit == "head_dim":
        cfg["head_dim"] = 32
    elif edit == "layers":
        cfg["num_hidden_layers"] = cfg["num_hidden_layers"] + 1
    elif edit == "missing-norm":
        del t["model.layers.1.post_attention_layernorm.weight"]
    elif edit == "extra-bias":
        t["model.layers.0.mlp.down_proj.bias"] = torch.zeros(cfg["hidden_size"], dtype=torch.bfloat16)
    return cfg, t


@pytest.mark.parametrize("edit", ["none", "hidden_size", "head_dim", "layers", "missing-norm", "extra-bias"])
def test_verify_reports_every_problem_of_the_list(tmp_path, edit):
    """Each edit is found by the list (none in the unedited checkpoint), and verify of the W8A16 output reports every
    problem the list finds in that output, word for word, and fails it; the list is its two parts, in order."""
    cfg, t = _edited(edit)
    src = write_checkpoint(tmp_path / "src", t, cfg)
    api.quantize(src, tmp_path / "out", "W8A16", device="cpu")
    for folder in (src, tmp_path / "out"):
        ck = open_checkpoint(folder, strict=False)
        mods = modules_of(ck)
        found = loadability_problems(ck, mods, folder)
        parts = header_problems(ck, mods, folder) + architecture_problems(ck, mods)
        assert found == [p for p in parts if p.severity != "note"]
        assert bool([p for p in found if p.severity == "error"]) == (edit != "none"), (folder, found)
    rep = api.verify(tmp_path / "out")
    reported = {(p["severity"], p["message"], p.get("tensor")) for p in rep["problems"]}
    assert {(p.severity, p.message, p.tensor) for p in found} <= reported
    assert rep["ok"] == (edit == "none")


def test_a_folder_that_cannot_be_read_gets_no_follow_on_problems(tmp_path):
    """A shard that cannot be read: the list is empty (its own error says why), while its parts would still run."""
    cfg, t = _edited("hidden_size")
    src = write_checkpoint(tmp_path / "src", t, cfg)
    shard = next(src.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    ck = open_checkpoint(src, strict=False)
    assert any(p.severity == "error" for p in ck.problems)
    assert loadability_problems(ck, modules_of(ck), src) == []
