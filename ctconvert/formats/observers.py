"""Weight observers: the per-group ranges a format's quantizer turns into scales, llm-compressor's way.

An observer looks at a weight chunk ``w`` ``[N, K]`` (bf16/fp16/fp32) and returns, per quantization group,
the ``(min, max)`` range (in the weight's dtype D, shape ``[N, G]``) that the format's quantizer turns into
scales (``WeightFormat.quantize(..., ranges=...)``); the bytes then equal those of llm-compressor 0.14.0.1
``oneshot`` with ``QuantizationModifier(config_groups={...: {"weights": {..., "observer": NAME}}})`` on its
eager (CPU) path, and the output config records ``"observer": NAME`` (and ``"observer_kwargs": {}``) in the
weights' QuantizationArgs, as llm-compressor writes it.

Observers (llm-compressor's registry names, ``llmcompressor/observers/``, release 0.14.0.1):

====================== ====================================================================================
``minmax``             the group's min and max (ctconvert's default; llm-compressor's weight default
                       ``memoryless_minmax``, ``min_max.py: MemorylessMinMaxObserver``): today's bytes and
                       config (no ``observer`` field written)
``memoryless_mse``     ``mse.py: MemorylessMSEObserver``: maxshrink 0.20, patience 5, grid 100, norm 2.4,
                       expand 1.0: 20 steps, p = 1 .. 0.81
``nvfp4_expanded_mse`` ``mse.py: NVFP4ExpandedMSEObserver``: expand 1.8, maxshrink 1 - 0.8/1.8, grid 200,
                       patience 1000, norm 2.4 (PR #2950; ``fouroversix`` is an alias of it there):
                       ``int(maxshrink * grid)`` = 111 steps, p = 1 .. 0.45 (its docstring says 112)
====================== ====================================================================================

The search (``mse_quant.py: _grid_search_mse``, the eager implementation, used for every CPU tensor; the
Triton one, registered for CUDA, differs: a zero point fixed from the unshrunk range and per-group
patience with an error buffer, and is *not* what this module matches):

1. ``observed`` is the weight reshaped per strategy (``helpers.py: _flatten_weight``): group and
   tensor_group ``[1, N, G, g]``, channel ``[1, N, 1, K]``, tensor ``[1, 1, N*K]``. Here: ``[N, G, g]``.
2. ``min0 = amin(observed) * expand``, ``max0 = amax(observed) * expand`` over the group, in D.
3. For step ``i`` in ``range(int(maxshrink * grid))``: ``p = 1 - i / grid``, candidate range
   ``(min0 * p, max0 * p)`` in D; candidate scale and zero point by compressed-tensors 0.19.0
   ``quantization/utils/helpers.py: calculate_qparams`` with ``global_scale=None`` and, for
   tensor_group (NVFP4), ``scale_dtype=None`` (so the candidate NVFP4 scale is ``D(amax / 6)``, neither
   multiplied by a global scale nor rounded to E4M3); fake quantization by ``lifecycle/forward_helpers.py:
   _quantize_dequantize`` with the TOKEN strategy (``x / scale`` in D, ``+ zp``, clamp, round to the
   element type: ``torch.round`` for int, E4M3 for FP8, ``fp4_utils.py: cast_to_fp4`` for FP4, then
   ``(q - zp) * scale`` in D); error ``sum(|q - observed| ** norm)`` over the group, in D.
4. A group keeps the candidate whose error is strictly below its best so far (the first of equal
   errors wins; the initial best error is ``finfo(D).max``, so a group whose every error is inf keeps the
   unshrunk range). Patience is *global*: the loop stops after ``patience`` consecutive steps in which no
   group of the whole tensor improved. With ``nvfp4_expanded_mse`` (patience 1000 > 111 steps) it never
   stops early; with ``memoryless_mse`` (patience 5, 20 steps) it can, and a row chunk alone would stop at
   a different step than the whole tensor: :class:`StopTracker` finds the whole tensor's step count from
   every chunk's ``improved`` steps, and ``search(..., steps=S)`` then gives each chunk the whole tensor's
   ranges.
5. The searched ranges are the observer's statistics: ``base.py: Observer.get_qparams`` computes the
   scales from them by ``calculate_qparams`` (the format's usual min/max arithmetic), and for tensor_group
   the global scale from the absmax of the *searched* ranges of every fused partner
   (``base.py: Observer.get_global_scale``, ``fusion.py: FusionHandler``, ``helpers.py:
   FUSED_LAYER_NAMES``: q/k/v, gate/up, q_a/kv_a_with_mqa, w1/w3): :func:`range_absmax`.

Every step here is the same torch operation on the same dtypes as llm-compressor's (so the same bytes,
with the same torch, rounding, reductions and ``pow`` included); for MX schemes (:func:`is_mx`) the
candidate scale is the E8M0 one of ``calculate_qparams`` (``generate_mx_scales``: the search keeps
``scale_dtype=uint8`` for the group strategy). Two facts of torch 2.13's CPU kernels
that this depends on (and that a fused kernel must reproduce): a D tensor times a Python float is
``D(float32(x) * float32(p))``; and ``pow`` of a bf16/fp16 tensor with a Python scalar exponent rounds the
exponent to D first, so the error norm is in effect 2.40625 for bf16 weights and 2.400390625 for fp16
(2.4 for fp32), ``|d| ** norm`` rounded to D, and the group sum accumulates in fp32 and rounds to D. Formats: int (symmetric or not), FP8
(channel, tensor, group), NVFP4 (tensor_group) and MXFP4/MXFP8 (group 32); the block strategy is
refused (``ValueError``).

How a streaming quantizer uses it (one chunk = some rows of one tensor; the pipeline's part, not here):

- ``minmax``: nothing changes (no ranges are passed, the fused quantizers run as today).
- The observer replaces the min/max of the scale step only: ``fmt.quantize(chunk, args, global_scale,
  ranges=(mn, mx))`` with the chunk's searched ranges; everything after (scale arithmetic, rounding,
  packing) is the format's own.
- Pre-pass, when the chunk alone does not decide its ranges:
  NVFP4 (``fmt.needs_global_scale``): the fused set's global scale is
  ``nvfp4_global_scale(max over members and chunks of range_absmax(*search.ranges), D)`` -- the searched
  ranges, not the weights' absmax; global patience (``obs.needs_stop_pass``, ``memoryless_mse``): each
  chunk's ``search(chunk, args, steps=obs.total_steps)`` goes into ``obs.stop_tracker().add(improved)``.
  Keep each chunk's ``Search.step`` (int16 per group; with global patience ``Search.hits``, int64 per
  group) instead of searching again: in the quantize pass ``obs.ranges_from_steps(chunk, args, step)``
  (with ``step = obs.steps_at(hits, tracker.steps)``) gives the same ranges from the chunk's own min/max.
  Both can share one pre-pass (:class:`TensorSearch` does both: ``add`` per chunk, ``absmax``, then
  ``ranges`` per chunk); a tensor needs none when neither applies (a group format with
  ``nvfp4_expanded_mse``, whose patience never stops it: ``obs.ranges(chunk, args)`` per chunk).
- The tensor strategy (FP8 per tensor) searches the whole tensor as one group: its chunk is the tensor.
- Output config: the weights' QuantizationArgs of the group get ``obs.config_fields()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import WeightArgs
from .mx import round_pow2_bits
from .native import observe as native_observe

__all__ = [
    "OBSERVERS",
    "MSEObserver",
    "MinMaxObserver",
    "Search",
    "StopTracker",
    "TensorSearch",
    "WeightObserver",
    "get_observer",
    "grouped",
    "is_mx",
    "range_absmax",
]


def grouped(w: torch.Tensor, args: WeightArgs) -> torch.Tensor:
    """``w`` ``[N, K]`` as llm-compressor observes it, without the leading observation dim: ``[N, G, g]``.

    group / tensor_group: ``[N, K/g, g]``; channel: ``[N, 1, K]``; tensor: ``[1, 1, N*K]`` (the chunk must then
    be the whole tensor). Raises ``ValueError`` for a non-2-D ``w``, a K that is not a multiple of the group
    size, and the block strategy.
    """
    if w.dim() != 2:
        raise ValueError(f"an observer takes a 2-D weight chunk, got shape {tuple(w.shape)}")
    n, k = w.shape
    if args.strategy in ("group", "tensor_group"):
        g = args.group_size
        if not g or k % g:
            raise ValueError(f"K={k} is not a multiple of the group size {g}")
        return w.reshape(n, k // g, g)
    if args.strategy == "channel":
        return w.reshape(n, 1, k)
    if args.strategy == "tensor":
        return w.reshape(1, 1, n * k)
    raise ValueError(f"observers do not take the {args.strategy!r} strategy")


def _check(w: torch.Tensor, args: WeightArgs) -> None:
    if not w.dtype.is_floating_point or w.element_size() < 2:
        raise ValueError(f"an observer takes a bf16/fp16/fp32 weight, got {w.dtype}")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("the weight holds NaN or inf: no observer range can be searched for it")
    if args.type == "float" and args.num_bits == 4 and not args.symmetric:
        raise ValueError("asymmetric FP4 is not a quantization compressed-tensors implements")
    if args.type == "float" and args.num_bits not in (4, 8):
        raise ValueError(f"float weights of {args.num_bits} bits are not taken by the observers")
    if args.type == "float" and args.num_bits == 4 and args.strategy not in ("tensor_group",) and not is_mx(args):
        raise ValueError("FP4 takes an observer as NVFP4 (tensor_group, 16) or MXFP4 (group, 32)")


def is_mx(args: WeightArgs) -> bool:
    """Whether ``args`` are an MX scheme (E8M0 scales): float, 4 or 8 bits, strategy group, group 32, as
    compressed-tensors' ``should_generate_mx_scales`` tells (there also ``scale_dtype=uint8``, which
    :class:`WeightArgs` does not carry: ctconvert writes no FP8 group-32 scheme with D scales)."""
    return args.type == "float" and args.num_bits in (4, 8) and args.strategy == "group" and args.group_size == 32


def range_absmax(mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """The absmax of searched ranges, as ``Observer.get_global_scale`` takes it: ``max(max(mx), -min(mn))``.

    ``mn``/``mx``: the ranges of one tensor (any shape, dtype D). Returns fp32 0-d holding a value of D;
    the NVFP4 global scale of a fused set is :func:`.fp4.nvfp4_global_scale` of the max over its members.
    """
    return torch.maximum(mx.max(), -mn.min()).to(torch.float32)


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

    def search(self, w: torch.Tensor, args: WeightArgs, steps: int | None = None, impl: str = "auto") -> Search:
        """The ranges of ``w`` ``[N, K]`` for ``args``; ``steps``: run exactly this many grid steps, without
        stopping early (None: stop as llm-compressor does, with ``w`` taken as the whole tensor)."""
        raise NotImplementedError

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
        _check(w, args)
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
        _check(w, args)
        grouped(w, args)  # the shape checks
        if w.device.type != "cpu":
            # the bytes are the CPU path's: CUDA's pow and reduction order are not torch's CPU ones (no GPU kernel yet)
            found = self.search(w.cpu(), args, steps, impl)
            dev = w.device
            hits = None if found.hits is None else found.hits.to(dev)
            return Search(found.min.to(dev), found.max.to(dev), found.step.to(dev), found.improved, hits)
        if impl != "torch" and args.strategy in ("group", "tensor_group") and native_observe.takes(w) and (impl == "native" or native_observe.available()):
            total = self.total_steps if steps is None else steps
            found = self._native(w, args, total)
            if steps is None and self.patience < total:
                tracker = StopTracker(total, self.patience)
                tracker.add(found.improved)
                if tracker.steps < total:
                    found = self._native(w, args, tracker.steps)
            return found
        if impl == "native":
            raise ValueError("the native observer kernel takes a CPU bf16/fp16 chunk of a group strategy")
        return self._torch(w, args, steps)

    def _native(self, w: torch.Tensor, args: WeightArgs, steps: int) -> Search:
        """``steps`` grid steps in the C kernel; the groups it cannot vouch for searched again by torch."""
        d = w.dtype
        g = args.group_size
        qmin, qmax = _FakeQuant.bounds(args)
        bit_range = torch.tensor(qmax - qmin).to(d)
        kind = "int" if args.type == "int" else ("fp8" if args.num_bits == 8 else "fp4")
        p = torch.tensor([1 - i / self.grid for i in range(steps)], dtype=torch.float32)
        norm = float(torch.tensor(self.norm).to(d))  # torch's pow of a D tensor takes its exponent in D
        mx_offset = (2 if args.num_bits == 4 else 8) if is_mx(args) else 0  # floor(log2(6)), floor(log2(448))
        step, mn, mx, improved, unsure, hits = native_observe.mse_search(
            w, g, kind, args.symmetric, qmin, qmax, float(bit_range / 2), float(bit_range), self.expand, p, norm, mx_offset
        )
        if bool(unsure.any()):
            again = self._torch(grouped(w, args)[unsure], args, steps)
            step[unsure], mn[unsure], mx[unsure] = again.step[:, 0], again.min[:, 0], again.max[:, 0]
            if hits is not None:
                hits[unsure] = again.hits[:, 0]
            improved |= again.improved
        return Search(mn, mx, step, improved, hits)

    def _torch(self, w: torch.Tensor, args: WeightArgs, steps: int | None) -> Search:
        """The search in torch, operation for operation as upstream (module docstring)."""
        x = grouped(w, args)
        q = _FakeQuant(args, x.device)
        ax = x.abs() if args.type == "float" and args.num_bits == 4 else None
        mn0 = torch.amin(x, dim=-1) * self.expand
        mx0 = torch.amax(x, dim=-1) * self.expand
        best_err = torch.full_like(mn0, torch.finfo(mn0.dtype).max)
        best_step = torch.full(mn0.shape, -1, dtype=torch.int16, device=x.device)
        hits = torch.zeros(mn0.shape, dtype=torch.int64, device=x.device) if (self.total_steps if steps is None else steps) <= 63 else None
        total = self.total_steps if steps is None else steps
        improved = torch.zeros(total, dtype=torch.bool)
        stale = 0
        for i in range(total):
            err = q.error(x, *self._candidate(mn0, mx0, i), self.norm, ax)
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
                if stale >= self.patience:
                    improved = improved[: i + 1]
                    break
        mn, mx = self.ranges_at(mn0, mx0, best_step)
        return Search(mn, mx, best_step, improved, hits)

    def _candidate(self, mn0, mx0, i):
        p = 1 - i / self.grid  # a Python float: ``min0 * p`` rounds once to D, as upstream
        return mn0 * p, mx0 * p

    def ranges_at(self, mn0: torch.Tensor, mx0: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges of grid steps ``step`` (int ``[N, G]``, -1 = unshrunk) from the unshrunk ``(mn0, mx0)``
        (``amin``/``amax`` times ``expand``, D ``[N, G]``): the same values the search returned."""
        mn, mx = mn0.clone(), mx0.clone()
        for i in torch.unique(step[step >= 0]).tolist():
            sel = step == i
            cmn, cmx = self._candidate(mn0[sel], mx0[sel], i)
            mn[sel], mx[sel] = cmn, cmx
        return mn, mx

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


class StopTracker:
    """The number of grid steps llm-compressor's search of a whole tensor runs, from its chunks' searches.

    A group's improvement at step ``i`` depends only on its own errors at steps ``<= i``, so the whole
    tensor improves at step ``i`` exactly when some chunk's full search (``search(chunk, args,
    steps=total)``) did; the loop stops after ``patience`` consecutive steps without one. :meth:`add` each
    chunk's ``Search.improved``; :attr:`steps` is then the count to pass as ``search(..., steps=...)``;
    :attr:`final` says that no further chunk can change it (every later chunk may be skipped).
    """

    def __init__(self, total: int, patience: int):
        self.total, self.patience = total, patience
        self.any = torch.zeros(total, dtype=torch.bool)

    def add(self, improved: torch.Tensor) -> None:
        """OR in one chunk's ``Search.improved`` (a full search: ``total`` steps)."""
        if improved.numel() != self.total:
            raise ValueError(f"a stop pass needs searches of all {self.total} steps, got {improved.numel()}")
        self.any |= improved.cpu()

    @property
    def steps(self) -> int:
        stale = 0
        for i, hit in enumerate(self.any.tolist()):
            stale = 0 if hit else stale + 1
            if stale >= self.patience:
                return i + 1
        return self.total

    @property
    def final(self) -> bool:
        return self.steps == self.total


class TensorSearch:
    """The pre-pass of one tensor, chunk by chunk, and its ranges in the quantize pass (module docstring).

    ``add(row0, chunk)`` searches a row chunk in full (every grid step), keeps its groups' steps (int16,
    or with global patience the int64 ``hits`` and the unshrunk range) and folds in its ``improved`` steps;
    :attr:`absmax` is then the tensor's searched absmax for the NVFP4 global scale (:func:`range_absmax`),
    and ``ranges(row0, chunk)`` the chunk's ranges from its kept steps (no second search), equal to one
    search of the whole tensor. Memory: 2 bytes per group (12 with global patience) until :meth:`ranges`
    takes them.
    Example::

        ts = TensorSearch(OBSERVERS["nvfp4_expanded_mse"], args)
        for r0, chunk in chunks:                    # pass 1, all members of a fused set
            ts.add(r0, chunk)
        gs = nvfp4_global_scale(max(t.absmax for t in fused_set), dtype)
        for r0, chunk in chunks:                    # pass 2
            out = fmt.quantize(chunk, args, gs, ranges=ts.ranges(r0, chunk))
    """

    def __init__(self, observer: MSEObserver, args: WeightArgs, impl: str = "auto"):
        self.observer, self.args, self.impl = observer, args, impl
        self.tracker = observer.stop_tracker() if observer.needs_stop_pass else None
        self._absmax = torch.zeros((), dtype=torch.float32)
        self._kept: dict[int, tuple] = {}

    def add(self, row0: int, chunk: torch.Tensor) -> None:
        """Search rows ``[row0, row0 + len(chunk))`` (every grid step) and keep what the quantize pass needs."""
        found = self.observer.search(chunk, self.args, steps=self.observer.total_steps, impl=self.impl)
        if self.tracker is None:
            if found.min.numel():
                self._absmax = torch.maximum(self._absmax, range_absmax(found.min, found.max).cpu())
            self._kept[row0] = (found.step,)
            return
        self.tracker.add(found.improved)
        x = grouped(chunk, self.args)
        self._kept[row0] = (found.hits, torch.amin(x, dim=-1) * self.observer.expand, torch.amax(x, dim=-1) * self.observer.expand)

    @property
    def steps(self) -> int:
        """The grid steps the whole tensor's search runs (known once every chunk is added)."""
        return self.observer.total_steps if self.tracker is None else self.tracker.steps

    @property
    def absmax(self) -> torch.Tensor:
        """fp32 0-d: the tensor's searched ranges' absmax (:func:`range_absmax`), once every chunk is added."""
        if self.tracker is None:
            return self._absmax
        out = torch.zeros((), dtype=torch.float32)
        for hits, mn0, mx0 in self._kept.values():
            if mn0.numel():
                mn, mx = self.observer.ranges_at(mn0, mx0, self.observer.steps_at(hits, self.steps))
                out = torch.maximum(out, range_absmax(mn, mx).cpu())
        return out

    def ranges(self, row0: int, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges of the chunk added at ``row0`` (the same rows), D ``[rows, G]``, as one search of the whole
        tensor finds them; every chunk must have been added first. Raises ``KeyError`` for a chunk never added."""
        kept = self._kept.pop(row0)
        if self.tracker is None:
            return self.observer.ranges_from_steps(chunk, self.args, kept[0].to(chunk.device))
        hits, mn0, mx0 = kept
        return self.observer.ranges_at(mn0, mx0, self.observer.steps_at(hits, self.steps))


class _FakeQuant:
    """Candidate qparams and fake quantization of one :class:`WeightArgs`, compressed-tensors 0.19.0's eager ops.

    ``calculate_qparams`` (``quantization/utils/helpers.py``) with ``scale_dtype=None`` and no global scale,
    then ``_quantize_dequantize`` (``lifecycle/forward_helpers.py``) with the TOKEN strategy: each line of
    :meth:`qparams` and :meth:`error` is one upstream torch call on the same operand types (0-d fp32
    range tensors, D scales, an int8 or E4M3 zero point).
    """

    def __init__(self, args: WeightArgs, device):
        self.args = args
        qmin, qmax = self.bounds(args)
        self.q_min, self.q_max = torch.tensor(qmin, device=device), torch.tensor(qmax, device=device)
        self.mx = is_mx(args)
        if args.type == "int":
            self.zp_dtype = torch.int8 if args.num_bits <= 8 else torch.int16
        else:
            self.zp_dtype = torch.float8_e4m3fn

    def _mx_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The E8M0 scale of an MX candidate, in D: compressed-tensors 0.19.0 ``generate_mx_scales``
        (``127 + floor(log2(round_to_power_2(amax))) - offset`` in D), the ``scale_dtype=uint8`` rounding
        (clamp to [0, 255], round, back to D), ``maybe_convert_from_mx_exp`` (``2.0 ** (e - 127)`` in fp32,
        then D) and the zero guard (``eps`` of uint8: 1)."""
        d = amax.dtype
        offset = 2 if self.args.num_bits == 4 else 8  # floor(log2(6)), floor(log2(448))
        p2 = round_pow2_bits(amax).to(d)
        e = 127 + torch.floor(torch.log2(p2)) - offset
        e = torch.round(torch.clamp(e, 0, 255)).to(torch.uint8).to(d)
        scale = (2.00 ** ((e.to(torch.int32) - 127).to(torch.float))).to(d)
        return torch.where(scale == 0, torch.tensor(1.0, dtype=d, device=scale.device), scale)

    @staticmethod
    def bounds(args: WeightArgs) -> tuple[float, float]:
        """``(q_min, q_max)`` of ``calculate_range``: ``±2^(B-1)`` (minus one above) for int, ±448 FP8, ±6 FP4."""
        if args.type == "int":
            half = 2.0**args.num_bits / 2
            return -half, half - 1
        m = 448.0 if args.num_bits == 8 else 6.0
        return -m, m

    def qparams(self, mn: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mn = torch.min(mn, torch.zeros_like(mn))
        mx = torch.max(mx, torch.zeros_like(mx))
        bit_range = self.q_max - self.q_min
        if self.mx:
            scale = self._mx_scale(torch.max(torch.abs(mn), torch.abs(mx)))
            return scale, torch.zeros(scale.shape, device=mn.device, dtype=torch.uint8)
        if self.args.symmetric:
            scale = torch.max(torch.abs(mn), torch.abs(mx)) / (bit_range.to(mx.dtype) / 2)
            zp = torch.zeros(scale.shape, device=mn.device, dtype=mn.dtype)
        else:
            scale = (mx - mn) / bit_range.to(mx.dtype)
            zp = torch.clamp(self.q_min - (mn / scale), self.q_min, self.q_max)
        eps = torch.finfo(scale.dtype).eps
        scale = torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype, device=scale.device), scale)
        if self.zp_dtype.is_floating_point:
            fi = torch.finfo(self.zp_dtype)
            zp = torch.clamp(zp, fi.min, fi.max).to(self.zp_dtype)
        else:
            ii = torch.iinfo(self.zp_dtype)
            zp = torch.round(torch.clamp(zp, ii.min, ii.max)).to(self.zp_dtype)
        return scale, zp

    def error(self, x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, norm: float, ax: torch.Tensor | None = None) -> torch.Tensor:
        """``sum(|fake_quant(x) - x| ** norm)`` over the last dim of ``x`` ``[N, G, g]``, D ``[N, G]``.

        Two shortcuts give the same values as upstream's ops: a symmetric zero point is 0, so adding and
        subtracting it changes no value (only the sign of a zero, which ``|q - x|`` drops); and for FP4,
        whose clamp and rounding are odd functions (``x / s``, RNE, ``level * s`` all commute with the sign),
        ``|q - x|`` is computed on ``ax = |x|`` (given by the caller, once per search), and the clamp to 6
        is left out (every value above 5 rounds to 6 either way).
        """
        scale, zp = self.qparams(mn, mx)
        scale, zp = scale.unsqueeze(-1), zp.unsqueeze(-1)
        if self.args.type == "float" and self.args.num_bits == 4:
            a = ax if ax is not None else x.abs()  # (the MX scale is also positive: the same shortcut)
            # no clamp to 6: every value above 5 takes the level 6 with or without it
            q = (_fp4_level(a / scale) * scale).to(x.dtype)
            return torch.sum((q - a).abs().pow(norm), dim=-1)
        scaled = x / scale
        if not self.args.symmetric:
            scaled += zp.to(x.dtype)
        t = torch.clamp(scaled, self.q_min, self.q_max)
        if self.args.type == "int":
            r = torch.round(t)
        else:
            r = t.to(torch.float8_e4m3fn).to(scaled.dtype)
        deq = r.to(scale.dtype)
        if not self.args.symmetric:
            deq = deq - zp.to(scale.dtype)
        q = (deq * scale).to(x.dtype)
        return torch.sum((q - x).abs().pow(norm), dim=-1)


_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_BOUNDS: dict[torch.dtype, torch.Tensor] = {}


def _next_up(v: float, dtype: torch.dtype) -> float:
    """The smallest value of ``dtype`` above ``v`` (> 0)."""
    t = torch.tensor([v], dtype=dtype)
    bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    return (bits + 1).view(dtype).item()


def _fp4_level(a: torch.Tensor) -> torch.Tensor:
    """The E2M1 magnitude of ``a >= 0`` (anything above 5 is 6), in ``a``'s dtype, as ``cast_to_fp4`` rounds it
    (compressed-tensors 0.19.0 ``quantization/utils/fp4_utils.py``, eager): ``<= .25 -> 0``, ``< .75 -> .5``,
    ``<= 1.25 -> 1``, ``< 1.75 -> 1.5``, ``<= 2.5 -> 2``, ``< 3.5 -> 3``, ``<= 5 -> 4``, else 6; one
    ``bucketize`` over the thresholds as values of the dtype (a strict ``>`` is ``>=`` the next value up)."""
    d = a.dtype
    b = _BOUNDS.get(d)
    if b is None:
        up = [_next_up(0.25, d), 0.75, _next_up(1.25, d), 1.75, _next_up(2.5, d), 3.5, _next_up(5.0, d)]
        b = _BOUNDS[d] = torch.tensor(up, dtype=d)
    idx = torch.bucketize(a, b.to(a.device), right=True)
    return torch.tensor(_LEVELS, dtype=d, device=a.device)[idx]


def _cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """E2M1 rounding of compressed-tensors 0.19.0 ``quantization/utils/fp4_utils.py: cast_to_fp4`` (eager),
    step by step (the tests' reference for :func:`_fp4_level`)."""
    sign = torch.sign(x)
    a = torch.abs(x)
    a[(a >= 0.0) & (a <= 0.25)] = 0.0
    a[(a > 0.25) & (a < 0.75)] = 0.5
    a[(a >= 0.75) & (a <= 1.25)] = 1.0
    a[(a > 1.25) & (a < 1.75)] = 1.5
    a[(a >= 1.75) & (a <= 2.5)] = 2.0
    a[(a > 2.5) & (a < 3.5)] = 3.0
    a[(a >= 3.5) & (a <= 5.0)] = 4.0
    a[a > 5.0] = 6.0
    return a * sign


#: every observer by llm-compressor's name, with its defaults (``mse.py``, 0.14.0.1)
OBSERVERS: dict[str, WeightObserver] = {
    o.name: o
    for o in (
        MinMaxObserver(),
        MSEObserver("memoryless_mse", maxshrink=0.20, patience=5, grid=100.0, norm=2.4, expand=1.0),
        MSEObserver("nvfp4_expanded_mse", maxshrink=1 - 0.8 / 1.8, patience=1000, grid=200.0, norm=2.4, expand=1.8),
    )
}


def get_observer(name: str | None) -> WeightObserver:
    """The observer of a name (``None``, ``minmax`` and ``memoryless_minmax``: min/max); raises ``ValueError``
    naming the known ones for another."""
    if name in (None, "minmax", "memoryless_minmax"):
        return OBSERVERS["minmax"]
    try:
        return OBSERVERS[name]
    except KeyError:
        raise ValueError(f"unknown observer {name!r}: one of {', '.join(OBSERVERS)}") from None
