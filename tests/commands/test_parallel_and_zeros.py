"""quantize/verify: the tensor-parallel plan (--tp/--ep) and the tensors that quantize to all zeros."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ctconvert import api
from ctconvert.plan.schemes import get_scheme

from conftest import LLAMA_CONFIG, cuda_params, llama_tensors, moe_checkpoint, write_checkpoint
from ct_reference import ct_compress

# -- the tensor-parallel plan --------------------------------------------------------------


def test_dry_run_reports_largest_tp_per_tensor_and_overall(tiny_llama):
    res = api.quantize(tiny_llama, None, "W4A16", dry_run=True, tp=4)
    par = res.parallel
    # o_proj [256, 256] is row-parallel: K 256 / 4 = 64 cuts the groups of 128; down_proj K 512 holds at 4
    assert par.max_tp == 2 and sorted(par.limited_by) == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    assert sorted(r.name for r in par.failing) == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    doc = res.to_dict()
    rows = {r["name"]: r for r in doc["plan"]["tensors"]}
    assert rows["model.layers.0.mlp.down_proj.weight"]["max_tp"] == 4
    assert rows["model.layers.0.self_attn.o_proj.weight"]["max_tp"] == 2
    assert rows["model.layers.0.self_attn.q_proj.weight"]["max_tp"] == 4  # 4 attention heads
    assert rows["lm_head.weight"]["max_tp"] == 128  # dense head: vocab 384 = 3 * 128
    assert "max_tp" not in rows["model.norm.weight"]
    assert doc["plan"]["parallel"]["max_tp"] == 2 and doc["parallel"] == doc["plan"]["parallel"]
    assert {m["what"]: m["max_tp"] for m in doc["parallel"]["model"]} == {"num_attention_heads 4": 4}
    assert api.quantize(tiny_llama, None, "W4A16", dry_run=True).parallel.ok  # tp 1 always splits


def test_dry_run_with_marlin_target_checks_tiles(tiny_llama):
    plain = api.quantize(tiny_llama, None, "W4A16", dry_run=True).parallel
    marlin = api.quantize_to_target(tiny_llama, None, "W4A16", "marlin", dry_run=True).parallel
    gate = "model.layers.0.mlp.gate_proj"
    assert plain.row(gate).max_tp == 512 and marlin.row(gate).max_tp == 8  # 512 / 16 = 32 rows: not a 64-wide tile


def _moe_checkpoint(tmp_path, inter=640, experts=4):
    return moe_checkpoint(tmp_path, experts, inter)


def test_moe_intermediate_640_supports_tp1_only_unless_ep(tmp_path):
    src = _moe_checkpoint(tmp_path)
    par = api.quantize(src, None, "W4A16", dry_run=True, tp=2).parallel
    assert par.max_tp == 1 and not par.ok
    experts = [r for r in par.rows if ".experts." in r.name]
    assert len(experts) == 2 * 4 * 3 and all(r.max_tp == 1 and not r.ok for r in experts)
    assert par.max_ep == 4 and par.row("model.layers.0.mlp.gate") is None  # the router stays dense: not a quantized tensor
    with_ep = api.quantize(src, None, "W4A16", dry_run=True, tp=2, ep=2).parallel
    assert with_ep.ok and with_ep.max_tp == 2  # o_proj limits what is left
    # verify reads the same from the written checkpoint
    out = tmp_path / "o"
    api.quantize(src, out, "W4A16")
    rep = api.verify(out, tp=2)
    bad = {p["tensor"] for p in rep["problems"] if p["severity"] == "error"}
    assert not rep["ok"] and bad == {r.name for r in experts}
    assert api.verify(out, tp=2, ep=2)["ok"]
    rep = api.verify(out, ep=3)
    uneven = "4 experts over --ep 3: the first rank holds 2, the others 1 (vLLM determine_expert_map)"
    assert rep["ok"] and [p["message"] for p in rep["problems"]] == [uneven]


def test_real_run_notes_what_does_not_split_and_verify_checks_it(tiny_llama, tmp_path):
    out = tmp_path / "o"
    res = api.quantize(tiny_llama, out, "W4A16", tp=4)
    assert any(n.startswith("tensor parallel: largest TP degree 2") and "at --tp 4: 2 tensors do not split" in n for n in res.notes)
    rep = api.verify(out)
    assert rep["ok"] and rep["parallel"]["max_tp"] == 2 and rep["parallel"]["ok"]
    rep = api.verify(out, tp=4)
    assert not rep["ok"]
    bad = [p for p in rep["problems"] if p["severity"] == "error"]
    assert sorted(p["tensor"] for p in bad) == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    assert "does not split at --tp 4: K per rank 64" in bad[0]["message"]
    assert api.verify(out, tp=2)["ok"]
    # the same rules for the kernel-native (Marlin) form of it: tiles limit the column-parallel layers too
    api.repack(out, tmp_path / "k", "marlin", device="cpu")
    rep = api.verify(tmp_path / "k")
    rows = {r["tensor"]: r for r in rep["parallel"]["tensors"]}
    assert rows["model.layers.0.mlp.gate_proj"]["max_tp"] == 8 and rep["parallel"]["max_tp"] == 2
    assert not api.verify(tmp_path / "k", tp=4)["ok"]


# -- values that quantize to zero ------------------------------------------------------------------

TINY_ROWS = 5


def _tiny_checkpoint(tmp_path):
    """fp16 Llama: 5 rows of down_proj (layer 0) and all of o_proj (layer 1) hold values of about 3e-8."""
    cfg = dict(LLAMA_CONFIG, torch_dtype="float16")
    t = llama_tensors(cfg, dtype=torch.float16)
    g = torch.Generator().manual_seed(11)
    t["model.layers.0.mlp.down_proj.weight"][:TINY_ROWS] = (torch.randn(TINY_ROWS, 512, generator=g) * 3e-8).half()
    t["model.layers.1.self_attn.o_proj.weight"] = (torch.randn(256, 256, generator=g) * 3e-8).half()
    assert bool((t["model.layers.1.self_attn.o_proj.weight"] != 0).any())
    return write_checkpoint(tmp_path / "tiny", t, cfg), t


def _stored(out, module):
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name, f in index["weight_map"].items():
        if name.startswith(module + "."):
            with safe_open(out / f, "pt") as h:
                got[name[len(module) + 1 :]] = h.get_tensor(name)
    return got


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC", "NVFP4A16", "W4A16_ASYM"])
def test_quantize_reports_rows_quantized_to_zero(tmp_path, scheme, device):
    src, t = _tiny_checkpoint(tmp_path)
    out = tmp_path / "o"
    res = api.quantize(src, out, scheme, device=device)
    by = {z["tensor"]: z for z in res.zero_quantized}
    assert set(by) == {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"}
    assert by["model.layers.0.mlp.down_proj.weight"]["zero_rows"] == TINY_ROWS and not by["model.layers.0.mlp.down_proj.weight"]["all_zero"]
    whole = by["model.layers.1.self_attn.o_proj.weight"]
    assert whole["all_zero"] and whole["zero_rows"] == 256
    assert whole["max_abs"] == pytest.approx(float(t["model.layers.1.self_attn.o_proj.weight"].abs().max()))
    down = by["model.layers.0.mlp.down_proj.weight"]
    if scheme == "NVFP4A16":  # the down_proj rows vanish under the global scale its largest value sets; the whole
        # o_proj of ~1e-7 needs a global scale beyond fp16's range (stored as 1): the dtype's range is the cause
        assert down["cause"] == "global_scale" and down["set_max"] == float(t["model.layers.0.mlp.down_proj.weight"].abs().max())
        assert whole["cause"] == "scale_range" and whole["set_max"] == float(t["model.layers.1.self_attn.o_proj.weight"].abs().max())
    else:
        assert down["cause"] == whole["cause"] == "scale_range" and down["set_max"] is whole["set_max"] is None
    assert any(n.startswith("model.layers.1.self_attn.o_proj.weight: every quantized value is zero") for n in res.notes)
    assert any(n.startswith(f"model.layers.0.mlp.down_proj.weight: {TINY_ROWS} of 256 rows quantize to all zeros") for n in res.notes)
    # the bytes are compressed-tensors' own, and they do dequantize to zero
    for module in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        got = _stored(out, module)
        for key, ref in ct_compress(t[module + ".weight"], scheme).items():
            assert torch.equal(got[key].reshape(-1).view(torch.uint8), ref.contiguous().reshape(-1).view(torch.uint8)), (module, key)
        deq = get_scheme(scheme).weight_format.dequantize(got, get_scheme(scheme).weights)
        rows = deq.abs().amax(dim=1) == 0
        assert int(rows.sum()) == (256 if "o_proj" in module else TINY_ROWS)


def test_normal_weights_report_nothing(tiny_llama, tmp_path):
    res = api.quantize(tiny_llama, tmp_path / "o", "W4A16")
    assert res.zero_quantized == [] and not any("quantize to all zeros" in n for n in res.notes)


def test_verify_names_the_zero_rows(tmp_path):
    src, _ = _tiny_checkpoint(tmp_path)
    out = tmp_path / "o"
    api.quantize(src, out, "W4A16")
    rep = api.verify(out)
    warn = [p for p in rep["problems"] if p["severity"] == "warning"]
    assert [p["tensor"] for p in warn] == ["model.layers.1.self_attn.o_proj"] and "every quantized value is zero" in warn[0]["message"]
    assert rep["ok"]  # a warning: the bytes are what compressed-tensors writes
    rep = api.verify(out, src)
    msgs = {p["tensor"]: p["message"] for p in rep["problems"] if p["severity"] == "warning"}
    assert msgs["model.layers.0.mlp.down_proj"].startswith(f"{TINY_ROWS} of 256 rows are all zero in the output but not in the reference")
    assert msgs["model.layers.1.self_attn.o_proj"].startswith("every row is all zero in the output")
    rows = {r["module"]: r for r in rep["tensors"]}
    assert rows["model.layers.0.mlp.down_proj"]["zero_rows"] == TINY_ROWS and rows["model.layers.0.mlp.up_proj"]["zero_rows"] == 0
    assert not rep["ok"]  # the all-zero o_proj also fails its error threshold
