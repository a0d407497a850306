"""Calibration beside the write stage: the feed's waiting and errors, the background thread's result, error and
cancellation; calibration puts each module's tensors as its layer finishes, with the values the whole pass gives;
the output of a run with calibration beside the write stage is byte for byte the output of the run in line."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import warnings

import pytest
import torch

from ctconvert import api
from ctconvert.calibration import apply
from ctconvert.calibration.feed import BackgroundCalibration, CalibratedFeed, Cancelled
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError, OutputError
from ctconvert.plan.planner import make_plan
from ctconvert.stages.calibrate import CalibrateStage

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint
from helpers import randomized

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")


def _later(fn, delay: float = 0.2) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), fn()))
    t.start()
    return t


def test_feed_waits_for_an_expected_module_and_answers_others_at_once():
    feed = CalibratedFeed({"a", "b"})
    assert feed and len(feed) == 2 and "a" in feed and "c" not in feed and list(feed) == ["a", "b"]
    assert feed.get("c", {}) == {} and not CalibratedFeed(set())  # not expected: at once, as an empty dict's get
    with pytest.raises(KeyError):
        feed["c"]
    t0 = time.perf_counter()
    th = _later(lambda: feed.put("a", {"input_global_scale": torch.tensor([2.0])}))
    got = feed.get("a", {})
    assert time.perf_counter() - t0 >= 0.15 and torch.equal(got["input_global_scale"], torch.tensor([2.0]))
    assert torch.equal(feed["a"]["input_global_scale"], torch.tensor([2.0]))  # once given, at once
    th.join()


def test_feed_failure_reaches_every_waiting_reader():
    feed = CalibratedFeed({"a", "b"})
    feed.put("a", {"x": torch.zeros(1)})
    err = BadInputError("calibration: the inputs of m are not finite")
    th = _later(lambda: feed.fail(err))
    with pytest.raises(BadInputError, match="not finite"):
        feed.get("b", {})
    th.join()
    assert torch.equal(feed["a"]["x"], torch.zeros(1))  # what was given stays readable
    with pytest.raises(BadInputError):
        feed["b"]


def test_background_result_error_and_cancel():
    ok = BackgroundCalibration(CalibratedFeed(set()), lambda feed, check: 42)
    assert ok.result() == 42

    bad = BackgroundCalibration(CalibratedFeed({"m"}), lambda feed, check: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    with pytest.raises(ZeroDivisionError):
        bad.feed.get("m")  # a reader of the feed gets the same error

    layers = []

    def slow(feed, check):
        for i in range(1000):
            check()
            layers.append(i)
            time.sleep(0.01)
        return "done"

    bg = BackgroundCalibration(CalibratedFeed({"m"}), slow)
    time.sleep(0.05)
    bg.cancel()
    n = len(layers)
    assert 0 < n < 1000 and not any(t.name == "ctconvert-calibrate" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(Cancelled):
        bg.feed.get("m")
    time.sleep(0.05)
    assert len(layers) == n  # stopped for good


def _moe(path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=384,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=1,
    )
    randomized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("feed")
    if request.param == "llama":
        return write_checkpoint(root / "m", llama_tensors(LLAMA_CONFIG, seed=5), LLAMA_CONFIG)
    return _moe(root / "m")  # 8 experts, top-1, 6 tokens: most experts see no token (their range is their layer's)


def _layer(module: str) -> int:
    return int(module.split(".layers.")[1].split(".")[0])


@pytest.mark.parametrize("scheme,kv", [("NVFP4", "none"), ("FP8", "fp8"), ("INT8_STATIC_ASYM", "fp8-head")])
def test_each_module_is_put_once_its_layer_ran_with_the_whole_pass_values(model, scheme, kv):
    ckpt = open_checkpoint(model)
    plan = make_plan(ckpt, scheme, allow_unloadable=True)  # static INT8 MoE experts too (vLLM 0.33 cannot load them)
    apply.add_outputs(plan, ckpt, kv)
    tokens = torch.randint(0, 300, (2, 3), generator=torch.Generator().manual_seed(1))
    events, feed = [], CalibratedFeed(apply.calibrated_modules(plan, kv))
    real_put = feed.put
    feed.put = lambda m, parts: (events.append(("put", m, parts)), real_put(m, parts))
    done = apply.run(plan, ckpt, tokens, torch.device("cpu"), kv, progress=lambda i, n: events.append(("layer", i, None)), feed=feed)
    expected = apply.calibrated_modules(plan, kv)
    assert expected and set(done.tensors) == expected
    first = {}
    for pos, (kind, what, parts) in enumerate(events):
        if kind == "put":
            first.setdefault(what, (pos, parts))
    assert set(first) == expected  # every module put
    layer_end = {i - 1: pos for pos, (kind, i, _) in enumerate(events) if kind == "layer"}  # layer i's progress event
    for m, (pos, parts) in first.items():
        assert pos < layer_end[_layer(m)], m  # put before its layer's progress: as soon as its layer ran
        assert parts.keys() == done.tensors[m].keys()
        for k, t in parts.items():
            assert t.dtype == done.tensors[m][k].dtype and torch.equal(t, done.tensors[m][k]), (m, k)
    fallback = [n for n in done.notes if "no calibration token was routed" in n]
    if "qwen3" in str(ckpt.config.get("model_type")):
        assert fallback  # the experts no token reached were put too, with their layer's range


def test_a_failing_layer_puts_nothing_of_it_and_the_run_raises(tmp_path):
    t = llama_tensors(LLAMA_CONFIG)
    t["model.layers.1.post_attention_layernorm.weight"][3] = float("nan")
    src = write_checkpoint(tmp_path / "m", t, LLAMA_CONFIG)
    ckpt = open_checkpoint(src)
    plan = make_plan(ckpt, "NVFP4")
    apply.add_outputs(plan, ckpt)
    feed = CalibratedFeed(apply.calibrated_modules(plan))
    put = []
    real_put = feed.put
    feed.put = lambda m, parts: (put.append(m), real_put(m, parts))
    with pytest.raises(BadInputError, match=r"model\.layers\.1\.mlp\.\S+ are not finite"):
        apply.run(plan, ckpt, torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(1)), torch.device("cpu"), feed=feed)
    assert put and all(_layer(m) == 0 or "self_attn" in m and _layer(m) == 1 for m in put)  # layer 0 (and layer 1's attention)
    assert not any(".layers.1.mlp." in m for m in put)


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.name != "ctconvert-provenance.json"}


@pytest.mark.parametrize("scheme,kv", [("NVFP4", "none"), ("FP8", "fp8-head")])
def test_beside_the_write_stage_writes_the_in_line_bytes(model, tmp_path, monkeypatch, scheme, kv):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % 300 for i in range(96)]))
    kw = dict(calibration=ids, calibration_samples=2, calibration_seq_len=48, kv_cache=kv, max_shard_size="200KB")
    beside = api.quantize(model, tmp_path / "beside", scheme, **kw)
    monkeypatch.setattr(CalibrateStage, "_beside", lambda self, job: False)
    in_line = api.quantize(model, tmp_path / "inline", scheme, **kw)
    assert _digests(tmp_path / "beside") == _digests(tmp_path / "inline") and len(beside.shards) == len(in_line.shards)
    assert beside.notes == in_line.notes and beside.calibration["layers"] == in_line.calibration["layers"]
    assert beside.calibration["seconds"] > 0


def _calibrating() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ctconvert-calibrate" and t.is_alive()]


@pytest.mark.parametrize("error", [KeyboardInterrupt, OutputError])
def test_a_failed_or_interrupted_write_stops_the_calibration_thread(model, tmp_path, monkeypatch, error):
    """A failed write waits for the calibration thread to stop (at its next layer); a stopped run (Ctrl-C, SIGTERM)
    does not wait for it, and it stops by itself at its next layer."""
    from ctconvert.stages import write

    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % 300 for i in range(96)]))
    from ctconvert.calibration.model import CalibrationModel

    ran, gate = [], threading.Event()
    real_init, real_cancel, real_layer = BackgroundCalibration.__init__, BackgroundCalibration.cancel, CalibrationModel.run_layer

    def init(self, feed, work):  # the thread starts its work only once the run has cancelled it
        real_init(self, feed, lambda feed, check: (gate.wait(timeout=60), work(feed, check))[1])

    def cancel(self, wait=True):
        self._stop.set()
        gate.set()
        real_cancel(self, wait)

    monkeypatch.setattr(BackgroundCalibration, "__init__", init)
    monkeypatch.setattr(BackgroundCalibration, "cancel", cancel)
    monkeypatch.setattr(CalibrationModel, "run_layer", lambda self, *a: (ran.append(1), real_layer(self, *a))[1])

    def failing(*a, **k):
        raise error("disk gone") if error is OutputError else error

    monkeypatch.setattr(write, "_execute", failing)
    with pytest.raises(error):
        api.quantize(model, tmp_path / "q", "NVFP4", calibration=ids, calibration_samples=2, calibration_seq_len=48)
    if error is OutputError:
        assert not _calibrating()  # waited for
    for t in _calibrating():
        t.join(timeout=120)
    assert not _calibrating()
    assert ran == []  # stopped at its first check, before any layer ran
    assert not (tmp_path / "q").exists()


def test_the_write_stage_writes_every_weight_before_it_waits_for_calibration(model, tmp_path, monkeypatch):
    """Calibration held before its first layer: the executor still writes every tensor that is not calibrated (the
    calibrated ones are written later, at their planned offsets), and only then waits; the bytes are the in-line run's."""
    from ctconvert.pipeline import executor

    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % 300 for i in range(96)]))
    kw = dict(calibration=ids, calibration_samples=2, calibration_seq_len=48, max_shard_size="200KB")
    written, at_wait, release = [], [], threading.Event()
    real_write, real_wait, real_init = executor.Executor._write_many, CalibratedFeed._wait, BackgroundCalibration.__init__

    def write(self, writes, *a, **kw):  # what the executor hands its writers (they write it a little later)
        written.extend(name for name, _, _ in writes)
        return real_write(self, writes, *a, **kw)

    def wait(self, module):
        if module in self.expected and not self.ready(module) and not at_wait:
            at_wait.append(set(written))
            release.set()
        return real_wait(self, module)

    def init(self, feed, work):  # the calibration pass starts only once the write stage waits for it
        real_init(self, feed, lambda feed, check: (release.wait(60), work(feed, check))[1])

    monkeypatch.setattr(executor.Executor, "_write_many", write)
    monkeypatch.setattr(CalibratedFeed, "_wait", wait)
    monkeypatch.setattr(BackgroundCalibration, "__init__", init)
    r = api.quantize(model, tmp_path / "beside", "NVFP4", **kw)
    planned = {n for f in (tmp_path / "beside").glob("*.safetensors") for n in json.loads(f.read_bytes()[8 : 8 + int.from_bytes(f.read_bytes()[:8], "little")])}
    calibrated = {n for n in planned if n.endswith("input_global_scale")}
    assert r.shards and calibrated and at_wait
    assert at_wait[0] >= {n for n in planned - calibrated if n.endswith("weight_packed")}  # every weight written before the wait
    assert not at_wait[0] & calibrated
    monkeypatch.setattr(CalibrateStage, "_beside", lambda self, job: False)
    api.quantize(model, tmp_path / "inline", "NVFP4", **kw)
    assert _digests(tmp_path / "beside") == _digests(tmp_path / "inline")
