"""inspect of every input format quantize and convert read: AutoAWQ, GPTQ, FP8 block (DeepSeek), ModelOpt NVFP4."""

from __future__ import annotations

import json

import foreign_formats as ff
import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from ctconvert import api
from ctconvert.cli import main


def _build(kind, path):
    if kind == "awq":
        return ff.awq_checkpoint(path)[0]
    if kind == "gptq":
        return ff.gptq_checkpoint(path, act_order=True)[0]
    if kind == "gptq-8":
        return ff.gptq_checkpoint(path, bits=8, v1=False)[0]
    if kind == "modelopt":
        return ff.modelopt_checkpoint(path)[0]
    if kind == "modelopt-hf-quant-config":
        return ff.modelopt_checkpoint(path, in_config=False)[0]
    return ff.deepseek_checkpoint(path)


@pytest.mark.parametrize(
    "kind,fmt,bits,group,quantized,layers",
    [
        ("awq", "awq", 4, 128, 7, 8),
        ("gptq", "gptq", 4, 128, 7, 8),
        ("gptq-8", "gptq", 8, 128, 7, 8),
        ("modelopt", "modelopt-nvfp4", 4, 16, 7, 8),
        ("modelopt-hf-quant-config", "modelopt-nvfp4", 4, 16, 7, 8),
        ("fp8-block", "fp8-block", 8, None, 33, 38),
    ],
)
def test_inspect_reads_the_input_formats_of_other_tools(tmp_path, kind, fmt, bits, group, quantized, layers):
    """issue 22: inspect of a valid AutoAWQ, GPTQ, FP8-block or ModelOpt input exited 3 with about 14 `error:` lines
    and "0/1 Linear layers quantized". Each is shown as what it is, as the readers quantize/convert use see it."""
    src = _build(kind, tmp_path / kind)
    rep = api.inspect(src)
    assert [p for p in rep["problems"] if p["severity"] == "error"] == []
    assert (rep["totals"]["quantized_layers"], rep["totals"]["linear_layers"]) == (quantized, layers)
    q = [r for r in rep["layers"] if r["format"] != "dense"]
    assert {r["format"] for r in q} == {fmt} and {r["bits"] for r in q} == {bits} and {r["group_size"] for r in q} == {group}
    assert rep["quantization_config"]["source_format"] in (fmt, "modelopt")
    if kind == "fp8-block":
        assert {tuple(r["block"]) for r in q} == {(128, 128)} and all(set(r["tensors"]) == {"weight", "weight_scale_inv"} for r in q)
    if kind == "modelopt-hf-quant-config":
        assert rep["quantization_config"]["config_file"] == "hf_quant_config.json"
    down = next(r for r in q if r["module"].endswith("mlp.down_proj"))
    assert down["bits_per_weight"] == pytest.approx(8 * down["bytes"] / down["params"], abs=1e-3) and bits <= down["bits_per_weight"] < bits + 1
    r = CliRunner().invoke(main, ["--plain", "inspect", str(src)])
    assert r.exit_code == 0 and f"{quantized}/{layers} Linear layers quantized" in r.stdout and "error:" not in r.output
    r = CliRunner().invoke(main, ["--json", "inspect", str(src)])
    assert r.exit_code == 0 and json.loads(r.stdout)["exit_code"] == 0


def test_inspect_of_a_broken_foreign_input_names_the_file_and_tensor(tmp_path):
    """A reader's refusal (a missing scale) is one error naming the file and tensor, exit 3."""
    src, _ = ff.awq_checkpoint(tmp_path / "awq")
    tensors = load_file(src / "model.safetensors")
    gone = next(n for n in tensors if n.endswith("mlp.down_proj.scales"))
    ff.save(src, {n: t for n, t in tensors.items() if n != gone}, json.loads((src / "config.json").read_text()))
    rep = api.inspect(src)
    errs = [p for p in rep["problems"] if p["severity"] == "error"]
    assert len(errs) == 1 and errs[0]["file"].endswith(".safetensors") and "down_proj" in errs[0]["tensor"]
    assert CliRunner().invoke(main, ["inspect", str(src)]).exit_code == 3


def test_inspect_names_the_activations_and_the_kv_cache(tmp_path):
    """Each config group's input activations and the config's kv_cache_scheme are in the report (and the text):
    NVFP4 (W4A4) is told apart from NVFP4A16, static FP8 from dynamic."""
    from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

    src = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG, seed=1), LLAMA_CONFIG)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % 250 for i in range(64)]))
    cal = dict(calibration=ids, calibration_samples=2, calibration_seq_len=16)
    cases = [
        ("NVFP4", dict(cal, kv_cache="fp8-head"), "fp4 g16 local", "fp8 attn_head static"),
        ("NVFP4A16", {}, None, None),
        ("FP8", dict(cal), "fp8 tensor static", None),
        ("FP8_DYNAMIC", dict(cal, kv_cache="fp8"), "fp8 token dynamic", "fp8 tensor static"),
    ]
    for scheme, kw, acts, kv in cases:
        out = tmp_path / scheme
        api.quantize(src, out, scheme, **kw)
        report = api.inspect(out)
        assert [g["activations"] for g in report["config_groups"].values()] == [acts], scheme
        assert report["kv_cache_scheme"] == kv, scheme


def test_inspect_counts_fused_experts_kept_dense_as_linear_weights(tmp_path):
    """gpt-oss's fused 3-D experts kept dense (the default) are rows of the layer table and count in the totals: the
    source, the output with dense experts and the output with experts quantized (split per expert) hold the same
    Linear parameters; the fused rows say how many experts they hold."""
    import torch

    from conftest import write_checkpoint

    h, i, e = 128, 128, 4
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": r(256, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": r(256, h)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = r(h, h)
        t[p + "mlp.router.weight"], t[p + "mlp.router.bias"] = r(e, h), r(e)
        t[p + "mlp.experts.gate_up_proj"], t[p + "mlp.experts.gate_up_proj_bias"] = r(e, h, 2 * i), r(e, 2 * i)
        t[p + "mlp.experts.down_proj"], t[p + "mlp.experts.down_proj_bias"] = r(e, i, h), r(e, h)
    cfg = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": h,
        "intermediate_size": i,
        "num_local_experts": e,
        "num_hidden_layers": 2,
    }
    src = write_checkpoint(tmp_path / "src", t, cfg)
    api.quantize(src, tmp_path / "dense-experts", "W4A16")
    api.quantize(src, tmp_path / "split", "W4A16", targets=["Linear", r"re:.*mlp\.experts\.\d+\..*"], allow_unloadable=True)
    expert_params = 2 * e * (h * 2 * i + i * h)
    reports = {k: api.inspect(tmp_path / k if k != "src" else src) for k in ("src", "dense-experts", "split")}
    for k, rep in reports.items():
        assert rep["totals"]["linear_params"] == expert_params + 2 * h * h + 2 * e * h + 256 * h, k  # experts, q_proj, routers, lm_head
        assert rep["totals"]["linear_layers"] == 2 * e * 3 + 2 + 2 + 1, k  # a fused tensor counts the layers it holds
    for k in ("src", "dense-experts"):
        fused = {row["module"]: row for row in reports[k]["layers"] if row.get("experts")}
        assert set(fused) == {f"model.layers.{n}.mlp.experts.{m}" for n in range(2) for m in ("gate_up_proj", "down_proj")}, k
        assert all(row["experts"] == e and row["format"] == "dense" and row["bits_per_weight"] == 16.0 for row in fused.values())
    assert not any(row.get("experts") for row in reports["split"]["layers"])
    assert reports["split"]["totals"]["quantized_layers"] == 2 * e * 3 + 2  # gate, up, down per expert; q_proj
    out = CliRunner().invoke(main, ["inspect", str(tmp_path / "dense-experts"), "--all-layers"], env={"COLUMNS": "220"})
    assert out.exit_code == 0 and "model.layers.0.mlp.experts.gate_up_proj" in out.output, out.output
    line = next(x for x in out.output.splitlines() if "experts.gate_up_proj" in x)
    assert f"dense, {e} experts" in line, line


def test_partial_fp8_blocks_are_an_error_in_inspect_and_verify(tmp_path):
    """An FP8_BLOCK checkpoint whose MLP weights are not whole 128x128 blocks ([200, 256] gate/up, [256, 200] down, made
    with compressed-tensors' own compressor where ctconvert refuses them): transformers and vLLM 0.33 load whole blocks
    only, so inspect (exit 3) and verify (exit 5) report it, naming the first module and how many more; the same
    checkpoint with whole blocks has no such error."""
    from safetensors.torch import save_file

    from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint
    from ct_reference import ct_compress

    cfg = dict(LLAMA_CONFIG, intermediate_size=200)
    t = llama_tensors(cfg, seed=3)
    src = write_checkpoint(tmp_path / "src", t, cfg)
    out = tmp_path / "fp8"
    api.quantize(src, out, "FP8_BLOCK", skip_incompatible=True)  # the MLP stays dense and in ignore
    conf = json.loads((out / "config.json").read_text())
    mlp = [n[: -len(".weight")] for n in t if ".mlp." in n]
    conf["quantization_config"]["ignore"] = [x for x in conf["quantization_config"]["ignore"] if x not in mlp]
    (out / "config.json").write_text(json.dumps(conf))
    shard = next(out.glob("*.safetensors"))
    ts = load_file(shard)
    for m in mlp:
        del ts[m + ".weight"]
        ts.update({f"{m}.{k}": v for k, v in ct_compress(t[m + ".weight"], "FP8_BLOCK").items()})
    save_file(ts, shard, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {n: shard.name for n in ts}
        index.write_text(json.dumps(idx))
    (out / "ctconvert-provenance.json").unlink(missing_ok=True)
    rep = api.inspect(out)
    errs = [p for p in rep["problems"] if p["severity"] == "error" and "whole [128, 128] blocks" in p["message"]]
    assert len(errs) == 1 and errs[0]["tensor"] in mlp, rep["problems"]
    assert f"and {len(mlp) - 1} more such modules" in errs[0]["message"] and "vLLM 0.33 load whole blocks only" in errs[0]["message"]
    ver = api.verify(out)
    assert not ver["ok"] and any("whole [128, 128] blocks" in p["message"] for p in ver["problems"] if p["severity"] == "error")
    code = CliRunner().invoke(main, ["inspect", str(out)]).exit_code
    assert code == 3
    whole = tmp_path / "whole"
    api.quantize(write_checkpoint(tmp_path / "src2", llama_tensors(LLAMA_CONFIG, seed=3), LLAMA_CONFIG), whole, "FP8_BLOCK")
    assert not any("blocks of scales" in p["message"] for p in api.inspect(whole)["problems"] + api.verify(whole)["problems"])


def test_inspect_of_a_kernel_native_output_warns_of_what_verify_fails(tmp_path):
    """A kernel-native output whose config contradicts its tensors (hidden_size edited in the source): inspect warns of
    it as verify's count/width/size checks judge it (exit 0), where verify fails it; an unedited one has no warning."""
    from tests.conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

    for wide, warned in ((LLAMA_CONFIG["hidden_size"], False), (2 * LLAMA_CONFIG["hidden_size"], True)):
        cfg = {**LLAMA_CONFIG, "hidden_size": wide}
        src = write_checkpoint(tmp_path / f"src-{wide}", llama_tensors(LLAMA_CONFIG), cfg)
        out = tmp_path / f"marlin-{wide}"
        api.quantize(src, out, "W4A16", device="cpu", target="marlin")
        said = [p for p in api.inspect(out)["problems"] if p["message"].endswith("(`ctconvert verify` fails it)")]
        assert bool(said) == warned and all(p["severity"] == "warning" for p in said)
        assert api.verify(out)["ok"] != warned
        if warned:
            assert f"config.json's hidden_size is {wide}, but model.embed_tokens.weight holds {LLAMA_CONFIG['hidden_size']} columns" in said[0]["message"]


@pytest.mark.parametrize("kind", ["awq", "gptq", "modelopt", "fp8-block"])
def test_a_foreign_source_gets_the_loadability_list_of_its_dense_view(tmp_path, kind):
    """inspect and quantize of another tool's checkpoint judge its dense view as verify judges the output made from it:
    none of verify's architecture problems in a valid source;
    with config.json's hidden_size edited, inspect warns of the widths, quantize warns of the source, and
    verify fails the output with the same message."""
    src = _build(kind, tmp_path / kind)
    said = [p for p in api.inspect(src)["problems"] if p["message"].endswith("(`ctconvert verify` fails it)")]
    assert bool(said) == (kind == "fp8-block"), said  # (that fixture: a partial DeepSeek copy its config does not describe)
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] += 64
    (src / "config.json").write_text(json.dumps(cfg))
    width = f"config.json's hidden_size is {cfg['hidden_size']}"
    said = [p for p in api.inspect(src)["problems"] if p["severity"] == "warning" and width in p["message"]]
    assert len(said) == 1 and said[0]["message"].endswith("(`ctconvert verify` fails it)"), api.inspect(src)["problems"]
    r = api.quantize(src, tmp_path / "out", "FP8_DYNAMIC", device="cpu")
    assert any(w.startswith(f"the source {src}: ") and width in w for w in r.warnings), r.warnings
    rep = api.verify(tmp_path / "out")
    assert not rep["ok"] and any(width in p["message"] and p["severity"] == "error" for p in rep["problems"])


def test_inspect_shows_what_verify_fails_in_an_output_for_other_loaders(tmp_path):
    """Written with --allow-unloadable: gpt-oss experts quantized (vLLM 0.33 cannot load them quantized) and a MoE block
    whose experts are quantized unlike each other. inspect said "no problems found" of the first (a new-user trial);
    it now shows every error verify fails such an output with, as a warning saying so, exit 0."""
    from tests.conftest import gpt_oss_checkpoint, moe_checkpoint

    outs = [tmp_path / "gpt-oss", tmp_path / "mixed"]
    api.quantize(gpt_oss_checkpoint(tmp_path / "src"), outs[0], "W4A16", targets=["Linear", r"re:.*mlp\.experts\.\d+\..*"], allow_unloadable=True)
    api.quantize(moe_checkpoint(tmp_path, inter=128), outs[1], "W4A16", ignore=["model.layers.1.mlp.experts.0.down_proj"], allow_unloadable=True)
    for out in outs:
        failed = [p for p in api.verify(out)["problems"] if p["severity"] == "error"]
        assert len(failed) == 1, failed
        shown = [{**p, "severity": "error", "message": p["message"].removesuffix(" (`ctconvert verify` fails it)")} for p in api.inspect(out)["problems"]]
        assert shown == failed and all(p["severity"] == "warning" for p in api.inspect(out)["problems"])
        r = CliRunner().invoke(main, ["inspect", str(out)])
        assert r.exit_code == 0 and "warning:" in r.output and "no problems found" not in r.output
