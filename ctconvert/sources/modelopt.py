"""ModelOpt NVFP4 checkpoints as a source (``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``).

From ``config.json`` or ``hf_quant_config.json``: ``weight [N, K/2]`` E2M1 pairs, ``weight_scale [N, K/16]``
E4M3 block scales, one fp32 ``weight_scale_2`` (value = ``e2m1 * scale * weight_scale_2``,
:func:`ctconvert.formats.foreign.modelopt_nvfp4_dequantize`), optionally ``input_scale``.

Converted losslessly to compressed-tensors ``nvfp4-pack-quantized`` (``NVFP4`` with the source's
``input_scale`` as ``input_global_scale = 1 / input_scale``, as compressed-tensors 0.20
``converters/modelopt_nvfp4.py`` does; ``NVFP4A16`` without it): the bytes and block scales copied, and
``weight_global_scale`` the fp32 number that makes compressed-tensors' ``e2m1 * (scale / global)`` equal
ModelOpt's for every code (:func:`ctconvert.formats.foreign.nvfp4_global_scale_for`).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..checkpoint.naming import FLOAT_DTYPES, FUSED_OF, fused_set_name
from ..checkpoint.safetensors_io import read_rows, read_tensor
from ..errors import BadInputError, UnsupportedError, plural
from ..formats import CompressionFormat
from ..formats.foreign import modelopt_nvfp4_dequantize, nvfp4_global_scale_for
from .base import GroupSpec, SourceFormat, SourceModule, at, drop_kv_scales, need, preset_key, shape_is

__all__ = ["MODELOPT", "ModelOptFormat", "ModelOptModule"]

_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group", "dynamic": False}
_NVFP4_WEIGHTS["scale_dtype"] = "torch.float8_e4m3fn"
_NVFP4_INPUTS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": 16,
    "strategy": "tensor_group",
    "dynamic": "local",
    "scale_dtype": "torch.float8_e4m3fn",
    "observer": "static_minmax",
}
_NVFP4_PRESETS = ("NVFP4", "NVFP4A16", "W4A4_NVFP4")  # NVFP4A16 also matches an NVFP4 source: its input scales are left out


class ModelOptModule(SourceModule):
    """One ModelOpt NVFP4 module (``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale`` if stored)."""

    kind: ClassVar[str] = "modelopt-nvfp4"
    bits = 4
    group_size = 16  # E2M1 values, one E4M3 scale per 16 (docs/compressed-tensors-format.md §4.4)

    def scale_2(self) -> torch.Tensor:
        """``weight_scale_2`` as one fp32 value ``[1]``."""
        return read_tensor(self.parts["weight_scale_2"]).to(torch.float32).reshape(-1)[:1]

    def dense(self, r0: int, r1: int) -> torch.Tensor:
        return modelopt_nvfp4_dequantize(read_rows(self.parts["weight"], r0, r1), read_rows(self.parts["weight_scale"], r0, r1), self.scale_2())

    def ct_problem(self) -> str | None:
        return None

    def ct_outputs(self, with_input_scale: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
        n, k = self.shape
        out = {"weight_packed": ("U8", (n, k // 2)), "weight_scale": ("F8_E4M3", (n, k // 16)), "weight_global_scale": ("F32", (1,))}
        if with_input_scale and "input_scale" in self.parts:
            out["input_global_scale"] = ("F32", (1,))
        return out

    def ct_rows(self, r0: int, r1: int) -> dict[str, torch.Tensor]:
        return {"weight_packed": read_rows(self.parts["weight"], r0, r1), "weight_scale": read_rows(self.parts["weight_scale"], r0, r1)}


class ModelOptFormat(SourceFormat):
    """``quant_method: "modelopt"`` (``config.json``, or ``hf_quant_config.json``'s ``quantization``)."""

    def from_config_file(self, d: dict) -> dict:
        return {"quant_method": self.quant_method, **(d.get("quantization") or {}), "producer": d.get("producer")}

    def read(self, ckpt, qcfg, where, groups):
        algo = str(qcfg.get("quant_algo") or (qcfg.get("quantization") or {}).get("quant_algo") or "").upper()
        if algo != "NVFP4":
            raise UnsupportedError(f"ModelOpt quant_algo {algo or None!r}: only NVFP4 is read", file=where)
        gs = int(qcfg.get("group_size") or 16)
        if gs != 16:
            raise UnsupportedError(f"ModelOpt NVFP4 with group_size {gs}: NVFP4 blocks are 16 wide", file=where)
        out, dropped = [], {}
        for mod, parts in groups.items():
            w = parts.get("weight")
            if w is None or w.dtype != "U8":
                if "weight_scale_2" in parts:
                    raise BadInputError("weight_scale_2 without a packed uint8 weight", **at(parts["weight_scale_2"]))
                continue
            out.append(_module(mod, parts, w))
            drop_kv_scales(parts, dropped)
        for parts in groups.values():  # KV-cache scales on attention modules that are not quantized Linears
            drop_kv_scales(parts, dropped)
        return out, dropped

    def lossless(self, source, scheme=None) -> GroupSpec | None:
        if scheme is None:
            inputs = all("input_scale" in m.parts for m in source.modules.values())
        elif preset_key(scheme) in _NVFP4_PRESETS:
            inputs = preset_key(scheme) != "NVFP4A16"
        else:
            return None
        weights = dict(_NVFP4_WEIGHTS)
        return GroupSpec("NVFP4" if inputs else "NVFP4A16", CompressionFormat.NVFP4_PACK_QUANTIZED.value, weights, dict(_NVFP4_INPUTS) if inputs else None)

    def lossless_blocker(self, source) -> str | None:
        if (found := _fused_scale_problem(source)) is not None:
            return f"{found[0].name}: {found[1]}; each fused set requantized to one shared global scale"
        return None

    def lossless_tensors(self, source, spec, notes):
        """``weight_global_scale`` (and ``input_global_scale`` for ``NVFP4``) of every module. Raises
        :class:`UnsupportedError` for a ``weight_scale_2`` no fp32 global scale matches and for fused members
        with different ones, :class:`BadInputError` for a missing ``input_scale``."""
        extra: dict[str, dict[str, torch.Tensor]] = {}
        inexact = []
        for m in source.modules.values():
            w2 = float(m.scale_2())
            found = nvfp4_global_scale_for(w2)
            if found is None:
                raise UnsupportedError(
                    f"weight_scale_2 {w2!r} has no fp32 weight_global_scale that gives the same values (compressed-tensors divides by it)",
                    **at(m.parts["weight_scale_2"]),
                )
            g, exact = found
            if not exact:
                inexact.append(m.name)
            extra[m.name] = {"weight_global_scale": g.reshape(1)}
            if spec.inputs is not None:
                if "input_scale" not in m.parts:
                    raise BadInputError("NVFP4 (W4A4) needs input_scale for every module (scales missing)", **at(m.anchor))
                s = read_tensor(m.parts["input_scale"]).to(torch.float32).reshape(-1)[:1]
                extra[m.name]["input_global_scale"] = (1 / s).reshape(1)  # as compressed-tensors 0.20 converters/modelopt_nvfp4.py
        _check_fused(source)
        if inexact:
            notes.append(
                f"{plural(len(inexact), 'module')} (e.g. {inexact[0]}): 1 / weight_global_scale differs from weight_scale_2 in the last fp32 bit; "
                "every dequantized value is equal (compressed-tensors' formula), a kernel that multiplies by 1 / global scale sees a 1-ulp different factor"
            )
        return extra


def _module(mod: str, parts: dict, w) -> ModelOptModule:
    """The source module of one packed uint8 ``weight`` and its scales (checked)."""
    if len(w.shape) != 2:
        raise UnsupportedError(f"{len(w.shape)}-D NVFP4 weight; only 2-D Linear weights are read", **at(w))
    n, k = w.shape[0], w.shape[1] * 2
    sc = need(parts, mod, "weight_scale", w, "NVFP4")
    s2 = need(parts, mod, "weight_scale_2", w, "NVFP4")
    shape_is(sc, (n, k // 16), f"weight {list(w.shape)} (K={k}, blocks of 16)")
    if sc.dtype != "F8_E4M3":
        raise BadInputError(f"weight_scale is {sc.dtype}, expected F8_E4M3", **at(sc))
    if math.prod(s2.shape) != 1 or s2.dtype not in FLOAT_DTYPES:
        raise BadInputError(f"weight_scale_2 is {s2.dtype}{list(s2.shape)}, expected one float", **at(s2))
    use = {"weight": w, "weight_scale": sc, "weight_scale_2": s2}
    if "input_scale" in parts:
        use["input_scale"] = parts["input_scale"]
    return ModelOptModule(mod, "modelopt nvfp4 (weight, weight_scale, weight_scale_2)", use, (n, k), "BF16", 128, {})


def _fused_scale_problem(source):
    """The first fused set (q/k/v, gate/up) whose members have different ``weight_scale_2``, as ``(tensor info,
    message)``, else None: vLLM keeps one global scale per fused layer (and garbles MoE output from such
    checkpoints, vllm#54974), and compressed-tensors' ``weight_global_scale`` cannot differ within one."""
    sets: dict[str, list[ModelOptModule]] = {}
    for m in source.modules.values():
        parent, _, leaf = m.name.rpartition(".")
        if leaf in FUSED_OF:
            sets.setdefault(fused_set_name(parent, FUSED_OF[leaf]), []).append(m)
    for name, members in sets.items():
        values = {m.name.rpartition(".")[2]: float(m.scale_2()) for m in members}
        if len(set(values.values())) > 1:
            return members[-1].parts["weight_scale_2"], f"fused set {name} has a different weight_scale_2 per member ({values})"
    return None


def _check_fused(source) -> None:
    """Members of a fused set (q/k/v, gate/up) must share ``weight_scale_2``: vLLM keeps one global scale per fused
    layer. A lossless conversion cannot give them one; ``quantize --scheme NVFP4A16`` requantizes them to one."""
    found = _fused_scale_problem(source)
    if found is not None:
        info, message = found
        raise UnsupportedError(
            f"{message}; vLLM keeps one global scale per fused layer, so no lossless conversion exists: "
            "`ctconvert quantize SRC -o OUT --scheme NVFP4A16` requantizes each fused set to one shared global scale",
            **at(info),
        )


#: the registered object (:mod:`ctconvert.sources`)
MODELOPT = ModelOptFormat("modelopt", "modelopt", "hf_quant_config.json")
