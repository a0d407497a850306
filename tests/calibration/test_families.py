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
