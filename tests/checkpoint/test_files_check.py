"""The rules of :mod:`ctconvert.checkpoint.files_check` on hand-made configs and folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctconvert.checkpoint.files_check import CONFIG_RULES, FILE_RULES, attention_shape_problems, config_problems, copied_file_problems
from ctconvert.checkpoint.modules import Module
from ctconvert.checkpoint.reader import Checkpoint
from ctconvert.checkpoint.safetensors_io import TensorInfo

VLM = {"model_type": "llava", "text_config": {"rope_theta": 1e6, "tie_word_embeddings": True, "torch_dtype": "float32"}, "vision_config": {"hidden_size": 64}}


def _ckpt(config: dict, tensors=("lm_head.weight",)) -> Checkpoint:
    return Checkpoint(Path("/nowhere"), config, dict.fromkeys(tensors), [], None)


def _messages(got: dict, want: dict, tensors=("lm_head.weight",)) -> list[str]:
    return [p.message for p in config_problems(_ckpt(got, tensors), _ckpt(want))]


def test_nested_keys_are_named_with_dots():
    got = {**VLM, "text_config": {**VLM["text_config"], "rope_theta": 1.0}, "vision_config": {}}
    assert _messages(got, VLM) == [
        "config.json's text_config.rope_theta is 1.0, the reference's 1000000.0",
        "config.json lacks vision_config.hidden_size (the reference's: 64)",
    ]


def test_what_a_conversion_changes():
    assert set(CONFIG_RULES) == {"quantization_config", "torch_dtype", "dtype", "tie_word_embeddings"} and "hidden" in FILE_RULES
    converted = {
        **VLM,
        "quantization_config": {"quant_method": "compressed-tensors"},
        "torch_dtype": "bfloat16",  # --dense-dtype adds it at the top level
        "tie_word_embeddings": False,  # --lm-head unties it, at the top level and in text_config
        "text_config": {**VLM["text_config"], "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    }
    assert _messages(converted, VLM) == []
    assert "tie_word_embeddings is false but the output stores no lm_head" in _messages(converted, VLM, tensors=("model.embed_tokens.weight",))[0]
    quantized_ref = {**VLM, "text_config": {**VLM["text_config"], "quantization_config": {"quant_method": "gptq"}}}
    assert _messages(VLM, quantized_ref) == []  # the source's own, dropped (decompress, a requantization)
    added = 'config.json adds text_config.quantization_config: {"quant_method": "gptq"} (not in the reference, and no conversion writes it)'
    assert _messages(quantized_ref, VLM) == [added]
    assert _messages({**VLM, "dtype": "float8"}, VLM) == ['config.json adds dtype: "float8" (not in the reference, and no conversion writes it)']


def test_an_untied_head_no_tensor_fills_is_said_once():
    """A generating model untied (tie_word_embeddings false, the reference's true) that stores no lm_head: the widths check
    (widths.tied_head_problems, with or without a reference) says it; config_problems does not say it again. For a model
    that does not generate (no ...ForCausalLM / ...ForConditionalGeneration) config_problems still does."""
    from ctconvert.checkpoint.widths import tied_head_problems

    gen = {**VLM, "architectures": ["LlavaForConditionalGeneration"]}
    untied = {**gen, "text_config": {**gen["text_config"], "tie_word_embeddings": False}}
    headless = ("model.embed_tokens.weight",)
    assert _messages(untied, gen, tensors=headless) == []
    (p,) = tied_head_problems(untied, dict.fromkeys(headless))
    assert "tie_word_embeddings is false, but the checkpoint stores no lm_head" in p.message
    other = {**untied, "architectures": ["LlavaModel"]}
    assert tied_head_problems(other, dict.fromkeys(headless)) == []
    (m,) = _messages(other, {**gen, "architectures": ["LlavaModel"]}, tensors=headless)
    assert "tie_word_embeddings is false but the output stores no lm_head" in m


def test_a_head_dim_derived_from_hidden_size_is_said_plainly():
    """Without head_dim in config.json the error says which keys gave it (hidden_size / num_attention_heads), not a
    garbled 'x hidden_size / num_attention_heads = 64 = 256' formula."""
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 256}
    tensors = {"model.embed_tokens.weight": None, "model.layers.0.self_attn.k_proj.weight": None}
    k = Module(
        "model.layers.0.self_attn.k_proj", {"weight": TensorInfo("model.layers.0.self_attn.k_proj.weight", Path("m.safetensors"), "BF16", (128, 256), 0, 0)}
    )
    (p,) = attention_shape_problems({k.name: k}, cfg, tensors)
    assert p.message == (
        "config.json's num_key_value_heads 4 x head_dim 64 (config.json has no head_dim: hidden_size 256 / num_attention_heads 4) = 256 "
        "output rows, but k_proj has 128"
    )
    (p,) = attention_shape_problems({k.name: k}, dict(cfg, head_dim=64), tensors)
    assert p.message == "config.json's num_key_value_heads 4 x head_dim 64 = 256 output rows, but k_proj has 128"


def test_copied_files(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    files = {
        "config.json": "{}",
        "model.safetensors": "w",
        "sub/model.safetensors.index.json": "{}",
        "pytorch_model.bin": "w",  # --keep-other-weights
        "original/consolidated.pth": "w",
        "quantize_config.json": "{}",  # a quantized source's own
        ".cache/huggingface/x.lock": "",  # hidden: not copied
        ".gitattributes": "*.bin lfs",
        "ctconvert-provenance.json": "{}",  # each quantize output writes its own
        "1_Pooling/config.json": "{}",
    }
    for name, text in files.items():
        (ref / name).parent.mkdir(parents=True, exist_ok=True)
        (ref / name).write_text(text)
    (out / "1_Pooling").mkdir(parents=True)
    (out / "ctconvert-provenance.json").write_text('{"other": 1}')
    assert [p.message for p in copied_file_problems(out, ref)] == [
        ".gitattributes of the reference is missing from the output (a conversion copies it)",
        "1_Pooling/config.json of the reference is missing from the output (a conversion copies it)",
    ]
    (out / ".gitattributes").write_text("*.bin lfs")
    (out / "1_Pooling/config.json").write_text("{ }")
    (out / "pytorch_model.bin").write_text("w")
    assert [p.message for p in copied_file_problems(out, ref)] == ["1_Pooling/config.json differs from the reference's (a conversion copies it unchanged)"]


def _module(name: str, rows: int) -> Module:
    return Module(name, {"weight": TensorInfo(name + ".weight", Path("/x"), "BF16", (rows, 256), 0, rows * 512)})


def test_attention_shapes_skip_other_rules():
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    mods = {m.name: m for m in (_module("model.layers.0.self_attn.q_proj", 256), _module("model.layers.0.self_attn.k_proj", 256))}
    emb = {"model.embed_tokens.weight": None}
    assert [p.tensor for p in attention_shape_problems(mods, cfg, emb)] == ["model.layers.0.self_attn.k_proj"]
    assert attention_shape_problems(mods, {**cfg, "kv_lora_rank": 512}, emb) == []  # MLA
    assert attention_shape_problems(mods, {**cfg, "model_type": "qwen3_next"}, emb) == []  # a gated query of twice the rows
    assert [p.tensor for p in attention_shape_problems(mods, {"text_config": cfg}, emb)] == ["model.layers.0.self_attn.k_proj"]
    assert attention_shape_problems(mods, cfg, {}) == []  # no token embedding: no decoder stack known, nothing checked
    tower = {m.name: m for m in (_module("vision_tower.vision_model.layers.0.self_attn.k_proj", 96),)}
    assert attention_shape_problems(tower, {"text_config": cfg}, emb) == []  # the vision tower has its own config


@pytest.mark.parametrize(
    "prefix",
    [
        "vpm.encoder.layers.0.self_attn",  # MiniCPM-V's SigLIP tower
        "apm.layers.0.self_attn",  # MiniCPM-o's audio tower
        "model.embed_tokens_extend.image_embed.img_processor.encoder.layers.0.self_attn",  # Phi-4-multimodal
        "model.connector.perceiver_resampler.layers.0.self_attn",  # Idefics2
    ],
)
def test_towers_of_any_naming_are_not_the_decoders_attention(prefix):
    """Only ``<P>layers.N`` beside the token embedding ``<P>embed_tokens`` is the text model (a sweep found towers whose
    names the vision pattern misses failing a correct output: 28 x 128 = 3584 rows against a SigLIP's 1152)."""
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    mods = {m.name: m for m in (_module(f"{prefix}.q_proj", 96), _module(f"{prefix}.k_proj", 96), _module("model.layers.0.self_attn.k_proj", 128))}
    assert attention_shape_problems(mods, cfg, {"model.embed_tokens.weight": None}) == []
    mods["model.layers.0.self_attn.k_proj"] = _module("model.layers.0.self_attn.k_proj", 64)  # the decoder's own is still checked
    assert [p.tensor for p in attention_shape_problems(mods, cfg, {"model.embed_tokens.weight": None})] == ["model.layers.0.self_attn.k_proj"]
    lm = {"model.language_model.embed_tokens.weight": None}  # a VLM's text model under model.language_model.
    vlm = {m.name: m for m in (_module("model.language_model.layers.0.self_attn.k_proj", 64),)}
    assert [p.tensor for p in attention_shape_problems(vlm, {"text_config": cfg}, lm)] == ["model.language_model.layers.0.self_attn.k_proj"]


#: (model_type, num_key_value_heads in config.json: "absent", None or a number, the number judged or None, the words
#: and number the error gives: a class default's words carry its number, which no config.json holds)
KV_CASES = [
    ("llama", "absent", 4, "num_key_value_heads (absent: transformers' LlamaConfig takes num_attention_heads) 4"),
    ("llama", None, 4, "num_key_value_heads (null: transformers' LlamaConfig takes num_attention_heads) 4"),
    ("qwen2", None, 4, "num_key_value_heads (null: transformers' Qwen2Config takes num_attention_heads) 4"),
    ("qwen2", "absent", 32, "num_key_value_heads (absent: transformers' Qwen2Config default, 32)"),
    ("mistral", "absent", 8, "num_key_value_heads (absent: transformers' MistralConfig default, 8)"),
    ("mistral", None, None, None),  # a null MistralConfig refuses: config_types.py's error
    ("qwen2_moe", None, None, None),  # kept null by Qwen2MoeConfig: not judged
    ("starcoder2", "absent", None, None),  # a family not listed: not judged
    ("llama", 2, 2, "num_key_value_heads 2"),
]


@pytest.mark.parametrize("model_type,kv,judged,words", KV_CASES)
def test_key_value_heads_absent_or_null_are_read_as_transformers_reads_them(model_type, kv, judged, words):
    """vLLM 0.33 builds the k/v projections from the num_key_value_heads transformers 5.20's class holds: a Llama whose
    config.json says null (or nothing) has num_attention_heads of them (a new-user trial: a Llama with null passed verify
    while vLLM built 4 heads where 2 are stored), a Qwen2 without the key 32. Stored rows of 2 heads are judged so."""
    cfg = {"model_type": model_type, "num_attention_heads": 4, "head_dim": 64}
    if kv != "absent":
        cfg["num_key_value_heads"] = kv
    tensors = {"model.embed_tokens.weight": None, "model.layers.0.self_attn.k_proj.weight": None}
    k = Module(
        "model.layers.0.self_attn.k_proj", {"weight": TensorInfo("model.layers.0.self_attn.k_proj.weight", Path("m.safetensors"), "BF16", (128, 256), 0, 0)}
    )
    found = attention_shape_problems({k.name: k}, cfg, tensors)
    if judged in (None, 2):
        assert found == []
    else:
        (p,) = found
        assert p.message == f"config.json's {words} x head_dim 64 = {judged * 64} output rows, but k_proj has 128"
