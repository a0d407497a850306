"""Batches of small units (pipeline/batches.py, reads.unit_order): the same bytes as each unit alone, on the CPU and
on CUDA, for every data-free scheme, with awkward values (rows of zeros, tiny rows that quantize to zeros, huge
values, -0.0); every unit read exactly once; NaN/inf and a quantizer's error named by tensor as without batches."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ctconvert import api
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError
from ctconvert.pipeline import reads
from ctconvert.pipeline.batches import member_writes, quantize_batch
from ctconvert.pipeline.executor import ExecOptions
from ctconvert.pipeline.reads import batch_key, unit_bytes, unit_order
from ctconvert.plan.planner import make_plan
from ctconvert.plan.schemes import resolve_scheme

from conftest import LLAMA_CONFIG, cuda_params, llama_tensors, write_checkpoint

E, H, INTER = 6, 256, 128
SCHEMES = ["NVFP4A16", "W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP4A16", "MXFP8A16"]


def _moe(tmp_path, dtype=torch.bfloat16, seed=5, poison=None):
    """A 2-layer Qwen3-MoE-named checkpoint with E experts per layer (2 shards) whose experts hold awkward values:
    expert 1's gate_proj a row of zeros, expert 2's up_proj tiny rows (1e-30: zero scales), expert 3's down_proj
    a huge value and a -0.0, each expert its own magnitude (so that every unit has its own global scale).
    ``poison``: ``(tensor name, row, column, value)`` written over one value."""
    cfg = dict(LLAMA_CONFIG, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=E, moe_intermediate_size=INTER, hidden_size=H)
    g = torch.Generator().manual_seed(seed)
    t = {k: v.to(dtype) for k, v in llama_tensors(LLAMA_CONFIG).items() if ".mlp." not in k}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp."
        t[p + "gate.weight"] = (torch.randn(E, H, generator=g) * 0.02).to(dtype)
        for e in range(E):
            scale = 0.02 * 2.0 ** (e - 2)
            for leaf, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
                w = torch.randn(*shape, generator=g) * scale
                if e == 1 and leaf == "gate_proj":
                    w[7] = 0
                if e == 2 and leaf == "up_proj":
                    w[3:5] = 1e-30 * torch.randn(2, shape[1], generator=g)
                if e == 3 and leaf == "down_proj":
                    w[0, 0], w[1, 1] = 1000.0, -0.0
                t[p + f"experts.{e}.{leaf}.weight"] = w.to(dtype)
    if poison is not None:
        name, r, c, v = poison
        t[name][r, c] = v
    return write_checkpoint(tmp_path / f"moe-{seed}", t, cfg, shards=2)


def _tensors(folder):
    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            found.update({k: h.get_tensor(k) for k in h.keys()})
    return found


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


def _run(src, out, scheme, device, batch, monkeypatch, **kw):
    monkeypatch.setenv("CTCONVERT_BATCH", "1" if batch else "0")
    return api.quantize(src, out, scheme, device=device, **kw)


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("scheme", SCHEMES)
def test_batched_bytes_are_each_unit_alone(tmp_path, monkeypatch, scheme, device):
    src = _moe(tmp_path)
    ckpt = open_checkpoint(src)
    opts = ExecOptions(device=torch.device(device), batch=True)
    order = list(unit_order(ckpt, make_plan(ckpt, scheme), opts))
    assert sum(len(u) for u in order if isinstance(u, tuple)) >= 4 * E  # the experts were batched
    a = _run(src, tmp_path / "a", scheme, device, False, monkeypatch)
    b = _run(src, tmp_path / "b", scheme, device, True, monkeypatch)
    ta, tb = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert ta.keys() == tb.keys() and any(".experts.4.down_proj.weight" in k for k in ta)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(_bits(ta[k]), _bits(tb[k])), k
    for f in (tmp_path / "a").glob("*.safetensors"):  # the files too, header and padding
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()
    assert a.zero_quantized == b.zero_quantized
    if scheme == "NVFP4A16":  # the tiny rows (E4M3 group scales of zero) are reported, batched or not
        assert any("experts.2.up_proj" in z["tensor"] for z in b.zero_quantized)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads((tmp_path / "b" / "config.json").read_text())


@pytest.mark.parametrize("device", cuda_params())
def test_batch_results_match_one_unit_at_a_time_in_fp16_and_per_tensor_fp8(tmp_path, device):
    """quantize_batch itself against each member quantized alone (its set's global scale, or its own per-tensor scale
    from its absmax), fp16 with tiny and huge values, and the ``FP8`` preset's per-tensor weight scale."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(5, 2, 40, 256, generator=g) * torch.logspace(-6, 2, 5).reshape(5, 1, 1, 1)).half()
    x[0, 1, 3] = 0
    x[2, 0, 0, 0] = 60000.0
    x = x.to(dev)
    for name in ("NVFP4A16", "FP8", "W4A16"):
        scheme = resolve_scheme(name)
        units = [SimpleNamespace(scheme=scheme, modules=["m.a", "m.b"])] * 5  # what quantize_batch reads of a WorkUnit
        res = quantize_batch(units, [[None, None]] * 5, x, "auto", check_now=True)
        for b in range(5):
            amax = x[b].abs().amax().float()
            for m in range(2):
                w = x[b, m]
                if scheme.global_scale:
                    from ctconvert.formats.fp4 import nvfp4_global_scale

                    gs = nvfp4_global_scale(amax, w.dtype)
                    want = {**scheme.quantize_rows(w, gs), **scheme.whole_tensor_outputs(tuple(w.shape), gs)}
                elif name == "FP8":
                    from ctconvert.pipeline.scales import fp8_tensor_scale

                    ws = fp8_tensor_scale(w.abs().amax().float(), w.dtype)
                    want = {**scheme.quantize_rows(w, None, weight_scale=ws), "weight_scale": ws}
                else:
                    want = {**scheme.quantize_rows(w), **scheme.whole_tensor_outputs(tuple(w.shape), None)}
                assert res.outputs.keys() == want.keys(), name
                for k, t in want.items():
                    assert torch.equal(_bits(res.outputs[k][b * 2 + m]), _bits(t)), (name, b, m, k)
        assert res.prefixes == ["m.a.", "m.b."] * 5
        assert torch.equal(res.amax.cpu(), x.reshape(10, -1).abs().amax(dim=1).float().cpu())


def test_every_unit_is_read_once_in_batches_of_one_key_within_the_window(tmp_path, monkeypatch):
    src = _moe(tmp_path)
    ckpt = open_checkpoint(src)
    plan = make_plan(ckpt, "NVFP4A16")
    opts = ExecOptions(device=torch.device("cpu"), batch=True)
    monkeypatch.setattr(reads, "BATCH_BYTES", 3 * 2 * INTER * H * 2)  # three gate/up sets, or six downs
    monkeypatch.setattr(reads, "BATCH_WINDOW", 9)
    order = list(unit_order(ckpt, plan, opts))
    flat = [u for item in order for u in (item if isinstance(item, tuple) else (item,))]
    assert sorted(flat) == list(range(len(plan.units)))
    alone = [u for u in order if isinstance(u, int)]
    assert alone == sorted(alone)
    batches = [u for u in order if isinstance(u, tuple)]
    assert batches and all(len(b) > 1 for b in batches)
    for b in batches:
        keys = {batch_key(ckpt, plan.units[u], opts) for u in b}
        assert len(keys) == 1 and None not in keys
        assert max(b) - min(b) < 9 and list(b) == sorted(b)
        assert sum(unit_bytes(ckpt, plan.units[u]) for u in b) <= reads.BATCH_BYTES  # within the limit, never past it
    for u, unit in enumerate(plan.units):  # what is read alone and why
        if u in alone and unit.kind != "copy":
            key = batch_key(ckpt, unit, opts)
            assert key is None or all(u not in b for b in batches)
    assert list(unit_order(ckpt, plan, dataclasses.replace(opts, batch=False))) == list(range(len(plan.units)))


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("value,kind", [(float("nan"), "NaN"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_non_finite_in_a_batched_expert_names_it(tmp_path, monkeypatch, device, value, kind):
    name = "model.layers.1.mlp.experts.4.up_proj.weight"
    src = _moe(tmp_path, poison=(name, 3, 5, value))
    for batch in (False, True):
        with pytest.raises(BadInputError) as e:
            _run(src, tmp_path / f"o{batch}", "NVFP4A16", device, batch, monkeypatch)
        assert name in str(e.value) and f"1 non-finite value ({kind}; first at row 3, column 5)" in str(e.value), batch
        assert not (tmp_path / f"o{batch}").exists()


@pytest.mark.parametrize("device", cuda_params())
def test_a_quantizer_error_in_a_batch_names_the_tensor(tmp_path, monkeypatch, device):
    name = "model.layers.0.mlp.experts.2.down_proj.weight"
    src = _moe(tmp_path, dtype=torch.float16, poison=(name, 1, 2, 65504.0))  # MXFP4's scale overflows fp16
    msgs = []
    for batch in (False, True):
        with pytest.raises(BadInputError) as e:
            _run(src, tmp_path / f"o{batch}", "MXFP4A16", device, batch, monkeypatch)
        msgs.append(str(e.value))
        assert name in str(e.value) and "overflows torch.float16 at row 1, columns 0-31: the group's absmax 65504" in str(e.value)
    assert msgs[0] == msgs[1]


def _gpt_oss(tmp_path, poison=None):
    """gpt-oss's fused 3-D experts (``gate_up_proj [E, H, 2I]`` interleaved, ``down_proj [E, I, H]``, used as x @ W):
    its experts are views of one region each (gate and up every other column), batched as such."""
    g = torch.Generator().manual_seed(8)
    p = "model.layers.0.mlp.experts."
    gu = torch.randn(E, H, 2 * INTER, generator=g) * torch.logspace(-3, 0, E).reshape(E, 1, 1)
    gu[1, :, 4] = 0  # a gate row of zeros (column 4 of the region: gate row 2)
    down = torch.randn(E, INTER, H, generator=g) * 0.02
    down[2, 3, 5] = 1000.0
    t = {p + "gate_up_proj": gu.bfloat16(), p + "down_proj": down.bfloat16(), "model.layers.0.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)}
    if poison is not None:
        name, idx, v = poison
        t[name][idx] = v
    return write_checkpoint(tmp_path / "gpt", t, {"model_type": "gpt_oss", "hidden_size": H, "num_local_experts": E})


EXPERTS = ["Linear", r"re:.*mlp\.experts\.\d+\..*"]


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16", "FP8_DYNAMIC", "MXFP4A16"])
def test_fused_expert_views_batched_are_the_same_bytes(tmp_path, monkeypatch, scheme, device):
    src = _gpt_oss(tmp_path)
    ckpt = open_checkpoint(src)
    plan = make_plan(ckpt, scheme, targets=EXPERTS, allow_unloadable=True)
    ckpt = dataclasses.replace(ckpt, tensors={**ckpt.tensors, **plan.views})  # as the plan stage hands it on
    order = list(unit_order(ckpt, plan, ExecOptions(device=torch.device(device), batch=True)))
    batched = [plan.units[u] for b in order if isinstance(b, tuple) for u in b]
    assert len(batched) == 2 * E and all(ckpt.tensors[s].view is not None for u in batched for s in u.sources)
    kw = {"targets": EXPERTS, "allow_unloadable": True}
    a = _run(src, tmp_path / "a", scheme, device, False, monkeypatch, **kw)
    b = _run(src, tmp_path / "b", scheme, device, True, monkeypatch, **kw)
    for f in (tmp_path / "a").glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()
    assert {k for k in _tensors(tmp_path / "a") if "experts.5.up_proj.weight" in k}
    assert a.zero_quantized == b.zero_quantized


def test_fused_expert_views_are_batched_by_default_on_a_gpu(tmp_path):
    """A GPU run's default (``batch`` None) batches fused experts' views as it does per-expert tensors (their batched
    gather ran on an H100: the same bytes, faster); ``CTCONVERT_BATCH=0`` (``batch`` False) reads each alone, and a CPU
    run batches nothing unless asked (the device is not touched)."""
    src = _gpt_oss(tmp_path)
    ckpt = open_checkpoint(src)
    plan = make_plan(ckpt, "NVFP4A16", targets=EXPERTS, allow_unloadable=True)
    ckpt = dataclasses.replace(ckpt, tensors={**ckpt.tensors, **plan.views})

    def batched(batch, device="cuda"):
        order = unit_order(ckpt, plan, ExecOptions(device=torch.device(device), batch=batch))
        return [u for b in order if isinstance(b, tuple) for u in b]

    assert len(batched(None)) == 2 * E and batched(None) == batched(True) and batched(False) == []
    assert batched(None, "cpu") == [] and len(batched(True, "cpu")) == 2 * E


@pytest.mark.parametrize("device", cuda_params())
def test_non_finite_in_a_batched_fused_expert_names_the_view(tmp_path, monkeypatch, device):
    src = _gpt_oss(tmp_path, poison=("model.layers.0.mlp.experts.gate_up_proj", (3, 7, 9), float("nan")))  # expert 3, up (odd column)
    msgs = []
    for batch in (False, True):
        with pytest.raises(BadInputError) as e:
            _run(src, tmp_path / f"o{batch}", "NVFP4A16", device, batch, monkeypatch, targets=EXPERTS, allow_unloadable=True)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "experts.3.up_proj" in msgs[0]


def test_member_writes_are_each_members_equal_slice_of_its_outputs_bytes():
    """A batch's stacked output, staged as one byte array, goes to the writers as each member's slice (a view, in
    member order); bytes that do not split evenly among the members are an error, never a silent short write."""
    packed = torch.arange(3 * 2 * 5, dtype=torch.uint8).reshape(3, 2, 5)  # 3 members' [2, 5] weight_packed
    scale = torch.randn(3, 2, 1).to(torch.float8_e4m3fn)
    rows = [("weight_packed", [f"m{i}.weight_packed" for i in range(3)], packed), ("weight_scale", [f"m{i}.weight_scale" for i in range(3)], scale)]
    staged = [t.contiguous().reshape(-1).view(torch.uint8).numpy() for _, _, t in rows]
    writes = member_writes(rows, staged)
    assert [n for n, _, _ in writes] == [*rows[0][1], *rows[1][1]] and all(pos == 0 for _, _, pos in writes)
    for (_, part, _), member in zip(writes, [*packed, *scale]):
        assert part.tobytes() == member.contiguous().view(torch.uint8).numpy().tobytes()
        assert np.shares_memory(part, staged[0]) or np.shares_memory(part, staged[1])
    with pytest.raises(ValueError):
        member_writes([("weight_packed", ["a", "b"], packed)], [staged[0][:-1]])


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_warm_batch_launches_the_batch_kernels_of_each_key(tmp_path, monkeypatch, family, device):
    """The warm-up's batch (``warm_batch``) runs a batch's own work on zeros: the quantizer's tall launch of the first
    batch's rows with one NVFP4 global scale per row, the absmax, the NaN/inf flag and the zero-row scan, and for
    fused experts the gather of a view; nothing of it is kept (a later run writes what it wrote without it)."""
    from ctconvert.pipeline import batches as batches_mod
    from ctconvert.pipeline.reads import warm_up_batches
    from ctconvert.plan.schemes import Scheme

    src = _gpt_oss(tmp_path) if family == "gpt_oss" else _moe(tmp_path)
    kw = {"targets": EXPERTS, "allow_unloadable": True} if family == "gpt_oss" else {}
    ckpt = open_checkpoint(src)
    plan = make_plan(ckpt, "NVFP4A16", **kw)
    ckpt = dataclasses.replace(ckpt, tensors={**ckpt.tensors, **plan.views})
    jobs = warm_up_batches(ckpt, plan, ExecOptions(device=torch.device(device), batch=True))
    assert jobs and all((info.view is not None) == (family == "gpt_oss") for _, info, _ in jobs)
    launches, gathers, scans = [], [], []
    real_rows, real_values, real_scan = Scheme.quantize_rows, batches_mod.batch_values, batches_mod.stacked_candidates

    def rows_spy(self, w, gs=None, *a, **k):
        launches.append((tuple(w.shape), tuple(gs.shape)))
        return real_rows(self, w, gs, *a, **k)

    monkeypatch.setattr(Scheme, "quantize_rows", rows_spy)
    monkeypatch.setattr(batches_mod, "batch_values", lambda infos, data: gathers.append(infos[0][0].name) or real_values(infos, data))
    monkeypatch.setattr(batches_mod, "stacked_candidates", lambda s, *a: scans.append(tuple(s.shape)) or real_scan(s, *a))
    for scheme, info, rows in jobs:
        batches_mod.warm_batch(scheme, info, rows, "auto", torch.device(device))
    assert launches == [((rows, info.shape[1]), (rows, 1)) for _, info, rows in jobs]
    assert scans == [(rows // info.shape[0], info.shape[0], info.shape[1] // 16) for _, info, rows in jobs]
    assert gathers == ([info.name for _, info, _ in jobs] if family == "gpt_oss" else [])
