"""An MX group whose power-of-two scale overflows the weight's dtype is refused naming its row, its columns and its
absmax, on every implementation (the C and Triton kernels only flag it; the group is found again), and the
threshold is where the rounding passes the largest power of two: an fp16 absmax of 57344 (1.75 x 2^15) overflows,
57312 (the fp16 value below it) does not; a chunk's row is the tensor's (the executor adds the chunk's first row)."""

from __future__ import annotations

import pytest
import torch

from ctconvert import api
from ctconvert.errors import BadInputError
from ctconvert.formats.mx import GroupOverflow
from ctconvert.plan.schemes import resolve_scheme

from conftest import LLAMA_CONFIG, cuda_params, llama_tensors, write_checkpoint


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("name", ["MXFP4A16", "MXFP8A16"])
def test_the_overflowing_group_is_named(device, impl, name):
    scheme = resolve_scheme(name)
    w = torch.randn(12, 128, generator=torch.Generator().manual_seed(3)).half()
    w[9, 70] = 57312.0
    scheme.quantize_rows(w.to(device), impl=impl)  # below the threshold: quantized
    w[5, 100] = -57344.0
    w[9, 70] = 60000.0
    with pytest.raises(GroupOverflow) as e:
        scheme.quantize_rows(w.to(device), impl=impl)
    assert (e.value.row, e.value.col, e.value.absmax) == (5, 96, 57344.0)
    assert "at row 5, columns 96-127: the group's absmax 57344 rounds past the largest power of two of torch.float16" in str(e.value)
    assert "an absmax of 57344 or more" in str(e.value)


@pytest.mark.parametrize("device", cuda_params())
def test_the_row_is_the_tensors_in_a_later_chunk(tmp_path, device):
    t = {k: v.half() for k, v in llama_tensors(LLAMA_CONFIG).items()}
    name = "model.layers.1.mlp.down_proj.weight"
    t[name][200, 33] = 65504.0
    src = write_checkpoint(tmp_path / "m", t, dict(LLAMA_CONFIG, torch_dtype="float16"))
    with pytest.raises(BadInputError) as e:
        api.quantize(src, tmp_path / "o", "MXFP4A16", device=device, chunk_elems=64 * t[name].shape[1])  # 64-row chunks
    assert name in str(e.value) and "at row 200, columns 32-63: the group's absmax 65504" in str(e.value)
