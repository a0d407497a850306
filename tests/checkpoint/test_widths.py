"""config.json's widths (hidden, vocabulary, MLP and expert sizes) and a tied head against the stored tensors
(ctconvert/checkpoint/widths.py), unit and through verify."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ctconvert import api
from ctconvert.checkpoint.modules import Module, modules_of
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import TensorInfo
from ctconvert.checkpoint.widths import WIDTHS_CHECK, size_problems, tied_head_problems, width_problems

from conftest import LLAMA_CONFIG, llama_tensors, moe_checkpoint, save_shard, write_checkpoint

H, INTER, V = LLAMA_CONFIG["hidden_size"], LLAMA_CONFIG["intermediate_size"], LLAMA_CONFIG["vocab_size"]  # 256, 512, 384
#: the tiny Llama's tensors whose width is hidden_size: the embedding, the final norm, and per layer 2 norms and 7 Linears
HIDDEN_TENSORS = 2 + LLAMA_CONFIG["num_hidden_layers"] * 9


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """The tiny Llama (dense), its W4A16 and NVFP4A16 outputs (packed shapes differ from the dense ones: K/8, K/2) and an
    NVFP4A16 one with its lm_head quantized; and a Qwen3-MoE-named checkpoint and its W4A16 output."""
    tmp = tmp_path_factory.mktemp("widths")
    src = write_checkpoint(tmp / "dense", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    out = {"dense": src}
    for scheme in ("W4A16", "NVFP4A16"):
        api.quantize(src, tmp / scheme, scheme, device="cpu")
        out[scheme] = tmp / scheme
    api.quantize(src, tmp / "head", "NVFP4A16", lm_head="nvfp4a16", device="cpu")
    out["head"] = tmp / "head"
    moe = moe_checkpoint(tmp)
    api.quantize(moe, tmp / "moe-w4a16", "W4A16", device="cpu")
    out.update({"moe": moe, "moe-w4a16": tmp / "moe-w4a16"})
    return out


def _judge(folder: Path, **edits) -> list:
    """width_problems of the checkpoint at ``folder`` with ``edits`` made to its config (in memory)."""
    ckpt = open_checkpoint(folder)
    cfg = copy.deepcopy(ckpt.config)
    cfg.update(edits)
    return width_problems(cfg, ckpt.tensors, modules_of(ckpt), str(folder))


def _one(problems: list, start: str, tensor: str):
    assert len(problems) == 1, [p.message for p in problems]
    (p,) = problems
    assert p.severity == "error" and p.message.startswith(start) and p.tensor == tensor, p.message
    assert p.file.endswith("config.json")
    return p


@pytest.mark.parametrize("kind", ["dense", "W4A16", "NVFP4A16"])
def test_hidden_size(outputs, kind):
    """Every tensor of hidden_size width is judged (quantized Linears by their dense shape, never the packed one: a
    correct output is silent), and an edited hidden_size is one error naming the first tensor and counting the rest."""
    folder = outputs[kind]
    assert _judge(folder) == []
    p = _one(_judge(folder, hidden_size=320), f"config.json's hidden_size is 320, but model.embed_tokens.weight holds {H} columns", "model.embed_tokens.weight")
    assert f"({HIDDEN_TENSORS - 1} other tensors disagree too)" in p.message and "vLLM 0.33" in p.message
    ckpt = open_checkpoint(folder)  # without the embedding and the norms, the Linears alone are judged, and by their inputs
    linear = {n: i for n, i in ckpt.tensors.items() if "norm" not in n and "embed" not in n}
    linear["model.embed_tokens.weight"] = TensorInfo("model.embed_tokens.weight", Path("x"), "BF16", (V, 320), 0, 2)  # the decoder stack is found by it
    (p,) = size_problems(dict(ckpt.config, hidden_size=320), linear, modules_of(ckpt))
    assert p.message.startswith(f"config.json's hidden_size is 320, but model.layers.0.mlp.down_proj has {H} output rows") and "(13 other tensors" in p.message
    no_down = {n: m for n, m in modules_of(ckpt).items() if "down_proj" not in n}
    (p,) = size_problems(dict(ckpt.config, hidden_size=320), linear, no_down)
    assert p.message.startswith(f"config.json's hidden_size is 320, but model.layers.0.mlp.gate_proj takes {H} inputs")


@pytest.mark.parametrize("kind", ["dense", "W4A16", "head"])
def test_vocab_size(outputs, kind):
    """The embedding's rows and a stored lm_head's output rows (a quantized one's dense rows) must be vocab_size."""
    folder = outputs[kind]
    assert _judge(folder) == []
    p = _one(_judge(folder, vocab_size=V + 64), f"config.json's vocab_size is {V + 64}, but lm_head has {V} output rows", "lm_head")
    assert "(1 other tensor disagrees too)" in p.message and "vocab_parallel_embedding.py" in p.message
    assert _judge(folder, vocab_size=V + 64, draft_vocab_size=V + 64)[0].tensor == "model.embed_tokens.weight"  # an EAGLE draft's head: not judged


def test_vocab_rows_of_mllama_and_of_no_decoder_stack():
    """vLLM 0.33 builds Mllama's embedding vocab_size + 8 rows (mllama.py): those pass, vocab_size rows do not; the head
    is vocab_size rows. A checkpoint without ``<P>embed_tokens.weight`` is not judged."""
    names = _infos({"language_model.model.embed_tokens.weight": (V + 8, H), "language_model.lm_head.weight": (V, H)})
    cfg = {"model_type": "mllama", "text_config": {"model_type": "mllama_text_model", "vocab_size": V, "hidden_size": H}}
    assert size_problems(cfg, names, _mods(names)) == []
    names["language_model.model.embed_tokens.weight"] = _info("language_model.model.embed_tokens.weight", (V, H))
    (p,) = size_problems(cfg, names, _mods(names))
    assert p.message.startswith(f"config.json's text_config.vocab_size is {V} (the embedding: {V} + 8 = {V + 8} rows in vLLM 0.33 mllama.py), but")
    assert size_problems({"vocab_size": 7, "hidden_size": 7}, _infos({"transformer.wte.weight": (V, H), "lm_head.weight": (V, H)}), {}) == []


@pytest.mark.parametrize("kind", ["dense", "W4A16"])
def test_intermediate_size(outputs, kind):
    """A dense MLP's gate/up output rows and down inputs are intermediate_size."""
    folder = outputs[kind]
    p = _one(
        _judge(folder, intermediate_size=640),
        f"config.json's intermediate_size is 640, but model.layers.0.mlp.down_proj takes {INTER} inputs",
        "model.layers.0.mlp.down_proj",
    )
    assert "(5 other tensors disagree too)" in p.message
    assert _judge(folder, intermediate_size=640, use_double_wide_mlp=True) == []  # Gemma 4: some layers twice as wide
    assert _judge(folder, intermediate_size=640, block_configs=[{}]) == []  # Nemotron-NAS: each layer its own


@pytest.mark.parametrize("kind", ["moe", "moe-w4a16"])
def test_qwen3_moe_experts(outputs, kind):
    """Routed experts against moe_intermediate_size where the config has it (the Qwen3-MoE fixture: 640, beside an
    unused intermediate_size of 512, which is then not the experts' width)."""
    folder = outputs[kind]
    assert _judge(folder) == [] and _judge(folder, intermediate_size=1000) == []
    p = _one(
        _judge(folder, moe_intermediate_size=512),
        "config.json's moe_intermediate_size is 512, but model.layers.0.mlp.experts.0.down_proj takes 640 inputs",
        "model.layers.0.mlp.experts.0.down_proj",
    )
    assert "(23 other tensors disagree too)" in p.message  # 2 layers x 4 experts x 3 projections
    assert _judge(folder, moe_intermediate_size=None) == []  # present but not an integer: not judged, not read as intermediate_size


def test_mixtral_experts_and_shared_experts():
    """Without moe_intermediate_size the experts are intermediate_size wide (Mixtral's w1/w3 rows, w2 inputs); shared
    experts are shared_expert_intermediate_size (Qwen2-MoE) or moe_intermediate_size x n_shared_experts (DeepSeek)
    wide, and not judged where the config names another shared width."""
    names = _stack(
        "model.",
        {"block_sparse_moe.experts.0.w1.weight": (96, H), "block_sparse_moe.experts.0.w3.weight": (96, H), "block_sparse_moe.experts.0.w2.weight": (H, 96)},
    )
    assert size_problems({"hidden_size": H, "intermediate_size": 96}, names, _mods(names)) == []
    (p,) = size_problems({"hidden_size": H, "intermediate_size": 97}, names, _mods(names))
    assert p.message.startswith("config.json's intermediate_size is 97, but model.layers.0.block_sparse_moe.experts.0.w1 has 96 output rows (2 other tensors")
    shared = _stack(
        "model.", {"mlp.shared_expert.gate_proj.weight": (80, H), "mlp.shared_expert.up_proj.weight": (80, H), "mlp.shared_expert.down_proj.weight": (H, 80)}
    )
    assert size_problems({"shared_expert_intermediate_size": 80, "moe_intermediate_size": 40}, shared, _mods(shared)) == []
    (p,) = size_problems({"shared_expert_intermediate_size": 40}, shared, _mods(shared))
    assert p.message.startswith("config.json's shared_expert_intermediate_size is 40, but model.layers.0.mlp.shared_expert.down_proj takes 80 inputs")
    deepseek = _stack("model.", {"mlp.shared_experts.gate_proj.weight": (80, H), "mlp.shared_experts.down_proj.weight": (H, 80)})
    assert size_problems({"moe_intermediate_size": 40, "n_shared_experts": 2}, deepseek, _mods(deepseek)) == []
    (p,) = size_problems({"moe_intermediate_size": 40, "n_shared_experts": 1}, deepseek, _mods(deepseek))
    assert "moe_intermediate_size x n_shared_experts is 40 x 1 = 40, but model.layers.0.mlp.shared_experts.down_proj takes 80" in p.message
    assert size_problems({"moe_intermediate_size": 40, "n_shared_experts": 1, "shared_experts_intermediate_size": 80}, deepseek, _mods(deepseek)) == []
    assert size_problems({"moe_intermediate_size": 40}, deepseek, _mods(deepseek)) == []  # no rule for its width: not judged


@pytest.mark.parametrize(
    ("model_type", "gate_up", "down"),
    [("gpt_oss", (4, H, 2 * 96), (4, 96, H)), ("qwen3_moe", (4, 2 * 96, H), (4, H, 96)), ("llama4_text", (4, H, 2 * 96), (4, 96, H))],
)
def test_fused_experts_where_the_family_has_one_orientation(model_type, gate_up, down):
    """Fused 3-D experts in the family's one orientation (gpt-oss/Llama-4 [E, H, 2I], [E, I, H]; Qwen-MoE [E, 2I, H],
    [E, H, I]): the hidden axis against hidden_size, the other against the experts' size (twice it for gate_up_proj).
    Qwen3-VL-MoE comes both ways (told apart by hidden_size itself): not judged."""
    names = _stack("model.", {"mlp.experts.gate_up_proj": gate_up, "mlp.experts.down_proj": down, "mlp.experts.gate_up_proj_bias": (4, 192)})
    key = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
    cfg = {"model_type": model_type, "hidden_size": H, key: 96}
    assert size_problems(cfg, names, _mods(names)) == []
    (p,) = size_problems({**cfg, key: 100}, names, _mods(names))
    assert p.tensor == "model.layers.0.mlp.experts.down_proj" and p.message.startswith(
        f"config.json's {key} is 100, but model.layers.0.mlp.experts.down_proj holds"
    )
    assert "an intermediate width of 96 per expert (1 other tensor disagrees too)" in p.message
    (p,) = size_problems({**cfg, key: 192}, {n: i for n, i in names.items() if "down_proj" not in n}, {})
    assert "gate_up_proj holds" in p.message and "a gate and up width of 192 (2 x 96) per expert" in p.message
    (p,) = size_problems({**cfg, "hidden_size": 320}, names, _mods(names))
    assert p.tensor == "model.embed_tokens.weight" and "(3 other tensors disagree too)" in p.message  # the final norm, both fused weights
    wide = {**{n: i for n, i in names.items() if "norm" not in n}, "model.embed_tokens.weight": _info("model.embed_tokens.weight", (V, 320))}
    (p,) = size_problems({**cfg, "hidden_size": 320}, wide, {})
    assert p.message.startswith(
        f"config.json's hidden_size is 320, but model.layers.0.mlp.experts.down_proj holds {list(down)}, a hidden width of 256 per expert (1 other"
    )
    assert size_problems({**cfg, "model_type": "qwen3_vl_moe", key: 100}, names, _mods(names)) == []
    assert size_problems({**cfg, "model_type": "not_a_family", key: 100}, names, _mods(names)) == []


def test_a_vlm_tower_of_other_widths_is_silent():
    """A vision tower with its own layers, norms and MLPs of other widths is not the text model's: silent, while the
    text model (under model.language_model., sizes from text_config) is still judged."""
    text = {"embed_tokens.weight": (V, H), "norm.weight": (H,), "layers.0.input_layernorm.weight": (H,), "layers.0.self_attn.q_proj.weight": (H, H)}
    text.update({"layers.0.mlp.gate_proj.weight": (INTER, H), "layers.0.mlp.down_proj.weight": (H, INTER)})
    shapes = {"model.language_model." + n: s for n, s in text.items()}
    shapes["lm_head.weight"] = (V, H)
    for tower in ("model.visual.blocks.0", "model.vision_tower.encoder.layers.0", "model.language_model.vision.layers.0"):
        shapes.update({f"{tower}.input_layernorm.weight": (96,), f"{tower}.self_attn.q_proj.weight": (96, 96), f"{tower}.mlp.gate_proj.weight": (384, 96)})
    names = _infos(shapes)
    cfg = {"text_config": {"hidden_size": H, "vocab_size": V, "intermediate_size": INTER}, "vision_config": {"hidden_size": 96, "intermediate_size": 384}}
    assert size_problems(cfg, names, _mods(names)) == []
    (p,) = size_problems({**cfg, "text_config": {**cfg["text_config"], "intermediate_size": 640}}, names, _mods(names))
    assert p.message.startswith(f"config.json's text_config.intermediate_size is 640, but model.language_model.layers.0.mlp.down_proj takes {INTER} inputs")
    assert size_problems({"hidden_size": 96, "text_config": {"vocab_size": V}}, names, _mods(names)) == []  # the top level is not read where text_config is


@pytest.mark.parametrize("bad", ["256", 256.0, True, [256, 256], None])
def test_sizes_that_are_not_integers_are_not_judged(outputs, bad):
    ckpt = open_checkpoint(outputs["moe-w4a16"])
    for key in ("hidden_size", "vocab_size", "intermediate_size", "moe_intermediate_size"):
        cfg = dict(ckpt.config, **{key: bad})
        assert [p.message for p in width_problems(cfg, ckpt.tensors, modules_of(ckpt), "x")] == []
    assert width_problems(["not", "a", "dict"], ckpt.tensors, modules_of(ckpt), "x") == []


def test_tied_head(outputs, tmp_path):
    """tie_word_embeddings true with a stored lm_head: a quantized head is an error, a dense one only where its bytes
    are not the embedding's; false or missing, nothing is judged."""
    dense = open_checkpoint(outputs["dense"])
    assert tied_head_problems(dict(dense.config, tie_word_embeddings=False), dense.tensors) == []
    assert tied_head_problems({k: v for k, v in dense.config.items() if k != "tie_word_embeddings"}, dense.tensors) == []
    (p,) = tied_head_problems(dict(dense.config, tie_word_embeddings=True), dense.tensors, "cfg")
    assert p.message.startswith("config.json's tie_word_embeddings is true, but lm_head.weight holds other values than model.embed_tokens.weight")
    assert p.tensor == "lm_head.weight" and p.file == "cfg" and "AutoWeightsLoader" in p.message
    (p,) = tied_head_problems({"text_config": {"tie_word_embeddings": True}}, dense.tensors)  # the text config's, where the top level has none
    same = tmp_path / "same"  # the head stored with the embedding's bytes (a tied checkpoint that stores both): silent
    shutil.copytree(outputs["dense"], same)
    tensors = load_file(same / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_shard(tensors, same / "model.safetensors")
    tied = open_checkpoint(same)
    assert tied_head_problems(dict(tied.config, tie_word_embeddings=True), tied.tensors) == []
    assert _judge(same, tie_word_embeddings=True) == []
    head = open_checkpoint(outputs["head"])  # an NVFP4 lm_head (--lm-head): never used when tied
    (p,) = tied_head_problems(dict(head.config, tie_word_embeddings=True), head.tensors)
    assert p.message.startswith("config.json's tie_word_embeddings is true, but the output stores a quantized lm_head (lm_head.weight_")
    assert tied_head_problems(dict(head.config, tie_word_embeddings=False), head.tensors) == []


def _errors(report: dict) -> list[dict]:
    return [p for p in report["problems"] if p["severity"] == "error"]


@pytest.mark.parametrize(
    ("edit", "value", "message"),
    [
        ("hidden_size", 2 * H, f"config.json's hidden_size is {2 * H}, but model.embed_tokens.weight holds {H} columns"),
        ("intermediate_size", 2 * INTER, f"config.json's intermediate_size is {2 * INTER}, but model.layers.0.mlp.down_proj takes {INTER} inputs"),
        ("vocab_size", 2 * V, f"config.json's vocab_size is {2 * V}, but lm_head has {V} output rows"),
        ("tie_word_embeddings", True, "config.json's tie_word_embeddings is true, but lm_head.weight holds other values than model.embed_tokens.weight"),
    ],
)
def test_verify_fails_a_config_whose_widths_the_tensors_contradict(outputs, tmp_path, edit, value, message):
    """The trial's edits to a quantize output's config.json fail ``ctconvert verify OUT`` (exit 5), naming config.json
    and the key; the unedited output passes and lists the check."""
    from ctconvert.cli import main

    out = tmp_path / "out"
    shutil.copytree(outputs["W4A16"], out)
    report = api.verify(out)
    assert report["ok"] and WIDTHS_CHECK in report["checked"]["checks"], _errors(report)
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg[edit] = value
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    errors = _errors(api.verify(out))
    assert any(p["message"].startswith(message) and p["file"].endswith("config.json") for p in errors), errors
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 5
    seen = [p for p in api.inspect(out)["problems"] if p["message"].startswith(message)]  # inspect: the same, a warning (exit 0)
    want = [dict(p, severity="warning", message=p["message"] + " (`ctconvert verify` fails it)") for p in errors if p["message"].startswith(message)]
    assert seen == want and CliRunner().invoke(main, ["inspect", str(out)]).exit_code == 0


def test_verify_fails_an_edited_moe_size_and_a_head_tied_again(outputs, tmp_path):
    """moe_intermediate_size edited in a MoE output fails verify; so does a quantized head tied again, with and
    without --reference (one error: one implementation for both)."""
    out = tmp_path / "moe"
    shutil.copytree(outputs["moe-w4a16"], out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, moe_intermediate_size=320)))
    assert any(
        p["message"].startswith("config.json's moe_intermediate_size is 320, but model.layers.0.mlp.experts.0.down_proj") for p in _errors(api.verify(out))
    )
    head = tmp_path / "head"
    shutil.copytree(outputs["head"], head)
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    for ref in (None, outputs["dense"]):
        tied = [p for p in _errors(api.verify(head, ref)) if "quantized lm_head" in p["message"]]
        assert len(tied) == 1 and tied[0]["file"].endswith("config.json"), tied


def test_kernel_native_output_is_judged_on_its_dense_tensors(outputs, tmp_path):
    """A kernel-native output's modules are in a kernel's layout (no dense shape read here): it passes, and an edited
    hidden_size is still caught by the embedding and the norms."""
    api.repack(outputs["W4A16"], tmp_path / "marlin", "marlin", device="cpu")
    assert api.verify(tmp_path / "marlin")["ok"]
    cfg = json.loads((tmp_path / "marlin" / "config.json").read_text())
    (tmp_path / "marlin" / "config.json").write_text(json.dumps(dict(cfg, hidden_size=2 * H)))
    (p,) = [p for p in _errors(api.verify(tmp_path / "marlin")) if "hidden_size" in p["message"]]
    assert p["message"].startswith(f"config.json's hidden_size is {2 * H}, but model.embed_tokens.weight holds {H} columns (5 other tensors")


# -- helpers --------------------------------------------------------------------------------------


def _info(name: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name, Path("model.safetensors"), "BF16", shape, 0, 2 * max(1, len(shape)))


def _infos(shapes: dict[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
    return {n: _info(n, s) for n, s in shapes.items()}


def _stack(prefix: str, layer0: dict[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
    """A one-layer decoder: the embedding, the final norm and ``layer0``'s tensors."""
    shapes = {f"{prefix}embed_tokens.weight": (V, H), f"{prefix}norm.weight": (H,)}
    shapes.update({f"{prefix}layers.0.{n}": s for n, s in layer0.items()})
    return _infos(shapes)


def _mods(tensors: dict[str, TensorInfo]) -> dict[str, Module]:
    """The dense modules of ``tensors`` (as :func:`.modules.modules_of` groups them, no quantization config)."""
    out: dict[str, Module] = {}
    for name, info in tensors.items():
        mod, _, part = name.rpartition(".")
        out.setdefault(mod, Module(mod)).parts[part] = info
    return out


def test_helpers_build_what_the_checkpoint_reader_does(tmp_path):
    """The synthetic modules above group like those of a real checkpoint (their dense shapes)."""
    src = write_checkpoint(tmp_path / "s", {"model.embed_tokens.weight": torch.zeros(4, 2), "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 3)}, {})
    real = modules_of(open_checkpoint(src))
    fake = _mods(_infos({"model.embed_tokens.weight": (4, 2), "model.layers.0.mlp.down_proj.weight": (2, 3)}))
    assert {n: {p: tuple(i.shape) for p, i in m.parts.items()} for n, m in real.items()} == {
        n: {p: tuple(i.shape) for p, i in m.parts.items()} for n, m in fake.items()
    }


def test_an_untied_head_that_no_tensor_fills(outputs):
    """tie_word_embeddings false while a generating model stores no lm_head (a trial untied a tied Llama and Gemma-3:
    vLLM refused them, verify passed without a reference): an error naming config.json; nothing for a model that stores
    its head, for a missing key, or for an encoder (no ...ForCausalLM / ...ForConditionalGeneration)."""
    dense = open_checkpoint(outputs["dense"])
    headless = {n: i for n, i in dense.tensors.items() if not n.startswith("lm_head.")}
    cfg = dict(dense.config, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    (p,) = tied_head_problems(cfg, headless, "cfg")
    assert p.message.startswith("config.json's tie_word_embeddings is false, but the checkpoint stores no lm_head") and p.file == "cfg"
    assert tied_head_problems(dict(cfg, architectures=["Gemma3ForConditionalGeneration"]), headless) != []
    assert tied_head_problems(cfg, dense.tensors) == []  # the head is stored
    assert tied_head_problems({k: v for k, v in cfg.items() if k != "tie_word_embeddings"}, headless) == []
    assert tied_head_problems(dict(cfg, tie_word_embeddings=True), headless) == []  # tied: the embedding serves
    assert tied_head_problems(dict(cfg, architectures=["BertModel"]), headless) == []


@pytest.mark.parametrize("edit", ["format", "weight_shape"])
def test_a_module_that_contradicts_its_config_is_not_judged_on_widths(outputs, tmp_path, edit):
    """The trial's format edit (marlin-24) and weight_shape edit (values swapped) gave width errors first (config.json's
    hidden_size ...), before the cause: such modules have no dense shape to judge a width by. Now the first error is the
    module's own against its config group, and no width or attention-row error follows from it."""
    import torch

    from conftest import save_config

    out = tmp_path / "out"
    shutil.copytree(outputs["W4A16"], out)
    if edit == "format":
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24"
        save_config(out, cfg)
        first = "format marlin-24 (config group 'group_0') needs meta, scale_packed"
    else:
        ts = load_file(out / "model.safetensors")
        ts["model.layers.0.self_attn.q_proj.weight_shape"] = torch.tensor([2 * H, H // 2], dtype=torch.int64)
        save_shard(ts, out / "model.safetensors")
        first = f"weight_packed is I32[{H}, {H // 8}], but pack-quantized (int4 group 128, config group 'group_0') of a [{2 * H}, {H // 2}] weight"
    errors = _errors(api.verify(out))
    assert errors and errors[0]["message"].startswith(first), errors[0]
    assert not [p for p in errors if "hidden_size" in p["message"] or "output rows, but" in p["message"]], errors
