"""``--observer`` end to end (the quantize stage, pipeline/scales.py, the executor): a run of ctconvert on the
source weights of ``tests/data/observers/llmc_observers.safetensors`` writes llm-compressor 0.14.0.1's bytes and
config fields for every reference run it holds; the CLI and a batch job take the option; what a run cannot
honour is refused by name; the plan names the observer; ``verify`` measures the output's own error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from ctconvert import api
from ctconvert.cli import main
from ctconvert.errors import UsageError
from ctconvert.formats import WeightArgs, get_format

from conftest import write_checkpoint
from helpers import assert_reference_tensors, llama_around

REF = Path(__file__).resolve().parent.parent / "data" / "observers" / "llmc_observers.safetensors"
HIDDEN, VOCAB = 128, 64


def _meta() -> dict:
    with safe_open(str(REF), "pt") as f:
        return json.loads(f.metadata()["reference"])


def _runs():
    """Every (case, run) of the reference, the chunking varied: bf16 runs hold each set, fp16 ones read it twice."""
    return [pytest.param(case, run, id=f"{case}-{run}") for case, c in _meta()["cases"].items() for run in c["runs"]]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """One tiny Llama checkpoint per reference case: its source weights, plus embeddings, norms and an lm_head."""
    out = {}
    with safe_open(str(REF), "pt") as f:
        for case, c in _meta()["cases"].items():
            linear = {f"{m}.weight": f.get_tensor(f"{case}/source/{m}.weight") for m in c["modules"]}
            t, cfg = llama_around(linear, getattr(torch, c["dtype"]), VOCAB, HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
            out[case] = write_checkpoint(tmp_path_factory.mktemp(case) / "src", t, cfg)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _observer(run: str) -> str:
    name = run.split("/")[1]
    return "minmax" if name == "memoryless_minmax" else name


def _assert_llmc_bytes(case: str, run: str, out: Path) -> None:
    """Every tensor llm-compressor wrote for ``case``/``run`` is in ``out`` with its bytes; the weights' config
    args carry its observer fields (none for min/max)."""
    prefix = f"{case}/{run}/"
    assert_reference_tensors(REF, prefix, out)
    theirs = _meta()["cases"][case]["runs"][run]["config_groups"]["group_0"]["weights"]
    mine = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    if _observer(run) == "minmax":
        assert "observer" not in mine and "observer_kwargs" not in mine  # today's config
    else:
        assert {k: mine[k] for k in ("observer", "observer_kwargs")} == {k: theirs[k] for k in ("observer", "observer_kwargs")}


@pytest.mark.parametrize("case,run", _runs())
def test_api_writes_llmcompressors_bytes(case, run, sources, tmp_path):
    """Row chunks of 32 rows; bf16 holds each fused set, fp16 reads it twice (hold_bytes 0)."""
    scheme = run.split("/")[0]
    hold = {} if case.endswith("bf16") else {"hold_bytes": 0}
    api.quantize(sources[case], tmp_path / "out", scheme, observer=_observer(run), chunk_elems=32 * HIDDEN, **hold)
    _assert_llmc_bytes(case, run, tmp_path / "out")


def test_cli_observer(sources, tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", str(sources["llama-bf16"]), "-o", str(out), "-s", "W4A16", "--observer", "memoryless_mse"])
    assert r.exit_code == 0, r.output
    _assert_llmc_bytes("llama-bf16", "W4A16/memoryless_mse", out)


def test_batch_observer_key(sources, tmp_path):
    jobs = tmp_path / "jobs.json"
    job = {"model": str(sources["llama-fp16"]), "output": str(tmp_path / "out"), "scheme": "NVFP4A16", "observer": "nvfp4_expanded_mse"}
    jobs.write_text(json.dumps({"jobs": [job]}))
    assert api.batch(jobs, emit=lambda *a: None) == 0
    _assert_llmc_bytes("llama-fp16", "NVFP4A16/nvfp4_expanded_mse", tmp_path / "out")


def test_refused_by_name(tiny_llama, tmp_path):
    """A block scheme, calibrated activations and 2:4 pruning cannot take an MSE observer: a UsageError names why
    (also in a dry run), nothing is written."""
    with pytest.raises(UsageError, match=r"--observer memoryless_mse cannot take scheme FP8_BLOCK \(config group group_0\).*'block' strategy"):
        api.quantize(tiny_llama, tmp_path / "a", "FP8_BLOCK", observer="memoryless_mse")
    with pytest.raises(UsageError, match="cannot take scheme NVFP4 .*calibrated"):
        api.quantize(tiny_llama, tmp_path / "b", "NVFP4", observer="nvfp4_expanded_mse", dry_run=True)
    with pytest.raises(UsageError, match="does not take --sparsity 2:4"):
        api.quantize(tiny_llama, tmp_path / "c", "FP8_DYNAMIC", observer="memoryless_mse", sparsity="2:4")
    with pytest.raises(UsageError, match="unknown --observer 'mse'"):
        api.quantize(tiny_llama, tmp_path / "d", "W4A16", observer="mse")
    assert not any((tmp_path / x).exists() for x in "abcd")


def test_the_plan_names_the_observer(sources, tmp_path):
    src = sources["llama-bf16"]
    plan = api.quantize(src, tmp_path / "o", "NVFP4A16", observer="nvfp4_expanded_mse", lm_head="fp8", dry_run=True).to_dict()["plan"]
    assert plan["observers"] == {"lm_head": "nvfp4_expanded_mse", "group_0": "nvfp4_expanded_mse"}  # every config group, lm_head's too
    assert "observers" not in api.quantize(src, tmp_path / "o", "NVFP4A16", dry_run=True).to_dict()["plan"]  # min/max: today's plan
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "o"), "-s", "W4A16", "--observer", "memoryless_mse", "--dry-run"])
    assert r.exit_code == 0 and "observer memoryless_mse (config group group_0)" in r.output


def test_verify_measures_the_observers_output(sources, tmp_path):
    """verify passes, and its error is the output's own: the relative L2 error of llm-compressor's bytes
    dequantized, computed here without ctconvert's writer; the searched ranges lower it against min/max."""
    src, case, run = sources["llama-bf16"], "llama-bf16", "NVFP4A16/nvfp4_expanded_mse"
    out = tmp_path / "mse"
    api.quantize(src, out, "NVFP4A16", observer="nvfp4_expanded_mse")
    report = api.verify(out, reference=src)
    assert report["ok"], report["problems"]
    group = _meta()["cases"][case]["runs"][run]["config_groups"]["group_0"]
    fmt, args = get_format(group["format"]), WeightArgs.from_dict(group["weights"])
    rows = {r["module"]: r for r in report["tensors"]}
    with safe_open(str(REF), "pt") as ref:
        for m in _meta()["cases"][case]["modules"]:
            parts = {k.rsplit(".", 1)[1]: ref.get_tensor(k) for k in ref.keys() if k.startswith(f"{case}/{run}/{m}.")}
            dense = fmt.dequantize(parts, args, impl="torch").double()
            w = ref.get_tensor(f"{case}/source/{m}.weight").double()
            assert rows[m]["rel_l2"] == pytest.approx(float((dense - w).norm() / w.norm()), rel=1e-4), m
    api.quantize(src, tmp_path / "minmax", "NVFP4A16")
    plain = {r["module"]: r["rel_l2"] for r in api.verify(tmp_path / "minmax", reference=src)["tensors"]}
    assert sum(rows[m]["rel_l2"] for m in plain) < sum(plain.values())


def test_target_takes_the_observers_tensors(sources, tmp_path):
    """``--target marlin`` repacks the searched tensors; undoing the repack gives llm-compressor's bytes and config fields."""
    api.quantize(sources["llama-bf16"], tmp_path / "marlin", "W4A16", observer="memoryless_mse", target="marlin")
    api.repack(tmp_path / "marlin", tmp_path / "back", "compressed-tensors")
    _assert_llmc_bytes("llama-bf16", "W4A16/memoryless_mse", tmp_path / "back")


@pytest.mark.parametrize("scheme,observer", [("W4A16", "nvfp4_expanded_mse"), ("NVFP4A16", "nvfp4_expanded_mse"), ("W4A16", "memoryless_mse")])
def test_a_nan_weight_is_refused_by_name(scheme, observer, tmp_path):
    """With or without a pre-pass, a NaN in a weight is the usual error naming the file and tensor (exit 3)."""
    from ctconvert.errors import BadInputError

    from conftest import LLAMA_CONFIG, llama_tensors

    t = llama_tensors(LLAMA_CONFIG)
    t["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
    src = write_checkpoint(tmp_path / "nan", t, LLAMA_CONFIG)
    with pytest.raises(BadInputError, match="NaN") as e:
        api.quantize(src, tmp_path / "out", scheme, observer=observer)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value) and e.value.exit_code == 3


def test_moe_experts_fused_gate_up(tmp_path):
    """MoE experts through the executor (row chunks, read twice): each expert's gate/up pair shares the global
    scale of its searched ranges, as one search of each whole tensor gives it (the test_observers.py reference)."""
    from ctconvert.formats.fp4 import nvfp4_global_scale
    from ctconvert.formats.observers import OBSERVERS, range_absmax
    from ctconvert.plan.schemes import get_scheme

    from conftest import moe_checkpoint

    src = moe_checkpoint(tmp_path, experts=2, inter=256)
    api.quantize(src, tmp_path / "out", "NVFP4A16", observer="memoryless_mse", chunk_elems=64 * 256, hold_bytes=0)
    obs, scheme = OBSERVERS["memoryless_mse"], get_scheme("NVFP4A16")
    with safe_open(str(src / "model.safetensors"), "pt") as s, safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as got:
        bases = [k[: -len("gate_proj.weight")] for k in s.keys() if ".experts." in k and k.endswith("gate_proj.weight")]
        assert len(bases) == 4
        for base in bases:
            ws = {p: s.get_tensor(f"{base}{p}.weight") for p in ("gate_proj", "up_proj")}
            ranges = {p: obs.ranges(w, scheme.weights) for p, w in ws.items()}
            gs = nvfp4_global_scale(torch.stack([range_absmax(*r) for r in ranges.values()]).max(), torch.bfloat16)
            for p, w in ws.items():
                want = scheme.weight_format.quantize(w, scheme.weights, gs, ranges=ranges[p])
                want.update(scheme.weight_format.whole_tensor_outputs(tuple(w.shape), gs))
                for key, t in want.items():
                    assert torch.equal(_bits(got.get_tensor(f"{base}{p}.{key}")), _bits(t)), f"{base}{p}.{key}"


@pytest.mark.parametrize(
    ("options", "refresh", "begun"),
    [
        ({}, False, True),
        ({"target": "marlin"}, False, False),  # the layout stage replaces the plan and sets the repack after this stage
        ({"resume": True}, False, False),  # the executor runs a part of the plan
        ({}, True, False),  # --refresh: the same
        ({"executor": "ray"}, False, False),
        ({"impl": "torch"}, False, False),
    ],
)
def test_the_warm_up_is_begun_ahead_only_where_the_plan_and_options_are_final(monkeypatch, options, refresh, begun):
    """A local GPU run begins its warm-up in the quantize stage (stages/quantize.py _warm_ahead), which the executor
    adopts; a failed run waits for it in close() unless stopped. No GPU is used: WarmUp's start is replaced."""
    from types import SimpleNamespace

    from ctconvert.pipeline.options import QuantizeOptions
    from ctconvert.pipeline.warm import WarmUp
    from ctconvert.stages.quantize import QuantizeStage

    joined = []

    class FakeThread:
        def join(self):
            joined.append(True)

    monkeypatch.setattr(WarmUp, "start", lambda self: setattr(self, "thread", FakeThread()) or self.thread)
    stage = QuantizeStage(QuantizeOptions(device="cpu", **options))
    job = SimpleNamespace(ckpt="ckpt", plan="plan", refresh=refresh, exec=SimpleNamespace(device=torch.device("cuda", 0), warm=None))
    stage._warm_ahead(job)
    assert (job.exec.warm is not None) == begun
    if begun:
        assert job.exec.warm.dev == torch.device("cuda", 0) and job.exec.warm.plan == "plan"
    stage.close(job, stopped=True)
    assert joined == []  # stopped: the process is ending
    stage.close(job)
    assert joined == ([True] if begun else [])
    job.exec.device = torch.device("cpu")
    job.exec.warm = None
    stage._warm_ahead(job)
    assert job.exec.warm is None  # a CPU run warms up nothing
