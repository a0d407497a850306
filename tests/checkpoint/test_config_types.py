"""Config values vLLM 0.33 refuses when it parses config.json (:mod:`ctconvert.checkpoint.config_types`): a value of
another type than transformers 5.20's class declares, a ``layer_types`` of another length than the layers. quantize
warns of such a source, inspect shows it, verify fails the output naming config.json, the key, the value and what vLLM
requires; a correct config has none. Each refusal was confirmed with ``vllm_accept.py`` (vLLM 0.33, 2026-12-07)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ctconvert import api
from ctconvert.checkpoint.config_types import _COUNTED, DECLARED, FIELDS_FILE, config_type_problems, declared, layer_types_problems, parse_problems

from conftest import LLAMA_CONFIG, llama_tensors, moe_checkpoint, write_checkpoint

_WHY = "vLLM 0.33 refuses the config when it parses it"


def _llama(tmp_path, **edits):
    return write_checkpoint(tmp_path / "src", llama_tensors(LLAMA_CONFIG), {**LLAMA_CONFIG, **edits})


def _edited_moe(tmp_path, **edits):
    src = moe_checkpoint(tmp_path, inter=128)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **edits}))
    return src


def _errors(report: dict) -> list[str]:
    return [p["message"] for p in report["problems"] if p["severity"] == "error"]


def _declared(what: str, cls: str, annotation: str) -> str:
    return f"config.json's {what}: {_WHY} (transformers 5.20 {cls} declares {annotation}; its strict validation fails)"


_LAYER_TYPES = f"{_WHY} (transformers 5.20 PreTrainedConfig.validate_layer_type)"


@pytest.mark.parametrize(
    "family, edits, message",
    [
        ("llama", {"rms_norm_eps": "1e-6"}, _declared('rms_norm_eps is "1e-6", not a float', "LlamaConfig", "rms_norm_eps: float")),
        ("llama", {"rms_norm_eps": 1}, _declared("rms_norm_eps is 1, not a float (write 1.0)", "LlamaConfig", "rms_norm_eps: float")),
        ("llama", {"tie_word_embeddings": 0}, _declared("tie_word_embeddings is 0, not a boolean", "LlamaConfig", "tie_word_embeddings: bool")),
        ("llama", {"attention_bias": "false"}, _declared('attention_bias is "false", not a boolean', "LlamaConfig", "attention_bias: bool")),
        ("llama", {"layer_types": ["full_attention"]}, f"config.json's layer_types has 1 entry, but num_hidden_layers is 2: one per layer: {_LAYER_TYPES}"),
        (
            "llama",
            {"layer_types": ["full_attention", "bogus_attention"]},
            'config.json\'s layer_types[1] is "bogus_attention", not a layer type transformers 5.20 knows (full_attention, sliding_attention, '
            f"chunked_attention ...): {_LAYER_TYPES}",
        ),
        ("llama", {"hidden_act": 5}, _declared("hidden_act is 5, not a string", "LlamaConfig", "hidden_act: str")),
        (
            "llama",
            {"max_position_embeddings": "512"},
            _declared('max_position_embeddings is "512", not an integer', "LlamaConfig", "max_position_embeddings: int"),
        ),
        ("llama", {"initializer_range": "0.02"}, _declared('initializer_range is "0.02", not a float', "LlamaConfig", "initializer_range: float")),
        ("llama", {"head_dim": 32.0}, _declared("head_dim is 32.0, not an integer or null", "LlamaConfig", "head_dim: int | None")),
        (
            "qwen3_moe",
            {"router_aux_loss_coef": 0},
            _declared("router_aux_loss_coef is 0, not a float (write 0.0)", "Qwen3MoeConfig", "router_aux_loss_coef: float"),
        ),
        (
            "qwen3_moe",
            {"eos_token_id": "2"},
            _declared('eos_token_id is "2", not an integer, a list of integers or null', "Qwen3MoeConfig", "eos_token_id: int | list[int] | None"),
        ),
        (
            "qwen3_moe",
            {"num_key_value_heads": None},
            _declared("num_key_value_heads is null, not an integer", "Qwen3MoeConfig", "num_key_value_heads: int"),
        ),
        (
            "qwen3_moe",
            {"mlp_only_layers": ["1"]},
            _declared('mlp_only_layers is ["1"], not a list of integers or null', "Qwen3MoeConfig", "mlp_only_layers: list[int] | None"),
        ),
        (
            "qwen3_moe",
            {"decoder_sparse_step": 1.0},
            _declared("decoder_sparse_step is 1.0, not an integer", "Qwen3MoeConfig", "decoder_sparse_step: int"),
        ),
    ],
)
def test_a_config_value_vllm_refuses_is_warned_of_shown_and_fails_verify(tmp_path, family, edits, message):
    """The source's config carries the value to the output: quantize warns of it (exit 0, the output is written for
    other loaders), inspect shows it, verify fails the output with it, naming the output's config.json; it is reported
    alone (vLLM builds nothing from the config, and the other checks would read a value of another type)."""
    src = _llama(tmp_path, **edits) if family == "llama" else _edited_moe(tmp_path, **edits)
    res = api.quantize(src, tmp_path / "out", "W4A16")
    assert [w for w in res.warnings if message in w] == [f"the source {src}: {message}; `ctconvert verify OUT` fails it (it is written for other loaders)"]
    out = tmp_path / "out"
    assert _errors(api.verify(out)) == [message]
    (p,) = [p for p in api.verify(out)["problems"] if p["message"] == message]
    assert p["file"] == f"{out}/config.json"
    shown = [p["message"] for p in api.inspect(out)["problems"] if p["severity"] == "warning"]
    assert shown == [f"{message} (`ctconvert verify` fails it)"]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_correct_config_has_no_such_problem(tmp_path, family):
    """The unedited sources, and values the classes admit (a null where the annotation does, legacy layer type names,
    one layer type per layer): nothing to say, and verify passes."""
    if family == "llama":
        edits = {"head_dim": 64, "layer_types": ["attention", "full_attention"], "rms_norm_eps": 1e-6, "hidden_act": "silu"}
        src = _llama(tmp_path, **edits, attention_dropout=0, eos_token_id=[1, 2], pretraining_tp=None, initializer_range=0.05, use_cache=False)
    else:
        src = _edited_moe(tmp_path, mlp_only_layers=None, attention_bias=False, sliding_window=None, router_aux_loss_coef=0.001, eos_token_id=2)
    cfg = json.loads((src / "config.json").read_text())
    assert parse_problems(cfg, str(src)) == []
    api.quantize(src, tmp_path / "out", "W4A16")
    assert api.verify(tmp_path / "out")["ok"]


def test_levels_judged():
    """A composite's text_config is judged as the class it is built with (Gemma 3's Gemma3TextConfig whatever its
    model_type says); Qwen2-VL's flat keys as its text class's; Kimi-K2 and DeepSeek-V3.2 as the DeepseekV3Config vLLM
    0.33 parses them with; a family not listed, and a key the class does not declare (an attribute_map alias such as
    Qwen3-MoE's num_local_experts), are not judged here."""
    (p,) = config_type_problems({"model_type": "gemma3", "text_config": {"model_type": "x", "rms_norm_eps": "1"}}, "f")
    assert p.message.startswith('config.json\'s text_config.rms_norm_eps is "1", not a float') and "Gemma3TextConfig" in p.message
    (p,) = config_type_problems({"model_type": "qwen2_vl", "tie_word_embeddings": True, "rms_norm_eps": "1"})
    assert p.message.startswith('config.json\'s rms_norm_eps is "1"') and "Qwen2VLTextConfig" in p.message
    (p,) = config_type_problems({"model_type": "llava", "text_config": {"attention_bias": None, "head_dim": None}})
    assert p.message.startswith("config.json's text_config.attention_bias is null, not a boolean:") and "LlamaConfig" in p.message
    assert config_type_problems({"model_type": "some_new_model", "rms_norm_eps": "1"}) == []
    assert config_type_problems({"model_type": "kimi_k2", "q_lora_rank": None}) == []  # parsed as DeepseekV3Config: int | None
    (p,) = config_type_problems({"model_type": "deepseek_v32", "kv_lora_rank": None})
    assert "DeepseekV3Config declares kv_lora_rank: int;" in p.message
    assert config_type_problems({"model_type": "qwen3_moe", "num_local_experts": None, "head_dim": None}) == []
    (p,) = layer_types_problems({"model_type": "gemma3", "text_config": {"num_hidden_layers": 3, "layer_types": "full_attention"}})
    assert p.message.startswith('config.json\'s text_config.layer_types is "full_attention", not a list of layer types or null')
    assert layer_types_problems({"model_type": "llama", "layer_types": ["full_attention"]}) == []  # no num_hidden_layers: not judged
    # a count that is no integer is depth.count_type_problems' error (any family), not a second one here
    found = parse_problems({"model_type": "llama", "num_hidden_layers": "2"}, "o")
    assert [p.message for p in found] == ['config.json\'s num_hidden_layers is "2", not an integer: vLLM cannot build the model from it']


def test_head_dim_is_worded_from_the_class_that_declares_it():
    """head_dim: 32.0 (a new-user trial): the class's wording where the level's class declares head_dim (its type, as
    max_position_embeddings: "512" gets), one error, not the generic count wording as well; where no listed class
    declares it (Qwen2Config, a Gemma 3's top level), the count check's wording, as before. The same values fail."""
    why = f"{_WHY} (transformers 5.20 Qwen3Config declares head_dim: int; its strict validation fails)"
    for value in (32.0, "32", True):
        found = parse_problems({"model_type": "qwen3", "head_dim": value}, "o")
        assert [p.message for p in found] == [f"config.json's head_dim is {json.dumps(value)}, not an integer: {why}"]
    (p,) = parse_problems({"model_type": "gemma3", "text_config": {"head_dim": 32.0}}, "o")
    assert p.message == f"config.json's text_config.head_dim is 32.0, not an integer: {why.replace('Qwen3Config', 'Gemma3TextConfig')}"
    generic = "config.json's head_dim is 32.0, not an integer: vLLM cannot build the model from it"
    assert [p.message for p in parse_problems({"model_type": "qwen2", "head_dim": 32.0}, "o")] == [generic]
    assert [p.message for p in parse_problems({"model_type": "gemma3", "head_dim": 32.0, "text_config": {}}, "o")] == [generic]
    assert parse_problems({"model_type": "llama", "head_dim": None}, "o") == parse_problems({"model_type": "qwen3", "head_dim": 32}, "o") == []


#: annotation (``str()``, class brackets dropped) -> the table's code, as scripts/config_fields.py writes it
_CODES = {"int": "i", "float": "f", "bool": "b", "str": "s", "list[int]": "I", "list[str]": "S", "float | int": "n", "int | float": "n"}
_CODES["int | list[int]"] = "t"
#: per code: values the rule must judge as the class does (the first of each kind, the rest of another)
_SAMPLES = {
    "i": [3, "1", 1.0, True],
    "f": [0.5, {"__float__": "NaN"}, 1, "1.0", True],
    "b": [True, False, 0, "true"],
    "s": ["silu", 5, True],
    "I": [[1], [], ["1"], [True], 1],
    "S": [["a"], [1], "a"],
    "n": [0.0, 1, "1", True, [1]],
    "t": [2, [1, 2], "1", True, [1.0], ["1"]],
}


#: the trial's and new cases per family, as vllm_accept.py found them (config stage REJECT; 2026-12-08, vLLM 0.33 on CPU:
#: llama, gpt_oss, qwen3, mixtral, mistral; the others read in the classes)
_NEW = [
    ("llama", {"hidden_act": 5}, "hidden_act is 5, not a string", "LlamaConfig declares hidden_act: str;"),
    ("llama", {"use_cache": 1}, "use_cache is 1, not a boolean", "use_cache: bool;"),
    ("llama", {"attention_dropout": True}, "attention_dropout is true, not a number or null", "attention_dropout: float | int | None;"),
    ("qwen3", {"use_sliding_window": "false"}, 'use_sliding_window is "false", not a boolean', "Qwen3Config declares use_sliding_window: bool;"),
    ("qwen3", {"max_window_layers": 2.0}, "max_window_layers is 2.0, not an integer", "max_window_layers: int;"),
    ("qwen3_moe", {"norm_topk_prob": "true"}, 'norm_topk_prob is "true", not a boolean', "Qwen3MoeConfig"),
    ("gpt_oss", {"sliding_window": "128"}, 'sliding_window is "128", not an integer or null', "GptOssConfig declares sliding_window: int | None;"),
    ("gpt_oss", {"swiglu_limit": 7}, "swiglu_limit is 7, not a float (write 7.0)", "swiglu_limit: float;"),
    ("mixtral", {"router_jitter_noise": 0}, "router_jitter_noise is 0, not a float (write 0.0)", "MixtralConfig"),
    ("mistral", {"sliding_window": "4096"}, 'sliding_window is "4096", not an integer or null', "MistralConfig"),
    ("deepseek_v3", {"routed_scaling_factor": 2}, "routed_scaling_factor is 2, not a float (write 2.0)", "DeepseekV3Config"),
    ("kimi_k2", {"rope_interleave": "true"}, 'rope_interleave is "true", not a boolean or null', "DeepseekV3Config declares rope_interleave: bool | None;"),
    ("hunyuan_v1_moe", {"moe_topk": [1.0]}, "moe_topk is [1.0], not an integer or a list of integers:", "moe_topk: int | list[int];"),
    ("glm4_moe_lite", {"mlp_layer_types": "dense"}, 'mlp_layer_types is "dense", not a list of strings or null', "list[str] | None;"),
]


@pytest.mark.parametrize("family, edits, words, cls", _NEW)
def test_every_simply_typed_field_is_judged(family, edits, words, cls):
    """Fields ctconvert does not read are judged too (the trial's hidden_act: 5 and gpt-oss sliding_window: "128"
    passed verify while vLLM refused them), one error each, in the composites' text_config as well."""
    (p,) = config_type_problems({"model_type": family, **edits}, "o/config.json")
    assert p.severity == "error" and p.file == "o/config.json"
    assert p.message.startswith(f"config.json's {words}") and cls in p.message and _WHY in p.message


def test_a_composites_text_config_is_judged_as_its_text_class():
    gemma = {"model_type": "gemma3", "text_config": {"query_pre_attn_scalar": "256", "final_logit_softcapping": 30}}
    assert sorted(p.message.split(":")[0] for p in config_type_problems(gemma)) == [
        "config.json's text_config.final_logit_softcapping is 30, not a float or null (write 30.0)",
        'config.json\'s text_config.query_pre_attn_scalar is "256", not an integer',
    ]


def _right(code: str):
    return {"i": 3, "f": 0.5, "b": False, "s": "silu", "I": [1], "S": ["a"], "n": 0, "t": [1, 2]}[code.rstrip("?")]


def _wrong(code: str):
    return {"i": "3", "f": 1, "b": 0, "s": 5, "I": ["1"], "S": [1], "n": True, "t": "2"}[code.rstrip("?")]


@pytest.mark.parametrize("family", sorted(DECLARED))
def test_each_declared_key_right_null_and_wrong(family):
    """Every key of the table: a value of its type passes, null passes where the annotation is Optional (else an
    error), and a value of another type is one error naming the key (a count's is depth.py's, as before)."""
    table = declared(family)
    right = {"model_type": family, **{k: _right(c) for k, c in table.items()}}
    assert parse_problems(right, "o") == []
    assert parse_problems({**right, **{k: None for k, c in table.items() if c.endswith("?")}}, "o") == []
    for key, code in table.items():
        for value in [_wrong(code)] + ([] if code.endswith("?") else [None]):
            (p,) = parse_problems({**right, key: value}, "o")
            assert p.message.startswith(f"config.json's {key} is {json.dumps(value)}, not "), p.message
            assert (DECLARED[family][0] in p.message) != (key in _COUNTED and value is not None), p.message


@pytest.mark.parametrize("family", sorted(DECLARED))
def test_unjudged_annotations_are_never_reported(family):
    """Dicts, Literals, int | str, PreTrainedConfig's own string-annotated fields, keys the class does not declare
    (attribute_map aliases, legacy rope keys, quantization_config) are not judged, whatever their value."""
    cfg = {"model_type": family, "rope_parameters": "x", "dtype": 5, "torch_dtype": 5, "transformers_version": 5, "id2label": "x"}
    cfg |= {"is_encoder_decoder": "no", "chunk_size_feed_forward": "0", "output_hidden_states": 1, "problem_type": 5, "quantization_config": 5}
    cfg |= {"use_bidirectional_attention": 5, "mamba_dt_rank": [1], "rope_scaling": 5, "rope_theta": "1e4", "num_mtp_layers_x": "1"}
    assert config_type_problems({k: v for k, v in cfg.items() if k not in declared(family)}) == []
    text = {k: v for k, v in cfg.items() if k not in declared("gemma3_text")}
    assert config_type_problems({"model_type": "gemma3", "text_config": {**text, "model_type": "gemma3_text"}}) == []


def _code(annotation) -> str | None:
    if isinstance(annotation, str):
        return None  # PreTrainedConfig's own fields (from __future__ import annotations): huggingface_hub skips them
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    base = _CODES.get(text.removesuffix(" | None"))
    return None if base is None else base + ("?" if text.endswith(" | None") else "")


@pytest.mark.parametrize("family", sorted(DECLARED))
def test_the_table_is_the_classes_own(family):
    """The stored table (transformers 5.20.2's, what vLLM 0.33 runs; CI has no such venv) against the installed
    transformers' class: with 5.20 the same keys and codes; with another 5.x every key both declare has the same code.
    And the rule agrees with the installed strict validator on every key both declare: each sample value is refused
    exactly where :func:`config_type_problems` reports it (an int for a float, 0 for a bool, "1" for an int ...)."""
    transformers = pytest.importorskip("transformers")
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    if not dataclasses.is_dataclass(cls):
        pytest.skip(f"transformers {transformers.__version__}: config classes are no strict dataclasses")
    refused = pytest.importorskip("huggingface_hub.errors").StrictDataclassFieldValidationError
    assert cls.__name__ == DECLARED[family][0]
    live = {f.name: c for f in dataclasses.fields(cls) if (c := _code(f.type)) and f.name != "layer_types"}
    table = declared(family)
    if transformers.__version__.startswith("5.20."):
        assert live == table
    common = {k: c for k, c in table.items() if live.get(k) == c}
    assert len(common) >= 0.9 * len(table), sorted(set(table) - set(common))
    for key, code in common.items():
        for value in [*_SAMPLES[code.rstrip("?")], None]:
            try:
                cls(**cls._decode_special_floats({key: value}))  # as get_config_dict reads config.json
                taken = True
            except refused as e:  # by the type check (a TypeError), not a field's own validator (Llama's initializer_range interval)
                taken = key not in str(e) or not isinstance(e.__cause__, TypeError)
            except Exception:  # noqa: BLE001 - a class validator or __post_init__ failing on a value it took
                taken = True
            found = config_type_problems({"model_type": family, key: value})
            assert (not found) == taken or (key in _COUNTED and value is not None and not taken), (key, value, found)


def test_the_table_is_package_data():
    """The table is read from the package's own file (no transformers import at run time), which the wheel carries."""
    import importlib.resources
    from pathlib import Path

    text = (importlib.resources.files("ctconvert.checkpoint") / FIELDS_FILE).read_text()
    rows = [line.split() for line in text.splitlines() if line and not line.startswith("#")]
    assert {r[0]: (r[1], dict(f.split(":") for f in r[2:])) for r in rows} == DECLARED
    assert text.startswith("# transformers 5.20.2:")
    (line,) = [t for t in (Path(__file__).parents[2] / "pyproject.toml").read_text().splitlines() if t.startswith('"ctconvert.checkpoint" = [')]
    assert f'"{FIELDS_FILE}"' in line.split("]")[0]
    assert "import transformers" not in (Path(__file__).parents[2] / "ctconvert/checkpoint/config_types.py").read_text()
    assert len(DECLARED) == 34 and all(len(f) >= 12 for _, f in DECLARED.values())


def test_layer_types_as_transformers_validates_them():
    """The rule agrees with the installed transformers' PreTrainedConfig.validate_layer_type on Llama's class."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    if not hasattr(LlamaConfig, "validate_layer_type"):
        pytest.skip("transformers without validate_layer_type")
    for types in (["full_attention"], ["full_attention", "bogus"], ["attention", "sliding_attention"], ["full_attention"] * 2, "full"):
        try:
            LlamaConfig(num_hidden_layers=2, layer_types=types)
            refused = False
        except Exception:  # noqa: BLE001 - StrictDataclassClassValidationError (or a TypeError on a string)
            refused = True
        found = layer_types_problems({"model_type": "llama", "num_hidden_layers": 2, "layer_types": types})
        assert bool(found) == refused, (types, found)


def test_kv_head_count_reads_the_class_default_where_the_key_is_null_or_absent():
    from ctconvert.checkpoint.config_types import kv_head_count

    assert kv_head_count({"model_type": "qwen2", "num_attention_heads": 28}) == 32  # Qwen2Config's default, not the heads
    assert kv_head_count({"model_type": "qwen2", "num_attention_heads": 28, "num_key_value_heads": None}) == 28
    assert kv_head_count({"model_type": "llama", "num_attention_heads": 28}) == 28
    assert kv_head_count({"model_type": "llama", "num_attention_heads": 28, "num_key_value_heads": 4}) == 4
    assert kv_head_count({"model_type": "qwen3_moe", "num_attention_heads": 32}) == 4
    assert kv_head_count({"model_type": "unknown_type", "num_attention_heads": 12}) == 12  # no known default: the heads
    assert kv_head_count({"model_type": "llava", "text_config": {"model_type": "qwen2", "num_attention_heads": 28}}) == 32
    assert kv_head_count({"model_type": "llama"}) is None


@pytest.mark.parametrize(
    ("archs", "words"),
    [
        ("Qwen3ForCausalLM", 'architectures is "Qwen3ForCausalLM", not a list of strings'),
        ({"a": 1}, "not a list of strings"),
        (["LlamaForCausalLM", None], "architectures[1] is null, not a string"),
        ([1], "architectures[0] is 1, not a string"),
    ],
)
def test_architectures_vllm_refuses_are_errors(archs, words):
    from ctconvert.checkpoint.config_types import architectures_problems, parse_problems

    cfg = {"model_type": "llama", "architectures": archs}
    got = architectures_problems(cfg, "m/config.json")
    assert len(got) == 1 and words in got[0].message and got[0].severity == "error"
    assert "ModelArchitectureConfig" in got[0].message
    assert [p.message for p in parse_problems(cfg, "m") if "architectures" in p.message] == [got[0].message]


@pytest.mark.parametrize("archs", [["LlamaForCausalLM"], [], None, ["FooBarForCausalLM", "LlamaForCausalLM"]])
def test_architectures_vllm_takes_pass(archs):
    from ctconvert.checkpoint.config_types import architectures_problems

    assert architectures_problems({"model_type": "llama", "architectures": archs}) == []
    assert architectures_problems({"model_type": "llama"}) == []


def test_head_dim_is_the_class_default_where_config_json_has_none():
    from ctconvert.checkpoint.config_types import head_dim

    base = {"hidden_size": 256, "num_attention_heads": 8}
    assert head_dim(dict(base, head_dim=48), "qwen3") == (48, "head_dim")
    assert head_dim(base, "qwen3")[0] == 128 and "Qwen3Config" in head_dim(base, "qwen3")[1]
    assert head_dim(base, "gpt_oss")[0] == 64
    assert head_dim(base, "gemma2")[0] == 256
    assert head_dim(base, "gemma3")[0] == 256  # a composite's text level: Gemma3TextConfig
    assert head_dim(base, "llama") == (32, "hidden_size / num_attention_heads")
    assert head_dim(base, "qwen3_moe") == (32, "hidden_size / num_attention_heads")  # Qwen3MoeConfig has none: vLLM divides
    assert head_dim(dict(base, head_dim=None), "qwen3") == (32, "hidden_size / num_attention_heads")  # null: a type error elsewhere
    assert head_dim({"hidden_size": 250, "num_attention_heads": 8}, "llama") == (None, "")


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "10000"}}, "rope_parameters.rope_theta"),
        ({"rope_theta": "10000"}, "rope_theta"),  # transformers moves it into rope_parameters
        ({"rope_parameters": {"full_attention": {"rope_theta": True}, "sliding_attention": {"rope_theta": 1e4}}}, "rope_parameters.full_attention.rope_theta"),
        ({"text_config": {"rope_parameters": {"rope_theta": [1]}}}, "text_config.rope_parameters.rope_theta"),
    ],
)
def test_a_rope_base_that_is_not_a_number_is_an_error(cfg, key):
    from ctconvert.checkpoint.config_types import parse_problems, rope_problems

    (p,) = rope_problems(dict(cfg, model_type="llama"), "m/config.json")
    assert p.severity == "error" and p.message.startswith(f"config.json's {key} is ") and "not a number" in p.message
    assert p.message in [q.message for q in parse_problems(dict(cfg, model_type="llama"), "m")]


@pytest.mark.parametrize(
    "cfg",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000}},
        {"rope_parameters": {"rope_theta": 1e6}, "rope_theta": "10000"},  # the dict's own value is the one used
        {"rope_theta": 500000.0},
        {"rope_parameters": None},
        {},
    ],
)
def test_a_numeric_rope_base_passes(cfg):
    from ctconvert.checkpoint.config_types import rope_problems

    assert rope_problems(dict(cfg, model_type="llama")) == []


def test_kv_head_count_of_composites_and_text_classes():
    """The class a level is parsed with decides the default: a flat Qwen2-VL config is Qwen2VLTextConfig's (8), a
    Gemma 3 text_config without any head count Gemma3TextConfig's (4; transformers 5.20.2, built without the key)."""
    from ctconvert.checkpoint.config_types import kv_head_count

    assert kv_head_count({"model_type": "qwen2_vl", "num_attention_heads": 28}) == 8
    assert kv_head_count({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 2560}}) == 4
    assert kv_head_count({"model_type": "qwen3_vl", "text_config": {"num_attention_heads": 16}}) == 32
    assert kv_head_count({"model_type": "llama4", "text_config": {"num_attention_heads": 40}}) == 8
    assert kv_head_count({"model_type": "qwen2_vl", "num_attention_heads": 28, "num_key_value_heads": None}) == 28  # null: the heads
