"""``verify --reference`` compares ``config.json`` (outside ``quantization_config``) and the files a conversion copies;
every ``verify`` checks the config's attention shapes against the tensors (:mod:`ctconvert.checkpoint.files_check`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ctconvert import api
from ctconvert.cli import main

from conftest import LLAMA_CONFIG, llama_tensors, save_config, write_checkpoint

FILES = {"tokenizer_config.json": '{"model_max_length": 128}', "generation_config.json": '{"bos_token_id": 1}', "README.md": "# A card\n\ntext\n"}


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    """(source, its W4A16 output): a tiny bf16 Llama with a tokenizer config, a generation config and a model card."""
    tmp = tmp_path_factory.mktemp("files")
    src = write_checkpoint(tmp / "src", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG, extra_files=FILES)
    api.quantize(src, tmp / "out", "W4A16", device="cpu")
    return src, tmp / "out"


def _copy(out, tmp_path):
    bad = tmp_path / "copy"
    shutil.copytree(out, bad)
    return bad


def _set_config(path, **changes):
    """config.json changed as a writer would have written it (its record in the index too: the checks of its keys are
    tested here; a config edited after the run is tests/checkpoint/test_integrity.py's)."""
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    save_config(path, cfg)


def _errors(rep: dict) -> list[str]:
    return [p["message"] for p in rep["problems"] if p["severity"] == "error"]


def test_a_correct_output_passes(w4a16):
    src, out = w4a16
    rep = api.verify(out, reference=src)
    assert rep["ok"] and not [p for p in rep["problems"] if p["severity"] != "note"], rep["problems"]
    assert "config.json and the copied files against the reference" in rep["checked"]["checks"]
    assert "# A card" in (out / "README.md").read_text() and "## Conversion (ctconvert)" in (out / "README.md").read_text()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_key_value_heads", 4, "config.json's num_key_value_heads is 4, the reference's 2"),
        ("rope_theta", 1.0, "config.json's rope_theta is 1.0, the reference's 10000.0"),
        ("rms_norm_eps", 0.1, "config.json's rms_norm_eps is 0.1, the reference's 1e-05"),
        ("bos_token_id", None, "config.json lacks bos_token_id (the reference's: 1)"),
        ("my_key", "x" * 200, 'config.json adds my_key: "xxxxx'),
        ("torch_dtype", "int8", 'config.json\'s torch_dtype is "int8", the reference\'s "bfloat16"'),
        ("tie_word_embeddings", True, "config.json's tie_word_embeddings is true, the reference's false"),
    ],
)
def test_a_changed_config_key_fails(w4a16, tmp_path, key, value, message):
    src, out = w4a16
    bad = _copy(out, tmp_path)
    _set_config(bad, **{key: value})
    rep = api.verify(bad, reference=src)
    assert not rep["ok"] and any(m.startswith(message) for m in _errors(rep)), _errors(rep)
    assert all(len(m) < 300 for m in _errors(rep))  # long values are truncated


def test_the_cli_exits_5_on_a_changed_config(w4a16, tmp_path):
    src, out = w4a16
    bad = _copy(out, tmp_path)
    _set_config(bad, rope_theta=1.0)
    r = CliRunner().invoke(main, ["verify", str(bad), "--reference", str(src)])
    assert r.exit_code == 5 and "rope_theta" in r.output, r.output


def test_kv_heads_against_k_proj_rows_without_a_reference(w4a16, tmp_path):
    _, out = w4a16
    bad = _copy(out, tmp_path)
    _set_config(bad, num_key_value_heads=4)
    rep = api.verify(bad)
    found = [p for p in rep["problems"] if p["severity"] == "error"]
    assert not rep["ok"] and {p["tensor"] for p in found} == {f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("k_proj", "v_proj")}
    assert found[0]["message"] == "config.json's num_key_value_heads 4 x head_dim 64 = 256 output rows, but k_proj has 128"
    _set_config(bad, num_key_value_heads=2, num_attention_heads=8)
    rep = api.verify(bad)
    assert {p["tensor"] for p in rep["problems"] if p["severity"] == "error"} == {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}
    assert "num_attention_heads 8 x head_dim 64 = 512 output rows, but q_proj has 256" in _errors(rep)[0]


def test_head_dim_from_hidden_size(w4a16, tmp_path):
    _, out = w4a16
    bad = _copy(out, tmp_path)
    _set_config(bad, head_dim=None)  # 256 / 4 = 64: consistent
    assert api.verify(bad)["ok"]
    _set_config(bad, hidden_size=512)  # 512 / 4 = 128: q_proj would have 512 rows
    assert any("x head_dim 128 (config.json has no head_dim: hidden_size 512 / num_attention_heads 4) = 512 output rows" in m for m in _errors(api.verify(bad)))


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json", "README.md"])
def test_a_missing_or_changed_copy_fails(w4a16, tmp_path, name):
    src, out = w4a16
    bad = _copy(out, tmp_path)
    (bad / name).unlink()
    rep = api.verify(bad, reference=src)
    assert not rep["ok"] and f"{name} of the reference is missing from the output (a conversion copies it)" in _errors(rep)
    (bad / name).write_text("{}\n")
    rep = api.verify(bad, reference=src)
    assert not rep["ok"] and any(m.startswith(name) for m in _errors(rep)), _errors(rep)


def test_a_file_the_reference_lacks_is_a_warning(w4a16, tmp_path):
    src, out = w4a16
    bad = _copy(out, tmp_path)
    (bad / "notes.txt").write_text("mine")
    rep = api.verify(bad, reference=src)
    warned = [p["message"] for p in rep["problems"] if p["severity"] == "warning"]
    assert rep["ok"] and warned == ["files that are not in the reference and that ctconvert does not write: notes.txt"]


@pytest.fixture(scope="module")
def fp32_tied(tmp_path_factory):
    cfg = dict(LLAMA_CONFIG, torch_dtype="float32", tie_word_embeddings=True)
    return write_checkpoint(tmp_path_factory.mktemp("tied") / "src", llama_tensors(cfg, dtype=torch.float32), cfg, extra_files=FILES)


def test_dense_dtype_and_an_untied_head_pass(fp32_tied, tmp_path):
    api.quantize(fp32_tied, tmp_path / "bf16", "W4A16", dense_dtype="bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    rep = api.verify(tmp_path / "bf16", reference=fp32_tied)
    assert rep["ok"], _errors(rep)
    api.quantize(fp32_tied, tmp_path / "head", "W4A16", lm_head="nvfp4a16")
    assert json.loads((tmp_path / "head" / "config.json").read_text())["tie_word_embeddings"] is False
    rep = api.verify(tmp_path / "head", reference=fp32_tied)
    assert rep["ok"], _errors(rep)
    plain = tmp_path / "plain"  # untied in config.json, but no lm_head stored: the head would be random
    api.quantize(fp32_tied, plain, "W4A16")
    _set_config(plain, tie_word_embeddings=False)
    headless = [m for m in _errors(api.verify(plain, reference=fp32_tied)) if "no lm_head" in m]  # said once (widths.tied_head_problems)
    assert headless == ["config.json's tie_word_embeddings is false, but the checkpoint stores no lm_head: vLLM 0.33 builds an untied head no tensor fills"]


def test_a_config_dtype_the_dense_tensors_do_not_have_fails(w4a16, fp32_tied, tmp_path):
    """``torch_dtype`` changed by hand to another float dtype (a new user: bf16 tensors said float16; a --dense-dtype
    bf16 output said float32 again) fails naming the key; the dtype --dense-dtype wrote passes (above)."""
    src, out = w4a16
    bad = _copy(out, tmp_path)
    _set_config(bad, torch_dtype="float16")
    assert any('torch_dtype is "float16", but the output\'s dense tensors are BF16' in m for m in _errors(api.verify(bad, reference=src)))
    api.quantize(fp32_tied, tmp_path / "bf16", "W4A16", dense_dtype="bf16")
    _set_config(tmp_path / "bf16", torch_dtype="float32")  # the reference's own value, but no longer the tensors'
    assert any('torch_dtype is "float32", but the output\'s dense tensors are BF16' in m for m in _errors(api.verify(tmp_path / "bf16", reference=fp32_tied)))


def test_a_head_tied_again_over_a_quantized_lm_head_fails(fp32_tied, tmp_path):
    api.quantize(fp32_tied, tmp_path / "head", "W4A16", lm_head="nvfp4a16")
    _set_config(tmp_path / "head", tie_word_embeddings=True)
    errors = _errors(api.verify(tmp_path / "head", reference=fp32_tied))
    assert any("tie_word_embeddings is true, but the output stores a quantized lm_head (lm_head." in m for m in errors), errors


def test_decompress_against_both_references(w4a16, tmp_path):
    src, out = w4a16
    dense = tmp_path / "dense"
    api.decompress(out, dense)
    for ref in (src, out):
        rep = api.verify(dense, reference=ref)
        assert rep["ok"], _errors(rep)
    _set_config(dense, rope_theta=1.0)
    (dense / "generation_config.json").unlink()
    errors = _errors(api.verify(dense, reference=src))
    assert "config.json's rope_theta is 1.0, the reference's 10000.0" in errors
    assert "generation_config.json of the reference is missing from the output (a conversion copies it)" in errors


def test_minilm(minilm_path, tmp_path):
    out = tmp_path / "out"
    api.quantize(minilm_path, out, "W4A16", ignore=["re:.*pooler.*"])
    rep = api.verify(out, reference=minilm_path)
    assert rep["ok"] and not [p for p in rep["problems"] if p["severity"] == "warning"], rep["problems"]
    for name in ("tokenizer.json", "vocab.txt"):
        (out / name).unlink()
    found = [p for p in api.verify(out, reference=minilm_path)["problems"] if p["severity"] == "error"]
    # each named twice: against the reference, and against the hash the index records of what the run wrote
    assert sorted(Path(p["file"]).name for p in found) == ["tokenizer.json"] * 2 + ["vocab.txt"] * 2, found
    assert [p for p in found if p["file"] == str(out / "vocab.txt") and p["message"].startswith("missing: the run wrote it")], found
