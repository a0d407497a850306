"""Whether the tensors of a compressed-tensors checkpoint are what its ``quantization_config`` says they are.

A config that the tensors contradict is wrong input: a loader builds the layers the config describes and
then reads garbage, or fails. Checked per quantized module (:func:`module_problems`):

* the weight tensors of its group's format, with the group's weight args: names, dtypes and shapes as the
  format object writes them (:meth:`ctconvert.formats.base.WeightFormat.outputs`, which follows
  compressed-tensors 0.20.1's compressors, ``compressed_tensors/compressors/quantized_compressors/``); a
  scale in the model dtype may be any of BF16/F16/F32 (``scale_dtype``). Missing parts, extra parts and
  another dtype or shape are errors. Formats ctconvert only reads (``naive-quantized``, ``marlin-24``): the
  required parts only.
* the activation tensors its ``input_activations`` / ``output_activations`` imply (compressed-tensors
  0.20.1, ``quantization/lifecycle/initialize.py``, ``initialize_qparams``): none for ``dynamic: true``; an
  fp32 ``[1]`` ``*_global_scale`` for strategy ``tensor_group``; a ``*_scale`` (and a ``*_zero_point`` when
  asymmetric; optional when symmetric) unless ``dynamic: "local"``.
* ``weight_g_idx`` only for ``actorder: "group"`` (vLLM 0.33
  ``compressed_tensors_wNa16.py``, ``CompressedTensorsWNA16.create_weights``), I32 ``[K]``.
* a stored ``weight_shape`` first: of another dtype or shape, it alone is the error (the dense shape the other
  parts are compared with is read from it).

Per config group, :func:`strategy_problems`: weight args whose ``strategy`` contradicts their ``group_size`` (a
``group_size`` with ``channel``, a ``group`` strategy without one) are one error naming ``config.json`` and what
the tensors hold, and the group's modules are not dequantized (their scales cannot be read as the config says).

Over the model, :func:`missing_fused_members`: a fused set (q/k/v, gate/up ...) with a member missing where the
other layers have it is wrong input, whatever the config. And :func:`sparsity_problems`: a ``sparsity_config`` of format ``sparse-24-bitmask``
(compressed-tensors <= 0.14, docs/compressed-tensors-format.md §4.8) covers every Linear its ``targets``
match and its ``ignore`` does not: each must be stored as ``compressed``/``bitmask``/``shape``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInputError, plural
from ..formats import CompressionFormat, WeightArgs, get_format
from .families import vllm_dense_reason
from .group_args import group_arg_problems, strategy_conflict, strategy_problems
from .modules import ACT_PARTS, QUANT_PARTS, SPARSITY_GROUP, Module, dense_shape
from .naming import FLOAT_DTYPES, fused_key, fused_set_name, is_linear_weight, matches
from .reader import Problem
from .safetensors_io import TORCH_TO_ST, read_tensor

__all__ = [
    "ExpertMismatch",
    "conforms",
    "contradictions",
    "expected_parts",
    "group_arg_problems",
    "group_problems",
    "kv_scale_problems",
    "linear_module_files",
    "missing_fused_members",
    "mixed_expert_blocks",
    "module_problems",
    "partial_block_problems",
    "refuse",
    "sparsity_problems",
    "strategy_problems",
    "vllm_expert_group",
    "vllm_expert_mismatches",
    "vllm_expert_problems",
    "vllm_unloadable_problems",
]

_SPARSE = CompressionFormat.SPARSE_24_BITMASK.value
_SPARSE_PARTS = ("compressed", "bitmask", "shape")


def expected_parts(m: Module, qcfg: dict) -> tuple[dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]], set[str]] | None:
    """``(required, optional)`` tensors of the quantized module ``m`` under ``qcfg``: required maps each local
    name to ``(accepted safetensors dtypes, shape or None when any)``; optional holds the names that may also be
    present. None when the module's format is unknown or only readable (only ``required`` of the format is then
    known: see :func:`module_problems`). Raises ``ValueError``/``KeyError`` when the dense shape cannot be told
    from the stored tensors."""
    fmt = get_format(m.format)
    if fmt is None:
        return None
    args = WeightArgs.from_dict(m.weights)
    n, k = dense_shape(m)
    try:  # the parts in the model dtype D are the ones whose dtype follows the dtype asked for
        bf, f16 = fmt.outputs((n, k), torch.bfloat16, args), fmt.outputs((n, k), torch.float16, args)
    except NotImplementedError:
        return None
    if not set(fmt.required) <= bf.keys():  # marlin-24: outputs() are the values the layout packs, not the stored tensors
        return None
    req: dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]] = {}
    for part, (dt, shape) in bf.items():
        dts = FLOAT_DTYPES if f16[part][0] != dt else (TORCH_TO_ST[dt],)
        if part == "weight_shape":
            dts = ("I64", "I32")
        req[part] = (dts, tuple(shape))
    optional: set[str] = set()
    if (m.weights or {}).get("actorder") == "group":
        req["weight_g_idx"] = (("I32",), (k,))
    group = (qcfg.get("config_groups") or {}).get(m.group) if m.group != SPARSITY_GROUP else None
    for base, key in (("input", "input_activations"), ("output", "output_activations")):
        r, o = _activation_parts(base, (group or {}).get(key))
        req.update(r)
        optional |= o
    return req, optional


def _activation_parts(base: str, args: dict | None):
    """The ``{base}_*`` tensors activation args imply (module docstring): ``(required, optional names)``."""
    if not args or args.get("dynamic") is True:
        return {}, set()
    req = {}
    if args.get("strategy") == "tensor_group":
        req[f"{base}_global_scale"] = (("F32",), (1,))
    if args.get("dynamic") == "local":
        return req, set()
    req[f"{base}_scale"] = (FLOAT_DTYPES, None)
    zp = f"{base}_zero_point"
    if args.get("symmetric", True):
        return req, {zp}
    req[zp] = (("I8", "I32", *FLOAT_DTYPES), None)
    return req, set()


def _shape_ok(part: str, got: tuple[int, ...], want: tuple[int, ...] | None, m: Module) -> bool:
    if want is None or got == want:
        return True
    args = WeightArgs.from_dict(m.weights)
    if part in ("weight_scale", "weight_zero_point") and args.strategy == "group" and args.group_size and len(got) == 2 == len(want):
        n, k = dense_shape(m)
        return got[1] == math.ceil(k / args.group_size) and got[0] == want[0]  # a last, partial group
    if part == "shape" and math.prod(got) == 2:  # sparse-24-bitmask's [[N], [K]] is also seen flat
        return True
    return False


def module_problems(m: Module, qcfg: dict, scales: bool = True) -> list[Problem]:
    """Errors for the tensors of the quantized module ``m`` that contradict its config group (module docstring):
    a missing part, a part the format and args do not write, another dtype or shape (a stored ``weight_shape`` of
    another dtype or shape alone: the others are compared with the dense shape read from it); with ``scales``, and
    none of those, a negative or zero scale (:func:`_negative_scales`: reads the scales). ``m`` must have a known group
    and format (callers report the others); a group whose strategy contradicts its group size is reported once, by
    :func:`strategy_problems`, not here."""
    fmt = get_format(m.format)
    if fmt is None or strategy_conflict(m.weights) is not None:
        return []
    where = {"file": m.file, "tensor": m.name}
    missing = [p for p in fmt.required if p not in m.parts]
    if missing:
        return [Problem("error", f"format {m.format} (config group {m.group!r}) needs {', '.join(missing)}, which the checkpoint does not hold", **where)]
    try:
        exp = expected_parts(m, qcfg)
    except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as e:
        return [Problem("error", f"the tensors do not give the dense shape of a {m.format} weight ({e})", **where)]
    if exp is None:
        return []
    req, optional = exp
    what = f"{m.format} ({_describe(m.weights)}, config group {m.group!r})"
    out = []
    if missing := [p for p in req if p not in m.parts]:
        out.append(Problem("error", f"{what} needs {', '.join(missing)}, which the checkpoint does not hold", **where))
    if extra := [p for p in m.parts if (p in QUANT_PARTS or p in ACT_PARTS or p == "weight") and p not in req and p not in optional]:
        out.append(Problem("error", f"{', '.join(extra)}: not a tensor of {what}; the config does not explain it", **where))
    try:
        n, k = dense_shape(m)
    except (ValueError, KeyError, RuntimeError):
        n = k = None
    dense = f"a [{n}, {k}] weight" + (" (as its weight_shape says)" if "weight_shape" in m.parts else "")
    parts = sorted(req.items(), key=lambda item: item[0] != "weight_shape")  # weight_shape first: the others' shapes follow it
    for p, (dts, shape) in parts:
        info = m.parts.get(p)
        if info is None or info.dtype in dts and _shape_ok(p, tuple(info.shape), shape, m):
            continue
        want = "/".join(dts) + (str(list(shape)) if shape is not None else "")
        if p == "weight_shape":  # the dense shape cannot be read from it: the other parts are not compared with one
            why = f"weight_shape is {info.dtype}{list(info.shape)}, but {what} stores {want}: the dense shape cannot be read from it"
            return [*out, Problem("error", why, str(info.file), f"{m.name}.{p}")]
        why = f"{p} is {info.dtype}{list(info.shape)}, but {what} of {dense} stores {want}: the config and the tensors disagree"
        out.append(Problem("error", why, str(info.file), f"{m.name}.{p}"))
    return out or (_negative_scales(m, what) if scales else [])


def conforms(m: Module, qcfg: dict) -> bool:
    """Whether module ``m``'s tensors agree with its config group (:func:`module_problems`, without reading its scales):
    true for a module that is not quantized or has no known group or format (nothing to contradict). A module that does
    not conform has no dense shape to judge the config's widths by (:mod:`.widths`: its error is the cause)."""
    if not (m.quantized and m.group is not None and get_format(m.format) is not None):
        return True
    return not module_problems(m, qcfg, scales=False)


def group_problems(mods: dict[str, Module], qcfg: dict, file: str | None = None) -> tuple[list[Problem], set[str]]:
    """The errors of the config groups against the modules they claim, the root cause first: :func:`strategy_problems`
    (whose modules, returned, are not to be dequantized or judged part by part), then :func:`sparsity_problems`,
    :func:`kv_scale_problems` and :func:`vllm_expert_problems`. ``file``: ``config.json``'s path."""
    out, names = strategy_problems(mods, qcfg, file)
    return out + sparsity_problems(mods, qcfg) + kv_scale_problems(mods, qcfg) + vllm_expert_problems(mods, qcfg), names


#: the scale tensors of a module (weights' and activations'): compressed-tensors computes each from an absolute maximum or
#: a range (compressed-tensors 0.14, ``quantization/utils/helpers.py: calculate_qparams``), E8M0 has no sign bit: none
#: is ever below zero, and a negative one dequantizes the weight with its sign flipped
SCALE_PARTS = ("weight_scale", "weight_global_scale", "input_scale", "input_global_scale")
#: calibrated activation scales (and the KV cache's ``k_scale``/``v_scale``) are never zero either: compressed-tensors
#: replaces a zero scale by its dtype's eps (``calculate_qparams``) and NVFP4's global scale is ``448 x 6 / amax``; a
#: loader divides activations by them
ACTIVATION_SCALES = ("input_scale", "input_global_scale")
_POSITIVE = "a calibrated scale is never zero or negative (a loader divides by it)"
#: NVFP4's weight global scale is ``448 x 6 / amax``, 1.0 for an all-zero weight (formats/fp4.py ``nvfp4_global_scale``),
#: never zero: a loader divides the group scales by it (a zeroed one passed verify without a reference: a new user)
_GLOBAL = "NVFP4's weight global scale is 448 x 6 / absmax, never zero (a loader divides the group scales by it)"
#: a module whose every (float) weight scale is zero dequantizes to zeros whatever its codes: compressed-tensors stores the
#: format's substitute for a zero scale (eps of the dtype for int and FP8, 0.125 for NVFP4's E4M3: ``WeightFormat.zero_scale``),
#: never 0, so such a module was zeroed after it was written, or written by another tool (a warning: vLLM loads it)
_ALL_ZERO = "every value is zero, so every weight dequantizes to zero; compressed-tensors stores a substitute for a zero scale, never 0"


def _negative_scales(m: Module, what: str) -> list[Problem]:
    """An error for each float scale tensor of ``m`` (:data:`SCALE_PARTS`) holding a value below zero (``-0`` is zero), or
    for an activation scale (:data:`ACTIVATION_SCALES`) or an NVFP4 ``weight_global_scale`` holding a zero; a warning
    for a float ``weight_scale`` that is zero throughout (:data:`_ALL_ZERO`)."""
    out = []
    for p in SCALE_PARTS:
        info = m.parts.get(p)
        if info is None or not (info.dtype in FLOAT_DTYPES or info.dtype.startswith("F8_")):
            continue  # (MX's E8M0 scales are stored as U8: no sign)
        v = read_tensor(info).float()
        if neg := int((v < 0).sum()):
            why = f"{p}: {plural(neg, 'value')} below zero of {info.numel}; {what} never stores a negative scale"
            out.append(Problem("error", why, str(info.file), f"{m.name}.{p}"))
        elif p in (*ACTIVATION_SCALES, "weight_global_scale") and (zero := int((v == 0).sum())):
            why = _GLOBAL if p == "weight_global_scale" else _POSITIVE
            out.append(Problem("error", f"{p}: {plural(zero, 'value')} zero of {info.numel}; {why}", str(info.file), f"{m.name}.{p}"))
        elif p == "weight_scale" and v.numel() and not bool(v.ne(0).any()):
            out.append(Problem("warning", _ALL_ZERO, str(info.file), f"{m.name}.{p}"))
    return out


def _describe(w: dict | None) -> str:
    w = w or {}
    if not w:
        return "no weight args"
    s = w.get("strategy") or ("group" if w.get("group_size") else "channel")
    extra = f" {w.get('group_size')}" if s in ("group", "tensor_group") else (f" {w.get('block_structure')}" if s == "block" else "")
    sym = "" if w.get("symmetric", True) else " asymmetric"
    return f"{w.get('type', 'int')}{w.get('num_bits')} {s}{extra}{sym}"


def sparsity_problems(mods: dict[str, Module], qcfg: dict) -> list[Problem]:
    """Errors for the Linear modules a ``sparse-24-bitmask`` ``sparsity_config`` covers (its ``targets``, not its
    ``ignore``) whose tensors are not stored 2:4-compressed (no ``compressed``/``bitmask``/``shape``)."""
    scfg = qcfg.get("sparsity_config") or {}
    if scfg.get("format") != _SPARSE:
        return []
    targets, ignore = scfg.get("targets") or [], scfg.get("ignore") or []
    out = []
    for m in mods.values():
        w = m.parts.get("weight")
        if not (m.quantized or (w is not None and is_linear_weight(m.name + ".weight", w))):
            continue
        if not matches(m.name, targets, is_linear=True) or matches(m.name, ignore, is_linear=True):
            continue
        if all(p in m.parts for p in _SPARSE_PARTS):
            continue
        held = "dense" if not m.quantized else (m.format or "quantized")
        out.append(
            Problem(
                "error",
                f"sparsity_config claims {_SPARSE} (2:4) for this module, but its tensors are plain {held} "
                f"({', '.join(sorted(m.parts))}; no {'/'.join(_SPARSE_PARTS)}): the config and the tensors disagree",
                m.file,
                m.name,
            )
        )
    return out


def kv_scale_problems(mods: dict[str, Module], qcfg: dict) -> list[Problem]:
    """Errors for a static ``kv_cache_scheme`` (``dynamic`` false) whose scales are missing: every attention module
    whose ``k_proj`` and ``v_proj`` are quantized must hold a ``k_scale`` and a ``v_scale`` (compressed-tensors 0.20.1
    ``quantization/lifecycle/initialize.py``, ``initialize_attn_qparams``; floats ``[1]`` per tensor or ``[H, 1, 1]``
    per KV head), else a loader takes a scale of 1."""
    kv = qcfg.get("kv_cache_scheme")
    if not isinstance(kv, dict) or kv.get("dynamic") is True:
        return []
    out = []
    for m in mods.values():
        parent, _, leaf = m.name.rpartition(".")
        if leaf != "k_proj" or not m.quantized or not (v := mods.get(f"{parent}.v_proj")) or not v.quantized:
            continue
        attn = mods.get(parent)
        parts = attn.parts if attn is not None else {}
        for p in ("k_scale", "v_scale"):
            info = parts.get(p)
            if info is None:
                out.append(
                    Problem(
                        "error",
                        f"kv_cache_scheme ({kv.get('type')}{kv.get('num_bits')}, static) needs {p} on this attention module",
                        m.file,
                        f"{parent}.{p}",
                    )
                )
            elif info.dtype not in FLOAT_DTYPES or not (tuple(info.shape) == (1,) or (len(info.shape) == 3 and tuple(info.shape[1:]) == (1, 1))):
                out.append(
                    Problem("error", f"{p} is {info.dtype}{list(info.shape)}; a KV cache scale is a float [1] or [heads, 1, 1]", str(info.file), info.name)
                )
            elif bad := int((read_tensor(info).float() <= 0).sum()):
                out.append(Problem("error", f"{p}: {plural(bad, 'value')} not above zero; {_POSITIVE}", str(info.file), info.name))
    return out


#: per-expert Linear modules: ``<block>.experts.<i>.<projection>``
_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<i>\d+)\.(?P<proj>[^.]+)$")


def vllm_expert_group(name: str, qcfg: dict) -> str | None:
    """The config group vLLM 0.33 gives a name of its fused experts, by its own rule (None: ignored or untargeted).

    vLLM 0.33 matches a layer against the targets in the config's order, the first exact name or ``re:`` pattern
    that matches winning (not compressed-tensors' exact-before-pattern precedence), then the layer's class, where
    ``Linear`` also stands for ``RoutedExperts`` (``model_executor/layers/quantization/compressed_tensors/utils.py``:
    ``find_matched_target``; ``compressed_tensors.py``: ``_add_fused_moe_to_target_scheme_map``); a name ``ignore``
    matches is unquantized (``should_ignore_layer``)."""
    if matches(name, qcfg.get("ignore") or [], is_linear=False):
        return None
    groups = qcfg.get("config_groups") or {}
    for gname, g in groups.items():  # names and patterns first (not Linear), the first group in the config's order
        if matches(name, g.get("targets") or [], is_linear=False) is not None:
            return gname
    return next((gname for gname, g in groups.items() if "Linear" in (g.get("targets") or [])), None)


@dataclass(frozen=True)
class ExpertMismatch:
    """One MoE block's projection whose experts vLLM 0.33 would load with another config group (:func:`vllm_expert_mismatches`):
    ``module``: its lowest-numbered expert's module; ``vllm_name``: the name vLLM matches; ``theirs``: the group vLLM
    takes (None: none); ``ours``: the group that holds the experts' tensors."""

    block: str
    proj: str
    module: str
    vllm_name: str
    theirs: str | None
    ours: str | None

    @property
    def experts(self) -> str:
        return f"{self.block}.experts.*.{self.proj}"

    def message(self) -> str:
        took = f"config group {self.theirs!r} takes" if self.theirs else "no config group takes"
        built = "with the wrong parameters" if self.theirs else "unquantized"
        return (
            f"vLLM 0.33 loads these experts as {self.vllm_name!r}, which {took}, not {self.ours!r} that holds their "
            f"tensors: it would build them {built}; write the targets so that they also match that "
            f"name (for example 're:.*{self.proj}$')"
        )


def vllm_expert_mismatches(groups: dict[str, str | None], qcfg: dict) -> list[ExpertMismatch]:
    """The MoE blocks and projections whose experts vLLM 0.33 would load with another config group, in name order.

    ``groups``: each quantized module's name -> its config group (compressed-tensors' rule). vLLM 0.33 builds one
    ``RoutedExperts`` layer per MoE block, named ``<block>.experts.routed_experts``, and takes the scheme of every
    expert from the names of expert 0 under it: ``<block>.experts.routed_experts.0.<projection>``
    (``model_executor/layers/fused_moe/layer.py``: ``routed_experts_prefix``; ``compressed_tensors_moe.py``:
    ``get_moe_method``). A target written for the checkpoint's names (``re:.*experts\\.\\d+\\..*``) may not match
    that name; vLLM then falls back to the class (``Linear``), and builds the experts with another group's parameters
    (its loader refuses them) or none. A block and projection whose experts' group differs from
    :func:`vllm_expert_group` of that name is a mismatch."""
    first: dict[tuple[str, str], tuple[int, str]] = {}  # (block, projection) -> its lowest expert index, module
    for name in groups:
        if (hit := _EXPERT.match(name)) is not None:
            key, i = (hit["block"], hit["proj"]), int(hit["i"])
            if key not in first or i < first[key][0]:
                first[key] = (i, name)
    out = []
    for (block, proj), (_, module) in sorted(first.items()):
        vllm_name = f"{block}.experts.routed_experts.0.{proj}"
        theirs = vllm_expert_group(vllm_name, qcfg)
        if theirs != groups[module]:
            out.append(ExpertMismatch(block, proj, module, vllm_name, theirs, groups[module]))
    return out


@dataclass
class MixedExperts:
    """One MoE block whose per-expert modules are not all quantized alike (:func:`mixed_expert_blocks`): ``groups``:
    config group (None: dense) -> ``(expert indices, projections)`` in it, sorted."""

    block: str
    groups: dict
    first: str  # the block's first per-expert module, by name (where verify reports it)

    @property
    def experts(self) -> str:
        return f"{self.block}.experts"

    def message(self) -> str:
        def which(ix: list[int]) -> str:
            head = ", ".join(map(str, ix[:4])) + (f" and {len(ix) - 4} more" if len(ix) > 4 else "")
            return f"expert{'s' if len(ix) > 1 else ''} {head}"

        parts = [f"{which(ix)} ({', '.join(projs)}) {'dense' if g is None else f'in config group {g!r}'}" for g, (ix, projs) in self.groups.items()]
        return (
            f"{'; '.join(parts)}: vLLM 0.33 builds a MoE block's experts as one fused layer with one quantization method "
            "for all of its projections, so it cannot load experts or projections quantized unlike each other; quantize "
            "every expert and projection of the block alike (--ignore all of them or none)"
        )


def mixed_expert_blocks(groups: dict[str, str | None]) -> list[MixedExperts]:
    """The MoE blocks whose per-expert Linear modules (``<block>.experts.<i>.<projection>``) are not all in one config
    group, in name order. ``groups``: every per-expert module's name -> its config group (None: dense). vLLM 0.33
    builds a block's routed experts as one ``FusedMoE`` layer with one quantization method for all its projections
    (``model_executor/layers/fused_moe/layer.py``; ``compressed_tensors_moe.py``: ``get_moe_method``, which raises
    "All MoE projections need to have same quantization scheme"): a dense expert beside quantized ones has no
    parameter for its ``weight``, quantized experts beside a dense expert 0 have none for their ``weight_scale``, and
    a dense ``down_proj`` beside quantized ``gate_proj``/``up_proj`` is refused (``vllm_accept.py`` rejected all three,
    2026-12-06)."""
    seen: dict[str, dict] = {}
    first: dict[str, str] = {}
    for name, group in groups.items():
        if (hit := _EXPERT.match(name)) is not None:
            ix, projs = seen.setdefault(hit["block"], {}).setdefault(group, (set(), set()))
            ix.add(int(hit["i"]))
            projs.add(hit["proj"])
            first[hit["block"]] = min(first.get(hit["block"], name), name)
    out = []
    for block, by in sorted(seen.items()):
        if len(by) > 1:
            ordered = sorted(by.items(), key=lambda kv: (min(kv[1][0]), sorted(kv[1][1])))
            out.append(MixedExperts(block, {g: (sorted(ix), sorted(projs)) for g, (ix, projs) in ordered}, first[block]))
    return out


def vllm_expert_problems(mods: dict[str, Module], qcfg: dict) -> list[Problem]:
    """Errors for quantized per-expert Linear modules that vLLM 0.33 would load with another config group's scheme
    (:func:`vllm_expert_mismatches`, one per MoE block and projection), and for MoE blocks whose experts and
    projections are not quantized alike (:func:`mixed_expert_blocks`, one per block), naming the first expert's file. None for a
    sparsity-only config (``--scheme DENSE --sparsity 2:4``): vLLM 0.33 loads no ``sparse-24-bitmask`` checkpoint at all
    (the README's 2:4 section: vLLM <= 0.18), so which group its experts would take there is no question."""
    if not qcfg.get("config_groups"):
        return []
    groups = {m.name: m.group for m in mods.values() if m.quantized}
    out = []
    for mm in vllm_expert_mismatches(groups, qcfg):
        m = mods[mm.module]
        out.append(Problem("error", mm.message(), m.file, mm.experts))
    every = {m.name: (m.group if m.quantized else None) for m in mods.values() if "weight" in m.parts or m.quantized}
    for mx in mixed_expert_blocks(every):
        out.append(Problem("error", mx.message(), mods[mx.first].file, mx.experts))
    return out


def vllm_unloadable_problems(mods: dict[str, Module], config: dict) -> list[Problem]:
    """Errors for quantized modules that vLLM 0.33 cannot load quantized
    (:func:`~ctconvert.checkpoint.families.vllm_dense_reason`: gpt-oss's experts, experts whose group's scheme vLLM
    has no fused-MoE method for, the MoE router of the families whose
    vLLM model builds it without a quantization config), one per reason and kind of module, naming the first module
    and how many; ``quantize`` writes them only with ``--allow-unloadable``."""
    found: dict[str, list[Module]] = {}
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    for m in mods.values():
        group = groups.get(m.group)
        inputs = group.get("input_activations") if isinstance(group, dict) else None
        if m.quantized and (why := vllm_dense_reason(m.name, config, m.weights, inputs)) is not None:
            found.setdefault(why, []).append(m)
    out = []
    for why, ms in found.items():
        more = f" (and {plural(len(ms) - 1, 'more such module')})" if len(ms) > 1 else ""
        first = ms[0]
        out.append(Problem("error", f"quantized, but {why}{more}", first.file, first.name))
    return out


def partial_block_problems(mods: dict[str, Module]) -> list[Problem]:
    """An error for quantized modules with block scales (FP8_BLOCK) whose weight is not whole blocks (N or K not a multiple
    of ``block_structure``: a [200, 200] weight with [2, 2] scales), naming the first and how many: transformers and
    vLLM 0.33 load whole blocks only (the planner's rule, :func:`ctconvert.plan.schemes.weight_problem`, by which
    ``quantize`` refuses such weights; vLLM ``validate_fp8_block_shape``). Read from the headers."""
    bad = []
    for m in mods.values():
        w = m.weights or {}
        block = w.get("block_structure") if m.quantized and w.get("strategy") == "block" else None
        if not block:
            continue
        try:
            n, k = dense_shape(m)
        except (ValueError, KeyError, RuntimeError, TypeError):
            continue
        if n % int(block[0]) or k % int(block[1]):
            bad.append((m, n, k, block))
    if not bad:
        return []
    m, n, k, block = bad[0]
    more = f" (and {plural(len(bad) - 1, 'more such module')})" if len(bad) > 1 else ""
    why = f"its [{n}, {k}] weight is not whole {list(block)} blocks of scales: transformers and vLLM 0.33 load whole blocks only{more}"
    return [Problem("error", why, m.file, m.name)]


def contradictions(mods: dict[str, Module], qcfg: dict | None) -> list[Problem]:
    """Every error of :func:`strategy_problems` (first), of :func:`module_problems` (quantized modules with a known group
    and format), of :func:`sparsity_problems` and of :func:`kv_scale_problems`, in module order."""
    if not qcfg:
        return []
    out, _ = strategy_problems(mods, qcfg)
    for m in mods.values():
        if m.quantized and m.group is not None and get_format(m.format) is not None:
            out += module_problems(m, qcfg)
    return out + sparsity_problems(mods, qcfg) + kv_scale_problems(mods, qcfg)


def refuse(found: list[Problem], config_file: Path) -> None:
    """Raise :class:`~ctconvert.errors.BadInputError` for the first of ``found`` (naming its file and tensor, and
    how many more modules there are); nothing when ``found`` is empty. ``config_file``: named when a problem has no
    file of its own (a config that claims what no tensor holds)."""
    if found:
        p = found[0]
        more = f" (and {len(found) - 1} more modules)" if len(found) > 1 else ""
        raise BadInputError(p.message + more, file=Path(p.file).name if p.file else config_file, tensor=p.tensor)


#: config keys under which layers legitimately lack ``k_proj``/``v_proj`` (transformers' ``Gemma4TextAttention`` and
#: ``Gemma3nTextAttention.__init__``: no k/v projections on KV-shared layers, no ``v_proj`` with ``attention_k_eq_v``)
_KV_OPTIONAL_KEYS = ("attention_k_eq_v", "num_kv_shared_layers", "kv_sharing_modes")
_INDEX = re.compile(r"\.\d+(?=\.|$)")


def linear_module_files(mods: dict[str, Module]) -> dict[str, str]:
    """The Linear modules of ``mods`` (quantized, or with a dense Linear weight), each with the file that holds it:
    the input of :func:`missing_fused_members`."""
    out = {}
    for m in mods.values():
        w = m.parts.get("weight")
        if m.quantized or (w is not None and is_linear_weight(m.name + ".weight", w)):
            out[m.name] = m.file
    return out


def missing_fused_members(modules: dict[str, str], config: dict | None) -> list[Problem]:
    """Errors for the fused sets (:data:`.naming.FUSED_SETS`: q/k/v, gate/up ...) that lack a member which the same
    set has in other layers (``model.layers.1.self_attn`` without ``v_proj`` where ``model.layers.0.self_attn`` has
    it): a partial copy or a broken export, which vLLM would load with the projection missing. ``modules``: Linear
    module name -> the file holding it; ``config``: ``config.json`` (or its ``text_config``), whose
    :data:`_KV_OPTIONAL_KEYS` make ``k_proj``/``v_proj`` optional. One error per set, naming the file and module."""
    cfg = config or {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    kv_optional = any(cfg.get(k) or text.get(k) for k in _KV_OPTIONAL_KEYS)
    present: dict[tuple[str, tuple[str, ...]], set[str]] = {}
    for name in modules:
        key = fused_key(name)
        if key is not None:
            present.setdefault(key, set()).add(name.rpartition(".")[2])
    seen: dict[tuple[str, tuple[str, ...]], set[str]] = {}  # per set and parent pattern (layer numbers as N)
    for (parent, members), leaves in present.items():
        seen.setdefault((_INDEX.sub(".N", parent), members), set()).update(leaves)
    out = []
    for (parent, members), leaves in sorted(present.items()):
        missing = [m for m in members if m in seen[(_INDEX.sub(".N", parent), members)] - leaves]
        if not missing or (kv_optional and set(missing) <= {"k_proj", "v_proj"}):
            continue
        have = [m for m in members if m in leaves]
        out.append(
            Problem(
                "error",
                f"fused set {fused_set_name(parent, members)} has no {', '.join(missing)} (other layers have it; this one only "
                f"{', '.join(have)}): a partial copy or a broken export? vLLM loads the set as one layer",
                modules[f"{parent}.{have[0]}"],
                f"{parent}.{missing[0]}",
            )
        )
    return out
