"""What AutoAWQ and GPTQ share: grouped integer weights with zero points, and their lossless ``pack-quantized`` form.

A module presents unsigned ``q [N, K]``, zero points and scales ``[N, G]`` and the group of each column
(:meth:`GroupedIntModule.int_rows`; each format unpacks its own words), dequantized as
``(q - z) * s[g_idx]`` (:func:`ctconvert.formats.foreign.dequant_grouped_int`). Without act-order, and for
4 or 8 bits, compressed-tensors ``pack-quantized`` holds the same values: ``q - 2^(B-1)`` packed into
int32 words, the zero points likewise (asymmetric), the scales transposed (compressed-tensors 0.20
``converters/autoawq.py``).
"""

from __future__ import annotations

import math

import torch

from ..checkpoint.safetensors_io import TensorInfo, read_tensor
from ..errors import BadInputError, UnsupportedError
from ..formats import CompressionFormat
from ..formats.foreign import dequant_grouped_int
from ..formats.integer import pack_int32, pack_int32_dim0
from .base import GroupSpec, SourceFormat, SourceModule, at, cols, preset_key

__all__ = ["GroupedIntFormat", "GroupedIntModule", "qweight"]

_PRESETS = {  # (bits, symmetric, group size) -> compressed-tensors preset name (plan/schemes.py)
    (4, True, 128): "W4A16",
    (4, False, 128): "W4A16_ASYM",
    (8, True, 128): "W8A16",
}


class GroupedIntModule(SourceModule):
    """An AWQ/GPTQ module; ``args``: ``bits``, ``group_size``, ``groups``, ``sym``, ``channel`` (one group per row)."""

    def unpack(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[r0, r1)`` of the unsigned values ``q [r, K]`` and zero points ``[r, G]``, as the format packs them."""
        raise NotImplementedError

    def int_rows(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``[r0, r1)``: unsigned ``q [r, K]``, zero points ``[r, G]`` (GPTQ v1 offset applied), scales
        ``[r, G]`` and ``g_idx [K]``."""
        q, z = self.unpack(r0, r1)
        s = cols(self.parts["scales"], r0, r1).t()
        return q.contiguous(), z.contiguous(), s.contiguous(), self.g_idx()

    def g_idx(self) -> torch.Tensor:
        """The group of each input column: the stored ``g_idx`` (GPTQ) or ``k // group_size``."""
        k, gs = self.shape[1], self.args["group_size"]
        if "g_idx" in self.parts:
            return read_tensor(self.parts["g_idx"]).to(torch.int64)
        return torch.arange(k, dtype=torch.int64) // gs

    def dense(self, r0: int, r1: int) -> torch.Tensor:
        q, z, s, g = self.int_rows(r0, r1)
        return dequant_grouped_int(q, z, s, g)

    def ct_problem(self) -> str | None:
        if "g_idx" in self.parts:
            g = read_tensor(self.parts["g_idx"]).to(torch.int64)
            if not torch.equal(g, torch.arange(self.shape[1]) // self.args["group_size"]):
                return (
                    "act-order (desc_act: g_idx is not k // group_size): compressed-tensors 0.19+ has no weight_g_idx "
                    "(actorder 'group' was removed; vLLM 0.33 rejects it); requantize with quantize --scheme instead"
                )
        if self.args["bits"] not in (4, 8):
            return f"{self.args['bits']}-bit weights: compressed-tensors pack-quantized is read by vLLM for 4 and 8 bits only"
        return None

    def ct_weights(self) -> dict:
        """The compressed-tensors weight QuantizationArgs (as compressed-tensors 0.20 dumps them) that express the source."""
        gs, k = self.args["group_size"], self.shape[1]
        channel = gs >= k and self.args.get("channel", False)
        return {
            "num_bits": self.args["bits"],
            "type": "int",
            "symmetric": self.args["sym"],
            "group_size": None if channel else gs,
            "strategy": "channel" if channel else "group",
            "dynamic": False,
        }

    def ct_outputs(self, with_input_scale: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
        n, k = self.shape
        bits, g = self.args["bits"], self.args["groups"]
        out = {"weight_packed": ("I32", (n, math.ceil(k * bits / 32))), "weight_scale": (self.parts["scales"].dtype, (n, g)), "weight_shape": ("I64", (2,))}
        if not self.args["sym"]:
            out["weight_zero_point"] = ("I32", (math.ceil(n * bits / 32), g))
        return out

    def ct_rows(self, r0: int, r1: int) -> dict[str, torch.Tensor]:
        """See :meth:`SourceModule.ct_rows`; raises ``ValueError`` for a zero point a symmetric source must not have."""
        bits = self.args["bits"]
        half = 1 << (bits - 1)
        q, z, s, _ = self.int_rows(r0, r1)
        out = {"weight_packed": pack_int32((q - half).to(torch.int8), bits), "weight_scale": s}
        if self.args["sym"]:
            bad = (z != half).nonzero()
            if bad.numel():
                row, grp = int(bad[0][0]), int(bad[0][1])
                raise ValueError(f"zero point {int(z[row, grp])} at row {r0 + row}, group {grp} in a symmetric (sym: true) checkpoint")
        else:
            out["weight_zero_point"] = pack_int32_dim0((z - half).to(torch.int8), bits)
        return out


class GroupedIntFormat(SourceFormat):
    """What AWQ and GPTQ share: a module per ``qweight``, and one ``pack-quantized`` group as the lossless
    conversion (a preset where one matches)."""

    def settings(self, qcfg: dict, where) -> dict:
        """The config's settings every module is read with; :class:`UnsupportedError` for those not read."""
        raise NotImplementedError

    def module(self, name: str, parts: dict[str, TensorInfo], qw: TensorInfo, settings: dict) -> GroupedIntModule:
        """The checked module of one ``qweight`` and the tensors beside it."""
        raise NotImplementedError

    def read(self, ckpt, qcfg, where, groups):
        settings = self.settings(qcfg, where)
        return [self.module(mod, parts, qw, settings) for mod, parts in groups.items() if (qw := qweight(parts)) is not None], {}

    def lossless(self, source, scheme=None) -> GroupSpec | None:
        """Raises :class:`UnsupportedError` for modules with different bits or group sizes."""
        mods = list(source.modules.values())
        specs = {(m.args["bits"], m.args["sym"], m.args["group_size"], m.args["channel"]) for m in mods}
        if len(specs) > 1:
            raise UnsupportedError(f"{self.kind} modules with different bits/group sizes: {sorted(specs)}", file=source.config_file)
        bits, sym, gs, channel = specs.pop()
        name = _PRESETS.get((bits, sym, gs)) if not channel else None
        if name is None:
            name = f"W{bits}A16{'' if sym else '_ASYM'} ({'channel' if channel else f'group {gs}'})"
        if scheme is not None and preset_key(scheme) != name:
            return None
        return GroupSpec(name, CompressionFormat.PACK_QUANTIZED.value, mods[0].ct_weights())


def qweight(parts: dict) -> TensorInfo | None:
    """A module's AutoAWQ/GPTQ ``qweight`` (2-D int32 words), or None when it has none."""
    qw = parts.get("qweight")
    if qw is not None and (qw.dtype != "I32" or len(qw.shape) != 2):
        raise BadInputError(f"qweight is {qw.dtype}{list(qw.shape)}, expected 2-D I32", **at(qw))
    return qw
