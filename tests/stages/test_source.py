"""The source stage: opens a path, or takes an opened Source as it is."""

from __future__ import annotations

import pytest

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError
from ctconvert.pipeline.options import QuantizeOptions
from ctconvert.sources import open_source
from ctconvert.stages.job import QuantizeJob
from ctconvert.stages.source import SourceStage

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint


def test_a_path_is_opened(tiny_llama):
    job = QuantizeJob(str(tiny_llama), None, QuantizeOptions())
    SourceStage().prepare(job)
    assert job.src_path == tiny_llama and not job.source.quantized and job.ckpt is job.source.view


def test_an_opened_source_is_taken_as_it_is(tiny_llama):
    source = open_source(open_checkpoint(tiny_llama, strict=True))
    job = QuantizeJob(source, None, QuantizeOptions())
    SourceStage().prepare(job)
    assert job.source is source and job.ckpt is source.view and job.src_path == source.original.path


def test_a_fused_set_missing_a_member_is_refused(tmp_path):
    t = llama_tensors(LLAMA_CONFIG)
    del t["model.layers.1.self_attn.k_proj.weight"]
    p = write_checkpoint(tmp_path / "m", t, LLAMA_CONFIG)
    with pytest.raises(BadInputError, match="k_proj"):
        SourceStage().prepare(QuantizeJob(p, None, QuantizeOptions()))
