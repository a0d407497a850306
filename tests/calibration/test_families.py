"""Calibrated NVFP4 on the families whose language model needs more than embed -> layers: Gemma-4's text MoE
(per-layer-input embeddings, fused 3-D experts) and the vision-language models (Qwen2.5-VL, LLaVA: the language
model calibrated on text, the towers and projector dense). The dry run and the real run agree, and every
``input_global_scale`` is compressed-tensors' ``generate_gparam`` of the absmax that transformers' own model,
loaded whole, feeds that Linear on the same tokens."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from calibration.test_routing import _saved
from ctconvert.cli import main

from helpers import randomized

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")


def _absmax_of_transformers(model, ids: torch.Tensor, rename=lambda n: n) -> dict[str, torch.Tensor]:
    """Checkpoint module name -> absmax of its input in ``model``'s forward (bf16, as the observers see it): every
    nn.Linear through a forward-pre hook; fused 3-D experts per expert, from the tokens routed to it and the fused
    weights (``F.linear(x, gate_up_proj[e])``, transformers' experts loop)."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name, x):
        a = x.abs().max()
        seen[name] = a if name not in seen else torch.maximum(seen[name], a)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, a, name=name: keep(rename(name), a[0]))
        elif isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter):

            def experts(mod, args, name=name):
                h, idx = args[0], args[1]
                for e in range(mod.num_experts):
                    x = h[(idx == e).any(-1)]
                    if x.shape[0] == 0:
                        continue
                    gate, up = torch.nn.functional.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
                    p = f"{rename(name)}.{e}."
                    keep(p + "gate_proj", x)
                    keep(p + "up_proj", x)
                    keep(p + "down_proj", mod.act_fn(gate) * up)

            m.register_forward_pre_hook(experts)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    return seen


def _calibrated(src, tmp_path, ids: torch.Tensor, extra=()):
    """The dry run's and the real run's JSON documents of ``quantize -s NVFP4`` on ``ids``, and the written tensors."""
    from safetensors.torch import load_file

    f = tmp_path / "ids.json"
    f.write_text(json.dumps(ids.tolist()))
    args = ["--json", "quantize", str(src), "-s", "NVFP4", "-o", str(tmp_path / "q"), "--calibration", str(f)]
    args += ["--calibration-samples", str(ids.shape[0]), "--calibration-seq-len", str(ids.shape[1]), *extra]
    docs = []
    for dry in (["--dry-run"], []):
        r = CliRunner().invoke(main, [*args, *dry])
        assert r.exit_code == 0, r.output
        docs.append(json.loads(r.stdout))
    tensors = {}
    for p in sorted((tmp_path / "q").glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    return docs, tensors


def _assert_scales_equal(tensors: dict, want: dict[str, torch.Tensor]) -> int:
    from compressed_tensors.quantization.utils import generate_gparam

    scaled = sorted(n.removesuffix(".input_global_scale") for n in tensors if n.endswith(".input_global_scale"))
    assert scaled
    for m in scaled:
        a = want[m].reshape(1)  # in the model dtype, as the observers hand it to generate_gparam
        assert torch.equal(tensors[m + ".input_global_scale"], generate_gparam(-a, a)), m
    return len(scaled)


def test_gemma4_text_moe_nvfp4_calibrates_as_transformers_runs_it(tmp_path):
    """Gemma-4's per-layer-input embeddings (``embed_tokens_per_layer``, ``per_layer_model_projection``) and their
    ``embed_scale`` buffers run as transformers runs them (they stayed on ``meta``: "forward failed in the embedding")."""
    src = _saved(tmp_path / "m", "gemma4")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    (dry, real), tensors = _calibrated(src, tmp_path, ids)
    assert dry["ok"] and dry["calibration"]["layers"] == 2 and real["ok"]
    assert any(n.startswith("calibration (NVFP4): 2 decoder layers") for n in dry["notes"])
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16, experts_implementation="eager").eval()
    n = _assert_scales_equal(tensors, _absmax_of_transformers(ref, ids))
    assert n == 2 * (7 + 2 + 4 * 3)  # per layer: q/k/v/o, gate/up/down, the per-layer-input gate and projection, 4 experts x 3
    v = CliRunner().invoke(main, ["verify", str(tmp_path / "q"), "--reference", str(src)])
    assert v.exit_code == 0, v.output


def _llava(path):
    """A tiny LLaVA saved under the names the Hub ships (``vision_tower.vision_model.…``, ``language_model.model.…``;
    transformers 5.24 itself saves the tower as ``vision_tower.…``)."""
    import test_moe_families as fam
    from safetensors.torch import load_file, save_file

    vc = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=16)
    cfg = transformers.LlavaConfig(text_config=dict(fam.TEXT, model_type="llama"), vision_config=vc, image_token_index=255)
    torch.manual_seed(0)
    randomized(transformers.LlavaForConditionalGeneration(cfg).to(torch.bfloat16)).save_pretrained(str(path))
    f = path / "model.safetensors"
    t = {(("vision_tower.vision_model." + n[len("vision_tower.") :]) if n.startswith("vision_tower.") else n): v for n, v in load_file(str(f)).items()}
    assert any(n.startswith("language_model.model.layers.") for n in t)
    save_file(t, str(f), metadata={"format": "pt"})
    return path


def _qwen2_5_vl(path):
    import test_moe_families as fam

    torch.manual_seed(0)
    randomized(fam._qwen2_5_vl().to(torch.bfloat16)).save_pretrained(str(path))
    return path


#: VLM -> (builder, checkpoint name of a transformers 5.24 module name of its language model, a tower module the plan keeps dense)
VLMS = {
    "qwen2_5_vl": (_qwen2_5_vl, lambda n: n.replace("model.language_model.", "model."), "visual.blocks.0.mlp.up_proj"),
    "llava": (_llava, lambda n: n.replace("model.language_model.", "language_model.model."), "vision_tower.vision_model.encoder.layers.0.mlp.fc1"),
}


@pytest.mark.parametrize("family", list(VLMS))
def test_vlm_nvfp4_calibrates_its_language_model_on_text(tmp_path, family):
    """The language model is calibrated on text (llm-compressor calibrates VLMs so), through transformers' own text
    forward of the whole VLM (no image: its tower and projector do not run, and stay dense); the dry run says what
    the real run does; the output verifies and loads in transformers."""
    build, rename, tower = VLMS[family]
    src = build(tmp_path / "m")
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(4))
    (dry, real), tensors = _calibrated(src, tmp_path, ids)
    assert dry["ok"] and dry["calibration"]["layers"] == 2 and real["ok"], (dry, real)
    assert any(n.startswith("calibration (NVFP4): 2 decoder layers") for n in dry["notes"])
    assert tower in real["ignore"] and tower + ".weight" in tensors and not any(n.startswith(tower + ".") and n.endswith("_scale") for n in tensors)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    want = {n: a for n, a in _absmax_of_transformers(ref, ids, rename).items() if "lm_head" not in n}
    assert _assert_scales_equal(tensors, want) == 2 * 7  # q/k/v/o and gate/up/down of both layers
    v = CliRunner().invoke(main, ["verify", str(tmp_path / "q"), "--reference", str(src)])
    assert v.exit_code == 0, v.output
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "q"), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert torch.isfinite(b).all() and 0.85 <= torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0) < 1.0


def _llama4_absmax(model, ids: torch.Tensor, rename) -> dict[str, torch.Tensor]:
    """transformers' Llama-4 (loaded whole, text only): the absmax of every Linear's input, and per expert of the
    input ``Llama4TextMoe`` hands it for the tokens its router routes there (``routed_in``: each token scaled by its
    sigmoid score) and of the activation ``Llama4TextExperts`` computes from it with the fused weights."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name, x):
        if x.numel():
            a = x.abs().max()
            seen[name] = a if name not in seen else torch.maximum(seen[name], a)

    chosen = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "Llama4Router":
            m.register_forward_hook(lambda mod, a, out, name=name: chosen.__setitem__(name.rpartition(".")[0], torch.topk(out[1], mod.top_k, dim=1)[1]))
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, a, name=name: keep(rename(name), a[0]))
        elif type(m).__name__ == "Llama4TextExperts":

            def experts(mod, args, name=name):
                per = args[0].view(mod.num_experts, -1, mod.hidden_size)
                idx = chosen[name.rpartition(".")[0]]
                for e in range(mod.num_experts):
                    x = per[e][(idx == e).any(-1)]
                    gate, up = (x @ mod.gate_up_proj[e]).chunk(2, dim=-1)
                    p = f"{rename(name)}.{e}."
                    keep(p + "gate_proj", x)
                    keep(p + "up_proj", x)
                    keep(p + "down_proj", up * mod.act_fn(gate))

            m.register_forward_pre_hook(experts)
    with torch.no_grad():  # its text model (Llama4ForCausalLM): transformers 5.24's VLM forward without an image fails at its end
        model.get_decoder()(input_ids=ids, use_cache=False)
    return seen


def test_llama4_nvfp4_calibrates_the_routed_tokens_scaled_by_their_score(tmp_path):
    """Llama-4's experts take every token once per expert, scaled by its router score (0 where not routed): each
    expert is calibrated on the tokens routed to it, scaled as transformers scales them (the input vLLM quantizes),
    and every ``input_global_scale`` equals transformers' own forward's (the VLM's, on text); the tower stays dense."""
    import test_moe_families as fam

    torch.manual_seed(0)
    randomized(fam._llama4().to(torch.bfloat16)).save_pretrained(str(tmp_path / "m"))
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(4))
    (dry, real), tensors = _calibrated(tmp_path / "m", tmp_path, ids)
    assert dry["ok"] and dry["calibration"]["layers"] == 2 and real["ok"], (dry, real)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16).eval()
    want = {n: a for n, a in _llama4_absmax(ref, ids, lambda n: n).items() if "lm_head" not in n}  # transformers 5.24's names are the stored ones
    assert _assert_scales_equal(tensors, want) == 2 * (7 + 4 * 3)  # per layer: q/k/v/o, the shared expert's gate/up/down, 4 experts x 3
    assert "multi_modal_projector.linear_1" in real["ignore"] and not any(n.startswith("vision_model.") and n.endswith("_scale") for n in tensors)
    v = CliRunner().invoke(main, ["verify", str(tmp_path / "q"), "--reference", str(tmp_path / "m")])
    assert v.exit_code == 0, v.output
