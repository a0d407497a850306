"""The imatrix observers end to end: the calibration pass' E[x^2] statistic and the output bytes equal llm-compressor's.

``tests/data/observers/llmc_imatrix.safetensors`` (``scripts/llmc_imatrix_reference.py``: llm-compressor 0.14.0.1
``oneshot`` on a tiny Llama, fed fixed token ids) holds the source checkpoint, the ids, each Linear's importance as
llm-compressor's observer held it, and the compressed tensors it wrote. ctconvert calibrates the same checkpoint on
the same ids (``--calibration ids.json``): the statistic is the same fp32 bits (eager attention, each sample added in
order, also from micro-batches of several samples), and so is every compressed tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.cli import main

from helpers import assert_reference_tensors

transformers = pytest.importorskip("transformers")

REF = Path(__file__).resolve().parents[1] / "data" / "observers" / "llmc_imatrix.safetensors"
RUNS = ["W4A16/imatrix_mse", "W4A16_ASYM/imatrix_mse", "FP8_DYNAMIC/imatrix_mse", "NVFP4A16/nvfp4_expanded_imatrix"]


def _reference():
    from safetensors import safe_open

    f = safe_open(str(REF), "pt")
    return f, json.loads(f.metadata()["reference"])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The reference's checkpoint and its token ids file: ``(folder, ids file, samples, seq_len)``."""
    from safetensors.torch import save_file

    f, meta = _reference()
    root = tmp_path_factory.mktemp("imatrix")
    src = root / "src"
    src.mkdir()
    save_file({k[len("source/") :]: f.get_tensor(k) for k in f.keys() if k.startswith("source/")}, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(meta["config"]))
    ids = root / "ids.json"
    ids.write_text(json.dumps(meta["token_ids"]))
    return src, ids, len(meta["token_ids"]), len(meta["token_ids"][0])


def _args(source, *extra) -> list[str]:
    src, ids, n, seq = source
    return [str(src), "--calibration", str(ids), "--calibration-samples", str(n), "--calibration-seq-len", str(seq), *extra]


#: the Linears whose inputs no matmul has touched (embedding, RMSNorm): the same bits on every CPU
FIRST = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")


def _statistic(source, batch_tokens: int) -> dict[str, torch.Tensor]:
    from ctconvert.calibration.model import calibrate

    _, meta = _reference()
    stats = calibrate(open_checkpoint(source[0]), torch.tensor(meta["token_ids"]), torch.device("cpu"), importance=True, batch_tokens=batch_tokens)
    for m in meta["modules"]:
        assert stats.importance[m].count == len(meta["token_ids"]) * len(meta["token_ids"][0]), m
    return {m: stats.importance[m].sum / torch.tensor(stats.importance[m].count).float() for m in meta["modules"]}


@pytest.fixture(scope="module")
def same_forward(source) -> bool:
    """Whether this CPU's bf16 matmuls round as the reference machine's did: then the whole pass is llm-compressor's
    bits (an AMD EPYC without AVX-512 rounds some bf16 products otherwise, ~4e-3 relative after two layers)."""
    f, meta = _reference()
    got = _statistic(source, 4096)
    return all(torch.equal(got[m], f.get_tensor(f"importance/{m}")) for m in meta["modules"])


@pytest.mark.parametrize("batch_tokens", [32, 4096])
def test_statistic_equals_llmcompressor(source, batch_tokens, same_forward):
    """Every Linear's ``sum / count`` is llm-compressor's fp32 importance, bit for bit (one sample per micro-batch, and 8)
    where this CPU's matmuls round as the reference machine's; elsewhere bit for bit where no matmul came before (the
    first layer's q/k/v) and within bf16 rounding (1e-2 relative) after."""
    f, meta = _reference()
    got = _statistic(source, batch_tokens)
    for m in meta["modules"]:
        want = f.get_tensor(f"importance/{m}")
        if same_forward or m in FIRST:
            assert torch.equal(got[m], want), m
        else:
            assert torch.allclose(got[m], want, rtol=1e-2, atol=0), m


def test_statistic_is_off_by_default(source):
    from ctconvert.calibration.model import calibrate

    stats = calibrate(open_checkpoint(source[0]), torch.zeros(1, 8, dtype=torch.int64), torch.device("cpu"))
    assert stats.importance == {} and stats.inputs


def _given_reference_statistic(monkeypatch) -> None:
    """The calibration pass hands the observers llm-compressor's statistic (``Importance(sum=importance, count=1)``:
    ``sum / count`` is its bits) instead of this machine's: what follows the statistic is the same on every CPU."""
    from ctconvert.calibration import apply
    from ctconvert.formats.observers.imatrix import Importance

    f, meta = _reference()
    real = apply.run

    def run(*a, **kw):
        done = real(*a, **kw)
        return apply.Calibrated(done.tensors, done.notes, {**done.importance, **{m: Importance(f.get_tensor(f"importance/{m}"), 1) for m in meta["modules"]}})

    monkeypatch.setattr(apply, "run", run)


@pytest.mark.parametrize("given", ["statistic", "pass"])
@pytest.mark.parametrize("run", RUNS)
def test_bytes_equal_llmcompressor(source, tmp_path, run, given, same_forward, monkeypatch):
    """``--observer NAME`` on a data-free scheme calibrates and writes oneshot's tensors and observer config: given
    llm-compressor's statistic on every CPU, and from this run's own pass where the CPU's matmuls round as the
    reference machine's (else the statistic test above bounds the pass)."""
    if given == "pass" and not same_forward:
        pytest.skip("this CPU's bf16 matmuls round otherwise than the reference machine's (test_statistic_equals_llmcompressor bounds them)")
    if given == "statistic":
        _given_reference_statistic(monkeypatch)
    scheme, name = run.split("/")
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["quantize", *_args(source, "-o", str(out), "--scheme", scheme, "--observer", name, "--json")])
    assert res.exit_code == 0, res.output
    assert_reference_tensors(REF, f"{run}/", out)
    _, meta = _reference()
    ref = meta["runs"][run]["config_groups"]["group_0"]["weights"]
    got = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (got["observer"], got["observer_kwargs"]) == (ref["observer"], ref["observer_kwargs"]) == (name, {})
    doc = json.loads(res.output)
    assert doc["calibration"]["schemes"] == [f"observer {name}"] and doc["calibration"]["tokens"] == source[2] * source[3]


def test_dry_run_shows_the_calibration(source):
    res = CliRunner().invoke(main, ["quantize", *_args(source, "--scheme", "W4A16", "--observer", "imatrix_mse", "--dry-run")])
    assert res.exit_code == 0, res.output
    assert "observer imatrix_mse (config group group_0)" in res.output
    assert "calibration (observer imatrix_mse): 2 decoder layers, one at a time, 8 x 32 = 256 tokens" in res.output


def test_data_free_observer_needs_no_calibration(source, tmp_path):
    res = CliRunner().invoke(main, ["quantize", str(source[0]), "-o", str(tmp_path / "o"), "--scheme", "W4A16", "--observer", "memoryless_mse", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output).get("calibration") is None


def test_encoder_model_is_refused_by_name(tmp_path):
    """A model calibration cannot run (an encoder): the observer is named as what needs the pass, one line, exit 4."""
    from safetensors.torch import save_file

    src = tmp_path / "bert"
    src.mkdir()
    save_file({"encoder.layer.0.attention.self.query.weight": torch.zeros(128, 128, dtype=torch.bfloat16)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 128}))
    res = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "W4A16", "--observer", "imatrix_mse"])
    assert res.exit_code == 4
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--observer imatrix_mse needs a calibration pass" in lines[0] and "BertModel is not one" in lines[0], res.output
    assert "use a data-free observer (memoryless_mse, nvfp4_expanded_mse)" in lines[0]


def test_module_without_data_is_searched_unweighted(source, tmp_path):
    """lm_head is not run by the calibration pass (no token reaches it here): llm-compressor's fallback, said in a note."""
    from safetensors import safe_open

    from ctconvert.formats import WeightArgs, get_format
    from ctconvert.formats.fp4 import nvfp4_global_scale
    from ctconvert.formats.observers import OBSERVERS, range_absmax

    out = tmp_path / "out"
    args = _args(source, "-o", str(out), "--scheme", "NVFP4A16", "--observer", "nvfp4_expanded_imatrix", "--lm-head", "nvfp4a16", "--json")
    res = CliRunner().invoke(main, ["quantize", *args])
    assert res.exit_code == 0, res.output
    note = "nvfp4_expanded_imatrix: no importance data available for 1 module (lm_head): searched unweighted, as llm-compressor does"
    assert note in json.loads(res.output)["notes"]
    f, _ = _reference()
    w = f.get_tensor("source/lm_head.weight")
    nv = WeightArgs(type="float", num_bits=4, strategy="tensor_group", group_size=16)
    mn, mx = OBSERVERS["nvfp4_expanded_imatrix"].ranges(w, nv)
    want = get_format("nvfp4-pack-quantized").quantize(w, nv, nvfp4_global_scale(range_absmax(mn, mx), w.dtype), ranges=(mn, mx))
    with safe_open(str(out / "model.safetensors"), "pt") as got:
        for name in ("weight_packed", "weight_scale"):
            a, b = got.get_tensor(f"lm_head.{name}"), want[name]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_recipe_group_observer(source, tmp_path):
    """A recipe whose group names ``imatrix_mse`` calibrates as ``--observer`` does: oneshot's bytes for that recipe."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      ignore: [lm_head]\n      config_groups:\n"
        "        group_0:\n          targets: [Linear]\n"
        "          weights: {num_bits: 4, type: int, symmetric: true, group_size: 128, strategy: group, observer: imatrix_mse}\n"
    )
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["quantize", *_args(source, "-o", str(out), "--recipe", str(recipe))])
    assert res.exit_code == 0, res.output
    assert_reference_tensors(REF, "W4A16/imatrix_mse/", out)
