"""verify's value-by-value check: the C kernel (ctconvert/formats/native/grid.c ``ct_grid_check``) and its torch path
(checkpoint/grid.py ``_torch_check``) against an independent brute force (each value's distance to every grid value,
in float64): the same values judged, the same off-grid count and the same first off-grid value, on fixed-seed codes
and references with zero and huge and tiny values, NaN/inf references (not judged), zero factors (not judged), values
at midpoints (ties) and moved one grid step, zero points, nibbles, an odd K and a K that is not a multiple of the group."""

from __future__ import annotations

import pytest
import torch

from ctconvert.checkpoint.grid import TIE, _torch_check, intervals
from ctconvert.formats.base import DequantSpec, byte_values
from ctconvert.formats.fp4 import e2m1_values
from ctconvert.formats.native import grid as native_grid

INT4 = torch.arange(16, dtype=torch.float32) - 8
GRIDS = {"int4": (INT4, True), "e2m1": (e2m1_values(), True), "e4m3": (byte_values(torch.float8_e4m3fn), False), "int8": (byte_values(torch.int8), False)}


def _brute(codes_v: torch.Tensor, lut: torch.Tensor, want, factor, zp) -> tuple[int, int, int | None]:
    """(judged, off, first flat index): a value is accepted when it is the nearest finite grid value to x (float64
    distances), or the grid neighbour of that nearest value with x within TIE * max(|q|, |x|) of their midpoint."""
    grid = sorted({float(v) for v in lut.tolist() if v == v and abs(v) != float("inf")})
    q = want / factor  # fp32, as the kernel divides
    x = q + zp if zp is not None else q
    judged = off = 0
    first = None
    for j, (xv, qv, fv, v) in enumerate(zip(x.reshape(-1).tolist(), q.reshape(-1).tolist(), factor.reshape(-1).tolist(), codes_v.reshape(-1).tolist())):
        if fv == 0 or not (abs(xv) < float("inf")):
            continue
        judged += 1
        i = min(range(len(grid)), key=lambda i: abs(grid[i] - xv))
        t = TIE * max(abs(qv), abs(xv))
        ok = v == grid[i] or any(0 <= i + d < len(grid) and v == grid[i + d] and abs(xv - (grid[i] + v) / 2) <= t for d in (-1, 1))
        if not ok:
            off += 1
            first = j if first is None else first
    return judged, off, first


def _case(name: str, n: int, k: int, g: int, seed: int, asym: bool):
    """Codes, reference, per-group factors and zero points: most codes the nearest value to the reference over the factor,
    some moved, some references exactly at midpoints (ties) or just beyond the tolerance, zero/huge/tiny/NaN rows."""
    lut, nib = GRIDS[name]
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // g)
    factor = torch.rand(n, groups, generator=gen) * 0.1 + 0.01
    factor[1, 0] = 0.0  # a zero factor: not judged
    zp = torch.randint(-3, 4, (n, groups), generator=gen).float() if asym else None
    grid = torch.unique(lut[torch.isfinite(lut)])
    lo, hi = (float(grid[1]), float(grid[-2])) if name != "e4m3" else (-400.0, 400.0)
    xs = torch.rand(n, k, generator=gen) * (hi - lo) + lo  # in the format's units
    fe = factor.repeat_interleave(g, dim=1)[:, :k]
    ze = zp.repeat_interleave(g, dim=1)[:, :k] if asym else torch.zeros(n, k)
    want = (xs - ze) * fe
    want[2] = 0.0
    want[3] = want[3] * 1e-30  # tiny
    want[4, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])  # not judged
    near = grid[(grid[None, None, :] - (want / torch.where(fe == 0, 1.0, fe) + ze)[..., None]).abs().argmin(-1)]
    mids = (grid[:-1] + grid[1:]) / 2
    m = mids[torch.randint(0, mids.numel(), (k,), generator=gen)]
    want[5] = (m - ze[5]) * fe[5]  # exactly at midpoints: either neighbour is accepted
    near[5] = grid[torch.searchsorted(grid, m)]  # the upper neighbour
    moved = torch.rand(n, k, generator=gen) < 0.02
    idx = torch.searchsorted(grid, near).clamp(1, grid.numel() - 2)
    near = torch.where(moved, grid[idx + torch.where(torch.rand(n, k, generator=gen) < 0.5, -1, 1)], near)
    # each value -> one code of the table with that value
    code_of = {float(v): c for c, v in reversed(list(enumerate(lut.tolist()))) if v == v}
    codes_v = torch.tensor([[code_of[float(v)] for v in row] for row in near.tolist()], dtype=torch.uint8)
    stored = lut[codes_v.long()]
    if nib:
        padded = torch.nn.functional.pad(codes_v, (0, k % 2))
        codes = (padded[:, 0::2] | (padded[:, 1::2] << 4)).to(torch.uint8)
    else:
        codes = codes_v
    spec = DequantSpec(codes, nib, k, lut, factor, zp, (groups, 1, g), torch.bfloat16)
    return spec, want.float(), stored, fe, (ze if asym else None)


@pytest.mark.parametrize("name", list(GRIDS))
@pytest.mark.parametrize("n,k,g,asym", [(16, 96, 32, False), (12, 101, 32, True), (9, 64, 64, False), (7, 50, 16, True)])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_same_judgement_as_the_brute_force(name, n, k, g, asym, path):
    if path == "native" and not native_grid.available():
        pytest.skip("no C compiler")
    spec, want, stored, fe, ze = _case(name, n, k, g, seed=n * 1000 + k, asym=asym)
    expect = _brute(stored, spec.lut, want, fe, ze)
    lower, upper = intervals(spec.lut)
    if path == "native":
        got = native_grid.grid_check(spec.codes, spec.nibbles, want, lower, upper, spec.factor, spec.zero_point, spec.layout, TIE)
    else:
        got = _torch_check(spec, want, lower, upper)
    assert got == expect
    assert expect[1] > 0 and expect[0] < n * k  # the case holds off-grid values and unjudged ones


def test_intervals_of_a_table():
    """E2M1: the midpoints to each value's neighbours, -0 and 0 one value, the ends open; E4M3's NaN codes accept nothing."""
    lower, upper = intervals(e2m1_values())
    v = e2m1_values().tolist()
    assert (lower[v.index(1.0)], upper[v.index(1.0)]) == (0.75, 1.25)
    assert (lower[v.index(6.0)], upper[v.index(6.0)]) == (5.0, float("inf"))
    assert (lower[v.index(-6.0)], upper[v.index(-6.0)]) == (-float("inf"), -5.0)
    assert (lower[0], upper[0]) == (lower[8], upper[8]) == (-0.25, 0.25)  # +0 and -0
    lower, upper = intervals(byte_values(torch.float8_e4m3fn))
    assert lower[0x7F] == float("inf") and upper[0x7F] == -float("inf")
    assert upper[0x7E] == float("inf") and lower[0x7E] == (448.0 + 416.0) / 2
