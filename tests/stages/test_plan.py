"""The plan stage's error (a shape the scheme cannot take): a real run stops at it only after every check a dry run
makes too (:class:`~ctconvert.stages.plan.PlanErrorStage`), so both stop at the same first error and exit code."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ctconvert import api
from ctconvert.cli import main
from ctconvert.errors import UnsupportedError, UsageError
from tests.conftest import LLAMA_CONFIG, gpt_oss_checkpoint, llama_tensors, moe_checkpoint, write_checkpoint

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
        (
            {"hidden_size": 512},
            "the source {src}: model.embed_tokens.weight: config.json's hidden_size is 512, but model.embed_tokens.weight holds 256 columns",
        ),
        ({"num_hidden_layers": 1}, "the source {src}: config.json's num_hidden_layers is 1 (model.layers.0 .. model.layers.0), but the checkpoint stores 1"),
        ({"head_dim": 32}, "the source {src}: model.layers.0.self_attn.k_proj: config.json's num_key_value_heads 2 x head_dim 32 = 64 output rows, but k_proj"),
    ],
    ids=["hidden_size", "layer-past-the-count", "head_dim"],
)
def test_a_source_verify_would_fail_is_warned_of_by_quantize(tmp_path, edit, first):
    """A config that contradicts the source's tensors (which the output carries): one warning naming the source's folder
    and the first problem and counting the rest, in a dry run and a real run (-q too), exit 0, and the output fails
    verify as it says; the same source unedited gets none. A Llama's layer past num_hidden_layers is not taken for an
    MTP layer kept dense."""
    cfg = {**LLAMA_CONFIG, **edit}
    src = write_checkpoint(tmp_path / "src", llama_tensors(LLAMA_CONFIG), cfg)
    good = write_checkpoint(tmp_path / "good", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    dry = api.quantize(src, None, "W8A16", device="cpu", dry_run=True)
    (warning,) = dry.warnings
    first = first.format(src=src)  # (it names the source's folder: which of several conversions it is about)
    assert warning.startswith(first) and warning.endswith(REFUSED) and warning in dry.notes
    assert not [r for r in dry.plan.rows if (r.reason or "").startswith("MTP layer")]  # (num_hidden_layers 1: layer 1 is no MTP layer)
    r = CliRunner().invoke(main, ["-q", "quantize", str(src), "-o", str(tmp_path / "out"), "-s", "W8A16", "--device", "cpu"])
    assert r.exit_code == 0 and r.stderr.strip() == f"warning: {warning}"
    rep = api.verify(tmp_path / "out")
    assert not rep["ok"] and any(first.split(": ", 2)[-1][:40] in p["message"] for p in rep["problems"])
    assert api.quantize(good, tmp_path / "good-out", "W8A16", device="cpu").warnings == []


#: how quantize's warning of an output vLLM refuses ends
REFUSED_OUTPUT = "; vLLM refuses this output and `ctconvert verify OUT` fails it (it is written for other loaders)"
#: gpt-oss's experts named by a target: quantized only with --allow-unloadable (vLLM 0.33 cannot load them quantized)
EXPERTS = ["Linear", r"re:.*mlp\.experts\.\d+\..*"]
GPT_OSS_EXPERTS = (
    "gpt-oss experts: vLLM 0.33 cannot load them quantized (gpt_oss.py reads per-expert w13_*/w2_* names with no path for weight_shape or "
    "weight_global_scale; its FP8, NVFP4 and MXFP4 MoE methods have no expert bias)"
)


def test_allow_unloadable_warns_that_vllm_refuses_the_output(tmp_path):
    """--allow-unloadable quantizes gpt-oss's experts: a `warning:` line (a new-user trial saw only a note) saying that
    vLLM refuses the output and why, in the words verify fails it with, exit 0 (-q too); inspect OUT shows the same
    problem (it said none); without the option's targets, no warning and an output verify passes."""
    src = gpt_oss_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["-q", "quantize", str(src), "-o", str(out), "-s", "W4A16", "--allow-unloadable", *(f"--targets={t}" for t in EXPERTS)])
    first = "model.layers.0.mlp.experts.0.down_proj (and 23 more such modules)"
    warning = f"--allow-unloadable quantized {first}, but {GPT_OSS_EXPERTS}{REFUSED_OUTPUT}"
    assert r.exit_code == 0 and r.stderr.strip() == f"warning: {warning}"
    verified = [(p["severity"], p["message"], p.get("tensor")) for p in api.verify(out)["problems"]]
    said = f"quantized, but {GPT_OSS_EXPERTS} (and 23 more such modules)"
    assert verified == [("error", said, "model.layers.0.mlp.experts.0.down_proj")]
    shown = [(p["severity"], p["message"], p.get("tensor")) for p in api.inspect(out)["problems"]]
    assert shown == [("warning", f"{said} (`ctconvert verify` fails it)", "model.layers.0.mlp.experts.0.down_proj")]
    plain = api.quantize(src, tmp_path / "plain", "W4A16", allow_unloadable=True)
    assert plain.warnings == [] and api.verify(tmp_path / "plain")["ok"] and api.inspect(tmp_path / "plain")["problems"] == []


def test_allow_unloadable_warns_of_experts_quantized_unlike_each_other(tmp_path):
    """One expert's down_proj left dense beside quantized ones: refused without the option (exit 2), written with it
    and a warning naming the block (vLLM builds a block's experts as one fused layer), which inspect shows too."""
    src = moe_checkpoint(tmp_path, inter=128)
    ignore = "model.layers.0.mlp.experts.1.down_proj"
    with pytest.raises(UsageError, match="--allow-unloadable writes it for other loaders"):
        api.quantize(src, tmp_path / "refused", "W4A16", ignore=[ignore])
    res = api.quantize(src, tmp_path / "out", "W4A16", ignore=[ignore], allow_unloadable=True)
    mixed = (
        "experts 0, 1, 2, 3 (down_proj, gate_proj, up_proj) in config group 'group_0'; expert 1 (down_proj) dense: vLLM 0.33 builds a MoE block's "
        "experts as one fused layer with one quantization method for all of its projections, so it cannot load experts or projections quantized "
        "unlike each other; quantize every expert and projection of the block alike (--ignore all of them or none)"
    )
    assert res.warnings == [f"--allow-unloadable wrote model.layers.0.mlp.experts so: {mixed}{REFUSED_OUTPUT}"]
    assert [p["message"] for p in api.verify(tmp_path / "out")["problems"]] == [mixed]
    assert [p["message"] for p in api.inspect(tmp_path / "out")["problems"]] == [f"{mixed} (`ctconvert verify` fails it)"]
