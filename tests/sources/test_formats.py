"""Quantized inputs read as dense weights, and requantized: every source format against its reference.

- compressed-tensors sources (every format ctconvert writes): requantizing equals quantizing the
  checkpoint compressed-tensors' own decompress gives, byte for byte;
- Hugging Face FP8 block (DeepSeek-V3 layout: MLA, MoE experts, shared experts, router, MTP layer):
  the dequantized weights equal compressed-tensors' ``FP8BlockDequantizer`` bit for bit, and
  requantizing equals quantizing the checkpoint that converter writes;
- AutoAWQ, GPTQ (v1/v2, sym/asym, act-order) and ModelOpt NVFP4: the dequantized weights equal the
  independent reference dequantizers of ``tests/foreign_formats.py`` bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import foreign_formats as ff
import pytest
import torch
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from safetensors.torch import load_file, save_file

from ctconvert import api
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import read_rows, read_tensor
from ctconvert.errors import BadInputError, UnsupportedError
from ctconvert.sources import open_source

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint
from helpers import bitwise_equal


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_outputs(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert bitwise_equal(ta[k], tb[k]), k
    qa = json.loads((a / "config.json").read_text())["quantization_config"]
    qb = json.loads((b / "config.json").read_text())["quantization_config"]
    assert qa == qb


@pytest.fixture(scope="module")
def dense_llama(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("src") / "dense", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG, shards=2)


@pytest.mark.parametrize("source_scheme", ["FP8_BLOCK", "FP8_DYNAMIC", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16", "MXFP8A16"])
def test_requantize_compressed_tensors_equals_quantize_of_decompressed(dense_llama, tmp_path, source_scheme):
    src = tmp_path / "src"
    api.quantize(dense_llama, src, source_scheme)
    target = "W4A16" if source_scheme.startswith("NVFP4") else "NVFP4A16"
    res = api.quantize(src, tmp_path / "req", target)
    api.decompress(src, tmp_path / "dq")  # compressed-tensors' decompress math (tests/formats/test_dequant.py)
    api.quantize(tmp_path / "dq", tmp_path / "ref", target)
    _same_outputs(tmp_path / "req", tmp_path / "ref")
    assert any(n.startswith("requantize:") for n in res.notes)
    assert not (tmp_path / "req" / "hf_quant_config.json").exists()
    report = api.verify(tmp_path / "req", reference=src)  # measured against the dequantized source
    assert report["ok"], report["problems"]
    assert len(report["tensors"]) == res.quantized_modules > 0


@pytest.mark.parametrize("source_scheme", ["W4A16", "NVFP4A16", "FP8_DYNAMIC"])
def test_requantize_keeps_the_biases_of_quantized_modules(tmp_path, source_scheme):
    """A new user's find: the biases of the source's quantized Linear layers were dropped (the reader took every
    tensor of a quantized module as its own). They pass through as stored, and the output equals quantizing
    the decompressed source, biases included."""
    cfg = dict(LLAMA_CONFIG, attention_bias=True)
    t = llama_tensors(cfg)
    g = torch.Generator().manual_seed(5)
    for layer in range(cfg["num_hidden_layers"]):
        for proj, n in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128), ("o_proj", 256)):
            t[f"model.layers.{layer}.self_attn.{proj}.bias"] = torch.randn(n, generator=g).to(torch.bfloat16)
    dense = write_checkpoint(tmp_path / "dense", t, cfg, shards=2)
    src = tmp_path / "src"
    api.quantize(dense, src, source_scheme)
    biases = {k for k in t if k.endswith(".bias")}
    assert biases <= _tensors(src).keys()
    target = "FP8_DYNAMIC" if source_scheme != "FP8_DYNAMIC" else "W4A16"
    api.quantize(src, tmp_path / "req", target)
    got = _tensors(tmp_path / "req")
    assert biases <= got.keys() and all(bitwise_equal(got[k], t[k]) for k in biases)
    api.decompress(src, tmp_path / "dq")
    api.quantize(tmp_path / "dq", tmp_path / "ref", target)
    _same_outputs(tmp_path / "req", tmp_path / "ref")
    report = api.verify(tmp_path / "req", reference=src)
    assert report["ok"], report["problems"]
    if source_scheme == "W4A16":  # and a Marlin round trip of the source verifies against it (it said "bias: not in the reference")
        api.repack(src, tmp_path / "marlin", "marlin")
        api.repack(tmp_path / "marlin", tmp_path / "back", "compressed-tensors")
        back = api.verify(tmp_path / "back", reference=src)
        assert back["ok"], back["problems"]


def test_requantize_keeps_the_source_dense_linears_dense_and_says_so(dense_llama, tmp_path):
    src = tmp_path / "src"
    api.quantize(dense_llama, src, "W4A16", ignore=["model.layers.1.mlp.down_proj"])
    plan = api.quantize(src, None, "FP8_DYNAMIC", dry_run=True).plan
    row = next(r for r in plan.rows if r.name == "model.layers.1.mlp.down_proj.weight")
    assert (row.action, row.reason, row.source) == ("ignore", "dense in the source (its ignore carries over)", None)
    q = next(r for r in plan.rows if r.name == "model.layers.0.mlp.down_proj.weight")
    assert q.action == "quantize" and q.source.startswith("compressed-tensors pack-quantized (int4 group 128")
    assert "model.layers.1.mlp.down_proj" in plan.ignore
    assert any("lossy twice" in n for n in plan.notes)  # int4 -> FP8: more bits cannot restore the lost precision
    for scheme in ("NVFP4A16", "W4A16_ASYM"):  # int4 -> another 4-bit grid: rounded again too (found by a new-user run)
        notes = api.quantize(src, None, scheme, dry_run=True).plan.notes
        assert any("rounds their dequantized values again" in n and "lossy twice" in n for n in notes), notes
    api.quantize(src, tmp_path / "out", "FP8_DYNAMIC")
    out = _tensors(tmp_path / "out")
    assert out["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.down_proj.weight_scale" not in out


def test_output_records_what_it_was_derived_from(dense_llama, tmp_path):
    src = tmp_path / "src"
    api.quantize(dense_llama, src, "FP8_BLOCK")
    api.quantize(src, tmp_path / "out", "NVFP4A16")
    prov = json.loads((tmp_path / "out" / "ctconvert-provenance.json").read_text())
    assert prov["derived_from"]["quant_method"] == "compressed-tensors"
    assert prov["derived_from"]["source_format"] == "compressed-tensors"
    entry = prov["tensors"]["model.layers.0.mlp.down_proj.weight_packed"][0]
    assert entry["tensor"] == "model.layers.0.mlp.down_proj.weight"
    assert set(entry["dequantized_from"]["tensors"]) == {"model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale"}
    report = api.inspect(tmp_path / "out")
    assert report["derived_from"]["path"] == str(src)
    dense_prov = json.loads((src / "ctconvert-provenance.json").read_text())
    assert "derived_from" not in dense_prov


# -- Hugging Face FP8 block (DeepSeek-V3 layout) ---------------------------------------------------


def _ct_fp8_dequantized(src, dst):
    """The dense checkpoint compressed-tensors' FP8BlockDequantizer makes of ``src`` (the reference)."""
    t = load_file(src / "model.safetensors")
    conv = FP8BlockDequantizer.from_pretrained(str(src))
    t = conv.process(dict(t))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in t.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, t


def test_fp8_block_dequantizes_as_compressed_tensors_converter(tmp_path):
    src = ff.deepseek_checkpoint(tmp_path / "ds")
    _, ref = _ct_fp8_dequantized(src, tmp_path / "ref")
    s = open_source(open_checkpoint(src))
    assert s.kind == "fp8-block"
    assert len(s.modules) == sum(1 for n in load_file(src / "model.safetensors") if n.endswith("weight_scale_inv"))
    assert "model.layers.1.mlp.experts.1.down_proj" in s.modules and "model.layers.2.mlp.shared_experts.up_proj" in s.modules  # MoE, MTP
    assert set(s.view.tensors) == set(ref)
    for name, info in s.view.tensors.items():
        assert bitwise_equal(read_tensor(info), ref[name]), name
    info = s.view.tensors["model.layers.0.self_attn.q_a_proj.weight"]  # 192 rows: a partial block
    assert bitwise_equal(read_rows(info, 130, 191), ref["model.layers.0.self_attn.q_a_proj.weight"][130:191])


def test_fp8_block_requantize_equals_quantize_of_the_reference_dequantization(tmp_path):
    src = ff.deepseek_checkpoint(tmp_path / "ds")
    ref_dense, _ = _ct_fp8_dequantized(src, tmp_path / "dense")
    res = api.quantize(src, tmp_path / "req", "NVFP4A16", chunk_elems=40_000)  # several row chunks per module
    # the Linear layers that are bf16 in the FP8 source (MTP eh_proj and shared head) stay dense (the source's ignore carries over)
    api.quantize(ref_dense, tmp_path / "ref", "NVFP4A16", ignore=["model.layers.2.eh_proj", "model.layers.2.shared_head.head"])
    ta, tb = _tensors(tmp_path / "req"), _tensors(tmp_path / "ref")
    assert ta.keys() == tb.keys()
    assert all(bitwise_equal(ta[k], tb[k]) for k in ta)
    qa = json.loads((tmp_path / "req" / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "ref" / "config.json").read_text())["quantization_config"]
    assert set(qb["ignore"]) == set(qa["ignore"])
    assert {"model.layers.2.eh_proj", "model.layers.2.shared_head.head", "model.layers.1.mlp.gate"} <= set(qa["ignore"])
    assert qa["config_groups"] == qb["config_groups"]
    assert any("fp8 block 128x128" in n for n in res.notes)
    assert api.verify(tmp_path / "req", reference=src)["ok"]
    assert api.verify(tmp_path / "req", reference=ref_dense)["ok"]


def test_fp8_block_to_bf16_is_exact_and_static_input_scales_are_dropped(tmp_path):
    src = ff.deepseek_checkpoint(tmp_path / "ds", static=True)
    res = api.quantize(src, None, "FP8_BLOCK", dry_run=True)
    drops = [r for r in res.plan.rows if r.action == "drop"]
    assert drops and all(r.name.endswith(".input_scale") for r in drops)
    assert len(drops) == sum(1 for r in res.plan.rows if r.source)
    _, ref = _ct_fp8_dequantized(ff.deepseek_checkpoint(tmp_path / "ds2"), tmp_path / "ref")
    s = open_source(open_checkpoint(src))
    w = s.view.tensors["model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert w.dtype == "BF16" and bitwise_equal(read_tensor(w), ref["model.layers.1.mlp.experts.0.gate_proj.weight"])


def _edit(src, drop=(), replace=None, config=None):
    t = load_file(src / "model.safetensors")
    for n in drop:
        del t[n]
    t.update(replace or {})
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "break_it, err, words",
    [
        (lambda s: _edit(s, drop=["model.layers.0.mlp.down_proj.weight_scale_inv"]), BadInputError, "without weight_scale_inv (scales missing)"),
        (
            lambda s: _edit(s, replace={"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 2)}),
            BadInputError,
            "shapes inconsistent",
        ),
        (lambda s: _edit(s, config={"quant_method": "exl2"}), UnsupportedError, "unknown quant_method 'exl2'"),
        (lambda s: _edit(s, config={"weight_block_size": None}), UnsupportedError, "weight_block_size"),
    ],
    ids=["scales-missing", "shape", "unknown-method", "no-block"],
)
def test_fp8_block_bad_inputs_are_one_line_errors_and_write_nothing(tmp_path, break_it, err, words):
    src = ff.deepseek_checkpoint(tmp_path / "ds")
    break_it(src)
    with pytest.raises(err, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        api.quantize(src, tmp_path / "out", "W4A16")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


# -- AutoAWQ, GPTQ, ModelOpt: dequantized as their references -----------------------------------------


def _view_equals(src, refs):
    s = open_source(open_checkpoint(src))
    assert set(s.modules) == set(refs)
    for mod, ref in refs.items():
        got = read_tensor(s.view.tensors[mod + ".weight"])
        assert bitwise_equal(got, ref), mod
    return s


@pytest.mark.parametrize("group", [128, 64])
def test_awq_dequantizes_as_autoawq(tmp_path, group):
    src, refs = ff.awq_checkpoint(tmp_path / "awq", group=group, in_config=group == 128)
    _view_equals(src, refs)


@pytest.mark.parametrize("kw", [{}, {"bits": 8}, {"sym": False}, {"act_order": True}, {"v1": False, "sym": False}, {"group": 64, "act_order": True}], ids=str)
def test_gptq_dequantizes_as_autogptq(tmp_path, kw):
    src, refs = ff.gptq_checkpoint(tmp_path / "gptq", **kw)
    _view_equals(src, refs)


def test_gptq_act_order_requantizes_with_a_note(tmp_path):
    src, _ = ff.gptq_checkpoint(tmp_path / "gptq", act_order=True)
    res = api.quantize(src, tmp_path / "out", "W4A16")
    assert any("not converted losslessly" in n and "act-order" in n for n in res.notes)
    assert api.verify(tmp_path / "out", reference=src)["ok"]


def test_modelopt_nvfp4_dequantizes_as_modelopt(tmp_path):
    src, refs = ff.modelopt_checkpoint(tmp_path / "mo", in_config=False)
    s = _view_equals(src, refs)
    assert s.config_file.name == "hf_quant_config.json"
    res = api.quantize(src, tmp_path / "out", "W4A16")
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    assert sorted(r.name for r in res.plan.rows if r.action == "drop") == sorted(f"{m}.input_scale" for m in refs)
    assert api.verify(tmp_path / "out", reference=src)["ok"]


def test_cli_dry_run_shows_the_source_format_and_drops(tmp_path):
    import subprocess
    import sys

    src = ff.deepseek_checkpoint(tmp_path / "ds", static=True)
    import os

    env = {**os.environ, "COLUMNS": "300"}  # wide enough that no plan column is dropped
    r = subprocess.run(
        [sys.executable, "-m", "ctconvert", "quantize", str(src), "--scheme", "FP8_DYNAMIC", "--dry-run"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "source" in r.stdout and "fp8 block 128x128" in r.stdout and "drop" in r.stdout and "dropped" in r.stdout
    cmd = [sys.executable, "-m", "ctconvert", "--json", "quantize", str(src), "--scheme", "FP8_DYNAMIC", "--dry-run"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = {t["name"]: t for t in json.loads(r.stdout)["plan"]["tensors"]}
    assert rows["model.layers.2.self_attn.o_proj.weight"]["source"] == "fp8 block 128x128 (weight_scale_inv)"
    assert rows["model.layers.2.self_attn.o_proj.input_scale"]["action"] == "drop"
    assert "source" not in rows["model.norm.weight"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"))])
def test_requantize_on_each_device_and_refresh(tmp_path, device):
    src = ff.deepseek_checkpoint(tmp_path / "ds")
    api.quantize(src, tmp_path / "cpu", "FP8_DYNAMIC", device="cpu")
    api.quantize(src, tmp_path / "out", "FP8_DYNAMIC", device=device)
    _same_outputs(tmp_path / "cpu", tmp_path / "out")
    res = api.quantize(src, tmp_path / "out", "FP8_DYNAMIC", device=device, refresh=True)  # source unchanged: nothing rewritten
    assert res.rewritten_shards == []


_LLMC = Path(__file__).resolve().parent.parent / "data" / "requantize" / "llmc_reference.json"


def _sha(t: torch.Tensor) -> str:
    import hashlib

    t = t.contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


#: sets vLLM fuses (one global scale per fused layer, docs/compressed-tensors-format.md §9.1) that llm-compressor
#: 0.14's model-free rules (``microscale.py``: ``mlp.gate_proj``/``up_proj``, ``wq_a``/``wkv_a_with_mqa``) miss
_LLMC_UNFUSED = re.compile(r"\.(mlp\.(experts\.\d+|shared_experts)\.(gate|up)_proj|self_attn\.(q_a_proj|kv_a_proj_with_mqa))\.")


@pytest.mark.parametrize("case", sorted(json.loads(_LLMC.read_text())["cases"]))
def test_requantize_equals_llm_compressor_model_free_ptq(tmp_path, case):
    """llm-compressor 0.14 ``model_free_ptq`` with compressed-tensors' ``FP8BlockDequantizer`` on the same FP8 block
    source (``scripts/llmc_requantize_reference.py`` recorded the sha256 of every tensor it wrote): the same bytes,
    an FP8 -0 as 0x80 included (dequantized FP8 sources hold -0), but for one known difference, checked: the NVFP4
    global scale of fused sets its rules do not fuse (ctconvert shares the set's smallest, i.e. the one of the
    largest absmax, as vLLM needs)."""
    ref = json.loads(_LLMC.read_text())["cases"][case]
    scheme = case.rpartition("/")[2]
    src = ff.deepseek_checkpoint(tmp_path / "ds", seed=0, partial=False)
    got_src = {k: _sha(v) for k, v in load_file(src / "model.safetensors").items()}
    assert got_src == ref["source"], "the test built another source than the reference run (torch RNG changed?)"
    api.quantize(src, tmp_path / "out", scheme, quantize_mtp=True)  # model_free_ptq quantizes the MTP layer too (ctconvert keeps it dense by default)
    out = _tensors(tmp_path / "out")
    assert out.keys() == ref["output"].keys()
    unfused = {k.rpartition(".")[0] for k in out if _LLMC_UNFUSED.search(k)}
    for k, t in out.items():
        mod = k.rpartition(".")[0]
        if mod in unfused and scheme == "NVFP4A16":
            continue
        assert _sha(t) == ref["output"][k], k
    if scheme == "NVFP4A16":
        sets: dict[str, list[str]] = {}
        for mod in unfused:
            parent, _, leaf = mod.rpartition(".")
            sets.setdefault(parent + ("/mla" if leaf.endswith("a_proj") or leaf.endswith("mqa") else "/mlp"), []).append(mod)
        for members in sets.values():
            theirs = {m: ref["global_scales"][m + ".weight_global_scale"] for m in members}
            shared = min(theirs.values())
            for m in members:
                assert float(out[m + ".weight_global_scale"]) == shared, m
                if theirs[m] == shared:  # the member whose own global scale is the set's: the same bytes
                    assert _sha(out[m + ".weight_packed"]) == ref["output"][m + ".weight_packed"], m


def test_decompress_reads_every_source(tmp_path):
    src = ff.deepseek_checkpoint(tmp_path / "ds")
    _, ref = _ct_fp8_dequantized(src, tmp_path / "ref")
    api.decompress(src, tmp_path / "dense")  # bf16 from FP8 block: exact
    got = _tensors(tmp_path / "dense")
    assert got.keys() == ref.keys()
    assert all(bitwise_equal(got[k], ref[k]) for k in ref)  # other tensors as stored (the F32 router bias stays F32)
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    awq, refs = ff.awq_checkpoint(tmp_path / "awq", in_config=False)
    api.decompress(awq, tmp_path / "awq-dense", dtype="fp16")
    got = _tensors(tmp_path / "awq-dense")
    assert all(bitwise_equal(got[m + ".weight"], r) for m, r in refs.items())
    assert not (tmp_path / "awq-dense" / "quant_config.json").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))])
@pytest.mark.parametrize("part", ["weight_scale_inv", "weight"])
def test_a_non_finite_stored_tensor_is_named_not_the_weight_made_from_it(tmp_path, part, device):
    """A NaN in an FP8 source's ``weight_scale_inv`` names that tensor (the stored E4M3 weight is finite); a NaN byte
    in the E4M3 weight names the weight, said to be its stored values. Nothing is written."""
    src = ff.deepseek_checkpoint(tmp_path / "ds")
    t = load_file(src / "model.safetensors")
    name = f"model.layers.0.mlp.down_proj.{part}"
    x = t[name].clone()
    if part == "weight":
        x.view(torch.uint8).reshape(-1)[5] = 0x7F  # E4M3 NaN
        want = rf"'{name}': weight holds 1 non-finite value \(NaN; first at row 0, column 5\) in its stored F8_E4M3 values"
    else:
        x.reshape(-1)[1] = float("nan")
        want = rf"'{name}': stored tensor holds 1 non-finite value \(NaN; first at row 0, column 1\): model\.layers\.0\.mlp\.down_proj\.weight is dequantized"
    _edit(src, replace={name: x})
    with pytest.raises(BadInputError, match=want) as e:
        api.quantize(src, tmp_path / "out", "NVFP4A16", device=device)
    assert "\n" not in str(e.value) and str(src / "model.safetensors") in str(e.value)
    assert not (tmp_path / "out").exists()
