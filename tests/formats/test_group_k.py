"""A group format's quantizer refuses a K that is not a multiple of its group size (one line naming K and the group),
on every implementation, instead of reading past a row's end: the planner keeps such weights dense first, so this is
the API's own guard (a batch test found the C kernel's output changing from call to call on such a K)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.plan.schemes import resolve_scheme

from conftest import cuda_params


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("name,group", [("W4A16", 128), ("W8A16", 128), ("NVFP4A16", 16), ("MXFP4A16", 32), ("MXFP8A16", 32)])
def test_k_not_a_multiple_of_the_group_is_refused(device, impl, name, group):
    scheme = resolve_scheme(name)
    w = torch.randn(8, group + group // 2, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    gs = torch.ones(1) if scheme.global_scale else None
    with pytest.raises(ValueError, match=f"K={group + group // 2} is not a multiple of the group size {group}"):
        scheme.quantize_rows(w, gs, impl=impl)
    ok = scheme.quantize_rows(w[:, : 2 * group].contiguous() if w.shape[1] >= 2 * group else torch.cat([w, w], 1)[:, : 2 * group], gs, impl=impl)
    assert ok["weight_scale"].shape[0] == 8
