"""A decoder layer that hands the next one a value beside its hidden states (GLM-5's DSA top-k selection,
``prev_topk_indices``): calibration layer by layer passes it on as the model's forward does, and observes what the
whole model observes. Before, the stand-in layers returned the hidden states alone and GLM-5's forward failed at the
first layer ("too many values to unpack")."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import randomized

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")


def _glm5(path, indexer_types):
    if not hasattr(transformers, "GlmMoeDsaConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no GlmMoeDsaConfig")
    cfg = transformers.GlmMoeDsaConfig(
        num_hidden_layers=len(indexer_types), hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, index_topk=8,
        index_head_dim=32, index_n_heads=2, vocab_size=256, n_group=1, topk_group=1, max_position_embeddings=128,
        indexer_types=indexer_types,
    )  # fmt: skip
    torch.manual_seed(0)
    randomized(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("indexer_types", [["full", "full", "full"], ["full", "shared", "full"]])
def test_glm5_layer_by_layer_equals_whole_model(tmp_path, indexer_types):
    from ctconvert.calibration.model import CARRIED, CalibrationModel, calibrate, calibrate_whole_model
    from ctconvert.checkpoint.reader import open_checkpoint

    ckpt = open_checkpoint(_glm5(tmp_path / "m", indexer_types))
    assert CalibrationModel(ckpt, torch.device("cpu")).carried == CARRIED[0] == "prev_topk_indices"
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(3))
    s = calibrate(ckpt, ids, torch.device("cpu"), kv_cache=True, batch_tokens=40)  # one sequence per micro-batch
    w = calibrate_whole_model(ckpt, ids, torch.device("cpu"), kv_cache=True, batch_tokens=40)
    assert s.inputs.keys() == w.inputs.keys() and "model.layers.2.self_attn.indexer.wq_b" in s.inputs
    for a, b in ((s.inputs, w.inputs), (s.keys, w.keys), (s.values, w.values)):
        for k in a:
            assert torch.equal(a[k].min, b[k].min) and torch.equal(a[k].max, b[k].max), k


def test_a_layer_without_a_carried_value_takes_none():
    from ctconvert.calibration.model import _carried

    class Plain(torch.nn.Module):
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            return hidden_states

    class Carrying(torch.nn.Module):
        def forward(self, hidden_states, prev_topk_indices=None, **kwargs):
            return hidden_states, prev_topk_indices

    assert _carried(Plain()) is None and _carried(Carrying()) == "prev_topk_indices"
