"""A ``quantization_config``'s weight arguments against themselves and their format (``verify``, ``inspect``, ``repack``),
where no tensor can contradict them, or where the contradiction is the config's and not one module's.

:func:`group_arg_problems`: a weight ``type`` the format does not store, ``dynamic`` weights, NVFP4 without the
arguments vLLM 0.33 recognises it by. :func:`strategy_problems`: a ``strategy`` that contradicts the ``group_size``
(compressed-tensors refuses the config; the scales cannot be read as it says), one error per config group naming
``config.json`` and what the tensors hold, and the group's modules (not to be dequantized). Used through
:mod:`.conformance`.
"""

from __future__ import annotations

import json

from ..errors import plural
from ..formats import CompressionFormat
from .modules import Module, dense_shape
from .naming import natural_key
from .reader import Problem

__all__ = ["group_arg_problems", "strategy_conflict", "strategy_problems"]

#: the weights' ``type`` each format stores (compressed-tensors 0.20 ``compressors/quantized_compressors``: the
#: pack and int compressors write integer codes, the float, NVFP4 and MX ones float codes)
_FORMAT_TYPE = {
    CompressionFormat.PACK_QUANTIZED.value: "int",
    CompressionFormat.INT_QUANTIZED.value: "int",
    CompressionFormat.FLOAT_QUANTIZED.value: "float",
    CompressionFormat.NVFP4_PACK_QUANTIZED.value: "float",
    CompressionFormat.MXFP4_PACK_QUANTIZED.value: "float",
    CompressionFormat.MXFP8_QUANTIZED.value: "float",
}
#: the weight arguments NVFP4 is recognised by (vLLM 0.33 ``compressed_tensors.py``: ``_is_fp4a16_nvfp4`` and
#: ``_is_fp4a4_nvfp4`` ask for 4-bit float, ``tensor_group`` strategy, groups of 16, symmetric)
_NVFP4_ARGS = {"num_bits": 4, "strategy": "tensor_group", "group_size": 16, "symmetric": True}


def group_arg_problems(qcfg: dict, file: str | None = None) -> list[Problem]:
    """An error for each config group whose weight arguments contradict its format where no tensor can (their shapes
    and dtypes are the format's either way): a weight ``type`` the format does not store (:data:`_FORMAT_TYPE`),
    ``dynamic`` weights (stored weights are quantized once, not at run time), NVFP4 weights without the arguments
    vLLM recognises it by (:data:`_NVFP4_ARGS`; a ``strategy`` and ``group_size`` that contradict each other are
    :func:`strategy_problems`' error, not said twice). ``file``: the config's path, named in each error."""
    out = []
    groups = qcfg.get("config_groups")
    for name, g in (groups if isinstance(groups, dict) else {}).items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            continue
        fmt = g.get("format") or qcfg.get("format")
        bad = []
        if (want := _FORMAT_TYPE.get(fmt)) is not None and w.get("type") != want:
            bad.append(f"type {_shown(w.get('type'))} ({fmt} stores {want} codes)")
        if w.get("dynamic", False) is not False:
            bad.append(f"dynamic {_shown(w.get('dynamic'))} (stored weights are quantized once: false)")
        if fmt == CompressionFormat.NVFP4_PACK_QUANTIZED.value:  # a strategy contradicting its group_size: strategy_problems says it
            said = ("strategy", "group_size") if strategy_conflict(w) is not None else ()
            bad += [f"{k} {_shown(w.get(k))} (NVFP4: {v!r})" for k, v in _NVFP4_ARGS.items() if w.get(k) != v and k not in said]
        if bad:
            out.append(Problem("error", f"config group {name!r}: weights {'; '.join(bad)}: vLLM would load these tensors otherwise or refuse them", file))
    return out


def _shown(v) -> str:
    """A config value as the message shows it: JSON's ``null`` for None (as config.json holds it), else its repr."""
    return "null" if v is None else repr(v)


#: the strategies a ``group_size`` > 0 goes with: compressed-tensors 0.17 (vLLM 0.33's) and 0.20.1
#: ``quantization/quant_args.py`` ``QuantizationArgs.validate_model_after`` raise "group_size requires strategy to be set
#: to 'group'" for another strategy, and "strategy ... requires group_size to be set to a positive value" for these without one
_GROUPED = ("group", "tensor_group")
#: how many scales each strategy stores per row of a weight (``None``: not one count per row)
_PER_ROW = {"channel": 1, "tensor": None}


def strategy_conflict(w: dict | None) -> str | None:
    """How weight args' ``strategy`` and ``group_size`` contradict each other (:data:`_GROUPED`), or None (no strategy:
    compressed-tensors infers it from the group size)."""
    s, gs = (w or {}).get("strategy"), (w or {}).get("group_size")
    if not isinstance(s, str):
        return None
    sized = isinstance(gs, int) and not isinstance(gs, bool) and gs > 0
    if sized and s not in _GROUPED:
        return f"strategy {s!r} with group_size {gs}"
    return f"strategy {s!r} without a group_size ({json.dumps(gs)})" if not sized and s in _GROUPED else None


def strategy_problems(mods: dict[str, Module], qcfg: dict, file: str | None = None) -> tuple[list[Problem], set[str]]:
    """``(one error per config group whose weights' strategy contradicts their group_size (:func:`strategy_conflict`),
    the names of the quantized modules of those groups)``: compressed-tensors, and so vLLM 0.33, refuses such a config,
    and the scales cannot be read as it says (a trial's ``strategy: channel`` over group-quantized tensors gave a reshape
    error per module against a reference). Each error names ``config.json`` (``file``), the group, the contradiction and
    what the first module's ``weight_scale`` holds (shape, dtype; one scale per how many columns) beside what the
    strategy stores; the modules are not to be dequantized."""
    groups = qcfg.get("config_groups")
    out, names = [], set()
    for group, g in (groups if isinstance(groups, dict) else {}).items():
        conflict = strategy_conflict(g.get("weights") if isinstance(g, dict) else None)
        if conflict is None:
            continue
        members = sorted((m for m in mods.values() if m.quantized and m.group == group), key=lambda m: natural_key(m.name))
        names |= {m.name for m in members}
        strategy = g["weights"].get("strategy")
        rule = (
            f"strategy {strategy!r} needs a positive group_size" if strategy in _GROUPED else "a group_size goes with strategy 'group' or 'tensor_group' only"
        )
        why = (
            f"config group {group!r}: weights {conflict}, which compressed-tensors (quant_args.py) and so vLLM 0.33 refuse: {rule}"
            f"{_scales_held(members, strategy)}"
        )
        out.append(Problem("error", why + (f"; its {plural(len(members), 'module')} are not dequantized" if members else ""), file))
    return out, names


def _scales_held(members: list[Module], strategy: str) -> str:
    """``"; <module>.weight_scale is BF16[256, 4]: one scale per 128 columns, where strategy 'channel' stores [256, 1]"``
    for the first of ``members`` holding a 2-D ``weight_scale`` (empty where none does)."""
    m = next((m for m in members if len(getattr(m.parts.get("weight_scale"), "shape", ())) == 2), None)
    if m is None:
        return ""
    s = m.parts["weight_scale"]
    rows, per_row = int(s.shape[0]), int(s.shape[1])
    try:
        k = dense_shape(m)[1]
    except (ValueError, KeyError, RuntimeError, TypeError):
        k = None
    held = f"one scale per {k // per_row} columns" if k and per_row > 1 and k % per_row == 0 else f"{plural(per_row, 'scale')} per row"
    want = _PER_ROW.get(strategy, False)
    stores = f", where strategy {strategy!r} stores [{rows}, 1]" if want == 1 else (f", where strategy {strategy!r} stores [1]" if want is None else "")
    return f"; {m.name}.weight_scale is {s.dtype}{list(s.shape)}: {held}{stores}"
