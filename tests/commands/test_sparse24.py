"""quantize --sparsity 2:4 end to end: sparse-24-bitmask and marlin-24 checkpoints as compressed-tensors 0.14 writes them,
read back by decompress / inspect / verify; the 2:4 kernel layouts (repack, quantize --target) and their inverses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ctconvert import api
from ctconvert.cli import main
from ctconvert.errors import BadInputError, UnsupportedError, UsageError
from ctconvert.formats import FORMATS, CompressionFormat, WeightArgs
from ctconvert.formats.sparse24 import marlin24_quantize, prune24, sparse24_format
from ctconvert.layouts.marlin24 import marlin24_pack

from conftest import LLAMA_CONFIG, cuda_params, llama_tensors, write_checkpoint
from helpers import bitwise_equal

REF = Path(__file__).resolve().parents[1] / "data" / "sparse24_ct014.safetensors"
_INNER = {
    "DENSE": (None, {}),
    "FP8_DYNAMIC": (CompressionFormat.FLOAT_QUANTIZED, {"num_bits": 8, "type": "float", "strategy": "channel"}),
    "W8A8": (CompressionFormat.INT_QUANTIZED, {"num_bits": 8, "type": "int", "strategy": "channel"}),
}


#: one decoder layer is enough: every Linear shape of the tiny Llama, half the work
SMALL = {**LLAMA_CONFIG, "num_hidden_layers": 1}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("sparse24") / "small", llama_tensors(SMALL), SMALL)


@pytest.fixture(scope="module")
def sparse_outputs(small, tmp_path_factory):
    """``scheme -> output folder`` of ``quantize --sparsity 2:4`` on the CPU, made once for the module."""
    made: dict[str, Path] = {}

    def get(scheme: str) -> Path:
        if scheme not in made:
            made[scheme] = tmp_path_factory.mktemp(scheme) / "q"
            api.quantize(small, made[scheme], scheme, sparsity="2:4", device="cpu")
        return made[scheme]

    return get


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def ct014_config(scheme: str) -> dict:
    """The quantization_config compressed-tensors 0.14 wrote for ``scheme`` in the reference data (first such case)."""
    with safe_open(REF, "pt") as f:
        meta = f.metadata()
        for i in range(json.loads(meta["file"])["num_cases"]):
            p = json.loads(meta[f"case{i}"])
            if (p["scheme"] or "DENSE") == scheme:
                return p["quantization_config"]
    raise AssertionError(scheme)


def linear_modules(src: dict) -> list[str]:
    return sorted(n[: -len(".weight")] for n, t in src.items() if ".layers." in n and n.endswith("_proj.weight"))


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("scheme", ["DENSE", "FP8_DYNAMIC", "W8A8"])
def test_sparse24_bitmask_checkpoint(small, sparse_outputs, tmp_path, scheme, device):
    if device == "cpu":
        out = sparse_outputs(scheme)
    else:
        out = tmp_path / "q"
        res = api.quantize(small, out, scheme, sparsity="2:4", device=device)
        assert any("vLLM <= 0.18" in n for n in res.notes)
        cpu = tensors(sparse_outputs(scheme))
        assert all(bitwise_equal(t, cpu[n]) for n, t in tensors(out).items())  # the same bytes on the GPU
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    ref = ct014_config(scheme)
    assert cfg["sparsity_config"] == {**ref["sparsity_config"], "ignore": ["lm_head"]}
    if scheme == "DENSE":
        assert sorted(cfg) == sorted(ref)  # quant_method, sparsity_config, transform_config, version
    else:
        assert cfg["config_groups"] == ref["config_groups"] and cfg["format"] == ref["format"]
        assert sorted(cfg) == sorted(ref) and cfg["quantization_status"] == "compressed"
    src, got = tensors(small), tensors(out)
    fmt, w = _INNER[scheme]
    sp, args = sparse24_format(FORMATS[fmt] if fmt else None), WeightArgs.from_dict(w)
    for mod in linear_modules(src):
        wt = src[mod + ".weight"]
        exp = {**sp.quantize(wt, args, impl="torch"), "shape": torch.tensor([[wt.shape[0]], [wt.shape[1]]])}
        assert sorted(p for n, p in (k.rsplit(".", 1) for k in got) if n == mod) == sorted(exp), mod
        for p, t in exp.items():
            assert bitwise_equal(got[f"{mod}.{p}"], t), (mod, p)
    # read back
    rep = api.verify(out, reference=small)
    assert rep["ok"], rep["problems"]
    assert [p["severity"] for p in rep["problems"] if "pruned 2:4" in p["message"]] == ["note"]  # said once
    assert {r.get("against") for r in rep["tensors"]} == {"2:4-pruned reference"}
    layers = {r["module"]: r for r in api.inspect(out)["layers"]}
    assert layers["model.layers.0.mlp.down_proj"]["format"].startswith("sparse-24-bitmask") and "2:4" in layers["model.layers.0.mlp.down_proj"]["scheme"]
    dec = tmp_path / "d"
    api.decompress(out, dec)
    back = tensors(dec)
    for mod in linear_modules(src):
        pruned = prune24(src[mod + ".weight"])
        want = pruned if scheme == "DENSE" else FORMATS[fmt].dequantize(FORMATS[fmt].quantize(pruned, args, impl="torch"), args).to(pruned.dtype)
        assert torch.equal(back[mod + ".weight"], want), mod


def test_already_24_input_is_kept(tmp_path):
    t = llama_tensors(SMALL)
    t = {n: prune24(v) if n.endswith("_proj.weight") else v for n, v in t.items()}
    src = write_checkpoint(tmp_path / "src", t, SMALL)
    api.quantize(src, tmp_path / "q", "DENSE", sparsity="2:4")
    api.decompress(tmp_path / "q", tmp_path / "d")
    back = tensors(tmp_path / "d")
    for n, v in t.items():
        assert torch.equal(back[n], v), n  # no second pruning: the 2:4 weights come back as they were (by value)


def test_marlin24_checkpoint(small, tmp_path):
    out = tmp_path / "m"
    res = api.quantize_to_target(small, out, "W4A16", "marlin-24", sparsity="2:4")
    assert res.format == "marlin-24" and any("vLLM <= 0.15" in n for n in res.notes)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    ref = ct014_config("W4A16")
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "marlin-24"
    assert cfg["config_groups"] == ref["config_groups"]
    assert cfg["sparsity_config"] == {**ref["sparsity_config"], "ignore": ["lm_head"]}
    src, got = tensors(small), tensors(out)
    for mod in linear_modules(src):
        q = marlin24_quantize(src[mod + ".weight"], 128)
        exp = marlin24_pack(q["weight"], q["weight_scale"], 128)
        assert sorted(p for n, p in (k.rsplit(".", 1) for k in got) if n == mod) == sorted(exp), mod  # no weight_shape, as CT 0.14
        for p, t in exp.items():
            assert bitwise_equal(got[f"{mod}.{p}"], t), (mod, p)
    rep = api.verify(out, reference=small)
    assert rep["ok"], rep["problems"]
    api.decompress(out, tmp_path / "d")
    back = tensors(tmp_path / "d")["model.layers.0.mlp.down_proj.weight"]
    q = marlin24_quantize(src["model.layers.0.mlp.down_proj.weight"], 128)
    assert torch.equal(back, (q["weight"].float() * q["weight_scale"].float().repeat_interleave(128, 1)).to(torch.float16).to(back.dtype))


@pytest.mark.parametrize(("scheme", "target"), [("DENSE", "cutlass-2of4"), ("FP8_DYNAMIC", "cutlass-2of4"), ("W8A8", "cutlass-2of4-sm80")])
def test_cutlass_2of4_one_pass_equals_repack_and_inverts(small, sparse_outputs, tmp_path, scheme, target):
    q = sparse_outputs(scheme)
    k, one, back = (tmp_path / x for x in ("k", "one", "back"))
    api.repack(q, k, target, device="cpu")
    res = api.quantize_to_target(small, one, scheme, target, sparsity="2:4")
    assert any(target in n and "kernel-native" in n for n in res.notes)
    a, b = tensors(k), tensors(one)
    assert a.keys() == b.keys() and all(bitwise_equal(a[n], b[n]) for n in a)
    cfg = json.loads((k / "config.json").read_text())["quantization_config"]
    assert cfg == json.loads((one / "config.json").read_text())["quantization_config"]
    rec = cfg["modules"]["model.layers.0.mlp.down_proj"]
    assert rec["kernel"] == target and (rec["size_n"], rec["size_k"]) == (256, 512)
    assert a["model.layers.0.mlp.down_proj.meta"].dtype == (torch.uint8 if target == "cutlass-2of4" else torch.int32)
    api.repack(k, back, "compressed-tensors", device="cpu")
    x, y = tensors(q), tensors(back)
    assert x.keys() == y.keys() and all(bitwise_equal(x[n], y[n]) for n in x)
    assert json.loads((back / "config.json").read_text()) == json.loads((q / "config.json").read_text())


def test_sm80_refuses_fp8(sparse_outputs, tmp_path):
    with pytest.raises(UnsupportedError, match="SM80"):
        api.repack(sparse_outputs("FP8_DYNAMIC"), tmp_path / "k", "cutlass-2of4-sm80", device="cpu")


def _odd(tmp_path, inter: int) -> Path:
    cfg = {**SMALL, "intermediate_size": inter}
    return write_checkpoint(tmp_path / f"odd{inter}", llama_tensors(cfg), cfg)


def test_shapes_the_loaders_cannot_take(tmp_path):
    src = _odd(tmp_path, 500)  # down_proj K=500, gate/up N=500: not multiples of 8
    with pytest.raises(UnsupportedError, match=r"K=500 is not a multiple of 8|N=500 is not a multiple of 8"):
        api.quantize(src, tmp_path / "q", "FP8_DYNAMIC", sparsity="2:4")
    assert not (tmp_path / "q").exists()
    res = api.quantize(src, tmp_path / "q", "FP8_DYNAMIC", sparsity="2:4", skip_incompatible=True)
    assert {"model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj"} <= set(res.ignore)
    src = _odd(tmp_path, 320)  # marlin-24 needs N and K multiples of 128
    with pytest.raises(UnsupportedError, match="multiple of 128"):
        api.quantize_to_target(src, tmp_path / "m", "W4A16", "marlin-24", sparsity="2:4")


def test_scheme_and_target_combinations(small, tmp_path):
    tiny_llama = small
    with pytest.raises(UsageError, match="--target marlin-24"):
        api.quantize(tiny_llama, tmp_path / "a", "W4A16", sparsity="2:4")
    with pytest.raises(UnsupportedError, match="FP8_BLOCK"):
        api.quantize(tiny_llama, tmp_path / "a", "FP8_BLOCK", sparsity="2:4")
    with pytest.raises(UnsupportedError, match="W4A16"):
        api.quantize_to_target(tiny_llama, tmp_path / "a", "W8A8", "marlin-24", sparsity="2:4")
    with pytest.raises(UsageError, match="sparsity"):
        api.quantize(tiny_llama, tmp_path / "a", "W8A8", sparsity="1:2")
    with pytest.raises(UsageError):
        api.quantize(tiny_llama, tmp_path / "a", "DENSE")  # DENSE only with --sparsity
    with pytest.raises(UsageError, match="--lm-head"):
        api.quantize(tiny_llama, tmp_path / "a", "FP8_DYNAMIC", sparsity="2:4", lm_head="fp8")
    with pytest.raises(UnsupportedError, match="does not take it"):
        api.quantize_to_target(tiny_llama, tmp_path / "a", "FP8_DYNAMIC", "cutlass-2of4")  # no --sparsity


def test_nonfinite_weight_refused(tmp_path):
    t = llama_tensors(SMALL)
    t["model.layers.0.mlp.up_proj.weight"][3, 7] = float("nan")
    src = write_checkpoint(tmp_path / "src", t, SMALL)
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "q"), "--scheme", "FP8_DYNAMIC", "--sparsity", "2:4"])
    assert r.exit_code == BadInputError.exit_code and "up_proj" in r.stderr and "NaN" in r.stderr
    assert not (tmp_path / "q").exists()


def test_cli_help_says_which_vllm_loads_it():
    for cmd in (["quantize", "--help"], ["repack", "--help"]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 0
        text = " ".join(r.output.split())
        assert "cutlass-2of4" in text
    text = " ".join(CliRunner().invoke(main, ["quantize", "--help"]).output.split())
    assert "vLLM <= 0.18" in text and "vLLM <= 0.15" in text


@pytest.mark.parametrize("scheme", ["DENSE", "FP8_DYNAMIC", "W8A8"])
def test_reads_what_compressed_tensors_014_wrote(tmp_path, scheme):
    """A checkpoint of compressed-tensors 0.14's own tensors and config: inspect, verify, decompress and the
    2:4 kernel layouts (and back) take it."""
    with safe_open(REF, "pt") as f:
        meta = f.metadata()
        case = next(i for i in range(json.loads(meta["file"])["num_cases"]) if (json.loads(meta[f"case{i}"])["scheme"] or "DENSE") == scheme)
        p = json.loads(meta[f"case{case}"])
        exp = {k.split(".", 2)[2]: f.get_tensor(k) for k in f.keys() if k.startswith(f"case{case}.expected.")}
        pruned = {k.split(".", 2)[2]: f.get_tensor(k) for k in f.keys() if k.startswith(f"case{case}.pruned.")}
    t = {f"model.{k}": v for k, v in exp.items()}
    src = write_checkpoint(tmp_path / "ct014", t, {**SMALL, "quantization_config": p["quantization_config"]})
    rows = {r["module"]: r for r in api.inspect(src)["layers"]}
    assert {"model.layers.0", *(["model.layers.1"] if len(p["shapes"]) > 1 else [])} == set(rows)
    assert all(r["format"].startswith("sparse-24-bitmask") for r in rows.values())
    rep = api.verify(src)
    assert rep["ok"], rep["problems"]
    api.decompress(src, tmp_path / "d")
    back = tensors(tmp_path / "d")
    fmt, w = _INNER[scheme]
    args = WeightArgs.from_dict(w)
    for name, wt in pruned.items():
        if scheme == "DENSE":
            assert torch.equal(back[f"model.{name}"], wt)
        else:  # compressed-tensors' own tensors, dequantized: the inner format's dequantization of what CT quantized
            mod = f"model.{name[: -len('.weight')]}"
            q = sparse24_format(None).dequantize({"compressed": t[f"{mod}.compressed"], "bitmask": t[f"{mod}.bitmask"]}, args)
            got = FORMATS[fmt].dequantize({"weight": q, "weight_scale": t[f"{mod}.weight_scale"]}, args)
            assert torch.equal(back[f"model.{name}"], got.to(wt.dtype))
    api.repack(src, tmp_path / "k", "cutlass-2of4", device="cpu")
    api.repack(tmp_path / "k", tmp_path / "b", "compressed-tensors", device="cpu")
    b = tensors(tmp_path / "b")
    assert b.keys() == t.keys() and all(bitwise_equal(b[n], t[n]) for n in t)
