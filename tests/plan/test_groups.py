"""plan/groups.py and the planner's group assignment: compressed-tensors' rule (exact name, then re: pattern, then
Linear; a target two groups list goes to the later one), a plan of several groups, a fused set split over two groups."""

from __future__ import annotations

import pytest

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import UsageError
from ctconvert.plan.groups import ConfigGroup, GroupAssignment
from ctconvert.plan.planner import make_plan
from ctconvert.plan.schemes import get_scheme

W4, FP8, NV = get_scheme("W4A16"), get_scheme("FP8_DYNAMIC"), get_scheme("NVFP4A16")
Q = "model.layers.0.self_attn.q_proj"


def _names(assign, module, linear=True):
    m = assign.match(module, linear)
    return None if m is None else (m[0].name, m[1])


def test_name_then_pattern_then_linear_whatever_the_group_order():
    groups = [ConfigGroup("lin", W4, ("Linear",)), ConfigGroup("re", FP8, ("re:.*self_attn.*",)), ConfigGroup("name", NV, (Q,))]
    for order in (groups, groups[::-1]):
        a = GroupAssignment(order)
        assert _names(a, Q) == ("name", Q)
        assert _names(a, "model.layers.0.self_attn.k_proj") == ("re", "re:.*self_attn.*")
        assert _names(a, "model.layers.0.mlp.up_proj") == ("lin", "Linear")
        assert _names(a, "model.layers.0.mlp.up_proj", linear=False) is None


def test_patterns_in_text_order_and_a_shared_target_goes_to_the_later_group():
    a = GroupAssignment([ConfigGroup("b", W4, ("re:model.*",)), ConfigGroup("a", FP8, ("re:.*proj",))])
    assert _names(a, Q) == ("a", "re:.*proj")  # '.' sorts before 'm'
    a = GroupAssignment([ConfigGroup("first", W4, ("Linear",)), ConfigGroup("later", FP8, ("Linear",))])
    assert _names(a, Q) == ("later", "Linear")


def test_one_group_keeps_the_list_order():
    a = GroupAssignment([ConfigGroup("group_0", W4, ("Linear", "re:.*q_proj"))])
    assert _names(a, Q) == ("group_0", "re:.*q_proj") and a.targets == ["Linear", "re:.*q_proj"]


def test_plan_of_two_groups(tiny_llama):
    ckpt = open_checkpoint(tiny_llama)
    groups = [ConfigGroup("mlp", NV, ("re:.*mlp.*",)), ConfigGroup("attn", FP8, ("Linear",))]
    plan = make_plan(ckpt, None, groups=groups, default_ignore=False, ignore=["lm_head"])
    rows = {r.name: r for r in plan.rows}
    assert (rows[f"{Q}.weight"].scheme, rows[f"{Q}.weight"].group) == ("FP8_DYNAMIC", "attn")
    assert (rows["model.layers.1.mlp.down_proj.weight"].scheme, rows["model.layers.1.mlp.down_proj.weight"].group) == ("NVFP4A16", "mlp")
    assert rows["lm_head.weight"].action == "ignore"
    assert {u.group: u.scheme.name for u in plan.units if u.kind == "quantize"} == {"mlp": "NVFP4A16", "attn": "FP8_DYNAMIC"}
    assert {g: (s.name, t) for g, (s, t) in plan.config_groups.items()} == {"mlp": ("NVFP4A16", ["re:.*mlp.*"]), "attn": ("FP8_DYNAMIC", ["Linear"])}
    assert plan.format == "mixed-precision" and plan.to_dict()["tensors"][[r.name for r in plan.rows].index(f"{Q}.weight")]["group"] == "attn"
    assert all("group" not in r for r in make_plan(ckpt, "W4A16").to_dict()["tensors"])  # one --scheme: today's rows


def test_a_group_that_takes_nothing_is_left_out(tiny_llama):
    groups = [ConfigGroup("none", W4, ("Linear",)), ConfigGroup("all", FP8, ("re:.*proj",))]
    plan = make_plan(open_checkpoint(tiny_llama), None, groups=groups, default_ignore=False, ignore=["lm_head"])
    assert list(plan.config_groups) == ["all"] and plan.format == "float-quantized"


def test_a_fused_set_split_over_two_groups_is_refused(tiny_llama):
    groups = [ConfigGroup("q", W4, ("re:.*q_proj",)), ConfigGroup("rest", FP8, ("Linear",))]
    with pytest.raises(UsageError, match=r"fused set .*self_attn.{q_proj,k_proj,v_proj} is split over config groups q, rest"):
        make_plan(open_checkpoint(tiny_llama), None, groups=groups, default_ignore=False, ignore=["lm_head"])
