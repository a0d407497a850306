"""Every tensor a decoder layer's forward reads comes from the checkpoint or from the config as transformers computes
it: the tokens calibration routes to each expert are those transformers' own forward routes (DeepSeek-V3's stored
``e_score_correction_bias`` included), and the layer-by-layer model holds exactly from_pretrained's tensors."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from ctconvert.calibration.model import CalibrationModel, calibrate
from ctconvert.checkpoint.families import split_fused_experts
from ctconvert.checkpoint.reader import open_checkpoint

from helpers import bitwise_equal, randomized

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")

#: family -> (expert parent per layer, gate leaf, its MoE layers, attention implementation transformers runs)
ROUTED = {
    "qwen3_moe": ("model.layers.{}.mlp.experts", "gate_proj", (0, 1), "sdpa"),
    "mixtral": ("model.layers.{}.block_sparse_moe.experts", "w1", (0, 1), "sdpa"),
    "deepseek_v3": ("model.layers.{}.mlp.experts", "gate_proj", (1,), "sdpa"),
    "gpt_oss": ("model.layers.{}.mlp.experts", "gate_proj", (0, 1), "eager"),
    "gemma4": ("model.layers.{}.experts", "gate_proj", (0, 1), "sdpa"),
}


def _saved(path, family: str):
    import test_moe_families as fam

    torch.manual_seed(0)
    model = randomized(fam.FAMILIES[family][0]().to(torch.bfloat16))
    if family == "deepseek_v3":  # a stored, non-zero correction bias that changes the routing (transformers' init is zeros)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                b = layer.mlp.gate.e_score_correction_bias
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    model.save_pretrained(str(path))
    return path


def _checkpoint(path):
    """The checkpoint as calibration sees it: with the plan's per-expert views of fused 3-D experts."""
    ckpt = open_checkpoint(path)
    parts = {p.name: p for fe in split_fused_experts(ckpt.tensors, ckpt.config).values() for p in fe.parts}
    return dataclasses.replace(ckpt, tensors={**ckpt.tensors, **parts})


def _reference(path, impl: str):
    """transformers' own model, loaded whole, with the experts' reference loop (``experts_implementation="eager"``,
    the loop calibration runs per expert; transformers 5.24's default ``grouped_mm`` sums the top-k outputs in fp32,
    the loop in the model dtype)."""
    kw = dict(dtype=torch.bfloat16, attn_implementation=impl, experts_implementation="eager")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


@pytest.mark.parametrize("family", list(ROUTED))
def test_tokens_routed_to_each_expert_equal_transformers_forward(tmp_path, family):
    parent, gate, layers, impl = ROUTED[family]
    src = _saved(tmp_path / "m", family)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    stats = calibrate(_checkpoint(src), ids, torch.device("cpu"), batch_tokens=ids.numel())

    ref = _reference(src, impl)
    routed = {}  # layer -> the expert indices transformers' router chose ([tokens, top_k]), as its experts receive them
    for i in layers:
        experts = ref.get_submodule(parent.format(i).replace("block_sparse_moe", "mlp"))  # transformers 5 names Mixtral's MoE mlp
        experts.register_forward_pre_hook(lambda mod, args, i=i: routed.__setitem__(i, args[1]))
    with torch.no_grad():
        ref(input_ids=ids, use_cache=False)
    assert set(routed) == set(layers)
    for i in layers:
        n = 4  # the builders' experts per layer
        want = [int((routed[i] == e).any(-1).sum()) for e in range(n)]
        got = [stats.inputs[f"{parent.format(i)}.{e}.{gate}"].tokens if f"{parent.format(i)}.{e}.{gate}" in stats.inputs else 0 for e in range(n)]
        assert got == want, (family, i, got, want)
        assert sum(want) == ids.numel() * routed[i].shape[-1]


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4"])
def test_layer_by_layer_model_holds_from_pretrained_tensors(tmp_path, family):
    """Every parameter and buffer (persistent and not) of every decoder layer and of the modules around them, as
    calibration loads them, equals transformers' ``from_pretrained`` model's, bit for bit."""
    src = _saved(tmp_path / "m", family)
    ref = dict(_reference(src, "sdpa").named_buffers())
    cm = CalibrationModel(_checkpoint(src), torch.device("cpu"))
    cm.load_outside()
    got = {n: b for n, b in cm.model.named_buffers() if b.device.type != "meta"}
    for i, layer in enumerate(cm.layers):
        cm._materialize(layer, f"{cm.layers_name}.{i}.")
        got.update({f"{cm.layers_name}.{i}.{n}": b for n, b in layer.named_buffers()})
    assert got.keys() == ref.keys()
    assert any(n.endswith("e_score_correction_bias") or n.endswith("layer_scalar") for n in got)
    for n in ref:
        assert bitwise_equal(got[n], ref[n]), n


def test_a_buffer_missing_from_the_checkpoint_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from ctconvert.errors import BadInputError

    src = _saved(tmp_path / "m", "deepseek_v3")
    f = src / "model.safetensors"
    t = load_file(str(f))
    del t["model.layers.1.mlp.gate.e_score_correction_bias"]
    save_file(t, str(f), metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    with pytest.raises(BadInputError, match=r"no tensor for buffer 'model\.layers\.1\.mlp\.gate\.e_score_correction_bias'"):
        calibrate(_checkpoint(src), ids, torch.device("cpu"))


def test_a_buffer_transformers_does_not_compute_is_named(tmp_path, monkeypatch):
    """A non-persistent buffer (not in the checkpoint) that the model's own ``_init_weights`` leaves unwritten is an
    error naming it, never the uninitialised memory ``to_empty`` allocated."""
    from ctconvert.errors import UnsupportedError

    src = _saved(tmp_path / "m", "qwen3_moe")
    monkeypatch.setattr(transformers.Qwen3MoePreTrainedModel, "_init_weights", lambda self, module: None)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    with pytest.raises(UnsupportedError, match=r"the buffer 'model\.rotary_emb\.inv_freq' \(Qwen3MoeRotaryEmbedding\) is not in the checkpoint"):
        calibrate(_checkpoint(src), ids, torch.device("cpu"))


def test_llama4_tokens_routed_to_each_expert_equal_transformers_forward(tmp_path):
    """Llama-4 (every token handed to every expert, scaled by its router score): the tokens each expert is calibrated
    on are those transformers' router routes to it (its top-k), layer by layer."""
    import test_moe_families as fam

    torch.manual_seed(0)
    randomized(fam._llama4().to(torch.bfloat16)).save_pretrained(str(tmp_path / "m"))
    ids = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(3))
    stats = calibrate(_checkpoint(tmp_path / "m"), ids, torch.device("cpu"), batch_tokens=ids.numel())
    ref = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16).eval()
    chosen = {}
    for i, layer in enumerate(ref.get_decoder().model.layers):
        router = layer.feed_forward.router
        router.register_forward_hook(lambda mod, a, out, i=i: chosen.__setitem__(i, torch.topk(out[1], mod.top_k, dim=1)[1]))
    with torch.no_grad():
        ref.get_decoder()(input_ids=ids, use_cache=False)  # its text model: the VLM's forward without an image fails at its end
    for i in (0, 1):
        p = f"language_model.model.layers.{i}.feed_forward.experts"
        want = [int((chosen[i] == e).any(-1).sum()) for e in range(4)]
        got = [stats.inputs[f"{p}.{e}.gate_proj"].tokens if f"{p}.{e}.gate_proj" in stats.inputs else 0 for e in range(4)]
        assert got == want and sum(want) == ids.numel(), (i, got, want)
