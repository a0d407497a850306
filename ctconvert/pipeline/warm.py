"""A GPU run's warm-up: the kernels of the run launched once on zeros, on a thread and a stream of their own, while the
first units are read and written (a checkpoint often starts with its embeddings, copied as they are).

Two first-launch costs are paid here instead of on the computing thread:

- **Triton compiles** a kernel at its first launch with given dtypes, constexprs and argument specialisation, and
  caches it on disk (``~/.triton/cache``); a process with a cold cache would otherwise spend ~1-2 s of its call
  compiling (an H200 profile of an 8B NVFP4A16 run).
- **CUDA loads** each of torch's kernels at its first launch (lazy module loading, the default since CUDA 11.7:
  ``CUDA_MODULE_LOADING=LAZY``). The first batch of a MoE's experts launches a dozen kernels no earlier unit did (the
  absmax reductions, the NVFP4 global scales' elementwise steps, the NaN/inf flag, the zero-row scan, the gather of
  fused experts); on an H100 it took 0.26 s (Qwen3-MoE) and 0.34 s (gpt-oss) of which the quantizer was 13-66 ms,
  where a later batch takes ~10 ms (``scripts/trace_timeline.py``, 2026-12-07).

So the first batch of each batch key runs the batch's own device work (:func:`.batches.warm_batch`: one tall launch,
with one NVFP4 global scale per row), then each distinct (scheme, dtype, K, chunk rows) of the plan's tensors is
quantized once and its absmax and NaN/inf flag taken. The results are dropped; a failure here is ignored (kept for
``--debug`` and the tests): the real launch compiles, and reports, as it would have.
"""

from __future__ import annotations

import threading

import torch

from ..formats import triton_key
from ..formats.common import tensor_absmax
from .batches import warm_batch
from .reads import warm_up_batches, warm_up_shapes

__all__ = ["WarmUp"]


class WarmUp:
    """The warm-up of one run (``ckpt``, ``plan``, executor options ``opts``, CUDA device ``dev``): :meth:`start`
    begins its thread; ``warmed`` counts the launches done, ``error`` is why it stopped early (None: it did not)."""

    def __init__(self, ckpt, plan, opts, dev: torch.device):
        self.ckpt, self.plan, self.opts, self.dev = ckpt, plan, opts, dev
        self.warmed, self.error = 0, None
        self.done = False  # the thread's work is over (a CUDA graph may be captured: .graphs)
        self.thread: threading.Thread | None = None

    @classmethod
    def adopt_or_start(cls, ahead: WarmUp | None, ckpt, plan, opts, dev: torch.device) -> WarmUp:
        """An executor's warm-up: ``ahead`` where it was begun before the executor on its device ``dev`` (the quantize
        stage's, of the whole plan: a superset of the executor's units), else a new one, started."""
        if ahead is not None and ahead.dev == dev and ahead.thread is not None:
            return ahead
        warm = cls(ckpt, plan, opts, dev)
        warm.start()
        return warm

    def start(self) -> threading.Thread:
        self.thread = threading.Thread(target=self._work, daemon=True, name="ctconvert-warmup")
        self.thread.start()
        return self.thread

    def _work(self) -> None:
        opts, dev = self.opts, self.dev
        try:
            triton_key.wait()  # Triton's cache key, begun at start-up: its first launch needs it (formats/triton_key.py)
            with torch.inference_mode(), torch.cuda.stream(torch.cuda.Stream(dev)):
                for scheme, info, rows in warm_up_batches(self.ckpt, self.plan, opts):  # first: a MoE's time is in them
                    warm_batch(scheme, info, rows, opts.impl, dev)
                    self.warmed += 1
                for scheme, info, rows in warm_up_shapes(self.ckpt, self.plan, opts.chunk_elems):
                    w = torch.zeros(rows, info.shape[1], dtype=info.torch_dtype, device=dev)
                    torch.isfinite(tensor_absmax(w))
                    scheme.quantize_rows(w, torch.ones(1, device=dev) if scheme.global_scale else None, impl=opts.impl)
                    self.warmed += 1
        except Exception as e:  # noqa: BLE001 - kept for --debug and tests; the real launch reports its own errors
            self.error = e
        finally:
            self.done = True
