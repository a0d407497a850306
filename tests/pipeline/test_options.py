"""QuantizeOptions is the one source of quantize's option names and defaults: the API, the CLI and batch agree with it."""

from __future__ import annotations

import dataclasses

import click
import pytest

from ctconvert import api
from ctconvert.cli import quantize as quantize_cmd
from ctconvert.commands import batch
from ctconvert.commands.convert import ConvertResult
from ctconvert.commands.quantize import QuantizeResult
from ctconvert.errors import UsageError
from ctconvert.pipeline.options import QuantizeOptions, job_keys
from ctconvert.plan.result import ConversionResult

#: every keyword api.quantize took before the options had a type of their own (they must all still work)
OLD_API_KEYWORDS = (
    "lm_head targets ignore max_shard_size overwrite dry_run skip_incompatible device lm_head_chunk_rows chunk_elems hold_bytes resume "
    "refresh impl map_input allow_nonfinite keep_other_weights tp ep sparsity group_size symmetric calibration calibration_samples "
    "calibration_seq_len kv_cache keep_unclassified default_ignore quantize_mtp"
).split()
#: what the batch jobs took before the job keys were derived from the options
OLD_JOB_KEYS = (
    "model output scheme lm_head targets ignore max_shard_size overwrite skip_incompatible device resume refresh lm_head_chunk_rows "
    "allow_non_finite keep_other_weights sparsity group_size symmetric target layout_version act_dtype dry_run calibration "
    "calibration_samples calibration_seq_len kv_cache keep_unclassified default_ignore quantize_mtp"
).split()
#: CLI option -> (option field, how the CLI value maps to it)
CLI_NAMES = {"allow_non_finite": ("allow_nonfinite", bool), "no_default_ignore": ("default_ignore", lambda v: not v)}


def test_every_old_keyword_is_an_option():
    assert set(OLD_API_KEYWORDS) <= set(QuantizeOptions.names())


def test_batch_keys_are_the_options():
    assert set(OLD_JOB_KEYS) <= batch.ALLOWED
    assert batch.ALLOWED == {"model", "output", "scheme", *job_keys()}
    assert set(job_keys().values()) == set(QuantizeOptions.names())
    assert job_keys()["allow_non_finite"] == "allow_nonfinite" and "allow_nonfinite" not in batch.ALLOWED


def test_unknown_keywords_are_a_type_error_naming_them(tiny_llama):
    with pytest.raises(TypeError, match=r"unknown quantize option\(s\): colour, lm_haed"):
        api.quantize(tiny_llama, None, "W4A16", dry_run=True, lm_haed="fp8", colour="red")
    with pytest.raises(TypeError, match="colour"):
        api.quantize_to_target(tiny_llama, None, "W4A16", "marlin", dry_run=True, colour="red")


def test_options_object_and_keywords_are_the_same_call(tiny_llama):
    a = api.quantize(tiny_llama, None, "W4A16", dry_run=True, ignore=["model.layers.0.mlp.down_proj"], lm_head="fp8")
    base = QuantizeOptions(ignore=["model.layers.0.mlp.down_proj"], lm_head="fp8")
    b = api.quantize(tiny_llama, None, "W4A16", options=base, dry_run=True)  # keywords amend the object
    assert a.to_dict() | {"seconds": 0} == b.to_dict() | {"seconds": 0}
    assert base.dry_run is False and base.ignore == ("model.layers.0.mlp.down_proj",)  # frozen: amending made a new one
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.lm_head = "none"


def test_cli_defaults_are_the_options_defaults():
    """The click options mirror the defaults (the CLI does not import the engine before it runs); they must agree."""
    default = QuantizeOptions()
    ctx = click.Context(quantize_cmd)
    checked = 0
    for p in quantize_cmd.params:
        name, conv = CLI_NAMES.get(p.name, (p.name, lambda v: v))
        value = p.get_default(ctx)
        if name not in QuantizeOptions.names() or value in (None, ()) or p.name in ("targets", "ignore"):
            continue
        assert conv(value) == getattr(default, name), p.name
        checked += 1
    assert checked >= 15


def test_one_result_type():
    assert QuantizeResult is ConvertResult is api.QuantizeResult is ConversionResult
    r = ConversionResult(output=None, scheme="W4A16", format="fmt", dry_run=True, input_bytes=1)
    assert "lossless" not in r.to_dict() and "source_format" not in r.to_dict()
    r = ConversionResult(output=None, scheme="W4A16_ASYM", format="fmt", dry_run=True, input_bytes=1, source_format="awq", lossless=True)
    assert r.to_dict()["lossless"] is True and r.to_dict()["source_format"] == "awq"


def test_executor_is_a_choice_of_local_or_ray():
    assert QuantizeOptions().executor == "local" and QuantizeOptions(executor="RAY").executor == "ray"
    with pytest.raises(UsageError, match="unknown --executor 'dask'; choose one of local, ray"):
        QuantizeOptions(executor="dask")


def test_a_local_result_has_no_nodes_and_a_ray_one_names_them():
    r = ConversionResult(output="o", scheme="W4A16", format="fmt", dry_run=False, input_bytes=1)
    assert "nodes" not in r.to_dict()
    r.nodes = [{"node": "10.0.0.2", "node_id": "ab", "bytes": 1, "shards": 1}]
    assert r.to_dict()["nodes"] == r.nodes
