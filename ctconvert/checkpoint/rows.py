"""Per-row checks of a quantized module against its reference (``verify --reference``): each row's relative L2 error
against its reference row, and rows that quantize to all zeros although their reference row is not too small for
the format.

A module's overall relative L2 error hides a few wrong rows (rows swapped with their scales, a row's scales
zeroed): each output row is judged on its own, against a per-format limit measured on correct outputs
(:data:`ROW_LIMITS`). A row that is all zero in the output and not in the reference is judged by the zero-row rule
instead (:meth:`ctconvert.formats.base.WeightFormat.zero_row_floor`: only a reference row too small for the
format's scales may become zero; any other is an error), and is left out of the worst row. Both are computed in
the one streaming pass over row chunks that gives the module's error (``verify``'s error row); read from the two
checkpoints alone.
"""

from __future__ import annotations

import math

import torch

from ..errors import agree, plural
from .reader import Problem

__all__ = ["ROW_LIMITS", "RowErrors", "row_limit", "row_problems", "rows_ok"]

#: largest relative L2 error of any single row (against its reference row), per (type, bits) of the weights. The worst
#: row of correct outputs, measured over all-MiniLM-L6-v2 (fp32, K 384/1536), a random Gaussian tiny Llama and one with
#: log-normal magnitudes (sigma 1.5; bf16, K 256/512): FP8_DYNAMIC 0.035, FP8_BLOCK 0.057, MXFP8A16 0.058; W8A8 0.084
#: (MiniLM's outlier row 99 of encoder.layer.1.output.dense), W8A16 0.025; W4A16 0.298 (MiniLM, group 128), W4A16 group
#: 32 0.187, W4A16_ASYM 0.218; NVFP4A16 0.128, MXFP4A16 0.201. A wrong row is far above: a row swapped with another
#: (values and scales) ~1.4, a row whose scales are zeroed 1.0 (judged by the zero-row rule). Each limit is 2-3x the
#: worst correct row of its kind and well below 1
ROW_LIMITS = {("float", 8): 0.2, ("int", 8): 0.25, ("int", 4): 0.6, ("float", 4): 0.6}
#: a row whose reference absmax is below this many times the format's zero-row floor is not judged by the row limit:
#: there its values fall among the subnormals of the scale it shares with larger rows (an E4M3 per-tensor, block or
#: NVFP4 group scale: 3 mantissa bits, then steps of 2^-9), where a correct quantization's error grows to ~100% as the
#: row shrinks to the floor (measured by a false-failure sweep on a tiny Llama, one row scaled to r x the tensor's
#: absmax: FP8_BLOCK and per-tensor FP8 rows at 2.3x the floor 0.32-0.34, at 4.5x 0.16-0.17; NVFP4A16 at 1.4x 0.79,
#: every value and scale equal to compressed-tensors' own); such rows hold a negligible share of the weight's energy
NEAR_FLOOR = 16.0
#: the largest value a row's own scale (per channel or group, stored in the weight's dtype D) maps its absmax to, per
#: (type, bits) of the weights (compressed-tensors: ``amax / 448`` for FP8, ``amax / ((qmax - qmin) / 2)`` for int). Where
#: that scale falls below D's smallest normal it keeps fewer bits, and a correct row's error grows past the row limit (a
#: new user's fp16 Llama, FP8_DYNAMIC: 0.26 for a row of absmax under 448 x 2^-14 = 0.027): such rows are not judged by
#: the row limit either (fp16 only, in practice: bf16's and fp32's smallest normal is 1.2e-38)
ROW_SCALE_MAX = {("float", 8): 448.0, ("int", 8): 127.5, ("int", 4): 7.5}


def row_limit(weights: dict, requantized: bool) -> float | None:
    """The largest worst-row relative L2 error accepted for a module of ``weights`` (a config group's weight args);
    None against a quantized reference (``requantized``: rows whose values already lie on another grid are not
    judged one by one) or for weights of another kind."""
    if requantized:
        return None
    return ROW_LIMITS.get((weights.get("type"), int(weights.get("num_bits") or 0)))


class RowErrors:
    """The per-row accumulator of one module: :meth:`add` each chunk of dequantized rows with its reference rows,
    then :meth:`result`. ``fmt``/``args``: the module's format object and WeightArgs, ``dtype`` the dense weight's
    (the dtype its scales were computed in), ``global_scale`` its NVFP4 ``weight_global_scale`` (or None)."""

    #: the output was requantized from a quantized checkpoint other than the reference (verify: ``derived_from``), whose
    #: own rounding may have zeroed rows or groups: their errors say so (:func:`row_problems`); they still fail
    rounded_elsewhere = False

    def __init__(self, fmt, args, dtype: torch.dtype, global_scale: float | None = None):
        self.fmt, self.args, self.dtype, self.global_scale = fmt, args, dtype, global_scale
        grouped = args.strategy in ("group", "tensor_group") and args.group_size
        self.group = int(args.group_size) if grouped else None  # scales per group of columns: a zeroed group is judged too
        self.zero_groups: list[tuple[int, torch.Tensor]] = []  # per chunk: its first row, each row's largest zeroed group
        self.tensor_amax = 0.0
        #: per chunk: its first row, its rows' relative L2 (zero rows: 0), their reference absmax, the largest absmax of the
        #: rows each shares its scales with (block scales: each row's block of rows, a tensor; else the chunk's, a float), and
        #: which rows are all zero in the output and not in the reference
        self.chunks: list[tuple[int, torch.Tensor, torch.Tensor, float, torch.Tensor]] = []

    def add(self, r0: int, got: torch.Tensor, want: torch.Tensor) -> None:
        """Rows ``r0 ..`` of the module: ``got`` dequantized, ``want`` the reference (fp32 ``[r, K]`` each)."""
        if got.numel() == 0:
            return
        d = got - want
        se, sr = (d * d).sum(dim=1), (want * want).sum(dim=1)
        amax = want.abs().amax(dim=1)
        lost = (got == 0).all(dim=1) & (amax > 0)
        rel = torch.where(sr > 0, (se / sr.clamp_min(torch.finfo(torch.float32).tiny)).sqrt(), torch.where(se > 0, math.inf, 0.0))
        rel = torch.where(lost, torch.zeros_like(rel), rel)  # judged by the zero-row rule
        chunk_amax = float(amax.max())
        span = _block_spans(amax, r0, int(self.args.block_structure[0])) if self.args.strategy == "block" else chunk_amax
        self.chunks.append((r0, rel.cpu(), amax.cpu(), span, lost.cpu()))
        g = self.group
        if g and got.shape[1] % g == 0 and got.shape[1] > g:  # groups all zero in a row that is not: their reference absmax
            gamax = want.reshape(got.shape[0], -1, g).abs().amax(dim=2)
            zeroed = (got.reshape(got.shape[0], -1, g) == 0).all(dim=2) & (gamax > 0) & ~lost.unsqueeze(1)
            self.zero_groups.append((r0, torch.where(zeroed, gamax, torch.zeros_like(gamax)).amax(dim=1).cpu()))
        self.tensor_amax = max(self.tensor_amax, chunk_amax)

    def result(self) -> dict:
        """``worst_row_rel_l2``, ``worst_row`` (the rows quantized to something, but those whose reference absmax is below
        :data:`NEAR_FLOOR` times the format's floor, counted in ``rows_near_floor``), ``zero_rows`` (rows all zero in the
        output and not in the reference), of them ``zero_rows_unexplained`` (whose reference row is not too small for
        the format; the first one's index, reference absmax and the format's floor: ``first_unexplained_zero_row``,
        ``its_reference_absmax``, ``zero_row_floor``), ``zero_group_rows`` (rows of other values holding a group all zero
        whose reference group is not too small for the format; the first: ``first_zero_group_row``, ``its_group_absmax``)."""
        absolute, relative = self.fmt.zero_row_floor(self.args, self.dtype, self.global_scale)
        own = self.args.strategy in ("channel", "group") and not str(self.fmt.name.value).startswith("mx")  # a scale in D per row
        coarse = ROW_SCALE_MAX.get((self.args.type, int(self.args.num_bits or 0)), 0.0) * torch.finfo(self.dtype).tiny if own else 0.0
        worst, worst_row, near, zero, bad, first, judged_rows = 0.0, None, 0, 0, 0, None, 0

        def floor_of(span):  # the scale a row shares: the tensor's, its block's (per row), or at most the chunk's
            if torch.is_tensor(span):
                return (relative * span).clamp_min(absolute)
            return max(absolute, relative * (self.tensor_amax if self.args.strategy == "tensor" else span))

        for r0, rel, amax, span, lost in self.chunks:
            floor = floor_of(span)
            judged = (amax >= NEAR_FLOOR * floor) & (amax >= coarse)  # rows near the floor, or scaled in D's subnormals: not judged
            near += int((~judged & (rel > 0)).sum())
            judged_rows += int((judged & ~lost).sum())
            rel = torch.where(judged, rel, torch.zeros_like(rel))
            i = int(rel.argmax())
            if worst_row is None or float(rel[i]) > worst:
                worst, worst_row = float(rel[i]), r0 + i
            over = lost & (amax >= floor)  # all zero, though not too small for the format
            zero, bad = zero + int(lost.sum()), bad + int(over.sum())
            if first is None and bool(over.any()):
                j = int(over.nonzero()[0])
                f = float(floor[j]) if torch.is_tensor(floor) else floor
                first = {"first_unexplained_zero_row": r0 + j, "its_reference_absmax": float(amax[j]), "zero_row_floor": f}
        zg, zg_first = 0, None
        for (r0, gmax), (_, _, _, span, _) in zip(self.zero_groups, self.chunks):
            over = gmax >= floor_of(span)
            zg += int(over.sum())
            if zg_first is None and bool(over.any()):
                j = int(over.nonzero()[0])
                zg_first = {"first_zero_group_row": r0 + j, "its_group_absmax": float(gmax[j])}
        out = {"worst_row_rel_l2": worst, "worst_row": worst_row, "rows_near_floor": near, "rows_judged": judged_rows, "zero_rows": zero}
        out.update(zero_group_rows=zg, **(zg_first or {}))
        out["zero_rows_unexplained"] = bad
        out["rounded_elsewhere"] = self.rounded_elsewhere
        out["module_limits_judged"] = judged_rows > 0 or near == 0  # not where every row lies near the floor (some not zero)
        out.update(first or {})
        return out


def _block_spans(amax: torch.Tensor, r0: int, rows: int) -> torch.Tensor:
    """Per row of a chunk starting at row ``r0``: the largest reference absmax of its block of ``rows`` rows (the rows
    whose block scales it shares, in some column block) within the chunk (fp32 ``[r]`` on the CPU)."""
    a = amax.float().cpu()
    ids = (torch.arange(a.numel()) + r0) // max(1, rows)
    ids -= int(ids[0])
    top = torch.zeros(int(ids[-1]) + 1).scatter_reduce(0, ids, a, "amax", include_self=False)
    return top[ids]


def rows_ok(row: dict) -> bool:
    """No row of the module is wrong: none all zero that the format explains not, the worst within ``row_threshold``."""
    limit = row.get("row_threshold")
    return not row["zero_rows_unexplained"] and not row.get("zero_group_rows") and (limit is None or row["worst_row_rel_l2"] <= limit)


def row_problems(row: dict, module: str, n: int) -> list[Problem]:
    """The problems of a module's error row (``row``, with :meth:`RowErrors.result` and ``row_threshold`` in it; ``n``
    its rows): rows all zero that the format explains (a warning), rows all zero that it does not (an error naming
    the first), a module beyond its error or gain limit whose every row is near the floor or all zero, some near the
    floor (a warning: verify does not judge the module's limits there; all zero rows have theirs), a worst row beyond the
    row limit (an error naming it)."""
    out = []
    lost, bad = row["zero_rows"], row["zero_rows_unexplained"]
    # requantized from a quantized checkpoint other than the reference: its own rounding may have zeroed them too
    elsewhere = ", or the quantized checkpoint it was requantized from zeroed them (verify against that checkpoint to tell which)"
    elsewhere = elsewhere if row.get("rounded_elsewhere") else ""
    if bad:
        what = "every row is" if bad == n else f"{bad} of {n} rows {agree(bad, 'is', 'are')}"
        out.append(
            Problem(
                "error",
                f"{what} all zero in the output but not in the reference, whose rows are not too small for {row['format']} (row "
                f"{row['first_unexplained_zero_row']}: reference absmax {row['its_reference_absmax']:.3g}, while only rows below "
                f"{row['zero_row_floor']:.3g} quantize to zero): its scales or values were zeroed{elsewhere}",
                None,
                module,
            )
        )
    if lost - bad:
        what = "every row is" if lost - bad == n else f"{lost - bad} of {n} rows {agree(lost - bad, 'is', 'are')}"
        out.append(Problem("warning", f"{what} all zero in the output but not in the reference (values too small for the format)", None, module))
    if not row.get("module_limits_judged", True) and (not row["rel_l2"] <= row["threshold"] or not row["gain_ok"]):
        why = (
            f"relative L2 error {row['rel_l2']:.4f} (gain {row['gain']:.4f}) is beyond {row['format']}'s limits, but no row is large enough for "
            "them: every row lies near the floor of its scales (or among the subnormals of a scale in fp16), where a correct "
            "quantization's error grows; its values were judged one by one"
        )
        out.append(Problem("warning", why, None, module))
    if zg := row.get("zero_group_rows"):
        out.append(
            Problem(
                "error",
                f"{plural(zg, 'row')} of {n} {agree(zg, 'has', 'have')} a group of {row['format']} values all zero in the output but not in the reference, "
                f"whose values are not too small for the format (row {row['first_zero_group_row']}: group absmax "
                f"{row['its_group_absmax']:.3g}): a group scale was zeroed{elsewhere}",
                None,
                module,
            )
        )
    limit = row.get("row_threshold")
    if limit is not None and not row["worst_row_rel_l2"] <= limit:  # NaN too
        out.append(
            Problem(
                "error",
                f"row {row['worst_row']} has relative L2 error {row['worst_row_rel_l2']:.4f} against its reference row, beyond the "
                f"{limit} a correct {row['format']} row reaches (module: {row['rel_l2']:.4f}): rows or their scales were changed",
                None,
                module,
            )
        )
    return out
