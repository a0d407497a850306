"""``ctconvert inspect``: per-layer scheme, format, dtypes, shapes, bytes, bits per weight, problems.

Works on dense and compressed-tensors checkpoints from the headers (plus the
few tiny tensors that carry shapes and global scales). Problems found:
anything :func:`ctconvert.checkpoint.reader.open_checkpoint` reports (missing
shard, stale index, duplicates, unreadable files), quantized tensors that the
``quantization_config`` does not explain, dense Linear weights a loader would
expect quantized (not in ``ignore``), tensors that contradict the config
(:mod:`ctconvert.checkpoint.conformance`: a part missing, extra, of another
dtype or shape than the group's format writes; a 2:4 ``sparsity_config``
over modules stored plain), and fused sets whose NVFP4 global scales differ
(docs/compressed-tensors-format.md §9.1). A kernel-native
checkpoint (:mod:`ctconvert.checkpoint.kernel_native`) is summarized from its
module records.

Reads top to bottom: open the folder (problems collected, not raised) -> one
row per Linear layer -> fused-set checks -> totals.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ..checkpoint.conformance import (
    contradictions,
    linear_module_files,
    missing_fused_members,
    partial_block_problems,
    vllm_expert_problems,
    vllm_unloadable_problems,
)
from ..checkpoint.families import split_fused_experts
from ..checkpoint.kernel_native import is_kernel_native, missing_tensors
from ..checkpoint.loadable import loadability_problems
from ..checkpoint.modules import ACT_PARTS, QUANT_PARTS, Module, dense_shape, fused_global_scales, modules_of, unexplained_dense
from ..checkpoint.naming import BLOCK, decoder_layer_index, is_linear_weight, natural_key
from ..checkpoint.provenance import PROVENANCE, cast_tensors
from ..checkpoint.reader import Checkpoint, Problem, open_checkpoint
from ..errors import CTConvertError, agree, plural
from ..formats import CompressionFormat
from ..sources import SOURCE_CONFIG_FILES, Source, SourceModule, open_source
from ..sources.compressed_tensors import COMPRESSED_TENSORS

__all__ = ["describe_weights", "inspect_checkpoint"]


def _inspect_kernel_native(ckpt, path: Path) -> dict:
    q = ckpt.quantization_config
    problems = list(ckpt.problems) + _vllm_problems(ckpt, {}, path)  # (no dense modules: verify's count, widths and sizes)
    layers = []
    for mod, rec in (q.get("modules") or {}).items():
        if (problem := missing_tensors(ckpt, mod, rec)) is not None:
            problems.append(problem)
            continue
        infos = {p: ckpt.tensors[f"{mod}.{p}"] for p in rec.get("tensors", [])}
        n, k = rec.get("size_n"), rec.get("size_k")
        nbytes = sum(i.nbytes for i in infos.values())
        params = (n or 0) * (k or 0)
        layers.append(
            {
                "module": mod,
                "group": None,
                "scheme": rec["kernel"],
                "format": f"{rec['kernel']} (vLLM {rec.get('layout_version')})",
                "tensors": {p: {"dtype": i.dtype, "shape": list(i.shape)} for p, i in sorted(infos.items())},
                "bytes": nbytes,
                "params": params,
                "bits_per_weight": round(8 * nbytes / params, 3) if params else None,
                "padded": [rec.get("padded_n"), rec.get("padded_k")],
            }
        )
    n_quantized = len(layers)
    for name in sorted(ckpt.tensors, key=natural_key):  # the dense Linear layers (lm_head ...), counted as the source counts them
        info, mod = ckpt.tensors[name], name.removesuffix(".weight")
        if name.endswith(".weight") and mod not in (q.get("modules") or {}) and is_linear_weight(name, info):
            layers.append(_dense_row(mod, info))
    lb = sum(r["bytes"] for r in layers)
    lp = sum(r["params"] for r in layers)
    qb = sum(r["bytes"] for r in layers[:n_quantized])
    qp = sum(r["params"] for r in layers[:n_quantized])
    return {
        "path": str(path),
        "quantization_config": {k: q.get(k) for k in ("quant_method", "format", "target", "layout_version", "act_dtype")},
        "config_groups": {},
        "ignore": (q.get("source_quantization_config") or {}).get("ignore"),
        "layers": layers,
        "totals": {
            "tensors": len(ckpt.tensors),
            "files": len(ckpt.files),
            "bytes": ckpt.total_bytes,
            "linear_layers": len(layers),
            "quantized_layers": n_quantized,
            "linear_bytes": lb,
            "linear_params": lp,
            "linear_bits_per_weight": round(8 * lb / lp, 3) if lp else None,
            "quantized_bits_per_weight": round(8 * qb / qp, 3) if qp else None,
            "in_blocks": sum(r.get("linear_layers", 1) for r in layers if BLOCK.search(r["module"] + ".")),
        },
        "problems": [p.to_dict() for p in problems],
    }


def _dense_row(mod: str, info) -> dict:
    params = math.prod(info.shape)
    return {
        "module": mod,
        "group": None,
        "scheme": "dense",
        "format": "dense",
        "tensors": {"weight": {"dtype": info.dtype, "shape": list(info.shape)}},
        "bytes": info.nbytes,
        "params": params,
        "bits_per_weight": round(8 * info.nbytes / params, 3) if params else None,
    }


def _missing_layers(ckpt, path: Path) -> Problem | None:
    """A warning when config.json's ``num_hidden_layers`` names decoder layers that no tensor holds
    (a partial copy or download). Checked for plain decoder models only (``model.layers.N.``)."""
    n = ckpt.config.get("num_hidden_layers")
    if not isinstance(n, int) or n <= 0:
        return None
    present = {i for name in ckpt.tensors if (i := decoder_layer_index(name)) is not None}
    if not present:
        return None
    missing = sorted(set(range(n)) - present)
    if not missing:
        return None
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    return Problem(
        "warning",
        f"config.json has num_hidden_layers={n} but no tensor of {agree(len(missing), 'layer', 'layers')} {shown} ({len(missing)} missing): a partial copy?",
        file=str(Path(path) / "config.json"),
    )


def inspect_checkpoint(path: Path) -> dict:
    """Return the inspection report of the checkpoint folder ``path`` (a JSON-ready dict).

    Every input format ``quantize`` and ``convert`` read is shown as what it is: compressed-tensors and dense
    folders from their tensors and config; AutoAWQ, GPTQ, Hugging Face FP8 block and ModelOpt NVFP4 through
    their readers (:func:`ctconvert.sources.open_source`: format, bits, group size or block per
    layer); a kernel-native output from its module records."""
    ckpt = open_checkpoint(path, strict=False)
    if is_kernel_native(ckpt.quantization_config):
        return _inspect_kernel_native(ckpt, path)
    if (foreign := _foreign_source(ckpt)) is not None:
        return _inspect_source(ckpt, path, *foreign)
    problems: list[Problem] = list(ckpt.problems)  # (missing decoder layers: _vllm_problems' count)
    qcfg = ckpt.quantization_config or {}
    groups = qcfg.get("config_groups") or {}
    mods = modules_of(ckpt)
    keyed = []
    for m in mods.values():
        row = _layer(m, qcfg, problems)
        if row is not None:
            keyed.append(((m.file, natural_key(m.name)), row))
    keyed += _fused_expert_rows(ckpt, problems)
    layers = [row for _, row in sorted(keyed, key=lambda x: x[0])]
    problems += _fused_set_problems(mods)
    problems += missing_fused_members(linear_module_files(mods), ckpt.config)
    if qcfg.get("quant_method") == "compressed-tensors":
        problems += contradictions(mods, qcfg) + partial_block_problems(mods)
    problems += unexplained_dense(ckpt, mods)
    problems += _vllm_problems(ckpt, mods, path)
    if qcfg.get("quant_method") == "compressed-tensors":  # quantized so for other loaders (--allow-unloadable): verify fails it
        problems += _verify_fails(vllm_expert_problems(mods, qcfg) + vllm_unloadable_problems(mods, ckpt.config))
    casts = cast_tensors(path)
    for row in layers:
        if (c := casts.get(row["module"] + ".weight")) is not None:
            row["cast"] = c
    return {
        "path": str(path),
        "quantization_config": _config_summary(qcfg),
        "sparsity_config": qcfg.get("sparsity_config") or None,  # 2:4 (compressed-tensors <= 0.14)
        "config_groups": {
            g: {
                "targets": v.get("targets"),
                "format": v.get("format"),
                "scheme": describe_weights(v.get("weights") or {}),
                "activations": describe_activations(v.get("input_activations") or {}),
            }
            for g, v in groups.items()
        },
        "kv_cache_scheme": describe_activations(qcfg.get("kv_cache_scheme") or {}) if qcfg else None,
        "ignore": qcfg.get("ignore") if qcfg else None,
        "derived_from": _derived_from(path),
        "dense_cast": _cast_summary(casts),
        "layers": layers,
        "totals": _totals(ckpt, layers),
        "problems": [p.to_dict() for p in problems],
    }


def _vllm_problems(ckpt: Checkpoint, mods: dict[str, Module], path: Path) -> list[Problem]:
    """What verify's architecture checks find, from the headers (:func:`.loadable.loadability_problems`), as warnings:
    inspect describes a checkpoint (a partial copy or a test's slice too) and keeps exit 3 for one it cannot read
    consistently, while ``verify`` fails these (exit 5)."""
    return _verify_fails(loadability_problems(ckpt, mods, path))


def _verify_fails(found: list[Problem]) -> list[Problem]:
    """``found``'s errors as warnings that say ``verify`` fails them (what vLLM 0.33 makes of the checkpoint: inspect
    keeps its exit 3 for a checkpoint it cannot read consistently)."""
    return [dataclasses.replace(p, severity="warning", message=f"{p.message} (`ctconvert verify` fails it)") if p.severity == "error" else p for p in found]


def _foreign_source(ckpt: Checkpoint) -> tuple[Source | None, Problem | None] | None:
    """``(source, None)`` for a checkpoint of another tool's quantization (AutoAWQ, GPTQ, FP8 block, ModelOpt:
    from ``config.json`` or the tool's own file beside it), ``(None, problem)`` when its reader refuses it
    (an error naming file and tensor), None for a dense or compressed-tensors checkpoint."""
    qcfg = ckpt.quantization_config
    if (qcfg or {}).get("quant_method") == COMPRESSED_TENSORS.quant_method:  # read by the report of its own
        return None
    if qcfg is None and not any((ckpt.path / f).is_file() for f in SOURCE_CONFIG_FILES):
        return None
    if ckpt.problems and any(p.severity == "error" for p in ckpt.problems):
        return None  # an inconsistent folder: reported as such, tensor by tensor
    try:
        source = open_source(ckpt)
    except CTConvertError as e:
        return None, Problem("error", e.message, str(e.file) if e.file else None, e.tensor)
    return (source, None) if source.quantized else None


def _source_row(m: SourceModule) -> dict:
    """The report row of one quantized module of another tool's format: ``format`` is the reader's kind, ``scheme``
    its label; ``bits`` and ``group_size`` (``block`` for FP8 block scales) as the source's config states them."""
    bits, group, block = m.bits, m.group_size, m.block
    nbytes = sum(i.nbytes for i in m.parts.values())
    params = m.shape[0] * m.shape[1]
    row = {
        "module": m.name,
        "group": None,
        "scheme": m.label,
        "format": m.kind,
        "bits": bits,
        "group_size": group,
        "tensors": {p: {"dtype": i.dtype, "shape": list(i.shape)} for p, i in sorted(m.parts.items())},
        "bytes": nbytes,
        "params": params,
        "bits_per_weight": round(8 * nbytes / params, 3) if params else None,
    }
    if block:
        row["block"] = block
    return row


def _inspect_source(ckpt: Checkpoint, path: Path, source: Source | None, refused: Problem | None) -> dict:
    """The report of a checkpoint of another tool's quantization (:func:`_foreign_source`): one row per quantized
    module as its reader sees it, the dense Linear layers, the tool's config, and what verify's architecture checks
    find in its dense view (:func:`_vllm_problems`: an output made from it carries them)."""
    problems: list[Problem] = list(ckpt.problems)
    if source is None and (missing := _missing_layers(ckpt, path)) is not None:  # (else _vllm_problems' count)
        problems.append(missing)
    layers = []
    qcfg = ckpt.quantization_config
    if source is not None:
        problems += _vllm_problems(source.view, modules_of(source.view), path)  # the dense view: what an output carries
        qcfg = source.quantization_config
        layers = [_source_row(m) for m in sorted(source.modules.values(), key=lambda m: (str(m.anchor.file), natural_key(m.name)))]
        stored = {i.name for m in source.modules.values() for i in m.parts.values()}
        for name in sorted(ckpt.tensors, key=natural_key):
            info = ckpt.tensors[name]
            if name not in stored and is_linear_weight(name, info):
                layers.append(_dense_row(name.removesuffix(".weight"), info))
        linear = {n.removesuffix(".weight"): str(i.file) for n, i in source.view.tensors.items() if is_linear_weight(n, i)}
        problems += missing_fused_members(linear, ckpt.config)
        if source.dropped:
            first = next(iter(source.dropped))
            what = f"{plural(len(source.dropped), 'tensor')} ({first}{' ...' if len(source.dropped) > 1 else ''})"
            problems.append(Problem("note", f"{what}: activation or KV-cache scales of the source's quantization, not part of a weight"))
    if refused is not None:
        problems.append(refused)
    summary = _config_summary(qcfg or {})
    if summary is not None and source is not None:
        summary["source_format"] = source.kind
        if source.config_file is not None and source.config_file.name != "config.json":
            summary["config_file"] = source.config_file.name
    return {
        "path": str(path),
        "quantization_config": summary,
        "sparsity_config": None,
        "config_groups": {},
        "ignore": None,
        "derived_from": None,
        "dense_cast": None,
        "layers": layers,
        "totals": _totals(ckpt, layers),
        "problems": [p.to_dict() for p in problems],
    }


def _config_summary(qcfg: dict) -> dict | None:
    """compressed-tensors: ``quant_method``, ``format``, ``quantization_status``; another method (GPTQ, AWQ,
    bitsandbytes, FP8 of another tool ...): its own scalar settings, as its config states them."""
    if not qcfg:
        return None
    out = {k: qcfg.get(k) for k in ("quant_method", "format", "quantization_status")}
    if qcfg.get("quant_method") != "compressed-tensors":
        out.update({k: v for k, v in qcfg.items() if isinstance(v, (str, int, float, bool)) and k not in out})
    return out


def _derived_from(path: Path) -> dict | None:
    """The quantized checkpoint a requantized or converted output was made from (its provenance says), or None."""
    try:
        prov = json.loads((Path(path) / PROVENANCE).read_text())
    except (OSError, ValueError):
        return None
    d = prov.get("derived_from") if isinstance(prov, dict) else None
    if not isinstance(d, dict):
        return None
    return {**d, **({"conversion": prov["conversion"]} if "conversion" in prov else {})}


def _cast_summary(casts: dict[str, str]) -> dict | None:
    """How many tensors were cast, by cast (``{"fp32->bf16": 12}``), or None."""
    if not casts:
        return None
    counts: dict[str, int] = {}
    for c in casts.values():
        counts[c] = counts.get(c, 0) + 1
    return {"tensors": len(casts), "casts": dict(sorted(counts.items()))}


def _layer(m: Module, qcfg: dict, problems: list[Problem]) -> dict | None:
    """The report row of a Linear layer (None for a module that is not one); its problems go to ``problems``."""
    quantized = m.quantized
    dense = m.parts.get("weight")
    if not quantized and (dense is None or not is_linear_weight(m.name + ".weight", dense)):
        return None
    infos = {p: i for p, i in m.parts.items() if p == "weight" or p in QUANT_PARTS or p in ACT_PARTS}
    group = m.group
    if quantized:
        try:
            params = math.prod(dense_shape(m))
        except Exception:  # noqa: BLE001 - an unreadable shape is reported through the bits per weight
            params = 0
        if not qcfg:
            problems.append(Problem("error", "quantized tensors but config.json has no quantization_config", tensor=m.name))
        elif group is None:
            problems.append(Problem("error", "quantized tensors that no config group targets (or listed in ignore)", tensor=m.name))
    else:
        params = dense.numel
        if group is not None:
            problems.append(
                Problem(
                    "error",
                    f"dense Linear weight matched by config group {group!r} but not in ignore: loaders expect quantized tensors (they would load garbage)",
                    tensor=m.name,
                )
            )
    nbytes = sum(i.nbytes for i in infos.values())
    return {
        "module": m.name,
        "group": group,
        "scheme": _sparse_scheme(m, describe_weights(m.weights or {})) if quantized else "dense",
        "format": m.format if quantized else "dense",
        "tensors": {p: {"dtype": i.dtype, "shape": list(i.shape)} for p, i in sorted(infos.items())},
        "bytes": nbytes,
        "params": params,
        "bits_per_weight": round(8 * nbytes / params, 3) if params else None,
    }


def _fused_expert_rows(ckpt: Checkpoint, problems: list[Problem]) -> list[tuple[tuple, dict]]:
    """``(sort key, report row)`` of each fused 3-D expert weight stored as it is (gpt-oss's ``experts.gate_up_proj``
    ``[E, H, 2I]`` and ``experts.down_proj``, kept dense: a quantized expert is stored split, one module per expert):
    the experts' Linear weights, each counted in the totals as the layers it holds (``linear_layers``: E, or 2E for
    gate and up), as the split output counts them. A family the expert table does not know is a warning (its experts
    are then not counted)."""
    try:
        fused = split_fused_experts(ckpt.tensors, ckpt.config)
    except CTConvertError as e:
        problems.append(Problem("warning", f"fused expert tensors not counted in the layers: {e.message}", tensor=e.tensor))
        return []
    out = []
    for name, fe in fused.items():
        if fe.bias:
            continue
        info = ckpt.tensors[name]
        params = math.prod(info.shape)
        row = {
            "module": name,
            "group": None,
            "scheme": "dense",
            "format": "dense",
            "experts": int(info.shape[0]),
            "linear_layers": len(fe.parts),  # the Linear weights it holds: an expert's down_proj, or its gate and up
            "tensors": {fe.member: {"dtype": info.dtype, "shape": list(info.shape)}},
            "bytes": info.nbytes,
            "params": params,
            "bits_per_weight": round(8 * info.nbytes / params, 3) if params else None,
        }
        out.append(((str(info.file), natural_key(name)), row))
    return out


def _fused_set_problems(mods: dict[str, Module]) -> list[Problem]:
    """A warning per fused set whose NVFP4 global scales differ (vLLM keeps one)."""
    try:
        fused = fused_global_scales(mods)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return [Problem("error", f"cannot read a weight_global_scale: {e}")]
    return [
        Problem("warning", f"fused set members have different NVFP4 global scales {vals}; vLLM keeps only the largest", tensor=fused_set)
        for fused_set, vals in fused.items()
        if len(set(vals.values())) > 1
    ]


def _totals(ckpt: Checkpoint, layers: list[dict]) -> dict:
    lin_bytes = sum(r["bytes"] for r in layers)
    lin_params = sum(r["params"] for r in layers)
    q_bytes = sum(r["bytes"] for r in layers if r["format"] != "dense")
    q_params = sum(r["params"] for r in layers if r["format"] != "dense")
    return {
        "tensors": len(ckpt.tensors),
        "files": len(ckpt.files),
        "bytes": sum(t.nbytes for t in ckpt.tensors.values()),
        "linear_layers": sum(r.get("linear_layers", 1) for r in layers),  # a fused expert tensor: the layers it holds
        "quantized_layers": sum(1 for r in layers if r["format"] != "dense"),
        "linear_bytes": lin_bytes,
        "linear_params": lin_params,
        "linear_bits_per_weight": round(8 * lin_bytes / lin_params, 3) if lin_params else None,
        "quantized_bits_per_weight": round(8 * q_bytes / q_params, 3) if q_params else None,
        "in_blocks": sum(r.get("linear_layers", 1) for r in layers if BLOCK.search(r["module"] + ".")),
    }


def _sparse_scheme(m: Module, scheme: str | None) -> str | None:
    """The scheme of a 2:4 sparse module gets ``2:4`` (``sparse-24-bitmask``, ``marlin-24``)."""
    if str(m.format).startswith(CompressionFormat.SPARSE_24_BITMASK.value) or m.format == CompressionFormat.MARLIN_24.value:
        return f"{scheme} 2:4" if scheme else "dense 2:4"
    return scheme


def describe_activations(a: dict) -> str | None:
    """A short name of activation (or KV cache) QuantizationArgs: ``fp8 token dynamic``, ``fp4 g16 local`` (NVFP4's
    calibrated global scale), ``fp8 tensor static``, ``int8 tensor asym static``; None for none."""
    if not a:
        return None
    dynamic = a.get("dynamic")
    how = "local" if dynamic == "local" else ("dynamic" if dynamic else "static")
    return f"{describe_weights(a)} {how}"


def describe_weights(w: dict) -> str | None:
    """A short name of weight QuantizationArgs: ``int4 g128``, ``fp8 channel``, ``int4 g128 asym``, ``fp8 128x128``."""
    if not w:
        return None
    t = "fp" if w.get("type") == "float" else "int"
    s = w.get("strategy")
    g = w.get("group_size")
    extra = f"g{g}" if s in ("group", "tensor_group") and g else ("x".join(map(str, w.get("block_structure") or [])) if s == "block" else s)
    sym = "" if w.get("symmetric", True) else " asym"
    return f"{t}{w.get('num_bits')} {extra}{sym}"
