"""begin_contexts: the CUDA contexts opened on a thread while the run plans; the quantize stage begins it for a local
run on CUDA devices only (not a dry run, a CPU run or a Ray driver)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.pipeline import devices
from ctconvert.pipeline.options import QuantizeOptions
from ctconvert.stages import quantize as quantize_stage


def test_no_thread_without_a_cuda_device():
    assert devices.begin_contexts([torch.device("cpu")]) is None
    assert devices.begin_contexts([]) is None


CASES = [("cuda", "local", False, True), ("cuda", "ray", False, False), ("cuda", "local", True, False), ("cpu", "local", False, False)]


@pytest.mark.parametrize("device,executor,dry_run,begun", CASES)
def test_the_quantize_stage_begins_it_for_a_local_run_on_cuda(monkeypatch, device, executor, dry_run, begun):
    calls = []
    monkeypatch.setattr(quantize_stage, "resolve_devices", lambda spec: [torch.device(device, 0) if device == "cuda" else torch.device("cpu")])
    monkeypatch.setattr(quantize_stage, "begin_contexts", lambda devs: calls.append([str(d) for d in devs]))
    monkeypatch.setattr(quantize_stage.triton_key, "begin", lambda: None)
    quantize_stage.QuantizeStage(QuantizeOptions(device=device, executor=executor, dry_run=dry_run))
    assert calls == ([["cuda:0"]] if begun else [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_thread_opens_the_context_of_each_device():
    devs = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    t = devices.begin_contexts(devs)
    t.join(60)
    assert not t.is_alive() and torch.cuda.is_initialized()
    assert torch.cuda.Stream(devs[0]) is not None  # the executor's first call, after it
