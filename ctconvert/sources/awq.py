"""AutoAWQ GEMM checkpoints as a source (``quant_method: "awq"``, ``version: "gemm"``, 4 bits, zero points).

``qweight [K, N/8]`` and ``qzeros [G, N/8]`` hold eight 4-bit values per int32 in AutoAWQ's
interleaved order (:func:`ctconvert.formats.foreign.awq_unpack`), ``scales [G, N]``; converted
losslessly to compressed-tensors ``pack-quantized`` int4 asymmetric (:mod:`.grouped_int`).
"""

from __future__ import annotations

import math
from typing import ClassVar

from ..checkpoint.naming import FLOAT_DTYPES
from ..errors import BadInputError, UnsupportedError
from ..formats.foreign import awq_unpack
from .base import at, cols, need, shape_is
from .grouped_int import GroupedIntFormat, GroupedIntModule

__all__ = ["AWQ", "AWQFormat", "AWQModule"]


class AWQModule(GroupedIntModule):
    """One AutoAWQ GEMM module (``qweight``, ``qzeros``, ``scales``)."""

    kind: ClassVar[str] = "awq"

    def unpack(self, r0, r1):
        """Eight output rows per int32 column of ``qweight`` and ``qzeros`` (AutoAWQ's interleaved order)."""
        w0, w1 = r0 // 8, math.ceil(r1 / 8)
        q = awq_unpack(cols(self.parts["qweight"], w0, w1)).t()[r0 - w0 * 8 : r1 - w0 * 8]
        z = awq_unpack(cols(self.parts["qzeros"], w0, w1)).t()[r0 - w0 * 8 : r1 - w0 * 8]
        return q, z


class AWQFormat(GroupedIntFormat):
    """``quant_method: "awq"`` (``config.json`` or ``quant_config.json``)."""

    def settings(self, qcfg, where):
        version = str(qcfg.get("version") or "gemm").lower()
        if version != "gemm":
            raise UnsupportedError(f"AutoAWQ version {version!r}: only GEMM packing is read", file=where)
        bits = int(qcfg.get("bits") or qcfg.get("w_bit") or 4)
        if bits != 4:
            raise UnsupportedError(f"AutoAWQ with {bits}-bit weights: only 4-bit GEMM is read", file=where)
        if qcfg.get("zero_point", True) is False:
            raise UnsupportedError("AutoAWQ zero_point: false is not read (AutoAWQ GEMM checkpoints store zero points)", file=where)
        return {"group_size": int(qcfg.get("group_size") or qcfg.get("q_group_size") or 128)}

    def module(self, name, parts, qw, settings):
        gs = settings["group_size"]
        k, n = qw.shape[0], qw.shape[1] * 8
        g_size = k if gs <= 0 else gs
        if k % g_size:
            raise BadInputError(f"K={k} is not a multiple of group_size {g_size} (shapes inconsistent)", **at(qw))
        groups_n = k // g_size
        sc = need(parts, name, "scales", qw, "AutoAWQ")
        qz = need(parts, name, "qzeros", qw, "AutoAWQ")
        shape_is(sc, (groups_n, n), f"qweight {list(qw.shape)} (K={k}, N={n}, group {g_size})")
        shape_is(qz, (groups_n, n // 8), f"qweight {list(qw.shape)} (K={k}, N={n}, group {g_size})")
        if sc.dtype not in FLOAT_DTYPES or qz.dtype != "I32":
            raise BadInputError(f"scales {sc.dtype} / qzeros {qz.dtype}: expected float / I32", **at(sc))
        args = {"bits": 4, "group_size": g_size, "groups": groups_n, "sym": False, "channel": gs <= 0}
        label = f"awq gemm int4 group {g_size} (qweight, qzeros, scales)"
        return AWQModule(name, label, {"qweight": qw, "qzeros": qz, "scales": sc}, (n, k), sc.dtype, 128, args)


#: the registered object (:mod:`ctconvert.sources`)
AWQ = AWQFormat("awq", "awq", "quant_config.json")
