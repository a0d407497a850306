"""Issue 17: messages that point to the fix, options after the command, help without arguments (CLI tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ctconvert.cli import main

from conftest import LLAMA_CONFIG, llama_tensors, save_shard, write_checkpoint
from helpers import RecordingBar


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize(
    "args,code,msg",
    [
        (
            ["--ignore", "down_proj"],
            2,
            "--ignore 'down_proj' matches no module: entries are full module names (like 'model.layers.0.mlp.down_proj') or re: patterns "
            "(re.match from the start of the name, like 're:.*down_proj$')",
        ),
        (["--ignore", "re:nomatch.*"], 2, "--ignore 're:nomatch.*' matches no module of this checkpoint: entries are full module names (like 'model."),
        (["--targets", "q_proj"], 2, "--targets 'q_proj' matches no module: entries are full module names (like 'model.layers.0.self_attn.q_proj')"),
        (["--targets", "lm_head"], 2, "--targets 'lm_head': lm_head is quantized with --lm-head nvfp4a16 or --lm-head fp8, not with --targets"),
        (["--layout-version", "0.29"], 2, "--layout-version without --target: they choose a kernel-native layout; add --target marlin"),
        (["--act-dtype", "fp16"], 2, "--act-dtype without --target"),
        (["--act-dtype", "fp16", "--layout-version", "0.29"], 2, "--layout-version and --act-dtype without --target"),
    ],
)
def test_messages_point_to_the_fix(tiny_llama, tmp_path, args, code, msg):
    out = tmp_path / "o"
    c, stdout, err = run("quantize", tiny_llama, "-s", "W4A16", "-o", out, *args)
    assert c == code and msg in err and err.count("\n") == 1 and not out.exists(), err
    c, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "W4A16", "-o", out, *args)
    doc = json.loads(stdout)
    assert c == code and doc["ok"] is False and doc["exit_code"] == code and msg in doc["error"]


def test_ignore_matching_only_dense_modules_is_a_note(tiny_llama, tmp_path):
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "W4A16", "--dry-run", "--ignore", "model.embed_tokens")
    doc = json.loads(stdout)
    assert code == 0 and "--ignore 'model.embed_tokens' matched only modules that stay dense anyway" in doc["notes"]


def test_skip_incompatible_that_skips_everything_says_so(tmp_path):
    cfg = dict(LLAMA_CONFIG, hidden_size=64, intermediate_size=96, head_dim=16)
    m = write_checkpoint(tmp_path / "m", llama_tensors(cfg), cfg)
    code, _, err = run("quantize", m, "-s", "FP8_BLOCK", "--skip-incompatible", "-o", tmp_path / "o")
    assert code == 4 and not (tmp_path / "o").exists()
    assert "nothing to quantize: FP8_BLOCK cannot take any targeted Linear layer; --skip-incompatible kept all 14 dense" in err
    assert "is not a multiple of the block" in err and "choose another scheme" in err
    assert "--group-size" not in err  # FP8_BLOCK has no group size to change
    code, _, err = run("quantize", m, "-s", "W4A16", "--group-size", "40", "--skip-incompatible", "-o", tmp_path / "o")
    assert code == 4 and "choose another scheme or --group-size" in err, err  # a new user's find: the fix is the group size


def test_src_file_or_hub_id(tiny_llama, tmp_path):
    single = write_checkpoint(tmp_path / "single", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    code, _, err = run("quantize", single / "model.safetensors", "-s", "W4A16", "-o", tmp_path / "o")
    assert code == 3 and f"is a file; give the checkpoint folder that holds it and its config.json: {single}" in err
    code, _, err = run("inspect", "meta-llama/Llama-3.1-8B")
    assert code == 3 and "looks like a Hugging Face Hub id" in err and "hf download meta-llama/Llama-3.1-8B --local-dir DIR" in err
    code, _, err = run("decompress", tmp_path / "nope", "-o", tmp_path / "o")
    assert code == 3 and "not a checkpoint folder (does not exist" in err


def test_repack_w8a8_says_what_marlin_takes(tiny_llama, tmp_path):
    assert run("quantize", tiny_llama, "-s", "W8A8", "-o", tmp_path / "q")[0] == 0
    code, _, err = run("repack", tmp_path / "q", "-o", tmp_path / "m", "--target", "marlin")
    assert code == 4 and "marlin takes pack-quantized int4/int8 (W4A16, W4A16_ASYM, W8A16)" in err
    assert "int-quantized W8A8 runs on vLLM's int8 GEMM kernels, not Marlin" in err


def test_quiet_and_debug_after_the_command(tiny_llama, tmp_path):
    code, stdout, err = run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o", "-q")
    assert code == 0 and stdout == "" and err == ""
    code, stdout, _ = run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o2", "--debug")
    assert code == 0 and "wrote" in stdout
    r = subprocess.run([sys.executable, "-m", "ctconvert", "inspect", str(tmp_path / "nope"), "--debug"], capture_output=True, text=True)
    assert r.returncode == 3 and "Traceback" in r.stderr


def test_no_arguments_prints_help():
    r = subprocess.run([sys.executable, "-m", "ctconvert"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("Usage: ") and "quantize" in r.stdout and "error" not in r.stderr


def test_truncated_shard_is_reported_once(tiny_llama, tmp_path):
    out = tmp_path / "o"
    assert run("quantize", tiny_llama, "-s", "W8A16", "-o", out, "--max-shard-size", "200KB")[0] == 0
    shard = sorted(out.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:6])
    code, stdout, _ = run("--json", "inspect", out)
    errs = [p for p in json.loads(stdout)["problems"] if p["severity"] == "error"]
    assert code == 3 and len(errs) == 1 and "truncated" in errs[0]["message"] and errs[0]["file"].endswith(shard.name)


def test_decompress_keeps_source_dtypes_and_dtype_option_updates_config(tmp_path):
    import torch
    from safetensors import safe_open

    cfg = dict(LLAMA_CONFIG, torch_dtype="float32")
    m = write_checkpoint(tmp_path / "m", llama_tensors(cfg, dtype=torch.float32), cfg)
    assert run("quantize", m, "-s", "W4A16", "-o", tmp_path / "q")[0] == 0
    code, stdout, _ = run("--json", "decompress", tmp_path / "q", "-o", tmp_path / "d")
    doc = json.loads(stdout)
    assert code == 0 and doc["dtype"] == "fp32" and doc["cast_all"] is False
    with safe_open(tmp_path / "d" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # norms, embeddings and the dense head stay fp32 too
    assert json.loads((tmp_path / "d" / "config.json").read_text())["torch_dtype"] == "float32"
    code, stdout, _ = run("decompress", tmp_path / "q", "-o", tmp_path / "d16", "--dtype", "bf16")
    assert code == 0 and "14 modules decompressed to bf16, every float tensor cast to it" in stdout
    with safe_open(tmp_path / "d16" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "d16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_decompress_fp32_of_a_bf16_model_says_fp32_in_config(tiny_llama, tmp_path):
    assert run("quantize", tiny_llama, "-s", "FP8_DYNAMIC", "-o", tmp_path / "q")[0] == 0
    assert run("decompress", tmp_path / "q", "-o", tmp_path / "d", "--dtype", "fp32")[0] == 0
    assert json.loads((tmp_path / "d" / "config.json").read_text())["torch_dtype"] == "float32"


def test_decompress_and_repack_report_progress(tiny_llama, tmp_path):
    from ctconvert import api

    api.quantize(tiny_llama, tmp_path / "q", "W4A16")
    for name, call in (
        ("decompress", lambda p: api.decompress(tmp_path / "q", tmp_path / "d", progress=p)),
        ("repack", lambda p: api.repack(tmp_path / "q", tmp_path / "m", "marlin", device="cpu", progress=p)),
    ):
        log, totals = [], []
        res = call(lambda total, log=log, totals=totals: totals.append(total) or RecordingBar(log, total))
        assert totals == [res["output_bytes"]] and sum(log) == res["output_bytes"] and len(log) > 10, name


def test_progress_bar_only_on_a_terminal(monkeypatch):
    from ctconvert.cli import _Ctx, _progress_factory

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert _progress_factory(_Ctx(False, False, False), "decompress") is not None
    assert _progress_factory(_Ctx(False, False, True)) is None and _progress_factory(_Ctx(True, False, False)) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert _progress_factory(_Ctx(False, False, False)) is None


def test_tables_fit_80_columns_without_splitting_names(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, stdout, _ = run("quantize", tiny_llama, "-s", "W4A16", "--dry-run", "--target", "marlin")
    assert code == 0 and "then repacked for marlin (vLLM layout 0.33, bf16 activations)" in stdout.replace("\n", " ").replace("  ", " ") or "marlin" in stdout
    lines = stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any("model.layers.0.post_attention_layernorm.weight" in line for line in lines)  # whole, on one line
    assert "not shown at this width" in stdout
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o")[0] == 0
    code, stdout, _ = run("inspect", tmp_path / "o")
    assert code == 0 and max(len(line) for line in stdout.splitlines()) <= 80 and "model.layers.1.self_attn.q_proj" in stdout
    code, stdout, _ = run("--plain", "quantize", tiny_llama, "-s", "W4A16", "--dry-run")
    row = next(line for line in stdout.splitlines() if line.startswith("lm_head.weight"))
    assert row.split()[:4] == ["lm_head.weight", "BF16", "384x256", "ignore"] and "lm_head (default; see --lm-head)" in row
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "W4A16", "--dry-run", "--target", "marlin")
    doc = json.loads(stdout)
    assert doc["target"] == {"target": "marlin", "layout_version": "0.33", "act_dtype": "bf16"} and len(doc["plan"]["tensors"]) == 21


def test_dry_run_summary_and_inspect_summary_rows_name_their_layers(tmp_path):
    cfg = dict(LLAMA_CONFIG, hidden_size=64, intermediate_size=128, head_dim=16, num_hidden_layers=10, vocab_size=128)
    m = write_checkpoint(tmp_path / "m", llama_tensors(cfg), cfg)
    code, stdout, _ = run("--plain", "quantize", m, "-s", "FP8_DYNAMIC", "--dry-run")
    assert code == 0 and "93 tensors summarized; --all-layers lists each" in stdout
    assert "20 x model.layers.0.mlp.down_proj.weight ..." in stdout and "30 x model.layers.0.self_attn.k_proj.weight ..." in stdout
    assert "1 x lm_head.weight" in stdout and "fused {q_proj, k_proj, v_proj}" in stdout
    code, stdout, _ = run("--plain", "quantize", m, "-s", "FP8_DYNAMIC", "--dry-run", "--all-layers")
    assert "model.layers.9.mlp.up_proj.weight" in stdout
    assert run("quantize", m, "-s", "FP8_DYNAMIC", "-o", tmp_path / "o")[0] == 0
    code, stdout, _ = run("--plain", "inspect", tmp_path / "o")
    rows = [line.split()[0:3] for line in stdout.splitlines()]
    assert code == 0 and ["lm_head", "dense", "dense"] in rows  # the summary row names its one layer
    assert "70 layers (model.layers.0.mlp.down_proj ...)" in stdout


def test_inspect_bits_per_quantized_weight_other_methods_and_kernel_native_counts(tiny_llama, tmp_path):
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "q")[0] == 0
    t = json.loads(run("--json", "inspect", tmp_path / "q")[1])["totals"]
    assert t["quantized_bits_per_weight"] == pytest.approx(8 * (256 * 64 * 4 + 256 * 4 * 2 + 16) / (256 * 512), abs=0.01)
    assert t["linear_bits_per_weight"] > t["quantized_bits_per_weight"]
    assert run("repack", tmp_path / "q", "-o", tmp_path / "m", "--target", "marlin", "--device", "cpu")[0] == 0
    k = json.loads(run("--json", "inspect", tmp_path / "m")[1])["totals"]
    assert (k["linear_layers"], k["quantized_layers"]) == (t["linear_layers"], t["quantized_layers"]) == (15, 14)
    gptq = dict(LLAMA_CONFIG, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})
    g = write_checkpoint(tmp_path / "g", llama_tensors(LLAMA_CONFIG), gptq)
    code, stdout, _ = run("inspect", g)
    assert "gptq (not compressed-tensors): bits=4, group_size=128, desc_act=False" in stdout and "None" not in stdout.splitlines()[0]


def test_model_card_copy_says_how_it_was_converted(tmp_path):
    card = "# Tiny\n\nA model card.\n"
    m = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG, extra_files={"README.md": card})
    assert run("quantize", m, "-s", "W4A16", "-o", tmp_path / "o", "--ignore", "model.layers.1.mlp.down_proj")[0] == 0
    from ctconvert import __version__

    out = (tmp_path / "o" / "README.md").read_text()
    assert out.startswith(card) and "## Conversion (ctconvert)" in out and f"ctconvert {__version__}" in out
    assert "- scheme: `W4A16`, compressed-tensors format `pack-quantized`" in out
    assert "- kept dense (`ignore`): `lm_head`, `model.layers.1.mlp.down_proj`" in out and "- lm_head: kept dense" in out
    assert (m / "README.md").read_text() == card  # the input stays untouched
    assert run("quantize", m, "-s", "W4A16", "-o", tmp_path / "k", "--target", "marlin")[0] == 0
    assert "- kernel-native layout: `marlin`" in (tmp_path / "k" / "README.md").read_text()
    bare = write_checkpoint(tmp_path / "b", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    assert run("quantize", bare, "-s", "W4A16", "-o", tmp_path / "bo")[0] == 0 and not (tmp_path / "bo" / "README.md").exists()


def test_verify_says_what_it_checked_and_summarizes_above_the_table(tiny_llama, tmp_path):
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "q", "--max-shard-size", "300KB")[0] == 0
    code, stdout, _ = run("--json", "verify", tmp_path / "q", "--reference", tiny_llama)
    rep = json.loads(stdout)
    c, s = rep["checked"], rep["summary"]
    assert code == 0 and c["shards"] == len(list((tmp_path / "q").glob("*.safetensors"))) > 1 and c["tensors"] == 49 and c["compared_modules"] == 14
    assert "error of every quantized weight against the reference" in c["checks"] and "dense Linear in ignore" in c["checks"]
    worst = max(rep["tensors"], key=lambda r: r["rel_l2"])
    assert s["modules"] == 14 and s["failed"] == 0 and s["worst_module"] == worst["module"] and s["worst_rel_l2"] == worst["rel_l2"]
    code, stdout, _ = run("verify", tmp_path / "q", "--reference", tiny_llama)
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "14 weights compared with" in line)
    assert code == 0 and lines[0].startswith(f"checked {c['shards']} shards, 49 tensors") and at < next(i for i, line in enumerate(lines) if "┏" in line)
    assert f"worst {worst['module']}" in stdout.replace("\n", " ")
    code, stdout, _ = run("--json", "verify", tmp_path / "q")
    assert code == 0 and json.loads(stdout)["summary"] is None and json.loads(stdout)["checked"]["compared_modules"] == 0


def test_verify_of_a_dense_decompress_output_compares_values(tmp_path):
    import torch
    from safetensors.torch import load_file

    cfg = dict(LLAMA_CONFIG, torch_dtype="float32")
    m = write_checkpoint(tmp_path / "m", llama_tensors(cfg, dtype=torch.float32), cfg)
    assert run("quantize", m, "-s", "W8A16", "-o", tmp_path / "q")[0] == 0
    assert run("decompress", tmp_path / "q", "-o", tmp_path / "d", "--dtype", "bf16")[0] == 0  # norms cast to bf16 too
    code, stdout, _ = run("--json", "verify", tmp_path / "d", "--reference", m)
    rep = json.loads(stdout)
    assert code == 0 and rep["ok"] and not any("bytes differ" in p["message"] for p in rep["problems"])
    mods = {r["module"] for r in rep["tensors"]}
    assert "model.layers.0.mlp.down_proj" in mods and all(r["format"] == "dense" and r["rel_l2"] < 0.04 for r in rep["tensors"])
    assert "every tensor's values against the reference (dense)" in rep["checked"]["checks"]
    f = tmp_path / "d" / "model.safetensors"
    t = load_file(f)
    t["model.layers.1.mlp.up_proj.weight"] = -t["model.layers.1.mlp.up_proj.weight"]
    save_shard(t, f)
    code, stdout, _ = run("--json", "verify", tmp_path / "d", "--reference", m)
    rep = json.loads(stdout)
    assert code == 5 and rep["summary"]["worst_module"] == "model.layers.1.mlp.up_proj" and rep["summary"]["failed"] == 1
    assert any(p["tensor"] == "model.layers.1.mlp.up_proj.weight" and "exceeds 0.3" in p["message"] for p in rep["problems"])


def test_verify_reference_reports_progress(tiny_llama, tmp_path):
    from ctconvert import api

    api.quantize(tiny_llama, tmp_path / "q", "W4A16")
    log, totals = [], []
    rep = api.verify(tmp_path / "q", tiny_llama, progress=lambda total: totals.append(total) or RecordingBar(log, total))
    assert (
        rep["ok"]
        and len(totals) == 1
        and sum(log)
        == totals[0]
        == sum(p.stat().st_size for p in tiny_llama.glob("*.safetensors"))
        - sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in tiny_llama.glob("*.safetensors"))
    )


def test_schemes_header_and_activation_column():
    code, stdout, _ = run("--plain", "schemes")
    lines = stdout.splitlines()
    assert code == 0 and lines[0].split() == ["scheme", "compressed-tensors", "format", "weights", "activations"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["FP8_DYNAMIC"].endswith("fp8 per token, dynamic") and rows["W4A16"].endswith("none (weight-only)")
    assert rows["FP8_BLOCK"].endswith("fp8 group 128, dynamic") and rows["W8A8"].endswith("int8 per token, dynamic")
    doc = json.loads(run("--json", "schemes")[1])
    assert {s["name"]: s["activations"] for s in doc["schemes"]}["NVFP4A16"] == "none (weight-only)"
