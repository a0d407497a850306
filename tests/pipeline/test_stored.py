"""A quantized source's stored rows dequantized on a device (pipeline/stored.py): the bytes of the CPU path
(VirtualDense.rows, the C kernel) for every row range (block-aligned or not, partial last blocks), FP8-block and
compressed-tensors FP8 sources of every strategy, awkward values (rows of zeros, huge and tiny scales); which
sources take the path; and a whole GPU requantize equal to the CPU one (CUDA only)."""

from __future__ import annotations

import hashlib
import json

import foreign_formats as ff
import pytest
import torch

from ctconvert import api
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError
from ctconvert.pipeline.stored import on_device, read_stored
from ctconvert.sources import open_source

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint
from helpers import bitwise_equal

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


class _Pool:
    """A PinnedPool's interface: page-locked buffers where CUDA is, plain ones else; counts what it handed out."""

    def __init__(self):
        self.given = 0

    def get(self, nbytes: int) -> torch.Tensor:
        self.given += 1
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8, pin_memory=torch.cuda.is_available())  # junk: every byte used must be written


def _awkward_llama(path, seed: int):
    """Llama tensors with rows of zeros, a huge and a tiny row, and K not a multiple of 128 in no module (Llama's)."""
    t = llama_tensors(LLAMA_CONFIG, seed=seed)
    w = t["model.layers.0.mlp.up_proj.weight"]
    w[3] = 0
    w[130:140] = 0
    w[7] *= 3e4
    w[9] *= 1e-6
    return write_checkpoint(path, t, LLAMA_CONFIG)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("stored")
    dense = _awkward_llama(root / "dense", seed=5)
    out = {"fp8-block (DeepSeek)": ff.deepseek_checkpoint(root / "ds", seed=2)}
    ids = root / "ids.json"
    ids.write_text(json.dumps([(i * 13) % 250 for i in range(64)]))
    for scheme in ("FP8_BLOCK", "FP8_DYNAMIC"):
        out[scheme] = root / scheme
        api.quantize(dense, out[scheme], scheme)
    out["FP8"] = root / "FP8"  # static input scales: calibrated
    api.quantize(dense, out["FP8"], "FP8", calibration=ids, calibration_samples=2, calibration_seq_len=16)
    return out


def _ranges(n: int) -> list[tuple[int, int]]:
    return [(0, n), (0, min(n, 128)), (5, min(n, 133)), (min(n, 128), n), (max(0, n - 37), n), (n, n), (n // 2, n // 2 + 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp8-block (DeepSeek)", "FP8_BLOCK", "FP8_DYNAMIC", "FP8"])
def test_stored_rows_dequantized_on_the_device_are_the_cpu_bytes(sources, kind, device, monkeypatch):
    """The CPU path (the C kernel) against the torch reference on ``device`` (on the CPU too: the kernel hidden)."""
    from ctconvert.formats.native import dequant as native_dequant

    src = open_source(open_checkpoint(sources[kind]))
    virtual = [i for i in src.view.tensors.values() if i.virtual is not None]
    assert virtual and all(on_device(i) for i in virtual)
    pool = _Pool()
    for info in virtual:
        for r0, r1 in _ranges(info.shape[0]):
            want = info.virtual.rows(r0, r1)
            stored = read_stored(info, r0, r1, pool)
            with monkeypatch.context() as m:
                m.setattr(native_dequant, "available", lambda: False)
                got = stored.to_device(torch.device(device))
            assert got.device.type == device and got.dtype == want.dtype and got.shape == want.shape, (info.name, r0, r1)
            assert bitwise_equal(got.cpu(), want), (info.name, r0, r1)
    assert pool.given == len(virtual) * len(_ranges(2))  # one buffer per read


@pytest.mark.parametrize("kind", ["fp8-block (DeepSeek)", "FP8_BLOCK"])
def test_an_empty_range_is_made_where_the_parts_are(sources, kind):
    """No rows (r0 == r1 at a block edge) gives an empty tensor on the parts' device, not the CPU's (seen on CUDA;
    the meta device stands in for it here)."""
    src = open_source(open_checkpoint(sources[kind]))
    for info in (i for i in src.view.tensors.values() if i.virtual is not None):
        n = info.shape[0]
        for r0 in (0, n):
            parts = {k: v.to("meta") for k, v in info.virtual.stored_rows(r0, r0).items()}
            got = info.virtual.dense_from(parts, r0, r0)
            assert got.device.type == "meta" and got.shape == (0, info.shape[1]) and got.dtype == info.virtual.dtype


def test_packed_and_fp4_sources_stay_on_the_cpu_kernel(tmp_path):
    dense = write_checkpoint(tmp_path / "d", llama_tensors(LLAMA_CONFIG, seed=1), LLAMA_CONFIG)
    for scheme in ("W4A16", "NVFP4A16", "W8A16"):
        api.quantize(dense, tmp_path / scheme, scheme)
        src = open_source(open_checkpoint(tmp_path / scheme))
        virtual = [i for i in src.view.tensors.values() if i.virtual is not None]
        assert virtual and not any(on_device(i) for i in virtual), scheme
    assert not any(on_device(i) for i in open_checkpoint(dense).tensors.values())


def test_a_short_source_is_one_error_naming_the_tensor(sources, tmp_path):
    import shutil

    src_dir = tmp_path / "cut"
    shutil.copytree(sources["FP8_BLOCK"], src_dir)
    src = open_source(open_checkpoint(src_dir))
    info = next(i for i in src.view.tensors.values() if i.virtual is not None and "down_proj" in i.name)
    anchor = info.virtual.mod.anchor
    with open(anchor.file, "r+b") as f:
        f.truncate(anchor.start + 10)
    with pytest.raises(BadInputError) as e:
        read_stored(info, 0, info.shape[0], _Pool())
    assert str(anchor.file) in str(e.value)


def _digests(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.name != "ctconvert-provenance.json"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("kind", ["fp8-block (DeepSeek)", "FP8_BLOCK"])
def test_a_gpu_requantize_writes_the_cpu_bytes(sources, tmp_path, kind):
    kw = dict(chunk_elems=40_000)  # several row chunks per module
    api.quantize(sources[kind], tmp_path / "cpu", "NVFP4A16", device="cpu", **kw)
    api.quantize(sources[kind], tmp_path / "cuda", "NVFP4A16", device="cuda", **kw)
    assert _digests(tmp_path / "cuda") == _digests(tmp_path / "cpu")
