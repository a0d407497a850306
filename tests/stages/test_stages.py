"""The rules each stage holds (sparsity, --lm-head, --refresh, --target with --resume) and what each adds to a
dry run, on the tiny Llama: each stage is prepared after the ones before it, as run_stages does."""

from __future__ import annotations

import pytest
import xxhash

from ctconvert.errors import UsageError
from ctconvert.pipeline.options import QuantizeOptions
from ctconvert.stages.calibrate import CalibrateStage
from ctconvert.stages.job import QuantizeJob
from ctconvert.stages.plan import PlanStage
from ctconvert.stages.quantize import QuantizeStage
from ctconvert.stages.source import SourceStage
from ctconvert.stages.target import TargetStage
from ctconvert.stages.write import WriteStage


def _planned(src, scheme: str, out=None, **kw) -> tuple[QuantizeJob, QuantizeOptions]:
    o = QuantizeOptions(device="cpu", **kw)
    job = QuantizeJob(src, out, o)
    for stage in (SourceStage(), PlanStage(scheme, o), QuantizeStage(o)):
        stage.prepare(job)
    return job, o


def test_sparsity_takes_the_presets_as_they_are(tiny_llama):
    with pytest.raises(UsageError, match="cannot be combined with --sparsity"):
        PlanStage("W8A8", QuantizeOptions(sparsity="2:4", group_size=64))
    o = QuantizeOptions(sparsity="2:4", lm_head="fp8")
    job = QuantizeJob(tiny_llama, None, o)
    SourceStage().prepare(job)
    with pytest.raises(UsageError, match="--lm-head cannot be combined with --sparsity"):
        PlanStage("W8A8", o).prepare(job)


def test_the_plan_starts_the_result(tiny_llama):
    job, _ = _planned(tiny_llama, "W4A16", dry_run=True)
    assert job.result.plan is job.plan and job.result.notes is job.plan.notes
    assert job.result.device == "cpu" and job.result.parallel is not None  # a dry run plans the tensor-parallel split


def test_data_free_schemes_need_no_calibration(tiny_llama):
    job, o = _planned(tiny_llama, "W4A16", dry_run=True)
    stage = CalibrateStage(o)
    stage.prepare(job)
    assert not job.calibrated and job.fingerprint == {} and job.refresh_refused is None and job.kv_cache_scheme is None
    stage.report(job)
    assert job.result.notes[-1] == "no calibration needed (weights and dynamic activation scales only)"
    stage.run(job)  # nothing to do
    assert job.calibration is None


def test_calibrated_scales_cannot_be_refreshed(tiny_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job, o = _planned(tiny_llama, "FP8", out, refresh=True, kv_cache="fp8")
    CalibrateStage(o).prepare(job)
    assert job.calibrated and job.fingerprint["calibration"] == ["", o.calibration_samples, o.calibration_seq_len, "fp8"]
    assert job.kv_cache_scheme is not None and job.result.calibration["layers"] == 2
    with pytest.raises(UsageError, match="--refresh cannot update calibrated activation scales"):
        WriteStage(o).prepare(job)


def test_the_calibration_files_bytes_are_in_the_fingerprint(tiny_llama, tmp_path):
    """--resume and --refresh compare fingerprints: the same file name holding other text is another run."""
    data = tmp_path / "cal.txt"
    prints = []
    for text in ("The first text. " * 50, "Another text, same name. " * 50):
        data.write_text(text)
        job, o = _planned(tiny_llama, "FP8", dry_run=True, calibration=str(data))
        CalibrateStage(o).prepare(job)
        prints.append(job.fingerprint["calibration"])
        assert prints[-1][:4] == [str(data), o.calibration_samples, o.calibration_seq_len, "none"]
    one_block = xxhash.xxh3_128(("The first text. " * 50).encode()).digest()  # the file is one hash block
    assert prints[0][-1] == xxhash.xxh3_128(one_block).hexdigest()
    assert prints[0][-1] != prints[1][-1]


def test_refresh_of_no_earlier_output_converts_in_full(tiny_llama, tmp_path):
    out = tmp_path / "new"
    job, o = _planned(tiny_llama, "W4A16", out, refresh=True)
    job.refresh_refused = "not reached: nothing to refresh"
    WriteStage(o).prepare(job)
    assert job.created and not job.refresh and job.old_prov is None
    assert job.result.notes[-1] == f"--refresh: no earlier output at {out}; converted in full"
    assert list(job.fingerprint)[:2] == ["scheme", "lm_head"] and job.fingerprint["scheme"] == "W4A16"


def test_an_output_is_required(tiny_llama):
    job, o = _planned(tiny_llama, "W4A16")
    with pytest.raises(UsageError, match="an output folder is required"):
        WriteStage(o).prepare(job)


def test_target_refuses_resume_and_names_the_layout(tiny_llama):
    job, o = _planned(tiny_llama, "W4A16", target="marlin", resume=True)
    stage = TargetStage(o)
    stage.prepare(job)
    assert job.layout is stage.layout
    with pytest.raises(UsageError, match="--target cannot be combined with --resume or --refresh"):
        stage.run(job)
    stage.finish(job)
    assert job.result.format == "kernel-native (marlin, from pack-quantized)"
