"""vLLM's per-tensor TP rules (ctconvert.plan.shard_rules): the split of a layer and what one rank's slice must hold."""

from __future__ import annotations

from ctconvert.formats import CompressionFormat
from ctconvert.plan import parallel
from ctconvert.plan.schemes import get_scheme
from ctconvert.plan.shard_rules import EXPERT, ParallelModule, dense_at, expert_at, heads_of, layer_kind


def mod(name, shape, scheme="W4A16"):
    s = get_scheme(scheme)
    return ParallelModule(name, shape, s.weights, s.format.value)


def test_column_and_row_splits_of_one_rank():
    up = mod("model.layers.0.mlp.up_proj", (1024, 512))
    assert layer_kind(up.name) == "column"
    assert dense_at(up, "column", 4, {}) == ((256, 512), [], [])
    down = mod("model.layers.0.mlp.down_proj", (512, 384))  # K 384 = 3 groups of 128
    per, problems, _ = dense_at(down, "row", 2, {})
    assert per == (512, 192) and any("verify_group_size_divides_partition" in p for p in problems)


def test_pack_quantized_words_along_k():
    m = mod("model.layers.0.self_attn.o_proj", (64, 64))
    assert m.format == CompressionFormat.PACK_QUANTIZED
    per, problems, _ = dense_at(m, "row", 16, {})  # 4 columns per rank: not whole groups nor whole int32 words
    assert per == (64, 4) and problems


def test_experts_share_the_intermediate_split():
    gate = mod("model.layers.0.mlp.experts.3.gate_proj", (256, 128))
    assert EXPERT.search(gate.name) is not None
    per, problems, _ = expert_at(gate, "expert-column", 2, 128)
    assert per == (128, 128) and not problems


def test_heads_from_the_text_config():
    assert heads_of({"text_config": {"num_attention_heads": 32, "num_key_value_heads": 8}}) == (32, 8)
    assert heads_of({"num_attention_heads": 16}) == (16, 16)
    # null or absent num_key_value_heads: the count transformers 5.20's class gives, as vLLM builds it
    assert heads_of({"model_type": "qwen2", "num_attention_heads": 28}) == (28, 32)
    assert heads_of({"model_type": "llama", "num_attention_heads": 28, "num_key_value_heads": None}) == (28, 28)
    assert heads_of({"model_type": "mixtral", "num_attention_heads": 32}) == (32, 8)
    assert heads_of({"model_type": "llava", "text_config": {"model_type": "qwen2", "num_attention_heads": 28}}) == (28, 32)


def test_parallel_keeps_the_names_it_exported():
    assert parallel.ParallelModule is ParallelModule and parallel.layer_kind is layer_kind
