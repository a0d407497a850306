"""The ``--target`` table: every kernel-layout target, the kernels it offers, its inverse, and the one check of its options.

A :class:`Target` row says everything ctconvert knows of one ``--target``: what it takes (for messages), the
:class:`~ctconvert.layouts.kernels.Kernel` objects it offers (tried in order), the ``repack`` target that
undoes it (:data:`INVERSE_TARGET`; none for a compressed-tensors format), the compressed-tensors format its
output is when it is one (``marlin-24``: compressed-tensors' own config, no kernel-native tag), the layout
versions it knows, and which vLLM releases load its output (the 2:4 note). :func:`check_target` is the one
check of ``--target``/``--act-dtype``/``--layout-version``, used by ``repack``, ``quantize --target`` and the API.

The table lives in ``plan/`` because it joins both pure layers: the kernels of ``layouts/`` and the format
facts of ``formats/`` (format names as :class:`~ctconvert.formats.CompressionFormat` members, the
sparse-24-bitmask functions the 2:4 kernels are given, :data:`ctconvert.formats.sparse24.BITMASK`).

``marlin-24`` is a plain format (:class:`ctconvert.formats.sparse24.Marlin24`) that ``--target marlin-24``
selects: no kernel; its row's :attr:`Target.pack` packs each whole module's values into the stored tensors
(``ctconvert.layouts.marlin24.marlin24_pack``: the layout spans every row, so the row chunks are joined first).

The CLI's choice lists come from here: :data:`QUANTIZE_TARGETS` (``quantize --target``) and
:data:`REPACK_TARGETS` (``repack --target``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..checkpoint.kernel_native import check_act_dtype
from ..errors import UsageError
from ..formats import FORMATS, CompressionFormat, WeightArgs
from ..formats.sparse24 import BITMASK
from ..layouts import kernels, marlin24, sparse24
from ..layouts.kernels import LAYOUT_VERSIONS, Kernel, Sparse24Kernel

__all__ = [
    "CT_FORMAT_TARGETS",
    "FORMAT_RELEASES",
    "INVERSE_TARGET",
    "KERNELS",
    "QUANTIZE_TARGETS",
    "REPACK_TARGETS",
    "TARGETS",
    "Target",
    "check_target",
    "choose_kernel",
    "kernel_named",
    "repack_module",
    "unrepack_module",
]

#: ``repack --target compressed-tensors``: undo a kernel-native checkpoint
INVERSE_TARGET = "compressed-tensors"

#: the two CUTLASS 2:4 kernels: one class, its layout parameters, the sparse-24-bitmask functions
CUTLASS_2OF4 = Sparse24Kernel("cutlass-2of4", sparse24.SM90, BITMASK)
CUTLASS_2OF4_SM80 = Sparse24Kernel("cutlass-2of4-sm80", sparse24.SM80, BITMASK)

#: which vLLM releases load each 2:4 compressed-tensors format (docs/kernel-layouts.md §0.1, §8, §9; docs/field-notes.md F1)
FORMAT_RELEASES = {
    CompressionFormat.SPARSE_24_BITMASK: "vLLM <= 0.18 (CompressedTensors24, SM90 GPUs; removed by vLLM PR #36799); compressed-tensors <= 0.14 reads it",
    CompressionFormat.MARLIN_24: "vLLM <= 0.15 (CompressedTensorsW4A16Sparse24, SM80+ GPUs, fp16 activations); compressed-tensors <= 0.14 reads it",
}


def _pack_marlin24(t: dict[str, torch.Tensor], weights: dict) -> dict[str, torch.Tensor]:
    """The marlin-24 tensors of one whole module from its values (``weight`` int8, ``weight_scale`` fp16;
    :meth:`ctconvert.formats.sparse24.Marlin24.quantize`); any other tensor unchanged. Raises ``ValueError``."""
    g = weights.get("group_size") if weights.get("strategy") == "group" else None
    packed = marlin24.marlin24_pack(t["weight"], t["weight_scale"], g)
    return {**packed, **{p: x for p, x in t.items() if p not in ("weight", "weight_scale")}}


@dataclass(frozen=True)
class Target:
    """One ``--target``. ``kernels``: tried in order (:meth:`kernel_for`); ``inverse``: the ``repack --target``
    that undoes it (None: its output is the compressed-tensors format ``ct_format``, read as it is, whose
    values ``pack(tensors, weights) -> tensors`` packs per whole module); ``releases``: which vLLM releases
    load its output (None: those of its format)."""

    name: str
    takes: str
    kernels: tuple[Kernel, ...] = ()
    inverse: str | None = INVERSE_TARGET
    ct_format: CompressionFormat | None = None
    pack: Callable[[dict, dict], dict] | None = None
    layout_versions: tuple[str, ...] = LAYOUT_VERSIONS
    releases: str | None = None

    def kernel_for(self, weights: dict, parts: set[str]) -> Kernel | None:
        """The kernel this target gives a module (None: it does not take it). ``weights``: the module's weight
        QuantizationArgs (a dict); ``parts``: the names of its tensors."""
        return next((k for k in self.kernels if k.accepts(weights, set(parts))), None)

    def packs(self, fmt: str | None) -> bool:
        """Whether a module of format ``fmt`` is packed by :attr:`pack` (its output is this target's format)."""
        return self.ct_format is not None and fmt == self.ct_format

    def packed_outputs(self, parts: dict[str, tuple], dense: tuple[int, int], weights: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The tensors :attr:`pack` makes of one module: the format's stored tensors (torch dtype, shape), then
        every part of ``parts`` (local name -> (dtype, shape)) it does not replace, unchanged."""
        fmt = FORMATS[self.ct_format]
        values = fmt.outputs(tuple(dense), torch.float16, WeightArgs.from_dict(weights))
        return {**fmt.packed_outputs(tuple(dense), WeightArgs.from_dict(weights)), **{p: v for p, v in parts.items() if p not in values}}


#: every ``--target`` (cli.py: ``quantize --target`` offers all, ``repack --target`` those with an inverse)
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "marlin",
            "pack-quantized int4/int8 (W4A16, W4A16_ASYM, W8A16), FP8 per channel or tensor (FP8_DYNAMIC), NVFP4 (NVFP4A16) and MXFP4 (MXFP4A16)",
            (kernels.MARLIN_INT, kernels.MARLIN_FP8, kernels.MARLIN_NVFP4, kernels.MARLIN_MXFP4),
        ),
        Target("cutlass-nvfp4", "NVFP4 W4A4 (with input_global_scale)", (kernels.CUTLASS_NVFP4,)),
        Target(
            "cutlass-2of4",
            "sparse-24-bitmask (dense, FP8, int8) for the SM90 CUTLASS 2:4 kernels",
            (CUTLASS_2OF4,),
            releases="kernel-native, no loader reads it as is: the tensors vLLM <= 0.18 builds at load time for the SM90 CUTLASS 2:4 kernels "
            "(cutlass_scaled_sparse_mm)",
        ),
        Target(
            "cutlass-2of4-sm80",
            "sparse-24-bitmask (fp16/bf16, int8) in PyTorch's SM80 semi-structured layout",
            (CUTLASS_2OF4_SM80,),
            releases="kernel-native, no loader reads it as is: PyTorch's SM80 semi-structured layout (values and meta of "
            "torch.sparse.SparseSemiStructuredTensorCUTLASS)",
        ),
        Target(
            CompressionFormat.MARLIN_24.value,
            "W4A16 with --sparsity 2:4 (quantize only)",
            inverse=None,
            ct_format=CompressionFormat.MARLIN_24,
            pack=_pack_marlin24,
        ),
    )
}
#: ``quantize --target`` choices
QUANTIZE_TARGETS = tuple(TARGETS)
#: ``repack --target`` choices: the targets with an inverse, and the inverse itself
REPACK_TARGETS = (*(n for n, t in TARGETS.items() if t.inverse is not None), INVERSE_TARGET)
#: targets whose output is a compressed-tensors format (its own config), not the kernel-native tag
CT_FORMAT_TARGETS = tuple(n for n, t in TARGETS.items() if t.ct_format is not None)
#: every kernel by name (the name a kernel-native record's ``kernel`` holds)
KERNELS: dict[str, Kernel] = {k.name: k for t in TARGETS.values() for k in t.kernels}


def check_target(target: str, act_dtype: str, layout_version: str) -> torch.dtype:
    """The activation dtype of ``act_dtype`` (``bf16``/``fp16``); :class:`UsageError` for an unknown target,
    activation dtype or layout version (one the target does not know)."""
    targets = [*TARGETS, INVERSE_TARGET]
    if target not in targets:
        raise UsageError(f"unknown --target {target!r}; choose one of {', '.join(targets)}")
    act = check_act_dtype(act_dtype)
    versions = TARGETS[target].layout_versions if target in TARGETS else LAYOUT_VERSIONS
    if layout_version not in versions:
        raise UsageError(f"unknown --layout-version {layout_version!r}; choose one of {', '.join(versions)}")
    return act


def choose_kernel(target: str, weights: dict, parts: set[str]) -> Kernel | None:
    """The kernel a module goes to under ``target`` (None: the target, or no target of that name, takes it)."""
    t = TARGETS.get(target)
    return t.kernel_for(weights, parts) if t is not None else None


def kernel_named(name: str) -> Kernel:
    """The kernel of a record's ``kernel`` name. Raises ``ValueError`` for an unknown name."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}")
    return KERNELS[name]


def repack_module(kernel: str, tensors: dict[str, torch.Tensor], weights: dict, layout_version: str, act_dtype: torch.dtype):
    """:func:`ctconvert.layouts.kernels.repack_module` of the kernel named ``kernel``. Raises ``ValueError``."""
    return kernels.repack_module(kernel_named(kernel), tensors, weights, layout_version, act_dtype)


def unrepack_module(tensors: dict[str, torch.Tensor], rec: dict) -> dict[str, torch.Tensor]:
    """:func:`ctconvert.layouts.kernels.unrepack_module` of the kernel the record names. Raises ``ValueError``
    for an unknown kernel, ``KeyError`` for a missing tensor."""
    return kernels.unrepack_module(kernel_named(rec["kernel"]), tensors, rec)
