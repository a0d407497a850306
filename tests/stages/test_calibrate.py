"""The calibrate stage says when calibration options are given to a plan that needs no calibration (never a silent
ignore), and stays silent when none is given."""

from __future__ import annotations

import json

import pytest

from ctconvert import api

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cn") / "m", llama_tensors(LLAMA_CONFIG, seed=2), LLAMA_CONFIG)


@pytest.mark.parametrize("dry_run", [False, True])
def test_calibration_options_on_a_data_free_plan_are_named_in_a_note(llama, tmp_path, dry_run):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(64))))
    r = api.quantize(llama, tmp_path / "q", "W4A16", calibration=ids, calibration_samples=100, dry_run=dry_run)
    said = [n for n in r.notes if "not used" in n]
    assert said == ["--calibration and --calibration-samples not used: this plan needs no calibration (weights and dynamic activation scales only)"]
    assert not any(n.startswith("no calibration needed") for n in r.notes)
    plain = api.quantize(llama, tmp_path / "p", "W4A16", dry_run=dry_run)
    assert not any("not used" in n for n in plain.notes)


@pytest.mark.parametrize("scheme,observer", [("NVFP4", None), ("W4A16", "imatrix_mse")])
def test_model_seconds_is_what_building_the_model_took(llama, tmp_path, monkeypatch, scheme, observer):
    """``calibration.model_seconds``: the build's own time (at plan time), for a calibration in line (the imatrix
    observer) and one beside the write stage."""
    import time

    from ctconvert.calibration import apply

    real = apply.build_model
    monkeypatch.setattr(apply, "build_model", lambda ckpt: (time.sleep(0.4), real(ckpt))[1])
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % 300 for i in range(96)]))
    kw = dict(calibration=ids, calibration_samples=2, calibration_seq_len=48, **({"observer": observer} if observer else {}))
    cal = api.quantize(llama, tmp_path / "o", scheme, **kw).calibration
    assert 0.4 <= cal["model_seconds"] < 30 and cal["seconds"] > 0
