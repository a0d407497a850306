"""Captured batches (pipeline/graphs.py): a replay gives the bytes, absmaxes, global scales, NaN/inf flag and zero-row
candidates of the eager batch on the same input, for every data-free scheme, fp16 and bf16, per-expert members and
fused experts' views (transposed or not), with awkward values (rows of zeros, tiny rows, huge values, -0.0, NaN, inf);
each replay reads its own input (never a stale one); a whole conversion with graphs is the bytes of one without. The
graphs need CUDA: without it those tests skip, and the CPU tests check what a CPU run does instead (no graphs) and
the zero-row bookkeeping a replay feeds."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ctconvert import api
from ctconvert.checkpoint.safetensors_io import SliceView
from ctconvert.pipeline import executor as executor_mod
from ctconvert.pipeline import graphs as graphs_mod
from ctconvert.pipeline.batches import batch_values, quantize_batch
from ctconvert.pipeline.graphs import BatchGraphs, graph_key, graphs_default
from ctconvert.pipeline.zeros import ZeroTracker, stacked_candidates
from ctconvert.plan.schemes import resolve_scheme

from conftest import cuda_params

sys.path.insert(0, str(Path(__file__).parent))  # test_batches' checkpoint builder

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
SCHEMES = ["NVFP4A16", "W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP4A16", "MXFP8A16", "FP8"]
ST = {torch.bfloat16: "BF16", torch.float16: "F16"}


def _info(shape, dtype, view=None):
    """What the batch functions read of a member's TensorInfo."""
    n = shape[0] * shape[1] * torch.finfo(dtype).bits // 8
    return SimpleNamespace(shape=tuple(shape), dtype=ST[dtype], torch_dtype=dtype, nbytes=n, view=view, itemsize=torch.finfo(dtype).bits // 8)


def _values(g, b, m, r, k, dtype):
    """fp32 ``[b, m, r, k]`` of awkward values: each unit its own magnitude, a row of zeros, tiny rows, a huge value, -0.0."""
    x = torch.randn(b, m, r, k, generator=g) * torch.logspace(-3, 1, b).reshape(b, 1, 1, 1)
    x[0, m - 1, 2] = 0
    x[min(1, b - 1), 0, 3:5] = 1e-30 * torch.randn(2, k, generator=g)
    x[b - 1, 0, 0, 0], x[b - 1, 0, 1, 1] = (60000.0 if dtype == torch.float16 else 1e4), -0.0
    return x


def _batch(g, scheme, b, m, shape, dtype, fused=False):
    """``(units, infos, host bytes)`` of one batch of ``b`` units of ``m`` members ``shape`` (fused: gpt-oss-like views
    of one region per unit, gate/up interleaved columns of a transposed ``[K, 2R]`` region)."""
    r, k = shape
    units = [SimpleNamespace(scheme=scheme, modules=[f"e{u}.m{j}" for j in range(m)]) for u in range(b)]
    if not fused:
        infos = [[_info(shape, dtype) for _ in range(m)] for _ in range(b)]
        data = _values(g, b, m, r, k, dtype).to(dtype).reshape(-1).view(torch.uint8)
    else:
        views = [SliceView(k, m * r, True, j, m) for j in range(m)]
        infos = [[_info(shape, dtype, views[j]) for j in range(m)] for _ in range(b)]
        region = _values(g, b, 1, k, m * r, dtype).to(dtype)
        data = region.reshape(-1).view(torch.uint8)
    return units, infos, data.clone().pin_memory() if torch.cuda.is_available() else data.clone()


def _bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _eager(units, infos, data, scheme, dev):
    x = batch_values(infos, data.to(dev))
    res = quantize_batch(units, infos, x, "auto", check_now=False)
    first = infos[0][0]
    mask = stacked_candidates(res.scales, scheme.weight_format, scheme.weights, first.torch_dtype, first.shape[0])
    return res, bool(torch.isfinite(res.amax).all()), mask


def _same(got, want, what):
    (res, ok, mask), (wres, wok, wmask) = got, want
    assert res.outputs.keys() == wres.outputs.keys(), what
    for key, t in wres.outputs.items():
        assert t.dtype == res.outputs[key].dtype and torch.equal(_bits(res.outputs[key]), _bits(t)), (what, key)
    assert torch.equal(_bits(res.amax), _bits(wres.amax)), what
    assert bool(ok) == wok, what
    assert res.prefixes == wres.prefixes, what
    for a, b in ((res.unit_scales, wres.unit_scales), (res.unit_amax, wres.unit_amax)):
        assert (a is None) == (b is None) and (a is None or torch.equal(_bits(a), _bits(b))), what
    assert (mask is None) == (wmask is None), what
    if mask is not None:  # the zero-row scan reads each member's share
        for a, b in ((res.global_scales, wres.global_scales), (res.set_amax, wres.set_amax)):
            assert [None if t is None else _bits(t).tolist() for t in a] == [None if t is None else _bits(t).tolist() for t in b], what
        assert torch.equal(mask.cpu(), wmask.cpu()), what


@cuda
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_a_replay_is_the_eager_batch_on_the_same_bytes(scheme_name, dtype, fused):
    dev = torch.device("cuda")
    scheme = resolve_scheme(scheme_name)
    g = torch.Generator().manual_seed(3)
    graphs = BatchGraphs(dev, "auto", zeros=True)
    shape = (128, 256)  # whole 128-row blocks (FP8_BLOCK) and groups
    replays = []
    with torch.inference_mode(), torch.cuda.stream(torch.cuda.Stream(dev)):
        for i in range(4):
            units, infos, data = _batch(g, scheme, 3, 2, shape, dtype, fused)
            got = graphs.run(units, infos, data)
            if i == 0 or scheme.weight_format.reads_back:
                assert got is None  # a key's first batch runs eagerly (its kernels load); MX's overflow check reads back
                continue
            if got is None:  # the FP8 preset's per-tensor scale copies a host value (an H100: the capture refused it)
                assert scheme_name == "FP8" and len(graphs.failed) == 1 and graphs.error is not None, graphs.error
                continue
            want = _eager(units, infos, data, scheme, dev)
            _same(got, want, (scheme_name, dtype, fused, i))
            replays.append(_bits(got[0].amax).tolist())
    if scheme.weight_format.reads_back or graphs.failed:  # every batch ran eagerly
        assert graphs.replays == 0 and not graphs.graphs
        return
    assert graphs.replays == 3 and len(graphs.graphs) == 1
    assert len({str(r) for r in replays}) == 3  # each replay read its own bytes


@cuda
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_replayed_batch_holding_a_non_finite_value_is_flagged_at_its_member(value):
    dev = torch.device("cuda")
    scheme = resolve_scheme("NVFP4A16")
    g = torch.Generator().manual_seed(4)
    graphs = BatchGraphs(dev, "auto", zeros=False)
    with torch.inference_mode():
        for i in range(3):
            units, infos, data = _batch(g, scheme, 4, 2, (64, 128), torch.bfloat16)
            if i == 2:
                vals = data.view(torch.bfloat16)
                vals[(2 * 2 + 1) * 64 * 128 + 5] = value  # unit 2, member 1
            got = graphs.run(units, infos, data)
        res, ok, mask = got
        assert not bool(ok) and mask is None
        bad = (~torch.isfinite(res.amax)).nonzero().flatten().tolist()
        assert bad == [5]
        units, infos, data = _batch(g, scheme, 4, 2, (64, 128), torch.bfloat16)
        assert bool(graphs.run(units, infos, data)[1])  # the next replay is finite again


@cuda
def test_kinds_are_captured_each_once_within_the_limit():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    graphs = BatchGraphs(dev, "auto", zeros=True, limit=2)
    nv, w4 = resolve_scheme("NVFP4A16"), resolve_scheme("W4A16")
    kinds = [(nv, 3, (64, 128)), (nv, 2, (64, 128)), (w4, 3, (64, 128))]
    with torch.inference_mode():
        for _ in range(3):
            for scheme, b, shape in kinds:
                units, infos, data = _batch(g, scheme, b, 1, shape, torch.bfloat16)
                got = graphs.run(units, infos, data)
                if got is not None:
                    _same(got, _eager(units, infos, data, scheme, dev), (scheme.name, b))
    assert len(graphs.graphs) == 2 and graphs.replays == 4  # the third kind stays eager


@cuda
def test_a_failed_capture_leaves_its_kind_eager_and_the_device_usable(monkeypatch):
    """A capture that reads a value back (a synchronisation, illegal while capturing) fails; the batch and every later
    one of its kind run eagerly, with the right bytes, on the same stream."""
    dev = torch.device("cuda")
    scheme = resolve_scheme("NVFP4A16")

    def syncing(*a, **kw):
        res = quantize_batch(*a, **kw)
        float(res.amax.sum())  # a read-back
        return res

    monkeypatch.setattr(graphs_mod, "quantize_batch", syncing)
    g = torch.Generator().manual_seed(9)
    graphs = BatchGraphs(dev, "auto", zeros=False)
    with torch.inference_mode(), torch.cuda.stream(torch.cuda.Stream(dev)):
        for _ in range(3):
            units, infos, data = _batch(g, scheme, 2, 2, (64, 128), torch.bfloat16)
            assert graphs.run(units, infos, data) is None
            res, ok, _ = _eager(units, infos, data, scheme, dev)
            assert ok and torch.equal(res.amax.cpu(), data.view(torch.bfloat16).reshape(4, -1).float().abs().amax(dim=1))
    assert len(graphs.failed) == 1 and graphs.error is not None and not graphs.graphs


@cuda
def test_no_capture_while_the_warm_up_runs():
    dev = torch.device("cuda")
    ready = [False]
    graphs = BatchGraphs(dev, "auto", zeros=False, ready=lambda: ready[0])
    g = torch.Generator().manual_seed(6)
    scheme = resolve_scheme("NVFP4A16")
    with torch.inference_mode():
        runs = []
        for i in range(4):
            ready[0] = i >= 2
            runs.append(graphs.run(*_batch(g, scheme, 2, 2, (64, 128), torch.bfloat16)) is not None)
    assert runs == [False, False, True, True]


def test_the_key_is_what_fixes_the_device_work():
    nv, w4 = resolve_scheme("NVFP4A16"), resolve_scheme("W4A16")
    g = torch.Generator().manual_seed(7)
    k = graph_key(*_batch(g, nv, 3, 2, (64, 128), torch.bfloat16)[:2])
    assert k == graph_key(*_batch(g, nv, 3, 2, (64, 128), torch.bfloat16)[:2])  # other values, names: the same kind
    for other in (
        _batch(g, w4, 3, 2, (64, 128), torch.bfloat16),
        _batch(g, nv, 2, 2, (64, 128), torch.bfloat16),
        _batch(g, nv, 3, 1, (64, 128), torch.bfloat16),
        _batch(g, nv, 3, 2, (128, 64), torch.bfloat16),
        _batch(g, nv, 3, 2, (64, 128), torch.float16),
        _batch(g, nv, 3, 2, (64, 128), torch.bfloat16, fused=True),
    ):
        assert graph_key(*other[:2]) != k


def test_graphs_are_on_unless_the_environment_says_0_and_never_on_a_cpu(monkeypatch, tmp_path):
    monkeypatch.delenv("CTCONVERT_GRAPHS", raising=False)
    assert graphs_default()
    monkeypatch.setenv("CTCONVERT_GRAPHS", "0")
    assert not graphs_default()
    monkeypatch.setenv("CTCONVERT_GRAPHS", "1")
    made = []
    monkeypatch.setattr(executor_mod, "BatchGraphs", lambda *a, **kw: made.append(a) or graphs_mod.BatchGraphs(*a, **kw))
    from test_batches import _moe

    api.quantize(_moe(tmp_path), tmp_path / "o", "NVFP4A16", device="cpu")
    assert made == []


def test_a_replays_zero_row_candidates_are_examined_as_the_eager_batchs(monkeypatch):
    """ZeroTracker.observe_mask (a replay's candidates, kept until the run ends) finds what observe_stacked finds."""
    from ctconvert.checkpoint.safetensors_io import TensorInfo

    scheme = resolve_scheme("NVFP4A16")
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(2, 32, 64, generator=g) * 0.01).to(torch.bfloat16)
    w[1, 3:6] = (1e-30 * torch.randn(3, 64, generator=g)).to(torch.bfloat16)
    infos = [TensorInfo(f"m{j}.weight", None, "BF16", (32, 64), 0, 32 * 64 * 2) for j in range(2)]
    x = w.reshape(1, 2, 32, 64)
    units = [SimpleNamespace(scheme=scheme, modules=["m0", "m1"])]
    res = quantize_batch(units, [infos], x, "torch", check_now=True)
    eager = ZeroTracker()
    eager.observe_stacked(infos, w, res.scales, scheme, res.global_scales, res.set_amax)
    mask = stacked_candidates(res.scales, scheme.weight_format, scheme.weights, torch.bfloat16, 32)
    assert mask[1, 3:6].all() and not mask[0].any()
    kept = ZeroTracker()
    kept.observe_mask(infos, mask, scheme, res.global_scales, res.set_amax)
    assert not kept.found and len(kept.pending["cpu"]) == 2
    kept._examine = lambda info, idx, rows, *a: eager_rows.append((info.name, idx.tolist(), rows.shape))  # what resolve hands on
    eager_rows = []
    monkeypatch.setattr("ctconvert.pipeline.zeros.read_rows", lambda info, a, b: w[int(info.name[1])][a:b])  # the source rows
    kept.resolve(torch.device("cpu"))
    assert eager_rows == [("m1.weight", [3, 4, 5], (3, 64))]
    assert [z.zero_rows for z in eager.found.values()] == [3]


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16", "FP8_DYNAMIC"])
def test_a_conversion_with_graphs_is_the_bytes_of_one_without(tmp_path, monkeypatch, scheme, device):
    """Batches of two gate/up sets or four downs, so that each kind recurs and replays (the warm-up awaited first);
    on a CPU no graph is made and the outputs are the same too."""
    from test_batches import INTER, E, H, _moe, _tensors

    from ctconvert.pipeline import reads

    monkeypatch.setattr(reads, "BATCH_BYTES", 2 * 2 * INTER * H * 2)  # batches of two gate/up sets, or four downs: kinds recur

    def warm_done(self):
        while self.warm is not None and not self.warm.done:
            time.sleep(0.01)
        return True

    monkeypatch.setattr(executor_mod.Executor, "_warm_done", warm_done)
    replays = []
    run = graphs_mod.BatchGraphs.run

    def counted(self, *a):
        got = run(self, *a)
        replays.append(got is not None)
        return got

    monkeypatch.setattr(graphs_mod.BatchGraphs, "run", counted)
    src = _moe(tmp_path)
    monkeypatch.setenv("CTCONVERT_BATCH", "1")
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("CTCONVERT_GRAPHS", on)
        outs[on] = api.quantize(src, tmp_path / on, scheme, device=device)
    if device == "cuda":
        assert sum(replays) >= 2, replays
    else:
        assert replays == []
    ta, tb = _tensors(tmp_path / "0"), _tensors(tmp_path / "1")
    assert ta.keys() == tb.keys() and any(f".experts.{E - 1}.down_proj." in k for k in ta)
    for f in (tmp_path / "0").glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "1" / f.name).read_bytes(), f.name
    assert outs["0"].zero_quantized == outs["1"].zero_quantized
    if scheme == "NVFP4A16":
        assert any("experts.2.up_proj" in z["tensor"] for z in outs["1"].zero_quantized)
