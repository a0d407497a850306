"""The modules of a compressed-tensors checkpoint: which group, format and args each has, and its dense rows.

Group resolution follows compressed-tensors (:func:`.naming.resolve_group`);
the shapes, the rows of each stored tensor and the dequantization come from
the module's format object (:data:`ctconvert.formats.FORMATS`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..formats import CompressionFormat, WeightArgs, get_format
from ..formats.base import dequantize_unpacked, part_rows
from ..layouts.marlin24 import marlin24_unpack, marlin24_unpermute_scales
from .naming import FLOAT_DTYPES, FUSED_OF, dense_kind, fused_set_name, is_linear_weight, matches, resolve_group
from .reader import Checkpoint, Problem
from .safetensors_io import TensorInfo, read_spans, read_tensor

__all__ = [
    "ACT_PARTS",
    "KV_PARTS",
    "QUANT_PARTS",
    "SPARSITY_GROUP",
    "Module",
    "dense_row_chunks",
    "dense_rows",
    "dense_shape",
    "FUSED_SHARED",
    "fused_global_scales",
    "fused_scalars",
    "module_rows",
    "modules_of",
    "unexplained_dense",
    "with_files",
]

QUANT_PARTS = (
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_global_scale",
    "weight_shape",
    "weight_g_idx",
    *("compressed", "bitmask", "shape"),  # sparse-24-bitmask (docs/compressed-tensors-format.md §4.8)
    *("meta", "scale_packed"),  # marlin-24 (§4.8)
)
#: the pseudo group of modules a sparse-only checkpoint stores as sparse-24-bitmask (no config group)
SPARSITY_GROUP = "sparsity_config"
ACT_PARTS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point")
#: an attention module's KV cache scales (``kv_cache_scheme``; compressed-tensors ``quant_metadata.py`` ``KVCacheScaleType``)
KV_PARTS = ("k_scale", "v_scale", "q_scale")


@dataclass
class Module:
    name: str
    parts: dict[str, TensorInfo] = field(default_factory=dict)  # local name -> tensor
    group: str | None = None
    format: str | None = None
    weights: dict | None = None
    #: ``(weight_shape's TensorInfo, its values)`` once :func:`dense_shape` read them: verify's checks ask a module's
    #: dense shape several times (widths, attention rows, conformance, values), and each read opened the shard
    _weight_shape: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def quantized(self) -> bool:
        return "weight_packed" in self.parts or "compressed" in self.parts or {"weight", "weight_scale"} <= self.parts.keys()

    @property
    def file(self) -> str:
        """The file that holds the module's first tensor (where its problems are reported)."""
        return str(next(iter(self.parts.values())).file)


def modules_of(ckpt: Checkpoint) -> dict[str, Module]:
    """Group tensors by module and attach each quantized module's group, format and weight args."""
    qcfg = ckpt.quantization_config or {}
    groups = qcfg.get("config_groups") or {}
    mods: dict[str, Module] = defaultdict(lambda: Module(""))
    for name, info in ckpt.tensors.items():
        mod, _, part = name.rpartition(".")
        m = mods[mod]
        m.name = mod
        m.parts[part] = info
    for m in mods.values():
        w = m.parts.get("weight")
        linear = m.quantized or (w is not None and is_linear_weight(m.name + ".weight", w))
        if not qcfg or not linear:
            continue
        g = resolve_group(m.name, qcfg, True)
        if g is not None:
            m.group = g
            m.format = groups[g].get("format") or qcfg.get("format")
            m.weights = groups[g].get("weights") or {}
        if "compressed" in m.parts and (qcfg.get("sparsity_config") or {}).get("format") == CompressionFormat.SPARSE_24_BITMASK.value:
            # values stored as sparse-24-bitmask, over the group's quantization format or dense (sparse only)
            m.format = CompressionFormat.SPARSE_24_BITMASK.value + (f"+{m.format}" if g is not None else "")
            if g is None:
                m.group, m.weights = SPARSITY_GROUP, {}
    return dict(mods)


def dense_shape(m: Module) -> tuple[int, int]:
    """``[N, K]`` of a quantized module: ``weight_shape`` when stored, else from the tensor shapes
    (a packed weight without a known format is taken as FP4 when uint8, else int4). Raises
    ``ValueError`` for a module whose format is unknown."""
    ws = m.parts.get("weight_shape")
    shape = None
    if ws is not None:
        if m._weight_shape is None or m._weight_shape[0] is not ws:  # (read once per stored tensor)
            m._weight_shape = (ws, [int(x) for x in read_tensor(ws).tolist()])
        shape = list(m._weight_shape[1])
    fmt = get_format(m.format)
    if fmt is None and "weight_packed" in m.parts:
        packed_u8 = m.parts["weight_packed"].dtype == "U8"
        fmt = get_format(CompressionFormat.NVFP4_PACK_QUANTIZED if packed_u8 else CompressionFormat.PACK_QUANTIZED)
    if fmt is None:
        fmt = get_format(CompressionFormat.FLOAT_QUANTIZED)  # an unpacked ``weight``
    return fmt.dense_shape({p: tuple(i.shape) for p, i in m.parts.items()}, WeightArgs.from_dict(m.weights, num_bits=4), shape)


def module_spans(m: Module, r0: int, r1: int) -> dict[str, tuple[TensorInfo, int | None, int | None]]:
    """Which stored tensors of module ``m``, and which of their rows, cover dense rows ``[r0, r1)``
    (:func:`~ctconvert.formats.base.part_rows`): part -> ``(tensor, a, b)``, rows ``[a, b)`` of it, or ``(tensor,
    None, None)``: all of it (per-tensor and global scales)."""
    args = WeightArgs.from_dict(m.weights)
    out: dict[str, tuple[TensorInfo, int | None, int | None]] = {}
    for part, info in m.parts.items():
        rows = part_rows(part, tuple(info.shape), info.dtype, r0, r1, args)
        if rows is None:
            out[part] = (info, None, None)
        elif rows is not False:
            out[part] = (info, *rows)
    return out


def module_rows(m: Module, r0: int, r1: int, mapped: bool = False) -> dict[str, torch.Tensor]:
    """The compressed tensors of module ``m`` that cover dense rows ``[r0, r1)`` (:func:`module_spans`, read).
    ``mapped``: row ranges are read-only views of the mapped files (:func:`.safetensors_io.map_rows`: no copy)."""
    return read_spans(module_spans(m, r0, r1), mapped)


def dense_row_chunks(m: Module, chunk_elems: int, dtype: torch.dtype | None = None, alloc=None, mapped: bool = False):
    """Yield ``(r0, r1, dense rows)`` of a quantized module, dequantized as compressed-tensors does,
    in chunks of about ``chunk_elems`` elements (multiples of 128 rows, so blocks and packed
    zero points stay whole). ``dtype``: the rows cast to it (as ``.to(dtype)``; fused into the CPU
    kernel); ``alloc(shape, dtype)``: where each chunk goes (a reused buffer; with ``dtype``);
    ``mapped``: see :func:`module_rows`. Raises what :func:`dequantize_weight` raises."""
    n, k = dense_shape(m)
    fmt, args = get_format(m.format), WeightArgs.from_dict(m.weights)
    if fmt is None:
        raise ValueError(f"cannot dequantize format {m.format!r}")
    if m.format == CompressionFormat.MARLIN_24.value:  # the kernel layout spans all rows: the module at once
        dense = _marlin24_dense(m, n, k, args)
        yield 0, n, dense if dtype is None else dense.to(dtype)
        return
    step = max(128, (chunk_elems // max(1, k)) // 128 * 128)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        out = alloc((r1 - r0, k), dtype) if alloc is not None and dtype is not None else None
        yield r0, r1, dense_rows(m, r0, r1, k, dtype=dtype, out=out, mapped=mapped)


def dense_rows(
    m: Module, r0: int, r1: int, k: int | None = None, dtype: torch.dtype | None = None, out: torch.Tensor | None = None, mapped: bool = False
) -> torch.Tensor:
    """Dense rows ``[r0, r1)`` of a quantized module, dequantized as compressed-tensors does (``r0`` a
    multiple of 128, or of the block height when larger, so blocks and packed zero points stay whole).
    ``k``: the dense K when known (:func:`dense_shape`); ``dtype``, ``out``: as the format's
    :meth:`~ctconvert.formats.base.WeightFormat.dequantize` takes them; ``mapped``: see :func:`module_rows`.
    Raises what :func:`dequantize_weight` raises."""
    fmt, args = get_format(m.format), WeightArgs.from_dict(m.weights)
    if fmt is None:
        raise ValueError(f"cannot dequantize format {m.format!r}")
    parts = module_rows(m, r0, r1, mapped=mapped)
    if "weight_shape" in m.parts:
        parts["weight_shape"] = torch.tensor([r1 - r0, dense_shape(m)[1] if k is None else k])
    return fmt.dequantize(parts, args, dtype=dtype, out=out)


def fused_global_scales(mods: dict[str, Module]) -> dict[str, dict[str, float]]:
    """NVFP4 ``weight_global_scale`` of every fused-set member, by set (parent module name)."""
    return fused_scalars(mods, "weight_global_scale")


#: the one-element tensors every member of a fused set (q/k/v, gate/up) must hold with one value, and what they are: vLLM
#: 0.33 builds one layer of the set and keeps one of each (the NVFP4 global scales; the calibrated input scales, which
#: the members share since they read the same input: ``input_global_scale`` of NVFP4 W4A4, the static ``input_scale``
#: and ``input_zero_point`` of FP8 and W8A8_STATIC(_ASYM))
FUSED_SHARED = {
    "weight_global_scale": "NVFP4 global scales",
    "input_global_scale": "input global scales (calibrated: the members read the same input; vLLM 0.33 serves the fused layer with their "
    "largest and warns of reduced accuracy, compressed_tensors_w4a4_nvfp4.py)",
    "input_scale": "static input scales (calibrated: the members read the same input)",
    "input_zero_point": "static input zero points (calibrated: the members read the same input)",
}


def fused_scalars(mods: dict[str, Module], part: str) -> dict[str, dict[str, float]]:
    """The one-element tensor ``part`` of every fused-set member that holds one, by set (parent module name)."""
    sets: dict[str, dict[str, float]] = {}
    for m in mods.values():
        parent, _, leaf = m.name.rpartition(".")
        info = m.parts.get(part)
        if info is not None and leaf in FUSED_OF and math.prod(info.shape) == 1:
            sets.setdefault(fused_set_name(parent, FUSED_OF[leaf]), {})[leaf] = float(read_tensor(info).float().reshape(-1)[0])
    return sets


def _marlin24_dense(m: Module, n: int, k: int, args: WeightArgs) -> torch.Tensor:
    """The fp16 dense weight of a marlin-24 module: unpacked (:mod:`ctconvert.layouts.marlin24`), then
    ``q * scale`` in fp16 as compressed-tensors dequantizes symmetric int weights."""
    g = args.group_size if args.strategy == "group" else None
    q = marlin24_unpack(read_tensor(m.parts["weight_packed"]), read_tensor(m.parts["meta"]), n, k)
    scale = marlin24_unpermute_scales(read_tensor(m.parts["scale_packed"]), k, g)
    return dequantize_unpacked({"weight": q, "weight_scale": scale}, args)


def unexplained_dense(ckpt: Checkpoint, mods: dict[str, Module]) -> list[Problem]:
    """Dense floating tensors of 2 or more dimensions in a quantized checkpoint that its config does not explain.

    Explained are: quantized modules, Linear weights (checked against ``ignore`` elsewhere), tensors
    a naming rule classifies (:func:`.naming.dense_kind`: norms, embeddings, convolutions, towers)
    and tensors whose module (or own name) ``ignore`` matches (a sparsity-only config's: its ``sparsity_config``'s),
    and the KV cache's ``k_scale``/``v_scale``
    of a config with a ``kv_cache_scheme``. Anything else, fused 3-D MoE experts
    left in bf16 above all, is an error: loaders would build quantized layers the file does not hold,
    or the conversion silently skipped it."""
    qcfg = ckpt.quantization_config or {}
    if not qcfg:
        return []
    ignore = qcfg.get("ignore") or []
    if not qcfg.get("config_groups"):  # sparsity only (--scheme DENSE --sparsity 2:4): its sparsity_config's ignore
        ignore = [*ignore, *((qcfg.get("sparsity_config") or {}).get("ignore") or [])]
    out = []
    for m in mods.values():
        if m.quantized:
            continue
        for part, info in m.parts.items():
            name = f"{m.name}.{part}" if m.name else part
            if info.dtype not in FLOAT_DTYPES or len(info.shape) < 2:
                continue
            if part == "weight" and is_linear_weight(name, info):
                continue
            if part in KV_PARTS and qcfg.get("kv_cache_scheme"):  # the calibrated KV cache scales (per head: [heads, 1, 1])
                continue
            if dense_kind(name) is not None or matches(m.name, ignore, is_linear=False) or matches(name, ignore, is_linear=False):
                continue
            hint = "; fused 3-D MoE experts left unquantized?" if len(info.shape) == 3 and "expert" in name else ""
            out.append(
                Problem(
                    "error",
                    f"dense {len(info.shape)}-D tensor {list(info.shape)} that the quantization_config does not explain (not quantized, not a Linear, "
                    f"norm, embedding or tower, and its module is not in ignore){hint}",
                    file=str(info.file),
                    tensor=name,
                )
            )
    return out


def with_files(problems: list[Problem], ckpt: Checkpoint, mods: dict[str, Module]) -> list[Problem]:
    """``problems`` with the shard file named where one has none but names a tensor of ``ckpt`` (its file) or a module of
    ``mods`` (the file of its first tensor, :attr:`Module.file`): what ``verify --reference`` finds in the values is
    said ``model.safetensors: module: ...`` as every other error of a tensor. The others are kept as they are."""
    out = []
    for p in problems:
        if p.file is None and p.tensor is not None:
            held = ckpt.tensors.get(p.tensor)
            file = str(held.file) if held is not None else (mods[p.tensor].file if p.tensor in mods and mods[p.tensor].parts else None)
            p = Problem(p.severity, p.message, file, p.tensor)
        out.append(p)
    return out
