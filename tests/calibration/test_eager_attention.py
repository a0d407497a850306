"""Calibration of an architecture transformers has no SDPA attention for (gpt-oss: attention sinks) runs its eager
attention, says so, and every expert of its fused 3-D experts gets the input scale of the tokens routed to it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from ctconvert.cli import main

from helpers import randomized

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")


def _gpt_oss_checkpoint(path):
    from test_moe_families import _gpt_oss  # the tiny gpt-oss of the family tests (2 layers, 4 experts)

    torch.manual_seed(0)
    randomized(_gpt_oss().to(torch.bfloat16)).save_pretrained(str(path))
    return path


def _reference_expert_absmax(path, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' own gpt-oss, loaded whole with its eager attention and masks: per expert, the absmax of the
    tokens routed to it (gate/up input) and of its clamped SwiGLU output (down input), from the fused weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="eager").eval()
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts.register_forward_pre_hook(lambda mod, args, i=i: seen.setdefault(i, args))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    out = {}
    with torch.no_grad():
        for i, (h, idx, _) in seen.items():
            ex = model.model.layers[i].mlp.experts
            for e in range(ex.num_experts):
                x = h[(idx == e).any(-1)]
                assert x.shape[0] > 0, f"no token routed to expert {e} of layer {i}"
                act = ex._apply_gate(x @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e])
                p = f"model.layers.{i}.mlp.experts.{e}."
                out[p + "gate_proj"] = out[p + "up_proj"] = x.abs().max()  # bf16, as the observers see it
                out[p + "down_proj"] = act.abs().max()
    return out


def test_gpt_oss_layer_by_layer_equals_whole_model(tmp_path):
    """The eager path observes the same activations (Linear inputs, post-RoPE keys and values) layer by layer as
    with every layer loaded, and says which attention it ran."""
    import dataclasses

    from ctconvert.calibration.model import calibrate, calibrate_whole_model
    from ctconvert.checkpoint.families import split_fused_experts
    from ctconvert.checkpoint.reader import open_checkpoint

    ckpt = open_checkpoint(_gpt_oss_checkpoint(tmp_path / "m"))
    parts = {p.name: p for fe in split_fused_experts(ckpt.tensors, ckpt.config).values() for p in fe.parts}  # the plan's per-expert views
    ckpt = dataclasses.replace(ckpt, tensors={**ckpt.tensors, **parts})
    ids = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(2))
    s = calibrate(ckpt, ids, torch.device("cpu"), kv_cache=True, batch_tokens=48)
    w = calibrate_whole_model(ckpt, ids, torch.device("cpu"), kv_cache=True, batch_tokens=48)
    for a, b in ((s.inputs, w.inputs), (s.keys, w.keys), (s.values, w.values)):
        assert a.keys() == b.keys() and a
        for k in a:
            assert torch.equal(a[k].min, b[k].min) and torch.equal(a[k].max, b[k].max), k
    assert {f"model.layers.{i}.mlp.experts.{e}.{leaf}" for i in (0, 1) for e in range(4) for leaf in ("gate_proj", "up_proj", "down_proj")} <= set(s.inputs)
    assert len(s.keys) == 2 and any("calibrated with its eager attention" in n for n in s.notes)


def test_gpt_oss_calibrates_with_eager_attention(tmp_path):
    from compressed_tensors.quantization.utils import generate_gparam
    from safetensors.torch import load_file

    src = _gpt_oss_checkpoint(tmp_path / "m")
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    (tmp_path / "ids.json").write_text(json.dumps(ids.tolist()))
    args = ["--json", "quantize", str(src), "-s", "NVFP4", "-o", str(tmp_path / "q"), "--kv-cache", "fp8"]
    args += ["--allow-unloadable", "--targets", "Linear", "--targets", r"re:.*mlp\.experts\.\d+\..*"]  # gpt-oss experts stay dense unless named
    r = CliRunner().invoke(main, [*args, "--calibration", str(tmp_path / "ids.json"), "--calibration-samples", "4", "--calibration-seq-len", "64"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True
    assert 'has no SDPA attention for GptOssForCausalLM; calibrated with its eager attention (attn_implementation="eager"' in " ".join(doc["notes"])
    got = load_file(str(tmp_path / "q" / "model.safetensors"))
    want = _reference_expert_absmax(src, ids)
    assert len(want) == 2 * 4 * 3  # 2 layers x 4 experts x gate/up/down
    for module, amax in want.items():
        scale = got[module + ".input_global_scale"]
        ref = generate_gparam(-amax.reshape(1), amax.reshape(1))
        assert scale.dtype == torch.float32 and scale.shape == (1,)
        if module.startswith("model.layers.0.") and module.endswith(("gate_proj", "up_proj")):  # after the eager attention: the same bits
            assert torch.equal(scale, ref), module
        else:  # per-expert Linear vs the fused [H, 2I] matmul: the bf16 rounding may differ by an ulp (0.8%), and carries on
            torch.testing.assert_close(scale, ref, rtol=2e-2, atol=0, msg=module)
    for i in range(2):  # the KV cache scales of both attention kinds (sliding and full)
        assert got[f"model.layers.{i}.self_attn.k_scale"].shape == (1,) and float(got[f"model.layers.{i}.self_attn.v_scale"]) > 0


def test_dry_run_says_calibration_will_run_eager_attention(tmp_path):
    src = _gpt_oss_checkpoint(tmp_path / "m")
    (tmp_path / "ids.json").write_text(json.dumps(list(range(250)) * 10))
    r = CliRunner().invoke(main, ["--json", "quantize", str(src), "-s", "NVFP4", "--dry-run", "--calibration", str(tmp_path / "ids.json")])
    doc = json.loads(r.stdout)
    note = 'calibration will run GptOssForCausalLM\'s eager attention (attn_implementation="eager"): transformers has no SDPA attention for it'
    assert r.exit_code == 0 and doc["ok"] is True and note in doc["notes"]
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}  # an architecture with SDPA: no such note
    assert not any("eager attention" in n for n in _dry_run_notes(tmp_path, llama))


def _dry_run_notes(tmp_path, arch: dict) -> list[str]:
    from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

    m = write_checkpoint(tmp_path / "llama", llama_tensors(LLAMA_CONFIG), {**LLAMA_CONFIG, **arch})
    r = CliRunner().invoke(main, ["--json", "quantize", str(m), "-s", "NVFP4", "--dry-run", "--calibration", str(tmp_path / "ids.json")])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["notes"]


def test_sliding_window_attention_is_masked_as_transformers_masks_it(tmp_path):
    """SDPA calibration gets transformers' masks: a sliding window shorter than the calibration rows is applied
    (with no mask registered for the observer, SDPA ran plain is_causal and layer 1 saw other activations)."""
    from ctconvert.calibration.model import calibrate
    from ctconvert.checkpoint.reader import open_checkpoint

    cfg = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    cfg.sliding_window, cfg.max_position_embeddings = 8, 128
    torch.manual_seed(0)
    model = randomized(transformers.MistralForCausalLM(cfg).to(torch.bfloat16)).eval()
    model.save_pretrained(str(tmp_path / "m"))
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))  # rows of 48 tokens, a window of 8
    got = calibrate(open_checkpoint(tmp_path / "m"), ids, torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    seen = {}
    for name, m in ref.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            m.register_forward_pre_hook(lambda mod, a, name=name: seen.setdefault(name, a[0]))
    with torch.no_grad():
        ref(input_ids=ids, use_cache=False)
    assert set(seen) == set(got.inputs)
    for name, x in seen.items():
        assert torch.equal(got.inputs[name].max.max(), x.max()) and torch.equal(got.inputs[name].min.min(), x.min()), name
