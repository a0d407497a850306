"""The GPU warm-up: which chunk shapes it compiles (checked on any machine), and that it compiles them (CUDA)."""

from __future__ import annotations

import pytest
import torch

from ctconvert import api
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.pipeline.executor import ExecOptions, Executor, warm_up_shapes
from ctconvert.pipeline.reads import unit_order, warm_up_batches
from ctconvert.plan.planner import make_plan
from ctconvert.plan.schemes import Scheme

from conftest import moe_checkpoint


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16", "FP8_DYNAMIC"])
def test_one_shape_per_scheme_dtype_k_and_chunk_rows(tiny_llama, scheme):
    ckpt = open_checkpoint(tiny_llama, strict=True)
    plan = make_plan(ckpt, scheme)
    # tiny Llama: hidden 256, intermediate 512; a chunk of 64Ki elements holds 256 rows of K=256 and 128 of K=512
    got = [(info.name, info.shape[1], rows) for _, info, rows in warm_up_shapes(ckpt, plan, chunk_elems=64 * 1024)]
    # tiny Llama (hidden 256, intermediate 512, 2 KV heads of 64): 64Ki elements are 256 rows of K=256, 128 of K=512
    first = {}
    for u in plan.units:
        for n in u.sources if u.kind != "copy" else []:
            k, rows = ckpt.tensors[n].shape[1], ckpt.tensors[n].shape[0]
            first.setdefault((k, min(rows, 64 * 1024 // k)), n)
    assert {(k, r) for _, k, r in got} == set(first) == {(256, 256), (256, 128), (512, 128)}
    assert [n for n, _, _ in got] == sorted(first.values(), key=[n for u in plan.units for n in u.sources].index)  # plan order
    whole = [(info.shape[1], rows) for _, info, rows in warm_up_shapes(ckpt, plan)]  # default chunks: whole tensors
    expected = {(info.shape[1], info.shape[0]) for u in plan.units if u.kind != "copy" for info in (ckpt.tensors[n] for n in u.sources)}
    assert set(whole) == expected
    assert warm_up_shapes(ckpt, plan, limit=1) == warm_up_shapes(ckpt, plan)[:1]


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16", "FP8"])
def test_warm_up_batches_are_the_first_batch_launch_of_each_key(tmp_path, monkeypatch, scheme):
    """The batches' warm-up launches the rows a run's first batch of each key launches: the tall weights the executor
    quantizes (seen by a spy on ``Scheme.quantize_rows`` during a batched CPU run), first of each (K, member shape)."""
    src = moe_checkpoint(tmp_path, experts=6, inter=128)
    ckpt = open_checkpoint(src, strict=True)
    plan = make_plan(ckpt, scheme)
    opts = ExecOptions(device=torch.device("cpu"), batch=True)
    got = warm_up_batches(ckpt, plan, opts)
    if scheme == "FP8":  # a per-tensor weight scale: a batch's members are quantized one by one, no tall launch to warm up
        assert any(isinstance(u, tuple) for u in unit_order(ckpt, plan, opts)) and got == []
        return
    launches = []
    real = Scheme.quantize_rows

    def spy(self, w, global_scale=None, *a, **kw):
        launches.append((tuple(w.shape), None if global_scale is None else tuple(global_scale.shape)))
        return real(self, w, global_scale, *a, **kw)

    monkeypatch.setattr(Scheme, "quantize_rows", spy)
    monkeypatch.setenv("CTCONVERT_BATCH", "1")
    api.quantize(src, tmp_path / "out", scheme, device="cpu")
    # a batch launch: more rows than any source tensor has (every member is read whole, one tall weight per batch)
    most = max(i.shape[0] for i in ckpt.tensors.values() if len(i.shape) == 2)
    tall = [shape for shape, _ in launches if shape[0] > most]
    first: dict[int, tuple] = {}
    for rows, k in tall:
        first.setdefault(k, (rows, k))
    assert len(got) == len(first) >= 2  # gate/up sets and downs: two keys, K = hidden and K = intermediate
    assert sorted((rows, info.shape[1]) for _, info, rows in got) == sorted(first.values())
    if scheme == "NVFP4A16":  # one global scale per row of a batch: the per-row kernel
        assert all(gs == (rows, 1) for (rows, _), gs in launches if rows > most)
    assert warm_up_batches(ckpt, plan, ExecOptions(device=torch.device("cpu"), batch=False)) == []
    assert warm_up_batches(ckpt, plan, opts, limit=1) == got[:1]


def test_warm_up_batches_found_after_many_units_read_alone(tmp_path, monkeypatch):
    """Batches that start late in the plan (a vision tower or dense layers first, read alone) still get their warm-up:
    the look-out for new keys counts from the first batch, not from the plan's start; it stops 2 x BATCH_WINDOW units
    after the last new key."""
    from ctconvert.pipeline import reads

    src = moe_checkpoint(tmp_path, experts=96, inter=128)
    ckpt = open_checkpoint(src, strict=True)
    plan = make_plan(ckpt, "NVFP4A16")
    opts = ExecOptions(device=torch.device("cpu"), batch=True)
    order = list(unit_order(ckpt, plan, opts))
    late = 2 * reads.BATCH_WINDOW + 10
    assert any(isinstance(u, tuple) and u[0] > late for u in order)
    # the same run as if every unit before `late` were read alone
    monkeypatch.setattr(reads, "unit_order", lambda *a: iter([u for u in order if not isinstance(u, tuple) or u[0] > late]))
    got = warm_up_batches(ckpt, plan, opts)
    assert len(got) == 2 and all(rows > info.shape[0] for _, info, rows in got)
    # no batch after the first ones brings a new key: the look-out ends 2 x BATCH_WINDOW units after the last new one
    seen = []
    monkeypatch.setattr(reads, "batch_key", lambda c, u, o: seen.append(u) or ("k", len(u.sources)))
    warm_up_batches(ckpt, plan, opts)
    first = next(u[0] for u in order if isinstance(u, tuple) and u[0] > late)
    assert seen and all(plan.units.index(u) <= first + 3 * reads.BATCH_WINDOW for u in seen)


def test_no_warm_up_on_the_cpu(tiny_llama):
    ckpt = open_checkpoint(tiny_llama, strict=True)
    ex = Executor(ckpt, make_plan(ckpt, "W4A16"), {}, ExecOptions(device=torch.device("cpu")))
    assert ex._warm_up() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_warm_up_compiles_the_quantize_kernels(tiny_llama):
    ckpt = open_checkpoint(tiny_llama, strict=True)
    for scheme in ("NVFP4A16", "W4A16", "FP8_DYNAMIC"):
        plan = make_plan(ckpt, scheme)
        ex = Executor(ckpt, plan, {}, ExecOptions(device=torch.device("cuda")))
        ex._warm_up().join()
        assert ex.warm.error is None and ex.warm.warmed == len(warm_up_batches(ckpt, plan, ex.opts)) + len(warm_up_shapes(ckpt, plan)) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("batch", [False, True])
def test_warm_up_also_compiles_the_batches_per_row_kernel(tiny_llama, monkeypatch, batch):
    seen = []
    real = Scheme.quantize_rows

    def spy(self, w, global_scale=None, *a, **kw):
        seen.append(None if global_scale is None else tuple(global_scale.shape))
        return real(self, w, global_scale, *a, **kw)

    monkeypatch.setattr(Scheme, "quantize_rows", spy)
    ckpt = open_checkpoint(tiny_llama, strict=True)
    plan = make_plan(ckpt, "NVFP4A16")
    ex = Executor(ckpt, plan, {}, ExecOptions(device=torch.device("cuda"), batch=batch))
    ex._warm_up().join()
    assert ex.warm.error is None and (1,) in seen
    per_row = [s[0] for s in seen if s is not None and len(s) == 2 and s[0] >= 2 and s[1] == 1]
    assert per_row == [rows for _, _, rows in warm_up_batches(ckpt, plan, ex.opts)]  # the batches' own rows
    assert bool(per_row) == batch


def test_an_executor_adopts_the_warm_up_begun_ahead_on_its_own_device_only(monkeypatch):
    import torch

    from ctconvert.pipeline.warm import WarmUp

    started = []

    def fake_start(self):
        started.append(self)
        self.thread = f"thread of {self.dev}"
        return self.thread

    monkeypatch.setattr(WarmUp, "start", fake_start)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    ahead = WarmUp("ckpt", "whole plan", "opts", cuda0)
    assert WarmUp.adopt_or_start(ahead, "ckpt", "plan", "opts", cuda0) is not ahead  # never started: a new one
    ahead.start()
    started.clear()
    assert WarmUp.adopt_or_start(ahead, "ckpt", "plan", "opts", cuda0) is ahead and started == []
    other = WarmUp.adopt_or_start(ahead, "ckpt", "part", "opts", cuda1)  # another device's executor makes its own
    assert other is not ahead and started == [other] and other.dev == cuda1 and other.plan == "part"
    fresh = WarmUp.adopt_or_start(None, "ckpt", "plan", "opts", cuda0)
    assert started == [other, fresh] and fresh.thread == "thread of cuda:0"
