"""quantize --dense-dtype: the tensors that are not quantized are cast (torch's round to nearest even), bit for bit;
quantized weights are the bytes of a run without the option; the config, the plan, inspect, batch and --refresh say so."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ctconvert import api
from ctconvert.cli import main
from ctconvert.errors import BadInputError, UsageError

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

IGNORED = "model.layers.0.mlp.down_proj"


def _awkward_fp32(cfg: dict, seed: int = 5) -> dict[str, torch.Tensor]:
    """fp32 Llama weights whose dense tensors need real rounding: random norms, values at bf16/fp16's
    edges (halfway cases, subnormals, ±0, the largest finite fp16), a row of zeros in the embedding."""
    t = llama_tensors(cfg, dtype=torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name in [n for n in t if n.endswith("norm.weight")]:
        t[name] = 1 + torch.randn(t[name].shape, generator=g) * 0.3
    norm = t["model.norm.weight"]
    edge = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, -(2**-140), 0.0, -0.0, 65504.0, 1e-8, 3.0e38])
    norm[: edge.numel()] = edge
    t["model.embed_tokens.weight"][7] = 0
    return t


@pytest.fixture
def fp32_llama(tmp_path):
    cfg = dict(LLAMA_CONFIG, torch_dtype="float32")
    return write_checkpoint(tmp_path / "fp32", _awkward_fp32(cfg), cfg, shards=2)


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("scheme,lm_head", [("W4A16", "none"), ("NVFP4A16", "fp8")])
def test_dense_tensors_are_cast_and_quantized_bytes_unchanged(fp32_llama, tmp_path, scheme, lm_head):
    src = _tensors(fp32_llama)
    plain = api.quantize(fp32_llama, tmp_path / "plain", scheme, ignore=[IGNORED], lm_head=lm_head)
    cast = api.quantize(fp32_llama, tmp_path / "bf16", scheme, ignore=[IGNORED], lm_head=lm_head, dense_dtype="bf16")
    a, b = _tensors(tmp_path / "plain"), _tensors(tmp_path / "bf16")
    assert set(a) == set(b)
    dense = [n for n in b if n in src and a[n].dtype == src[n].dtype]  # copied or kept dense (a quantized lm_head keeps its name, not its dtype)
    assert {"model.embed_tokens.weight", "model.norm.weight", f"{IGNORED}.weight"} <= set(dense)
    assert ("lm_head.weight" in dense) == (lm_head == "none")
    for n in dense:
        assert b[n].dtype == torch.bfloat16, n
        assert _bits(b[n]) == _bits(src[n].to(torch.bfloat16)), n  # torch's own cast, bit for bit
        assert _bits(a[n]) == _bits(src[n])  # without the option: the source's bytes
    for n in set(b) - set(dense):  # quantized weights, their scales (the scheme's dtype), shapes
        assert a[n].dtype == b[n].dtype and _bits(a[n]) == _bits(b[n]), n
    assert any(b[n].dtype == torch.float32 for n in set(b) - set(dense))  # e.g. W4A16's fp32 scales, from the fp32 weights
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["torch_dtype"] == "float32"
    assert any(n.startswith("--dense-dtype bf16: ") for n in cast.notes) and not any("--dense-dtype" in n for n in plain.notes)
    assert cast.output_bytes < plain.output_bytes


def test_keep_is_todays_output(fp32_llama, tmp_path):
    api.quantize(fp32_llama, tmp_path / "a", "W4A16")
    api.quantize(fp32_llama, tmp_path / "b", "W4A16", dense_dtype="keep")
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert "dense_dtype" not in json.loads((tmp_path / "a" / "ctconvert-provenance.json").read_text())["options"]  # earlier outputs keep their fingerprint


def test_upcast_and_config_keys(tmp_path):
    """bf16 -> fp32 is exact; a config with ``dtype`` (and a text_config holding it) gets the new name in each place."""
    cfg = dict(LLAMA_CONFIG, dtype="bfloat16", text_config={"torch_dtype": "bfloat16"})
    src_path = write_checkpoint(tmp_path / "bf16", llama_tensors(cfg, seed=2), cfg)
    api.quantize(src_path, tmp_path / "out", "FP8_DYNAMIC", dense_dtype="fp32")
    src, out = _tensors(src_path), _tensors(tmp_path / "out")
    assert torch.equal(out["model.embed_tokens.weight"], src["model.embed_tokens.weight"].float())
    assert out["model.embed_tokens.weight"].dtype == torch.float32
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["torch_dtype"] == c["dtype"] == c["text_config"]["torch_dtype"] == "float32"


def test_fp16_overflow_is_refused_naming_the_tensor(fp32_llama, tmp_path):
    """model.norm holds 3e38 (and 65504, which fp16 holds): fp16 would write inf, so the run stops, naming it."""
    with pytest.raises(BadInputError, match=r"--dense-dtype fp16: value 3e\+38 \(element 9\) is beyond the range of fp16") as e:
        api.quantize(fp32_llama, tmp_path / "out", "W4A16", dense_dtype="fp16")
    assert e.value.tensor == "model.norm.weight" and e.value.file.endswith(".safetensors")
    assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(main, ["quantize", str(fp32_llama), "-s", "W4A16", "-o", str(tmp_path / "cli"), "--dense-dtype", "fp16"])
    assert r.exit_code == 3 and "model.norm.weight" in r.stderr and "beyond the range of fp16" in r.stderr and "Traceback" not in r.stderr


def test_nonfinite_values_stay_nonfinite(tmp_path):
    cfg = dict(LLAMA_CONFIG, torch_dtype="float32")
    t = llama_tensors(cfg, dtype=torch.float32)
    t["model.norm.weight"][:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    path = write_checkpoint(tmp_path / "m", t, cfg)
    r = api.quantize(path, tmp_path / "out", "W4A16", dense_dtype="fp16", allow_nonfinite=True)
    got = _tensors(tmp_path / "out")["model.norm.weight"]
    assert got.dtype == torch.float16 and torch.isnan(got[0]) and got[1] == float("inf") and got[2] == -float("inf")
    assert _bits(got[3:]) == _bits(t["model.norm.weight"][3:].half())
    assert "model.norm.weight: holds non-finite values (NaN/inf); cast to F16 with its NaN/inf (--allow-non-finite)" in r.notes
    doc = api.verify(tmp_path / "out", path)  # the cast copy holds the reference's NaN/inf: a warning, not an error
    assert doc["ok"], doc["problems"]
    held = [p for p in doc["problems"] if p.get("tensor") == "model.norm.weight"]
    assert [(p["severity"], p["message"]) for p in held] == [("warning", "3 NaN/inf values, as the reference holds them (a copy --allow-non-finite made)")]
    t["model.norm.weight"][5] = float("nan")  # a NaN the output holds and the reference does not: an error
    other = write_checkpoint(tmp_path / "other", t, cfg)
    doc = api.verify(tmp_path / "out", other)
    assert not doc["ok"] and any(
        p["severity"] == "error" and p["message"] == "3 NaN/inf values" and p["tensor"] == "model.norm.weight" for p in doc["problems"]
    )


def test_cli_plan_json_inspect_and_errors(fp32_llama, tmp_path):
    run = CliRunner().invoke
    r = run(main, ["--json", "quantize", str(fp32_llama), "-s", "W4A16", "--dry-run", "--dense-dtype", "BF16", "--ignore", IGNORED])
    assert r.exit_code == 0, r.output
    rows = {t["name"]: t for t in json.loads(r.stdout)["plan"]["tensors"]}
    assert rows["model.norm.weight"]["cast"] == "fp32->bf16" and rows[f"{IGNORED}.weight"]["cast"] == "fp32->bf16"
    assert "cast" not in rows["model.layers.0.mlp.up_proj.weight"]  # quantized: not cast
    r = run(main, ["--plain", "quantize", str(fp32_llama), "-s", "W4A16", "--dry-run", "--dense-dtype", "bf16"])
    assert r.exit_code == 0 and "embedding; cast fp32->bf16" in r.stdout
    assert "note: --dense-dtype bf16: 7 tensors that are not quantized are cast to bf16" in r.stdout
    r = run(main, ["quantize", str(fp32_llama), "-s", "W4A16", "--dry-run", "--dense-dtype", "int8"])
    assert r.exit_code == 2 and "'int8' is not one of 'keep', 'bf16', 'fp16', 'fp32'" in r.stderr
    with pytest.raises(UsageError, match="unknown --dense-dtype 'int8'; choose one of keep, bf16, fp16, fp32"):
        api.quantize(fp32_llama, None, "W4A16", dry_run=True, dense_dtype="int8")

    out = tmp_path / "out"
    r = run(main, ["quantize", str(fp32_llama), "-s", "W4A16", "-o", str(out), "--dense-dtype", "bf16", "--ignore", IGNORED])
    assert r.exit_code == 0, r.output
    rep = api.inspect(out)
    assert rep["dense_cast"] == {"tensors": 8, "casts": {"fp32->bf16": 8}}
    layers = {x["module"]: x for x in rep["layers"]}
    assert layers[IGNORED]["cast"] == "fp32->bf16" and layers["lm_head"]["cast"] == "fp32->bf16" and "cast" not in layers["model.layers.1.mlp.down_proj"]
    r = run(main, ["--plain", "inspect", str(out)])
    assert "cast at conversion (--dense-dtype): 8 tensors fp32->bf16" in r.stdout and "dense, cast fp32->bf16" in r.stdout
    assert api.inspect(fp32_llama)["dense_cast"] is None

    # --refresh compares it like every other option
    r = run(main, ["quantize", str(fp32_llama), "-s", "W4A16", "-o", str(out), "--ignore", IGNORED, "--refresh"])
    assert r.exit_code == 2 and "these differ: dense_dtype: earlier 'bf16', now the default" in r.stderr
    r = run(main, ["quantize", str(fp32_llama), "-s", "W4A16", "-o", str(out), "--ignore", IGNORED, "--refresh", "--dense-dtype", "fp16"])
    assert r.exit_code == 2 and "dense_dtype: earlier 'bf16', now 'fp16'" in r.stderr
    r = run(main, ["quantize", str(fp32_llama), "-s", "W4A16", "-o", str(out), "--ignore", IGNORED, "--refresh", "--dense-dtype", "bf16"])
    assert r.exit_code == 0 and "refreshed: rewrote 0 of 1 shard" in r.stderr

    # verify --reference compares a cast tensor with the reference cast the same way (and finds a changed value)
    rep = api.verify(out, reference=fp32_llama)
    assert rep["ok"], rep["problems"]
    shard = next(out.glob("*.safetensors"))
    t = load_file(shard)
    t["model.norm.weight"][3] = t["model.norm.weight"][3] * 2
    save_file(t, shard, metadata={"format": "pt"})
    rep = api.verify(out, reference=fp32_llama)
    errors = [p for p in rep["problems"] if p["severity"] == "error"]
    assert not rep["ok"] and [p.get("tensor") for p in errors] == [None, "model.norm.weight"]
    assert errors[0]["file"] == str(shard) and "changed or damaged after it was written" in errors[0]["message"]  # the index's hash
    assert "values differ from the reference cast to BF16 (fp32->bf16, --dense-dtype)" in errors[1]["message"]


def test_batch_job_key(fp32_llama, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"jobs:\n  - {{model: {fp32_llama}, output: {tmp_path / 'a'}, scheme: W8A16, dense_dtype: bf16}}\n")
    r = CliRunner().invoke(main, ["batch", str(jobs)])
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert r.exit_code == 0 and lines[0]["status"] == "ok" and any("--dense-dtype bf16" in n for n in lines[0]["notes"])
    assert _tensors(tmp_path / "a")["model.norm.weight"].dtype == torch.bfloat16
    jobs.write_text(f"jobs:\n  - {{model: {fp32_llama}, output: {tmp_path / 'b'}, scheme: W8A16, dense_dtype: fp8}}\n")
    r = CliRunner().invoke(main, ["batch", str(jobs)])  # refused before any job runs, like a bad scheme
    assert r.exit_code == 2 and "job 0: unknown --dense-dtype 'fp8'; choose one of keep, bf16, fp16, fp32" in r.stderr
    assert [json.loads(x)["status"] for x in r.stdout.splitlines()] == ["error", "summary"]  # a refused file: its error line and the summary


def test_kernel_native_target(fp32_llama, tmp_path):
    r = api.quantize_to_target(fp32_llama, tmp_path / "m", "W4A16", "marlin", dense_dtype="bf16")
    out = _tensors(tmp_path / "m")
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16 and r.format.startswith("kernel-native (marlin")


def test_lossless_conversion_takes_no_dense_dtype(tmp_path):
    from foreign_formats import awq_checkpoint

    src, _ = awq_checkpoint(tmp_path / "awq")
    with pytest.raises(UsageError, match="converts it losslessly, which takes no --dense-dtype"):
        api.quantize(src, tmp_path / "out", "W4A16_ASYM", dense_dtype="bf16")


def test_transformers_loads_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = dict(LLAMA_CONFIG, torch_dtype="float32")
    path = write_checkpoint(tmp_path / "m", llama_tensors(cfg, dtype=torch.float32, seed=3), cfg)
    api.quantize(path, tmp_path / "q", "W8A16", dense_dtype="bf16")
    ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    dense = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"), dtype="auto").eval()  # the config's dtype
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight, dense.model.embed_tokens.weight.to(torch.bfloat16))
    with torch.no_grad():
        ref, got = dense(ids).logits, model(ids).logits
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(ref.flatten(), got.float().flatten(), dim=0) > 0.99


def test_f64_tensors_stay_f64_and_a_note_names_them(tmp_path):
    cfg = dict(LLAMA_CONFIG, torch_dtype="float32")
    t = llama_tensors(cfg, dtype=torch.float32)
    t["model.layers.0.self_attn.rotary_emb.table"] = torch.arange(6, dtype=torch.float64) / 7
    path = write_checkpoint(tmp_path / "m", t, cfg)
    r = api.quantize(path, tmp_path / "out", "W4A16", dense_dtype="bf16")
    got = _tensors(tmp_path / "out")
    assert got["model.layers.0.self_attn.rotary_emb.table"].dtype == torch.float64 and got["model.norm.weight"].dtype == torch.bfloat16
    assert _bits(got["model.layers.0.self_attn.rotary_emb.table"]) == _bits(t["model.layers.0.self_attn.rotary_emb.table"])
    assert "--dense-dtype bf16: 1 F64 tensor stays F64 (it casts F32, F16 and BF16 tensors): model.layers.0.self_attn.rotary_emb.table" in r.notes
