"""Every stored value of a quantized module against its reference (``verify --reference``): the value must be the
format's representable value nearest to the reference value over its own stored scale.

Every scheme ctconvert writes rounds to nearest once its scales are chosen (compressed-tensors 0.14
``quantization/lifecycle/forward.py``, ``_quantize``: ``x / scale`` (NVFP4's scale divided by its global scale
first), plus the zero point, then clamped to the format's range and rounded: integers by ``torch.round``, FP8 and
FP4 values to the format's nearest). Whatever chose the scale (min/max, a
searched observer, an importance matrix, a requantized source), the value stored beside it is then fixed by the
reference value. A module's relative L2 error and its rows (:mod:`.rows`) cannot see one group whose scale was
written halved or doubled (one group of 128 among thousands moves a row's error by a few percent); this check
sees it exactly: there most values of the group are no longer the nearest.

The codes, grid and per-element scales are read through the format's :class:`~ctconvert.formats.base.DequantSpec`
(``(lut[code] - zero_point) * factor``). With ``q = reference / factor`` and ``x = q + zero_point``, a stored value is
accepted when ``x`` lies in its rounding interval (the midpoints to its grid neighbours: :func:`intervals`) widened by
:data:`TIE` of ``max(|q|, |x|)`` on each side: the nearest value, or either neighbour of a midpoint ``x`` lies that
close to. The quantizer divides, and adds the zero point, in the weight's dtype (bf16 rounds each by up to 2^-9), by
a scale it may hold more precisely than the stored one (W4A16_ASYM's: 0.37% apart, seen on a tiny Llama, where
0.4979 + zero point -1 was stored as 0: ``round(-0.5)``). Elements whose factor is zero or whose ``x`` is not finite
are not judged (every value there dequantizes to zero or to nothing; the row checks judge them). A format without a
spec (marlin-24; 2:4 ``sparse-24-bitmask`` has its inner format's, over the decompressed codes) is not
checked, nor an output requantized from a quantized checkpoint against a dense reference (:func:`rounded_elsewhere`):
the row says why, and one note. The comparisons run in the C kernel :mod:`ctconvert.formats.native.grid` (a 1.2B
model's 973M values add 1-3 s to a 2-core ``verify --reference`` of ~23 s: ``scripts/bench_verify.py``), else with torch (:func:`_torch_check`),
the same judgement.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..formats import CompressionFormat, WeightArgs, get_format
from ..formats.native import grid as native_grid
from .integrity import recorded_provenance
from .modules import Module, module_rows
from .reader import Problem

__all__ = ["TIE", "GridCheck", "grid_problems", "intervals", "rounded_elsewhere", "unchecked_note"]

#: a quotient within this share of its magnitude of a midpoint between two grid values may round to either (a scale
#: written 2x or 0.5x moves most values of its group by 50-100% of theirs)
TIE = 2.0**-6


class GridCheck:
    """The accumulator of one module: :meth:`add` each chunk of reference rows (fp32 ``[r, K]``), then :meth:`result`."""

    def __init__(self, m: Module, unchecked: str | None = None):
        """``unchecked``: why the module's values are not judged at all (:func:`rounded_elsewhere`), or None."""
        self.m, self.fmt, self.args = m, get_format(m.format), WeightArgs.from_dict(m.weights)
        self.values = self.off = 0
        self.first: dict | None = None
        self.unchecked = unchecked
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
        lower, upper = intervals(spec.lut)
        want = want.to(torch.float32).contiguous()
        if native_grid.available():
            judged, off, first = native_grid.grid_check(spec.codes, spec.nibbles, want, lower, upper, spec.factor, spec.zero_point, spec.layout, TIE)
        else:
            judged, off, first = _torch_check(spec, want, lower, upper)
        self.values += judged
        self.off += off
        if off and self.first is None:
            self.first = _describe(spec, want, first, r0)

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
            "changed after rounding, or the output was not rounded from this reference (a requantized output is rounded from the "
            "quantized checkpoint it was made from: give that as --reference)",
            None,
            module,
        )
    ]


def unchecked_note(rows: list[dict]) -> list[Problem]:
    """A note per reason the values of modules (error rows) were not judged one by one, if any, with their count."""
    reasons: dict[str, int] = {}
    for r in rows:
        if r.get("values_unchecked"):
            reasons[r["values_unchecked"]] = reasons.get(r["values_unchecked"], 0) + 1
    return [
        Problem("note", f"the values of {n} quantized module(s) are not judged one by one against their scales ({why}); their error, gain and rows still are")
        for why, n in reasons.items()
    ]


def rounded_elsewhere(out: Path, reference_quantized: bool) -> str | None:
    """Why no value of the output at ``out`` can be judged against a dense reference, or None: the output was requantized
    from a quantized checkpoint (its ``ctconvert-provenance.json`` says ``derived_from``), whose values it was rounded
    from, not the dense ones (a requantization of an FP8-block source to NVFP4A16 has ~2-35% of its values off the
    grid of the bf16 original, though its error against it is within every limit). A quantized reference
    (``reference_quantized``) is the checkpoint the values were rounded from: judged. Only a provenance its index
    records and that matches the record counts (:func:`.integrity.recorded_provenance`): a ``derived_from`` added by
    hand, or one of an earlier release's output (no record), leaves the values judged."""
    if reference_quantized:
        return None
    derived = (recorded_provenance(out) or {}).get("derived_from")
    if not isinstance(derived, dict):
        return None
    return (
        f"the output was requantized from the quantized checkpoint {derived.get('path')}, whose values it was rounded from, not this "
        "reference's: give that as --reference to judge them"
    )


def intervals(lut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each code's rounding interval ``(lower, upper)``, fp32 like ``lut`` (code -> value): the midpoints to the value's
    neighbours among the table's finite values (-inf/+inf at the ends; -0 and 0 are one value); an empty interval
    (+inf, -inf) for a code whose value is not finite."""
    lut = lut.to(torch.float32)
    grid = torch.unique(lut[torch.isfinite(lut)])  # sorted
    pos = torch.searchsorted(grid, lut.nan_to_num(0.0)).clamp(max=grid.numel() - 1)
    inf = torch.full_like(lut, torch.inf)
    lower = torch.where(pos > 0, (grid[(pos - 1).clamp(min=0)] + grid[pos]) / 2, -inf)
    upper = torch.where(pos < grid.numel() - 1, (grid[pos] + grid[(pos + 1).clamp(max=grid.numel() - 1)]) / 2, inf)
    finite = torch.isfinite(lut)
    return torch.where(finite, lower, inf), torch.where(finite, upper, -inf)


def _torch_check(spec, want: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor) -> tuple[int, int, int | None]:
    """The kernel's comparisons (formats/native/grid.c) with torch: ``(judged, off the grid, first flat index or None)``."""
    r, k = want.shape
    code = _codes(spec.codes, spec.nibbles, k).long()
    factor = _expand(spec.factor, spec.layout, r, k)
    x = q = want / factor
    if spec.zero_point is not None:
        x = q + _expand(spec.zero_point, spec.layout, r, k)
    t = TIE * torch.maximum(q.abs(), x.abs())
    judged = torch.isfinite(x) & (factor != 0)
    bad = judged & ((x < lower[code] - t) | (x > upper[code] + t))
    flat = bad.reshape(-1).nonzero()
    return int(judged.sum()), int(flat.numel()), int(flat[0]) if flat.numel() else None


def _describe(spec, want: torch.Tensor, first: int, r0: int) -> dict:
    """The report of the first off-grid value (flat index ``first`` into the chunk of rows from ``r0``)."""
    k = want.shape[1]
    a, c = divmod(first, k)
    code = int(_codes(spec.codes[a : a + 1], spec.nibbles, k)[0, c])
    f = float(_expand(spec.factor, spec.layout, a + 1, k)[a, c])
    zp = float(_expand(spec.zero_point, spec.layout, a + 1, k)[a, c]) if spec.zero_point is not None else 0.0
    x = float(want[a, c]) / f + zp
    lut = spec.lut.to(torch.float32)
    grid = torch.unique(lut[torch.isfinite(lut)])
    nearest = float(grid[int((grid - x).abs().argmin())])
    return {
        "first_off_grid_row": r0 + a,
        "first_off_grid_column": c,
        "its_reference": float(want[a, c]),
        "its_scale": f,
        "its_nearest": nearest,
        "its_stored": float(lut[code]),
    }


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
