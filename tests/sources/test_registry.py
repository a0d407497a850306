"""The registry of input formats (ctconvert/sources/__init__.py): each checkpoint recognised by its own format
object, a dense checkpoint the default, an unknown quant_method refused by name, the tools' own config files."""

from __future__ import annotations

import json

import foreign_formats as ff
import pytest

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import UnsupportedError
from ctconvert.sources import DENSE, FORMATS, SOURCE_CONFIG_FILES, open_source
from ctconvert.sources.awq import AWQ
from ctconvert.sources.compressed_tensors import COMPRESSED_TENSORS
from ctconvert.sources.fp8_block import FP8_BLOCK
from ctconvert.sources.gptq import GPTQ
from ctconvert.sources.modelopt import MODELOPT

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint


def _opened(path):
    return open_source(open_checkpoint(path, strict=True))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("src") / "dense", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)


@pytest.mark.parametrize(
    "make, fmt, kind",
    [
        (lambda p: ff.awq_checkpoint(p)[0], AWQ, "awq"),
        (lambda p: ff.awq_checkpoint(p, in_config=False)[0], AWQ, "awq"),
        (lambda p: ff.gptq_checkpoint(p)[0], GPTQ, "gptq"),
        (lambda p: ff.modelopt_checkpoint(p)[0], MODELOPT, "modelopt"),
        (lambda p: ff.modelopt_checkpoint(p, in_config=False)[0], MODELOPT, "modelopt"),
        (lambda p: ff.deepseek_checkpoint(p), FP8_BLOCK, "fp8-block"),
    ],
)
def test_each_format_is_recognised_by_its_own_object(tmp_path, make, fmt, kind):
    src = _opened(make(tmp_path / "src"))
    assert src.format is fmt and src.kind == kind and src.quantized
    assert [f for f in FORMATS if f.recognises(src.quantization_config)] == [fmt]
    assert all(type(m).kind == next(iter(src.modules.values())).kind for m in src.modules.values())


def test_compressed_tensors_is_recognised_by_its_object(dense, tmp_path):
    from ctconvert import api

    api.quantize(dense, tmp_path / "w4", "W4A16")
    src = _opened(tmp_path / "w4")
    assert src.format is COMPRESSED_TENSORS and src.kind == "compressed-tensors"
    assert {m.kind for m in src.modules.values()} == {"compressed-tensors"} and {m.bits for m in src.modules.values()} == {4}


def test_a_dense_checkpoint_is_the_default(dense):
    src = _opened(dense)
    assert src.format is DENSE and src.kind == "dense" and not src.quantized and src.view is src.original
    assert src.lossless_scheme("W4A16") == (False, None)


def test_an_unknown_quant_method_is_refused_by_name(tmp_path):
    path, _ = ff.awq_checkpoint(tmp_path / "src")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "bitsandbytes"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match=r"unknown quant_method 'bitsandbytes'; ctconvert reads: compressed-tensors, fp8, awq, gptq, modelopt$"):
        _opened(path)


def test_the_tools_config_files_in_the_order_they_are_read():
    assert SOURCE_CONFIG_FILES == ("hf_quant_config.json", "quantize_config.json", "quant_config.json")
    assert [f.quant_method for f in FORMATS] == ["compressed-tensors", "fp8", "awq", "gptq", "modelopt"]


@pytest.mark.parametrize(
    "name, doc, says",
    [
        ("quantize_config.json", '{"bits": 4}', "read as 'gptq' for its name (it names no quant_method)"),
        ("quantize_config.json", '{"quant_method": "gptq"}', "quant_method 'gptq' but"),
        ("quantize_config.json", "{}", "quantize_config.json is empty"),
        ("hf_quant_config.json", "{}", "hf_quant_config.json is empty"),
        ("hf_quant_config.json", "", "hf_quant_config.json is empty"),
        ("quant_config.json", " \n", "quant_config.json is empty"),
    ],
)
def test_a_config_file_with_no_quantized_module_says_what_named_the_format(tiny_llama, name, doc, says):
    """A dense checkpoint with a stray tool config file: the error says the file was read for its name (a trial's
    ``{}`` was reported as "quant_method 'gptq'", which the file does not say; ModelOpt's as an unsupported
    ``quant_algo None``), and suggests moving it; a file that names its method is not called stray."""
    from ctconvert.checkpoint.reader import open_checkpoint
    from ctconvert.errors import BadInputError
    from ctconvert.sources import open_source

    (tiny_llama / name).write_text(doc)
    with pytest.raises(BadInputError) as e:
        open_source(open_checkpoint(tiny_llama))
    assert says in str(e.value) and e.value.file == tiny_llama / name
    assert (f"stray {name}? move it away" in str(e.value)) == ("quant_method" not in doc)
