"""plan/recipe.py: the recipe forms llm-compressor 0.14.0.1 reads, and every refusal by name."""

from __future__ import annotations

import json
import textwrap

import pytest

from ctconvert.errors import UsageError
from ctconvert.plan.recipe import read_recipe

W4 = "{num_bits: 4, type: int, symmetric: true, group_size: 128, strategy: group}"


def _write(tmp_path, text: str, name: str = "r.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def _qm(args: str) -> str:
    """A recipe of one QuantizationModifier with ``args`` (YAML lines, indented below it)."""
    body = textwrap.indent(textwrap.dedent(args), " " * 6)
    return f"quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n{body}"


def test_config_groups_with_observers(tmp_path):
    r = read_recipe(
        _write(
            tmp_path,
            _qm(f"""\
            ignore: [lm_head]
            config_groups:
              mlp:
                targets: ["re:.*mlp.*"]
                weights: {{num_bits: 4, type: float, symmetric: true, group_size: 16, strategy: tensor_group, dynamic: false,
                           scale_dtype: torch.float8_e4m3fn, observer: nvfp4_expanded_mse, observer_kwargs: {{}}, zp_dtype: null}}
              rest:
                targets: Linear
                weights: {W4}
            """),
        )
    )
    assert [(g.name, g.scheme.name, g.targets, g.observer) for g in r.groups] == [
        ("mlp", "NVFP4A16", ("re:.*mlp.*",), "nvfp4_expanded_mse"),
        ("rest", "W4A16", ("Linear",), "minmax"),
    ]
    assert r.ignore == ("lm_head",) and r.observers == {"mlp": "nvfp4_expanded_mse"}


def test_scheme_forms(tmp_path):
    r = read_recipe(_write(tmp_path, _qm("scheme: {W4A16: ['re:.*mlp.*'], FP8_DYNAMIC: ['re:.*attn.*']}\nweight_observer: memoryless_mse\n")))
    assert [(g.name, g.scheme.name, g.targets, g.observer) for g in r.groups] == [
        ("group_0", "W4A16", ("re:.*mlp.*",), "memoryless_mse"),
        ("group_1", "FP8_DYNAMIC", ("re:.*attn.*",), "memoryless_mse"),
    ]
    r = read_recipe(_write(tmp_path, _qm("scheme: NVFP4A16\ntargets: [Linear]\nobserver: {weights: nvfp4_expanded_mse}\n")))
    assert [(g.name, g.scheme.name, g.targets, g.observer) for g in r.groups] == [("group_0", "NVFP4A16", ("Linear",), "nvfp4_expanded_mse")]


def test_json_and_saved_defaults(tmp_path):
    """A recipe as llm-compressor saves it (its defaults written out), in JSON, over two stages' keys."""
    doc = {
        "quant_stage": {
            "quant_modifiers": {
                "QuantizationModifier": {
                    "config_groups": {
                        "group_0": {
                            "targets": ["Linear"],
                            "weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128, "zp_dtype": None},
                            "input_activations": None,
                            "output_activations": None,
                            "format": None,
                        }
                    },
                    "targets": ["Linear"],
                    "ignore": [],
                    "bypass_divisibility_checks": False,
                    "requires_calibration_data": False,
                    "index": None,
                    "group": "quant",
                }
            }
        }
    }
    r = read_recipe(_write(tmp_path, json.dumps(doc), "r.json"))
    assert [(g.name, g.scheme.name, g.observer) for g in r.groups] == [("group_0", "W8A16", "minmax")] and r.ignore == ()


REFUSED = [
    ("quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16}\n", "GPTQModifier is not implemented"),
    ("quant_stage:\n  quant_modifiers:\n    AWQModifier: {}\n    QuantizationModifier: {scheme: W4A16}\n", "AWQModifier is not implemented"),
    ("s_stage:\n  s_modifiers:\n    SmoothQuantModifier: {smoothing_strength: 0.8}\n", "SmoothQuantModifier is not implemented"),
    ("sparsity_stage:\n  sparsity_modifiers:\n    SparseGPTModifier: {sparsity: 0.5}\n", "SparseGPTModifier is not implemented"),
    ("QuantizationModifier: {scheme: W4A16}\n", "'QuantizationModifier' is not a stage"),
    ("quant_stage:\n  QuantizationModifier: {scheme: W4A16}\n", "is not a modifier group"),
    ("a_stage:\n  a_modifiers:\n    QuantizationModifier: {scheme: W4A16}\nb_stage:\n  b_modifiers:\n    QuantizationModifier: {scheme: W8A16}\n", "2 Quantiz"),
    (_qm("scheme: W4A16\nkv_cache_scheme: {num_bits: 8, type: float}\n"), "argument kv_cache_scheme is not implemented"),
    (_qm("scheme: W4A16\ninput_observer: mse\n"), "argument input_observer is not implemented"),
    (_qm("scheme: W4A16\nstart: 0\n"), "start: 0 is not implemented"),
    (_qm("scheme: W4A16\nbypass_divisibility_checks: true\n"), "bypass_divisibility_checks: True"),
    (_qm("scheme: W4A16\nobserver: {input: mse}\n"), "only a weights observer"),
    (_qm("scheme: W4A16\nweight_observer: mse\n"), "weight observer 'mse' is not implemented"),
    (_qm("scheme: NVFP4\n"), "NVFP4 needs calibrated activation scales"),
    (_qm("scheme: W4A17\n"), "scheme 'W4A17': unknown scheme"),
    (_qm(f"scheme: W4A16\nconfig_groups: {{g: {{targets: [Linear], weights: {W4}}}}}\n"), "either scheme or config_groups"),
    (_qm("ignore: [lm_head]\n"), "without scheme or config_groups"),
    (_qm(f"targets: [re:.*mlp.*]\nconfig_groups: {{g: {{targets: [Linear], weights: {W4}}}}}\n"), "targets with config_groups"),
    (_qm("config_groups: {g: {targets: [Linear], weights: {num_bits: 3, type: int, strategy: channel}}}\n"), "config group g: scheme"),
    (_qm(f"config_groups: {{g: {{targets: [], weights: {W4}}}}}\n"), "config group g: targets must be"),
    (_qm("config_groups: {g: {targets: [Linear]}}\n"), "config group g: needs weights"),
    (
        _qm("config_groups: {g: {targets: [Linear], weights: {num_bits: 4, type: int, group_size: 128, strategy: group, observer: fouroversix}}}\n"),
        "weight observer 'fouroversix' is not implemented",
    ),
    (_qm("config_groups: {g: {targets: [Linear], weights: {num_bits: 8, type: float, strategy: channel, observer_kwargs: {norm: 3}}}}\n"), "observer_kwargs"),
    ("[1, 2]\n", "must be a mapping of stages"),
    ("quant_stage: {quant_modifiers: {QuantizationModifier: {scheme: W4A16}}\n", "not valid YAML/JSON"),
]


@pytest.mark.parametrize("text,match", REFUSED, ids=[m for _, m in REFUSED])
def test_refused_by_name(tmp_path, text, match):
    with pytest.raises(UsageError, match=match):
        read_recipe(_write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="cannot read the recipe"):
        read_recipe(tmp_path / "none.yaml")
