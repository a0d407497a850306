"""The tensor-parallel plan: per-rank slices against vLLM 0.33's rules (groups, blocks, tiles, vocab, experts)."""

from __future__ import annotations

import pytest

from ctconvert.formats import WeightArgs
from ctconvert.plan.parallel import ParallelModule, layer_kind, parallel_report
from ctconvert.plan.schemes import get_scheme


def mod(name, shape, scheme="W4A16", **kw):
    s = get_scheme(scheme)
    return ParallelModule(name, shape, s.weights, s.format.value, **kw)


def report(mods, tp=1, ep=None, config=None):
    return parallel_report(mods if isinstance(mods, list) else [mods], config or {}, tp, ep)


def test_down_proj_group_128_splits_at_tp2_not_tp4():
    down = mod("model.layers.0.mlp.down_proj", (4096, 11008))
    assert report(down, tp=2).ok
    r = report(down, tp=4)
    assert not r.ok and r.max_tp == 2 and r.limited_by == ["model.layers.0.mlp.down_proj"]
    row = r.rows[0]
    assert row.kind == "row" and row.per_rank == (4096, 2752) and row.max_tp == 2
    assert "K per rank 2752 is not a whole number of groups of 128" in row.problems[0]
    # 11008 / 128 = 86 = 2 * 43: degree 43 would hold whole groups, but no power of two above 2 does
    assert report(down, tp=43).ok


def test_moe_intermediate_640_group_128_only_tp1():
    h = 2048
    shapes = {"gate_proj": (640, h), "up_proj": (640, h), "down_proj": (h, 640)}
    experts = [mod(f"model.layers.0.mlp.experts.{e}.{p}", s) for e in range(4) for p, s in shapes.items()]
    r = report(experts, tp=2)
    assert r.max_tp == 1 and not r.ok
    assert {x.kind for x in r.rows} == {"expert-column", "expert-row"}
    assert all(x.max_tp == 1 for x in r.rows)
    # gate/up are column-parallel, yet the MoE layer needs I / tp = 320 in whole groups for them too
    gate = r.row("model.layers.0.mlp.experts.0.gate_proj")
    assert gate.per_rank == (320, h) and "moe intermediate per rank 320" in gate.problems[0]
    # with expert parallelism the experts stay whole: 4 experts over 2 or 4 ranks
    for ep in (2, 4):
        r = report(experts, tp=ep, ep=ep)
        assert r.ok and all(x.max_tp is None and x.per_rank == x.shape for x in r.rows)
    assert report(experts).max_ep == 4
    # I = 1280 = 10 * 128: TP 2 holds whole groups, TP 4 (320) does not
    wide = [mod("model.layers.0.mlp.experts.0.down_proj", (h, 1280)), mod("model.layers.0.mlp.experts.0.gate_proj", (1280, h))]
    assert report(wide).max_tp == 2


def test_expert_parallel_uneven_and_too_few_experts():
    experts = [mod(f"model.layers.1.mlp.experts.{e}.down_proj", (256, 512)) for e in range(6)]
    r = report(experts, tp=4, ep=4)
    assert r.ok and r.max_ep == 2
    (m,) = r.model
    assert "first 2 ranks hold 2, the others 1" in m["warning"]
    r = report(experts, tp=8, ep=8)
    assert not r.ok and "cannot fill --ep 8" in r.model[0]["problem"]
    assert r.summary().endswith("at --tp 8 --ep 8: every tensor splits, but 6 experts cannot fill --ep 8 ranks (ranks without experts)")
    r = report(experts[:5], tp=4, ep=4)  # 5 over 4: one rank holds one more
    assert "5 experts over --ep 4: the first rank holds 2, the others 1" in r.model[0]["warning"]


def test_column_split_keeps_groups_and_row_split_cuts_them():
    gate = mod("model.layers.0.mlp.gate_proj", (11008, 4096))
    r = report(gate, tp=4)
    assert r.ok and r.rows[0].per_rank == (2752, 4096) and r.rows[0].kind == "column"
    assert r.rows[0].max_tp == 256  # 11008 = 2^8 * 43: the N split is what runs out
    o = mod("model.layers.0.self_attn.o_proj", (4096, 4096))
    assert report(o).rows[0].max_tp == 32  # 4096 / 32 = 128: one group per rank


def test_nvfp4_blocks_of_16():
    r = report(mod("model.layers.0.self_attn.o_proj", (256, 96), "NVFP4A16"), tp=4)
    row = r.rows[0]
    assert row.max_tp == 2 and row.per_rank == (256, 24)
    assert "not a whole number of 16-element NVFP4 blocks" in row.problems[0]
    for mx in ("MXFP4A16", "MXFP8A16"):
        r = report(mod("model.layers.0.self_attn.o_proj", (256, 96), mx), tp=2)
        assert r.max_tp == 1 and "not a whole number of 32-element MX blocks" in r.rows[0].problems[0]  # 48 per rank


def test_fp8_block_shapes():
    # row-parallel: K per rank must hold whole 128-wide blocks at tp > 1
    r = report(mod("model.layers.0.mlp.down_proj", (512, 384), "FP8_BLOCK"), tp=2)
    assert not r.ok and "block width 128" in r.rows[0].problems[0] and r.max_tp == 1
    # column-parallel: N per rank whole 128-high blocks
    r = report(mod("model.layers.0.mlp.up_proj", (512, 384), "FP8_BLOCK"), tp=8)
    assert r.rows[0].max_tp == 4 and "block height 128" in r.rows[0].problems[0]
    # channelwise FP8: any exact split
    assert report(mod("model.layers.0.mlp.down_proj", (512, 384), "FP8_DYNAMIC")).max_tp == 128


def test_asymmetric_zero_points_packed_along_n():
    asym = report(mod("model.layers.0.mlp.up_proj", (96, 256), "W4A16_ASYM"), tp=8)
    assert asym.rows[0].max_tp == 4 and "zero points" in asym.rows[0].problems[0]  # 12 rows x 4 bits: not whole words
    assert report(mod("model.layers.0.mlp.up_proj", (96, 256), "W4A16")).max_tp == 32


@pytest.mark.parametrize(("vocab", "max_tp", "per_rank_at_8"), [(151936, 128, 18992), (32001, 64, 4008), (50257, 128, 6288)])
def test_vocabulary_padded_to_64(vocab, max_tp, per_rank_at_8):
    for head in (ParallelModule("lm_head", (vocab, 1024)), mod("lm_head", (vocab, 1024), "NVFP4A16"), ParallelModule("model.embed_tokens", (vocab, 1024))):
        r = report(head, tp=8)
        assert r.ok and r.rows[0].kind == "vocab" and r.rows[0].max_tp == max_tp and r.rows[0].per_rank == (per_rank_at_8, 1024)
    r = report(ParallelModule("lm_head", (32001, 1024)), tp=128)
    assert not r.ok and "padded vocabulary 32064" in r.rows[0].problems[0]


def test_attention_heads_and_replicated_kv_heads():
    cfg = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}
    mods = [mod("model.layers.0.self_attn.q_proj", (512, 512)), mod("model.layers.0.self_attn.k_proj", (128, 512))]
    r = report(mods, tp=4, config=cfg)
    assert r.ok
    k = r.row("model.layers.0.self_attn.k_proj")
    assert k.per_rank == (64, 512) and "2 KV heads replicated 2x across 4 ranks" in k.warnings[0]
    assert r.max_tp == 8 and r.model[0] == {"what": "num_attention_heads 8", "max_tp": 8}
    r = report(mods, tp=3, config=cfg)
    assert not r.ok and "not divisible by --tp 3" in r.model[0]["problem"]
    assert "heads do not divide over 3 ranks" in r.row("model.layers.0.self_attn.q_proj").problems[0]
    # a non-power-of-two degree that divides everything works
    cfg12 = {"num_attention_heads": 12, "num_key_value_heads": 12}
    assert report([mod("model.layers.0.self_attn.q_proj", (768, 768))], tp=3, config=cfg12).ok


def test_marlin_tiles_for_kernel_native_output():
    g32 = WeightArgs(type="int", num_bits=4, strategy="group", group_size=32)
    gate = ParallelModule("model.layers.0.mlp.gate_proj", (1024, 4096), g32, "pack-quantized")
    assert report(gate).max_tp == 1024  # compressed-tensors: any N split
    marlin = ParallelModule("model.layers.0.mlp.gate_proj", (1024, 4096), g32, "pack-quantized", "marlin")
    r = report(marlin, tp=32)
    assert r.rows[0].max_tp == 16 and "not whole Marlin tiles" in r.rows[0].problems[0]  # 32 rows per rank: not a 64-wide tile
    # row-parallel K = 64 per rank: a 128 x 64 tile family from vLLM 0.25 on, rejected by 0.21 (K % 128)
    o33 = ParallelModule("model.layers.0.self_attn.o_proj", (4096, 4096), g32, "pack-quantized", "marlin", "0.33")
    o21 = ParallelModule("model.layers.0.self_attn.o_proj", (4096, 4096), g32, "pack-quantized", "marlin", "0.21")
    assert report(o33).max_tp == 64 and report(o21).max_tp == 32


def test_cutlass_nvfp4_atoms():
    s = get_scheme("NVFP4A16")
    up = ParallelModule("model.layers.0.mlp.up_proj", (512, 1024), s.weights, s.format.value, "cutlass-nvfp4")
    r = report(up, tp=8)
    assert r.rows[0].max_tp == 4 and "128x4 CUTLASS scale atoms" in r.rows[0].problems[0]
    assert report(mod("model.layers.0.mlp.up_proj", (512, 1024), "NVFP4A16")).max_tp == 512


def test_unknown_kind_is_stated_and_checked_both_ways():
    r = report([mod("model.layers.0.mlp.down_proj", (4096, 4096)), mod("model.layers.0.block.mixer", (1024, 256))], tp=2)
    row = r.row("model.layers.0.block.mixer")
    assert row.kind == "unknown" and row.per_rank is None and "checked both ways" in row.warnings[0]
    assert row.max_tp == 2  # as row-parallel 256 / 2 = 128 is the last whole group
    assert r.max_tp == 2 and r.limited_by == ["model.layers.0.block.mixer"]
    assert "of a kind the names do not tell" in r.notes[0]
    assert not report(mod("model.layers.0.block.mixer", (1024, 256)), tp=4).ok


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("bert.encoder.layer.0.attention.self.query", "column"),
        ("bert.encoder.layer.0.attention.output.dense", "row"),
        ("bert.encoder.layer.0.intermediate.dense", "column"),
        ("bert.encoder.layer.0.output.dense", "row"),
        ("bert.pooler.dense", "replicated"),
        ("model.layers.3.self_attn.kv_a_proj_with_mqa", "replicated"),
        ("model.layers.3.self_attn.kv_b_proj", "column"),
        ("model.layers.3.mlp.experts.7.w2", "row"),
        ("transformer.h.0.self_attention.dense", "row"),
        ("lm_head", "vocab"),
        ("model.layers.0.mlp.gate", "replicated"),
        ("model.layers.0.block_sparse_moe.gate", "replicated"),
        ("model.layers.0.feed_forward.router", "replicated"),
        ("model.layers.0.router.proj", "replicated"),
        ("model.layers.0.mlp.shared_expert_gate", "replicated"),
        ("model.layers.0.mlp.frobnicate", "unknown"),
        ("model.layers.0.self_attn.indexer.wq_b", "replicated"),  # DeepSeek-V3.2/GLM-5: vLLM's Indexer splits none of these
        ("model.layers.0.self_attn.indexer.wk", "replicated"),
        ("model.layers.0.self_attn.indexer.weights_proj", "replicated"),
        ("model.layers.0.attn.wq_b", "unknown"),  # (not an indexer's)
    ],
)
def test_layer_kinds(name, kind):
    assert layer_kind(name) == kind


def test_replicated_layers_do_not_limit():
    r = report([mod("model.layers.0.self_attn.q_a_proj", (1536, 7168)), mod("model.layers.0.self_attn.o_proj", (7168, 16384))], tp=8)
    assert r.ok and r.row("model.layers.0.self_attn.q_a_proj").max_tp is None and r.max_tp == 128


def test_bad_degrees():
    with pytest.raises(ValueError):
        report(mod("model.layers.0.mlp.down_proj", (256, 256)), tp=0)


def test_fused_checkpoint_tensors_split_per_member():
    cfg = {"num_attention_heads": 8, "num_key_value_heads": 2}
    # Phi-3 style qkv_proj: q 8 heads + k, v 2 heads each, head_dim 64 -> N = 768
    r = report(mod("model.layers.0.self_attn.qkv_proj", (768, 512), "FP8_BLOCK"), tp=2, config=cfg)
    row = r.rows[0]
    assert row.per_rank == (256 + 64 + 64, 512) and "N per rank 64 is not a multiple of the FP8 block height 128" in row.problems[0]
    assert report(mod("model.layers.0.self_attn.qkv_proj", (768, 512)), tp=4, config=cfg).rows[0].per_rank == (128 + 64 + 64, 512)
    # a fused gate/up [2I, H] splits each half: I = 96 rows, asymmetric zero points 8 per word
    row = report(mod("model.layers.0.mlp.gate_up_proj", (192, 256), "W4A16_ASYM"), tp=8).rows[0]
    assert row.per_rank == (24, 256) and row.max_tp == 4 and "N per rank 12" in row.problems[0]
    # one expert's fused gate/up: I = 640 -> TP 1 only at group 128, like its down_proj
    ex = report([mod("model.layers.0.mlp.experts.0.gate_up_proj", (1280, 256)), mod("model.layers.0.mlp.experts.0.down_proj", (256, 640))], tp=2)
    assert ex.rows[0].per_rank == (640, 256) and ex.max_tp == 1 and all(not x.ok for x in ex.rows)


def test_modules_without_a_2d_weight_are_stated():
    r = parallel_report([ParallelModule("model.layers.0.mlp.experts.gate_up_proj", (0, 0)), mod("model.layers.0.mlp.down_proj", (256, 256))], {}, 2)
    assert [x.name for x in r.rows] == ["model.layers.0.mlp.down_proj"]
    assert r.notes == ["not checked (no 2-D [N, K] weight): model.layers.0.mlp.experts.gate_up_proj"]
    assert "changes nothing" in parallel_report([mod("model.layers.0.mlp.down_proj", (256, 256))], {}, 2, ep=2).notes[0]
