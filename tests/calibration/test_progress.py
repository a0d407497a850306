"""Calibration shows its progress (decoder layer i of N, and the tokens) through the progress factory the CLI gives
on a terminal (tqdm on stderr); none with -q, --json or a pipe, and an API factory that takes only the byte total
still works."""

from __future__ import annotations

import sys
import warnings

import pytest

from ctconvert import api

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint
from helpers import RecordingBar

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def llama_ids(tmp_path_factory):
    root = tmp_path_factory.mktemp("prog")
    ids = root / "ids.txt"
    ids.write_text(" ".join(str(i % 250) for i in range(256)))
    return write_checkpoint(root / "m", llama_tensors(LLAMA_CONFIG, seed=3), LLAMA_CONFIG), ids


def test_calibration_reports_each_decoder_layer(llama_ids, tmp_path):
    src, ids = llama_ids
    bars = []

    def factory(total, unit="B", desc="quantize"):
        bars.append((total, unit, desc, []))
        return RecordingBar(bars[-1][3])

    r = api.quantize(src, tmp_path / "q", "NVFP4", calibration=ids, calibration_samples=2, calibration_seq_len=64, progress=factory)
    layers = LLAMA_CONFIG["num_hidden_layers"]
    by_unit = {u: (t, d, steps) for t, u, d, steps in bars}
    assert len(bars) == 2 and set(by_unit) == {"layer", "B"}  # calibration's bar and the conversion's (open at once)
    assert by_unit["layer"][:2] == (layers, "calibrate (2 x 64 tokens)")
    assert by_unit["layer"][2] == [1] * layers  # one step per decoder layer, each after it ran
    assert sum(by_unit["B"][2]) == by_unit["B"][0]  # the conversion's bytes
    assert r.calibration["layers"] == layers


def test_a_byte_total_factory_still_works_on_a_calibrated_run(llama_ids, tmp_path):
    src, ids = llama_ids
    totals, log = [], []
    bytes_only = lambda total: totals.append(total) or RecordingBar(log)  # noqa: E731 - the API's documented (total_bytes) form
    api.quantize(src, tmp_path / "q", "FP8", calibration=ids, calibration_samples=2, calibration_seq_len=64, progress=bytes_only)
    assert len(totals) == 1 and sum(log) == totals[0]


def test_cli_bar_shows_layers_on_a_terminal(monkeypatch, capsys):
    from ctconvert.cli import _Ctx, _progress_factory

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    factory = _progress_factory(_Ctx(False, False, False))
    with factory(3, unit="layer", desc="calibrate (8 x 256 tokens)") as bar:
        for _ in range(3):
            bar.update(1)
    err = capsys.readouterr().err
    assert "calibrate (8 x 256 tokens)" in err and "3/3" in err and "layer" in err
    assert _progress_factory(_Ctx(False, False, True)) is None and _progress_factory(_Ctx(True, False, False)) is None  # --json, -q
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert _progress_factory(_Ctx(False, False, False)) is None  # a pipe
