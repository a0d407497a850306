"""pipeline/calibrated.py: calibrated tensors written at once when known, else later (by name, with their values)."""

from __future__ import annotations

import threading

import pytest
import torch

from ctconvert.calibration.feed import CalibratedFeed
from ctconvert.pipeline.calibrated import CalibratedWrites


def _parts(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_global_scale": torch.rand(1, generator=g), "input_scale": torch.rand(1, generator=g)}


def test_a_plain_mapping_is_answered_at_once_and_nothing_waits():
    parts = _parts(0)
    w = CalibratedWrites({"a": parts}, defer=True)
    assert w.now("a") is parts and w.now("b") == {} and not w.pending and "a" in w and "b" not in w


def test_a_module_not_ready_is_written_later_with_its_names_and_values():
    feed = CalibratedFeed({"m.q", "m.attn", "m.k"})
    w = CalibratedWrites(feed, defer=True)
    q, attn = _parts(1), {"k_scale": torch.tensor([0.5]), "v_scale": torch.tensor([0.25])}
    assert w.now("m.q") == {} and w.now("m.attn", {"k_scale": "m.attn.k_scale"}) == {} and w.now("other") == {}
    assert len(w.pending) == 2
    written: dict[str, torch.Tensor] = {}
    w.flush(written.__setitem__, wait=False)
    assert written == {} and len(w.pending) == 2  # nothing given yet
    feed.put("m.q", q)
    w.flush(written.__setitem__, wait=False)
    assert set(written) == {"m.q.input_global_scale", "m.q.input_scale"} and len(w.pending) == 1
    assert all(torch.equal(written[f"m.q.{k}"], v) for k, v in q.items())
    threading.Timer(0.2, feed.put, args=("m.attn", attn)).start()
    w.flush(written.__setitem__, wait=True)  # waits for the attention module; only the part it named
    assert torch.equal(written["m.attn.k_scale"], attn["k_scale"]) and "m.attn.v_scale" not in written and not w.pending


def test_without_defer_a_feed_is_waited_for_and_a_failure_is_raised():
    feed = CalibratedFeed({"m.q"})
    parts = _parts(2)
    threading.Timer(0.2, feed.put, args=("m.q", parts)).start()
    assert CalibratedWrites(feed, defer=False).now("m.q") is parts
    failing = CalibratedFeed({"m.k"})
    w = CalibratedWrites(failing, defer=True)
    assert w.now("m.k") == {}
    failing.fail(RuntimeError("layer 3 failed"))
    with pytest.raises(RuntimeError, match="layer 3 failed"):
        w.flush(lambda name, t: None, wait=False)
