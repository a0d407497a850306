"""ctconvert repack: kernel-native output with its own tag, and the exact way back."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ctconvert import api
from ctconvert.cli import main
from ctconvert.commands.repack import repack

from helpers import bitwise_equal


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A16"])
def test_marlin_int_round_trip(tiny_llama, tmp_path, scheme):
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, scheme, max_shard_size="300KB")
    k = tmp_path / "k"
    res = repack(q, k, "marlin", device="cpu")
    assert res["modules"] == 14
    cfg = json.loads((k / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "ctconvert-kernel-native" and cfg["target"] == "marlin" and cfg["layout_version"] == "0.33"
    assert cfg["source_quantization_config"]["quant_method"] == "compressed-tensors"
    rec = cfg["modules"]["model.layers.0.mlp.down_proj"]
    assert rec["kernel"] == "marlin-int" and rec["size_k"] == 512 and rec["size_n"] == 256
    back = tmp_path / "b"
    repack(k, back, "compressed-tensors", device="cpu")
    # the safetensors bytes may be laid out in other shards; compare tensors and config
    from safetensors.torch import load_file

    def tensors(d):
        out = {}
        for f in d.glob("*.safetensors"):
            out.update(load_file(f))
        return out

    a, b = tensors(q), tensors(back)
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)), n
    assert json.loads((back / "config.json").read_text()) == json.loads((q / "config.json").read_text())


def test_repack_refuses_what_the_target_cannot_take(tiny_llama, tmp_path):
    api.quantize(tiny_llama, tmp_path / "q", "FP8_BLOCK")
    r = CliRunner().invoke(main, ["repack", str(tmp_path / "q"), "-o", str(tmp_path / "k"), "--target", "marlin"])
    assert r.exit_code == 4 and "does not take it" in r.stderr
    r = CliRunner().invoke(main, ["repack", str(tiny_llama), "-o", str(tmp_path / "k"), "--target", "marlin"])
    assert r.exit_code == 3 and "not a quantized checkpoint (config.json has no quantization_config): repack takes" in r.stderr


def test_inspect_and_verify_kernel_native(tiny_llama, tmp_path):
    q, k = tmp_path / "q", tmp_path / "k"
    api.quantize(tiny_llama, q, "W4A16_ASYM")
    repack(q, k, "marlin", device="cpu")
    rep = api.inspect(k)
    assert rep["quantization_config"]["quant_method"] == "ctconvert-kernel-native" and not rep["problems"]
    assert {r["scheme"] for r in rep["layers"]} == {"marlin-int", "dense"} and len(rep["layers"]) == 15  # the dense lm_head counts too
    assert [r["module"] for r in rep["layers"] if r["scheme"] == "dense"] == ["lm_head"] and rep["totals"]["quantized_layers"] == 14
    v = api.verify(k, q)
    assert v["ok"] and all(r["round_trip"] and r["equals_reference"] for r in v["modules"])
    # the reference must be the compressed-tensors source: a dense one is a usage error, not 112 "differs"
    r = CliRunner().invoke(main, ["verify", str(k), "--reference", str(tiny_llama)])
    assert r.exit_code == 2 and "verified against its compressed-tensors source" in r.stderr
    # corrupt one stored byte: the round trip catches it
    from safetensors.torch import load_file, save_file

    f = next(k.glob("*.safetensors"))
    t = load_file(f)
    name = next(n for n in t if n.endswith("down_proj.weight_packed"))
    t[name] = t[name].clone()
    t[name].view(-1)[5] ^= 1
    save_file(t, f, metadata={"format": "pt"})
    v = api.verify(k, q)
    assert not v["ok"] and any("differs from the reference" in p["message"] for p in v["problems"])
    r = CliRunner().invoke(main, ["inspect", str(k)])
    assert "kernel-native (marlin" in r.stdout


def test_quantize_with_target_in_one_command(tiny_llama, tmp_path):
    r = CliRunner().invoke(main, ["--json", "quantize", str(tiny_llama), "-s", "W4A16", "-o", str(tmp_path / "k"), "--target", "marlin"])
    assert r.exit_code == 0, r.stderr
    cfg = json.loads((tmp_path / "k" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "ctconvert-kernel-native"
    assert not list(tmp_path.glob(".k.ctconvert-*"))
    # one pass (no compressed-tensors stage): the same tensors and config as quantize, then repack
    api.quantize(tiny_llama, tmp_path / "q", "W4A16")
    repack(tmp_path / "q", tmp_path / "k2", "marlin", device="cpu")
    _assert_same_checkpoint(tmp_path / "k", tmp_path / "k2")


def _assert_same_checkpoint(a, b):
    from safetensors.torch import load_file

    ta, tb = {}, {}
    for f in a.glob("*.safetensors"):
        ta.update(load_file(f))
    for f in b.glob("*.safetensors"):
        tb.update(load_file(f))
    assert ta.keys() == tb.keys() and len(ta) > 20
    for name, t in ta.items():
        assert bitwise_equal(t, tb[name]), name
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


@pytest.mark.parametrize(
    "scheme,target,act,lm_head",
    [
        ("NVFP4A16", "marlin", "fp16", "nvfp4a16"),
        ("FP8_DYNAMIC", "marlin", "bf16", "none"),
        ("W4A16_ASYM", "marlin", "bf16", "none"),
        ("NVFP4A16", "marlin", "bf16", "none"),
        ("MXFP4A16", "marlin", "bf16", "none"),
        ("MXFP4", "marlin", "fp16", "nvfp4a16"),
    ],
)
def test_quantize_with_target_equals_quantize_then_repack(tiny_llama, tmp_path, scheme, target, act, lm_head):
    api.quantize_to_target(tiny_llama, tmp_path / "k", scheme, target, act_dtype=act, lm_head=lm_head, chunk_elems=4096, device="cpu")
    api.quantize(tiny_llama, tmp_path / "q", scheme, lm_head=lm_head, device="cpu")
    repack(tmp_path / "q", tmp_path / "k2", target, act_dtype=act, device="cpu")
    _assert_same_checkpoint(tmp_path / "k", tmp_path / "k2")
    assert api.verify(tmp_path / "k", tmp_path / "q")["ok"]


@pytest.mark.parametrize(
    "scheme,act", [("FP8_DYNAMIC", "bf16"), ("FP8_DYNAMIC", "fp16"), ("NVFP4A16", "bf16"), ("NVFP4A16", "fp16"), ("MXFP4A16", "bf16"), ("MXFP4A16", "fp16")]
)
def test_marlin_fp_round_trip(tiny_llama, tmp_path, scheme, act):
    q, k, b = tmp_path / "q", tmp_path / "k", tmp_path / "b"
    api.quantize(tiny_llama, q, scheme, lm_head="nvfp4a16" if scheme == "NVFP4A16" else "none")
    res = repack(q, k, "marlin", act_dtype=act, device="cpu")
    assert res["modules"] == (15 if scheme == "NVFP4A16" else 14)
    v = api.verify(k, q)
    assert v["ok"], v["problems"]
    repack(k, b, "compressed-tensors", device="cpu")
    assert api.verify(b, tiny_llama)["ok"]
    from safetensors.torch import load_file

    ta = {}
    tb = {}
    for f in q.glob("*.safetensors"):
        ta.update(load_file(f))
    for f in b.glob("*.safetensors"):
        tb.update(load_file(f))
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[n].reshape(-1).view(torch.uint8), tb[n].reshape(-1).view(torch.uint8)) for n in ta)


def test_cutlass_needs_input_global_scale(tiny_llama, tmp_path):
    api.quantize(tiny_llama, tmp_path / "q", "NVFP4A16")
    r = CliRunner().invoke(main, ["repack", str(tmp_path / "q"), "-o", str(tmp_path / "k"), "--target", "cutlass-nvfp4"])
    assert r.exit_code == 4 and "does not take it" in r.stderr


def test_cutlass_round_trip_on_a_w4a4_checkpoint(tiny_llama, tmp_path):
    """NVFP4 W4A4 checkpoints come from calibrating tools: add an input_global_scale to ours."""
    from safetensors.torch import load_file, save_file

    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "NVFP4A16")
    cfg = json.loads((q / "config.json").read_text())
    from compressed_tensors.quantization import preset_name_to_scheme

    g = preset_name_to_scheme("NVFP4", ["Linear"]).model_dump()
    g["format"] = "nvfp4-pack-quantized"
    cfg["quantization_config"]["config_groups"]["group_0"] = g
    (q / "config.json").write_text(json.dumps(cfg))
    f = next(q.glob("*.safetensors"))
    t = load_file(f)
    for n in [n for n in t if n.endswith(".weight_global_scale")]:
        t[n.replace("weight_global_scale", "input_global_scale")] = torch.tensor([617.5], dtype=torch.float32)
    save_file(t, f, metadata={"format": "pt"})
    idx = json.loads((q / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {n: f.name for n in t}
    (q / "model.safetensors.index.json").write_text(json.dumps(idx))
    k, b = tmp_path / "k", tmp_path / "b"
    repack(q, k, "cutlass-nvfp4", device="cpu")
    kt = {}
    for ff in k.glob("*.safetensors"):
        kt.update(load_file(ff))
    alpha = kt["model.layers.0.mlp.up_proj.alpha"]
    assert alpha.dtype == torch.float32 and alpha.numel() == 1
    assert api.verify(k, q)["ok"]
    repack(k, b, "compressed-tensors", device="cpu")
    tb = {}
    for ff in b.glob("*.safetensors"):
        tb.update(load_file(ff))
    assert all(torch.equal(t[n].reshape(-1).view(torch.uint8), tb[n].reshape(-1).view(torch.uint8)) for n in t)


@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_mxfp4_goes_to_its_marlin_layout(tiny_llama, tmp_path, act):
    """MXFP4A16 and MXFP4 (W4A4) weights take marlin-mxfp4 (docs/kernel-layouts.md §5.3): E8M0 scales in the
    kernel's float8_e8m0fnu, the checkpoint bytes kept beside them only for fp16 activations (where the cast loses)."""
    from safetensors import safe_open

    k = tmp_path / "k"
    r = CliRunner().invoke(main, ["--json", "quantize", str(tiny_llama), "-s", "MXFP4A16", "-o", str(k), "--target", "marlin", "--act-dtype", act])
    assert r.exit_code == 0, r.stderr
    cfg = json.loads((k / "config.json").read_text())["quantization_config"]
    recs = cfg["modules"]
    assert len(recs) == 14 and {r["kernel"] for r in recs.values()} == {"marlin-mxfp4"}
    rec = recs["model.layers.0.mlp.down_proj"]
    assert (rec["size_n"], rec["size_k"], rec["act_dtype"]) == (256, 512, "bfloat16" if act == "bf16" else "float16")
    with safe_open(str(next(k.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_dtype() == "F8_E8M0"
    assert ("model.layers.0.mlp.down_proj.weight_scale_source" in names) == (act == "fp16")
    assert {r["scheme"] for r in api.inspect(k)["layers"]} == {"marlin-mxfp4", "dense"}  # the dense lm_head is counted too
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "MXFP4A16")
    v = api.verify(k, q)
    assert v["ok"] and all(m["round_trip"] and m["equals_reference"] for m in v["modules"])
    b = tmp_path / "b"
    repack(k, b, "compressed-tensors", device="cpu")
    _assert_same_checkpoint(q, b)


def test_quantize_with_target_imports_no_dynamo(tiny_llama, tmp_path):
    """Planning the kernel layout runs on host zeros, not meta tensors, whose Python meta functions import
    torch._dynamo (seconds at start-up); checked in a fresh process."""
    import subprocess
    import sys

    code = (
        "import sys; from ctconvert import api; "
        f"api.quantize_to_target({str(tiny_llama)!r}, {str(tmp_path / 'k')!r}, 'NVFP4A16', 'marlin', device='cpu'); "
        f"api.quantize_to_target({str(tiny_llama)!r}, {str(tmp_path / 'k2')!r}, 'W4A16_ASYM', 'marlin', device='cpu'); "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


# -- every tensor of every module, both ways and by both routes (issue 22) ---------------------------------------

#: (scheme, --sparsity, target): every scheme each target takes
CONSERVATION = [
    *[(s, None, "marlin") for s in ("W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "FP8", "NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4")],
    ("NVFP4", None, "cutlass-nvfp4"),
    *[(s, "2:4", "cutlass-2of4") for s in ("DENSE", "FP8_DYNAMIC", "W8A8")],
    *[(s, "2:4", "cutlass-2of4-sm80") for s in ("DENSE", "W8A8")],
]
_CALIBRATED = ("NVFP4", "FP8")
_QUANTIZED: dict[tuple, object] = {}


@pytest.fixture(scope="module")
def qwen2_biases(tmp_path_factory):
    """A tiny Qwen2 saved by transformers: q/k/v biases, every parameter random (the biases too: a permuted or
    dropped bias shows), with a tokenizer for the calibrated schemes."""
    transformers = pytest.importorskip("transformers")
    from calibration.test_calibration import add_tokenizer

    cfg = transformers.Qwen2Config(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    path = tmp_path_factory.mktemp("qwen2") / "src"
    model.save_pretrained(str(path))
    return add_tokenizer(path)


def _kwargs(scheme: str, sparsity: str | None, kv_cache: str = "none") -> dict:
    kw = {"device": "cpu", "sparsity": sparsity, "kv_cache": kv_cache}
    if scheme in _CALIBRATED or kv_cache != "none":
        kw.update(calibration_samples=2, calibration_seq_len=32)
    return kw


def _quantized(src, scheme: str, sparsity: str | None, kv_cache: str = "none"):
    """The compressed-tensors checkpoint of ``scheme`` (made once per module)."""
    key = (str(src), scheme, sparsity, kv_cache)
    if key not in _QUANTIZED:
        out = src.parent / f"q-{scheme}-{sparsity or 'dense'}-{kv_cache}".replace(":", "")
        api.quantize(src, out, scheme, **_kwargs(scheme, sparsity, kv_cache))
        _QUANTIZED[key] = out
    return _QUANTIZED[key]


def _tensors(d) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same_tensors(a, b):
    """Same names, dtypes, shapes and bytes (offsets and shards may differ)."""
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb), sorted(set(ta) ^ set(tb))
    for name, t in ta.items():
        assert t.dtype == tb[name].dtype and t.shape == tb[name].shape and bitwise_equal(t, tb[name]), name


@pytest.mark.parametrize("scheme,sparsity,target", CONSERVATION)
def test_round_trip_restores_every_tensor(qwen2_biases, tmp_path, scheme, sparsity, target):
    """compressed-tensors -> target -> compressed-tensors gives every tensor back, bit for bit (biases,
    input_global_scale, input_scale ...), and the config; verify of the kernel-native output agrees."""
    q = _quantized(qwen2_biases, scheme, sparsity)
    k, back = tmp_path / "k", tmp_path / "b"
    repack(q, k, target, device="cpu")
    v = api.verify(k, q)
    assert v["ok"], v["problems"]
    repack(k, back, "compressed-tensors", device="cpu")
    _assert_same_tensors(q, back)
    assert json.loads((back / "config.json").read_text()) == json.loads((q / "config.json").read_text())


@pytest.mark.parametrize("scheme,sparsity,target", CONSERVATION)
def test_both_target_routes_write_the_same_checkpoint(qwen2_biases, tmp_path, scheme, sparsity, target):
    """``quantize --target T`` equals ``quantize`` then ``repack --target T``: the same tensors (names, bytes)
    and the same config.json, with no field excepted."""
    q = _quantized(qwen2_biases, scheme, sparsity)
    repack(q, tmp_path / "k", target, device="cpu")
    api.quantize_to_target(qwen2_biases, tmp_path / "k2", scheme, target, **_kwargs(scheme, sparsity))
    _assert_same_tensors(tmp_path / "k", tmp_path / "k2")
    assert json.loads((tmp_path / "k" / "config.json").read_text()) == json.loads((tmp_path / "k2" / "config.json").read_text())


def test_kernel_native_biases_and_input_scales_are_kept(qwen2_biases, tmp_path):
    """Biases in the layout vLLM holds after loading (Marlin: marlin_permute_bias; CUTLASS NVFP4: as they are),
    an NVFP4 input_global_scale on Marlin copied and recorded; a module that lacks one fails verify."""
    from ctconvert.layouts import marlin

    q = _quantized(qwen2_biases, "NVFP4", None)
    src = _tensors(q)
    b = "model.layers.0.self_attn.k_proj"
    n, k = src[f"{b}.weight_packed"].shape[0], src[f"{b}.weight_packed"].shape[1] * 2
    repack(q, tmp_path / "m", "marlin", device="cpu")
    repack(q, tmp_path / "c", "cutlass-nvfp4", device="cpu")
    tm, tc = _tensors(tmp_path / "m"), _tensors(tmp_path / "c")
    assert bitwise_equal(tm[f"{b}.bias"], marlin.marlin_permute_bias(src[f"{b}.bias"], k, n, 16))
    assert not bitwise_equal(tm[f"{b}.bias"], src[f"{b}.bias"])  # (N = 64: the permutation moves values)
    assert bitwise_equal(tm[f"{b}.input_global_scale"], src[f"{b}.input_global_scale"])
    assert bitwise_equal(tc[f"{b}.bias"], src[f"{b}.bias"])
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["quantization_config"]["modules"][b]["copied"] == ["input_global_scale"]
    # a kernel-native output without a module's bias (as written before this fix): verify must not pass it
    from safetensors.torch import save_file

    rec = cfg["quantization_config"]["modules"][b]
    rec["tensors"].remove("bias")
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    f = next((tmp_path / "m").glob("*.safetensors"))
    save_file({n_: t for n_, t in _tensors(tmp_path / "m").items() if n_ != f"{b}.bias"}, f, metadata={"format": "pt"})
    for idx in (tmp_path / "m").glob("*.index.json"):
        idx.unlink()
    v = api.verify(tmp_path / "m", q)
    assert not v["ok"] and any("lacks bias" in p["message"] for p in v["problems"])
    assert not api.verify(tmp_path / "m")["ok"]  # without the reference too: the record's source tensors


def test_an_incompletely_written_output_is_an_internal_error(tiny_llama, tmp_path, monkeypatch):
    """The writer's "tensors incompletely written" is ctconvert's own inconsistency: exit 1 (internal error), not
    6 ("output cannot be written"), which sends the user to check the disk."""
    from ctconvert.errors import EXIT_INTERNAL
    from ctconvert.plan import kernel_targets as kernels

    api.quantize(tiny_llama, tmp_path / "q", "W4A16")
    repack(tmp_path / "q", tmp_path / "k", "marlin", device="cpu")
    real = kernels.unrepack_module
    monkeypatch.setattr(kernels, "unrepack_module", lambda t, rec: {p: v for p, v in real(t, rec).items() if p != "weight_scale"})
    r = CliRunner().invoke(main, ["repack", str(tmp_path / "k"), "-o", str(tmp_path / "b"), "--target", "compressed-tensors", "--device", "cpu"])
    assert r.exit_code == EXIT_INTERNAL and "internal: 14 tensors incompletely written" in r.stderr, (r.exit_code, r.stderr)
    assert "Traceback" not in r.stderr and not (tmp_path / "b").exists()


def test_act_order_module_repacks_and_round_trips(tmp_path):
    """An act-order (``weight_g_idx``) W4A16 module for ``--layout-version 0.29``: the layout sorts by the g_idx
    values, which meta tensors cannot do (torch: no meta kernel for aten::equal), so it plans on stand-in values;
    before, repack refused it ("cannot repack for marlin-int")."""
    from safetensors.torch import load_file, save_file

    from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

    src = write_checkpoint(tmp_path / "src", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    q = tmp_path / "q"
    api.quantize(src, q, "W4A16", device="cpu")
    f = next(q.glob("*.safetensors"))
    t = load_file(f)
    g = torch.Generator().manual_seed(0)
    for n in [n for n in t if n.endswith(".weight_shape")]:
        k = int(t[n][1])
        t[n.replace("weight_shape", "weight_g_idx")] = torch.randperm(k, generator=g).to(torch.int32) // 128
    save_file(t, f, metadata={"format": "pt"})
    for idx in q.glob("*.index.json"):
        idx.unlink()
    cfg = json.loads((q / "config.json").read_text())  # the config explains the g_idx: act-order by group
    for grp in cfg["quantization_config"]["config_groups"].values():
        grp["weights"]["actorder"] = "group"
    (q / "config.json").write_text(json.dumps(cfg))
    repack(q, tmp_path / "k", "marlin", layout_version="0.29", device="cpu")
    rec = json.loads((tmp_path / "k" / "config.json").read_text())["quantization_config"]["modules"]["model.layers.1.mlp.down_proj"]
    assert rec["act_order"] and "g_idx_sort_indices" in rec["tensors"]
    assert api.verify(tmp_path / "k", q)["ok"]
    repack(tmp_path / "k", tmp_path / "b", "compressed-tensors", device="cpu")
    _assert_same_tensors(q, tmp_path / "b")


def test_dry_run_with_target_says_the_bias_goes_through_the_kernel(qwen2_biases):
    """``quantize --target --dry-run``: a quantized module's bias is not a plain copy; its row says so."""
    r = api.quantize_to_target(qwen2_biases, None, "W4A16", "marlin", device="cpu", dry_run=True)
    rows = {t.name: t for t in r.plan.rows}
    assert rows["model.layers.0.self_attn.q_proj.bias"].reason == "bias; goes through its module's marlin kernel"
    assert rows["model.norm.weight"].reason == "norm"


@pytest.mark.parametrize("target", ["marlin", "cutlass-nvfp4"])
def test_kv_cache_scales_survive_both_ways_and_both_routes(qwen2_biases, tmp_path, target):
    """Calibrated NVFP4 with ``--kv-cache fp8``: the attention modules' k_scale/v_scale (and every other tensor)
    come back from the kernel-native output, and both --target routes write the same checkpoint."""
    q = _quantized(qwen2_biases, "NVFP4", None, "fp8")
    assert "model.layers.0.self_attn.k_scale" in _tensors(q)
    repack(q, tmp_path / "k", target, device="cpu")
    assert "model.layers.0.self_attn.v_scale" in _tensors(tmp_path / "k")
    repack(tmp_path / "k", tmp_path / "b", "compressed-tensors", device="cpu")
    _assert_same_tensors(q, tmp_path / "b")
    api.quantize_to_target(qwen2_biases, tmp_path / "k2", "NVFP4", target, **_kwargs("NVFP4", None, "fp8"))
    _assert_same_tensors(tmp_path / "k", tmp_path / "k2")
    assert json.loads((tmp_path / "k" / "config.json").read_text()) == json.loads((tmp_path / "k2" / "config.json").read_text())


def test_target_refuses_a_nonfinite_bias_naming_it(qwen2_biases, tmp_path):
    """A bias that goes through its module's kernel is checked as the copy would check it: NaN is a one-line
    error naming the file and tensor (exit 3), and nothing is written."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for f in qwen2_biases.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    f = next(src.glob("*.safetensors"))
    t = load_file(f)
    t["model.layers.0.self_attn.v_proj.bias"][3] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    r = CliRunner().invoke(main, ["quantize", str(src), "-s", "W4A16", "-o", str(tmp_path / "k"), "--target", "marlin", "--device", "cpu"])
    assert r.exit_code == 3 and "tensor 'model.layers.0.self_attn.v_proj.bias': tensor holds NaN/inf values" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "k").exists()


def test_verify_kernel_native_flags_a_reference_tensor_left_out(tiny_llama, tmp_path):
    """verify KERNEL_NATIVE --reference CT: a tensor of the reference that no module record covers (a norm, a dense
    lm_head) must be in the checkpoint with the same bytes; verify fails naming it (it said "bit for bit" before)."""
    from safetensors.torch import load_file, save_file

    q, k = tmp_path / "q", tmp_path / "k"
    api.quantize(tiny_llama, q, "W4A16")
    repack(q, k, "marlin", device="cpu", max_shard_size="100GB")
    f = next(k.glob("*.safetensors"))
    t = {n: x for n, x in load_file(f).items() if n != "model.norm.weight"}
    t["lm_head.weight"][0, 0] += 1  # and a copied tensor with other bytes
    save_file(t, f, metadata={"format": "pt"})
    for idx in k.glob("*.index.json"):
        idx.unlink()
    v = api.verify(k, q)
    assert not v["ok"] and any(p.get("tensor") == "model.norm.weight" and "missing from the output" in p["message"] for p in v["problems"]), v["problems"]
    assert any(p.get("tensor") == "lm_head.weight" and "differs from the reference" in p["message"] for p in v["problems"])


def test_fp8_marlin_bias_of_an_earlier_output_still_inverts(qwen2_biases, tmp_path):
    """marlin-fp8 biases are permuted now (vLLM's prepare_fp8_layer_for_marlin); an earlier output held them as
    they are, with no ``bias_permuted`` in its record: its inverse still gives the source bias back."""
    from safetensors.torch import load_file, save_file

    q = _quantized(qwen2_biases, "FP8_DYNAMIC", None)
    k = tmp_path / "k"
    repack(q, k, "marlin", device="cpu")
    name = "model.layers.0.self_attn.q_proj"
    cfg = json.loads((k / "config.json").read_text())
    assert cfg["quantization_config"]["modules"][name].pop("bias_permuted") is True
    (k / "config.json").write_text(json.dumps(cfg))
    f = next(k.glob("*.safetensors"))
    t = load_file(f)
    t[f"{name}.bias"] = _tensors(q)[f"{name}.bias"]  # as written before
    save_file(t, f, metadata={"format": "pt"})
    repack(k, tmp_path / "b", "compressed-tensors", device="cpu")
    _assert_same_tensors(q, tmp_path / "b")


@pytest.mark.parametrize("scheme", ["W4A16", "W8A16", "FP8_DYNAMIC", "NVFP4A16", "MXFP4A16"])
def test_marlin_round_trip_files_are_what_the_readme_says(tiny_llama, tmp_path, scheme):
    """README ("Kernel-native layouts"): every tensor (name, dtype, shape, bytes) of each shard comes back; the shard
    file is byte for byte the original one for NVFP4A16/MXFP4A16 in one shard (W4A16/W8A16/FP8: another order)."""
    import hashlib

    from safetensors import safe_open

    q, k, b = tmp_path / "q", tmp_path / "k", tmp_path / "b"
    api.quantize(tiny_llama, q, scheme)
    repack(q, k, "marlin", device="cpu")
    repack(k, b, "compressed-tensors", device="cpu")
    files = sorted(f.name for f in q.glob("*.safetensors"))
    assert files == sorted(f.name for f in b.glob("*.safetensors")) and len(files) == 1
    for name in files:
        with safe_open(str(q / name), "pt") as fa, safe_open(str(b / name), "pt") as fb:
            assert set(fa.keys()) == set(fb.keys())
            for t in fa.keys():
                x, y = fa.get_tensor(t), fb.get_tensor(t)
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), t
    if scheme in ("NVFP4A16", "MXFP4A16"):
        assert [hashlib.sha256((q / n).read_bytes()).digest() for n in files] == [hashlib.sha256((b / n).read_bytes()).digest() for n in files]
