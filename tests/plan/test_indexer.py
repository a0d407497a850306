"""The DeepSeek V3.2 sparse-attention indexer: vLLM 0.33 fuses its ``wk`` and ``weights_proj`` into one
``wk_weights_proj`` built without a quantization config (``vllm/models/deepseek_v32/attention.py`` ``Indexer``), and
dequantizes only an FP8 ``wk`` on loading (``deepseek_v2.py`` ``_try_load_fp8_indexer_wk``). A quantize of a V3.2
checkpoint quantized both, and verify passed the output vLLM cannot load. ``wq_b`` is built with the model's
quantization config and is quantized as any Linear."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ctconvert import api
from ctconvert.checkpoint.families import indexer_dense_reason, vllm_dense_reason
from ctconvert.cli import main
from ctconvert.errors import UnsupportedError

V32 = {"model_type": "deepseek_v32", "index_topk": 16}
FP8_W = {"type": "float", "num_bits": 8, "strategy": "channel"}
DYNAMIC = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
STATIC = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
INT4_W = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 64}
LAYER = "model.layers.1.self_attn.indexer"


@pytest.mark.parametrize(
    "leaf, weights, inputs, dense",
    [
        ("weights_proj", None, None, True),  # the plan's default: module-only
        ("weights_proj", FP8_W, DYNAMIC, True),  # its scale has no parameter; its codes would be read as bf16
        ("weights_proj", INT4_W, None, True),
        ("wk", None, None, True),
        ("wk", FP8_W, DYNAMIC, False),  # the loader dequantizes it
        ("wk", FP8_W, None, False),
        ("wk", FP8_W, STATIC, True),  # its input_scale has no parameter
        ("wk", INT4_W, None, True),  # weight_packed has no parameter
        ("wq_b", INT4_W, None, False),  # built with the quantization config
    ],
)
def test_which_indexer_modules_vllm_cannot_load_quantized(leaf, weights, inputs, dense):
    why = indexer_dense_reason(f"{LAYER}.{leaf}", V32, weights, inputs)
    assert (why is not None) == dense
    assert vllm_dense_reason(f"{LAYER}.{leaf}", V32, weights, inputs) == why
    if dense:
        assert "wk_weights_proj" in why and "deepseek_v32/attention.py" in why


def test_only_a_config_with_index_topk_builds_the_indexer():
    assert indexer_dense_reason(f"{LAYER}.wk", {"model_type": "deepseek_v3"}) is None
    assert indexer_dense_reason(f"{LAYER}.wk", {"model_type": "glm_moe_dsa", "text_config": {"index_topk": 8}}) is not None
    assert indexer_dense_reason("model.layers.1.self_attn.wk", V32) is None  # not the indexer's
    assert indexer_dense_reason(f"{LAYER}.wk_weights_proj", V32) is None


@pytest.fixture(scope="module", params=["DeepseekV32Config", "GlmMoeDsaConfig"])
def v32(request, tmp_path_factory):
    """A tiny DeepSeek-V3.2 or GLM-5 (DSA) checkpoint as transformers saves it (every layer with an indexer)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    if not hasattr(transformers, request.param):
        pytest.skip(f"transformers {transformers.__version__} has no {request.param}")
    torch.manual_seed(0)
    extra = {"indexer_types": ["full", "full"]} if request.param == "GlmMoeDsaConfig" else {}
    cfg = getattr(transformers, request.param)(
        **extra,
        num_hidden_layers=2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, index_topk=16,
        index_head_dim=64, index_n_heads=4, vocab_size=512, n_group=1, topk_group=1, max_position_embeddings=512,
    )  # fmt: skip
    path = tmp_path_factory.mktemp(request.param) / "src"
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(str(path))
    return path


def test_a_v32_checkpoint_keeps_the_indexers_wk_and_weights_proj_dense_and_verify_passes(v32, tmp_path):
    out = tmp_path / "q"
    res = api.quantize(v32, out, "W4A16", group_size=64)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    for layer in range(2):
        for leaf in ("wk", "weights_proj"):
            assert f"model.layers.{layer}.self_attn.indexer.{leaf}" in ignore
        assert f"model.layers.{layer}.self_attn.indexer.wq_b" not in ignore
    (why,) = [w for w in res.kept_dense if "indexer" in w]
    assert res.kept_dense[why] == 4 and why.startswith("the sparse-attention indexer's wk/weights_proj") and why.endswith("kept dense by default")
    r = CliRunner().invoke(main, ["quantize", str(v32), "-o", str(tmp_path / "cli"), "--scheme", "W4A16", "--group-size", "64"])
    assert r.exit_code == 0 and "note: kept dense: 4 weights: the sparse-attention indexer's wk/weights_proj" in r.stderr, r.output
    r = CliRunner().invoke(main, ["quantize", str(v32), "-o", str(tmp_path / "dry"), "--scheme", "W4A16", "--group-size", "64", "--dry-run"])
    assert "plan: W4A16[group_size=64] (pack-quantized)" in r.stdout  # (its arguments were read as rich markup and dropped)
    assert api.verify(out)["ok"] and api.verify(out, v32)["ok"]


def test_a_target_naming_them_is_refused_and_with_allow_unloadable_verify_fails(v32, tmp_path):
    targets = ["Linear", r"re:.*indexer\.(wk|weights_proj)$"]
    with pytest.raises(UnsupportedError, match=r"indexer's wk/weights_proj \(DeepSeek-V3\.2, GLM-5\): vLLM 0\.33 fuses them"):
        api.quantize(v32, tmp_path / "refused", "W4A16", group_size=64, targets=targets)
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "q"
    api.quantize(v32, out, "W4A16", group_size=64, targets=targets, allow_unloadable=True)
    errors = [p for p in api.verify(out)["problems"] if p["severity"] == "error"]
    assert any("indexer." in p.get("tensor", "") and "wk_weights_proj" in p["message"] for p in errors), errors
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 5


def test_an_fp8_dynamic_wk_named_by_a_target_is_written_and_passes(v32, tmp_path):
    out = tmp_path / "q"
    api.quantize(v32, out, "FP8_DYNAMIC", targets=["Linear", r"re:.*indexer\.wk$"])
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.self_attn.indexer.wk" not in ignore and "model.layers.0.self_attn.indexer.weights_proj" in ignore
    assert api.verify(out)["ok"]
