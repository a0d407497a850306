"""Every stored value of a quantized module against its reference (``verify --reference``): the value must be the
format's representable value nearest to the reference value over its own stored scale.

Every scheme ctconvert writes rounds to nearest once its scales are chosen (compressed-tensors 0.14
``quantization/lifecycle/forward.py``, ``_quantize``: ``round(x / scale) + zero_point``, clamped to the format's
range; FP8 and FP4 values by the cast to the format: nearest, ties to even). Whatever chose the scale (min/max, a
searched observer, an importance matrix, a requantized source), the value stored beside it is then fixed by the
reference value. A module's relative L2 error and its rows (:mod:`.rows`) cannot see one group whose scale was
written halved or doubled (one group of 128 among thousands moves a row's error by a few percent); this check
sees it exactly: there most values of the group are no longer the nearest.

The codes, grid and per-element scales are read through the format's :class:`~ctconvert.formats.base.DequantSpec`
(``(lut[code] - zero_point) * factor``). A value is accepted when it is the nearest grid value to
``reference / factor + zero_point``, or one of the two around a midpoint within :data:`TIE` of the quotient's
magnitude: the quantizer divides, and adds the zero point, in the weight's dtype (bf16 rounds each by up to 2^-9),
by a scale it may hold more precisely than the stored one (W4A16_ASYM's: 0.37% apart, seen on a tiny Llama, where
0.4979 + zero point -1 was stored as 0: ``round(-0.5)``). Elements
whose factor is zero or not finite are not judged (every value there dequantizes to zero or to nothing; the row
checks judge them). A format without a spec (2:4 sparse, kernel layouts) is not checked: the row says so.
"""

from __future__ import annotations

import torch

from ..formats import CompressionFormat, WeightArgs, get_format
from .modules import Module, module_rows
from .reader import Problem

__all__ = ["TIE", "GridCheck", "grid_problems", "unchecked_note"]

#: a quotient within this share of its magnitude of a midpoint between two grid values may round to either (a scale
#: written 2x or 0.5x moves most values of its group by 50-100% of theirs)
TIE = 2.0**-6


class GridCheck:
    """The accumulator of one module: :meth:`add` each chunk of reference rows (fp32 ``[r, K]``), then :meth:`result`."""

    def __init__(self, m: Module):
        self.m, self.fmt, self.args = m, get_format(m.format), WeightArgs.from_dict(m.weights)
        self.values = self.off = 0
        self.first: dict | None = None
        self.unchecked: str | None = None
        if m.format == CompressionFormat.MARLIN_24.value:  # a kernel layout over all rows: not read by row ranges
            self.unchecked = f"{m.format} values are not read code by code"

    def add(self, r0: int, r1: int, want: torch.Tensor) -> None:
        """Dense rows ``[r0, r1)`` of the reference, fp32 ``[r1 - r0, K]``."""
        if self.unchecked is not None or want.numel() == 0:
            return
        parts = module_rows(self.m, r0, r1)
        if "weight_shape" in parts:
            parts["weight_shape"] = torch.tensor([r1 - r0, want.shape[1]])
        try:
            spec = self.fmt.dequant_spec(parts, self.args)
        except (RuntimeError, ValueError, IndexError, TypeError, KeyError):
            spec = None
        if spec is None:
            self.unchecked = f"{self.m.format} values are not read code by code"
            return
        r, k = want.shape
        stored = spec.lut[_codes(spec.codes, spec.nibbles, k).long()]
        factor = _expand(spec.factor, spec.layout, r, k)
        x = quotient = want / factor
        if spec.zero_point is not None:
            x = quotient + _expand(spec.zero_point, spec.layout, r, k)
        grid = torch.unique(spec.lut[torch.isfinite(spec.lut)])  # sorted; -0 and 0 are one value
        i = torch.searchsorted(grid, x.contiguous()).clamp(1, grid.numel() - 1) if grid.numel() > 1 else None
        lo, hi = (grid[i - 1], grid[i]) if i is not None else (grid.expand_as(x), grid.expand_as(x))
        nearest = torch.where((x - lo).abs() <= (hi - x).abs(), lo, hi)
        tie = ((x - lo).abs() - (hi - x).abs()).abs() <= 2 * TIE * torch.maximum(quotient.abs(), x.abs())  # within TIE of the midpoint
        judged = torch.isfinite(x) & (factor != 0)
        bad = judged & (stored != nearest) & ~(tie & ((stored == lo) | (stored == hi)))
        self.values += int(judged.sum())
        n_bad = int(bad.sum())
        if n_bad and self.first is None:
            j = int(bad.reshape(-1).nonzero()[0])
            a, c = divmod(j, k)
            self.first = {
                "first_off_grid_row": r0 + a,
                "first_off_grid_column": c,
                "its_reference": float(want[a, c]),
                "its_scale": float(factor[a, c]),
                "its_nearest": float(nearest[a, c]),
                "its_stored": float(stored[a, c]),
            }
        self.off += n_bad

    def result(self) -> dict:
        """``values_checked`` (the values judged), ``values_off_grid`` (those that are not the nearest), the first of
        them (``first_off_grid_row``, ``first_off_grid_column``, ``its_reference``, ``its_scale`` (the factor the stored
        value is multiplied by), ``its_nearest``, ``its_stored``, in the format's units), ``values_unchecked`` (why a
        module's values are not judged, or None) and ``grid_ok``."""
        out = {"values_checked": self.values, "values_off_grid": self.off, "values_unchecked": self.unchecked, "grid_ok": not self.off}
        out.update(self.first or {})
        return out


def grid_problems(row: dict, module: str) -> list[Problem]:
    """An error for a module whose row (with :meth:`GridCheck.result` in it) has values off the grid, naming the first."""
    if not row.get("values_off_grid"):
        return []
    off, n = row["values_off_grid"], row["values_checked"]
    return [
        Problem(
            "error",
            f"{off} of {n} values are not the {row['format']} value nearest to the reference over their scale (row "
            f"{row['first_off_grid_row']}, column {row['first_off_grid_column']}: reference {row['its_reference']:.4g} / scale "
            f"{row['its_scale']:.4g} is nearest {row['its_nearest']:g}, stored {row['its_stored']:g}): values or their scales were "
            "changed after rounding",
            None,
            module,
        )
    ]


def unchecked_note(rows: list[dict]) -> list[Problem]:
    """A note naming the formats of the modules (error rows) whose values were not judged one by one, if any."""
    skipped = [r for r in rows if r.get("values_unchecked")]
    if not skipped:
        return []
    formats = ", ".join(sorted({str(r["format"]) for r in skipped}))
    why = (
        f"the values of {len(skipped)} quantized module(s) ({formats}) are not judged one by one against their scales (the format is "
        "not read code by code); their error, gain and rows are"
    )
    return [Problem("note", why)]


def _codes(codes: torch.Tensor, nibbles: bool, k: int) -> torch.Tensor:
    """One code per element ``[n, k]`` (uint8) from the spec's bytes: two per byte where ``nibbles`` (element ``2j`` low)."""
    if not nibbles:
        return codes[:, :k]
    return torch.stack((codes & 0xF, codes >> 4), dim=2).reshape(codes.shape[0], -1)[:, :k]


def _expand(t: torch.Tensor, layout: tuple[int, int, int], r: int, k: int) -> torch.Tensor:
    """fp32 ``[r, k]``: element ``(row // rdiv) * stride + col // g`` of the flat ``t`` (:func:`~ctconvert.formats.base.factor_layout`)."""
    stride, rdiv, g = layout
    flat = t.reshape(-1)
    rows = (torch.arange(r) // rdiv) * stride
    cols = torch.arange(k) // g
    return flat[rows[:, None] + cols[None, :]]
