"""Candidate qparams and fake quantization of a grid search, compressed-tensors 0.19.0's eager ops, and E2M1 rounding."""

from __future__ import annotations

import torch

from ..base import WeightArgs
from ..mx import round_pow2_bits
from .groups import is_mx

__all__ = ["FakeQuant", "cast_to_fp4", "fp4_level"]


class FakeQuant:
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
        self.is_fp4 = args.type == "float" and args.num_bits == 4
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
        """``sum(|fake_quant(x) - x| ** norm)`` over the last dim of ``x`` ``[N, G, g]``, in D ``[N, G]`` (``mse_quant.py:
        _calculate_error``: the difference, its power and the sum in D). ``ax``: ``|x|``, for FP4 (:meth:`dequantized`)."""
        ref = (ax if ax is not None else x.abs()) if self.is_fp4 else x
        return torch.sum((self.dequantized(x, mn, mx, ref) - ref).abs().pow(norm), dim=-1)

    def dequantized(self, x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, ax: torch.Tensor | None = None) -> torch.Tensor:
        """``fake_quantize(x, *qparams(mn, mx))`` of ``x`` ``[N, G, g]`` with the TOKEN strategy, in D ``[N, G, g]``; for FP4
        the fake quantization of ``|x|`` (``ax``, or computed here), which a caller compares with ``|x|``.

        Two shortcuts give the same values as upstream's ops: a symmetric zero point is 0, so adding and
        subtracting it changes no value (only the sign of a zero, which ``|q - x|`` drops); and for FP4,
        whose clamp and rounding are odd functions (``x / s``, RNE, ``level * s`` all commute with the sign),
        ``|q - x|`` is computed on ``ax = |x|`` (given by the caller, once per search), and the clamp to 6
        is left out (every value above 5 rounds to 6 either way).
        """
        scale, zp = self.qparams(mn, mx)
        scale, zp = scale.unsqueeze(-1), zp.unsqueeze(-1)
        if self.is_fp4:
            a = ax if ax is not None else x.abs()  # (the MX scale is also positive: the same shortcut)
            # no clamp to 6: every value above 5 takes the level 6 with or without it
            return (fp4_level(a / scale) * scale).to(x.dtype)
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
        return (deq * scale).to(x.dtype)


_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_BOUNDS: dict[torch.dtype, torch.Tensor] = {}


def _next_up(v: float, dtype: torch.dtype) -> float:
    """The smallest value of ``dtype`` above ``v`` (> 0)."""
    t = torch.tensor([v], dtype=dtype)
    bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    return (bits + 1).view(dtype).item()


def fp4_level(a: torch.Tensor) -> torch.Tensor:
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


def cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """E2M1 rounding of compressed-tensors 0.19.0 ``quantization/utils/fp4_utils.py: cast_to_fp4`` (eager),
    step by step (the tests' reference for :func:`fp4_level`)."""
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
