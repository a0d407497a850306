"""The MSE observers' search on the GPU, deciding exactly what the CPU path decides: :func:`search`.

The CPU path (``search.py``: ``observe.c`` and the torch reference) takes, per group and grid step, torch's
error ``E`` (a D value) and keeps a step when ``E < best``. A GPU cannot recompute ``E`` operation for
operation (its ``pow`` and its fp32 summation order are not torch's CPU ones), so:

1. :func:`gpu_kernel.mse_search_kernel` runs every step of every group and bounds each error: ``lo <= E <= hi``,
   ``|d| ** norm`` from :class:`PowTable` (torch's own values for each D value), the sum widened by the error any
   fp32 summation order can make (``gpu_kernel``'s docstring gives the bound and why it holds). A comparison
   is decided when the bounds say it (``hi < best_lo``: kept; ``lo >= best_hi``: not); the steps, the ranges
   and the improvements of a group whose every comparison is decided are then exactly the CPU path's.
2. The other groups (typically a few in a thousand) are settled exactly (:func:`_settle`): the kernel writes
   their ``[lo, hi]`` at every step; where ``lo == hi`` that is ``E``; for the rest (where an fp32 sum lies
   within the bound of a rounding boundary of D: one or two steps of such a group) the kernel writes the
   elements' ``|q - x|`` (exact: elementwise IEEE arithmetic) and torch takes their ``pow`` and sum on the CPU,
   the reference's own last operations (``FakeQuant.error``); then the comparisons run on the exact sequence.
3. Global patience (``memoryless_mse``) runs on the exact improvements, as on the CPU (:class:`StopTracker`).

What it does not decide: a D value whose ``|d| ** norm`` torch's vectorized and scalar kernels round
differently (none for bf16 and fp16 at norm 2.4 with torch 2.13 on AVX-512; :class:`PowTable` checks on the
machine) makes torch's own result depend on where the element falls in its call; the CPU path then depends on
it too, and such a step is settled by one torch call of this module's layout.

Takes CUDA bf16/fp16 chunks of group strategies (group, tensor_group: NVFP4, MXFP4/MXFP8, int groups) and up
to 128 grid steps (:func:`takes`); :class:`~.search.MSEObserver` searches others on the CPU. With Triton's
interpreter (``TRITON_INTERPRET=1``) it also runs on CPU tensors (the tests).
"""

from __future__ import annotations

import os

import torch

from ..base import WeightArgs
from . import gpu_kernel
from .fake_quant import FakeQuant
from .groups import grouped, is_mx
from .patience import StopTracker

__all__ = ["PowTable", "available", "search", "takes"]

MAX_STEPS = 128  # two int64 words of improvement bits per group
_DT = {torch.bfloat16: 0, torch.float16: 1}
#: launch configuration: elements per program (BLOCK groups of the group size), warps per program
TUNE = {"elems": 1024, "num_warps": 2}  # the fastest of bench_observers.py --tune on an H200


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Whether the kernel can run: Triton, and CUDA (or Triton's interpreter)."""
    return gpu_kernel.HAVE_TRITON and (torch.cuda.is_available() or _interpreting())


def takes(w: torch.Tensor, args: WeightArgs, steps: int) -> bool:
    """Whether :func:`search` takes chunk ``w`` for ``args`` and ``steps`` grid steps: a CUDA (or, interpreting,
    any) 2-D bf16/fp16 tensor of a group strategy, at most :data:`MAX_STEPS` steps, with the kernel available."""
    on = w.device.type == "cuda" or _interpreting()
    return on and available() and w.dtype in _DT and w.dim() == 2 and args.strategy in ("group", "tensor_group") and steps <= MAX_STEPS


class PowTable:
    """torch's ``|d| ** norm`` of every non-negative value of D (bit pattern ``i`` of D's 15 magnitude bits),
    computed by torch itself on the CPU (``Tensor.pow`` with a Python exponent, as the reference calls it), as
    fp32 ``lo``/``hi`` ``[32768]`` on ``device``: its vectorized and its scalar kernel (a tensor shorter than one
    vector) both run, ``lo``/``hi`` their minimum and maximum (equal wherever they agree: :attr:`exact`);
    NaN and inf (and their powers) count as inf, as in ``observe.c``'s table."""

    _cache: dict = {}

    def __init__(self, dtype: torch.dtype, norm: float, device):
        v = torch.arange(0x8000, dtype=torch.int32).to(torch.int16).view(dtype)
        vec = v.pow(norm).float()
        one = torch.empty_like(vec)
        for i in range(0, 0x8000, 7):  # 7 elements: below any vector width, torch's scalar loop
            one[i : i + 7] = v[i : i + 7].clone().pow(norm).float()
        bad = ~torch.isfinite(v.float())
        lo, hi = torch.minimum(vec, one), torch.maximum(vec, one)
        lo[bad | lo.isnan()] = float("inf")
        hi[bad | hi.isnan()] = float("inf")
        self.exact = bool(torch.equal(lo, hi))
        self.lo, self.hi = lo.to(device), hi.to(device)

    @classmethod
    def get(cls, dtype: torch.dtype, norm: float, device) -> PowTable:
        """The table of ``(dtype, norm)`` on ``device`` (built once)."""
        key = (dtype, norm, str(device))
        if key not in cls._cache:
            cls._cache[key] = cls(dtype, norm, device)
        return cls._cache[key]


def _shrink(steps: int, grid: float, device) -> torch.Tensor:
    """fp32 ``[steps]``: ``1 - i / grid`` as torch takes the Python float (``_grid_search_mse``)."""
    return torch.tensor([1 - i / grid for i in range(steps)], dtype=torch.float32, device=device)


class _Launch:
    """One observer's kernel arguments for chunks of one dtype (the constants of ``observe.c``'s call)."""

    def __init__(self, observer, args: WeightArgs, w: torch.Tensor, steps: int, widen: float = 1.0):
        d = w.dtype
        self.observer, self.args, self.steps, self.device = observer, args, steps, w.device
        self.g = args.group_size
        qmin, qmax = FakeQuant.bounds(args)
        rng = torch.tensor(qmax - qmin).to(d)
        self.kind = gpu_kernel.KIND_INT if args.type == "int" else (gpu_kernel.KIND_FP8 if args.num_bits == 8 else gpu_kernel.KIND_FP4)
        self.table = PowTable.get(d, observer.norm, w.device)
        self.p = _shrink(steps, observer.grid, w.device)
        m = self.g * 2.0**-23 * widen  # observe.c's widening of a sum (gpu_kernel's docstring)
        self.scalars = (qmin, qmax, float(rng / 2), float(rng), float(observer.expand), torch.finfo(d).max, torch.finfo(d).eps, 1.0 - m, 1.0 + m)
        self.mx_off = (2 if args.num_bits == 4 else 8) if is_mx(args) else 0
        gp = 1 << max(0, (self.g - 1).bit_length())  # the group padded to a power of two (Triton's block shapes)
        self.cols = torch.arange(gp, dtype=torch.int32, device=w.device)
        self.consts = dict(
            G=self.g, GP=gp, BLOCK=max(1, TUNE["elems"] // gp), DT=_DT[d], KIND=self.kind, SYM=bool(args.symmetric), MX_OFF=self.mx_off,
            TWO=not self.table.exact, HW=not _interpreting(),
        )  # fmt: skip

    def run(self, xg: torch.Tensor, idx: torch.Tensor | None = None, pstep: torch.Tensor | None = None):
        """The kernel over groups ``xg`` ``[R, g]``: the decisions (a dict of tensors); with ``idx``, the bounds
        ``(lo, hi)`` of those groups at every step; with ``idx`` and ``pstep``, ``|q - x|`` of group ``idx[r]`` at
        step ``pstep[r]`` (D ``[len(idx), g]``)."""
        r = xg.shape[0] if idx is None else idx.numel()
        block = self.consts["BLOCK"]
        programs = max(1, -(-r // block))
        dev = xg.device
        out = dict(
            step=torch.empty(r, dtype=torch.int16, device=dev), mn=torch.empty(r, dtype=xg.dtype, device=dev),
            mx=torch.empty(r, dtype=xg.dtype, device=dev), hits=torch.empty(r, dtype=torch.int64, device=dev),
            unsure=torch.empty(r, dtype=torch.uint8, device=dev), counted=torch.zeros(2 * programs, dtype=torch.int64, device=dev),
        ) if idx is None else {}  # fmt: skip
        mode = 0 if idx is None else (1 if pstep is None else 2)
        lo = torch.empty((r, self.steps) if mode == 1 else (1,), dtype=torch.float32, device=dev)
        hi = torch.empty_like(lo)
        d = torch.empty((r, self.g) if mode == 2 else (1,), dtype=xg.dtype, device=dev)
        any_ = lo  # a pointer the mode does not read
        if r:
            gpu_kernel.mse_search_kernel[(programs,)](
                xg, any_ if idx is None else idx, any_ if pstep is None else pstep, self.cols, self.p, self.table.lo, self.table.hi, d,
                *(out.get(k, any_) for k in ("step", "mn", "mx", "hits", "unsure", "counted")), lo, hi,
                r, *self.scalars, S=self.steps, DUMP=mode, num_warps=TUNE["num_warps"], **self.consts,
            )  # fmt: skip
        return (out, (lo, hi), d)[mode]


def _improved(counted: torch.Tensor, steps: int) -> torch.Tensor:
    """bool ``[steps]`` (CPU): the steps whose bit is set in any program's two words ``counted``."""
    words = counted.view(-1, 2)
    bits = ((words[:, :, None] >> torch.arange(64, device=counted.device)) & 1).amax(0).flatten()  # word 0's bits, then word 1's
    return bits[:steps].bool().cpu()


def _exact_errors(launch: _Launch, xg: torch.Tensor, idx: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """fp32 ``[U, S]`` (on ``lo``'s device): torch's errors of groups ``idx`` at every step where they matter: the
    bounds where they meet, else, for those (group, step) pairs, the kernel's exact ``|q - x|`` and torch's own
    ``sum(... .pow(norm), dim=-1)`` of it on the CPU (``FakeQuant.error``'s last step, the same values); a step
    whose ``lo`` is at least some earlier step's ``hi`` (or D's max) cannot improve whatever its error, and keeps
    ``lo``."""
    dmax = torch.full((lo.shape[0], 1), launch.scalars[5], device=lo.device)
    before = torch.cat([dmax, hi[:, :-1]], dim=1).cummin(dim=1).values  # at least the best error before each step
    u, i = torch.nonzero((lo != hi) & (lo < before), as_tuple=True)
    if not u.numel():
        return lo
    d = launch.run(xg, idx[u], i.to(torch.int32)).cpu()  # |q - x| of each pair, exact (the kernel's arithmetic)
    err = lo.clone()
    err[u, i] = torch.sum(d.pow(launch.observer.norm), dim=-1).float().to(lo.device)  # torch's pow and sum, on the CPU
    return err


def _decide(err: torch.Tensor, dmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The search's comparisons on exact errors ``err`` fp32 ``[U, S]`` (any device): (step int16 ``[U]``, hits
    int64 ``[U]`` (steps < 63), improved bool ``[S]``), as ``MSEObserver._torch`` keeps them: step ``i`` improves
    where its error is strictly below every earlier one and ``dmax`` (so the first of equal errors wins, and an
    error of inf or NaN never improves: NaN counts as inf here)."""
    u, steps = err.shape
    dev = err.device
    e = torch.nan_to_num(err, nan=float("inf"), posinf=float("inf"))
    before = torch.cat([torch.full((u, 1), dmax, dtype=e.dtype, device=dev), e[:, :-1]], dim=1).cummin(dim=1).values
    better = e < before
    idx = torch.arange(steps, dtype=torch.int64, device=dev)
    step = torch.cat([torch.full((u, 1), -1, device=dev), torch.where(better, idx, -1)], dim=1).amax(dim=1).to(torch.int16)
    hits = (better[:, :63].to(torch.int64) << idx[:63]).sum(dim=1)  # distinct bits: their sum is their OR
    return step, hits, better.any(dim=0)


def _settle(launch: _Launch, xg: torch.Tensor, out: dict, improved: torch.Tensor) -> None:
    """Settle the unsure groups of ``out`` exactly (module docstring, 2.), in place; ORs their improvements in."""
    idx = torch.nonzero(out["unsure"]).flatten()
    if not idx.numel():
        return
    lo, hi = launch.run(xg, idx)
    step, hits, imp = _decide(_exact_errors(launch, xg, idx, lo, hi), launch.scalars[5])
    x = xg[idx]
    obs = launch.observer
    mn, mx = obs.ranges_at(torch.amin(x, dim=-1) * obs.expand, torch.amax(x, dim=-1) * obs.expand, step)
    out["step"][idx], out["hits"][idx], out["mn"][idx], out["mx"][idx] = step, hits, mn, mx
    improved |= imp.cpu()


def _full(observer, w: torch.Tensor, args: WeightArgs, steps: int, widen: float):
    """Every one of ``steps`` grid steps over chunk ``w`` (no early stop): the ``Search`` fields, exact."""
    n, k = w.shape
    xg = grouped(w.contiguous(), args).reshape(-1, args.group_size)
    launch = _Launch(observer, args, w, steps, widen)
    out = launch.run(xg)
    improved = _improved(out["counted"], steps)
    _settle(launch, xg, out, improved)
    shape = (n, k // args.group_size)
    hits = out["hits"].view(shape) if steps <= 63 else None
    return out["mn"].view(shape), out["mx"].view(shape), out["step"].view(shape), improved, hits


def search(observer, w: torch.Tensor, args: WeightArgs, steps: int | None = None, *, widen: float = 1.0):
    """``observer.search(w, args, steps)`` (:class:`~.search.MSEObserver`) on ``w``'s device: the fields of the
    same :class:`~.search.Search` as the CPU path's, ``(min, max, step, improved, hits)`` (on ``w``'s device;
    improved on the CPU). ``steps``: run exactly this many grid steps (None: stop as llm-compressor does, ``w`` the whole
    tensor); ``widen``: the kernel's sum bounds times this (> 1: more groups settled exactly, the same result;
    the tests' knob). Raises ``ValueError`` where :func:`takes` is False; the caller checks the weight first."""
    total = observer.total_steps if steps is None else steps
    if not takes(w, args, total):
        raise ValueError("the GPU observer search takes a CUDA bf16/fp16 chunk of a group strategy, at most 128 steps")
    found = _full(observer, w, args, total, widen)
    if steps is None and observer.patience < total:
        tracker = StopTracker(total, observer.patience)
        tracker.add(found[3])
        stop = tracker.steps
        if stop < total and found[4] is not None:  # the step each group had kept by then, from its improvement bits
            step = observer.steps_at(found[4], stop)
            found = (*observer.ranges_from_steps(w, args, step), step, found[3][:stop].clone(), found[4] & ((1 << stop) - 1))
        elif stop < total:
            found = _full(observer, w, args, stop, widen)
    return found
