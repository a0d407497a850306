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
    monkeypatch.setattr(devices, "resolve_devices", lambda spec: [torch.device(device, 0) if device == "cuda" else torch.device("cpu")])
    monkeypatch.setattr(quantize_stage, "begin_contexts", lambda devs: calls.append([str(d) for d in devs]))
    monkeypatch.setattr(quantize_stage.triton_key, "begin", lambda: None)
    stage = quantize_stage.QuantizeStage(QuantizeOptions(device=device, executor=executor, dry_run=dry_run))
    assert [str(d) for d in stage.devices] == (["cuda:0"] if device == "cuda" else ["cpu"])  # (joins the thread)
    assert calls == ([["cuda:0"]] if begun else [])


def test_devices_are_resolved_on_a_thread_and_its_error_raised_where_they_are_asked_for(monkeypatch):
    """DevicesAhead: resolve_devices on a thread (cpu at once, no thread), then ``then``; result() joins and raises
    what resolving raised (a UsageError naming the device); an error of ``then`` is dropped."""
    import threading

    from ctconvert.errors import UsageError

    seen = []
    cpu = devices.DevicesAhead("cpu", then=lambda devs: seen.append((threading.current_thread().name, devs)))
    assert cpu._thread is None and seen == [(threading.main_thread().name, [torch.device("cpu")])] and cpu.result() == [torch.device("cpu")]
    gate = threading.Event()

    def slow(spec):
        gate.wait(10)
        return [torch.device("cuda", 1)]

    monkeypatch.setattr(devices, "resolve_devices", slow)
    ahead = devices.DevicesAhead("cuda:1", then=lambda devs: seen.append((threading.current_thread().name, devs)))
    assert ahead._thread.is_alive() and len(seen) == 1  # the caller goes on meanwhile
    gate.set()
    assert ahead.result() == [torch.device("cuda", 1)] and seen[1] == ("ctconvert-devices", [torch.device("cuda", 1)])

    def boom(devs):
        raise RuntimeError("no context")

    assert devices.DevicesAhead("cuda:1", then=boom).result() == [torch.device("cuda", 1)]
    monkeypatch.undo()
    bad = devices.DevicesAhead("tpu:0")
    with pytest.raises(UsageError, match="tpu:0"):
        bad.result()
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            devices.DevicesAhead("cuda").result()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_thread_opens_the_context_of_each_device():
    devs = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    t = devices.begin_contexts(devs)
    t.join(60)
    assert not t.is_alive() and torch.cuda.is_initialized()
    assert torch.cuda.Stream(devs[0]) is not None  # the executor's first call, after it
