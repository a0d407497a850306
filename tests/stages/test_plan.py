"""The plan stage's error (a shape the scheme cannot take): a real run stops at it only after every check a dry run
makes too (:class:`~ctconvert.stages.plan.PlanErrorStage`), so both stop at the same first error and exit code."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ctconvert import api
from ctconvert.cli import main
from ctconvert.errors import UnsupportedError, UsageError
from tests.conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

OBSERVER_REFUSAL = "--observer memoryless_mse cannot take scheme FP8_BLOCK (config group group_0): observers do not take the 'block' strategy"


@pytest.fixture
def narrow_kv(tmp_path):
    """A Llama whose k_proj/v_proj have 64 rows: not a whole FP8_BLOCK block of 128 (the plan's error)."""
    cfg = {**LLAMA_CONFIG, "num_key_value_heads": 1}
    return write_checkpoint(tmp_path / "narrow-kv", llama_tensors(cfg), cfg)


@pytest.mark.parametrize("dry", [False, True])
def test_an_observer_refusal_comes_before_the_shape_error(narrow_kv, tmp_path, dry):
    """FP8_BLOCK with a search observer is a usage error (exit 2) whatever the shapes, in a real run as in a dry run."""
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", str(narrow_kv), "-o", str(out), "-s", "FP8_BLOCK", "--observer", "memoryless_mse", *(["--dry-run"] * dry)])
    assert r.exit_code == 2
    assert f"error: {OBSERVER_REFUSAL}" in r.output
    assert "block height" not in r.output.split("error:", 1)[1]
    assert not out.exists()


def test_the_real_run_still_stops_at_the_shape_error(narrow_kv, tmp_path):
    """Without the observer: the shape error, exit 4, nothing written; the dry run names the same error."""
    out = tmp_path / "out"
    with pytest.raises(UnsupportedError, match=r"tensor 'model.layers.0.self_attn.k_proj.weight': \[64, 256\] .*block height 128 of FP8_BLOCK"):
        api.quantize(narrow_kv, out, "FP8_BLOCK")
    assert not out.exists() and not list(tmp_path.glob(".*out*"))
    dry = api.quantize(narrow_kv, out, "FP8_BLOCK", dry_run=True)
    assert isinstance(dry.error, UnsupportedError) and "k_proj.weight': [64, 256]" in str(dry.error)
    with pytest.raises(UsageError, match="cannot take scheme FP8_BLOCK"):
        api.quantize(narrow_kv, out, "FP8_BLOCK", observer="memoryless_mse")


#: how quantize's warning of a source vLLM refuses ends (the output carries it)
REFUSED = "; `ctconvert verify OUT` fails it (it is written for other loaders)"


@pytest.mark.parametrize(
    "edit,first",
    [
        ({"hidden_size": 512}, "the source: model.embed_tokens.weight: config.json's hidden_size is 512, but model.embed_tokens.weight holds 256 columns"),
        ({"num_hidden_layers": 1}, "the source: config.json's num_hidden_layers is 1 (model.layers.0 .. model.layers.0), but the checkpoint stores 1"),
        ({"head_dim": 32}, "the source: model.layers.0.self_attn.k_proj: config.json's num_key_value_heads 2 x head_dim 32 = 64 output rows, but k_proj"),
    ],
    ids=["hidden_size", "layer-past-the-count", "head_dim"],
)
def test_a_source_verify_would_fail_is_warned_of_by_quantize(tmp_path, edit, first):
    """A config that contradicts the source's tensors (which the output carries): one warning naming the first problem
    and counting the rest, in a dry run and a real run (-q too), exit 0, and the output fails verify as it says; the
    same source unedited gets none. A Llama's layer past num_hidden_layers is not taken for an MTP layer kept dense."""
    cfg = {**LLAMA_CONFIG, **edit}
    src = write_checkpoint(tmp_path / "src", llama_tensors(LLAMA_CONFIG), cfg)
    good = write_checkpoint(tmp_path / "good", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    dry = api.quantize(src, None, "W8A16", device="cpu", dry_run=True)
    (warning,) = dry.warnings
    assert warning.startswith(first) and warning.endswith(REFUSED) and warning in dry.notes
    assert not [r for r in dry.plan.rows if (r.reason or "").startswith("MTP layer")]  # (num_hidden_layers 1: layer 1 is no MTP layer)
    r = CliRunner().invoke(main, ["-q", "quantize", str(src), "-o", str(tmp_path / "out"), "-s", "W8A16", "--device", "cpu"])
    assert r.exit_code == 0 and r.stderr.strip() == f"warning: {warning}"
    rep = api.verify(tmp_path / "out")
    assert not rep["ok"] and any(first.split(": ", 2)[-1][:40] in p["message"] for p in rep["problems"])
    assert api.quantize(good, tmp_path / "good-out", "W8A16", device="cpu").warnings == []
