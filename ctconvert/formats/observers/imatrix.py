"""The data-driven observers ``imatrix_mse`` and ``nvfp4_expanded_imatrix``: the MSE search weighted by E[x^2].

llm-compressor 0.14.0.1 ``observers/imatrix.py`` (``IMatrixMSEObserver``, ``NVFP4ExpandedIMatrixObserver``, ``_grid_search``),
its eager CPU implementation (it has no other):

- **Statistic** (:class:`Importance`): a forward-pre hook on each Linear sums ``x.to(float32).pow(2)`` over every dim but
  the last (input channels, ``K``) per forward call and adds it into an fp32 ``[K]`` sum; the count adds the number of
  tokens (``prod(x.shape[:-1])``). llm-compressor runs it in the *calibration* pass of its sequential pipeline (one
  forward per sample, batch size 1, quantization disabled, the propagation pass' hooks disabled), so every calibration
  token counts once; with no padding no token is a pad.
- **Importance** (:meth:`Importance.weights`): ``imp = sum / count`` (fp32), refused (uniform MSE, the reason said) when
  there is no token, a value is not finite or negative, all are zero, the size is not ``K`` or the strategy is
  ``tensor``; else normalised ``imp / (imp.mean() + finfo(float32).tiny)``.
- **Search** (:class:`IMatrixMSEObserver`): the shrink-factor grid of :class:`~.search.MSEObserver` with
  ``max(1, int(maxshrink * grid)) + 1`` steps (one more than ``_grid_search_mse``), the candidate qparams and fake
  quantization the same (in D), but the error in fp32: ``sum(|float(q) - float(x)| ** norm * imp)`` per group (the
  initial best ``finfo(float32).max``), and global patience only when ``patience > 0``.

Defaults: ``imatrix_mse``: maxshrink 0.95, patience 5, grid 20, norm 3.0, expand 1.0 (20 steps, p = 1 .. 0.05);
``nvfp4_expanded_imatrix``: expand 1.8, maxshrink 1 - 0.8/1.8, grid 200, norm 2.4, patience 1000 (112 steps).
The output config records ``"observer": NAME, "observer_kwargs": {}``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from ..base import WeightArgs
from ..native import observe as native_observe
from .fake_quant import FakeQuant
from .groups import check_weight, grouped
from .search import MSEObserver, Search

__all__ = ["IMatrixMSEObserver", "Importance"]


@dataclass
class Importance:
    """One Linear's activation statistic: ``sum`` fp32 ``[K]`` of ``x ** 2`` per input channel and ``count`` tokens."""

    sum: torch.Tensor | None = None
    count: int = 0
    _parts: list = field(default_factory=list, repr=False)

    def add(self, x: torch.Tensor) -> None:
        """One forward call's input ``x`` ``[..., K]`` (any float dtype): llm-compressor's hook, operation for operation
        (``x.to(float32).pow(2).sum(dims but the last)``, added into the fp32 sum)."""
        xf = x.detach().to(torch.float32)
        part = xf.pow(2).sum(dim=list(range(xf.dim() - 1)))
        if self.sum is None:
            self.sum = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
        self.sum.add_(part)
        self.count += math.prod(x.shape[:-1])

    def add_samples(self, x: torch.Tensor) -> None:
        """A micro-batch ``x`` ``[B, T, K]`` as llm-compressor sees it with batch size 1: each sample added in order."""
        if x.dim() < 3:
            self.add(x)
            return
        for b in range(x.shape[0]):
            self.add(x[b : b + 1])

    def cpu(self) -> Importance:
        return Importance(None if self.sum is None else self.sum.cpu(), self.count)

    def weights(self, args: WeightArgs, k: int) -> tuple[torch.Tensor | None, str | None]:
        """``(imp, None)``: the normalised importance, fp32 ``[K]``; or ``(None, why)``: llm-compressor's fallback to
        uniform MSE (``_get_validated_importance``), with its reason."""
        if args.strategy == "tensor":
            return None, "TENSOR strategy not supported"
        if self.sum is None or self.count == 0:
            return None, "no importance data available"
        imp = self.sum / torch.tensor(self.count, dtype=torch.int64).float()
        if not bool(torch.isfinite(imp).all()):
            return None, "contains non-finite values"
        if bool((imp < 0).any()):
            return None, "contains negative values"
        if bool(torch.all(imp == 0)):
            return None, "all zeros"
        if imp.numel() != k:
            return None, f"size mismatch: expected {k}, got {imp.numel()}"
        return imp / (imp.mean() + torch.finfo(torch.float32).tiny), None


class IMatrixMSEObserver(MSEObserver):
    """``imatrix_mse`` / ``nvfp4_expanded_imatrix`` (module docstring). Bound to calibration data in three steps, as the
    streaming executor meets it: :meth:`with_data` (every Linear's :class:`Importance`), :meth:`for_unit` (a work unit's
    modules), :meth:`member` (one module: its importance weights the search; none, or one llm-compressor refuses,
    gives its uniform fallback, the same search unweighted)."""

    needs_data = True

    def __init__(self, name: str, *, maxshrink: float, patience: int, grid: float, norm: float, expand: float = 1.0):
        super().__init__(name, maxshrink=maxshrink, patience=patience, grid=grid, norm=norm, expand=expand)
        self.stat: Importance | None = None
        self.data: dict[str, Importance] = {}
        self.modules: list[str] = []
        self._rows_imp: torch.Tensor | None = None

    @property
    def total_steps(self) -> int:
        return max(1, int(self.maxshrink * self.grid)) + 1  # as ``_grid_search`` counts them

    @property
    def needs_stop_pass(self) -> bool:
        return 0 < self.patience < self.total_steps

    def _copy(self, **fields) -> IMatrixMSEObserver:
        bound = copy.copy(self)
        bound.__dict__.update(fields)
        return bound

    def with_data(self, data: dict[str, Importance]) -> IMatrixMSEObserver:
        """This observer with the calibration pass' statistics, module name -> :class:`Importance`."""
        return self._copy(data=data)

    def for_unit(self, modules: list[str]) -> IMatrixMSEObserver:
        return self._copy(modules=list(modules))

    def member(self, i: int) -> IMatrixMSEObserver:
        return self.with_importance(self.data.get(self.modules[i]))

    def with_importance(self, stat: Importance | None) -> IMatrixMSEObserver:
        """This observer for one module whose inputs' statistic is ``stat`` (None: no data, uniform MSE)."""
        return self._copy(stat=stat)

    def fallback(self, module: str, args: WeightArgs, k: int) -> str | None:
        """Why module ``module`` (``k`` input channels) is searched unweighted (llm-compressor's fallback), or None."""
        return (self.data.get(module) or Importance()).weights(args, k)[1]

    def search(self, w, args, steps=None, impl="auto"):
        """See :meth:`WeightObserver.search`. ``impl``: ``auto`` (the fused C kernel ``ct_imatrix_search`` of
        :mod:`..native.observe` for a CPU bf16/fp16 chunk of a group strategy when it is built, else the torch
        reference), ``torch`` or ``native``: the same ranges, steps, improvements and hits. A CUDA chunk is searched
        on the CPU (no GPU kernel of the weighted error)."""
        check_weight(w, args)
        grouped(w, args)  # the shape checks
        if w.device.type != "cpu":
            return self._on_cpu(w, args, steps, impl)
        return self._cpu(w, args, steps, impl)

    def _kernel(self, w: torch.Tensor, args: WeightArgs, common: tuple, mx_offset: int):
        """:func:`..native.observe.imatrix_search` of ``w`` with the importance of its ``K`` columns (None: uniform)."""
        return native_observe.imatrix_search(w, common, self._importance(args, w.shape[1]), self.norm, mx_offset)

    def _again(self, w: torch.Tensor, args: WeightArgs, unsure: torch.Tensor, steps: int) -> Search:
        """The torch search of the groups ``unsure`` (bool ``[N, G]``) of ``w``, each a row of one group weighted by
        its own columns' importance (the same fp32 values and sums as in the whole chunk's search)."""
        x = grouped(w, args)
        imp = self._importance(args, w.shape[1])
        rows = None if imp is None else imp.reshape(1, *x.shape[1:]).expand(x.shape)[unsure]
        return self._copy(_rows_imp=rows)._torch(x[unsure], args, steps)

    def _importance(self, args: WeightArgs, k: int) -> torch.Tensor | None:
        """The normalised importance of this module's ``k`` input channels, fp32 ``[k]``, or None (uniform MSE)."""
        return (self.stat or Importance()).weights(args, k)[0]

    def _stops(self, stale: int) -> bool:
        return self.patience > 0 and stale >= self.patience

    def _worst(self, mn0: torch.Tensor) -> torch.Tensor:
        return torch.full(mn0.shape, torch.finfo(torch.float32).max, dtype=torch.float32, device=mn0.device)

    def _errors(self, x: torch.Tensor, args: WeightArgs):
        """``(mn, mx) -> sum(|float(q) - float(x)| ** norm * imp)`` over each group, fp32 ``[N, G]`` (``_grid_search``)."""
        q = FakeQuant(args, x.device)
        ref = x.abs() if q.is_fp4 else x  # |q - x| of FP4 on |x| (FakeQuant.dequantized)
        ref32 = ref.float()
        if self._rows_imp is not None:  # the groups of :meth:`_again`, each with its own columns' importance
            imp = self._rows_imp.to(x.device).reshape(x.shape)
        else:
            imp = self._importance(args, x.shape[1] * x.shape[2])
            imp = None if imp is None else imp.to(x.device).reshape(x.shape[1:])

        def error(mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
            e = q.dequantized(x, mn, mx, ref).float()
            e.sub_(ref32).abs_().pow_(self.norm)
            if imp is not None:
                e.mul_(imp)
            return e.sum(dim=-1)

        return error
