"""CUDA's driver initialised ahead through ctypes (pipeline/driver.py): which devices a --device names, and that the
thread never raises (no driver library on a CPU machine; a failing call is torch's to report)."""

import ctypes

import pytest

from ctconvert.pipeline import driver


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("auto", [0]),
        (None, [0]),
        ("cuda", [0]),
        ("CUDA:3", [3]),
        ("cuda:0,1", [0, 1]),
        ("cuda:1,cuda:1", [1]),
        ("2", []),  # a bare ordinal alone is no device (resolve_devices refuses it)
        ("0,2", [0, 2]),
        ("all", None),
        ("cpu", []),
        ("tpu", []),
    ],
)
def test_ordinals_follow_the_device_grammar(spec, want):
    assert driver.ordinals(spec) == want


def test_device_spec_reads_both_spellings_and_the_last_one():
    assert driver.device_spec(["quantize", "m", "-o", "o"]) == "auto"
    assert driver.device_spec(["quantize", "m", "--device", "cuda:1"]) == "cuda:1"
    assert driver.device_spec(["quantize", "--device=cpu", "m"]) == "cpu"
    assert driver.device_spec(["quantize", "--device", "cpu", "--device=cuda"]) == "cuda"
    assert driver.device_spec(["quantize", "--device"]) == "auto"  # no value: the parse refuses it later


def test_init_calls_the_driver_for_each_device_and_stops_at_a_failure(monkeypatch):
    calls = []

    class FakeCuda:
        def __init__(self, init_rc=0):
            self.init_rc = init_rc

        def cuInit(self, flags):
            calls.append(("init", flags))
            return self.init_rc

        def cuDeviceGetCount(self, ref):
            ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents.value = 2
            return 0

        def cuDeviceGet(self, ref, n):
            calls.append(("get", n))
            return 0

        def cuDevicePrimaryCtxRetain(self, ref, dev):
            calls.append(("retain",))
            return 0

    monkeypatch.setattr(driver.ctypes, "CDLL", lambda name: FakeCuda())
    driver._init([1])
    assert calls == [("init", 0), ("get", 1), ("retain",)]
    calls.clear()
    driver._init(None)  # all: the driver's count
    assert calls == [("init", 0), ("get", 0), ("retain",), ("get", 1), ("retain",)]
    calls.clear()
    monkeypatch.setattr(driver.ctypes, "CDLL", lambda name: FakeCuda(init_rc=100))  # CUDA_ERROR_NO_DEVICE
    driver._init([0])
    assert calls == [("init", 0)]


def test_init_without_a_driver_library_is_quiet(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver.ctypes, "CDLL", missing)
    driver._init([0])  # no exception: torch reports a missing driver where it matters


def test_begin_names_no_thread_for_the_cpu():
    assert driver.begin("cpu") is None


@pytest.mark.parametrize("contexts", [True, False])
def test_devices_ahead_makes_the_driver_contexts_first_only_for_a_run_that_computes_here(monkeypatch, contexts):
    from ctconvert.pipeline import devices

    asked = []
    monkeypatch.setattr(devices.driver, "begin", lambda spec: asked.append(spec))
    got = devices.DevicesAhead("auto", contexts=contexts).result()
    assert got and got[0].type in ("cpu", "cuda")
    assert asked == (["auto"] if contexts else [])
    assert devices.DevicesAhead("cpu", contexts=contexts).result()[0].type == "cpu"
    assert asked == (["auto", "cpu"] if contexts else [])  # cpu: begin() itself names no thread for it
