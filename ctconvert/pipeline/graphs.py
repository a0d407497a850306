"""A GPU batch's device work captured once as a CUDA graph and replayed for every later batch of its kind.

A batch of small units (:mod:`.batches`) launches ~50 small kernels and tensor operations: the gather of fused
experts, each member's absmax, NVFP4's global scales, the quantizer, the whole-tensor outputs, the NaN/inf flag and
the zero-row candidates. Each is a Python call that lets the GIL go to the run's reader and writer threads, so that
on an H100 a Qwen3-MoE batch cost the computing thread ~3 ms while its kernels ran for far less, and that thread
bounded the run (docs/benchmarks.md, "The twelfth session"). A MoE's batches come in a handful of kinds (a key:
:func:`graph_key`, the units' scheme, their count, their members' shapes, dtype and views), so the work of a kind is
captured once (``torch.cuda.CUDAGraph``: PyTorch ``torch/cuda/graphs.py``; CUDA Programming Guide, "CUDA Graphs",
stream capture) and each later batch is one copy of its bytes into the graph's input and one replay.

The bytes are the same: a replay launches the kernels the eager batch launches, with the same arguments, on the bytes
copied into the graph's input. What the capture fixes is only what the key fixes (shapes, dtypes, the scheme, the
views; a format's host-made outputs such as ``weight_shape``); what differs from batch to batch (the names) is
made per batch by :meth:`Captured.result`. The graph's outputs are static: they are read in stream order by the
staging copies of the same batch before the next replay overwrites them, and what outlives the batch (each member's
absmax for the NaN/inf flags, the NVFP4 global scales and absmaxes, the zero-row candidates: read when the run ends)
is copied out of them by two copies per batch.

The first batch of a key runs eagerly (it loads and compiles the kernels, which a capture must not do); the second
is captured, once the run's warm-up thread is done (a capture is confined to its own thread:
``capture_error_mode="thread_local"``, on a stream of its own). A capture that fails leaves its key eager for the
run (kept in :attr:`BatchGraphs.error`). ``CTCONVERT_GRAPHS=0`` turns graphs off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..checkpoint.safetensors_io import TensorInfo
from .batches import BatchResult, batch_nbytes, batch_values, quantize_batch
from .zeros import stacked_candidates

__all__ = ["BatchGraphs", "Captured", "graph_key", "graphs_default"]

GRAPH_LIMIT = 8  # captured kinds per run at most (each holds its input, outputs and temporaries: ~3x a batch's bytes)


def graphs_default() -> bool:
    """Whether GPU runs replay captured batches: yes, unless the environment says ``CTCONVERT_GRAPHS=0``."""
    return os.environ.get("CTCONVERT_GRAPHS", "1") != "0"


def graph_key(units, infos: list[list[TensorInfo]]) -> tuple:
    """What fixes a batch's device work: the units' scheme (the object: units of one config group share it), their
    count, and each member's shape, dtype and view (a fused expert's place in its region)."""
    return (id(units[0].scheme), len(units), tuple((i.shape, i.dtype, i.view) for i in infos[0]))


@dataclass
class Captured:
    """One captured kind of batch: ``graph``; ``xin`` its input (uint8 on the device, the batch's bytes); ``res`` the
    :class:`~.batches.BatchResult` of the capture (its tensors the graph's static outputs); ``side`` fp32 ``[n + 2B]``
    (each member's absmax, then each unit's NVFP4 global scale and absmax, zeros for other schemes) and ``flags`` bool
    ``[1 + n * R]`` (the batch is finite, then each member's zero-row candidates, where the format has any), both
    static; ``m`` members per unit; ``scheme`` kept alive with its key."""

    graph: torch.cuda.CUDAGraph
    xin: torch.Tensor
    res: BatchResult
    side: torch.Tensor
    flags: torch.Tensor
    m: int
    rows: int
    masked: bool
    scheme: object

    def result(self, units) -> tuple[BatchResult, torch.Tensor, torch.Tensor | None]:
        """After a replay: ``(the batch's result, its finite flag bool [1], its zero-row candidates bool [n, R] or
        None)``. The outputs are the graph's (valid until the next replay, in stream order); the absmaxes, global scales
        and flags are copies of this replay's."""
        side, flags = self.side.clone(), self.flags.clone()
        b, m = len(units), self.m
        n = b * m
        gs = side[n : n + b] if self.res.unit_scales is not None else None
        ua = side[n + b :] if gs is not None else None
        each = self.masked and gs is not None  # each member's share: only the zero-row scan reads it
        res = BatchResult(
            side[:n],
            [unit.modules[mm] + "." for unit in units for mm in range(m)],
            self.res.outputs,
            [gs[j // m : j // m + 1] for j in range(n)] if each else [None] * n,
            self.res.scales,
            [ua[j // m : j // m + 1] for j in range(n)] if each else [None] * n,
            gs,
            ua,
        )
        mask = flags[1:].reshape(n, self.rows) if self.masked else None
        return res, flags[:1], mask


class BatchGraphs:
    """The captured batches of one GPU run on ``device`` (quantizer ``impl``). ``zeros``: whether the run looks for
    rows quantized to zeros (the candidates are then part of the graph); ``ready``: whether a capture may begin
    (the run's warm-up thread is done). :attr:`error`: the last capture's failure (None: none failed)."""

    def __init__(self, device: torch.device, impl: str, zeros: bool, ready=lambda: True, limit: int = GRAPH_LIMIT):
        self.device, self.impl, self.zeros, self.ready, self.limit = device, impl, zeros, ready, limit
        self.graphs: dict[tuple, Captured] = {}
        self.seen: set = set()
        self.failed: set = set()
        self.error: BaseException | None = None
        self.replays = 0

    def run(self, units, infos: list[list[TensorInfo]], data: torch.Tensor):
        """Replay the batch of ``units`` (their members ``infos``) on its bytes ``data`` (pinned host uint8, at least
        :func:`~.batches.batch_nbytes`): :meth:`Captured.result`, or None where this batch runs eagerly (its key's
        first, a failed capture, the warm-up still running, :data:`GRAPH_LIMIT` kinds captured, a format whose quantizer
        reads a value back: ``WeightFormat.reads_back``). The copy of ``data``
        is queued on the current stream (record its event after this call)."""
        key = graph_key(units, infos)
        got = self.graphs.get(key)
        if got is None:
            if units[0].scheme.weight_format.reads_back:  # its overflow check raises at once: never captured
                return None
            if key in self.failed or key not in self.seen or len(self.graphs) >= self.limit or not self.ready():
                self.seen.add(key)
                return None
            got = self._capture(key, units, infos)
            if got is None:
                return None
        n = batch_nbytes(infos)
        got.xin.copy_(data[:n], non_blocking=True)
        got.graph.replay()
        self.replays += 1
        return got.result(units)

    def _capture(self, key: tuple, units, infos: list[list[TensorInfo]]) -> Captured | None:
        scheme, first = units[0].scheme, infos[0][0]
        xin = torch.zeros(batch_nbytes(infos), dtype=torch.uint8, device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    res = quantize_batch(units, infos, batch_values(infos, xin), self.impl, check_now=False)
                    b = len(units)
                    none = res.amax.new_zeros(b)
                    side = torch.cat([res.amax, none if res.unit_scales is None else res.unit_scales, none if res.unit_amax is None else res.unit_amax])
                    mask = stacked_candidates(res.scales, scheme.weight_format, scheme.weights, first.torch_dtype, first.shape[0]) if self.zeros else None
                    ok = torch.isfinite(res.amax).all().reshape(1)
                    flags = torch.cat([ok, mask.reshape(-1)]) if mask is not None else ok
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        except Exception as e:  # noqa: BLE001 - the kind stays eager; the eager batch reports its own errors
            self.failed.add(key)
            self.error = e
            return None
        got = Captured(graph, xin, res, side, flags, len(infos[0]), first.shape[0], mask is not None, scheme)
        self.graphs[key] = got
        return got
