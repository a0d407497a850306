"""Issue 17, the last new-user run: what a dry run promises the real run does, one exit code per kind of wrong input,
tables that keep their information in every form, complete scheme lists, batch output for pipelines, counts that agree
with their nouns, absolute provenance paths (CLI tests: message, exit code and JSON)."""

from __future__ import annotations

import json
import os

import foreign_formats as ff
import pytest
from click.testing import CliRunner

from ctconvert.checkpoint.expected import EXPECTED_CHECK
from ctconvert.cli import main
from ctconvert.errors import agree, plural

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

NO_TOKENIZER = "no usable tokenizer in the checkpoint (looked for tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, merges.txt, vocab.txt"
FIX = "copy the model's tokenizer files into the checkpoint folder (or a copy of it, if it is read-only), or pass token ids with --calibration FILE"


def run(*args, env=None):
    r = CliRunner(env=env).invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture
def bare_llama(tmp_path):
    """A checkpoint without any tokenizer file."""
    return write_checkpoint(tmp_path / "bare", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)


@pytest.mark.parametrize("scheme,extra", [("NVFP4", []), ("FP8", []), ("W8A8_STATIC", []), ("W4A16", ["--kv-cache", "fp8"])])
def test_dry_run_of_a_calibrated_scheme_stops_where_the_real_run_stops(bare_llama, tmp_path, scheme, extra):
    code, stdout, err = run("quantize", bare_llama, "-s", scheme, "--dry-run", *extra)
    assert code == 3 and stdout.startswith("plan: ") and NO_TOKENIZER in err and "found none" in err and FIX in err, err
    assert "the built-in English corpus is text" in err and err.count("\n") == 1
    code, stdout, _ = run("--json", "quantize", bare_llama, "-s", scheme, "--dry-run", *extra)
    doc = json.loads(stdout)
    assert code == 3 and doc["ok"] is False and doc["exit_code"] == 3 and NO_TOKENIZER in doc["error"] and doc["plan"]["tensors"]
    if scheme == "NVFP4":  # the real run: the same code and message, nothing written
        code, _, real = run("quantize", bare_llama, "-s", scheme, "-o", tmp_path / "o", *extra)
        assert code == 3 and real == err and not (tmp_path / "o").exists()


def test_dry_run_names_the_calibration_data_and_its_shortfall(bare_llama, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(300)) * 10))
    code, stdout, _ = run("--json", "quantize", bare_llama, "-s", "NVFP4", "--dry-run", "--calibration", ids, "--calibration-samples", "4")
    doc = json.loads(stdout)
    assert code == 0 and doc["ok"] is True and f"calibration data: {ids} (token ids, 3000 tokens; using 4 x 256)" in doc["notes"]
    assert run("quantize", bare_llama, "-s", "NVFP4", "--dry-run", "--calibration", ids)[0] == 0  # the default 8 x 256 = 2048 tokens: enough
    code, _, err = run("quantize", bare_llama, "-s", "NVFP4", "--dry-run", "--calibration", ids, "--calibration-samples", "16")
    assert code == 3 and f"calibration needs 16 x 256 = 4096 tokens, {ids} has 3000" in err
    (tmp_path / "big.json").write_text(json.dumps([400] * 4096))  # outside the vocabulary of 384
    code, _, err = run("quantize", bare_llama, "-s", "FP8", "--dry-run", "--calibration", tmp_path / "big.json")
    assert code == 3 and "token id 400 is outside the vocabulary (size 384)" in err


def test_tokenizer_files_found_but_unusable_are_named(tiny_llama):
    code, _, err = run("quantize", tiny_llama, "-s", "NVFP4", "--dry-run")  # tokenizer_config.json "{}" only
    assert code == 3 and "found tokenizer_config.json: transformers could not load them (" in err and "ValueError)" not in err, err


def test_dense_or_foreign_input_has_one_exit_code_per_kind(bare_llama, tmp_path):
    dense = "not a quantized checkpoint (config.json has no quantization_config)"
    cases = [
        (["verify", bare_llama], "verify takes a compressed-tensors one; to compare a dense checkpoint (a decompress output) with its source, give"),
        (["decompress", bare_llama, "-o", tmp_path / "d"], "decompress takes a compressed-tensors one; this one is dense already"),
        (["repack", bare_llama, "-o", tmp_path / "r", "-t", "marlin"], "repack takes a compressed-tensors one; quantize it with --target marlin"),
        (["convert", bare_llama, "-o", tmp_path / "c"], "nothing to convert; `ctconvert quantize SRC -o OUT --scheme S` quantizes it"),
    ]
    for args, fix in cases:
        code, stdout, err = run(*args)
        assert code == 3 and f"{bare_llama / 'config.json'}: {dense}" in err and fix in err and err.count("\n") == 1, err
        code, stdout, _ = run("--json", *args)
        doc = json.loads(stdout)
        assert code == 3 and doc["ok"] is False and doc["exit_code"] == 3 and doc["type"] == "BadInputError" and dense in doc["error"]
    awq, _ = ff.awq_checkpoint(tmp_path / "awq")
    for args in (["verify", awq], ["verify", awq, "--reference", bare_llama], ["repack", awq, "-o", tmp_path / "r2", "-t", "marlin"]):
        code, stdout, err = run("--json", *args)
        doc = json.loads(stdout)
        assert code == 4 and doc["exit_code"] == 4 and "quant_method 'awq' is not compressed-tensors" in doc["error"] and "`ctconvert convert`" in doc["error"]
        assert err.count("\n") == 1  # one line, not a problem per AWQ tensor
    copy = write_checkpoint(tmp_path / "copy", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    assert run("verify", copy, "--reference", bare_llama)[0] == 0  # a dense checkpoint against a reference: compared, passes


def test_plain_and_rich_summary_tables_keep_max_tp(tmp_path):
    cfg = dict(LLAMA_CONFIG, num_hidden_layers=8)
    m = write_checkpoint(tmp_path / "m", llama_tensors(cfg), cfg)
    code, stdout, _ = run("--plain", "quantize", m, "-s", "W4A16", "--dry-run")
    lines = stdout.splitlines()
    assert code == 0 and lines[1].split() == ["tensors", "(count", "x", "first)", "action", "scheme", "max", "TP", "fused", "set", "/", "reason"]
    rows = {line.split()[2]: line.split() for line in lines[2:] if " x " in line}
    assert rows["lm_head.weight"][4] == "128" and rows["model.layers.0.mlp.gate_proj.weight"][6] == "512"
    # down_proj (K=512) and o_proj (K=256) share a summary row: the group's max TP is the smaller one, 256 / 128
    assert rows["model.layers.0.mlp.down_proj.weight"][:6] == ["16", "x", "model.layers.0.mlp.down_proj.weight", "...", "quantize", "W4A16"]
    assert rows["model.layers.0.mlp.down_proj.weight"][6] == "2"
    assert "fused {q_proj, k_proj, v_proj}" in stdout
    code, stdout, _ = run("quantize", m, "-s", "W4A16", "--dry-run", env={"COLUMNS": "160"})
    assert code == 0 and "max TP" in stdout and "│ 512 " in stdout


def test_schemes_lists_dense_and_dense_alone_says_what_it_needs(tiny_llama):
    code, stdout, _ = run("--plain", "schemes")
    row = next(line for line in stdout.splitlines() if line.startswith("DENSE "))
    assert code == 0 and "sparse-24-bitmask" in row and "with --sparsity 2:4 only" in row and row.rstrip().endswith("none (not quantized)")
    doc = json.loads(run("--json", "schemes")[1])
    dense = {s["name"]: s for s in doc["schemes"]}["DENSE"]
    assert dense["needs"] == "--sparsity 2:4" and dense["calibration"] is False and dense["format"] == "sparse-24-bitmask"
    assert [s["name"] for s in doc["schemes"]] == sorted(s["name"] for s in doc["schemes"])
    code, _, err = run("quantize", tiny_llama, "-s", "DENSE", "--dry-run")
    assert code == 2 and "--scheme DENSE quantizes nothing: it prunes 2:4 only and needs --sparsity 2:4" in err
    assert run("quantize", tiny_llama, "-s", "DENSE", "--sparsity", "2:4", "--dry-run")[0] == 0
    code, _, err = run("quantize", tiny_llama, "-s", "W4A61", "--dry-run")
    assert code == 2 and "unknown scheme 'W4A61'; did you mean W4A16? choose one of: FP8," in err


def test_batch_with_an_unknown_scheme_ends_stdout_with_error_and_summary(tiny_llama, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"jobs:\n  - model: {tiny_llama}\n    output: out\n    scheme: W4A17\n")
    for args in (["--json", "batch", jobs], ["batch", jobs], ["batch", jobs, "--json"]):
        code, stdout, err = run(*args)
        lines = [json.loads(x) for x in stdout.splitlines()]
        assert code == 2 and [x["status"] for x in lines] == ["error", "summary"] and not (tmp_path / "out").exists()
        assert lines[0]["job"] is None and lines[0]["exit_code"] == 2 and "job 0: unknown scheme 'W4A17'; did you mean W4A16?" in lines[0]["error"]
        assert set(lines[0]) >= {"model", "output", "reused_shards", "notes"}  # the schema of every job line
        assert lines[1]["jobs"] == 0 and lines[1]["error"] == 1 and lines[1]["exit_code"] == 2
        assert lines[1]["message"] == "0 ok, 1 failed, 0 skipped: the jobs file was refused, no job ran"
        assert err.startswith(f"error: {jobs}: job 0: unknown scheme 'W4A17'") and err.count("\n") == 1  # the human-readable line


def test_counts_agree_with_their_nouns(tiny_llama, tmp_path):
    assert (plural(1, "tensor"), plural(2, "tensor"), plural(1, "other entry", "other entries"), plural(0, "other entry", "other entries")) == (
        "1 tensor",
        "2 tensors",
        "1 other entry",
        "0 other entries",
    )
    assert (agree(1, "is", "are"), agree(3, "is", "are")) == ("is", "are")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "precious").write_text("x")
    code, _, err = run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "store", "--overwrite")
    assert code == 6 and "this folder holds 1 other entry (precious)" in err
    code, stdout, _ = run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o")
    assert code == 0 and ", 14 Linear layers quantized, 1 weight tensor kept dense, 1 shard, " in stdout
    code, stdout, _ = run("verify", tmp_path / "o")
    assert code == 0 and stdout.startswith("checked 1 shard, 49 tensors (")
    code, stdout, _ = run("--plain", "inspect", tmp_path / "o")
    assert code == 0 and "49 tensors in 1 file, " in stdout and "14/15 Linear layers quantized" in stdout
    code, stdout, _ = run("decompress", tmp_path / "o", "-o", tmp_path / "d")
    assert code == 0 and "14 modules decompressed" in stdout
    small = dict(LLAMA_CONFIG, hidden_size=64, intermediate_size=96, head_dim=16, num_hidden_layers=1)  # no 128x128 block fits
    m = write_checkpoint(tmp_path / "small", llama_tensors(small), small)
    code, _, err = run("quantize", m, "-s", "FP8_BLOCK", "--skip-incompatible", "--targets", "model.layers.0.self_attn.o_proj", "-o", tmp_path / "x")
    assert code == 4 and "--skip-incompatible kept it dense (first: model.layers.0.self_attn.o_proj.weight" in err


def test_requantized_inspect_names_the_format_once_and_paths_are_absolute(tmp_path, monkeypatch):
    ds = ff.deepseek_checkpoint(tmp_path / "ds")
    (ds / "README.md").write_text("# ds\n")
    awq, _ = ff.awq_checkpoint(tmp_path / "awq")
    monkeypatch.chdir(tmp_path)
    assert run("quantize", "./ds/", "-s", "FP8_DYNAMIC", "-o", "req")[0] == 0
    assert run("convert", "awq/../awq", "-o", "conv")[0] == 0
    code, stdout, _ = run("inspect", "req")
    assert code == 0 and f"  requantized from {ds} (fp8 block 128x128 (weight_scale_inv))" in stdout and "fp8: fp8" not in stdout
    code, stdout, _ = run("inspect", "conv")
    assert code == 0 and f"  converted losslessly from {awq} (awq gemm int4 group 128 (qweight, qzeros, scales))" in stdout
    for out, src in (("req", ds), ("conv", awq)):
        prov = json.loads((tmp_path / out / "ctconvert-provenance.json").read_text())
        assert prov["source"] == prov["derived_from"]["path"] == str(src) and os.path.isabs(prov["source"])
        doc = json.loads(run("--json", "inspect", out)[1])
        assert doc["derived_from"]["path"] == str(src)
    card = (tmp_path / "req" / "README.md").read_text()
    assert "Converted offline from `ds` by ctconvert" in card and "without calibration data" in card
    assert "- requantized from a quantized checkpoint (`quant_method: fp8`, fp8 block 128x128 (weight_scale_inv)), dequantized exactly first" in card
    (tmp_path / "m").mkdir()
    write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG, extra_files={"README.md": "# m\n"})
    monkeypatch.chdir(tmp_path / "m")
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(380)) * 6))
    assert run("quantize", ".", "-s", "FP8", "-o", "../cal", "--calibration", ids, "--calibration-samples", "2", "--calibration-seq-len", "64")[0] == 0
    card = (tmp_path / "cal" / "README.md").read_text()
    assert "Converted offline from `m` by ctconvert" in card and "calibrated on `ids.json` (2 x 64 tokens):" in card


def test_text_lines_are_not_wrapped_on_a_pipe_without_columns(tiny_llama, tmp_path):
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o")[0] == 0
    env = {"COLUMNS": None}
    code, stdout, _ = run("verify", tmp_path / "o", env=env)
    first = stdout.splitlines()[0]
    assert code == 0 and len(first) > 160 and first.endswith(EXPECTED_CHECK)  # the last check listed, unwrapped
    code, stdout, _ = run("verify", tmp_path / "o", env={"COLUMNS": "80"})  # COLUMNS: everything fits it
    assert code == 0 and max(len(line) for line in stdout.splitlines()) <= 80


def test_patterns_with_brackets_are_shown_as_written(tiny_llama, tmp_path):
    pattern = r"re:.*mlp\.[a-z]+_proj$"  # [a-z] looks like a rich style tag
    code, stdout, _ = run("quantize", tiny_llama, "-s", "W4A16", "--dry-run", "--ignore", pattern, env={"COLUMNS": None})
    assert code == 0 and f"--ignore {pattern}" in stdout  # the plan table's reason cell
    assert repr(pattern) in next(line for line in stdout.splitlines() if line.startswith("ignore: "))
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o", "--ignore", pattern)[0] == 0
    code, stdout, _ = run("inspect", tmp_path / "o")
    assert code == 0 and "  config group group_0: targets=['Linear'] scheme=int4 g128 format=pack-quantized" in stdout


def test_help_lists_every_command_in_a_sentence_that_fits():
    code, stdout, _ = run("--help")
    commands = stdout.split("Commands:")[1].splitlines()[1:]
    assert code == 0 and len(commands) == 8 and not any(line.endswith("...") for line in commands), stdout
    assert any(line.split() == ["verify", "Check", "the", "compressed-tensors", "checkpoint", "PATH."] for line in commands)


def test_kernel_native_input_and_a_folder_of_checkpoints_say_what_to_give(tiny_llama, tmp_path):
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "m", "--target", "marlin")[0] == 0
    fix = f"a ctconvert kernel-native (marlin) checkpoint, which only its kernel reads: `ctconvert repack {tmp_path / 'm'} -o OUT --target compressed-tensors`"
    for args in (["decompress", tmp_path / "m", "-o", tmp_path / "d"], ["quantize", tmp_path / "m", "-s", "FP8_DYNAMIC", "-o", tmp_path / "q"]):
        code, _, err = run(*args)
        assert code == 4 and fix in err and "unknown quant_method" not in err, err
    code, _, err = run("inspect", tmp_path)
    assert code == 3 and f"{tmp_path}: no *.safetensors file and no model.safetensors.index.json; it holds checkpoint folders (m, tiny-llama): give one" in err


def test_batch_unknown_key_names_the_key_meant(tiny_llama, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"jobs:\n  - model: {tiny_llama}\n    output: out\n    scheme: W4A16\n    lm-head: fp8\n    colour: red\n")
    code, stdout, err = run("batch", jobs)
    assert code == 2 and "job 0: unknown keys ['colour', 'lm-head'] ('lm-head': did you mean 'lm_head'?); a job takes act_dtype, " in err
    assert [json.loads(x)["status"] for x in stdout.splitlines()] == ["error", "summary"]


def test_verify_of_a_folder_without_a_readable_config_reports_that(bare_llama):
    (bare_llama / "config.json").write_text("{bad")
    code, stdout, _ = run("--json", "verify", bare_llama)
    doc = json.loads(stdout)
    errors = [p["message"] for p in doc["problems"] if p["severity"] == "error"]
    assert code == 5 and doc["ok"] is False and len(errors) == 1 and errors[0].startswith("config.json is not valid JSON"), errors
    (bare_llama / "config.json").unlink()
    code, stdout, _ = run("verify", bare_llama)
    assert code == 5 and "config.json is missing" in stdout and "quantization_config" not in stdout


def test_verify_against_another_model_says_so_once(tiny_llama, tmp_path):
    cfg = dict(LLAMA_CONFIG, num_hidden_layers=4)
    other = write_checkpoint(tmp_path / "other", llama_tensors(cfg), cfg)
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "q")[0] == 0
    code, stdout, _ = run("--json", "verify", tmp_path / "q", "--reference", other)
    doc = json.loads(stdout)
    missing = [p["message"] for p in doc["problems"] if "missing from the output" in p["message"]]
    assert code == 5 and len(missing) == 1, missing
    assert missing[0].startswith("18 tensors of the reference are missing from the output (model.layers.2.input_layernorm.weight, ")
    assert missing[0].endswith("is --reference the checkpoint this output was made from? (reference: 39 tensors, output: 49)")


def test_a_group_size_no_layer_takes_says_so_without_suggesting_skip_incompatible(tiny_llama, tmp_path):
    msg = "nothing to quantize: W4A16[group_size=100] cannot take any targeted Linear layer; --skip-incompatible would keep all 14 dense (first: "
    for extra in (["--dry-run"], ["-o", tmp_path / "o"]):
        code, stdout, err = run("quantize", tiny_llama, "-s", "W4A16", "--group-size", "100", *extra)
        assert code == 4 and msg in err and "or pass --skip-incompatible" not in err and not (tmp_path / "o").exists(), err
    code, _, err = run("quantize", tiny_llama, "-s", "W4A16", "--group-size", "100", "--skip-incompatible", "-o", tmp_path / "o")
    assert code == 4 and "--skip-incompatible kept all 14 dense" in err
    code, _, err = run("quantize", tiny_llama, "-s", "W4A16", "--group-size", "512", "-o", tmp_path / "o")  # some layers fit: the per-tensor fix
    assert code == 4 and "is not a multiple of the group size 512 of W4A16[group_size=512]; leave it dense with --ignore" in err


def test_json_of_inspect_and_verify_carries_the_exit_code(tiny_llama, tmp_path):
    assert run("quantize", tiny_llama, "-s", "W8A16", "-o", tmp_path / "o", "--max-shard-size", "200KB")[0] == 0
    for cmd in ("inspect", "verify"):
        code, stdout, _ = run("--json", cmd, tmp_path / "o")
        assert code == 0 and json.loads(stdout)["exit_code"] == 0
    shard = sorted((tmp_path / "o").glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:6])
    for cmd, want in (("inspect", 3), ("verify", 5)):
        code, stdout, _ = run("--json", cmd, tmp_path / "o")
        doc = json.loads(stdout)
        assert code == want and doc["exit_code"] == want and doc["ok"] is False


def test_ep_on_a_model_without_experts_is_said(tiny_llama, tmp_path):
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "o")[0] == 0
    code, stdout, _ = run("--json", "verify", tmp_path / "o", "--ep", "2")
    warnings = [p["message"] for p in json.loads(stdout)["problems"] if p["severity"] == "warning"]
    assert code == 0 and warnings == ["--ep 2: no MoE experts (modules named experts.N.), so it changes nothing"]
    code, stdout, _ = run("quantize", tiny_llama, "-s", "W4A16", "--dry-run", "--ep", "2")
    assert code == 0 and "at --tp 1 --ep 2: every tensor splits" in stdout
    assert "note: --ep 2: no quantized MoE experts (modules named experts.N.), so it changes nothing" in stdout


def test_verify_of_a_decompressed_untied_head_against_its_tied_source(tmp_path):
    cfg = dict(LLAMA_CONFIG, tie_word_embeddings=True)
    src = write_checkpoint(tmp_path / "tied", llama_tensors(cfg), cfg)
    assert run("quantize", src, "-s", "NVFP4A16", "--lm-head", "nvfp4a16", "-o", tmp_path / "q")[0] == 0
    assert run("decompress", tmp_path / "q", "-o", tmp_path / "d")[0] == 0
    code, stdout, _ = run("--json", "verify", tmp_path / "d", "--reference", src)
    doc = json.loads(stdout)
    assert code == 0 and doc["ok"] is True and not [p for p in doc["problems"] if p["severity"] == "error"]
    assert [r["module"] for r in doc["tensors"] if r["module"] == "lm_head"] == ["lm_head"]  # compared with the tied embedding


def test_problem_lines_read_like_error_lines(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    header = json.dumps({"a.weight": {"dtype": "Q7", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    (m / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    code, stdout, _ = run("inspect", m)
    assert code == 3 and f"error: {m / 'model.safetensors'}: a.weight: unknown dtype 'Q7'" in stdout and "┏" not in stdout  # no empty table


def test_verify_against_itself_is_refused(tiny_llama, tmp_path, monkeypatch):
    assert run("quantize", tiny_llama, "-s", "W4A16", "-o", tmp_path / "q")[0] == 0
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run("--json", "verify", "q", "--reference", "./q/")
    assert code == 2 and json.loads(stdout)["exit_code"] == 2 and "q: --reference is the checkpoint being verified, which measures nothing" in err


def test_pickle_weights_only_say_safetensors_are_needed(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (m / "pytorch_model.bin").write_bytes(b"not read")
    code, _, err = run("quantize", m, "-s", "W4A16", "--dry-run")
    assert code == 3 and "it holds pytorch_model.bin, weights in another format: ctconvert reads safetensors only" in err


def test_gpt_oss_mxfp4_source_says_how_to_get_a_readable_copy(tmp_path):
    cfg = dict(LLAMA_CONFIG, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})
    m = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG), cfg)
    code, stdout, err = run("--json", "quantize", m, "-s", "NVFP4A16", "--dry-run")
    assert code == 4 and json.loads(stdout)["exit_code"] == 4
    assert "quant_method 'mxfp4' (gpt-oss's own MXFP4 experts, *_blocks/*_scales) is not read yet" in err and "Mxfp4Config(dequantize=True)" in err
