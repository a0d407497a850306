"""The source stage: the input checkpoint opened once (headers only), seen as dense tensors.

A quantized input (compressed-tensors, Hugging Face FP8 block, ModelOpt NVFP4, AutoAWQ, GPTQ:
:mod:`ctconvert.sources`) is planned and read as its dequantized weights (requantize).
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.conformance import missing_fused_members
from ..checkpoint.naming import is_linear_weight
from ..checkpoint.reader import Checkpoint, open_checkpoint
from ..errors import BadInputError, plural
from ..pipeline.memory import fix_mmap_threshold
from ..sources import open_source
from .job import QuantizeJob, Stage

__all__ = ["SourceStage", "check_fused_sets"]


def check_fused_sets(ckpt: Checkpoint) -> None:
    """Raise :class:`BadInputError` (exit 3) for a fused set with a member missing where other layers have it
    (:func:`ctconvert.checkpoint.conformance.missing_fused_members`), naming the file and the missing module."""
    linear = {n.removesuffix(".weight"): str(i.file) for n, i in ckpt.tensors.items() if is_linear_weight(n, i)}
    if found := missing_fused_members(linear, ckpt.config):
        p = found[0]
        more = f" (and {plural(len(found) - 1, 'other fused set')})" if len(found) > 1 else ""
        raise BadInputError(p.message + more, file=p.file, tensor=p.tensor)


class SourceStage(Stage):
    """Opens ``job.src`` (a path, or a :class:`~ctconvert.sources.Source` opened already: one with
    ``.original`` and ``.view``, taken as it is) and checks its fused sets. Takes no options.

    Raises what :func:`~ctconvert.checkpoint.reader.open_checkpoint` and
    :func:`~ctconvert.sources.open_source` raise, and :class:`BadInputError` (:func:`check_fused_sets`)."""

    def prepare(self, job: QuantizeJob) -> None:
        src = job.src
        if hasattr(src, "original") and hasattr(src, "view"):
            job.source, job.src_path = src, Path(src.original.path)
        else:
            job.src_path = Path(src)
            job.source = open_source(open_checkpoint(job.src_path, strict=True))
        job.ckpt = job.source.view
        check_fused_sets(job.ckpt)
        if job.source.quantized:
            fix_mmap_threshold()  # dequantized temporaries would otherwise fragment the heaps (pipeline/memory.py)
