"""The GPU warm-up: which chunk shapes it compiles (checked on any machine), and that it compiles them (CUDA)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.pipeline.executor import ExecOptions, Executor, warm_up_shapes
from ctconvert.plan.planner import make_plan


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
        assert ex.warm_error is None and ex.warmed == len(warm_up_shapes(ckpt, plan)) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("batch", [False, True])
def test_warm_up_also_compiles_the_batches_per_row_kernel(tiny_llama, monkeypatch, batch):
    from ctconvert.plan.schemes import Scheme

    seen = []
    real = Scheme.quantize_rows

    def spy(self, w, global_scale=None, *a, **kw):
        seen.append(None if global_scale is None else tuple(global_scale.shape))
        return real(self, w, global_scale, *a, **kw)

    monkeypatch.setattr(Scheme, "quantize_rows", spy)
    ckpt = open_checkpoint(tiny_llama, strict=True)
    ex = Executor(ckpt, make_plan(ckpt, "NVFP4A16"), {}, ExecOptions(device=torch.device("cuda"), batch=batch))
    ex._warm_up().join()
    assert ex.warm_error is None and (1,) in seen
    assert any(s is not None and len(s) == 2 and s[0] >= 2 and s[1] == 1 for s in seen) == batch
