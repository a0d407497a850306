"""End to end through the Python API: bytes, index, config, files, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ctconvert import api
from ctconvert.errors import BadInputError, OutputError, UnsupportedError, UsageError

from conftest import LLAMA_CONFIG, cuda_params, llama_tensors, write_checkpoint
from ct_reference import ct_compress
from helpers import tree_hash

SCHEMES = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"]


def load_output(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(path / f, "pt") as h:
            for k in h.keys():
                assert index["weight_map"][k] == f
                tensors[k] = h.get_tensor(k)
    assert set(tensors) == set(index["weight_map"])
    return tensors, index


def fused_members(src: dict[str, torch.Tensor], module: str) -> list[torch.Tensor]:
    parent, _, leaf = module.rpartition(".")
    for s in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        if leaf in s:
            return [src[f"{parent}.{m}.weight"] for m in s]
    return [src[module + ".weight"]]


def bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_output_bytes_equal_compressed_tensors(tiny_llama, tmp_path, scheme):
    before = tree_hash(tiny_llama)
    out = tmp_path / "out"
    res = api.quantize(tiny_llama, out, scheme, max_shard_size="300KB")
    assert tree_hash(tiny_llama) == before, "input changed"
    src = llama_tensors(LLAMA_CONFIG)
    got, index = load_output(out)
    quantized = [n[: -len(".weight")] for n in src if ".layers." in n and n.endswith("_proj.weight")]
    assert res.quantized_modules == len(quantized) == 14
    for module in quantized:
        ref = ct_compress(src[module + ".weight"], scheme, fused_with=fused_members(src, module))
        assert module + ".weight" not in got or "weight" in ref
        for key, t in ref.items():
            name = f"{module}.{key}"
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert bytes_of(got[name]) == bytes_of(t), name
        assert {k for k in got if k.startswith(module + ".")} == {f"{module}.{k}" for k in ref}
    for name, t in src.items():
        if not any(name.startswith(m + ".") for m in quantized):
            assert bytes_of(got[name]) == bytes_of(t), name
    # shards bounded (a shard may exceed the limit only with a single tensor)
    for f in set(index["weight_map"].values()):
        n_in = sum(1 for v in index["weight_map"].values() if v == f)
        assert (out / f).stat().st_size <= 300_000 + 4096 or n_in == 1
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert len(res.shards) > 1 and res.shards[0] == f"model-00001-of-{len(res.shards):05d}.safetensors"
    # config
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["quantization_status"] == "compressed"
    assert q["ignore"] == ["lm_head"]
    assert q["sparsity_config"] == {} and q["version"].startswith("0.20")
    from compressed_tensors.quantization import preset_name_to_scheme

    group = q["config_groups"]["group_0"]
    expect = preset_name_to_scheme(scheme, ["Linear"]).model_dump()
    assert group["weights"] == expect["weights"] and group["input_activations"] == expect["input_activations"]
    assert group["format"] == q["format"] == res.format
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == LLAMA_CONFIG
    # copied files, no leftovers
    assert (out / "tokenizer_config.json").read_text() == "{}"
    assert (out / "generation_config.json").exists()
    assert not list(tmp_path.glob(".out.ctconvert-*"))


def test_nvfp4_fused_sets_share_global_scale_across_shards(tiny_llama, tmp_path):
    out = tmp_path / "o"
    api.quantize(tiny_llama, out, "nvfp4a16")
    got, _ = load_output(out)
    for layer in range(2):
        p = f"model.layers.{layer}."
        qkv = {got[p + f"self_attn.{m}.weight_global_scale"].item() for m in ("q_proj", "k_proj", "v_proj")}
        gu = {got[p + f"mlp.{m}.weight_global_scale"].item() for m in ("gate_proj", "up_proj")}
        assert len(qkv) == 1 and len(gu) == 1
        assert got[p + "self_attn.o_proj.weight_global_scale"].item() != qkv.pop()


def test_chunked_rows_give_the_same_bytes(tiny_llama, tmp_path):
    for scheme in ("NVFP4A16", "W4A16_ASYM", "FP8_BLOCK"):
        a, b = tmp_path / f"a{scheme}", tmp_path / f"b{scheme}"
        api.quantize(tiny_llama, a, scheme)
        api.quantize(tiny_llama, b, scheme, chunk_elems=1)  # row chunks of the minimum aligned size
        ta, _ = load_output(a)
        tb, _ = load_output(b)
        assert ta.keys() == tb.keys()
        assert all(bytes_of(ta[k]) == bytes_of(tb[k]) for k in ta), scheme


@pytest.mark.parametrize("head", ["nvfp4a16", "fp8"])
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head(tmp_path, head, tied):
    cfg = dict(LLAMA_CONFIG, tie_word_embeddings=tied)
    src = llama_tensors(cfg)
    ckpt = write_checkpoint(tmp_path / "m", src, cfg, shards=2)
    out = tmp_path / "o"
    res = api.quantize(ckpt, out, "W4A16", lm_head=head, lm_head_chunk_rows=100)
    got, _ = load_output(out)
    head_w = src["model.embed_tokens.weight"] if tied else src["lm_head.weight"]
    ref = ct_compress(head_w, {"nvfp4a16": "NVFP4A16", "fp8": "FP8_DYNAMIC"}[head])
    for k, t in ref.items():
        assert bytes_of(got[f"lm_head.{k}"]) == bytes_of(t), k
    assert "lm_head.weight" not in got or head == "fp8"
    assert bytes_of(got["model.embed_tokens.weight"]) == bytes_of(src["model.embed_tokens.weight"])
    cfg_out = json.loads((out / "config.json").read_text())
    q = cfg_out["quantization_config"]
    assert sorted(q["config_groups"]) == ["group_0", "lm_head"]
    assert q["config_groups"]["lm_head"]["targets"] == ["lm_head"]
    assert "lm_head" not in q["ignore"]
    assert cfg_out["tie_word_embeddings"] is False
    if tied:
        assert any("untied" in n for n in res.notes)


def test_tied_without_quantized_head_lists_lm_head_in_ignore(tmp_path):
    cfg = dict(LLAMA_CONFIG, tie_word_embeddings=True)
    ckpt = write_checkpoint(tmp_path / "m", llama_tensors(cfg), cfg)
    api.quantize(ckpt, tmp_path / "o", "FP8_DYNAMIC")
    cfg_out = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg_out["tie_word_embeddings"] is True
    assert cfg_out["quantization_config"]["ignore"] == ["lm_head"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16", "FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16_ASYM", "W8A16", "MXFP4A16", "MXFP8A16"])
def test_non_finite_weight_is_an_error_and_nothing_is_written(tmp_path, bad, scheme):
    src = llama_tensors(LLAMA_CONFIG)
    src["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    ckpt = write_checkpoint(tmp_path / "m", src, LLAMA_CONFIG, shards=2)
    with pytest.raises(BadInputError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*non-finite.*row 3, column 5"):
        api.quantize(ckpt, tmp_path / "o", scheme)
    assert not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".o.ctconvert-*"))


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16", "FP8_DYNAMIC"])
def test_the_first_non_finite_weight_in_plan_order_is_named(tmp_path, scheme, device):
    """On a GPU the NaN/inf flags are read behind events, units later: the error still names the first tensor."""
    src = llama_tensors(LLAMA_CONFIG)
    src["model.layers.0.self_attn.k_proj.weight"][2, 9] = float("nan")
    src["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
    ckpt = write_checkpoint(tmp_path / "m", src, LLAMA_CONFIG, shards=2)
    with pytest.raises(BadInputError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*1 non-finite value \(NaN; first at row 2, column 9\)"):
        api.quantize(ckpt, tmp_path / "o", scheme, device=device)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.ctconvert-*"))


def test_a_non_finite_value_of_a_1d_tensor_is_named_by_its_element(tmp_path):
    """A norm is 1-D: its first NaN is 'element 5', not 'row 5, column 0' (found by a new-user run)."""
    src = llama_tensors(LLAMA_CONFIG)
    src["model.layers.1.input_layernorm.weight"][5] = float("nan")
    ckpt = write_checkpoint(tmp_path / "m", src, LLAMA_CONFIG)
    with pytest.raises(BadInputError, match=r"input_layernorm\.weight.*1 non-finite value \(NaN; first at element 5\)"):
        api.quantize(ckpt, tmp_path / "o", "W4A16")


def test_group_size_must_divide(tmp_path):
    src = llama_tensors(LLAMA_CONFIG)
    src["model.layers.0.mlp.down_proj.weight"] = torch.randn(256, 500).to(torch.bfloat16)
    ckpt = write_checkpoint(tmp_path / "m", src, LLAMA_CONFIG)
    with pytest.raises(UnsupportedError, match=r"down_proj.*K=500 is not a multiple of the group size 128"):
        api.quantize(ckpt, tmp_path / "o", "W4A16")
    assert not (tmp_path / "o").exists()
    res = api.quantize(ckpt, tmp_path / "o", "W4A16", skip_incompatible=True)
    assert "model.layers.0.mlp.down_proj" in res.ignore and res.notes
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert "model.layers.0.mlp.down_proj" in cfg["quantization_config"]["ignore"]
    # FP8_BLOCK needs whole 128x128 blocks: transformers and vLLM cannot load partial ones
    with pytest.raises(UnsupportedError, match=r"K=500 is not a multiple of the block width 128 of FP8_BLOCK"):
        api.quantize(ckpt, tmp_path / "o2", "FP8_BLOCK")
    res = api.quantize(ckpt, tmp_path / "o2", "FP8_BLOCK", skip_incompatible=True)
    assert "model.layers.0.mlp.down_proj" in res.ignore


@pytest.mark.parametrize("scheme", ["MXFP4", "MXFP8A16", "MXFP8"])
def test_mx_schemes_need_k_multiple_of_32(tmp_path, scheme):
    src = llama_tensors(LLAMA_CONFIG)
    src["model.layers.0.mlp.down_proj.weight"] = torch.randn(256, 500).to(torch.bfloat16)  # 500 = 15 * 32 + 20
    ckpt = write_checkpoint(tmp_path / "m", src, LLAMA_CONFIG)
    with pytest.raises(UnsupportedError, match=r"down_proj.*K=500 is not a multiple of the group size 32"):
        api.quantize(ckpt, tmp_path / "o", scheme)
    assert not (tmp_path / "o").exists()
    res = api.quantize(ckpt, tmp_path / "o", scheme, skip_incompatible=True)
    assert "model.layers.0.mlp.down_proj" in res.ignore and res.quantized_modules == 13


def test_output_exists_and_overwrite(tiny_llama, tmp_path):
    """--overwrite replaces an empty folder or an earlier ctconvert output, and refuses any other folder."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(OutputError, match="exists"):
        api.quantize(tiny_llama, out, "W8A16")
    with pytest.raises(OutputError, match="replaces only an earlier ctconvert output or an empty folder"):
        api.quantize(tiny_llama, out, "W8A16", overwrite=True)
    assert (out / "keep.txt").read_text() == "x" and not (out / "config.json").exists()
    (out / "keep.txt").unlink()
    api.quantize(tiny_llama, out, "W8A16", overwrite=True)  # empty: replaced
    assert (out / "config.json").exists()
    (out / "stray.txt").write_text("y")  # an earlier ctconvert output holding a file it did not write: refused, named
    with pytest.raises(OutputError, match=r"would delete 1 file that ctconvert did not write \(stray.txt\)"):
        api.quantize(tiny_llama, out, "W4A16", overwrite=True)
    assert (out / "stray.txt").read_text() == "y"
    (out / "stray.txt").unlink()  # only what ctconvert wrote: replaced
    api.quantize(tiny_llama, out, "W4A16", overwrite=True)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"


def test_never_writes_into_the_input(tiny_llama):
    with pytest.raises(UsageError, match="overlaps the input"):
        api.quantize(tiny_llama, tiny_llama / "sub", "W8A16")
    with pytest.raises(UsageError, match="overlaps the input"):
        api.quantize(tiny_llama, tiny_llama, "W8A16", overwrite=True)


def test_dry_run_writes_nothing(tiny_llama, tmp_path):
    res = api.quantize(tiny_llama, tmp_path / "o", "nvfp4a16", dry_run=True)
    assert not (tmp_path / "o").exists()
    d = res.to_dict()
    actions = {r["name"]: r["action"] for r in d["plan"]["tensors"]}
    assert actions["lm_head.weight"] == "ignore"
    assert actions["model.embed_tokens.weight"] == "copy"
    assert actions["model.layers.0.self_attn.k_proj.weight"] == "quantize"
    fused = {r["name"]: r.get("fused_set") for r in d["plan"]["tensors"]}
    assert fused["model.layers.1.mlp.up_proj.weight"] == "model.layers.1.mlp.{gate_proj,up_proj}"


def test_unknown_scheme(tiny_llama, tmp_path):
    with pytest.raises(UsageError, match="unknown scheme 'W3A17'"):
        api.quantize(tiny_llama, tmp_path / "o", "W3A17")


def test_already_quantized_input_is_requantized_not_planned_raw(tiny_llama, tmp_path):
    from ctconvert.checkpoint.reader import open_checkpoint
    from ctconvert.plan.planner import make_plan

    api.quantize(tiny_llama, tmp_path / "q", "W8A16")
    with pytest.raises(UnsupportedError, match="already quantized"):  # the planner plans dense tensors only
        make_plan(open_checkpoint(tmp_path / "q"), "W4A16")
    res = api.quantize(tmp_path / "q", tmp_path / "q2", "W4A16")  # the command plans the dequantized view
    assert any(n.startswith("requantize:") for n in res.notes)


def test_fp16_and_fp32_inputs(tmp_path):
    for dtype in (torch.float16, torch.float32):
        src = llama_tensors(LLAMA_CONFIG, dtype=dtype)
        ckpt = write_checkpoint(tmp_path / f"m{dtype}", src, LLAMA_CONFIG)
        out = tmp_path / f"o{dtype}"
        api.quantize(ckpt, out, "W4A16")
        got, _ = load_output(out)
        w = "model.layers.0.mlp.up_proj"
        ref = ct_compress(src[w + ".weight"], "W4A16")
        assert got[w + ".weight_scale"].dtype == dtype
        assert bytes_of(got[w + ".weight_packed"]) == bytes_of(ref["weight_packed"])


def test_several_workers_write_the_same_bytes(tiny_llama, tmp_path):
    """--device with several devices deals units to one executor each; the output is identical."""
    for scheme in ("NVFP4A16", "W4A16_ASYM"):
        a, b = tmp_path / f"a{scheme}", tmp_path / f"b{scheme}"
        api.quantize(tiny_llama, a, scheme, max_shard_size="300KB")
        api.quantize(tiny_llama, b, scheme, max_shard_size="300KB", device="cpu,cpu,cpu")
        for f in sorted(p.name for p in a.iterdir()):
            assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_device_spec_errors():
    from ctconvert.pipeline.devices import resolve_devices

    assert [str(d) for d in resolve_devices("cpu")] == ["cpu"]
    with pytest.raises(UsageError, match="CUDA"):
        resolve_devices("all" if not torch.cuda.is_available() else "cuda:99")
    with pytest.raises(UsageError, match="unknown device"):
        resolve_devices("tpu:0,cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_all_gpus_write_the_same_bytes_as_the_cpu(tiny_llama, tmp_path):
    for scheme in ("NVFP4A16", "W4A16", "FP8_BLOCK"):
        a, b = tmp_path / f"a{scheme}", tmp_path / f"b{scheme}"
        api.quantize(tiny_llama, a, scheme, device="cpu")
        res = api.quantize(tiny_llama, b, scheme, device="all")
        assert res.device.count("cuda") >= 2
        for f in sorted(p.name for p in a.iterdir()):
            assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_dry_run_says_where_the_real_run_would_stop(tmp_path):
    t = {
        "model.layers.0.mlp.down_proj.weight": torch.zeros(256, 320, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(320, 256, dtype=torch.bfloat16),
    }
    m = write_checkpoint(tmp_path / "m", t, {"architectures": ["LlamaForCausalLM"]})
    res = api.quantize(m, None, "W4A16", dry_run=True)
    assert isinstance(res.error, UnsupportedError) and "K=320" in str(res.error)
    row = next(r for r in res.plan.rows if r.name == "model.layers.0.mlp.down_proj.weight")
    assert "the run stops here" in row.reason and "skipped" not in row.reason
    assert any("the run stops here unless --skip-incompatible" in n for n in res.notes)
    res = api.quantize(m, None, "W4A16", dry_run=True, skip_incompatible=True)
    assert res.error is None and any("kept dense and listed in ignore" in n for n in res.notes)


def test_an_opened_source_is_converted_as_its_folder(tiny_llama, tmp_path):
    """commands.quantize takes an opened Source (api opens the input once) and writes what the folder gives."""
    from ctconvert.checkpoint.reader import open_checkpoint
    from ctconvert.commands.quantize import quantize
    from ctconvert.pipeline.options import QuantizeOptions
    from ctconvert.sources import open_source

    o = QuantizeOptions(device="cpu")
    a = quantize(tiny_llama, tmp_path / "a", "W4A16", o)
    b = quantize(open_source(open_checkpoint(tiny_llama, strict=True)), tmp_path / "b", "W4A16", o)
    assert a.notes == b.notes and a.output_bytes == b.output_bytes
    assert tree_hash(tmp_path / "a") == tree_hash(tmp_path / "b")
