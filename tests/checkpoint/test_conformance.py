"""Checks of a checkpoint against how its loaders read it (ctconvert/checkpoint/conformance.py): here the MoE
experts' config group as vLLM 0.33 matches it."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ctconvert import api
from ctconvert.checkpoint.conformance import vllm_expert_group
from ctconvert.cli import main
from ctconvert.errors import UsageError

from conftest import moe_checkpoint, save_config

RECIPE = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head", "re:.*mlp\\\\.gate$"]
      config_groups:
        mlp:
          targets: ["{mlp}"]
          weights: {{num_bits: 4, type: float, symmetric: true, group_size: 16, strategy: tensor_group, scale_dtype: torch.float8_e4m3fn}}
        attention:
          targets: ["Linear"]
          weights: {{num_bits: 4, type: int, symmetric: true, group_size: 128, strategy: group}}
"""


def test_vllm_matches_targets_in_config_order_then_linear():
    """The first exact name or pattern in the config's order wins (compressed-tensors would take the exact name of
    the later group), then the group that targets Linear; an ignored name has none."""
    name = "model.layers.0.mlp.experts.routed_experts.0.gate_proj"
    qcfg = {"config_groups": {"a": {"targets": ["re:.*gate_proj$"]}, "b": {"targets": [name]}, "c": {"targets": ["Linear"]}}}
    assert vllm_expert_group(name, qcfg) == "a"
    assert vllm_expert_group("model.layers.0.mlp.experts.routed_experts.0.up_proj", qcfg) == "c"
    assert vllm_expert_group(name, {**qcfg, "ignore": ["re:.*experts.*"]}) is None
    assert vllm_expert_group("x.up_proj", {"config_groups": {"a": {"targets": ["re:.*gate_proj$"]}}}) is None


BAD = r"re:.*mlp\.(experts\.\d+\.)?(gate|up|down)_proj$"  # the experts by index: not vLLM's name of them
GOOD = r"re:.*(gate|up|down)_proj$"


def test_verify_refuses_experts_vllm_would_load_with_another_group(tmp_path):
    """A config whose MLP pattern names the experts by index (compressed-tensors' names) describes experts that vLLM
    0.33, which matches `<block>.experts.routed_experts.0.<proj>`, takes for the Linear group: verify names every
    block and projection; a pattern that also matches vLLM's name passes. (quantize refuses such a recipe, so the bad
    output is the good one with its config's pattern replaced: compressed-tensors gives every module the same group.)"""
    src = moe_checkpoint(tmp_path)
    recipe = tmp_path / "good.yaml"
    recipe.write_text(RECIPE.format(mlp=GOOD.replace("\\", "\\\\")))
    api.quantize(src, tmp_path / "good", None, recipe=recipe)
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    cfg = json.loads((tmp_path / "bad" / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["mlp"]["targets"] == [GOOD]
    cfg["quantization_config"]["config_groups"]["mlp"]["targets"] = [BAD]
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg))
    outs = {tag: api.verify(tmp_path / tag) for tag in ("bad", "good")}
    bad = [p for p in outs["bad"]["problems"] if "vLLM 0.33 loads these experts" in p["message"]]
    assert not outs["bad"]["ok"]
    assert sorted(p["tensor"] for p in bad) == sorted(f"model.layers.{i}.mlp.experts.*.{p}" for i in (0, 1) for p in ("down_proj", "gate_proj", "up_proj"))
    assert all(".mlp.experts.routed_experts.0." in p["message"] and "config group 'attention'" in p["message"] for p in bad)
    assert all("wrong parameters" in p["message"] and p["file"].endswith(".safetensors") for p in bad)
    assert outs["good"]["ok"], outs["good"]["problems"]
    assert "MoE experts' group as vLLM 0.33 matches them, alike within each block" in outs["good"]["checked"]["checks"]


def test_quantize_refuses_a_recipe_whose_experts_vllm_would_load_with_another_group(tmp_path):
    """The same rule at plan time: the run stops before any work (exit 2, nothing written) naming the first block and
    projection, vLLM's name, both groups, the fix and how many; a dry run shows the plan and the same error."""
    src = moe_checkpoint(tmp_path)
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(RECIPE.format(mlp=BAD.replace("\\", "\\\\")))
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "out"), "--recipe", str(recipe)])
    assert r.exit_code == 2 and not (tmp_path / "out").exists()
    line = r.output.strip().splitlines()[-1]
    first = "model.layers.0.mlp.experts.*.down_proj"
    assert line.startswith(f"error: {first}: vLLM 0.33 loads these experts as 'model.layers.0.mlp.experts.routed_experts.0.down_proj'")
    assert "config group 'attention' takes, not 'mlp'" in line and "'re:.*down_proj$'" in line
    assert line.endswith("(6 in all: 2 MoE blocks x down_proj, gate_proj, up_proj)")
    dry = CliRunner().invoke(main, ["--json", "quantize", str(src), "-o", str(tmp_path / "out"), "--recipe", str(recipe), "--dry-run"])
    doc = json.loads(dry.stdout)
    assert dry.exit_code == 2 and doc["error"] == line.removeprefix("error: ") and doc["plan"]["tensors"]


def test_quantize_refuses_targets_that_leave_vllms_experts_unquantized(tmp_path):
    """--targets naming the experts by index only: vLLM's name of them matches no group, so it would build them
    unquantized; a pattern that also matches `routed_experts.0` (``experts\\.\\d+``) is accepted and verify passes it."""
    src = moe_checkpoint(tmp_path)
    with pytest.raises(UsageError) as e:
        api.quantize(src, tmp_path / "a", "W4A16", targets=[r"re:.*mlp\.experts\.\d+\..*"])
    assert "which no config group takes, not 'group_0'" in e.value.message and "build them unquantized" in e.value.message
    assert not (tmp_path / "a").exists()
    api.quantize(src, tmp_path / "b", "W4A16", targets=[r"re:.*experts\.\d+\..*"])
    assert api.verify(tmp_path / "b")["ok"]


def test_routers_vllm_builds_unquantized_are_refused_unless_allowed_and_verify_reports_them(tmp_path):
    """vLLM 0.33 builds Qwen2-MoE's router (``qwen2_moe.py``) as a GateLinear without a quantization config, Qwen3-MoE's
    with one: taking the router (here with the default ignores off) is refused for the first (exit 4, naming the
    module and vLLM's file), kept dense with --skip-incompatible, written with --allow-unloadable (and then reported
    by verify, exit 5), and written as asked for the second, which verify passes."""
    from ctconvert.errors import UnsupportedError

    src = moe_checkpoint(tmp_path)
    api.quantize(src, tmp_path / "q3", "W4A16", default_ignore=False, ignore=["lm_head"])
    assert api.verify(tmp_path / "q3")["ok"]
    assert "model.layers.0.mlp.gate.weight_packed" in json.loads((tmp_path / "q3" / "model.safetensors.index.json").read_text())["weight_map"]
    q2 = tmp_path / "q2src"
    shutil.copytree(src, q2)
    cfg = json.loads((q2 / "config.json").read_text())
    qwen2 = dict(cfg, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], shared_expert_intermediate_size=0)
    (q2 / "config.json").write_text(json.dumps(qwen2))
    t = load_file(q2 / "model.safetensors")  # Qwen2-MoE's q/k/v have biases (vLLM 0.33 qwen2_moe.py: bias=True): verify wants them
    t.update({k.replace(".weight", ".bias"): torch.zeros(v.shape[0], dtype=v.dtype) for k, v in t.items() if re.search(r"\.[qkv]_proj\.weight$", k)})
    # and no q_norm/k_norm, but a shared_expert_gate in every sparse block (Qwen2MoeSparseMoeBlock builds it always)
    t = {k: v for k, v in t.items() if not re.search(r"\.[qk]_norm\.", k)}
    t.update({f"model.layers.{i}.mlp.shared_expert_gate.weight": torch.zeros(1, cfg["hidden_size"], dtype=torch.bfloat16) for i in range(2)})
    save_file(t, q2 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedError) as e:
        api.quantize(q2, tmp_path / "a", "W4A16", default_ignore=False, ignore=["lm_head"])
    assert "'model.layers.0.mlp.gate.weight'" in str(e.value) and "models/qwen2_moe.py: GateLinear without quant_config" in e.value.message
    assert "--allow-unloadable" in e.value.message and not (tmp_path / "a").exists()
    kept = api.quantize(q2, tmp_path / "b", "W4A16", default_ignore=False, ignore=["lm_head"], skip_incompatible=True)
    assert {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= set(kept.ignore) and api.verify(tmp_path / "b")["ok"]
    api.quantize(q2, tmp_path / "c", "W4A16", default_ignore=False, ignore=["lm_head"], allow_unloadable=True)
    report = api.verify(tmp_path / "c")
    errors = {p["tensor"]: p["message"] for p in report["problems"] if p["severity"] == "error"}  # one per reason
    assert not report["ok"] and set(errors) == {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"}
    assert "qwen2_moe router: vLLM 0.33 builds it unquantized" in errors["model.layers.0.mlp.gate"]
    assert "the shared expert's gate: vLLM 0.33 builds it unquantized" in errors["model.layers.0.mlp.shared_expert_gate"]
    assert all("(and 1 more such module)" in m for m in errors.values())


@pytest.mark.parametrize(
    "scheme,refused",
    [("W8A8_STATIC", True), ("W8A8_STATIC_ASYM", True), ("W8A8", False), ("FP8", False), ("NVFP4", False), ("W4A16", False), ("FP8_DYNAMIC", False)],
)
def test_which_expert_schemes_vllm_has_a_fused_moe_method_for(scheme, refused):
    """vLLM 0.33's get_moe_method takes integer inputs only dynamic per token: static INT8 experts have no method."""
    from ctconvert.checkpoint.families import vllm_dense_reason, vllm_expert_scheme_reason
    from ctconvert.plan.schemes import get_scheme

    g = get_scheme(scheme).config_group([])
    why = vllm_expert_scheme_reason(g["weights"], g["input_activations"])
    assert (why is not None) is refused
    cfg = {"model_type": "qwen3_moe"}
    assert (vllm_dense_reason("model.layers.3.mlp.experts.7.up_proj", cfg, g["weights"], g["input_activations"]) is not None) is refused
    assert vllm_dense_reason("model.layers.3.mlp.shared_expert.up_proj", cfg, g["weights"], g["input_activations"]) is None  # a plain Linear in vLLM
    assert vllm_dense_reason("model.layers.3.self_attn.q_proj", cfg, g["weights"], g["input_activations"]) is None
    gemma4 = {"model_type": "gemma4", "text_config": {"model_type": "gemma4_text"}}  # its router's Linear: router.proj, a GateLinear
    assert "gemma4.py" in vllm_dense_reason("model.language_model.layers.3.router.proj", gemma4, g["weights"], g["input_activations"])
    assert vllm_dense_reason("model.layers.3.router.proj", {"model_type": "llama"}, g["weights"], g["input_activations"]) is None
    for t in ("qwen2_moe", "qwen3_moe", "qwen3_next"):  # built without quant_config wherever vLLM builds one
        why = vllm_dense_reason("model.layers.3.mlp.shared_expert_gate", {"model_type": t}, g["weights"], g["input_activations"])
        assert why is not None and "shared expert's gate" in why


def test_static_int8_experts_are_refused_kept_dense_or_written_and_reported(tmp_path):
    """Trial finding: W8A8_STATIC on a Qwen3-MoE passed verify and vLLM 0.33 rejected it ("Unsupported FusedMoe
    scheme"). Now: refused before any work (exit 4, naming an expert and the vLLM function), its experts kept dense
    with --skip-incompatible (verify passes), written with --allow-unloadable and reported by verify (exit 5)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from ctconvert.errors import UnsupportedError

    from helpers import randomized

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    src = tmp_path / "m"
    randomized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)).save_pretrained(str(src))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([(i * 5) % 380 for i in range(128)]))
    kw = dict(calibration=ids, calibration_samples=2, calibration_seq_len=32)
    with pytest.raises(UnsupportedError) as e:
        api.quantize(src, tmp_path / "a", "W8A8_STATIC", **kw)
    assert ".mlp.experts." in str(e.value) and "no fused-MoE method for int8 experts with static int8 inputs" in e.value.message
    assert "get_moe_method" in e.value.message and not (tmp_path / "a").exists()
    kept = api.quantize(src, tmp_path / "b", "W8A8_STATIC", skip_incompatible=True, **kw)
    assert "model.layers.0.mlp.experts.3.down_proj" in kept.ignore and "model.layers.0.self_attn.q_proj" not in kept.ignore
    assert api.verify(tmp_path / "b")["ok"]
    api.quantize(src, tmp_path / "c", "W8A8_STATIC", allow_unloadable=True, **kw)
    report = api.verify(tmp_path / "c")
    errors = [p for p in report["problems"] if p["severity"] == "error"]
    assert (
        not report["ok"]
        and len(errors) == 1
        and "no fused-MoE method" in errors[0]["message"]
        and f"(and {2 * 4 * 3 - 1} more such modules)" in errors[0]["message"]
    )  # 2 layers x 4 experts x 3
    api.quantize(src, tmp_path / "d", "W8A8", **kw)
    assert api.verify(tmp_path / "d")["ok"]


@pytest.mark.parametrize(
    ("scheme", "part"), [("NVFP4A16", "weight_scale"), ("NVFP4A16", "weight_global_scale"), ("W4A16", "weight_scale"), ("FP8_DYNAMIC", "weight_scale")]
)
def test_a_negative_scale_fails_verify_naming_the_tensor(tiny_llama, tmp_path, scheme, part):
    """A scale with its sign bit set (a damaged byte, or a writer's bug) is an error of that tensor, with or without a
    reference, also where the shard hashes in the index would not tell (they are dropped here); -0 is zero."""
    import torch
    from safetensors.torch import load_file, save_file

    from ctconvert.checkpoint.reader import INDEX_NAME
    from ctconvert.checkpoint.writer import SHARDS_KEY

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, scheme)
    index = json.loads((out / INDEX_NAME).read_text())
    del index["metadata"][SHARDS_KEY]
    del index["metadata"]["ctconvert_records"], index["metadata"]["ctconvert_provenance"]  # as a release without the records wrote it
    del index["metadata"]["ctconvert_index_digest"]
    index["metadata"]["ctconvert"] = "0.1.0"  # (the release before the records)
    (out / INDEX_NAME).write_text(json.dumps(index))
    prov = json.loads((out / "ctconvert-provenance.json").read_text())  # and its provenance: format 2, which promises no records
    (out / "ctconvert-provenance.json").write_text(json.dumps(dict(prov, provenance_format=2, ctconvert="0.1.0")))
    name = f"model.layers.1.mlp.down_proj.{part}"
    shard = out / index["weight_map"][name]
    t = load_file(shard)
    dtype, shape = t[name].dtype, t[name].shape
    v = t[name].float().reshape(-1).clone()
    i = int(v.nonzero()[0])
    v[i] = -v[i]  # one value's sign bit set
    t[name] = v.reshape(shape).to(dtype)
    save_file(t, shard, metadata={"format": "pt"})
    assert int((t[name].float() < 0).sum()) == 1
    for ref in (None, tiny_llama):
        errors = [p for p in api.verify(out, ref)["problems"] if p["severity"] == "error"]
        assert errors and errors[0]["tensor"] == name and "1 value below zero" in errors[0]["message"]
    v[i] = -0.0  # -0: a zero scale (a zero row's), not an error of this check
    t[name] = v.reshape(shape).to(dtype)
    assert torch.signbit(t[name].float().reshape(-1)[i])
    save_file(t, shard, metadata={"format": "pt"})
    assert not [p for p in api.verify(out)["problems"] if "below zero" in p["message"]]


@pytest.mark.parametrize(
    ("scheme", "kv", "part"), [("FP8", "none", "input_scale"), ("NVFP4", "none", "input_global_scale"), ("FP8", "fp8", "k_scale"), ("FP8", "fp8", "v_scale")]
)
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_calibrated_scale_that_is_not_above_zero_fails_verify(tiny_llama, tmp_path, scheme, kv, part, value):
    """Activation and KV-cache scales are divided by at load (a new user set q/k/v's input_scale to 0, k_scale below zero:
    both passed): zero or negative is an error naming the tensor, with or without a reference."""
    import torch
    from safetensors.torch import load_file

    from conftest import save_shard

    out = tmp_path / "out"
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % 300 for i in range(64)]))
    api.quantize(tiny_llama, out, scheme, kv_cache=kv, calibration=ids, calibration_samples=2, calibration_seq_len=32)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.startswith("model.layers.1.") and n.endswith("." + part))
    shard = out / index["weight_map"][name]
    t = load_file(shard)
    t[name] = torch.full_like(t[name], value)
    save_shard(t, shard)
    for ref in (None, tiny_llama):
        rep = api.verify(out, ref)
        errors = [p for p in rep["problems"] if p["severity"] == "error" and p["tensor"] == name]
        assert not rep["ok"] and errors, rep["problems"]
        why = "a calibrated scale is never zero or negative" if value == 0.0 or part in ("k_scale", "v_scale") else "1 value below zero"
        assert why in errors[0]["message"], errors


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_an_nvfp4_weight_global_scale_that_is_not_above_zero_fails_verify(tiny_llama, tmp_path, value):
    """NVFP4's weight global scale is 448 x 6 / absmax (1.0 for an all-zero weight), never zero: a loader divides the
    group scales by it (a new user zeroed one and verify passed without a reference); an error naming the tensor, with
    or without a reference, the shard rewritten as a writer would (its hash record too: the check is this one)."""
    import torch
    from safetensors.torch import load_file

    from conftest import save_shard

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "NVFP4A16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.o_proj.weight_global_scale"
    shard = out / index["weight_map"][name]
    t = load_file(shard)
    assert float(t[name]) > 0
    t[name] = torch.full_like(t[name], value)
    save_shard(t, shard)
    for ref in (None, tiny_llama):
        errors = [p for p in api.verify(out, ref)["problems"] if p["severity"] == "error" and p["tensor"] == name]
        why = "NVFP4's weight global scale is 448 x 6 / absmax, never zero" if value == 0.0 else "1 value below zero"
        assert errors and why in errors[0]["message"], errors


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC", "NVFP4A16", "MXFP4A16"])
def test_a_weight_scale_zero_throughout_is_a_warning(tiny_llama, tmp_path, scheme):
    """A module whose every (float) weight scale is zero dequantizes to zeros whatever its codes, and no compressed-tensors
    quantizer stores such a scale (it substitutes the format's own): a warning naming the tensor, with or without a
    reference (a new user zeroed every weight_scale of a foreign copy and verify said nothing). A scale zero in one group
    only is not warned of, nor MX's E8M0 scales (bytes: 0 is 2^-127)."""
    import torch
    from safetensors.torch import load_file

    from conftest import save_shard

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, scheme)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name, part = "model.layers.0.self_attn.o_proj.weight_scale", "model.layers.1.self_attn.o_proj.weight_scale"
    shard = out / index["weight_map"][name]
    t = load_file(shard)
    assert t[name].ne(0).all() and t[part].ne(0).all()
    t[name] = torch.zeros_like(t[name])
    t[part] = t[part].clone()
    t[part].view(-1)[0] = 0  # one group's scale only
    save_shard(t, shard)
    for ref in (None, tiny_llama):
        warned = [p for p in api.verify(out, ref)["problems"] if p["severity"] == "warning" and "dequantizes to zero" in p["message"]]
        assert [p["tensor"] for p in warned] == ([] if scheme == "MXFP4A16" else [name]), warned


@pytest.mark.parametrize(
    "ignore, mixed",
    [
        ([r"re:model\.layers\.0\.mlp\.experts\.1\..*"], "expert 1 (down_proj, gate_proj, up_proj) dense"),
        ([r"re:model\.layers\.0\.mlp\.experts\.0\..*"], "expert 0 (down_proj, gate_proj, up_proj) dense"),
        ([r"re:model\.layers\.0\.mlp\.experts\.\d+\.down_proj"], "experts 0, 1, 2, 3 (down_proj) dense"),
        ([r"re:model\.layers\.0\.mlp\.experts\..*"], None),
    ],
)
def test_experts_of_one_block_quantized_unlike_each_other_are_refused_or_reported(tmp_path, ignore, mixed):
    """vLLM 0.33 builds a MoE block's experts as one fused layer with one quantization method for all its projections:
    some experts of a block dense beside quantized ones (expert 0 or another), or one projection of every expert dense
    beside the others quantized ("All MoE projections need to have same quantization scheme"; vllm_accept.py rejected
    all three, 2026-12-06), is refused before any work (exit 2, naming the block, which experts and projections are
    dense and which quantized), written with --allow-unloadable and then failed by verify (exit 5) for that block only;
    a block whose experts are all dense is not mixed, and verify passes it."""

    src = moe_checkpoint(tmp_path)  # 2 layers of 4 experts
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(out), "-s", "W4A16", *[a for p in ignore for a in ("--ignore", p)]])
    if mixed is None:
        assert r.exit_code == 0, r.output
        assert api.verify(out, src)["ok"]
        return
    assert r.exit_code == 2 and not out.exists()
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: model.layers.0.mlp.experts: ") and mixed in line and "in config group 'group_0'" in line
    assert line.endswith("(--ignore all of them or none); --allow-unloadable writes it for other loaders")
    api.quantize(src, out, "W4A16", ignore=ignore, allow_unloadable=True)
    doc = api.verify(out, src)
    found = [p for p in doc["problems"] if "one fused layer" in p["message"]]
    assert not doc["ok"] and [p["tensor"] for p in found] == ["model.layers.0.mlp.experts"]
    assert all(p["severity"] == "error" and p["file"].endswith(".safetensors") and mixed in p["message"] for p in found)
    r = CliRunner().invoke(main, ["verify", str(out), "--reference", str(src)])
    assert r.exit_code == 5 and mixed in " ".join(r.output.split())


def test_mixed_expert_blocks_groups_experts_and_projections_by_config_group():
    from ctconvert.checkpoint.conformance import mixed_expert_blocks

    got = mixed_expert_blocks(
        {
            "b.experts.0.w": "g",
            "b.experts.2.w": None,
            "b.experts.1.w": "g",
            "b.experts.1.v": "g",
            "c.experts.0.w": None,
            "c.experts.1.w": None,
            "d.experts.0.w": "g",
            "d.experts.0.v": None,
        }
    )
    assert [(m.block, m.groups) for m in got] == [("b", {"g": ([0, 1], ["v", "w"]), None: ([2], ["w"])}), ("d", {None: ([0], ["v"]), "g": ([0], ["w"])})]
    assert got[0].message().startswith("experts 0, 1 (v, w) in config group 'g'; expert 2 (w) dense: vLLM 0.33 builds")
    assert mixed_expert_blocks({"x.experts.0.w": "g", "x.experts.1.w": "g", "y.mlp.gate": None}) == []


@pytest.mark.parametrize(
    ("scheme", "edit", "want"),
    [
        ("NVFP4A16", {"type": "int"}, "weights type 'int' (nvfp4-pack-quantized stores float codes)"),
        ("NVFP4A16", {"strategy": "group"}, "strategy 'group' (NVFP4: 'tensor_group')"),
        ("NVFP4A16", {"symmetric": False}, "symmetric False (NVFP4: True)"),
        ("W4A16", {"dynamic": True}, "dynamic True (stored weights are quantized once: false)"),
        ("W4A16", {"type": "float"}, "type 'float' (pack-quantized stores int codes)"),
        ("FP8_DYNAMIC", {"type": "int"}, "type 'int' (float-quantized stores float codes)"),
    ],
)
def test_weight_arguments_the_format_contradicts_fail_verify_without_a_record(tiny_llama, tmp_path, scheme, edit, want):
    """A config written so by a tool (the index's config record agrees, or there is none: another tool's checkpoint)
    whose weight arguments no tensor contradicts but the format does: verify names the group and argument (exit 5);
    the unedited output passes."""
    out = tmp_path / "o"
    api.quantize(tiny_llama, out, scheme)
    assert api.verify(out)["ok"]
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(edit)
    save_config(out, cfg)
    errors = [p for p in api.verify(out)["problems"] if p["severity"] == "error"]
    assert any(want in p["message"] and "config group 'group_0'" in p["message"] and p["file"].endswith("config.json") for p in errors), errors
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 5


def test_an_nvfp4_strategy_contradicting_its_group_size_is_said_once(tiny_llama, tmp_path):
    """``strategy: channel`` over NVFP4's groups of 16: the strategy error (what the scales hold) is the group's one
    config error; the NVFP4-arguments error does not say the strategy again, but still says another argument edited
    beside it."""
    out = tmp_path / "o"
    api.quantize(tiny_llama, out, "NVFP4A16")
    for edit, others in (({"strategy": "channel"}, []), ({"strategy": "channel", "symmetric": False}, ["symmetric False (NVFP4: True)"])):
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update({"strategy": "tensor_group", "symmetric": True, **edit})
        save_config(out, cfg)
        errors = [p["message"] for p in api.verify(out)["problems"] if p["severity"] == "error" and "config group 'group_0'" in p["message"]]
        assert len(errors) == 1 + len(others), errors
        assert sum("strategy 'channel' with group_size 16" in e for e in errors) == 1 and "NVFP4: 'tensor_group'" not in " ".join(errors)
        assert all(any(o in e for e in errors) for o in others)


def test_a_weight_shape_of_another_dtype_is_the_one_error_of_its_module(tiny_llama, tmp_path):
    """The trial's weight_shape stored F64: every other part was compared with the dense shape read from it ([0, 0])
    and failed too, and an 'every quantized value is zero' warning followed. Now the weight_shape alone is the error, and
    nothing else is said of the module."""
    import torch
    from safetensors.torch import load_file

    from conftest import save_shard

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    name = "model.layers.0.self_attn.q_proj"
    ts = load_file(out / "model.safetensors")
    ts[f"{name}.weight_shape"] = ts[f"{name}.weight_shape"].to(torch.float64)
    save_shard(ts, out / "model.safetensors")
    report = api.verify(out)
    (e,) = [p for p in report["problems"] if p.get("tensor", "").startswith(name)]
    assert e["severity"] == "error" and e["tensor"] == f"{name}.weight_shape"
    assert e["message"] == (
        "weight_shape is F64[2], but pack-quantized (int4 group 128, config group 'group_0') stores I64/I32[2]: the dense shape cannot be read from it"
    )
