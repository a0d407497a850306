"""run_tasks: copy, cast and computed chunks reach their offsets through the writer threads; pooled buffers are reused; errors surface."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.shard_file import PlannedTensor, ShardFile
from ctconvert.errors import OutputError
from ctconvert.pipeline.tasks import CastTensor, ChunkBuffers, Compute, CopyTensor, run_tasks


def _source(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = {"a": torch.randn(300, 70, generator=g), "b": torch.randn(50, generator=g).to(torch.bfloat16), "e": torch.zeros(0, 4)}
    (tmp_path / "src").mkdir()
    save_file(t, tmp_path / "src" / "model.safetensors")
    (tmp_path / "src" / "config.json").write_text("{}")
    return t, open_checkpoint(tmp_path / "src", strict=False)


def test_every_task_lands_at_its_offsets_and_buffers_are_reused(tmp_path):
    src, ckpt = _source(tmp_path)
    rows = torch.arange(1000 * 33, dtype=torch.float32).reshape(1000, 33)
    buffers = ChunkBuffers(count=2)
    seen = set()

    def compute():
        for r0 in range(0, 1000, 64):  # 16 chunks through 2 buffers: the writers give them back
            out = buffers.take((min(64, 1000 - r0), 33), torch.float16)
            out.copy_(rows[r0 : r0 + 64])
            seen.add(out.untyped_storage().data_ptr())
            yield "c", out, r0 * 33 * 2

    planned = [
        PlannedTensor("a", "F16", (300, 70)),
        PlannedTensor("b", "BF16", (50,)),
        PlannedTensor("e", "F32", (0, 4)),
        PlannedTensor("c", "F16", (1000, 33)),
    ]
    shard = ShardFile(tmp_path / "out.safetensors", planned)
    tasks = [CastTensor(ckpt.tensors["a"], torch.float16), CopyTensor(ckpt.tensors["b"]), CopyTensor(ckpt.tensors["e"]), Compute(compute)]
    log = []

    class Bar:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            log.append(n)

    run_tasks(
        tasks,
        {p.name: shard for p in planned},
        progress=lambda total: log.append(("total", total)) or Bar(),
        total=sum(p.nbytes for p in planned),
        buffers=buffers,
    )
    shard.close()
    got = load_file(tmp_path / "out.safetensors")
    assert torch.equal(got["a"], src["a"].to(torch.float16)) and torch.equal(got["b"], src["b"]) and got["e"].shape == (0, 4)
    assert torch.equal(got["c"], rows.to(torch.float16))
    assert buffers.made == 2 and len(seen) <= 2
    assert log[0] == ("total", sum(p.nbytes for p in planned)) and sum(log[1:]) == log[0][1]


def test_a_write_error_is_raised_and_the_writers_stop(tmp_path):
    _, ckpt = _source(tmp_path)

    class Full:
        def write(self, name, t, pos):
            raise OutputError("write failed: No space left on device", file="out.safetensors", tensor=name)

    buffers = ChunkBuffers(count=1)

    def compute():
        for _ in range(50):  # more chunks than the queues hold: the run stops instead of waiting for a buffer
            yield "c", buffers.take((8, 8), torch.float32).fill_(1), 0

    with pytest.raises(OutputError, match="No space left"):
        run_tasks([CopyTensor(ckpt.tensors["a"]), Compute(compute)], {"a": Full(), "c": Full()}, buffers=buffers)
