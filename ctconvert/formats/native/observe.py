"""The fused CPU kernels of the MSE and imatrix observers (``observe.c``), compiled on first use and called through ctypes.

:func:`mse_search` runs a fixed number of grid steps of :class:`ctconvert.formats.observers.MSEObserver`'s
search over every group of a bf16/fp16 row chunk, and says which groups it cannot vouch for (a ``pow``
or a group sum within a rounding boundary's reach, see ``observe.c``): the caller searches those again
with the torch reference. :func:`imatrix_search`: the same for the imatrix observers' fp32 weighted error.
:func:`available` is False without a compiler or with ``CTCONVERT_NATIVE=0``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ... import cbuild

__all__ = ["available", "imatrix_search", "mse_search"]

_SRC = Path(__file__).with_name("observe.c")
_p, _i64, _i32, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_LIB = cbuild.Library(
    _SRC,
    {
        "ct_mse_search": ([_p, _i32, _i64, _i64, _i64, _i32, _i32, _i32, _f, _f, _f, _f, _f, _p, _i64, _p, _p, _f, _f, _p, _p, _p, _p, _p, _p], _i64),
        "ct_imatrix_search": ([_p, _i32, _i64, _i64, _i64, _i32, _i32, _i32, _f, _f, _f, _f, _f, _p, _i64, _p, _i32, _f, _f, _p, _p, _p, _p, _p, _p], _i64),
        "ct_pow_table": ([_i32, _f, _p, _p], None),
    },
)
_DT = {torch.bfloat16: 0, torch.float16: 1}
KINDS = {"int": 0, "fp8": 1, "fp4": 2}


_TABLES: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def _pow_table(lib, dt: int, norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``ct_pow_table``'s bounds of ``|d| ** norm`` for every non-negative D value (built once per dtype and norm)."""
    key = (dt, norm)
    if key not in _TABLES:
        lo, hi = torch.empty(0x8000, dtype=torch.float32), torch.empty(0x8000, dtype=torch.float32)
        lib.ct_pow_table(dt, norm, lo.data_ptr(), hi.data_ptr())
        _TABLES[key] = (lo, hi)
    return _TABLES[key]


def available() -> bool:
    """Whether the compiled kernel can be used (builds it on first call)."""
    return _LIB.get() is not None


def takes(w: torch.Tensor) -> bool:
    """Whether :func:`mse_search` takes ``w`` (a 2-D CPU bf16/fp16 tensor)."""
    return w.device.type == "cpu" and w.dtype in _DT and w.dim() == 2


def mse_search(
    w: torch.Tensor,
    g: int,
    kind: str,
    symmetric: bool,
    qmin: float,
    qmax: float,
    half: float,
    rng: float,
    expand: float,
    p: torch.Tensor,
    norm: float,
    mx_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Search every ``g``-column group of ``w`` ``[n, k]`` over the shrink factors ``p`` (fp32 ``[S]``), all run.

    ``kind``: ``int`` | ``fp8`` | ``fp4``; ``mx_offset``: 0, or 2 (MXFP4) / 8 (MXFP8) for an E8M0 candidate
    scale; ``qmin``/``qmax``: the clamp range; ``half``/``rng``: the symmetric and asymmetric scale divisors
    as values of D; ``norm``: the error exponent as a value of D. Returns
    ``(step int16 [n, k/g], min D, max D, improved bool [S], uncertain bool [n, k/g], hits)``, ``hits`` the
    steps each group improved at as bits of an int64 ``[n, k/g]`` when ``S <= 63`` (else None); uncertain
    groups' outputs are undefined and their improvements are not in ``improved``. Raises ``ValueError`` for a
    ``w`` :func:`takes` refuses, ``RuntimeError`` when the kernel is not built.
    """
    lib = _lib(w)
    plo, phi = _pow_table(lib, _DT[w.dtype], norm)
    dmax, eps = torch.finfo(w.dtype).max, torch.finfo(w.dtype).eps
    head = (g, KINDS[kind], mx_offset, int(symmetric), qmin, qmax, half, rng, expand)
    return _search(lib.ct_mse_search, w, g, p, lambda pp, steps: (*head, pp, steps, plo.data_ptr(), phi.data_ptr(), dmax, eps))


def imatrix_search(
    w: torch.Tensor, grid: tuple, imp: torch.Tensor | None, norm: float, mx_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`mse_search` with the imatrix observers' error (``ct_imatrix_search``): per group the fp32
    ``sum(|float(q) - float(x)| ** norm * imp)`` (llm-compressor 0.14.0.1 ``observers/imatrix.py: _grid_search``).

    ``grid``: :func:`mse_search`'s arguments ``(g, kind, symmetric, qmin, qmax, half, rng, expand, p)``;
    ``imp``: the normalised importance, fp32 ``[k]`` (None: unweighted, the uniform fallback); ``norm``: the
    exponent as torch's pow of an fp32 tensor takes it (a Python float; 2.0 and 3.0 are products there and here).
    Returns what :func:`mse_search` returns; the uncertain groups (a pow or an fp32 sum within reach of a tie,
    or a sum that may overflow) are to be searched again by the torch reference. Raises ``ValueError`` for a ``w``
    :func:`takes` refuses or an importance of another dtype or size, ``RuntimeError`` when the kernel is not built.
    """
    g, kind, symmetric, qmin, qmax, half, rng, expand, p = grid
    lib = _lib(w)
    if imp is not None and (imp.dtype != torch.float32 or imp.numel() != w.shape[1]):
        raise ValueError(f"the importance must be fp32 [{w.shape[1]}], got {imp.dtype} {tuple(imp.shape)}")
    imp = None if imp is None else imp.cpu().contiguous()
    pmode = int(norm) if norm in (2.0, 3.0) else 0
    head = (g, KINDS[kind], mx_offset, int(symmetric), qmin, qmax, half, rng, expand)
    return _search(
        lib.ct_imatrix_search, w, g, p, lambda pp, steps: (*head, pp, steps, None if imp is None else imp.data_ptr(), pmode, norm, torch.finfo(w.dtype).eps)
    )


def _lib(w: torch.Tensor):
    if not takes(w):
        raise ValueError("the observer kernel takes a 2-D CPU bf16/fp16 tensor")
    lib = _LIB.get()
    if lib is None:
        raise RuntimeError("the native observer kernel is not available (no C compiler, or CTCONVERT_NATIVE=0)")
    return lib


def _search(fn, w: torch.Tensor, g: int, p: torch.Tensor, middle):
    """One search kernel ``fn`` over the row ranges of ``w`` on the worker threads: ``fn(w rows, dt, rows, k,
    *middle(p pointer, steps), best, min, max, improved, uncertain, hits)``; the outputs as :func:`mse_search`'s."""
    w = w.contiguous()
    n, k = w.shape
    groups, steps = k // g, p.numel()
    p = p.to(torch.float32).contiguous()
    step = torch.empty(n, groups, dtype=torch.int16)
    mn, mx = torch.empty(n, groups, dtype=w.dtype), torch.empty(n, groups, dtype=w.dtype)
    unsure = torch.zeros(n, groups, dtype=torch.uint8)
    hits = torch.zeros(n, groups, dtype=torch.int64) if steps <= 63 else None
    args = middle(p.data_ptr(), steps)
    parts: list[torch.Tensor] = []
    row_bytes = groups * 2

    def run(a, b):
        hit = torch.zeros(max(steps, 1), dtype=torch.uint8)
        fn(
            w.data_ptr() + a * k * w.element_size(),
            _DT[w.dtype],
            b - a,
            k,
            *args,
            step.data_ptr() + a * row_bytes,
            mn.data_ptr() + a * row_bytes,
            mx.data_ptr() + a * row_bytes,
            hit.data_ptr(),
            unsure.data_ptr() + a * groups,
            hits.data_ptr() + a * groups * 8 if hits is not None else None,
        )
        parts.append(hit[:steps])

    cbuild.parallel_ranges(n, 1, run)
    improved = torch.zeros(steps, dtype=torch.bool)
    for h in parts:
        improved |= h.bool()
    return step, mn, mx, improved, unsure.bool(), hits
