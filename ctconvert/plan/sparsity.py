"""``quantize --sparsity 2:4``: the sparse schemes, their shape rules and their ``quantization_config``.

A :class:`SparseScheme` is a :class:`~ctconvert.plan.schemes.Scheme` whose weight format prunes
each row chunk to 2:4 before quantizing (:mod:`ctconvert.formats.sparse24`):

* ``--scheme DENSE`` (sparse only), ``FP8_DYNAMIC`` or ``W8A8`` -> ``sparse-24-bitmask``
  (``compressed``, ``bitmask``, ``shape`` beside ``weight_scale``), as compressed-tensors 0.14 wrote it;
  vLLM <= 0.18 loads it (``CompressedTensors24``) and builds the SM90 CUTLASS 2:4 layout at load time.
* ``--scheme W4A16 --target marlin-24`` -> ``marlin-24`` (``weight_packed``, ``meta``, ``scale_packed``),
  the compressed-tensors format vLLM <= 0.15's ``CompressedTensorsW4A16Sparse24`` loads.

The config is compressed-tensors 0.14's (docs/compressed-tensors-format.md §7.4 (h); reference
``tests/data/sparse24_ct014.safetensors``): config groups in its all-fields form plus
``sparsity_config`` (``format`` ``sparse-24-bitmask``, or ``dense`` for marlin-24, with
``sparsity_structure: "2:4"``); a sparse-only model has only ``quant_method``, ``sparsity_config``,
``transform_config`` and ``version``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..errors import UnsupportedError, UsageError
from ..formats import CompressionFormat, WeightArgs, WeightFormat
from .schemes import Scheme, get_scheme

__all__ = ["DENSE_SCHEME", "SPARSITY_CHOICES", "SparseScheme", "sparse_config", "sparse_scheme", "sparsity_warning"]

SPARSITY_CHOICES = ("2:4",)
#: ``--scheme DENSE --sparsity 2:4``: prune only, values kept in the model dtype
DENSE_SCHEME = "DENSE"
_BITMASK_SCHEMES = ("FP8_DYNAMIC", "W8A8")
#: the QuantizationArgs fields compressed-tensors 0.14 serializes
_014_KEYS = (
    *("actorder", "block_structure", "dynamic", "group_size", "num_bits", "observer"),
    *("observer_kwargs", "scale_dtype", "strategy", "symmetric", "type", "zp_dtype"),
)


@dataclass(frozen=True)
class SparseScheme(Scheme):
    """A scheme with 2:4 sparsity: ``base`` is the quantization preset (None: dense values); ``marlin24``
    selects the marlin-24 output instead of ``sparse-24-bitmask``."""

    base: Scheme | None = None
    marlin24: bool = False
    sparsity: str = "2:4"

    @property
    def weight_format(self) -> WeightFormat:
        from ..formats import FORMATS  # the format objects (torch) on first use: `ctconvert schemes` lists DENSE without them
        from ..formats.sparse24 import sparse24_format

        if self.marlin24:
            return FORMATS[CompressionFormat.MARLIN_24]
        return sparse24_format(self.base.weight_format if self.base else None)

    @property
    def output_format(self) -> str:
        return (CompressionFormat.MARLIN_24 if self.marlin24 else CompressionFormat.SPARSE_24_BITMASK).value

    def shape_problem(self, n: int, k: int) -> str | None:
        """Why this scheme cannot take an ``(N, K)`` weight (vLLM's loaders and kernels), or None."""
        if self.marlin24:
            from ..layouts.marlin24 import marlin24_shape_problem

            return marlin24_shape_problem(n, k, self.weights.group_size)
        if k % 8:
            return f"K={k} is not a multiple of 8 (2:4 sparsity: vLLM's bitmask tensor is [N, K/8] and CUTLASS needs K % 8)"
        if n % 8:
            return f"N={n} is not a multiple of 8 (vLLM's CompressedTensors24 needs every output partition divisible by 8)"
        if self.base is not None and k % (self.base.k_multiple or 1):
            return f"K={k} is not a multiple of {self.base.k_multiple} ({self.base.name})"
        return None

    def config_group(self, targets: list[str]) -> dict:
        """compressed-tensors 0.14's serialization of the group (all QuantizationArgs fields); a sparse-only
        model has no group (:func:`sparse_config` drops it)."""
        if self.base is None:
            return {"targets": list(targets)}
        grp = self.base.config_group(targets)
        grp["format"] = self.format.value
        for key in ("weights", "input_activations"):
            if grp.get(key):
                a = grp[key]
                full = {k: a.get(k) for k in _014_KEYS}
                full["observer_kwargs"] = {}
                full["observer"] = None if a.get("dynamic") else "memoryless_minmax"
                grp[key] = full
        return grp

    def describe(self) -> str:
        return (self.base.describe() if self.base else "dense") + f", {self.sparsity} sparse ({self.output_format})"


def sparse_scheme(name: str, sparsity: str, target: str | None = None) -> SparseScheme:
    """The 2:4 variant of preset ``name`` (module docstring). ``target`` ``marlin-24`` selects marlin-24.
    Raises :class:`UsageError` / :class:`UnsupportedError` for combinations no 2:4 loader takes."""
    if sparsity not in SPARSITY_CHOICES:
        raise UsageError(f"unknown --sparsity {sparsity!r}; choose {', '.join(SPARSITY_CHOICES)}")
    key = name.strip().upper()
    if key == DENSE_SCHEME:
        if target == CompressionFormat.MARLIN_24:
            raise UsageError("--target marlin-24 needs --scheme W4A16")
        return SparseScheme(f"{DENSE_SCHEME}+2:4", CompressionFormat.DENSE, WeightArgs.from_dict(None), base=None)
    base = get_scheme(name)
    if target == CompressionFormat.MARLIN_24:
        if base.name != "W4A16":
            raise UnsupportedError(f"--target marlin-24 takes --scheme W4A16 (symmetric int4, group 128), not {base.name}")
        return SparseScheme(f"{base.name}+2:4", CompressionFormat.MARLIN_24, base.weights, base=base, marlin24=True)
    if base.name == "W4A16":
        raise UsageError("--scheme W4A16 --sparsity 2:4 is written as marlin-24 only: add --target marlin-24 (vLLM <= 0.15 loads it)")
    if base.name not in _BITMASK_SCHEMES:
        raise UnsupportedError(
            f"--sparsity 2:4 takes --scheme DENSE, FP8_DYNAMIC or W8A8 (sparse-24-bitmask), or W4A16 with --target marlin-24; "
            f"no vLLM release loads {base.name} with 2:4 sparsity"
        )
    return SparseScheme(f"{base.name}+2:4", base.format, base.weights, base=base)


def sparse_config(qcfg: dict, scheme: SparseScheme, targets: list[str], ignore: list[str]) -> dict:
    """The ``quantization_config`` compressed-tensors 0.14 writes for a 2:4 model (module docstring)."""
    scfg = {
        "format": (CompressionFormat.DENSE if scheme.marlin24 else CompressionFormat.SPARSE_24_BITMASK).value,
        "global_sparsity": 0.5,
        "ignore": list(ignore),
        "registry_requires_subclass": False,
        "sparsity_structure": scheme.sparsity,
        "targets": list(targets),
    }
    if scheme.base is None:
        return {"quant_method": "compressed-tensors", "sparsity_config": scfg, "transform_config": {}, "version": qcfg["version"]}
    out = copy.deepcopy(qcfg)
    out["sparsity_config"] = scfg
    out.pop("moe_sparsity_config", None)  # not a field of compressed-tensors 0.14
    return out


def sparsity_warning(scheme: Scheme, target: str | None = None) -> str | None:
    """The run-time note on which vLLM releases load a 2:4 output (None for a scheme without sparsity)."""
    if not isinstance(scheme, SparseScheme):
        return None
    from .kernel_targets import FORMAT_RELEASES, TARGETS

    if target in TARGETS and (releases := TARGETS[target].releases) is not None:  # a kernel-native 2:4 layout
        return f"2:4 sparse output ({target}): {releases}"
    fmt = scheme.output_format
    return f"2:4 sparse output ({fmt}): loaded by {FORMAT_RELEASES[CompressionFormat(fmt)]}; current vLLM releases do not load it"
