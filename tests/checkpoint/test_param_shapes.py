"""verify, no reference: the sizes of the non-quantized per-layer parameters (q/k norms, MoE routers, attention biases,
DeepSeek's router bias and MLA norms) against config.json, as vLLM 0.33 builds them (ctconvert/checkpoint/param_shapes.py),
and a DeepSeek router bias stored where vLLM builds none (expected.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ctconvert import api
from ctconvert.checkpoint.param_shapes import PARAM_SHAPES_CHECK

from .test_expected import TINY, TINY_MLA, TINY_MOE, _saved_model, damaged, transformers_or_skip
from helpers import save_tiny

L = "model.layers."


def _model(family: str):
    t = transformers_or_skip()
    if family == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**TINY, head_dim=64))
    if family == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**TINY))
    if family == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2))
    if family == "deepseek_v3_greedy":  # the router bias transformers stores, under a config vLLM builds none for
        cfg = dict(**TINY_MOE, **TINY_MLA, q_lora_rank=128, n_shared_experts=1, topk_method="greedy")
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(**dict(TINY, num_key_value_heads=2), **cfg))
    return _saved_model(family)  # olmoe, deepseek_v3 (topk_method noaux_tc), glm4_moe


FAMILIES = ("qwen3", "qwen2", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "deepseek_v3_greedy")


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    """family -> ctconvert's W4A16 output of a checkpoint transformers' own class saved (3 layers)."""
    tmp = tmp_path_factory.mktemp("shapes")
    out = {}
    for family in FAMILIES:
        api.quantize(save_tiny(lambda: _model(family), tmp / family), tmp / f"{family}-W4A16", "W4A16", device="cpu")  # noqa: B023
        out[family] = tmp / f"{family}-W4A16"
    out["tmp"] = tmp
    return out


def _resized(outs, family: str, tensor: str, size: int):
    """A foreign copy of the family's output whose ``tensor`` is cut to (or padded with zeros to) ``size`` rows."""
    t = load_file(outs[family] / "model.safetensors")[tensor]
    new = t[:size] if size <= t.shape[0] else torch.cat([t, torch.zeros(size - t.shape[0], *t.shape[1:], dtype=t.dtype)])
    return damaged(outs[family], outs["tmp"] / f"{family}-{tensor}-{size}", add={tensor: new.contiguous()})


def _shape_errors(path) -> list[dict]:
    found = [p for p in api.verify(path)["problems"] if p["severity"] == "error" and " builds [" in p["message"]]
    said = [dict(p, severity="error", message=p["message"].removesuffix(" (`ctconvert verify` fails it)")) for p in api.inspect(path)["problems"]]
    assert found == [p for p in said if " builds [" in p["message"]]  # inspect: the same, as warnings (verify fails them)
    return found


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "deepseek_v3_greedy"])
def test_correct_outputs_have_no_size_error(outs, family):
    """No false failure: each correct output (and its foreign copy) passes verify, the size check listed."""
    for path in (outs[family], damaged(outs[family], outs["tmp"] / f"{family}-foreign")):
        rep = api.verify(path)
        assert rep["ok"], rep["problems"]
        assert PARAM_SHAPES_CHECK in rep["checked"]["checks"]
        assert _shape_errors(path) == []


#: (family, tensor, size written, the message expected)
DAMAGED = [
    (
        "qwen3",
        f"{L}0.self_attn.k_norm.weight",
        32,
        f"{L}0.self_attn.k_norm.weight is [32], where vLLM 0.33 qwen3.py Qwen3Attention builds [head_dim] = [64] (config.json head_dim)",
    ),
    (
        "qwen3",
        f"{L}1.self_attn.q_norm.weight",
        96,
        f"{L}1.self_attn.q_norm.weight is [96], where vLLM 0.33 qwen3.py Qwen3Attention builds [head_dim] = [64] (config.json head_dim)",
    ),
    (
        "olmoe",
        f"{L}2.self_attn.q_norm.weight",
        64,
        f"{L}2.self_attn.q_norm.weight is [64], where vLLM 0.33 olmoe.py OlmoeAttention builds [num_attention_heads * head_dim] = [128] "
        "(config.json num_attention_heads, hidden_size / num_attention_heads)",
    ),
    (
        "qwen2",
        f"{L}0.self_attn.q_proj.bias",
        64,
        f"{L}0.self_attn.q_proj.bias is [64], where vLLM 0.33 qwen2.py Qwen2Attention builds [num_attention_heads * head_dim] = [128] "
        "(config.json num_attention_heads, hidden_size / num_attention_heads)",
    ),
    (
        "qwen2",
        f"{L}1.self_attn.v_proj.bias",
        128,
        f"{L}1.self_attn.v_proj.bias is [128], where vLLM 0.33 qwen2.py Qwen2Attention builds [num_key_value_heads * head_dim] = [64] "
        "(config.json num_key_value_heads, hidden_size / num_attention_heads)",
    ),
    (
        "mixtral",
        f"{L}0.block_sparse_moe.gate.weight",
        3,
        f"{L}0.block_sparse_moe.gate.weight is [3, 128], where vLLM 0.33 mixtral.py MixtralMoE builds [num_local_experts, hidden_size] = [4, 128] "
        "(config.json num_local_experts, hidden_size)",
    ),
    (
        "deepseek_v3",
        f"{L}1.mlp.gate.e_score_correction_bias",
        8,
        f"{L}1.mlp.gate.e_score_correction_bias is [8], where vLLM 0.33 deepseek_v2.py DeepseekV2MoE builds [n_routed_experts] = [4] "
        "(config.json n_routed_experts)",
    ),
    (
        "deepseek_v3",
        f"{L}0.self_attn.kv_a_layernorm.weight",
        64,
        f"{L}0.self_attn.kv_a_layernorm.weight is [64], where vLLM 0.33 deepseek_v2.py DeepseekV2MLAAttention builds [kv_lora_rank] = [128] "
        "(config.json kv_lora_rank)",
    ),
    (
        "glm4_moe",
        f"{L}2.mlp.gate.e_score_correction_bias",
        3,
        f"{L}2.mlp.gate.e_score_correction_bias is [3], where vLLM 0.33 glm4_moe.py Glm4MoE builds [n_routed_experts] = [4] (config.json n_routed_experts)",
    ),
]


@pytest.mark.parametrize("family,tensor,size,message", DAMAGED, ids=[f"{d[0]}-{d[1].split('.', 3)[3]}-{d[2]}" for d in DAMAGED])
def test_resized_parameter_is_an_error(outs, family, tensor, size, message):
    """A parameter cut short or padded fails verify with one error naming its shard, the tensor, both sizes and the
    config keys; nothing else of the checkpoint is blamed by this check."""
    path = _resized(outs, family, tensor, size)
    found = _shape_errors(path)
    assert [(p["tensor"], p["file"]) for p in found] == [(tensor, str(path / "model.safetensors"))]
    assert found[0]["message"] == message + ": vLLM refuses the checkpoint"
    assert not api.verify(path)["ok"]


def test_router_bias_without_noaux_tc_is_an_error(outs):
    """DeepSeek-V3 saved with topk_method "greedy" stores e_score_correction_bias, which vLLM 0.33 deepseek_v2.py builds
    only where topk_method is noaux_tc: an error for every MoE layer's (1 and 2; layer 0 is dense)."""
    rep = api.verify(outs["deepseek_v3_greedy"])
    found = [p for p in rep["problems"] if p["severity"] == "error" and "e_score_correction_bias" in p["message"]]
    assert [p["tensor"] for p in found] == [f"{L}{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    assert found[0]["message"].startswith(f"extra: {L}1.mlp.gate.e_score_correction_bias is stored, but vLLM 0.33 deepseek_v2.py DeepseekV2MoE")
    assert "(config.json topk_method: 'greedy'), so its load_weights has no parameter for it (KeyError) and vLLM refuses" in found[0]["message"]
    fix = 'set "topk_method": "noaux_tc" in the source\'s config.json if its router was trained with that bias, then convert again'
    assert found[0]["message"].endswith(fix)
    assert "DeepseekV3Config" not in found[0]["message"]  # said only where the key is absent
    assert not rep["ok"]
    seen = [p for p in api.inspect(outs["deepseek_v3_greedy"])["problems"] if "e_score_correction_bias" in p["message"]]
    assert seen == [dict(p, severity="warning", message=p["message"] + " (`ctconvert verify` fails it)") for p in found]  # inspect says so too


def test_parameter_vllm_does_not_build_is_not_sized(outs):
    """A q_proj.bias stored where Qwen3's attention_bias is false (qwen3.py builds none) is not a size error: its error
    is expected.py's extra tensor, which verify reports instead."""
    tensor = f"{L}0.self_attn.q_proj.bias"
    path = damaged(outs["qwen3"], outs["tmp"] / "qwen3-add-qbias", add={tensor: torch.zeros(64, dtype=torch.bfloat16)})
    assert _shape_errors(path) == []
    rep = api.verify(path)
    assert not rep["ok"] and any(p["tensor"] == tensor and p["message"].startswith("extra") for p in rep["problems"])


#: how quantize's router-bias note ends
TAIL = "vLLM refuses this output and `ctconvert verify OUT` fails it (it is written for other loaders)"


def test_quantize_notes_the_router_bias_before_any_work(outs):
    """quantize says in its plan (a dry run too) that a DeepSeek source stores a router bias vLLM 0.33 builds no
    parameter for (verify's error on the output, in its words), or lacks one it builds (noaux_tc, the bias tensors
    removed); nothing where they agree (the Hub's configs) or for another family."""
    tmp = outs["tmp"]
    for dry in (True, False):
        res = api.quantize(tmp / "deepseek_v3_greedy", tmp / f"greedy-note-{dry}", "W4A16", device="cpu", dry_run=dry)
        (note,) = [n for n in res.notes if "e_score_correction_bias" in n]
        err = next(p for p in api.verify(outs["deepseek_v3_greedy"])["problems"] if "e_score_correction_bias" in p["message"])
        assert note == f"the source's routers (2; the first): {err['message']}; {TAIL}"  # layers 1 and 2 (0 is dense)
        assert res.warnings == [note] and res.to_dict()["warnings"] == [note]  # a warning: shown with -q too
    bare = damaged(tmp / "deepseek_v3", tmp / "deepseek_v3-no-bias", drop=[f"{L}{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)])
    res = api.quantize(bare, tmp / "no-bias-note", "W4A16", device="cpu")
    (note,) = [n for n in res.notes if "e_score_correction_bias" in n]
    assert note.startswith(f"the source's routers (2; the first): missing: {L}1.mlp.gate.e_score_correction_bias: the router lacks e_score_correction_bias")
    err = next(p for p in api.verify(tmp / "no-bias-note")["problems"] if "e_score_correction_bias" in p["message"])
    assert err["tensor"] == f"{L}1.mlp.gate.e_score_correction_bias" and note.endswith(f"{err['tensor']}: {err['message'].removeprefix('missing: ')}; {TAIL}")
    assert res.warnings == [note]
    for family in ("deepseek_v3", "glm4_moe", "qwen3"):
        res = api.quantize(tmp / family, tmp / f"{family}-note", "W4A16", device="cpu", dry_run=True)
        assert not [n for n in res.notes if "e_score_correction_bias" in n] and res.warnings == [], family


def test_quiet_quantize_still_warns_that_vllm_refuses_the_output(outs):
    """-q drops the summary and the notes, not the warning that vLLM refuses the output (stderr, exit 0: it is
    written for other loaders); a run with nothing to warn about stays silent; the full run says warning, not note."""
    from click.testing import CliRunner

    from ctconvert.cli import main

    tmp = outs["tmp"]
    for src, warned in (("deepseek_v3_greedy", True), ("deepseek_v3", False)):
        for quiet in (True, False):
            out = tmp / f"quiet-{src}-{quiet}"
            r = CliRunner().invoke(main, [*(["-q"] if quiet else []), "quantize", str(tmp / src), "-o", str(out), "--scheme", "W4A16", "--device", "cpu"])
            assert r.exit_code == 0 and (out / "config.json").exists(), r.output
            warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
            assert len(warnings) == warned and all(w.endswith(TAIL) and "e_score_correction_bias" in w for w in warnings)
            assert (r.stdout == "") == quiet and not [ln for ln in r.stderr.splitlines() if "e_score_correction_bias" in ln and ln.startswith("note")]
            if quiet:
                assert r.stderr.strip() == (warnings[0] if warned else "")


def test_a_target_outputs_warning_names_the_verify_that_judges_it(outs, tmp_path):
    """With --target, verify of the kernel-native output does not judge what vLLM builds (``checked.not_checked``, and a
    line saying so): quantize's warning names plain verify of the compressed-tensors form instead of ``verify OUT``."""
    from click.testing import CliRunner

    from ctconvert.checkpoint.expected import EXPECTED_CHECK
    from ctconvert.cli import main

    src, out = outs["tmp"] / "deepseek_v3_greedy", tmp_path / "marlin"
    res = api.quantize(src, out, "W4A16", device="cpu", target="marlin", group_size=32)
    (note,) = [n for n in res.warnings if "e_score_correction_bias" in n]
    assert note.endswith("; vLLM refuses this output and plain `ctconvert verify` fails its compressed-tensors form (it is written for other loaders)")
    rep = api.verify(out)
    assert rep["checked"]["not_checked"] == [EXPECTED_CHECK]
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert "the parameters vLLM builds are not judged in a kernel-native output" in r.stdout


GPT_OSS_CUTS = [
    (f"{L}1.mlp.experts.down_proj_bias", 1, "[num_local_experts, hidden_size] = [4, 128] (config.json num_local_experts, hidden_size)"),
    (f"{L}0.mlp.experts.gate_up_proj_bias", 1, "[num_local_experts, 2 * intermediate_size] = [4, 128] (config.json num_local_experts, intermediate_size)"),
    (f"{L}0.mlp.router.bias", 0, "[num_local_experts] = [4] (config.json num_local_experts)"),
    (f"{L}1.mlp.router.weight", 0, "[num_local_experts, hidden_size] = [4, 128] (config.json num_local_experts, hidden_size)"),
]


@pytest.mark.parametrize("tensor,dim,built", GPT_OSS_CUTS, ids=[c[0].split(".", 3)[3] for c in GPT_OSS_CUTS])
def test_gpt_oss_router_and_fused_expert_biases_are_sized(tmp_path, tensor, dim, built):
    """gpt-oss (transformers' own class saved it; experts kept dense, as by default): its router and the biases of its
    fused experts as vLLM 0.33 gpt_oss.py MLPBlock builds them. A correct output has no size error; one of them cut in
    half along ``dim`` fails verify naming shard, tensor, both sizes and the config keys, and quantize warns of such a
    source (the new-user trial's down_proj_bias of [4, 64] had passed every check and vLLM refused it)."""
    t = transformers_or_skip()
    layers = ["sliding_attention", "full_attention", "sliding_attention"]  # (TINY's 3 layers)
    cfg = t.GptOssConfig(**dict(TINY, intermediate_size=64), num_local_experts=4, num_experts_per_tok=2, layer_types=layers)
    src = save_tiny(lambda: t.GptOssForCausalLM(cfg), tmp_path / "gpt-oss")
    good = tmp_path / "good"
    assert api.quantize(src, good, "W4A16", device="cpu").warnings == []
    assert _shape_errors(good) == [] and api.verify(good)["ok"]
    w = load_file(good / "model.safetensors")[tensor]
    cut = w.narrow(dim, 0, w.shape[dim] // 2).contiguous()
    path = damaged(good, tmp_path / "cut", add={tensor: cut})
    found = _shape_errors(path)
    assert [(p["tensor"], p["file"]) for p in found] == [(tensor, str(path / "model.safetensors"))]
    assert found[0]["message"] == f"{tensor} is {list(cut.shape)}, where vLLM 0.33 gpt_oss.py MLPBlock builds {built}: vLLM refuses the checkpoint"
    bad_src = damaged(src, tmp_path / "cut-src", add={tensor: cut})
    (warning,) = api.quantize(bad_src, tmp_path / "cut-out", "W4A16", device="cpu").warnings
    assert warning.startswith(f"the source {bad_src}: {tensor}: {found[0]['message']}")
    assert not api.verify(tmp_path / "cut-out")["ok"]


@pytest.mark.parametrize("rows,cols", [(1, 128), (2, 128), (1, 64), (None, 128), (None, 64)])
def test_qwen2_moe_shared_expert_gate_is_sized(tmp_path, rows, cols):
    """Qwen2-MoE's shared_expert_gate (vLLM 0.33 qwen2_moe.py Qwen2MoeSparseMoeBlock: ReplicatedLinear(hidden_size, 1)):
    the saved one passes, and a 1-D [hidden_size] (its load_weights makes it [1, hidden_size]); one of another size fails
    verify, naming it and [1, hidden_size]."""
    t = transformers_or_skip()
    cfg = t.Qwen2MoeConfig(**TINY, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    out = tmp_path / "out"
    api.quantize(save_tiny(lambda: t.Qwen2MoeForCausalLM(cfg), tmp_path / "src"), out, "W4A16", device="cpu")
    name = f"{L}1.mlp.shared_expert_gate.weight"
    gate = load_file(out / "model.safetensors")[name]
    assert list(gate.shape) == [1, TINY["hidden_size"]]
    shape = [cols] if rows is None else [rows, cols]
    path = damaged(out, tmp_path / "cut", add={name: torch.zeros(*shape, dtype=gate.dtype)}) if shape != list(gate.shape) else out
    found = _shape_errors(path)
    built = "vLLM 0.33 qwen2_moe.py Qwen2MoeSparseMoeBlock builds [1, hidden_size] = [1, 128] (config.json hidden_size)"
    loads = cols == 128 and rows in (None, 1)
    want = [] if loads else [f"{name} is {shape}, where {built}: vLLM refuses the checkpoint"]
    assert [p["message"] for p in found] == want
    assert api.verify(path)["ok"] == loads


def test_kv_biases_follow_the_key_value_heads_transformers_reads():
    """A Qwen2 config without num_key_value_heads: transformers 5.20's Qwen2Config holds 32, so vLLM builds k/v biases of
    32 heads, and the error gives that number; with null, num_attention_heads (config_types.kv_heads, as the q/k/v rows
    are judged)."""
    from pathlib import Path

    from ctconvert.checkpoint.param_shapes import param_shape_problems
    from ctconvert.checkpoint.safetensors_io import TensorInfo

    cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "num_attention_heads": 4}
    names = ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.bias")
    tensors = {n: TensorInfo(n, Path("m.safetensors"), "BF16", (128,), 0, 256) for n in names}
    (p,) = param_shape_problems(cfg, tensors, {})
    assert p.message == (  # the default's number, which no config.json holds, as the k/v rows' error gives it (files_check)
        "model.layers.0.self_attn.k_proj.bias is [128], where vLLM 0.33 qwen2.py Qwen2Attention builds [num_key_value_heads * head_dim] = [2048] "
        "(config.json num_key_value_heads (absent: transformers' Qwen2Config default, 32), hidden_size / num_attention_heads): "
        "vLLM refuses the checkpoint"
    )
    assert [p.message for p in param_shape_problems(dict(cfg, num_key_value_heads=None), tensors, {})] == [
        "model.layers.0.self_attn.k_proj.bias is [128], where vLLM 0.33 qwen2.py Qwen2Attention builds [num_key_value_heads * head_dim] = [256] "
        "(config.json num_key_value_heads (null: transformers' Qwen2Config takes num_attention_heads), hidden_size / num_attention_heads): "
        "vLLM refuses the checkpoint"
    ]
    assert param_shape_problems(dict(cfg, num_key_value_heads=2), tensors, {}) == []


@pytest.mark.parametrize(
    ("model_type", "arch", "default"),
    [("qwen3", "Qwen3ForCausalLM", 128), ("gemma3_text", "Gemma3ForCausalLM", 256), ("qwen3_moe", "Qwen3MoeForCausalLM", None)],
)
def test_q_k_norms_follow_the_head_dim_transformers_reads(model_type, arch, default):
    """A config without head_dim: transformers 5.20's Qwen3Config holds 128 and Gemma3TextConfig 256 (not hidden_size /
    num_attention_heads), and vLLM builds the q/k norms with it; Qwen3MoeConfig has none, and vLLM computes
    hidden_size / num_attention_heads (config_types.head_dim; the new-user trial's q3-headdim-absent passed verify)."""
    from pathlib import Path

    from ctconvert.checkpoint.param_shapes import param_shape_problems
    from ctconvert.checkpoint.safetensors_io import TensorInfo

    cfg = {"model_type": model_type, "architectures": [arch], "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2}
    names = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight")
    tensors = {n: TensorInfo(n, Path("m.safetensors"), "BF16", (32,), 0, 64) for n in names}  # sized hidden_size / heads = 32
    got = [p.message for p in param_shape_problems(cfg, tensors, {})]
    if default is None:
        assert got == []
    else:
        assert len(got) == 2 and all(f"builds [head_dim] = [{default}] (config.json head_dim, absent: transformers'" in m for m in got)
    assert param_shape_problems(dict(cfg, head_dim=32), tensors, {}) == []  # the config's own value wins
