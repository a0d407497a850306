"""Where a NaN/inf is said to be (``pipeline/nonfinite.py: raise_nonfinite``): an element, a row and column, or the
full index of a 3-D tensor (a new user was told ``row 3, column 32765`` for ``[3, 127, 253]`` of fused experts)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError
from ctconvert.pipeline.nonfinite import raise_nonfinite

from conftest import write_checkpoint


@pytest.mark.parametrize(
    "shape, index, where",
    [
        ((7,), (5,), "element 5"),
        ((6, 10), (4, 7), "row 4, column 7"),
        ((4, 128, 256), (3, 127, 253), "index [3, 127, 253]"),
        ((2, 3, 5, 7), (1, 2, 4, 6), "index [1, 2, 4, 6]"),
        ((3, 1, 9), (2, 0, 0), "index [2, 0, 0]"),
    ],
)
@pytest.mark.parametrize("value, kind", [(float("nan"), "NaN"), (float("-inf"), "-inf")])
def test_the_first_non_finite_value_is_named_by_its_index(tmp_path, shape, index, where, value, kind):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    t[index] = value
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "m", {"x.weight": t}, {"model_type": "llama"}))
    with pytest.raises(BadInputError) as e:
        raise_nonfinite(ckpt.tensors["x.weight"])
    assert f"holds 1 non-finite value ({kind}; first at {where})" in str(e.value)
    assert torch.equal(torch.tensor(index), (~torch.isfinite(t.float())).nonzero()[0])  # the index said is the value's
