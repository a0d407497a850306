"""Quantized checkpoints as sources: every input format ctconvert reads, seen as dense tensors.

:func:`open_source` looks at a checkpoint's quantization config and presents it
as a :class:`Source`: a *view* (a :class:`~.reader.Checkpoint` whose quantized
Linear modules are replaced by one virtual dense ``<module>.weight`` each, with
the shape and dtype of the dequantized weight and a reader that dequantizes rows
on demand), the formats of its modules, and what is dropped (the source's
activation and KV-cache scales). The planner plans on the view's dense names and
the executor reads its rows through :mod:`.safetensors_io` as from any tensor
(:attr:`~.safetensors_io.TensorInfo.virtual`), so a quantized checkpoint is
requantized in the same streaming pass as a dense one.

Sources read (the math of each is in :mod:`ctconvert.formats` and
:mod:`ctconvert.formats.foreign`, with its reference):

- compressed-tensors: every format of :data:`ctconvert.formats.FORMATS`
  (float-quantized FP8 channel/tensor/block, int- and pack-quantized sym/asym,
  naive-quantized, nvfp4- and mxfp4-pack-quantized, mxfp8-quantized), dequantized as its
  ``decompress`` does (docs/compressed-tensors-format.md §10);
- Hugging Face FP8 block (``quant_method: "fp8"``, ``weight_block_size``,
  ``weight_scale_inv``; the DeepSeek-V3/R1, Qwen3-FP8 layout, MoE experts and
  the MTP layer included: every module with a ``weight_scale_inv``);
- AutoAWQ GEMM (``quant_method: "awq"``), GPTQ (``quant_method: "gptq"``,
  ``checkpoint_format`` ``gptq`` or ``gptq_v2``) and ModelOpt NVFP4
  (``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``; from ``config.json`` or
  ``hf_quant_config.json``), which :mod:`ctconvert.commands.convert` also
  re-expresses losslessly in compressed-tensors (:meth:`SourceModule.ct_rows`).

Errors are one line naming the file and tensor: an unknown ``quant_method``
(:class:`UnsupportedError`), missing scales or inconsistent shapes
(:class:`BadInputError`), a feature that cannot be read (:class:`UnsupportedError`).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import BadInputError, UnsupportedError
from ..formats import CompressionFormat, WeightArgs, get_format
from ..formats.foreign import (
    awq_unpack,
    dequant_grouped_int,
    fp8_block_dequantize,
    gptq_unpack_cols,
    gptq_unpack_rows,
    modelopt_nvfp4_dequantize,
)
from ..formats.integer import pack_int32, pack_int32_dim0
from .kernel_native import KERNEL_NATIVE
from .modules import ACT_PARTS, QUANT_PARTS, dense_rows, dense_shape, modules_of
from .naming import FLOAT_DTYPES, is_linear_weight
from .reader import CONFIG_NAME, Checkpoint
from .safetensors_io import DTYPES, TensorInfo, map_rows, read_rows, read_tensor

__all__ = ["SOURCE_CONFIG_FILES", "Source", "SourceModule", "open_source"]

#: quantization configs other tools keep beside ``config.json`` (not copied into an output)
SOURCE_CONFIG_FILES = ("hf_quant_config.json", "quantize_config.json", "quant_config.json")
_KV_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")
_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group", "dynamic": False}
_NVFP4_WEIGHTS["scale_dtype"] = "torch.float8_e4m3fn"
_FP4 = (CompressionFormat.NVFP4_PACK_QUANTIZED.value, CompressionFormat.MXFP4_PACK_QUANTIZED.value)


@dataclass
class SourceModule:
    """One quantized Linear of a source: its tensors, its dense shape/dtype and how to read it.

    ``kind``: ``compressed-tensors`` | ``fp8-block`` | ``awq`` | ``gptq`` | ``modelopt-nvfp4``;
    ``label``: the format in words (plan and provenance); ``parts``: local name -> stored tensor;
    ``shape``: dense ``[N, K]``; ``dtype``: dense safetensors dtype; ``align``: dense row ranges
    are read from multiples of it; ``args``: what the kind's readers need (bits, group size ...).
    """

    name: str
    kind: str
    label: str
    parts: dict[str, TensorInfo]
    shape: tuple[int, int]
    dtype: str
    align: int = 128
    args: dict = field(default_factory=dict)

    @property
    def anchor(self) -> TensorInfo:
        """The stored tensor the virtual weight stands in for (file order, errors)."""
        for p in ("weight", "qweight", "weight_packed"):
            if p in self.parts:
                return self.parts[p]
        return next(iter(self.parts.values()))

    # -- dense rows ---------------------------------------------------------------------
    def dense(self, r0: int, r1: int) -> torch.Tensor:
        """Dense rows ``[r0, r1)`` (``r0`` a multiple of :attr:`align`) as the source's reference computes them."""
        kind = self.kind
        if kind == "compressed-tensors":
            return dense_rows(self.args["module"], r0, r1, self.shape[1])
        if kind == "fp8-block":
            bh, bw = self.args["block"]
            w = read_rows(self.parts["weight"], r0, r1)
            s = read_rows(self.parts["weight_scale_inv"], r0 // bh, math.ceil(r1 / bh))
            return fp8_block_dequantize(w, s, (bh, bw))
        if kind == "modelopt-nvfp4":
            return modelopt_nvfp4_dequantize(read_rows(self.parts["weight"], r0, r1), read_rows(self.parts["weight_scale"], r0, r1), self.scale_2())
        q, z, s, g = self.int_rows(r0, r1)
        return dequant_grouped_int(q, z, s, g)

    def int_rows(self, r0: int, r1: int):
        """AWQ/GPTQ rows ``[r0, r1)``: unsigned ``q [r, K]``, zero points ``[r, G]`` (GPTQ v1 offset
        applied), scales ``[r, G]`` and ``g_idx [K]``."""
        bits, n_k = self.args["bits"], self.shape[1]
        if self.kind == "awq":
            w0, w1 = r0 // 8, math.ceil(r1 / 8)
            q = awq_unpack(_cols(self.parts["qweight"], w0, w1)).t()[r0 - w0 * 8 : r1 - w0 * 8]
            z = awq_unpack(_cols(self.parts["qzeros"], w0, w1)).t()[r0 - w0 * 8 : r1 - w0 * 8]
        else:
            per = 32 // bits
            q = gptq_unpack_rows(_cols(self.parts["qweight"], r0, r1), bits)[:n_k].t()
            w0, w1 = r0 // per, math.ceil(r1 / per)
            z = gptq_unpack_cols(_cols(self.parts["qzeros"], w0, w1), bits).t()[r0 - w0 * per : r1 - w0 * per]
            if self.args["v1"]:
                z = (z + 1) & ((1 << bits) - 1)
        s = _cols(self.parts["scales"], r0, r1).t()
        return q.contiguous(), z.contiguous(), s.contiguous(), self.g_idx()

    def g_idx(self) -> torch.Tensor:
        """The group of each input column: the stored ``g_idx`` (GPTQ) or ``k // group_size``."""
        k, gs = self.shape[1], self.args["group_size"]
        if "g_idx" in self.parts:
            return read_tensor(self.parts["g_idx"]).to(torch.int64)
        return torch.arange(k, dtype=torch.int64) // gs

    def scale_2(self) -> torch.Tensor:
        return read_tensor(self.parts["weight_scale_2"]).to(torch.float32).reshape(-1)[:1]

    # -- lossless re-expression in compressed-tensors -------------------------------------------
    def ct_problem(self) -> str | None:
        """Why the values cannot be re-expressed in compressed-tensors without rounding, or None."""
        if self.kind in ("awq", "gptq"):
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
        if self.kind == "modelopt-nvfp4":
            return None
        return f"{self.kind} is not converted (it is already compressed-tensors, or requantized)"

    def ct_weights(self) -> dict:
        """The compressed-tensors weight QuantizationArgs (as compressed-tensors 0.20 dumps them) that express the source."""
        if self.kind == "modelopt-nvfp4":
            return dict(_NVFP4_WEIGHTS)
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
        """Local name -> (safetensors dtype, shape) of the compressed-tensors tensors of this module."""
        n, k = self.shape
        if self.kind == "modelopt-nvfp4":
            out = {"weight_packed": ("U8", (n, k // 2)), "weight_scale": ("F8_E4M3", (n, k // 16)), "weight_global_scale": ("F32", (1,))}
            if with_input_scale and "input_scale" in self.parts:
                out["input_global_scale"] = ("F32", (1,))
            return out
        bits = self.args["bits"]
        g = self.args["groups"]
        out = {"weight_packed": ("I32", (n, math.ceil(k * bits / 32))), "weight_scale": (self.parts["scales"].dtype, (n, g)), "weight_shape": ("I64", (2,))}
        if not self.args["sym"]:
            out["weight_zero_point"] = ("I32", (math.ceil(n * bits / 32), g))
        return out

    def ct_rows(self, r0: int, r1: int) -> dict[str, torch.Tensor]:
        """The compressed-tensors tensors of dense rows ``[r0, r1)`` (row-chunked ones only; ``r0`` a
        multiple of 128). Raises ``ValueError`` for a zero point a symmetric source must not have."""
        if self.kind == "modelopt-nvfp4":
            return {"weight_packed": read_rows(self.parts["weight"], r0, r1), "weight_scale": read_rows(self.parts["weight_scale"], r0, r1)}
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


class _Dense:
    """The reader of a virtual dense weight (:attr:`.safetensors_io.TensorInfo.virtual`)."""

    def __init__(self, mod: SourceModule):
        self.mod = mod
        self.dtype = DTYPES[mod.dtype][0]
        self.row_bytes = mod.shape[1] * DTYPES[mod.dtype][1]

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        m = self.mod
        a0 = r0 // m.align * m.align
        a1 = min(m.shape[0], math.ceil(r1 / m.align) * m.align)
        try:
            t = m.dense(a0, a1) if a1 > a0 else torch.empty((0, m.shape[1]), dtype=self.dtype)
        except (KeyError, ValueError, RuntimeError, IndexError) as e:
            a = m.anchor
            raise BadInputError(f"cannot dequantize ({m.label}): {e}", file=str(a.file), tensor=a.name) from e
        return t.to(self.dtype)[r0 - a0 : r1 - a0]

    def stored(self) -> list:
        """The stored tensors this weight is computed from (what provenance hashes: :mod:`.hashing`)."""
        return list(self.mod.parts.values())

    def read_bytes(self, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        r0 = offset // self.row_bytes
        r1 = math.ceil((offset + nbytes) / self.row_bytes) if nbytes else r0
        raw = self.rows(r0, r1).contiguous().reshape(-1).view(torch.uint8)
        raw = raw[offset - r0 * self.row_bytes :][:nbytes]
        if out is None:
            return raw.clone()
        out[:nbytes].copy_(raw)
        return out[:nbytes]

    def describe(self) -> dict:
        m = self.mod
        return {"format": m.label, "tensors": [i.name for i in m.parts.values()]}


@dataclass
class Source:
    """A checkpoint seen through its quantization: see the module docstring.

    ``kind``: ``dense`` or a :class:`SourceModule` kind; ``view``: the dense view (``original``
    itself for a dense checkpoint); ``modules``: quantized modules by name; ``dropped``: stored
    tensor -> why it has no place in the view; ``dense_linear``: modules whose Linear weight is
    dense in the source (a requantized output keeps them dense: the source's ``ignore`` carries
    over); ``config_file``: where the quantization config was read.
    """

    kind: str
    original: Checkpoint
    view: Checkpoint
    quantization_config: dict | None = None
    config_file: Path | None = None
    modules: dict[str, SourceModule] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    dense_linear: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        return self.kind != "dense"

    @property
    def quant_method(self) -> str | None:
        return (self.quantization_config or {}).get("quant_method")

    def format_of(self, name: str) -> str | None:
        """The source format of a view tensor: its module's label, None for a stored dense tensor."""
        info = self.view.tensors.get(name)
        return info.virtual.mod.label if info is not None and info.virtual is not None else None

    def derived_from(self) -> dict:
        """What an output made from this source records (provenance, ``inspect``)."""
        labels = sorted({m.label for m in self.modules.values()})
        path = os.path.normpath(os.path.abspath(self.original.path))  # absolute and normalised, whatever the caller passed (no ./, ..)
        return {"path": path, "quant_method": self.quant_method, "source_format": self.kind, "formats": labels}


def open_source(ckpt: Checkpoint) -> Source:
    """The :class:`Source` of an opened checkpoint (headers and small tensors only: ``weight_shape``,
    ``g_idx``). Raises :class:`UnsupportedError` for an unknown ``quant_method`` or a feature that
    cannot be read, :class:`BadInputError` for missing scales or inconsistent shapes."""
    qcfg, where = _quant_config(ckpt)
    if qcfg is None:
        return Source("dense", ckpt, ckpt)
    qm = str(qcfg.get("quant_method") or "").lower()
    readers = {"compressed-tensors": _ct_modules, "fp8": _fp8_modules, "awq": _awq_modules, "gptq": _gptq_modules, "modelopt": _modelopt_modules}
    if qm == KERNEL_NATIVE:  # ctconvert's own kernel-native layout: its inverse is the readable checkpoint
        target = qcfg.get("target", "kernel-native")
        raise UnsupportedError(
            f"a ctconvert kernel-native ({target}) checkpoint, which only its kernel reads: "
            f"`ctconvert repack {ckpt.path} -o OUT --target compressed-tensors` restores the compressed-tensors checkpoint, which this command takes",
            file=where,
        )
    if qm == "mxfp4":  # gpt-oss as OpenAI ships it (``*_blocks``/``*_scales``): not read yet, the way round is transformers'
        raise UnsupportedError(
            "quant_method 'mxfp4' (gpt-oss's own MXFP4 experts, *_blocks/*_scales) is not read yet: write a bf16 copy with transformers "
            "(from_pretrained(SRC, quantization_config=Mxfp4Config(dequantize=True)).save_pretrained(NEW)) and quantize that",
            file=where,
        )
    if qm not in readers:
        raise UnsupportedError(f"unknown quant_method {qm or None!r}; ctconvert reads: {', '.join(readers)}", file=where)
    groups: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in ckpt.tensors.items():
        mod, _, part = name.rpartition(".")
        groups[mod][part] = info
    mods, dropped = readers[qm](ckpt, qcfg, where, groups)
    if not mods:
        raise BadInputError(f"quant_method {qm!r} but no quantized module was found", file=where)
    return _assemble(ckpt, qcfg, where, qm if qm != "fp8" else "fp8-block", mods, dropped)


def _assemble(ckpt: Checkpoint, qcfg: dict, where: Path, kind: str, mods: list[SourceModule], dropped: dict[str, str]) -> Source:
    consumed = {i.name: m for m in mods for i in m.parts.values()}
    anchors = {m.anchor.name: m for m in mods}
    tensors: dict[str, TensorInfo] = {}
    dense_linear = []
    for name in sorted(ckpt.tensors, key=lambda n: (str(ckpt.tensors[n].file), ckpt.tensors[n].start)):
        info = ckpt.tensors[name]
        if name in anchors:
            m = anchors[name]
            vname = m.name + ".weight"
            nbytes = m.shape[0] * m.shape[1] * DTYPES[m.dtype][1]
            tensors[vname] = TensorInfo(vname, info.file, m.dtype, m.shape, info.start, nbytes, virtual=_Dense(m))
        elif name in consumed or name in dropped:
            continue
        else:
            tensors[name] = info
            if is_linear_weight(name, info):
                dense_linear.append(name[: -len(".weight")])
    config = copy.deepcopy(ckpt.config)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    view = Checkpoint(ckpt.path, config, tensors, ckpt.files, ckpt.index, list(ckpt.problems))
    return Source(kind, ckpt, view, qcfg, where, {m.name: m for m in mods}, dropped, dense_linear)


def _quant_config(ckpt: Checkpoint) -> tuple[dict | None, Path | None]:
    """The quantization config and its file: ``config.json``'s, else a tool's own file beside it."""
    if ckpt.quantization_config is not None:
        return ckpt.quantization_config, ckpt.path / CONFIG_NAME
    for fname, method in zip(SOURCE_CONFIG_FILES, ("modelopt", "gptq", "awq")):
        p = ckpt.path / fname
        if not p.is_file():
            continue
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise BadInputError(f"cannot read {fname}: {e}", file=p) from e
        if not isinstance(d, dict):
            raise BadInputError(f"{fname} is not a JSON object", file=p)
        if method == "modelopt":
            d = {"quant_method": "modelopt", **(d.get("quantization") or {}), "producer": d.get("producer")}
        d.setdefault("quant_method", method)
        return d, p
    return None, None


def _where(info: TensorInfo) -> dict:
    return {"file": str(info.file), "tensor": info.name}


def _cols(info: TensorInfo, c0: int, c1: int) -> torch.Tensor:
    """Columns ``[c0, c1)`` of a stored 2-D tensor (through a mapping: only those bytes are read)."""
    return map_rows(info, 0, info.shape[0])[:, c0:c1].clone()


def _need(parts: dict[str, TensorInfo], name: str, part: str, anchor: TensorInfo, what: str) -> TensorInfo:
    if part not in parts:
        raise BadInputError(f"{what} {name}.{part} is missing (scales missing)", **_where(anchor))
    return parts[part]


def _shape_is(info: TensorInfo, want: tuple[int, ...], what: str) -> None:
    if tuple(info.shape) != tuple(want):
        raise BadInputError(f"{info.dtype}{list(info.shape)} but {what} needs {list(want)} (shapes inconsistent)", **_where(info))


# -- compressed-tensors ------------------------------------------------------------------------


def _ct_modules(ckpt, qcfg, where, groups):
    if (qcfg.get("sparsity_config") or {}).get("format"):
        raise UnsupportedError(f"sparse format {qcfg['sparsity_config']['format']!r} cannot be read", file=where)
    out, dropped = [], {}
    for m in modules_of(ckpt).values():
        if not m.quantized:
            continue
        anchor = m.parts.get("weight_packed") or m.parts.get("weight")
        if m.group is None:
            raise BadInputError("quantized tensors that no config group targets", **_where(anchor))
        if get_format(m.format) is None:
            raise UnsupportedError(f"format {m.format!r} cannot be dequantized", **_where(anchor))
        if m.format == "marlin-24":
            raise UnsupportedError("marlin-24 is a kernel layout spanning whole modules: decompress it first, then quantize", **_where(anchor))
        if "weight_g_idx" in m.parts:
            raise UnsupportedError("act-order weights (weight_g_idx, compressed-tensors <= 0.18 actorder 'group') cannot be dequantized", **_where(anchor))
        if len(anchor.shape) != 2:
            raise UnsupportedError(f"{len(anchor.shape)}-D quantized weight; only 2-D Linear weights are read", **_where(anchor))
        args = WeightArgs.from_dict(m.weights)
        try:
            shape = tuple(dense_shape(m))
        except (KeyError, ValueError) as e:
            raise BadInputError(f"cannot tell the dense shape: {e}", **_where(anchor)) from e
        scale = m.parts.get("weight_scale")
        if scale is None:
            raise BadInputError(f"{m.name}.weight_scale is missing (scales missing)", **_where(anchor))
        # the dtype decompress gives: the scale's (int and FP8 formats), bf16 for E4M3/E8M0-scaled microscale
        # formats (NVFP4, MXFP4, MXFP8), fp16 for another integer scale (docs/compressed-tensors-format.md §10)
        dtype = scale.dtype if scale.dtype in FLOAT_DTYPES else "BF16" if m.format in _FP4 or scale.dtype in ("U8", "F8_E4M3") else "F16"
        align = math.lcm(128, args.block_structure[0]) if args.strategy == "block" and args.block_structure else 128
        # the tensors the dense weight is computed from; the module's others (its bias) pass through as they are
        parts = {p: i for p, i in m.parts.items() if p == "weight" or p in QUANT_PARTS}
        for p, i in m.parts.items():
            if p in ACT_PARTS:
                dropped[i.name] = "activation scale of the source's quantization"
        label = f"compressed-tensors {m.format} ({_describe(args)})"
        out.append(SourceModule(m.name, "compressed-tensors", label, parts, shape, dtype, align, {"module": m}))
    if qcfg.get("kv_cache_scheme"):
        for parts in groups.values():
            for p in _KV_SCALES:
                if p in parts:
                    dropped[parts[p].name] = "KV-cache scale of the source's quantization"
    return out, dropped


def _describe(a: WeightArgs) -> str:
    unit = {"block": "block " + "x".join(map(str, a.block_structure or ())), "channel": "channel", "tensor": "tensor"}.get(a.strategy, f"group {a.group_size}")
    return f"{a.type}{a.num_bits} {unit}{'' if a.symmetric else ' asym'}"


# -- Hugging Face FP8 block --------------------------------------------------------------------


def _fp8_modules(ckpt, qcfg, where, groups):
    block = qcfg.get("weight_block_size")
    if not block or len(block) != 2:
        raise UnsupportedError("quant_method 'fp8' without a two-value weight_block_size (per-tensor FP8) is not read", file=where)
    bh, bw = (int(x) for x in block)
    out, dropped = [], {}
    for mod, parts in groups.items():
        w = parts.get("weight")
        if "weight_scale_inv" not in parts:
            if w is not None and w.dtype in ("F8_E4M3", "F8_E5M2"):
                raise BadInputError("FP8 weight without weight_scale_inv (scales missing)", **_where(w))
            continue
        s = parts["weight_scale_inv"]
        if w is None:
            raise BadInputError("weight_scale_inv without a weight (tensor missing)", **_where(s))
        if w.dtype != "F8_E4M3":
            raise BadInputError(f"weight is {w.dtype}; a weight with weight_scale_inv must be F8_E4M3", **_where(w))
        if len(w.shape) != 2:
            raise UnsupportedError(f"{len(w.shape)}-D FP8 weight; only 2-D Linear weights are read", **_where(w))
        n, k = w.shape
        _shape_is(s, (math.ceil(n / bh), math.ceil(k / bw)), f"weight {list(w.shape)} with {bh}x{bw} blocks")
        if s.dtype not in FLOAT_DTYPES:
            raise BadInputError(f"weight_scale_inv is {s.dtype}, not a float", **_where(s))
        for p in ACT_PARTS:
            if p in parts:
                dropped[parts[p].name] = "activation scale of the source's quantization"
        label = f"fp8 block {bh}x{bw} (weight_scale_inv)"
        out.append(SourceModule(mod, "fp8-block", label, {"weight": w, "weight_scale_inv": s}, (n, k), "BF16", math.lcm(128, bh), {"block": (bh, bw)}))
    return out, dropped


# -- AutoAWQ GEMM --------------------------------------------------------------------------------


def _qweight(parts: dict) -> TensorInfo | None:
    """A module's AutoAWQ/GPTQ ``qweight`` (2-D int32 words), or None when it has none."""
    qw = parts.get("qweight")
    if qw is not None and (qw.dtype != "I32" or len(qw.shape) != 2):
        raise BadInputError(f"qweight is {qw.dtype}{list(qw.shape)}, expected 2-D I32", **_where(qw))
    return qw


def _awq_modules(ckpt, qcfg, where, groups):
    version = str(qcfg.get("version") or "gemm").lower()
    if version != "gemm":
        raise UnsupportedError(f"AutoAWQ version {version!r}: only GEMM packing is read", file=where)
    bits = int(qcfg.get("bits") or qcfg.get("w_bit") or 4)
    if bits != 4:
        raise UnsupportedError(f"AutoAWQ with {bits}-bit weights: only 4-bit GEMM is read", file=where)
    if qcfg.get("zero_point", True) is False:
        raise UnsupportedError("AutoAWQ zero_point: false is not read (AutoAWQ GEMM checkpoints store zero points)", file=where)
    gs = int(qcfg.get("group_size") or qcfg.get("q_group_size") or 128)
    out = []
    for mod, parts in groups.items():
        if (qw := _qweight(parts)) is None:
            continue
        k, n = qw.shape[0], qw.shape[1] * 8
        g_size = k if gs <= 0 else gs
        if k % g_size:
            raise BadInputError(f"K={k} is not a multiple of group_size {g_size} (shapes inconsistent)", **_where(qw))
        groups_n = k // g_size
        sc = _need(parts, mod, "scales", qw, "AutoAWQ")
        qz = _need(parts, mod, "qzeros", qw, "AutoAWQ")
        _shape_is(sc, (groups_n, n), f"qweight {list(qw.shape)} (K={k}, N={n}, group {g_size})")
        _shape_is(qz, (groups_n, n // 8), f"qweight {list(qw.shape)} (K={k}, N={n}, group {g_size})")
        if sc.dtype not in FLOAT_DTYPES or qz.dtype != "I32":
            raise BadInputError(f"scales {sc.dtype} / qzeros {qz.dtype}: expected float / I32", **_where(sc))
        args = {"bits": 4, "group_size": g_size, "groups": groups_n, "sym": False, "channel": gs <= 0}
        label = f"awq gemm int4 group {g_size} (qweight, qzeros, scales)"
        out.append(SourceModule(mod, "awq", label, {"qweight": qw, "qzeros": qz, "scales": sc}, (n, k), sc.dtype, 128, args))
    return out, {}


# -- GPTQ ------------------------------------------------------------------------------------------


def _gptq_modules(ckpt, qcfg, where, groups):
    fmt = str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedError(f"GPTQ checkpoint_format {fmt!r}: only 'gptq' (v1) and 'gptq_v2' are read", file=where)
    bits = int(qcfg.get("bits") or 4)
    if 32 % bits:
        raise UnsupportedError(f"{bits}-bit GPTQ (values packed across int32 words) is not read", file=where)
    gs = int(qcfg.get("group_size") or 128)
    sym = bool(qcfg.get("sym", True))
    out = []
    for mod, parts in groups.items():
        if (qw := _qweight(parts)) is None:
            continue
        k, n = qw.shape[0] * 32 // bits, qw.shape[1]
        g_size = k if gs <= 0 else gs
        groups_n = math.ceil(k / g_size)
        sc = _need(parts, mod, "scales", qw, "GPTQ")
        qz = _need(parts, mod, "qzeros", qw, "GPTQ")
        _shape_is(sc, (groups_n, n), f"qweight {list(qw.shape)} (K={k}, N={n}, group {g_size})")
        _shape_is(qz, (groups_n, math.ceil(n * bits / 32)), f"qweight {list(qw.shape)} (K={k}, N={n}, group {g_size}, {bits} bits)")
        if sc.dtype not in FLOAT_DTYPES or qz.dtype != "I32":
            raise BadInputError(f"scales {sc.dtype} / qzeros {qz.dtype}: expected float / I32", **_where(sc))
        use = {"qweight": qw, "qzeros": qz, "scales": sc}
        if "g_idx" in parts:
            _shape_is(parts["g_idx"], (k,), f"qweight {list(qw.shape)} (K={k})")
            use["g_idx"] = parts["g_idx"]
            g = read_tensor(parts["g_idx"]).to(torch.int64)
            if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups_n):
                raise BadInputError(f"g_idx holds groups outside [0, {groups_n})", **_where(parts["g_idx"]))
        args = {"bits": bits, "group_size": g_size, "groups": groups_n, "sym": sym, "v1": fmt == "gptq", "channel": gs <= 0}
        label = f"gptq{'' if fmt == 'gptq' else '_v2'} int{bits} group {g_size}{'' if sym else ' asym'}{' act-order' if qcfg.get('desc_act') else ''}"
        out.append(SourceModule(mod, "gptq", label, use, (n, k), sc.dtype, 128, args))
    return out, {}


# -- ModelOpt NVFP4 ------------------------------------------------------------------------------


def _modelopt_modules(ckpt, qcfg, where, groups):
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
                raise BadInputError("weight_scale_2 without a packed uint8 weight", **_where(parts["weight_scale_2"]))
            continue
        if len(w.shape) != 2:
            raise UnsupportedError(f"{len(w.shape)}-D NVFP4 weight; only 2-D Linear weights are read", **_where(w))
        n, k = w.shape[0], w.shape[1] * 2
        sc = _need(parts, mod, "weight_scale", w, "NVFP4")
        s2 = _need(parts, mod, "weight_scale_2", w, "NVFP4")
        _shape_is(sc, (n, k // 16), f"weight {list(w.shape)} (K={k}, blocks of 16)")
        if sc.dtype != "F8_E4M3":
            raise BadInputError(f"weight_scale is {sc.dtype}, expected F8_E4M3", **_where(sc))
        if math.prod(s2.shape) != 1 or s2.dtype not in FLOAT_DTYPES:
            raise BadInputError(f"weight_scale_2 is {s2.dtype}{list(s2.shape)}, expected one float", **_where(s2))
        use = {"weight": w, "weight_scale": sc, "weight_scale_2": s2}
        if "input_scale" in parts:
            use["input_scale"] = parts["input_scale"]
        for p in _KV_SCALES:
            if p in parts:
                dropped[parts[p].name] = "KV-cache scale of the source's quantization"
        out.append(SourceModule(mod, "modelopt-nvfp4", "modelopt nvfp4 (weight, weight_scale, weight_scale_2)", use, (n, k), "BF16", 128, {}))
    for parts in groups.values():  # KV-cache scales on attention modules that are not quantized Linears
        for p in _KV_SCALES:
            if p in parts:
                dropped[parts[p].name] = "KV-cache scale of the source's quantization"
    return out, dropped
