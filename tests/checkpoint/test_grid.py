"""verify's value-by-value check (checkpoint/grid.py): every stored value is the format's nearest to its reference value
over its own stored scale. A group whose scale was written halved or doubled (a writer's bug: the hash record is of
the wrong bytes) passed the module's error, gain and row limits of W4A16, NVFP4A16 and MXFP4A16 outputs (a new
user's finding); it must fail naming the module and a value of that group. Correct outputs of every scheme pass with
every value judged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ctconvert import api
from ctconvert.checkpoint.grid import TIE

from conftest import LLAMA_CONFIG, edited_copy, llama_tensors, write_checkpoint

MODULE = "model.layers.0.mlp.down_proj"  # [256, 512]
N, K = LLAMA_CONFIG["hidden_size"], LLAMA_CONFIG["intermediate_size"]


def _edit(out, dst, fn):
    """A copy of ``out`` whose tensors of ``MODULE`` ``fn(dict)`` changed, rewritten as a writer would."""
    return edited_copy(out, dst, MODULE, fn)


def _rows(rep) -> dict:
    return {r["module"]: r for r in rep["tensors"]}


def _source(tmp_path, seed: int = 0, edit=None):
    t = llama_tensors(LLAMA_CONFIG, seed=seed)
    if edit is not None:
        edit(t)
    return write_checkpoint(tmp_path / f"src-{seed}", t, LLAMA_CONFIG, shards=2)


CALIBRATED = ("NVFP4", "FP8", "W8A8_STATIC", "W8A8_STATIC_ASYM")


@pytest.mark.parametrize(
    "scheme",
    ["W4A16", "W4A16_ASYM", "W8A16", "W4AFP8", "W8A8", *CALIBRATED, "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"],
)
def test_every_value_of_a_correct_output_is_judged_and_on_the_grid(tmp_path, scheme):
    """Awkward rows in the source: one all zero, one of huge values, one of tiny ones (a different scale per row and
    group); every value of every module is judged (the ones of a zero-scale group excepted), none is off the grid."""

    def awkward(t):
        w = t[MODULE + ".weight"]
        w[3] = 0
        w[7] = w[7].float().mul(1e4).to(w.dtype)
        w[11] = w[11].float().mul(1e-4).to(w.dtype)

    src = _source(tmp_path, seed=1, edit=awkward)
    out = tmp_path / "q"
    kw = {}
    if scheme in CALIBRATED:  # calibrated input scales: token ids need no tokenizer
        ids = tmp_path / "ids.json"
        ids.write_text(json.dumps([i % LLAMA_CONFIG["vocab_size"] for i in range(64)]))
        kw = {"calibration": ids, "calibration_samples": 2, "calibration_seq_len": 32}
    api.quantize(src, out, scheme, **kw)
    rep = api.verify(out, src)
    assert rep["ok"], rep["problems"]
    rows = _rows(rep)
    assert len(rows) == 14  # 7 Linear modules a layer, 2 layers
    for name, r in rows.items():
        assert r["values_unchecked"] is None and r["grid_ok"] and r["values_off_grid"] == 0, (name, r)
    assert N * K - K <= rows[MODULE]["values_checked"] <= N * K  # at most the zero row unjudged (where its scale is zero)
    assert "every quantized value the nearest to its reference over its scale" in rep["checked"]["checks"]


def _group_edit(scheme: str, factor: float):
    """(the edit of one scale of ``MODULE``, the rows and columns that scale covers)."""

    def scale(ts, idx):
        s = ts[MODULE + ".weight_scale"]
        if s.dtype == torch.uint8:  # E8M0: one power of two up or down
            s[idx] = s[idx] + (1 if factor > 1 else -1)
        else:
            s[idx] = (s[idx].float() * factor).to(s.dtype)

    if scheme == "FP8_BLOCK":  # [N/128, K/128] blocks
        return (lambda ts: scale(ts, (1, 2))), (range(128, 256), range(256, 384))
    if scheme == "W8A8":  # one scale per row
        return (lambda ts: scale(ts, (5, 0))), (range(5, 6), range(0, K))
    g = {"W4A16": 128, "W8A16": 128, "NVFP4A16": 16, "MXFP4A16": 32}[scheme]
    return (lambda ts: scale(ts, (5, 2))), (range(5, 6), range(2 * g, 3 * g))


@pytest.mark.parametrize("factor", [2.0, 0.5])
@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16", "MXFP4A16", "W8A16", "W8A8", "FP8_BLOCK"])
def test_one_scale_written_off_by_two_fails_naming_a_value_it_covers(tmp_path, scheme, factor):
    src = _source(tmp_path)
    out = tmp_path / "q"
    api.quantize(src, out, scheme)
    edit, (rows, cols) = _group_edit(scheme, factor)
    bad = _edit(out, tmp_path / "bad", edit)
    rep = api.verify(bad, src)
    r = _rows(rep)[MODULE]
    assert not rep["ok"] and not r["ok"] and not r["grid_ok"]
    assert 1 <= r["values_off_grid"] <= len(rows) * len(cols)  # only the values of that scale
    assert r["first_off_grid_row"] in rows and r["first_off_grid_column"] in cols
    assert r["its_nearest"] != r["its_stored"]
    errors = [p for p in rep["problems"] if p["severity"] == "error"]
    assert {p["tensor"] for p in errors} == {MODULE}
    assert any(f"{r['values_off_grid']} of {r['values_checked']} values are not the" in p["message"] for p in errors)
    if scheme in ("W4A16", "NVFP4A16", "MXFP4A16"):  # what the module's other limits let through
        assert r["rel_l2"] <= r["threshold"] and r["gain_ok"] and r["rows_ok"]
    others = [m for m in _rows(rep).values() if m["module"] != MODULE]
    assert all(m["grid_ok"] for m in others)


def test_one_code_moved_by_one_step_is_found_where_it_is(tmp_path):
    """W4A16: one 4-bit code of row 9 moved one step (a value that is not at a midpoint: the tie rule cannot accept it)."""
    src = _source(tmp_path, seed=2)
    out = tmp_path / "q"
    api.quantize(src, out, "W4A16")
    ref = load_file(next(p for p in src.glob("*.safetensors") if MODULE + ".weight" in load_file(p)))[MODULE + ".weight"].float()
    q = load_file(next(p for p in out.glob("*.safetensors") if MODULE + ".weight_packed" in load_file(p)))
    s = q[MODULE + ".weight_scale"].float()
    x = ref[9] / s[9].repeat_interleave(128)
    frac = (x - x.floor() - 0.5).abs()  # distance of each quotient from a midpoint
    col = int(torch.nonzero((frac > 4 * TIE * x.abs().clamp_min(1)) & (x.abs() < 6)).reshape(-1)[0])

    def move(ts):
        w = ts[MODULE + ".weight_packed"].view(torch.uint8)  # 8 codes a word, low nibble first, offset by 8
        byte, shift = col // 2, 4 * (col % 2)
        code = (int(w[9, byte]) >> shift) & 0xF
        new = code + 1 if code < 15 else code - 1
        w[9, byte] = (int(w[9, byte]) & ~(0xF << shift) & 0xFF) | (new << shift)

    rep = api.verify(_edit(out, tmp_path / "bad", move), src)
    r = _rows(rep)[MODULE]
    assert r["values_off_grid"] == 1 and (r["first_off_grid_row"], r["first_off_grid_column"]) == (9, col)
    assert abs(r["its_stored"] - r["its_nearest"]) == 1.0
    assert r["its_reference"] == pytest.approx(float(ref[9, col]))
    assert r["its_scale"] == pytest.approx(float(s[9, col // 128]))


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W8A8"])
def test_2of4_values_are_judged_and_a_row_scale_off_by_15_percent_fails(tmp_path, scheme):
    """sparse-24-bitmask over FP8/int8: the codes decompressed (zeros where pruned) against the reference pruned 2:4 by
    verify; a new user's row scale x1.15 passed the row limit (0.155 < 0.2) when these values were not judged."""
    src = _source(tmp_path, seed=3)
    out = tmp_path / "q"
    api.quantize(src, out, scheme, sparsity="2:4")
    rep = api.verify(out, src)
    assert rep["ok"], rep["problems"]
    assert all(r["values_off_grid"] == 0 and r["values_unchecked"] is None for r in rep["tensors"])
    assert _rows(rep)[MODULE]["values_checked"] == N * K  # the pruned positions too: code 0 where the pruned reference is 0

    def scale(ts):
        s = ts[MODULE + ".weight_scale"]
        s[3] = (s[3].float() * 1.15).to(s.dtype)

    rep = api.verify(_edit(out, tmp_path / "bad", scale), src)
    r = _rows(rep)[MODULE]
    assert not rep["ok"] and r["values_off_grid"] >= 1 and r["first_off_grid_row"] == 3


def test_a_format_not_read_code_by_code_is_said_not_judged(tmp_path):
    """marlin-24 (a kernel layout over all rows): its rows say why its values were not judged, and a note names it."""
    src = _source(tmp_path, seed=3)
    out = tmp_path / "m"
    api.quantize_to_target(src, out, "W4A16", "marlin-24", sparsity="2:4")
    rep = api.verify(out, src)
    assert rep["ok"], rep["problems"]
    rows = _rows(rep)
    assert all(r["values_checked"] == 0 and r["grid_ok"] and r["values_unchecked"] == "marlin-24 values are not read code by code" for r in rows.values())
    notes = [p["message"] for p in rep["problems"] if p["severity"] == "note" and "not judged one by one" in p["message"]]
    assert notes == [
        f"the values of {len(rows)} quantized module(s) are not judged one by one against their scales (marlin-24 values are not read "
        "code by code); their error, gain and rows still are"
    ]


def test_a_requantized_output_is_judged_against_its_quantized_source_not_the_original(tmp_path):
    """FP8_BLOCK -> NVFP4A16: its values are rounded from the FP8 block values. Against that checkpoint every value is
    judged; against the bf16 original (the provenance says it was requantized) none is, with a note saying what to give;
    without the provenance, the off-grid values fail and the message names that cause too."""
    src = _source(tmp_path, seed=4)
    fp8 = tmp_path / "fp8b"
    api.quantize(src, fp8, "FP8_BLOCK")
    out = tmp_path / "nvfp4"
    api.quantize(fp8, out, "NVFP4A16")
    rep = api.verify(out, fp8)
    assert rep["ok"] and all(r["values_checked"] > 0 and r["values_off_grid"] == 0 for r in rep["tensors"])
    rep = api.verify(out, src)
    assert rep["ok"], rep["problems"]
    assert all(r["values_checked"] == 0 and f"requantized from the quantized checkpoint {fp8}" in r["values_unchecked"] for r in rep["tensors"])
    notes = [p["message"] for p in rep["problems"] if p["severity"] == "note" and "not judged one by one" in p["message"]]
    assert len(notes) == 1 and "give that as --reference to judge them" in notes[0]
    (out / "ctconvert-provenance.json").unlink()  # another tool's output: nothing says where its values come from
    index = json.loads((out / "model.safetensors.index.json").read_text())
    (out / "model.safetensors.index.json").write_text(json.dumps(dict(index, metadata={})))  # (nor records ctconvert's)
    rep = api.verify(out, src)
    assert not rep["ok"]
    errors = [p["message"] for p in rep["problems"] if p["severity"] == "error"]
    assert errors and all("or the output was not rounded from this reference" in e for e in errors)
