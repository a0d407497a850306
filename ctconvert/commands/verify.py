"""``ctconvert verify``: structure, values, and (with a reference) error per tensor of a compressed-tensors checkpoint.

Structure: the folder validates (index, shards, no duplicates), each shard's bytes are the ones written (the hashes in
the index, :mod:`ctconvert.checkpoint.integrity`); the config says ``quant_method: compressed-tensors`` and
``quantization_status: compressed``; every quantized module is explained by a config group and holds exactly the
tensors its group's format and activation args write, with their dtypes and shapes
(:mod:`ctconvert.checkpoint.conformance`: a config the tensors contradict fails, a 2:4 ``sparsity_config`` over plain
tensors and a static ``kv_cache_scheme`` without its scales included); every dense Linear is
in ``ignore``; no fused set lacks a member its other layers have; NVFP4 fused sets share one global scale
(docs/compressed-tensors-format.md §9.1) and calibrated ones one input scale; the attention rows match config.json
(:mod:`ctconvert.checkpoint.files_check`), as do the layer and expert counts (:mod:`ctconvert.checkpoint.depth`), the
widths and a tied head (:mod:`ctconvert.checkpoint.widths`); no float tensor holds NaN/inf and no E4M3 byte is NaN (0x7F/0xFF).

With ``reference`` (the dense source, or a quantized one: then its weights dequantized by :mod:`ctconvert.sources`),
an independent check that reads the two checkpoints and nothing else (not the writer's plan, not the output's
provenance): every quantized weight is dequantized and compared (relative L2, max abs, SNR in dB) against a per-format
threshold (2:4 modules against the reference pruned 2:4 by verify, the error against the dense one beside it); every
other output tensor must come from the reference (equal bytes, or its values cast bit for bit to another float dtype)
or be explained by the config; every reference tensor must be in the output or replaced by the
parts of a quantized module; each row and each value is judged too (:mod:`ctconvert.checkpoint.rows`,
:mod:`ctconvert.checkpoint.grid`: a value must be the nearest to its reference over its scale); config.json and the
copied files match the reference's but for what a conversion changes (:mod:`ctconvert.checkpoint.files_check`).

A kernel-native checkpoint is verified by its round trip: every module is inverted and repacked again, and must give
the stored bytes (and, with a reference, the compressed-tensors source, whose every other tensor must be stored
unchanged).

A dense checkpoint (a ``decompress`` output) is compared value for value with ``reference``; without one, where its index
holds ctconvert's records, it is judged by them and by NaN/inf alone (:func:`.integrity.judged_by_records`).

Reads top to bottom: structure -> values -> reference errors -> the report.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace

import torch

from ..checkpoint.comparison import (
    CHUNK,
    PRUNED_NOTE,
    THRESHOLDS,
    add_error_sums,
    compare_others,
    copy_of,
    effective_values,
    error_stats,
    error_summary,
    error_threshold,
    gain_limit,
    gain_message,
    loose_row,
    same_bytes,
    split_reference,
    unread_note,
    widened,
)
from ..checkpoint.config import require_compressed_tensors
from ..checkpoint.conformance import (
    group_arg_problems,
    group_problems,
    linear_module_files,
    missing_fused_members,
    module_problems,
    partial_block_problems,
    vllm_unloadable_problems,
)
from ..checkpoint.depth import COUNTS_CHECK
from ..checkpoint.expected import EXPECTED_CHECK
from ..checkpoint.families import transformers_per_expert_reason
from ..checkpoint.files_check import reference_problems
from ..checkpoint.grid import GridCheck, grid_problems, rounded_elsewhere, unchecked_note
from ..checkpoint.integrity import dense_record_problems, judged_by_records, record_problems, shards_checks
from ..checkpoint.kernel_native import is_kernel_native
from ..checkpoint.loadable import PARSE_CHECK, architecture_problems, header_problems
from ..checkpoint.modules import FUSED_SHARED, Module, dense_row_chunks, dense_shape, fused_scalars, modules_of, unexplained_dense, with_files
from ..checkpoint.naming import find_embedding, is_linear_weight, natural_key, resolve_group
from ..checkpoint.param_shapes import PARAM_SHAPES_CHECK
from ..checkpoint.reader import CONFIG_NAME, Checkpoint, Problem, open_checkpoint
from ..checkpoint.rows import RowErrors, row_limit, row_problems, rows_ok
from ..checkpoint.safetensors_io import TORCH_TO_ST, iter_row_chunks, read_rows, read_tensor
from ..checkpoint.widths import WIDTHS_CHECK
from ..errors import UsageError
from ..formats import CompressionFormat, WeightArgs, get_format
from ..formats.sparse24 import SPARSE_PREFIX, prune24
from ..pipeline.zeros import candidate_rows
from ..plan import kernel_targets as kernels
from ..plan.parallel import checkpoint_modules, kernel_native_modules, parallel_report
from ..sources import open_source

__all__ = ["VALUES_UNCOMPARED", "verify"]

_FLOAT_OR_E4M3 = ("BF16", "F16", "F32", "F64", "F8_E4M3")

#: what each check is called in the report's ``checked.checks``
_STRUCTURE_CHECKS = [
    "folder (index, shards, duplicates)",
    "config explains every quantized tensor",
    "tensors agree with their group's format (parts, dtypes, shapes; 2:4 and KV cache claims)",
    "dense Linear in ignore",
    "MoE experts' group as vLLM 0.33 matches them, alike within each block",
    "modules vLLM 0.33 cannot load quantized (gpt-oss experts, experts with static INT8 inputs, most MoE routers, "
    "the DSA indexer's wk/weights_proj (DeepSeek-V3.2, GLM-5), partial FP8 blocks)",
    "fused sets complete",
    "attention shapes against config.json",
    "fused global scales and input scales",
    "NaN/inf",
]
_FILES_CHECK = "config.json and the copied files against the reference"
#: what a plain verify of a dense output (``decompress``) leaves out: it judges the bytes by their records alone
VALUES_UNCOMPARED = "the values against the checkpoint they were made from"
_NO_BAR = SimpleNamespace(update=lambda n: None)


def verify(path: str | Path, reference: str | Path | None = None, *, tp: int = 1, ep: int | None = None, progress=None) -> dict:
    """Return the verification report of ``path`` (``ok`` is the verdict); see :func:`ctconvert.api.verify`.

    ``progress``: a callable ``(total_bytes) -> context manager with .update(n)``, told the reference bytes compared."""
    path = Path(path)
    if tp < 1 or (ep is not None and ep < 1):
        raise UsageError(f"--tp and --ep must be >= 1, got {tp} and {ep}")
    if reference is not None and path.exists() and Path(reference).exists() and path.resolve() == Path(reference).resolve():
        raise UsageError("--reference is the checkpoint being verified, which measures nothing: give the source it was made from", file=path)
    ckpt = open_checkpoint(path, strict=False)
    mods = {} if is_kernel_native(ckpt.quantization_config) else modules_of(ckpt)  # kernel-native modules have no dense shapes
    ckpt.problems.extend(record_problems(ckpt, added=reference is None) + header_problems(ckpt, mods, path))  # (--reference names added files itself)
    if is_kernel_native(ckpt.quantization_config):
        report = _verify_kernel_native(ckpt, path, reference)
        return _with_parallel(report, kernel_native_modules(ckpt.quantization_config, ckpt.tensors), ckpt, tp, ep)
    if reference is not None and not ckpt.quantization_config:
        return _verify_dense(ckpt, mods, path, reference, progress)
    quantized = [m for m in mods.values() if m.quantized] if not ckpt.quantization_config else []
    if not ckpt.quantization_config and ((listed := judged_by_records(ckpt)) or quantized):  # a decompress output: records, NaN/inf
        problems = ckpt.problems + (dense_record_problems(ckpt) if listed and not quantized else [])  # (a quantized one: not a dense output's list)
        if quantized:  # (the quantization_config and its records removed: vLLM cannot load such tensors)
            why = (
                f"config.json has no quantization_config, but {len(quantized)} modules are stored quantized (e.g. {quantized[0].name}): removed after the run?"
            )
            problems.append(_error(why, file=str(path / CONFIG_NAME)))
        problems += _value_problems(ckpt) + architecture_problems(ckpt, mods)
        checks = [_STRUCTURE_CHECKS[0], "no quantized module", EXPECTED_CHECK, "NaN/inf"]
        return _report(path, None, problems, [], checked=_checked(ckpt, checks, 0, left=[VALUES_UNCOMPARED]), values_uncompared=True)
    if not any(p.file and Path(p.file).name == CONFIG_NAME for p in ckpt.problems):  # a missing or broken config.json is reported as such
        fix = "to compare a dense checkpoint (a decompress output) with its source, give --reference SRC; `ctconvert inspect` describes any checkpoint"
        require_compressed_tensors(ckpt.quantization_config, path / CONFIG_NAME, "verify", fix)
    problems: list[Problem] = list(ckpt.problems)
    problems += _config_problems(ckpt, path)
    found, contradicted = _module_problems(mods, ckpt.quantization_config or {}, str(path / CONFIG_NAME))
    found += vllm_unloadable_problems(mods, ckpt.config) + partial_block_problems(mods)
    problems += found
    problems += unexplained_dense(ckpt, mods)
    problems += missing_fused_members(linear_module_files(mods), ckpt.config) + architecture_problems(ckpt, mods, expected=reference is None)
    rows: list[dict] = []
    checks = [*_STRUCTURE_CHECKS, *([EXPECTED_CHECK] if reference is None else [])]
    if reference is None:
        problems += _value_problems(ckpt)
        problems += _all_zero_problems({n: m for n, m in mods.items() if n not in contradicted}, ckpt)  # (said: their tensors contradict the config)
    elif not ckpt.tensors:  # no shard could be read (truncated, say): the errors above say why, not a wrong --reference
        problems.append(unread_note(ckpt))
    else:
        source = open_checkpoint(reference, strict=True)
        ref = split_reference(open_source(source).view, ckpt, problems)  # a quantized reference: its dequantized weights
        problems += _value_problems(ckpt, ref)
        with _bar(progress, sum(t.nbytes for t in ref.tensors.values())) as bar:
            requantized = source.quantization_config is not None
            rows, ref_problems = _compare_weights(mods, ref, bar, contradicted, requantized, rounded_elsewhere(path, requantized))
            problems += with_files(ref_problems + compare_others(ckpt, mods, ref, bar), ckpt, mods) + reference_problems(ckpt, source)
        checks += [
            _FILES_CHECK,
            "error of every quantized weight against the reference",
            "every quantized value the nearest to its reference over its scale",
            "every other tensor equals the reference",
            "every reference tensor accounted for",
        ]
    report = _report(path, reference, problems, rows, checked=_checked(ckpt, checks, len(rows)))
    return _with_parallel(report, checkpoint_modules(mods, ckpt.tensors), ckpt, tp, ep)


def _with_parallel(report: dict, modules, ckpt: Checkpoint, tp: int, ep: int | None) -> dict:
    """Add the tensor-parallel plan; with ``tp > 1`` or ``ep`` every tensor that does not split is an error."""
    par = parallel_report(modules, ckpt.config, tp, ep)
    report["parallel"] = par.to_dict()
    if tp > 1 or ep is not None:
        at = f"--tp {tp}" + (f" --ep {ep}" if ep else "")
        found = [_error(f"does not split at {at}: {'; '.join(r.problems)}", tensor=r.name).to_dict() for r in par.failing]
        found += [_error(m["problem"]).to_dict() for m in par.model if "problem" in m]
        report["problems"] += found + [Problem("warning", m["warning"]).to_dict() for m in par.model if "warning" in m]
        report["ok"] = report["ok"] and not found
    return report


def _bar(progress, total: int):
    """``progress(total)``, or a context giving a bar whose ``update`` does nothing."""
    return contextlib.nullcontext(_NO_BAR) if progress is None else progress(total)


def _checked(ckpt: Checkpoint, checks: list[str], compared: int, left: list[str] | None = None) -> dict:
    """What verify looked at (the report's ``checked``), and what it left out (``not_checked``: with ``--reference``, what
    vLLM builds; ``left``: a dense output's values without one, :data:`VALUES_UNCOMPARED`)."""
    checks = [*shards_checks(ckpt), PARSE_CHECK, COUNTS_CHECK, WIDTHS_CHECK, PARAM_SHAPES_CHECK, *checks]
    left = left if left is not None else [c for c in (EXPECTED_CHECK,) if c not in checks]
    return dict(shards=len(ckpt.files), tensors=len(ckpt.tensors), bytes=ckpt.total_bytes, checks=checks, not_checked=left, compared_modules=compared)


def _report(path: Path, reference, problems: list[Problem], tensors: list[dict], **extra) -> dict:
    """The report: ``ok`` when no problem is an error."""
    return {
        "path": str(path),
        "reference": str(reference) if reference else None,
        "ok": not any(p.severity == "error" for p in problems),
        "summary": error_summary(tensors),
        "problems": [p.to_dict() for p in problems],
        "tensors": tensors,
        **extra,
    }


# -- a dense checkpoint (``decompress`` output) against its source ------------------------------


#: significand bits (the implicit one included) of the floating dtypes a dense tensor may be cast between
_SIGNIFICAND = {"F64": 53, "F32": 24, "F16": 11, "BF16": 8, "F8_E4M3": 4}


def _cast_limit(a: str, b: str) -> float:
    """The relative L2 error a round-to-nearest cast between the safetensors dtypes ``a`` and ``b`` can give:
    the unit roundoff ``2^-p`` of the narrower significand (every value moves by at most that fraction of
    itself; 0.1% more for the fp32 sums of :func:`_dense_row`), 0 for the same dtype."""
    return 0.0 if a == b else 2.0 ** -min(_SIGNIFICAND[a], _SIGNIFICAND[b]) * 1.001


def _verify_dense(ckpt: Checkpoint, mods: dict, path: Path, reference, progress) -> dict:
    """A dense checkpoint (a ``decompress`` output) against its source: every tensor's values.

    The reference is the dense model it was quantized from, or the quantized checkpoint it was decompressed
    from, read through its dequantized view (:func:`open_source`: compressed-tensors' ``decompress`` math).
    A reference with fused 3-D experts (gpt-oss) is read through the family split the planner uses
    (:func:`_split_reference`): each per-expert tensor of the output against its slice of the fused one.
    A tensor passes when its values are the reference's up to the rounding of a cast between the two dtypes
    (relative L2 at most :func:`_cast_limit`: exact in the same dtype). Only a Linear weight of a dense
    reference may differ more, up to the loosest format limit (:data:`THRESHOLDS`), since a dense file does
    not say which of its weights were quantized."""
    problems: list[Problem] = list(ckpt.problems)
    ref_ckpt = open_checkpoint(reference, strict=True)
    quantized_ref = bool(ref_ckpt.quantization_config)
    ref = open_source(ref_ckpt).view if quantized_ref else ref_ckpt
    split = split_reference(ref, ckpt, problems)  # fused 3-D experts (gpt-oss): each per-expert tensor against its slice
    if split is not ref and (why := transformers_per_expert_reason(ref.config)) is not None:  # a dense copy is for transformers too
        first = next(n for n in ref.tensors if n not in split.tensors)
        problems.append(_error(f"the reference stores these experts fused and this dense checkpoint holds them per expert: {why}", tensor=first))
    ref = split
    problems += _value_problems(ckpt, ref) + reference_problems(ckpt, ref_ckpt) + architecture_problems(ckpt, mods, expected=False)
    loose = max(THRESHOLDS.values())
    rows = []
    emb = find_embedding(ref.tensors)
    with _bar(progress, sum(t.nbytes for t in ref.tensors.values())) as bar:
        for name in sorted(ckpt.tensors, key=natural_key):
            info, src = ckpt.tensors[name], ref.tensors.get(name)
            if src is None and name.endswith("lm_head.weight") and emb:  # a head untied by --lm-head: the tied embedding
                src = ref.tensors[emb]
            if src is None:
                problems.append(_error("tensor not in the reference", tensor=name))
                continue
            if tuple(src.shape) != tuple(info.shape):
                problems.append(_error(f"shape {list(info.shape)} differs from the reference {list(src.shape)}", tensor=name))
                continue
            if src.dtype == info.dtype and src.virtual is None and src.view is None and info.view is None and same_bytes(info, src):
                bar.update(src.nbytes)
                continue
            if info.dtype not in _FLOAT_OR_E4M3 or src.dtype not in _FLOAT_OR_E4M3:
                problems.append(_error(f"{info.dtype} values differ from the reference {src.dtype}", tensor=name))
                continue
            cast = _cast_limit(info.dtype, src.dtype)
            row = _dense_row(name, info, src, cast)
            bar.update(src.nbytes)
            if row["rel_l2"] == 0.0:
                continue  # equal values (in another dtype, or another zero sign)
            if not row["ok"] and not quantized_ref and is_linear_weight(name, info):  # may have been quantized
                row.update(loose_row(row, info, src, loose))  # (a decompressed 2:4 output: against the pruned reference)
            rows.append(row)
            if row["ok"]:
                continue
            if row["threshold"] == loose:
                problems.append(_error(f"relative L2 error {row['rel_l2']:.4f} exceeds {loose}", tensor=name))
            elif cast == 0.0:
                problems.append(
                    _error(f"values differ from the reference (relative L2 error {row['rel_l2']:.3g}; same dtype {info.dtype}: must be equal)", tensor=name)
                )
            else:
                problems.append(
                    _error(f"relative L2 error {row['rel_l2']:.3g} exceeds {cast:.3g}, the rounding of a {src.dtype} -> {info.dtype} cast", tensor=name)
                )
    problems += [_error("tensor of the reference is missing", tensor=n) for n in ref.tensors if n not in ckpt.tensors]
    checks = ["folder (index, shards, duplicates)", "NaN/inf", "every tensor's values against the reference (dense)", _FILES_CHECK]
    return _report(path, reference, with_files(problems, ckpt, mods), rows, checked=_checked(ckpt, checks, len(rows)))  # each named with its shard


def _dense_row(name: str, info, src, limit: float) -> dict:
    se = sr = mx = 0.0
    rows = max(1, CHUNK // max(1, info.nbytes // max(1, info.shape[0]))) if info.shape else 1
    rows = max(128, rows // 128 * 128)  # a dequantized reference reads whole blocks and packed zero points
    n = info.shape[0] if info.shape else 1
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        got = (read_rows(info, r0, r1) if info.shape else read_tensor(info)).float()
        want = (read_rows(src, r0, r1) if src.shape else read_tensor(src)).float()
        d = got - want
        se += float((d * d).sum())
        sr += float((want * want).sum())
        mx = max(mx, float(d.abs().max()) if d.numel() else 0.0)
    rel = math.sqrt(se / sr) if sr > 0 else (0.0 if se == 0 else math.inf)
    snr = 10 * math.log10(sr / se) if se > 0 and sr > 0 else math.inf
    return {"module": name.removesuffix(".weight"), "format": "dense", "rel_l2": rel, "max_abs": mx, "snr_db": snr, "threshold": limit, "ok": rel <= limit}


def _error(msg: str, tensor: str | None = None, file: str | None = None) -> Problem:
    return Problem("error", msg, file, tensor)


# -- structure ---------------------------------------------------------------------


def _config_problems(ckpt: Checkpoint, path: Path) -> list[Problem]:
    qcfg = ckpt.quantization_config
    if not qcfg:  # a missing or unreadable config.json is reported once, by the folder check
        unread = any(p.file and Path(p.file).name == CONFIG_NAME for p in ckpt.problems)
        return [] if unread else [_error("config.json has no quantization_config", file=str(path / "config.json"))]
    out = group_arg_problems(qcfg, str(path / CONFIG_NAME))  # weight arguments the format contradicts
    if qcfg.get("quant_method") != "compressed-tensors":
        out.append(_error(f"quant_method is {qcfg.get('quant_method')!r}, not 'compressed-tensors'"))
    sparse_only = "config_groups" not in qcfg and (qcfg.get("sparsity_config") or {}).get("format")  # compressed-tensors 0.14 2:4
    if qcfg.get("quantization_status") != "compressed" and not sparse_only:
        out.append(_error(f"quantization_status is {qcfg.get('quantization_status')!r}; transformers then initializes weights randomly"))
    return out


def _module_problems(mods: dict[str, Module], qcfg: dict, file: str | None = None) -> tuple[list[Problem], set[str]]:
    """Quantized modules no config group explains, or whose tensors contradict their group's format
    (:func:`ctconvert.checkpoint.conformance.module_problems`), dense Linear weights a group claims, modules a
    2:4 ``sparsity_config`` claims that are not stored 2:4 (:func:`~ctconvert.checkpoint.conformance.sparsity_problems`),
    missing KV cache scales of a static ``kv_cache_scheme`` (:func:`~ctconvert.checkpoint.conformance.kv_scale_problems`),
    per-expert modules vLLM 0.33 would load with another group (:func:`~ctconvert.checkpoint.conformance.vllm_expert_problems`),
    fused sets whose members hold different NVFP4 global scales or calibrated input scales. Returns ``(problems, names of the modules whose tensors contradict
    their group)``: those are not dequantized."""
    out, contradicted = group_problems(mods, qcfg, file)  # (a strategy that contradicts its group size first: those modules not dequantized)
    for m in mods.values():
        if m.quantized:
            if m.group is None:
                out.append(_error("quantized tensors that no config group explains (or listed in ignore)", tensor=m.name))
                continue
            if get_format(m.format) is None:
                out.append(_error(f"unknown format {m.format!r}", tensor=m.name))
            elif found := module_problems(m, qcfg):
                out += found
                contradicted.add(m.name)
        elif m.group is not None and "weight" in m.parts:
            out.append(_error(f"dense Linear weight matched by config group {m.group!r} but not in ignore", tensor=m.name))
    for part, what in FUSED_SHARED.items():
        for fused_set, vals in fused_scalars(mods, part).items():
            if len(set(vals.values())) > 1:
                out.append(_error(f"fused set members have different {what} {vals}", tensor=fused_set))
    return out, contradicted


# -- values -----------------------------------------------------------------------------


def _value_problems(ckpt: Checkpoint, ref: Checkpoint | None = None) -> list[Problem]:
    """NaN/inf in float tensors, NaN bytes in E4M3 tensors: errors, but for a copy of the reference's tensor of that name
    (its bytes, or with ``--dense-dtype`` its values cast: a copy ``--allow-non-finite`` made, which its note names): a warning."""
    out = []
    for name, info in ckpt.tensors.items():
        if info.dtype not in _FLOAT_OR_E4M3:
            continue
        bad = 0
        for _, t in iter_row_chunks(info, CHUNK):
            if info.dtype == "F8_E4M3":
                bad += int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
            else:
                bad += int((~torch.isfinite(t)).sum())
        if bad:
            what = " (E4M3 NaN bytes 0x7F/0xFF)" if info.dtype == "F8_E4M3" else ""
            if ref is not None and (r := ref.tensors.get(name)) is not None and copy_of(info, r):  # its bytes, or its values cast
                why = f"{bad} NaN/inf values{what}, as the reference holds them (a copy --allow-non-finite made)"
                out.append(Problem("warning", why, str(info.file), name))
            else:
                out.append(_error(f"{bad} NaN/inf values{what}", tensor=name, file=str(info.file)))
    return out


# -- against the reference -------------------------------------------------------------------


def _compare_weights(
    mods: dict[str, Module], ref: Checkpoint, bar, contradicted: set[str] = frozenset(), requantized: bool = False, unchecked: str | None = None
) -> tuple[list[dict], list[Problem]]:
    """One error row per quantized module: its dequantized weight against the reference's. ``contradicted``: the modules whose tensors
    contradict their config group (reported already), not dequantized; a module whose tensors cannot be dequantized is an error.
    ``requantized``: the reference is itself quantized, whose weights lie on another grid, so that rounding them again is biased by
    itself (an int4 GPTQ source requantized to W4A16 gains ~1.047: each group's absmax code -8 becomes -7.5 steps of the new scale):
    the gain's wider limit. ``unchecked``: why no value is judged one by one (:func:`~ctconvert.checkpoint.grid.rounded_elsewhere`)."""
    rows, problems = [], []
    emb = find_embedding(ref.tensors)
    for m in sorted(mods.values(), key=lambda m: natural_key(m.name)):
        if not (m.quantized and m.group is not None and get_format(m.format) is not None) or m.name in contradicted:
            continue
        src = ref.tensors.get(m.name + ".weight")
        if src is None and m.name.endswith("lm_head") and emb:
            src = ref.tensors[emb]
        if src is None:
            problems.append(_error("no reference weight for this module", tensor=m.name))
            continue
        n, k = dense_shape(m)
        if tuple(src.shape) != (n, k):
            problems.append(_error(f"shape {n}x{k} differs from the reference {list(src.shape)}", tensor=m.name))
            continue
        try:
            row = _error_row(m, src, requantized, unchecked)
        except (ValueError, KeyError, RuntimeError, IndexError) as e:
            problems.append(_error(f"cannot be dequantized as {m.format}: {e}", tensor=m.name))
            continue
        bar.update(src.nbytes)
        rows.append(row)
        if row.get("against") == "2:4-pruned reference" and not any(p.message == PRUNED_NOTE for p in problems):
            problems.append(Problem("note", PRUNED_NOTE))
        if row["module_limits_judged"] and not row["rel_l2"] <= row["threshold"]:  # NaN fails; no row large enough for the limits: a warning (rows.py)
            problems.append(_error(f"relative L2 error {row['rel_l2']:.4f} exceeds {row['threshold']} for {m.format}", tensor=m.name))
        elif row["module_limits_judged"] and not row["gain_ok"]:
            problems.append(_error(gain_message(row), tensor=m.name))
        problems += row_problems(row, m.name, n) + grid_problems(row, m.name)
    return rows, problems + unchecked_note(rows)


def _error_row(m: Module, src, requantized: bool = False, unchecked: str | None = None) -> dict:
    """The error row of one quantized module against its reference weight ``src``: relative L2, max abs, SNR (dB).

    A 2:4 sparse module (``sparse-24-bitmask``, ``marlin-24``) is judged against the reference pruned 2:4 by verify
    itself (:func:`ctconvert.formats.sparse24.prune24`: compressed-tensors 0.14's magnitude rule), with the format's
    limit (exact, 0, for dense 2:4 values, which are the pruned weight itself); its error against the dense reference,
    the pruning's own, is reported beside it (``rel_l2_dense``, ``max_abs_dense``, ``snr_db_dense``), not judged."""
    sparse = str(m.format).startswith(SPARSE_PREFIX) or m.format == CompressionFormat.MARLIN_24
    sums = {"pruned": [0.0] * 5, "dense": [0.0] * 5}  # squared error, squared reference, max abs, <got, ref>, sum ref^4
    gs = float(read_tensor(m.parts["weight_global_scale"]).float().reshape(-1)[0]) if "weight_global_scale" in m.parts else None
    per_row = RowErrors(get_format(m.format), WeightArgs.from_dict(m.weights), src.torch_dtype if src.torch_dtype.is_floating_point else torch.bfloat16, gs)
    grid = GridCheck(m, unchecked)  # every value the nearest to its reference over its scale (checkpoint/grid.py)
    per_row.rounded_elsewhere = bool(unchecked)  # requantized from another quantized checkpoint: zero-row errors say it may have zeroed them
    for r0, r1, got in dense_row_chunks(m, CHUNK):
        dense = read_rows(src, r0, r1)
        wants = {"dense": dense.float()}
        if sparse:
            wants["pruned"] = prune24(dense).float()
        grid.add(r0, r1, wants["pruned" if sparse else "dense"])
        got, wants = widened(got.float(), wants)
        for key, want in wants.items():
            add_error_sums(sums[key], got, want)
        per_row.add(r0, got, wants["pruned" if sparse else "dense"])
    stats = {key: error_stats(*acc[:3]) for key, acc in sums.items()}
    rel, mx, snr = stats["pruned" if sparse else "dense"]
    limit = 0.0 if m.format == SPARSE_PREFIX else error_threshold(m.weights or {})
    judged = sums["pruned" if sparse else "dense"]
    gain = judged[3] / judged[1] if judged[1] > 0 else 1.0
    row = {"module": m.name, "format": m.format, "rel_l2": rel, "max_abs": mx, "snr_db": snr, "threshold": limit, "gain": gain}
    limit_gain = gain_limit(m.format, rel, requantized, effective_values(judged))
    row.update(gain_limit=limit_gain, gain_ok=abs(gain - 1) <= limit_gain, row_threshold=row_limit(m.weights or {}, requantized), **per_row.result())
    row.update(rows_ok=rows_ok(row), **grid.result())
    row["ok"] = (not row["module_limits_judged"] or rel <= limit and row["gain_ok"]) and row["rows_ok"] and row["grid_ok"]
    if sparse:
        rel_d, mx_d, snr_d = stats["dense"]
        row.update(against="2:4-pruned reference", rel_l2_dense=rel_d, max_abs_dense=mx_d, snr_db_dense=snr_d)
    return row


def _all_zero_problems(mods: dict[str, Module], ckpt: Checkpoint) -> list[Problem]:
    """Without a reference: a warning for each quantized module whose every value dequantizes to zero
    (found from its scales first: only modules whose every scale is the format's zero-scale substitute
    are dequantized, :func:`ctconvert.pipeline.zeros.candidate_rows`)."""
    out = []
    cfg_dtype = getattr(torch, str(ckpt.config.get("torch_dtype") or ckpt.config.get("dtype") or "bfloat16"), torch.bfloat16)
    for m in sorted(mods.values(), key=lambda m: natural_key(m.name)):
        fmt = get_format(m.format) if m.quantized and m.group is not None else None
        scale = m.parts.get("weight_scale")
        if fmt is None or scale is None:
            continue
        s = read_tensor(scale)
        dtype = s.dtype if s.dtype in (torch.bfloat16, torch.float16, torch.float32) else cfg_dtype
        try:
            n, _ = dense_shape(m)
            cand = candidate_rows({"weight_scale": s}, fmt, WeightArgs.from_dict(m.weights), dtype, n)
            if cand is None or not bool(cand.all()) or any(bool(got.any()) for _, _, got in dense_row_chunks(m, CHUNK)):
                continue
        except (ValueError, KeyError, RuntimeError):
            continue  # a module that cannot be read is reported by the structure checks
        why = "every quantized value is zero: the source was all zero, or too small for the format (compare with --reference)"
        out.append(Problem("warning", why, None, m.name))
    return out


# -- kernel-native ------------------------------------------------------------------------------


def _verify_kernel_native(ckpt: Checkpoint, path: Path, reference: str | Path | None) -> dict:
    """Round trip of every kernel-native module: invert, re-apply, compare bit for bit; with a reference
    (the compressed-tensors source), the inverse must equal it bit for bit."""
    problems: list[Problem] = list(ckpt.problems)
    q = ckpt.quantization_config
    ref = open_checkpoint(reference, strict=True) if reference is not None else None
    if ref is not None and (ref.quantization_config or {}).get("quant_method") != "compressed-tensors":
        raise UsageError(
            "a kernel-native checkpoint is verified against its compressed-tensors source (the checkpoint "
            "`repack` read or `quantize` would write), not a dense one; or verify "
            "`repack --target compressed-tensors` of it against the dense model",
            file=reference,
        )
    src_cfg = q.get("source_quantization_config") or {}
    rows = []
    ref_parts: dict[str, set[str]] = {}  # reference module -> its tensors' local names
    for n in ref.tensors if ref is not None else ():
        mod, _, part = n.rpartition(".")
        ref_parts.setdefault(mod, set()).add(part)
    inverted: set[str] = set()  # the reference tensors an inverse stands for
    for mod, rec in (q.get("modules") or {}).items():
        try:
            stored = {p: read_tensor(ckpt.tensors[f"{mod}.{p}"]) for p in rec["tensors"]}
            back, again = _round_trip(stored, rec, mod, src_cfg, q)
        except (KeyError, ValueError) as e:
            problems.append(_error(f"cannot invert: {e}", tensor=mod))
            continue
        same = all(_bits_equal(again[p], stored[p]) for p in stored)
        if not same:
            problems.append(_error("round trip (invert, then repack) does not give the stored bytes", tensor=mod))
        if lost := sorted(set(rec.get("source_tensors") or {}) - set(back)):  # the inverse must give every recorded source tensor
            same = False
            problems.append(_error(f"the inverse lacks {', '.join(lost)} (recorded as source tensors)", tensor=mod))
        ref_ok = None if ref is None else _equals_reference(back, ref, mod, problems, ref_parts.get(mod, set()))
        inverted.update(f"{mod}.{p}" for p in back)
        rows.append({"module": mod, "kernel": rec["kernel"], "round_trip": same, "equals_reference": ref_ok})
    checks = ["folder (index, shards, duplicates)", "round trip of every kernel-native module (invert, repack, same bytes)"]
    if ref is not None:
        problems += _kernel_native_others(ckpt, q, ref, inverted) + reference_problems(ckpt, ref)
        checks += [_FILES_CHECK, "inverse equals the compressed-tensors reference, bit for bit", "every other tensor equals the reference, none missing"]
    return _report(path, reference, problems, [], modules=rows, checked=_checked(ckpt, checks, len(rows)))


def _kernel_native_others(ckpt: Checkpoint, q: dict, ref: Checkpoint, inverted: set[str]) -> list[Problem]:
    """Conservation of a kernel-native checkpoint against its compressed-tensors source: every reference tensor
    that no module's inverse stands for (``inverted``: biases, norms, embeddings, activation scales a record does
    not hold ...) is stored under its name with the reference's bytes, and every stored tensor that no module
    record holds comes from the reference."""
    stored = {f"{mod}.{p}" for mod, rec in (q.get("modules") or {}).items() for p in rec.get("tensors", [])}
    out = []
    missing = [n for n in ref.tensors if n not in inverted and n not in ckpt.tensors]
    out += [_error("tensor of the reference is missing from the output (not in any module's inverse either)", tensor=n) for n in missing]
    for name, info in ckpt.tensors.items():
        if name in stored:
            continue
        s = ref.tensors.get(name)
        if s is None:
            out.append(_error("tensor not in the reference and not a tensor of any kernel-native module", tensor=name))
        elif s.dtype != info.dtype or s.shape != info.shape or not same_bytes(info, s):
            out.append(_error("differs from the reference (a pass-through tensor was changed)", tensor=name))
    return out


def _round_trip(stored: dict, rec: dict, mod: str, src_cfg: dict, q: dict):
    """``(inverse, inverse repacked again)`` of one kernel-native module."""
    back = kernels.unrepack_module(stored, rec)
    groups = src_cfg.get("config_groups") or {}
    g = groups.get(resolve_group(mod, src_cfg, True), next(iter(groups.values()), {}) if groups else {})
    again, _ = kernels.repack_module(rec["kernel"], back, g.get("weights") or {}, rec["layout_version"], getattr(torch, q.get("act_dtype", "bfloat16")))
    return back, again


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _equals_reference(back: dict, ref: Checkpoint, mod: str, problems: list[Problem], parts: set[str]) -> bool:
    if lost := sorted(parts - set(back)):
        problems.append(_error(f"the inverse lacks {', '.join(lost)} of the reference", tensor=mod))
        return False
    for p, t in back.items():
        r = ref.tensors.get(f"{mod}.{p}")
        if r is None or r.dtype != TORCH_TO_ST[t.dtype] or tuple(r.shape) != tuple(t.shape) or not _bits_equal(read_tensor(r), t):
            problems.append(_error(f"inverse of {p} differs from the reference", tensor=mod))
            return False
    return True
