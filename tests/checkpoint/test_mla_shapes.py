"""DeepSeek's MLA projections against config.json (:mod:`ctconvert.checkpoint.mla_shapes`): each head size or LoRA rank
edited after the checkpoint was saved is found on exactly the projections vLLM 0.33 builds from it, and verify fails
such an output (a new user's edits of these keys passed every check while vLLM refused the checkpoint)."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from ctconvert import api
from ctconvert.checkpoint.mla_shapes import mla_shape_problems
from ctconvert.checkpoint.modules import modules_of
from ctconvert.checkpoint.reader import open_checkpoint

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")

MLA = dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=48, v_head_dim=40)
#: the (projection, side) each key sizes, as DeepseekV2MLAAttention builds them (q_b_proj where q_lora_rank is set)
SIZED_BY = {
    "num_attention_heads": {("q_b_proj", "rows"), ("kv_b_proj", "rows"), ("o_proj", "columns")},
    "qk_nope_head_dim": {("q_b_proj", "rows"), ("kv_b_proj", "rows")},
    "qk_rope_head_dim": {("q_b_proj", "rows"), ("kv_a_proj_with_mqa", "rows")},
    "v_head_dim": {("kv_b_proj", "rows"), ("o_proj", "columns")},
    "q_lora_rank": {("q_a_proj", "rows"), ("q_b_proj", "columns")},
    "kv_lora_rank": {("kv_b_proj", "columns"), ("kv_a_proj_with_mqa", "rows")},
}
WORDING = (
    r"model\.layers\.(\d)\.self_attn\.(\w+) has (\d+) (rows|columns), "
    r"where vLLM 0\.33 deepseek_v2\.py DeepseekV2MLAAttention builds (.+) = (\d+) \(config\.json\): vLLM refuses the checkpoint"
)


def _save(path, q_lora_rank):
    cfg = transformers.DeepseekV3Config(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=256, max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, topk_method="noaux_tc", q_lora_rank=q_lora_rank, **MLA,
    )  # fmt: skip
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    return path


def _problems(folder):
    ck = open_checkpoint(folder, strict=False)
    return mla_shape_problems(modules_of(ck), ck.config, ck.tensors)


def _edit(folder, key, value):
    c = json.loads((folder / "config.json").read_text())
    c[key] = value
    (folder / "config.json").write_text(json.dumps(c))


@pytest.fixture(scope="module", params=[96, None], ids=["q_lora", "no_q_lora"])
def source(request, tmp_path_factory):
    return _save(tmp_path_factory.mktemp("mla"), request.param), request.param


@pytest.mark.parametrize("key", list(SIZED_BY))
def test_each_key_sizes_exactly_its_projections(source, key, tmp_path):
    """An unedited checkpoint has no problem; each key edited (+8) gives one error per layer for each projection side
    that key sizes, with the size built from the edited config."""
    src, q_rank = source
    assert _problems(src) == []
    if key == "q_lora_rank" and q_rank is None:
        pytest.skip("no q_lora_rank: vLLM builds q_proj [heads x qk_head_dim, hidden_size]")
    folder = tmp_path / "edited"
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text((src / "config.json").read_text())
    c = json.loads((folder / "config.json").read_text())
    _edit(folder, key, c[key] + 8)
    found = _problems(folder)
    sides = set()
    for p in found:
        m = re.fullmatch(WORDING, p.message)
        assert m and p.severity == "error" and p.tensor == f"model.layers.{m[1]}.self_attn.{m[2]}", p.message
        assert f"{key} {c[key] + 8}" in m[5] and int(m[6]) == int(m[3]) + 8 * _factor(key, m[2], m[4], c)
        sides.add((m[2], m[4]))
    want = {(p.replace("q_b_proj", "q_proj"), s) if q_rank is None else (p, s) for p, s in SIZED_BY[key]}
    assert sides == want and len(found) == 2 * len(want)  # both layers (one dense MLP, one MoE)


def _factor(key: str, proj: str, side: str, c: dict) -> int:
    """How many times the +8 edit shows in the size built: once per head for a per-head size, else once; by heads'
    own edit, the per-head width."""
    if key == "num_attention_heads":
        return {"o_proj": c["v_head_dim"], "kv_b_proj": c["qk_nope_head_dim"] + c["v_head_dim"]}.get(proj, c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    if key in ("qk_nope_head_dim", "v_head_dim") or (key == "qk_rope_head_dim" and proj in ("q_b_proj", "q_proj")):
        return c["num_attention_heads"]
    return 1


def test_verify_fails_an_output_whose_config_was_edited(source, tmp_path):
    """The FP8_DYNAMIC output (MLA projections quantized: judged by their dense shape) passes verify; with v_head_dim edited
    in its config, verify fails it, naming each o_proj and kv_b_proj."""
    src, _ = source
    out = tmp_path / "out"
    api.quantize(src, out, "FP8_DYNAMIC", device="cpu")
    assert api.verify(out)["ok"], api.verify(out)["problems"]
    c = json.loads((out / "config.json").read_text())
    _edit(out, "v_head_dim", c["v_head_dim"] * 2)
    rep = api.verify(out)
    named = {p.get("tensor") for p in rep["problems"] if "DeepseekV2MLAAttention" in p["message"]}
    assert not rep["ok"] and named == {f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("o_proj", "kv_b_proj")}, rep["problems"]


def test_other_families_and_layers_without_mla_are_not_judged(source):
    """A Llama config, and a DeepSeek config whose layers are built without MLA (both head sizes 0), give none."""
    src, _ = source
    ck = open_checkpoint(src, strict=False)
    mods = modules_of(ck)
    assert mla_shape_problems(mods, dict(ck.config, model_type="llama"), ck.tensors) == []
    assert mla_shape_problems(mods, dict(ck.config, qk_nope_head_dim=0, qk_rope_head_dim=0), ck.tensors) == []
    assert mla_shape_problems(mods, dict(ck.config, num_attention_heads=3), ck.tensors) != []


@pytest.mark.parametrize("key", list(SIZED_BY)[1:])
def test_a_key_left_out_is_transformers_default(source, key, tmp_path):
    """vLLM 0.33 builds from the config transformers 5.20 parses: a head size or rank config.json leaves out is
    DeepseekV3Config's default (v_head_dim 128, qk_rope_head_dim 64, kv_lora_rank 512, q_lora_rank 1536, qk_nope_head_dim
    128), which these tiny projections do not have: each projection it sizes is named, the default said."""
    src, q_rank = source
    if key == "q_lora_rank" and q_rank is None:
        pytest.skip("q_lora_rank null: q_proj (a left-out key would be 1536)")
    folder = tmp_path / "edited"
    folder.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    c = json.loads((src / "config.json").read_text())
    del c[key]
    (folder / "config.json").write_text(json.dumps(c))
    found = _problems(folder)
    want = {(p.replace("q_b_proj", "q_proj"), s) if q_rank is None else (p, s) for p, s in SIZED_BY[key]}
    sides = {(re.fullmatch(WORDING, p.message)[2], re.fullmatch(WORDING, p.message)[4]) for p in found}
    assert sides == want and all(f"{key} " in p.message and "(absent: transformers' default)" in p.message for p in found), found
