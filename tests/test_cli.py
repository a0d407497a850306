"""The command line: exit codes, one-line errors, --json documents, inspect reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ctconvert.cli import command_word, main, quantize_reads

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def test_quantize_then_inspect_json(tiny_llama, tmp_path):
    out = tmp_path / "o"
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "w4a16", "-o", out, "--max-shard-size", "200KB")
    assert code == 0
    doc = json.loads(stdout)
    assert doc["ok"] and doc["scheme"] == "W4A16" and doc["format"] == "pack-quantized" and doc["quantized_modules"] == 14
    code, stdout, _ = run("--json", "inspect", out)
    rep = json.loads(stdout)
    assert code == 0 and rep["ok"] and rep["problems"] == []
    assert rep["totals"]["quantized_layers"] == 14 and rep["totals"]["linear_layers"] == 15
    layer = next(r for r in rep["layers"] if r["module"] == "model.layers.0.mlp.down_proj")
    assert layer["scheme"] == "int4 g128" and layer["format"] == "pack-quantized"
    assert layer["tensors"]["weight_packed"] == {"dtype": "I32", "shape": [256, 64]}
    assert layer["bits_per_weight"] == pytest.approx(8 * (256 * 64 * 4 + 256 * 4 * 2 + 16) / (256 * 512), abs=1e-3)
    head = next(r for r in rep["layers"] if r["module"] == "lm_head")
    assert head["format"] == "dense" and head["bits_per_weight"] == 16.0


def test_human_output(tiny_llama, tmp_path):
    code, stdout, _ = run("quantize", tiny_llama, "-s", "nvfp4a16", "-o", tmp_path / "o")
    assert code == 0 and "NVFP4A16 (nvfp4-pack-quantized), 14 Linear layers quantized" in stdout
    code, stdout, _ = run("inspect", tmp_path / "o")
    assert code == 0 and "no problems found in the headers and config" in stdout and "ctconvert verify" in stdout and "fp4 g16" in stdout
    code, stdout, _ = run("inspect", tiny_llama)
    assert code == 0 and "dense (no quantization_config)" in stdout


def test_dry_run_table(tiny_llama, tmp_path):
    code, stdout, _ = run("quantize", tiny_llama, "-s", "fp8_dynamic", "--dry-run")
    assert code == 0 and "14 tensors to quantize, 1 Linear kept dense" in stdout and "q_proj,k_proj,v_proj" in stdout
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "fp8_dynamic", "--dry-run", "-o", tmp_path / "o")
    assert code == 0 and json.loads(stdout)["plan"]["ignore"] == ["lm_head"] and not (tmp_path / "o").exists()


def test_tensor_parallel_plan_and_checks(tiny_llama, tmp_path):
    code, stdout, _ = run("quantize", tiny_llama, "-s", "w4a16", "--dry-run", "--tp", "4")
    assert code == 0 and "max TP" in stdout
    assert "tensor parallel: largest TP degree 2 (limited by model.layers.0.self_attn.o_proj, model.layers.1.self_attn.o_proj)" in stdout
    assert "model.layers.0.self_attn.o_proj: K per rank 64 is not a whole number of groups of 128" in stdout
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "w4a16", "--dry-run", "--target", "marlin", "--tp", "2")
    doc = json.loads(stdout)
    assert code == 0 and doc["plan"]["parallel"]["tp"] == 2 and doc["plan"]["parallel"]["ok"]
    gate = next(r for r in doc["plan"]["tensors"] if r["name"] == "model.layers.0.mlp.gate_proj.weight")
    assert gate["max_tp"] == 8  # Marlin tiles: 512 / 8 = 64 rows per rank
    out = tmp_path / "o"
    assert run("quantize", tiny_llama, "-s", "w4a16", "-o", out)[0] == 0
    code, stdout, _ = run("verify", out, "--tp", "4")
    assert code == 5 and "does not split at --tp 4" in stdout and "largest TP degree 2" in stdout
    assert run("verify", out, "--tp", "2")[0] == 0
    code, _, stderr = run("verify", out, "--tp", "0")
    assert code == 2 and "--tp" in stderr


def test_quiet_verify_prints_what_failed_and_the_verdict(tiny_llama, tmp_path):
    """``-q verify``: no summary (the checks, the error table, the TP line), only what failed and the verdict."""
    out = tmp_path / "o"
    assert run("quantize", tiny_llama, "-s", "w4a16", "-o", out)[0] == 0
    code, loud, _ = run("verify", out, "--reference", tiny_llama)
    assert code == 0 and "checked " in loud and "error against" in loud and "tensor parallel" in loud
    said = "with --reference the parameters vLLM builds are not judged: `ctconvert verify OUT` without it judges them"
    assert said in loud and said not in run("verify", out)[1]  # (the plain run judges them)
    from ctconvert.checkpoint.expected import EXPECTED_CHECK

    for ref, left in (([], []), (["--reference", tiny_llama], [EXPECTED_CHECK])):  # --json: what the run left out, by name
        checked = json.loads(run("--json", "verify", out, *ref)[1])["checked"]
        assert checked["not_checked"] == left and (EXPECTED_CHECK in checked["checks"]) == (not left)
    from ctconvert.checkpoint.expected import EXPECTED_CHECK

    for ref, left in (([], []), (["--reference", tiny_llama], [EXPECTED_CHECK])):  # --json: what the run left out, by name
        checked = json.loads(run("--json", "verify", out, *ref)[1])["checked"]
        assert checked["not_checked"] == left and (EXPECTED_CHECK in checked["checks"]) == (not left)
    code, stdout, _ = run("-q", "verify", out, "--reference", tiny_llama)
    assert code == 0 and stdout.strip() == "verify: passed"
    code, stdout, _ = run("-q", "verify", out, "--tp", "4")
    assert code == 5 and "does not split at --tp 4" in stdout and stdout.strip().endswith("verify: FAILED") and "checked " not in stdout


def test_json_result_names_the_observer(tiny_llama, tmp_path):
    """``--json quantize`` names each config group's observer other than min/max, in a run as in a dry run."""
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "w4a16", "--observer", "memoryless_mse", "-o", tmp_path / "o")
    assert code == 0 and json.loads(stdout)["observers"] == {"group_0": "memoryless_mse"}
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "w4a16", "--observer", "memoryless_mse", "--dry-run")
    assert code == 0 and json.loads(stdout)["observers"] == {"group_0": "memoryless_mse"}
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "w4a16", "-o", tmp_path / "m")
    assert code == 0 and "observers" not in json.loads(stdout)


def test_a_redundant_target_is_noted_as_such_and_patterns_are_quoted_as_written(tiny_llama):
    """A target whose modules an earlier target already takes gets a note saying so (not "stay dense"); an entry
    that matches nothing is refused with its backslashes as the user wrote them (no repr doubling)."""
    code, stdout, _ = run("--json", "quantize", tiny_llama, "-s", "w4a16", "--targets", r"re:.*mlp\..*", "--targets", r"re:.*up_proj$", "--dry-run")
    assert code == 0, stdout
    assert "--targets 're:.*up_proj$' matched only modules that another target already takes" in json.loads(stdout)["notes"]
    code, _, stderr = run("quantize", tiny_llama, "-s", "w4a16", "--targets", r"re:.*mlp\.nothing$", "--dry-run")
    assert code == 2 and r"--targets 're:.*mlp\.nothing$' matches no module" in stderr


def test_rows_quantized_to_zero_are_named(tmp_path):
    cfg = dict(LLAMA_CONFIG, torch_dtype="float16")
    t = llama_tensors(cfg, dtype=torch.float16)
    t["model.layers.1.mlp.down_proj.weight"] *= 1e-6
    src = write_checkpoint(tmp_path / "src", t, cfg)
    code, _, stderr = run("quantize", src, "-s", "w4a16", "-o", tmp_path / "o")
    assert code == 0 and "note: model.layers.1.mlp.down_proj.weight: every quantized value is zero although the source is not" in stderr
    code, stdout, _ = run("verify", tmp_path / "o")
    assert code == 0 and "warning: model.layers.1.mlp.down_proj: every quantized value is zero" in stdout


@pytest.mark.parametrize(
    "args,code,msg",
    [
        (["-s", "nope"], 2, "unknown scheme 'nope'"),
        (["-s", "NVFP4"], 3, "no usable tokenizer"),  # calibrating from the built-in text needs the checkpoint's tokenizer
    ],
)
def test_usage_errors(tiny_llama, tmp_path, args, code, msg):
    c, _, err = run("quantize", tiny_llama, "-o", tmp_path / "o", *args)
    assert c == code and msg in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_inspect_reports_missing_shard_and_stale_index(tiny_llama, tmp_path):
    out = tmp_path / "o"
    run("quantize", tiny_llama, "-s", "w8a16", "-o", out, "--max-shard-size", "200KB")
    shards = sorted(out.glob("model-*.safetensors"))
    shards[-1].unlink()
    code, stdout, _ = run("--json", "inspect", out)
    rep = json.loads(stdout)
    assert code == 3 and not rep["ok"]
    assert any("does not exist" in p["message"] for p in rep["problems"])


def test_inspect_warns_of_missing_decoder_layers(tmp_path):
    """config.json names 4 layers, the tensors hold 2 (a partial copy): verify's count, naming layers 2 and 3, and one
    warning for each saying that vLLM refuses it and verify fails it (verify's own checks, from the headers; exit 0)."""
    m = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG), dict(LLAMA_CONFIG, num_hidden_layers=4))
    code, stdout, _ = run("--json", "inspect", m)
    warn = [p for p in json.loads(stdout)["problems"] if p["severity"] == "warning"]
    assert code == 0 and len(warn) == 3 and warn[0]["message"].startswith("config.json's num_hidden_layers is 4 (model.layers.0 .. model.layers.3)")
    assert "but 2 of them (2..3) have no tensors" in warn[0]["message"] and warn[0]["file"].endswith("config.json")
    assert [p["tensor"] for p in warn[1:]] == ["model.layers.2", "model.layers.3"]
    assert all("vLLM refuses" in p["message"] and p["message"].endswith("(`ctconvert verify` fails it)") for p in warn[1:])
    full = write_checkpoint(tmp_path / "full", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    assert json.loads(run("--json", "inspect", full)[1])["problems"] == []


def test_inspect_reports_dense_linear_not_in_ignore(tiny_llama, tmp_path):
    out = tmp_path / "o"
    run("quantize", tiny_llama, "-s", "w8a16", "-o", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = []
    (out / "config.json").write_text(json.dumps(cfg))
    code, stdout, _ = run("--json", "inspect", out)
    rep = json.loads(stdout)
    assert code == 3 and any(p.get("tensor") == "lm_head" and "not in ignore" in p["message"] for p in rep["problems"])


def test_inspect_reports_unequal_fused_global_scales(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "o"
    run("quantize", tiny_llama, "-s", "nvfp4a16", "-o", out)
    f = out / "model.safetensors"
    t = load_file(f)
    t["model.layers.0.self_attn.k_proj.weight_global_scale"] = t["model.layers.0.self_attn.k_proj.weight_global_scale"] * 2
    save_file(t, f, metadata={"format": "pt"})
    code, stdout, _ = run("--json", "inspect", out)
    rep = json.loads(stdout)
    assert any("different NVFP4 global scales" in p["message"] for p in rep["problems"])


def test_subprocess_nan_error_exit_code_no_traceback(tmp_path, monkeypatch):
    monkeypatch.delenv("CT_ENFORCE_EAGER", raising=False)
    src = llama_tensors(LLAMA_CONFIG)
    src["model.layers.0.self_attn.v_proj.weight"][0, 0] = float("nan")
    ckpt = write_checkpoint(tmp_path / "m", src, LLAMA_CONFIG)
    r = subprocess.run([sys.executable, "-m", "ctconvert", "quantize", str(ckpt), "-s", "W4A16", "-o", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 3
    assert r.stderr.strip().startswith(f"error: {ckpt / 'model.safetensors'}: tensor 'model.layers.0.self_attn.v_proj.weight': weight holds 1 non-finite")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    r = subprocess.run(
        [sys.executable, "-m", "ctconvert", "--debug", "quantize", str(ckpt), "-s", "W4A16", "-o", str(tmp_path / "o")], capture_output=True, text=True
    )
    assert r.returncode == 3 and "Traceback" in r.stderr


def test_schemes_command():
    code, stdout, _ = run("--json", "schemes")
    names = {s["name"] for s in json.loads(stdout)["schemes"]}
    assert {"FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"} <= names
    rows = {s["name"]: s for s in json.loads(stdout)["schemes"]}
    assert "INT8" not in rows and rows["W8A8"]["aliases"] == ["INT8"] and rows["W4A16"]["aliases"] == []
    assert rows["MXFP8"]["format"] == "mxfp8-quantized" and rows["MXFP4"]["format"] == "mxfp4-pack-quantized"
    assert {n for n, r in rows.items() if r["calibration"]} == {"NVFP4", "FP8", "W8A8_STATIC", "W8A8_STATIC_ASYM"}
    assert rows["W4AFP8"]["activations"] == "fp8 per token, dynamic" and rows["W4A16"]["activations"] == "none (weight-only)"
    assert rows["W8A8_STATIC_ASYM"]["activations"] == "int8 per tensor asymmetric, static, calibrated"
    code, stdout, _ = run("schemes")
    assert code == 0 and "W8A8 = INT8" in stdout and not any(line.startswith("INT8") for line in stdout.splitlines())


def test_output_exists_exit_code(tiny_llama, tmp_path):
    (tmp_path / "o").mkdir()
    code, _, err = run("quantize", tiny_llama, "-s", "W8A16", "-o", tmp_path / "o")
    assert code == 6 and "--overwrite" in err


def test_help():
    r = subprocess.run([sys.executable, "-m", "ctconvert", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "quantize" in r.stdout and "inspect" in r.stdout


def test_usage_errors_are_one_line_and_json(tmp_path):
    """click's own usage errors follow the same rules as ours: one line on stderr, a JSON document with --json."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "ctconvert", "--json", "quantize", str(tmp_path), "-s", "W4A16", "-o", str(tmp_path / "o"), "--target", "marlin", "--resume"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --target cannot be combined with --resume or --refresh (see `")
    assert lines[0].endswith("ctconvert quantize --help`)")
    doc = json.loads(p.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "--resume" in doc["error"]
    p = subprocess.run([sys.executable, "-m", "ctconvert", "quantize", str(tmp_path), "-s", "W4A16"], capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ") and p.stdout == ""


def test_option_lists_split_on_commas_outside_brackets():
    from ctconvert.cli import split_list as _split

    assert _split(("re:.*down_proj,model.layers.0.self_attn.o_proj",)) == ["re:.*down_proj", "model.layers.0.self_attn.o_proj"]
    assert _split((r"re:.*layers\.(1|2)\..*,re:x{1,3}", "a,b", " c ")) == [r"re:.*layers\.(1|2)\..*", "re:x{1,3}", "a", "b", "c"]
    assert _split(("re:.*[,;]x,y", "re:(a,b)")) == ["re:.*[,;]x", "y", "re:(a,b)"]


def _strict_json(text: str):
    """``json.loads`` that refuses the non-standard ``Infinity``/``NaN`` tokens, as parsers outside Python do."""

    def refuse(token):
        raise ValueError(f"not standard JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_json_is_standard_json_for_a_lossless_verify(tiny_llama, tmp_path):
    """A lossless comparison (an FP8 output against its own decompressed copy) has an infinite SNR: --json writes
    it as the string "inf", never the token Infinity."""
    out, back = tmp_path / "o", tmp_path / "b"
    assert run("quantize", tiny_llama, "-s", "FP8_DYNAMIC", "-o", out)[0] == 0
    assert run("decompress", out, "-o", back)[0] == 0
    code, stdout, _ = run("--json", "verify", out, "--reference", back)
    assert code == 0, stdout
    doc = _strict_json(stdout)  # (the text says "NaN/inf" in its list of checks, so test tokens, not substrings)
    assert doc["summary"]["min_snr_db"] == "inf" and float(doc["summary"]["min_snr_db"]) == float("inf")
    assert doc["tensors"] and all(t["snr_db"] == "inf" for t in doc["tensors"])


def test_json_dumps_replaces_every_non_finite_float():
    from ctconvert import jsonout

    doc = {"a": float("inf"), "b": [float("-inf"), 1.5, (float("nan"),)], "c": {"d": 0.0}}
    assert _strict_json(jsonout.dumps(doc)) == {"a": "inf", "b": ["-inf", 1.5, ["nan"]], "c": {"d": 0.0}}


@pytest.mark.parametrize(
    "argv, word, reads",
    [
        (["quantize", "m", "-o", "o", "-s", "W4A16"], "quantize", ("m", True)),
        (["--json", "quantize", "-s", "W4A16", "m", "--dry-run"], "quantize", ("m", False)),
        (["-q", "quantize", "--scheme=NVFP4", "--target", "marlin", "src", "-o", "o", "--device", "cpu"], "quantize", ("src", True)),
        (["quantize", "m", "--resume", "-o", "x", "-s", "W4A16", "--json"], "quantize", ("m", False)),
        (["quantize", "m", "--refresh", "-o", "x", "-s", "W4A16"], "quantize", ("m", False)),
        (["quantize", "--help"], "quantize", None),  # no SRC
        (["quantize", "m", "--no-such-option"], "quantize", None),  # click refuses it: cli.run says why
        (["--plain", "schemes"], "schemes", None),
        (["decompress", "m", "-o", "o"], "decompress", None),
        (["--json", "--debug"], None, None),
    ],
)
def test_what_a_command_line_reads(argv, word, reads):
    """The command word after the group's flags, and what a quantize line reads (SRC; every tensor unless a dry
    run, --resume or --refresh), as click parses it, without running or printing anything."""
    assert command_word(argv) == word
    assert quantize_reads(argv) == reads
