"""refusal_hint: the way out a refused weight's error names. A module refused for its shape in one numbered layer is
named for every layer that holds it (its shape comes from the config: the next run would refuse the next layer's),
with a group size that divides K where --group-size sets the scheme's; a module of its own is named as it is."""

from __future__ import annotations

import re

from ctconvert.plan.advice import refusal_hint
from ctconvert.plan.schemes import resolve_scheme

L = "model.layers."
MLA = [f"{L}{i}.self_attn.{m}" for i in range(3) for m in ("kv_b_proj", "q_b_proj", "o_proj")]


def test_a_layer_module_refused_for_k_is_named_for_every_layer_with_a_group_size_that_fits():
    hint = refusal_hint(f"{L}0.self_attn.kv_b_proj", (256, 32), resolve_scheme("W4A16"), False, frozenset(MLA), "--ignore")
    pattern = r"re:model\.layers\.\d+\.self_attn\.kv_b_proj$"
    assert hint == f"leave it dense with --ignore '{pattern}', quantize with a group size that divides K=32 (--group-size 32), or pass --skip-incompatible"
    assert [m for m in MLA if re.match(pattern[3:], m)] == [f"{L}{i}.self_attn.kv_b_proj" for i in range(3)]  # every layer's, no other
    fits = refusal_hint(f"{L}0.self_attn.q_b_proj", (192, 64), resolve_scheme("W4A16"), False, frozenset(MLA), "--ignore")
    assert "(--group-size 64)" in fits  # the largest that divides K, below the preset's 128


def test_a_module_no_other_layer_holds_is_named_as_it_is_and_no_group_size_where_the_scheme_has_none_to_set():
    alone = refusal_hint("model.vision.proj", (64, 100), resolve_scheme("W4A16"), False, frozenset(["model.vision.proj", *MLA]), "--ignore")
    assert alone == "leave it dense with --ignore 'model.vision.proj' or pass --skip-incompatible"  # K=100: no group of 64 or 32 divides it
    fp8 = refusal_hint(f"{L}0.self_attn.kv_b_proj", (200, 32), resolve_scheme("FP8_BLOCK"), False, frozenset(MLA), "--ignore")
    assert fp8 == r"leave it dense with --ignore 're:model\.layers\.\d+\.self_attn\.kv_b_proj$' or pass --skip-incompatible"
    recipe = refusal_hint("model.vision.proj", (64, 96), resolve_scheme("W4A16"), False, frozenset(["model.vision.proj"]), "the recipe's ignore")
    fit = "quantize with a group size that divides K=96 (--group-size 32)"
    assert recipe == f"leave it dense with an entry in the recipe's ignore ('model.vision.proj'), {fit}, or pass --skip-incompatible"


def test_a_fused_set_member_keeps_its_wording_with_the_group_size_before_skip_incompatible():
    mods = frozenset(f"{L}{i}.self_attn.{m}_proj" for i in range(2) for m in "qkv")
    hint = refusal_hint(f"{L}0.self_attn.k_proj", (64, 96), resolve_scheme("W4A16"), False, mods, "--ignore")
    every = r"re:model\.layers\.\d+\.self_attn\.k_proj$"
    assert hint.startswith(f"leave it dense with --ignore '{every}' and its fused set's other members (q_proj, v_proj; vLLM loads")
    fit = "quantize with a group size that divides K=96 (--group-size 32)"
    assert hint.endswith(f"with one scheme), {fit}, or pass --skip-incompatible (keeps the whole set dense)")
    no_fit = refusal_hint(f"{L}0.self_attn.k_proj", (64, 100), resolve_scheme("W4A16"), False, mods, "--ignore")
    assert no_fit.endswith("with one scheme), or pass --skip-incompatible (keeps the whole set dense)")
