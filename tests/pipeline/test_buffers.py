"""The executor's pinned read buffers (pipeline/buffers.py): made at the capacity torch's caching host allocator
reserves (the next power of two), and reused for any later read up to it. CUDA only (pinned memory)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.pipeline.buffers import PinnedPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available (pinned memory)")


@pytest.mark.parametrize("nbytes", [1, 3, 4096, 4097, 5 * 2**20 + 17])
def test_a_pinned_buffer_has_the_next_power_of_two_and_serves_reads_up_to_it(nbytes):
    pool = PinnedPool(1)
    buf = pool.get(nbytes)
    cap = 1 << (nbytes - 1).bit_length()
    assert buf.is_pinned() and buf.dtype == torch.uint8 and buf.numel() == cap >= nbytes
    pool.put(buf, None)
    again = pool.get(cap)  # the same buffer, not a new one
    assert again.data_ptr() == buf.data_ptr()
    pool.put(again, None)
    bigger = pool.get(cap + 1)
    assert bigger.numel() == 2 * cap and bigger.data_ptr() != buf.data_ptr()
    pool.closed = True
    with pytest.raises(RuntimeError):
        pool.get(1)
