"""The observers and their search: min/max, and the MSE shrink-factor grid search (torch reference and C kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import WeightArgs
from ..native import observe as native_observe
from .fake_quant import FakeQuant
from .groups import check_weight, grouped, is_mx
from .patience import StopTracker

__all__ = ["MSEObserver", "MinMaxObserver", "Search", "WeightObserver"]


@dataclass
class Search:
    """What a search of one chunk found.

    ``min``/``max``: D ``[N, G]`` (the :func:`grouped` groups) the ranges; ``step``: int16 ``[N, G]``, the
    grid step each group took (``-1``: none improved, the unshrunk range); ``improved``: bool ``[steps]``,
    whether any group of the chunk improved at each step run; ``hits``: int64 ``[N, G]``, bit ``i`` set where
    the group improved at step ``i`` (searches of at most 63 steps; else None): with it the group's step
    under any shorter count is known without searching again (:meth:`MSEObserver.steps_at`).
    """

    min: torch.Tensor
    max: torch.Tensor
    step: torch.Tensor
    improved: torch.Tensor
    hits: torch.Tensor | None = None

    @property
    def ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(min, max)``, for ``WeightFormat.quantize(..., ranges=...)``."""
        return self.min, self.max


class WeightObserver:
    """One observer: ``name`` (llm-compressor's registry name) and how it finds each group's range."""

    name: str
    needs_data = False  # whether it needs calibration data (``imatrix``: the importance of each input channel)

    def search(self, w: torch.Tensor, args: WeightArgs, steps: int | None = None, impl: str = "auto") -> Search:
        """The ranges of ``w`` ``[N, K]`` for ``args``; ``steps``: run exactly this many grid steps, without
        stopping early (None: stop as llm-compressor does, with ``w`` taken as the whole tensor)."""
        raise NotImplementedError

    def for_unit(self, modules: list[str]) -> WeightObserver:
        """This observer for a work unit of these modules (a fused set's members; data-free observers: itself)."""
        return self

    def member(self, i: int) -> WeightObserver:
        """This observer for member ``i`` of the unit of :meth:`for_unit` (data-free observers: itself)."""
        return self

    def ranges(self, w: torch.Tensor, args: WeightArgs, steps: int | None = None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """``search(w, args, steps, impl).ranges``."""
        return self.search(w, args, steps, impl).ranges

    @property
    def total_steps(self) -> int:
        """Grid steps of a search that does not stop early (0: no search)."""
        return 0

    @property
    def needs_stop_pass(self) -> bool:
        """Whether a row chunk's search depends on the rest of the tensor (global patience can stop it)."""
        return False

    def config_fields(self) -> dict:
        """What the weights' QuantizationArgs of the output config record: llm-compressor writes the
        observer's name and its (empty) keyword arguments."""
        return {"observer": self.name, "observer_kwargs": {}}

    def __repr__(self) -> str:
        return f"<observer {self.name}>"


class MinMaxObserver(WeightObserver):
    """``minmax``: each group's own min and max (``min_max.py: _get_min_max``), the range the format's
    quantizers compute by themselves; ``search`` returns it with no steps."""

    name = "minmax"

    def search(self, w, args, steps=None, impl="auto"):
        check_weight(w, args)
        x = grouped(w, args)
        mn, mx = torch.aminmax(x, dim=-1) if x.numel() else (x.sum(-1), x.sum(-1))
        return Search(mn, mx, torch.full(mn.shape, -1, dtype=torch.int16, device=w.device), torch.zeros(0, dtype=torch.bool))

    def config_fields(self):
        """Nothing: a min/max run writes today's config (llm-compressor, given ``memoryless_minmax``
        explicitly, records that name; its default weights args record none)."""
        return {}


class MSEObserver(WeightObserver):
    """A shrink-factor grid search minimising ``sum |fake_quant(x) - x| ** norm`` per group (module docstring).

    ``maxshrink``, ``patience``, ``grid``, ``norm``, ``expand``: llm-compressor's observer keyword arguments
    (``mse.py``); the defaults of each name are in :data:`OBSERVERS`.
    """

    def __init__(self, name: str, *, maxshrink: float, patience: int, grid: float, norm: float = 2.4, expand: float = 1.0):
        if expand < 1.0:
            raise ValueError(f"expand must be at least 1.0, got {expand}")
        self.name, self.maxshrink, self.patience, self.grid, self.norm, self.expand = name, maxshrink, patience, grid, norm, expand

    @property
    def total_steps(self) -> int:
        return int(self.maxshrink * self.grid)  # as ``_grid_search_mse`` counts them

    @property
    def needs_stop_pass(self) -> bool:
        return self.patience < self.total_steps

    def search(self, w, args, steps=None, impl="auto"):
        """See :meth:`WeightObserver.search`. ``impl``: ``auto`` (the fused C kernel of :mod:`.native.observe` for a
        CPU bf16/fp16 chunk of a group strategy when it is built, else the torch reference), ``torch`` or
        ``native``: the same ranges, steps and improvements."""
        check_weight(w, args)
        grouped(w, args)  # the shape checks
        if w.device.type != "cpu":
            from . import gpu_search  # imports Triton: only for CUDA tensors

            if impl == "auto" and gpu_search.takes(w, args, self.total_steps if steps is None else steps):
                return Search(*gpu_search.search(self, w, args, steps))  # the CPU path's decisions, exactly (gpu_search.py)
            return self._on_cpu(w, args, steps, impl)
        return self._cpu(w, args, steps, impl)

    def _cpu(self, w: torch.Tensor, args: WeightArgs, steps: int | None, impl: str) -> Search:
        """The search of a CPU chunk: the C kernel (:meth:`_native`) where ``impl`` and the chunk let it, else torch."""
        if impl != "torch" and args.strategy in ("group", "tensor_group") and native_observe.takes(w) and (impl == "native" or native_observe.available()):
            total = self.total_steps if steps is None else steps
            found = self._native(w, args, total)
            if steps is None and self.needs_stop_pass:
                tracker = StopTracker(total, self.patience)
                tracker.add(found.improved)
                if tracker.steps < total:
                    found = self._native(w, args, tracker.steps)
            return found
        if impl == "native":
            raise ValueError("the native observer kernel takes a CPU bf16/fp16 chunk of a group strategy")
        return self._torch(w, args, steps)

    def _on_cpu(self, w: torch.Tensor, args: WeightArgs, steps: int | None, impl: str) -> Search:
        """The search of a CUDA chunk on the CPU, its results back on ``w``'s device: the bytes are the CPU path's
        (CUDA's pow and reduction order are not torch's CPU ones; what gpu_search does not take)."""
        found = self.search(w.cpu(), args, steps, impl)
        dev = w.device
        hits = None if found.hits is None else found.hits.to(dev)
        return Search(found.min.to(dev), found.max.to(dev), found.step.to(dev), found.improved, hits)

    def _native(self, w: torch.Tensor, args: WeightArgs, steps: int) -> Search:
        """``steps`` grid steps in the C kernel; the groups it cannot vouch for searched again by torch."""
        d = w.dtype
        qmin, qmax = FakeQuant.bounds(args)
        bit_range = torch.tensor(qmax - qmin).to(d)
        kind = "int" if args.type == "int" else ("fp8" if args.num_bits == 8 else "fp4")
        p = torch.tensor([1 - i / self.grid for i in range(steps)], dtype=torch.float32)
        mx_offset = (2 if args.num_bits == 4 else 8) if is_mx(args) else 0  # floor(log2(6)), floor(log2(448))
        common = (args.group_size, kind, args.symmetric, qmin, qmax, float(bit_range / 2), float(bit_range), self.expand, p)
        step, mn, mx, improved, unsure, hits = self._kernel(w, args, common, mx_offset)
        if bool(unsure.any()):
            again = self._again(w, args, unsure, steps)
            step[unsure], mn[unsure], mx[unsure] = again.step[:, 0], again.min[:, 0], again.max[:, 0]
            if hits is not None:
                hits[unsure] = again.hits[:, 0]
            improved |= again.improved
        return Search(mn, mx, step, improved, hits)

    def _kernel(self, w: torch.Tensor, args: WeightArgs, common: tuple, mx_offset: int):
        """The C kernel's search of ``w``: :func:`.native.observe.mse_search` with ``common`` (its arguments from ``g``
        to ``p``), the norm and ``mx_offset``."""
        norm = float(torch.tensor(self.norm).to(w.dtype))  # torch's pow of a D tensor takes its exponent in D
        return native_observe.mse_search(w, *common, norm, mx_offset)

    def _again(self, w: torch.Tensor, args: WeightArgs, unsure: torch.Tensor, steps: int) -> Search:
        """The torch search of the groups ``unsure`` (bool ``[N, G]``) of ``w``, each as a row of one group."""
        return self._torch(grouped(w, args)[unsure], args, steps)

    def _torch(self, w: torch.Tensor, args: WeightArgs, steps: int | None) -> Search:
        """The search in torch, operation for operation as upstream (module docstring)."""
        x = grouped(w, args)
        error = self._errors(x, args)
        mn0 = torch.amin(x, dim=-1) * self.expand
        mx0 = torch.amax(x, dim=-1) * self.expand
        best_err = self._worst(mn0)
        best_step = torch.full(mn0.shape, -1, dtype=torch.int16, device=x.device)
        hits = torch.zeros(mn0.shape, dtype=torch.int64, device=x.device) if (self.total_steps if steps is None else steps) <= 63 else None
        total = self.total_steps if steps is None else steps
        improved = torch.zeros(total, dtype=torch.bool)
        stale = 0
        for i in range(total):
            err = error(*self._candidate(mn0, mx0, i))
            better = err < best_err
            if bool(better.any()):
                improved[i] = True
                best_err = torch.where(better, err, best_err)
                best_step[better] = i
                if hits is not None:
                    hits |= better.to(torch.int64) << i
                stale = 0
            elif steps is None:
                stale += 1
                if self._stops(stale):
                    improved = improved[: i + 1]
                    break
        mn, mx = self.ranges_at(mn0, mx0, best_step)
        return Search(mn, mx, best_step, improved, hits)

    def _errors(self, x: torch.Tensor, args: WeightArgs):
        """The error function of one search of ``x`` ``[N, G, g]``: ``(mn, mx) -> sum(|q - x| ** norm)`` per group, in D
        (:meth:`FakeQuant.error`)."""
        q = FakeQuant(args, x.device)
        ax = x.abs() if q.is_fp4 else None
        return lambda mn, mx: q.error(x, mn, mx, self.norm, ax)

    def _worst(self, mn0: torch.Tensor) -> torch.Tensor:
        """The initial best error: ``finfo(D).max`` per group (``_grid_search_mse``)."""
        return torch.full_like(mn0, torch.finfo(mn0.dtype).max)

    def _stops(self, stale: int) -> bool:
        """Whether ``stale`` steps in a row without an improvement stop the search (global patience)."""
        return stale >= self.patience

    def _candidate(self, mn0, mx0, i):
        p = 1 - i / self.grid  # a Python float: ``min0 * p`` rounds once to D, as upstream
        return mn0 * p, mx0 * p

    def ranges_at(self, mn0: torch.Tensor, mx0: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges of grid steps ``step`` (int ``[N, G]``, -1 = unshrunk) from the unshrunk ``(mn0, mx0)``
        (``amin``/``amax`` times ``expand``, D ``[N, G]``): the same values the search returned."""
        # ``mn0 * p`` with p a Python float is D(fp32(mn0) * fp32(p)) (module docstring); p = 1 - i / grid in float64
        # on the tensor's device is the Python float's value (IEEE division and subtraction, each correctly rounded),
        # then rounded to fp32 as torch rounds the scalar: no table of the steps, and no wait for the largest step on a GPU
        p = (1 - step.clamp(min=0).to(torch.float64) / self.grid).to(torch.float32)
        kept = step >= 0
        return torch.where(kept, (mn0.float() * p).to(mn0.dtype), mn0), torch.where(kept, (mx0.float() * p).to(mx0.dtype), mx0)

    def ranges_from_steps(self, w: torch.Tensor, args: WeightArgs, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges of ``w`` for the grid steps a search recorded (``Search.step``), without searching again."""
        x = grouped(w, args)
        return self.ranges_at(torch.amin(x, dim=-1) * self.expand, torch.amax(x, dim=-1) * self.expand, step)

    @staticmethod
    def steps_at(hits: torch.Tensor, steps: int) -> torch.Tensor:
        """The grid step each group takes in a search of ``steps`` steps, from a longer search's ``Search.hits``:
        its last improvement before ``steps`` (int16, -1 = none), as a search of ``steps`` steps would find."""
        step = torch.full(hits.shape, -1, dtype=torch.int16, device=hits.device)
        for i in range(min(steps, 63)):
            step = torch.where((hits >> i) & 1 == 1, torch.tensor(i, dtype=torch.int16, device=hits.device), step)
        return step

    def stop_tracker(self) -> StopTracker:
        """A :class:`StopTracker` for one tensor."""
        return StopTracker(self.total_steps, self.patience)
