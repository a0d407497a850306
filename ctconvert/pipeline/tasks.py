"""Whole-checkpoint rewrites that are not a quantization: ``repack`` and ``decompress``.

Such a command plans a list of tasks, one per output tensor (or batch of
modules): copy a tensor's bytes, cast a floating-point tensor to another dtype
by row chunks, or compute tensors (a repack, a dequantization) and write what
the computation yields. :func:`run_tasks` runs them into the open shards, in
order; memory is one task's chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..checkpoint.safetensors_io import ShardFile, TensorInfo, copy_tensor, iter_row_chunks

__all__ = ["CastTensor", "Compute", "CopyTensor", "run_tasks"]

#: what a computing task yields: (output tensor name, data, byte offset in the tensor)
Write = tuple[str, torch.Tensor, int]


@dataclass
class CopyTensor:
    """Copy ``info``'s bytes unchanged (same name)."""

    info: TensorInfo


@dataclass
class CastTensor:
    """Write ``info`` cast to ``dtype`` (same name), by row chunks."""

    info: TensorInfo
    dtype: torch.dtype


@dataclass
class Compute:
    """Write what ``run()`` yields: ``(name, tensor, byte offset)``, on any device (copied to the host)."""

    run: Callable[[], Iterator[Write]]


def run_tasks(tasks: list, shards: dict[str, ShardFile], progress=None, total: int = 0) -> None:
    """Run every task, in order, writing into ``shards`` (output tensor name -> its open shard).

    ``progress``: a callable ``(total_bytes) -> context manager with .update(n)`` (the CLI's bar), told
    every output byte written; ``total``: the output bytes (the bar's end)."""
    bar_cm = progress(total) if progress is not None else contextlib.nullcontext()
    with torch.inference_mode(), bar_cm as bar:
        done = (lambda n: bar.update(n)) if bar is not None else (lambda n: None)
        for task in tasks:
            if isinstance(task, CopyTensor):
                copy_tensor(task.info, shards[task.info.name])
                done(task.info.nbytes)
            elif isinstance(task, CastTensor):
                name, pos = task.info.name, 0
                for _, t in iter_row_chunks(task.info):
                    t = t.to(task.dtype)
                    shards[name].write(name, t, pos)
                    pos += t.numel() * t.element_size()
                    done(t.numel() * t.element_size())
            else:
                for name, t, pos in task.run():
                    shards[name].write(name, t.cpu(), pos)
                    done(t.numel() * t.element_size())
