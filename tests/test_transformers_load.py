"""transformers (with compressed-tensors) loads every output unchanged, close to the dense model."""

from __future__ import annotations

import warnings

import pytest
import torch

from ctconvert import api

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")

SCHEMES = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"]
# cosine(dense, quantized) lower bounds; 4-bit formats lose more on these tiny random models
MIN_COS = {
    "FP8_DYNAMIC": 0.98,
    "FP8_BLOCK": 0.98,
    "W8A8": 0.97,
    "W8A16": 0.995,
    "W4A16": 0.85,
    "W4A16_ASYM": 0.85,
    "NVFP4A16": 0.92,
    "MXFP4A16": 0.90,
    "MXFP4": 0.90,
    "MXFP8A16": 0.98,
    "MXFP8": 0.98,
}


def _load(cls, path, scheme):
    kw = {"dtype": torch.bfloat16}
    if scheme == "W4A16_ASYM":
        # transformers 5.24 + compressed-tensors 0.20.1 cannot build packed zero points
        # in compressed mode (docs/compressed-tensors-format.md §8.2, a reader bug); the
        # decompress-on-load path reads the same files.
        kw["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    return cls.from_pretrained(str(path), **kw).eval()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.fixture(scope="module")
def llama_dense(tmp_path_factory):
    cfg = dict(LLAMA_CONFIG)
    # a model with a real signal: weights from transformers' own init are too uniform to tell apart
    path = write_checkpoint(tmp_path_factory.mktemp("dense") / "m", llama_tensors(cfg, seed=3), cfg, shards=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    return path, ids, logits


@pytest.mark.parametrize("scheme", SCHEMES)
def test_llama_loads_and_matches_dense(llama_dense, tmp_path, scheme):
    path, ids, ref = llama_dense
    out = tmp_path / "q"
    api.quantize(path, out, scheme)
    model = _load(transformers.AutoModelForCausalLM, out, scheme)
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert _cos(ref, logits) >= MIN_COS[scheme]
    assert _cos(ref, logits) < 1.0  # it really is quantized


@pytest.mark.parametrize("head", ["nvfp4a16", "fp8"])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_quantized_lm_head_loads(tmp_path, head, tied):
    cfg = dict(LLAMA_CONFIG, tie_word_embeddings=tied)
    path = write_checkpoint(tmp_path / "m", llama_tensors(cfg, seed=3), cfg)
    ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    dense = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    out = tmp_path / "q"
    api.quantize(path, out, "W8A16", lm_head=head)
    model = _load(transformers.AutoModelForCausalLM, out, "W8A16")
    assert not model.config.tie_word_embeddings
    params = dict(model.lm_head.named_parameters())
    assert "weight_scale" in params  # the head is a quantized layer, not the embedding
    with torch.no_grad():
        a, b = dense(ids).logits, model(ids).logits
    assert torch.isfinite(b).all() and 0.9 <= _cos(a, b) < 1.0


@pytest.fixture(scope="module")
def minilm_dense(minilm_path):
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path))
    batch = tok(["ctconvert writes compressed-tensors checkpoints", "a second, longer sentence to embed here"], return_tensors="pt", padding=True)
    model = transformers.AutoModel.from_pretrained(str(minilm_path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
    return batch, ref


@pytest.mark.parametrize("scheme", SCHEMES)
def test_minilm_loads_and_matches_dense(minilm_path, minilm_dense, tmp_path, scheme):
    batch, ref = minilm_dense
    out = tmp_path / "q"
    res = api.quantize(minilm_path, out, scheme)
    assert res.quantized_modules == 36  # 6 layers x (query, key, value, attention.output.dense, intermediate.dense, output.dense)
    assert res.ignore == ["pooler.dense"]
    model = _load(transformers.AutoModel, out, scheme)
    with torch.no_grad():
        y = model(**batch).last_hidden_state
    assert torch.isfinite(y).all()
    assert MIN_COS[scheme] - 0.05 <= _cos(ref, y) < 1.0


#: a tiny text model for the transformers-built checkpoints below
_TINY_TEXT = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
    vocab_size=1024,
    max_position_embeddings=256,
)


def _randomized(model):
    """Weights with a real signal (transformers' init is too uniform to tell a quantized model apart)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def llava_dense(tmp_path_factory):
    """A LLaVA checkpoint as transformers 5 saves it (legacy names: ``language_model.*``, ``vision_tower.*``,
    ``multi_modal_projector.*``), and its logits on an image and text prompt."""
    torch.manual_seed(0)
    tc = transformers.LlamaConfig(**_TINY_TEXT)
    vc = transformers.CLIPVisionConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_hidden_layers=2, image_size=32, patch_size=8)
    cfg = transformers.LlavaConfig(text_config=tc, vision_config=vc, image_token_id=1000, projector_hidden_act="gelu")
    model = _randomized(transformers.LlavaForConditionalGeneration(cfg).to(torch.bfloat16))
    path = tmp_path_factory.mktemp("llava") / "m"
    model.save_pretrained(str(path))
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.cat([torch.full((1, 16), 1000), torch.randint(2, 999, (1, 12), generator=g)], dim=1),
        "pixel_values": torch.randn(1, 3, 32, 32, generator=g).to(torch.bfloat16),
    }
    dense = transformers.LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = dense(**inputs).logits
    return path, inputs, logits


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC", "NVFP4A16"])
def test_llava_loads_with_its_towers_dense(llava_dense, tmp_path, scheme):
    """The stored names are not the modules transformers builds (it renames them on load): ``ignore`` must
    match both, or transformers quantizes the vision tower and the head and the logits are garbage."""
    path, inputs, ref = llava_dense
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert any(k.startswith("vision_tower.") for k in f.keys()) and "language_model.lm_head.weight" in f.keys()  # legacy names
    res = api.quantize(path, tmp_path / "q", scheme)
    assert r"re:(.*\.)?vision_tower\..*" in res.ignore and r"re:(.*\.)?lm_head$" in res.ignore
    assert "language_model.lm_head" in res.ignore and "vision_tower.encoder.layers.0.mlp.fc1" in res.ignore  # vLLM's names
    model = _load(transformers.LlavaForConditionalGeneration, tmp_path / "q", scheme)
    for name, mod in model.named_modules():  # what transformers built: every tower module and the head stay dense
        if "vision_tower" in name or "multi_modal_projector" in name or name == "lm_head":
            assert not hasattr(mod, "quantization_scheme") or mod.quantization_scheme is None, name
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()
    assert 0.9 <= _cos(ref, logits) < 1.0


@pytest.fixture(scope="module")
def qwen3_moe_dense(tmp_path_factory):
    """A Qwen3-MoE checkpoint with per-expert 2-D experts (as transformers 5 saves it) and its logits."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**_TINY_TEXT, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    model = _randomized(transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16))
    path = tmp_path_factory.mktemp("qwen3moe") / "m"
    model.save_pretrained(str(path))
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    dense = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = dense(ids).logits
    return path, ids, logits


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def test_nvfp4_moe_output_is_right_though_transformers_misreads_it(qwen3_moe_dense, tmp_path):
    """README "Known reader limitations": transformers 5.24 fuses per-expert weights into 3-D experts on load and
    gets NVFP4 experts wrong. The files are right: verify passes, and their dense decompression loads within the
    format's error; W4A16 of the same model loads directly."""
    path, ids, ref = qwen3_moe_dense
    q = tmp_path / "q"
    api.quantize(path, q, "NVFP4A16")
    assert api.verify(q, reference=path)["ok"]
    api.decompress(q, tmp_path / "d")
    dense = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "d"), dtype=torch.bfloat16).eval()
    direct = transformers.AutoModelForCausalLM.from_pretrained(str(q), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        rel_dense, rel_direct = _rel(ref, dense(ids).logits), _rel(ref, direct(ids).logits)
    assert rel_dense < 0.4, rel_dense
    experts = direct.model.layers[0].mlp.experts.gate_up_proj.float()
    expected = dense.model.layers[0].mlp.experts.gate_up_proj.float()
    ratio = (experts.norm() / expected.norm()).item()  # the cause: the fused experts miss the 1 / weight_global_scale
    if rel_direct < 0.4:  # fixed upstream: remove the README limitation
        pytest.xfail(f"transformers now reads NVFP4 MoE experts right (rel {rel_direct:.3f}): update the README")
    assert ratio > 100, ratio
    api.quantize(path, tmp_path / "w4", "W4A16")
    w4 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "w4"), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert _rel(ref, w4(ids).logits) < 0.4


def test_minilm_output_runs_in_sentence_transformers_with_dequantize(minilm_path, tmp_path):
    """README "Known reader limitations": sentence-transformers runs compressed-mode modules without their
    decompression; with ``CompressedTensorsConfig(dequantize=True)`` the same files give the dense model's
    embeddings within the format's error."""
    st = pytest.importorskip("sentence_transformers")
    out = tmp_path / "q"
    api.quantize(minilm_path, out, "W8A16")
    texts = ["a quantized checkpoint", "the weather is nice today"]
    ref = st.SentenceTransformer(str(minilm_path), device="cpu").encode(texts, convert_to_tensor=True)
    kw = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)}
    got = st.SentenceTransformer(str(out), device="cpu", model_kwargs=kw).encode(texts, convert_to_tensor=True)
    assert torch.isfinite(got).all() and _cos(ref, got) > 0.99


def test_llava_quantized_head_keeps_its_stored_name(llava_dense, tmp_path):
    """--lm-head on a LLaVA layout quantizes ``language_model.lm_head`` under that name (verify compares it with
    its own source), and transformers still finds it as ``lm_head``."""
    path, inputs, ref = llava_dense
    out = tmp_path / "q"
    res = api.quantize(path, out, "NVFP4A16", lm_head="fp8")
    assert any(n.startswith("language_model.lm_head.weight") for n, _, _ in res.plan.output_tensors)
    assert not any(n.startswith("lm_head.") for n, _, _ in res.plan.output_tensors)
    assert api.verify(out, reference=path)["ok"]
    model = _load(transformers.LlavaForConditionalGeneration, out, "NVFP4A16")
    assert getattr(model.lm_head, "quantization_scheme", None) is not None  # the head group matched transformers' module
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all() and 0.9 <= _cos(ref, logits) < 1.0
