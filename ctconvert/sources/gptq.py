"""GPTQ checkpoints as a source (``quant_method: "gptq"``, ``checkpoint_format`` ``gptq`` (v1) or ``gptq_v2``).

``qweight [K*B/32, N]`` packs the values of each column down the rows, ``qzeros [G, N*B/32]`` along the
row (:func:`ctconvert.formats.foreign.gptq_unpack_rows` / ``gptq_unpack_cols``), v1 stores ``zero - 1``;
``g_idx [K]`` (act-order) maps columns to groups. Without act-order, converted losslessly to
compressed-tensors ``pack-quantized`` (:mod:`.grouped_int`).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..checkpoint.naming import FLOAT_DTYPES
from ..checkpoint.safetensors_io import read_tensor
from ..errors import BadInputError, UnsupportedError
from ..formats.foreign import gptq_unpack_cols, gptq_unpack_rows
from .base import at, cols, need, shape_is
from .grouped_int import GroupedIntFormat, GroupedIntModule

__all__ = ["GPTQ", "GPTQFormat", "GPTQModule"]


class GPTQModule(GroupedIntModule):
    """One GPTQ module (``qweight``, ``qzeros``, ``scales``, ``g_idx`` if stored); ``args["v1"]``: the v1 zero offset."""

    kind: ClassVar[str] = "gptq"

    def unpack(self, r0, r1):
        """``qweight``'s columns ``[r0, r1)`` unpacked down the rows, ``qzeros`` along them (v1: ``+ 1``)."""
        bits, n_k = self.args["bits"], self.shape[1]
        per = 32 // bits
        q = gptq_unpack_rows(cols(self.parts["qweight"], r0, r1), bits)[:n_k].t()
        w0, w1 = r0 // per, math.ceil(r1 / per)
        z = gptq_unpack_cols(cols(self.parts["qzeros"], w0, w1), bits).t()[r0 - w0 * per : r1 - w0 * per]
        if self.args["v1"]:
            z = (z + 1) & ((1 << bits) - 1)
        return q, z


class GPTQFormat(GroupedIntFormat):
    """``quant_method: "gptq"`` (``config.json`` or ``quantize_config.json``)."""

    def settings(self, qcfg, where):
        fmt = str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedError(f"GPTQ checkpoint_format {fmt!r}: only 'gptq' (v1) and 'gptq_v2' are read", file=where)
        bits = int(qcfg.get("bits") or 4)
        if 32 % bits:
            raise UnsupportedError(f"{bits}-bit GPTQ (values packed across int32 words) is not read", file=where)
        act_order = " act-order" if qcfg.get("desc_act") else ""
        return {"format": fmt, "bits": bits, "group_size": int(qcfg.get("group_size") or 128), "sym": bool(qcfg.get("sym", True)), "act_order": act_order}

    def module(self, name, parts, qw, settings):
        fmt, bits, gs, sym = settings["format"], settings["bits"], settings["group_size"], settings["sym"]
        k, n = qw.shape[0] * 32 // bits, qw.shape[1]
        g_size = k if gs <= 0 else gs
        groups_n = math.ceil(k / g_size)
        use = _tensors(parts, name, qw, k, n, bits, g_size, groups_n)
        args = {"bits": bits, "group_size": g_size, "groups": groups_n, "sym": sym, "v1": fmt == "gptq", "channel": gs <= 0}
        label = f"gptq{'' if fmt == 'gptq' else '_v2'} int{bits} group {g_size}{'' if sym else ' asym'}{settings['act_order']}"
        return GPTQModule(name, label, use, (n, k), use["scales"].dtype, 128, args)


def _tensors(parts, mod, qw, k, n, bits, g_size, groups_n) -> dict:
    """The checked stored tensors of one GPTQ module."""
    sc = need(parts, mod, "scales", qw, "GPTQ")
    qz = need(parts, mod, "qzeros", qw, "GPTQ")
    shape_is(sc, (groups_n, n), f"qweight {list(qw.shape)} (K={k}, N={n}, group {g_size})")
    shape_is(qz, (groups_n, math.ceil(n * bits / 32)), f"qweight {list(qw.shape)} (K={k}, N={n}, group {g_size}, {bits} bits)")
    if sc.dtype not in FLOAT_DTYPES or qz.dtype != "I32":
        raise BadInputError(f"scales {sc.dtype} / qzeros {qz.dtype}: expected float / I32", **at(sc))
    use = {"qweight": qw, "qzeros": qz, "scales": sc}
    if "g_idx" in parts:
        shape_is(parts["g_idx"], (k,), f"qweight {list(qw.shape)} (K={k})")
        use["g_idx"] = parts["g_idx"]
        g = read_tensor(parts["g_idx"]).to(torch.int64)
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups_n):
            raise BadInputError(f"g_idx holds groups outside [0, {groups_n})", **at(parts["g_idx"]))
    return use


#: the registered object (:mod:`ctconvert.sources`)
GPTQ = GPTQFormat("gptq", "gptq", "quantize_config.json")
