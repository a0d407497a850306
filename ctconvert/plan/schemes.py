"""Quantization schemes by compressed-tensors preset name, and what each writes.

A :class:`Scheme` binds a preset (``FP8_DYNAMIC``, ``W4A16`` ...; the names
and their QuantizationArgs are compressed-tensors' own presets,
``compressed_tensors/quantization/quant_scheme.py``, ``PRESET_SCHEMES``,
release 0.20) to its weight format object (:data:`ctconvert.formats.FORMATS`),
which knows the output tensors, the quantizers and the shape rules
(docs/compressed-tensors-format.md §3.3, §4). Everything a scheme says about
its tensors is the format's answer for the scheme's weight arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..formats import CompressionFormat, WeightArgs, WeightFormat

if TYPE_CHECKING:  # the table is torch-free (``ctconvert schemes``); the format objects import torch when first used
    import torch

__all__ = [
    "LM_HEAD_SCHEMES",
    "Scheme",
    "custom_scheme",
    "get_scheme",
    "resolve_scheme",
    "scheme_aliases",
    "scheme_from_dict",
    "scheme_from_file",
    "read_document",
    "scheme_names",
    "weight_problem",
]


class _Tables:
    """The tables of other modules a scheme reads per tensor, imported once on first use (importing them when this
    module loads would be circular; a function-level import per call cost ~3 us, 0.1 s of planning 18,867 tensors)."""

    def __init__(self) -> None:
        from ..checkpoint.naming import FLOAT_DTYPES
        from ..checkpoint.safetensors_io import TORCH_TO_ST
        from ..formats import FORMATS

        self.formats, self.torch_to_st, self.float_dtypes = FORMATS, TORCH_TO_ST, FLOAT_DTYPES


_TABLES: _Tables | None = None


def _tables() -> _Tables:
    global _TABLES
    if _TABLES is None:
        _TABLES = _Tables()
    return _TABLES


class _FormatAnswer:
    """A read-only :class:`Scheme` attribute that is its weight format's answer for the scheme's weight arguments:
    ``scheme.<name>`` is ``scheme.weight_format.<name>(scheme.weights)``."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, scheme, owner=None):
        return self if scheme is None else getattr(scheme.weight_format, self.name)(scheme.weights)


@dataclass(frozen=True)
class Scheme:
    """One weight quantization recipe: a preset name, its compressed-tensors format and weight arguments."""

    name: str
    format: CompressionFormat
    weights: WeightArgs
    #: the preset it was derived from (== name for a preset); its config group gets ``weights_args``
    base: str = ""
    weights_args: dict | None = field(default=None, compare=False, hash=False)
    #: :meth:`outputs`' parts per (shape, dtype), made once
    _outputs: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    @property
    def weight_format(self) -> WeightFormat:
        return _tables().formats[self.format]

    # the weight arguments, by their compressed-tensors names
    @property
    def num_bits(self) -> int:
        return self.weights.num_bits

    @property
    def group_size(self) -> int | None:
        return self.weights.group_size

    @property
    def symmetric(self) -> bool:
        return self.weights.symmetric

    @property
    def block(self) -> tuple[int, int] | None:
        return self.weights.block_structure

    # what the format says for these arguments
    @property
    def global_scale(self) -> bool:
        """Needs one absmax over the fused set before any chunk is quantized (NVFP4)."""
        return self.weight_format.needs_global_scale

    scale_flags_nonfinite = _FormatAnswer("See :meth:`ctconvert.formats.base.WeightFormat.scale_flags_nonfinite`.")

    row_align = _FormatAnswer("Row chunks must start at multiples of this (block scales, dim-0 packed zero points stay whole).")

    k_multiple = _FormatAnswer("K must be a multiple of this (1 = any).")

    n_multiple = _FormatAnswer("N must be a multiple of this for transformers and vLLM (1 = any).")

    def outputs(self, module: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, str, tuple[int, ...]]]:
        """Output tensors ``(name, safetensors dtype, shape)`` replacing ``module.weight`` ``[N, K]`` of ``dtype``."""
        key = (tuple(shape), dtype)
        parts = self._outputs.get(key)  # one format call per shape (a MoE plans thousands of experts of one shape)
        if parts is None:
            to_st = _tables().torch_to_st
            outs = self.weight_format.outputs(key[0], dtype, self.weights)
            parts = self._outputs[key] = [(f".{part}", to_st[dt], tuple(s)) for part, (dt, s) in outs.items()]
        return [(module + part, st, s) for part, st, s in parts]

    def quantize_rows(
        self,
        w: torch.Tensor,
        global_scale: torch.Tensor | None = None,
        impl: str = "auto",
        *,
        weight_scale: torch.Tensor | None = None,
        ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Quantize a row chunk ``w`` ``[r, K]``; see :meth:`ctconvert.formats.base.WeightFormat.quantize`.

        ``global_scale``: NVFP4's fp32 ``[1]`` scale of the fused set; ``weight_scale``: the ``[1]`` per-tensor
        scale of float ``strategy: tensor`` weights (the ``FP8`` preset), known before any chunk
        (:mod:`ctconvert.pipeline.scales`). The format takes either as the scale given in advance.
        ``ranges``: an observer's per-group ``(min, max)`` (D ``[r, G]``), in place of the chunk's own min/max."""
        scale = global_scale if weight_scale is None else weight_scale
        if ranges is None:
            return self.weight_format.quantize(w, self.weights, scale, impl)
        return self.weight_format.quantize(w, self.weights, scale, impl, ranges=ranges)

    def whole_tensor_outputs(self, shape: tuple[int, int], global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The outputs that belong to the whole tensor (``weight_shape``, ``weight_global_scale``)."""
        return self.weight_format.whole_tensor_outputs(tuple(shape), global_scale)

    def config_group(self, targets: list[str]) -> dict:
        """The ``config_groups`` entry: compressed-tensors' preset, serialized as its 0.20 ``model_dump``.

        The QuantizationArgs of each preset are compressed-tensors' (``PRESET_SCHEMES``);
        ``tests/checkpoint/test_config.py`` checks this table against the library, key for key.
        Kept as data so that a conversion does not pay compressed-tensors' multi-second import.
        """
        weights, inputs = _PRESET_ARGS[self.base or self.name]
        weights = self.weights_args or weights
        return {
            "targets": list(targets),
            "weights": dict(weights),
            "input_activations": dict(inputs) if inputs else None,
            "output_activations": None,
            "format": self.format.value,
        }

    @property
    def input_args(self) -> dict | None:
        """The preset's ``input_activations`` QuantizationArgs dict (None for weight-only presets)."""
        inputs = _PRESET_ARGS.get(self.name, (None, None))[1]  # a scheme built on a preset (2:4 sparsity) has its own name
        return dict(inputs) if inputs else None

    @property
    def needs_calibration(self) -> bool:
        """Static (``dynamic: false``) or ``local`` activation scales: they come from calibration data
        (compressed-tensors ``QuantizationConfig.requires_calibration_data``, release 0.20)."""
        inputs = self.input_args
        return inputs is not None and inputs["dynamic"] in (False, "local")

    def describe(self) -> str:
        """One line for ``ctconvert schemes``: type, bits, granularity (e.g. ``int4 group 128``)."""
        w = self.weights
        unit = {"channel": "per channel", "tensor": "per tensor", "block": "block 128x128"}.get(w.strategy, f"group {w.group_size}")
        return f"{w.type}{w.num_bits} {unit}{'' if w.symmetric else ' asymmetric'}"

    def describe_activations(self) -> str:
        """The input activations of the preset, for ``ctconvert schemes``: ``none (weight-only)`` or e.g.
        ``fp8 per token, dynamic`` (compressed-tensors ``PRESET_SCHEMES`` ``input_activations``)."""
        inputs = self.input_args
        if not inputs:
            return "none (weight-only)"
        unit = {"token": "per token", "tensor": "per tensor", "channel": "per channel"}.get(inputs["strategy"], f"group {inputs['group_size']}")
        kind = "fp" if inputs["type"] == "float" else "int"
        asym = "" if inputs.get("symmetric", True) else " asymmetric"
        how = {True: "dynamic", "local": "dynamic, calibrated global scale", False: "static, calibrated"}[inputs["dynamic"]]
        return f"{kind}{inputs['num_bits']} {unit}{asym}, {how}"


def _args(num_bits, type_, strategy, group_size=None, symmetric=True, dynamic=False, **extra):
    d = {"num_bits": num_bits, "type": type_, "symmetric": symmetric, "group_size": group_size, "strategy": strategy}
    if "block_structure" in extra:
        d["block_structure"] = extra.pop("block_structure")
    d["dynamic"] = dynamic
    d.update(extra)
    return d


_FP8_TOKEN = _args(8, "float", "token", dynamic=True)
_NVFP4_W = _args(4, "float", "tensor_group", 16, scale_dtype="torch.float8_e4m3fn")
#: preset -> (weights, input_activations) QuantizationArgs, as compressed-tensors 0.20 dumps them
_PRESET_ARGS: dict[str, tuple[dict, dict | None]] = {
    "FP8_DYNAMIC": (_args(8, "float", "channel"), _FP8_TOKEN),
    "FP8_BLOCK": (_args(8, "float", "block", block_structure=[128, 128]), _args(8, "float", "group", 128, dynamic=True)),
    "W8A8": (_args(8, "int", "channel"), _args(8, "int", "token", dynamic=True)),
    "W4A16": (_args(4, "int", "group", 128), None),
    "W4A16_ASYM": (_args(4, "int", "group", 128, symmetric=False), None),
    "W8A16": (_args(8, "int", "group", 128), None),
    "NVFP4A16": (_args(4, "float", "tensor_group", 16, scale_dtype="torch.float8_e4m3fn"), None),
    "MXFP4A16": (_args(4, "float", "group", 32, scale_dtype="torch.uint8"), None),
    # MX presets with dynamic group-32 activations (nothing stored for them, docs/compressed-tensors-format.md §4.5)
    "MXFP4": (_args(4, "float", "group", 32, scale_dtype="torch.uint8"), _args(4, "float", "group", 32, dynamic=True, scale_dtype="torch.uint8")),
    "MXFP8A16": (_args(8, "float", "group", 32, scale_dtype="torch.uint8"), None),
    "MXFP8": (_args(8, "float", "group", 32, scale_dtype="torch.uint8"), _args(8, "float", "group", 32, dynamic=True, scale_dtype="torch.uint8")),
    # calibrated activations (ctconvert.calibration); W4AFP8's per-token FP8 inputs are dynamic
    "NVFP4": (_NVFP4_W, _args(4, "float", "tensor_group", 16, dynamic="local", scale_dtype="torch.float8_e4m3fn", observer="static_minmax")),
    "FP8": (_args(8, "float", "tensor"), _args(8, "float", "tensor", observer="static_minmax")),
    "W4AFP8": (_args(4, "int", "group", 128), _FP8_TOKEN),
    # not compressed-tensors presets (it has none for static INT8): W8A8's weights, static per-tensor inputs
    "W8A8_STATIC": (_args(8, "int", "channel"), _args(8, "int", "tensor", observer="static_minmax")),
    "W8A8_STATIC_ASYM": (_args(8, "int", "channel"), _args(8, "int", "tensor", symmetric=False, observer="static_minmax")),
}
#: preset -> the compressed-tensors format its weights are written in (docs/compressed-tensors-format.md §3.3)
_PRESET_FORMAT = {
    "FP8_DYNAMIC": CompressionFormat.FLOAT_QUANTIZED,
    "FP8_BLOCK": CompressionFormat.FLOAT_QUANTIZED,
    "W8A8": CompressionFormat.INT_QUANTIZED,
    "W4A16": CompressionFormat.PACK_QUANTIZED,
    "W4A16_ASYM": CompressionFormat.PACK_QUANTIZED,
    "W8A16": CompressionFormat.PACK_QUANTIZED,
    "NVFP4A16": CompressionFormat.NVFP4_PACK_QUANTIZED,
    "MXFP4A16": CompressionFormat.MXFP4_PACK_QUANTIZED,
    "MXFP4": CompressionFormat.MXFP4_PACK_QUANTIZED,
    "MXFP8A16": CompressionFormat.MXFP8_QUANTIZED,
    "MXFP8": CompressionFormat.MXFP8_QUANTIZED,
    "NVFP4": CompressionFormat.NVFP4_PACK_QUANTIZED,
    "FP8": CompressionFormat.FLOAT_QUANTIZED,
    "W4AFP8": CompressionFormat.PACK_QUANTIZED,
    "W8A8_STATIC": CompressionFormat.INT_QUANTIZED,
    "W8A8_STATIC_ASYM": CompressionFormat.INT_QUANTIZED,
}
_SCHEMES: dict[str, Scheme] = {name: Scheme(name, _PRESET_FORMAT[name], WeightArgs.from_dict(weights)) for name, (weights, _) in _PRESET_ARGS.items()}
_ALIASES = {"INT8": "W8A8", "W4A4_NVFP4": "NVFP4", "INT8_STATIC": "W8A8_STATIC", "INT8_STATIC_ASYM": "W8A8_STATIC_ASYM"}

#: quantized lm_head choices (``--lm-head``): NVFP4A16, or FP8 per-row weights
#: with dynamic per-token activations (the FP8_DYNAMIC preset aimed at the head).
LM_HEAD_SCHEMES = {"none": None, "nvfp4a16": "NVFP4A16", "fp8": "FP8_DYNAMIC"}


#: presets whose group size (``--group-size``) and symmetry (``--symmetric/--asymmetric``) may be changed:
#: the pack-quantized integer ones (compressed-tensors ``pack_quantized.py`` packs any group size and zero point)
_CUSTOMIZABLE = ("W4A16", "W4A16_ASYM", "W8A16")


def custom_scheme(base: str | Scheme, group_size: int | None = None, symmetric: bool | None = None) -> Scheme:
    """The preset ``base`` with another weight ``group_size`` and/or ``symmetric`` (None: the preset's).

    Named ``BASE[group_size=G,asymmetric]`` (only what changed), so fingerprints and reports
    tell it from the preset. :class:`UsageError` for a preset whose arguments cannot change
    (only ``W4A16``, ``W4A16_ASYM`` and ``W8A16`` can: FP8, W8A8 and the FP4 formats fix their
    granularity) or a group size below 1.
    """
    s = base if isinstance(base, Scheme) else get_scheme(base)
    if group_size is None and symmetric is None:
        return s
    if (s.base or s.name) not in _CUSTOMIZABLE:
        raise UsageError(
            f"--group-size/--symmetric/--asymmetric apply to the integer weight-only schemes {', '.join(_CUSTOMIZABLE)}; "
            f"{s.base or s.name} fixes its granularity ({s.describe()})"
        )
    if group_size is not None and group_size < 1:
        raise UsageError(f"--group-size must be a positive number of columns, got {group_size}")
    weights = dict(s.weights_args or _PRESET_ARGS[s.base or s.name][0])
    changed = []
    if group_size is not None and group_size != weights["group_size"]:
        weights["group_size"] = group_size
        changed.append(f"group_size={group_size}")
    if symmetric is not None and symmetric != weights["symmetric"]:
        weights["symmetric"] = symmetric
        changed.append("symmetric" if symmetric else "asymmetric")
    if not changed:
        return s
    base_name = s.base or s.name
    return Scheme(f"{base_name}[{','.join(changed)}]", s.format, WeightArgs.from_dict(weights), base=base_name, weights_args=weights)


def scheme_from_file(path: str | Path) -> Scheme:
    """A scheme from a compressed-tensors ``QuantizationScheme`` written as JSON or YAML (``weights``,
    ``input_activations``, optional ``targets``/``format``), validated by compressed-tensors itself
    (``QuantizationScheme.model_validate``, release 0.20).

    It must be one of the presets, or a preset of :data:`_CUSTOMIZABLE` with another ``group_size``
    or ``symmetric`` (the combinations whose bytes ctconvert writes bit for bit like compressed-tensors);
    anything else is a :class:`UsageError` naming what differs."""
    p = Path(path)
    doc = read_document(p, "the scheme file", "JSON/YAML")
    if not isinstance(doc, dict) or not isinstance(doc.get("weights"), dict):
        raise UsageError("scheme file needs a compressed-tensors QuantizationScheme mapping with a 'weights' entry", file=p)
    return scheme_from_dict(doc, p)


def read_document(p: Path, what: str, kinds: str = "YAML/JSON"):
    """The parsed content of file ``p``: JSON for a ``.json`` name, else YAML. :class:`UsageError` naming the file:
    ``cannot read {what}: ...`` or ``{what without 'the '} is not valid {kinds} (...)``."""
    try:
        text = p.read_text()
    except OSError as e:
        raise UsageError(f"cannot read {what}: {e.strerror or e}", file=p) from e
    try:
        if p.suffix == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - yaml and json raise different classes
        raise UsageError(f"{what.removeprefix('the ')} is not valid {kinds} ({' '.join(str(e).split())})", file=p) from e


def scheme_from_dict(doc: dict, p: Path | None = None) -> Scheme:
    """The scheme of a compressed-tensors ``QuantizationScheme`` mapping (``weights``, ``input_activations``, optional
    ``targets``/``format``), validated by compressed-tensors; the rules and errors of :func:`scheme_from_file`
    (``p``: the file named in them)."""
    from compressed_tensors.quantization import QuantizationScheme

    try:
        qs = QuantizationScheme.model_validate({"targets": ["Linear"], **doc}).model_dump()
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError
        raise UsageError(f"not a valid compressed-tensors QuantizationScheme: {' '.join(str(e).split())[:300]}", file=p) from e
    if qs.get("output_activations"):
        raise UsageError("output_activations quantization is not supported", file=p)
    weights, inputs = qs["weights"], qs.get("input_activations")
    loose = lambda w: {k: v for k, v in w.items() if k not in ("group_size", "symmetric")}  # noqa: E731
    fits = [n for n, (w, i) in _PRESET_ARGS.items() if i == inputs and qs.get("format") in (None, _PRESET_FORMAT[n].value)]
    for name in fits:  # a preset itself first, then a customizable preset with other group_size/symmetric
        if _PRESET_ARGS[name][0] == weights:
            return _SCHEMES[name]
    for name in fits:
        if name in _CUSTOMIZABLE and loose(_PRESET_ARGS[name][0]) == loose(weights) and weights.get("group_size"):
            return custom_scheme(name, weights["group_size"], weights["symmetric"])
    raise UsageError(
        f"scheme {json.dumps({'weights': weights, 'input_activations': inputs})} is not one ctconvert writes: use a preset "
        f"({', '.join(_SCHEMES)}), or {', '.join(_CUSTOMIZABLE)} with another group_size or symmetric",
        file=p,
    )


def resolve_scheme(scheme: str | Scheme, group_size: int | None = None, symmetric: bool | None = None) -> Scheme:
    """``--scheme`` as given: a preset name or a ``.json``/``.yaml``/``.yml`` QuantizationScheme file, with
    ``--group-size``/``--symmetric``/``--asymmetric`` applied (:func:`custom_scheme`)."""
    if isinstance(scheme, Scheme):
        base = scheme
    elif str(scheme).lower().endswith((".json", ".yaml", ".yml")):
        base = scheme_from_file(scheme)
    else:
        base = get_scheme(scheme)
    return custom_scheme(base, group_size, symmetric)


def scheme_names() -> list[str]:
    """Every accepted scheme name (upper case), aliases included."""
    return sorted([*_SCHEMES, *_ALIASES])


def scheme_aliases() -> dict[str, list[str]]:
    """Each scheme (upper case) with the other names it is accepted under (``W8A8``: ``["INT8"]``), for listings."""
    return {name: sorted(a for a, target in _ALIASES.items() if target == name) for name in sorted(_SCHEMES)}


def get_scheme(name: str) -> Scheme:
    """Look a scheme up by preset name, case-insensitively.

    Raises :class:`UsageError` for an unknown name.
    """
    if isinstance(name, Scheme):
        return name
    key = name.strip().upper()
    key = _ALIASES.get(key, key)
    if key in _SCHEMES:
        return _SCHEMES[key]
    if key == "DENSE":  # plan/sparsity.py's DENSE_SCHEME: pruning only
        raise UsageError("--scheme DENSE quantizes nothing: it prunes 2:4 only and needs --sparsity 2:4 (`ctconvert schemes` lists the others)")
    import difflib

    close = difflib.get_close_matches(key, scheme_names(), n=1)  # a typo (W4A61, NVFP4A61): name the nearest scheme first
    hint = f"did you mean {close[0]}? " if close else ""
    raise UsageError(f"unknown scheme {name!r}; {hint}choose one of: {', '.join(scheme_names())} (or a .json/.yaml QuantizationScheme file)")


def weight_problem(dtype: str, shape: tuple[int, ...], scheme: Scheme) -> str | None:
    """Why ``scheme`` cannot take a targeted weight of safetensors ``dtype`` and ``shape``, or None (the planner's shape rules)."""
    if dtype not in _tables().float_dtypes:
        return f"dtype {dtype} is not bf16/fp16/fp32"
    if len(shape) != 2:
        return f"{len(shape)}-D weight {list(shape)}; only 2-D Linear weights can be quantized"
    n_rows, k = shape
    if hasattr(scheme, "shape_problem"):  # a scheme with its own loader rules (2:4 sparsity)
        return scheme.shape_problem(n_rows, k)
    block = scheme.weights.strategy == "block"
    if k % scheme.k_multiple:
        what = "block width" if block else "group size"
        return f"K={k} is not a multiple of the {what} {scheme.k_multiple} of {scheme.name}"
    if n_rows % scheme.n_multiple:
        return f"N={n_rows} is not a multiple of the block height {scheme.n_multiple} of {scheme.name} (transformers and vLLM need whole blocks)"
    return None
