"""``ctconvert convert``: a checkpoint of another tool -> compressed-tensors, losslessly.

The values of ModelOpt NVFP4, AutoAWQ GEMM and GPTQ (without act-order)
checkpoints can be re-expressed in compressed-tensors without rounding:

- ModelOpt NVFP4 -> ``nvfp4-pack-quantized`` (``NVFP4`` with the source's
  ``input_scale`` as ``input_global_scale = 1 / input_scale``, as compressed-tensors
  0.20 ``converters/modelopt_nvfp4.py`` does; ``NVFP4A16`` without it): the E2M1
  bytes and E4M3 block scales are copied, and ``weight_global_scale`` is the fp32
  number that makes compressed-tensors' ``e2m1 * (scale / global)`` equal ModelOpt's
  ``e2m1 * (scale * weight_scale_2)`` for every code
  (:func:`ctconvert.formats.foreign.nvfp4_global_scale_for`);
- AutoAWQ GEMM -> ``pack-quantized`` int4 asymmetric (``W4A16_ASYM`` for group 128):
  ``q - 8`` and ``zero - 8`` in compressed-tensors' signed convention, scales transposed;
- GPTQ -> ``pack-quantized`` (``W4A16``/``W8A16`` for sym group 128, asymmetric
  otherwise), the v1 zero-point offset undone.

Whatever compressed-tensors cannot express is refused before anything is written,
naming the tensor and the feature: act-order GPTQ (``g_idx`` not ``k // group_size``;
compressed-tensors 0.19+ has no ``weight_g_idx``), a zero point other than
``2^(B-1)`` in a ``sym: true`` GPTQ checkpoint, a ModelOpt ``weight_scale_2`` no fp32
global scale matches, fused sets (q/k/v, gate/up) whose members have different
``weight_scale_2`` (vLLM keeps one global scale per fused layer; ``quantize --scheme NVFP4A16``
requantizes such a source, each fused set to one global scale). Streaming by row
chunks, written atomically like ``quantize``.

Reads top to bottom: open the source (or take the opened one) -> choose the target
(the source format's lossless conversion, :mod:`ctconvert.sources`) -> check every module ->
plan every output tensor (a dry run stops here) -> run the tasks -> config, provenance.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .. import __version__, options
from ..checkpoint.config import build_quantization_config, updated_config
from ..checkpoint.naming import is_generative, loader_patterns, tie_word_embeddings
from ..checkpoint.provenance import PROVENANCE, PROVENANCE_FORMAT
from ..checkpoint.reader import CONFIG_NAME, open_checkpoint
from ..checkpoint.shard_file import PlannedTensor
from ..checkpoint.writer import OutputFolder, assign_shards, check_output_path, parse_size
from ..errors import BadInputError, UnsupportedError, UsageError, agree, plural
from ..pipeline.tasks import Compute, CopyTensor, run_tasks
from ..plan.planner import Plan, TensorDecision
from ..plan.result import ConversionResult
from ..sources import SOURCE_CONFIG_FILES, GroupSpec, Source, SourceModule, open_source
from ..stages.plan import SourceChecks

__all__ = ["ConvertResult", "convert", "lossless_target"]

_CHUNK_ELEMS = 16 * 2**20

#: the result of a lossless conversion: the one result type of every conversion (``lossless`` set)
ConvertResult = ConversionResult


def lossless_target(source: Source, scheme: str | None = None) -> GroupSpec:
    """The compressed-tensors group that holds ``source``'s values exactly (:meth:`~ctconvert.sources.SourceFormat.lossless`),
    for the preset ``scheme`` (None: the source's own). Raises :class:`UnsupportedError` for a source no
    compressed-tensors format re-expresses (compressed-tensors itself, FP8 block), :class:`UsageError` for another scheme."""
    spec = source.format.lossless(source)
    if spec is None:
        what = source.format.no_lossless
        raise UnsupportedError(f"{what}: nothing to convert losslessly; requantize with ctconvert quantize --scheme", file=source.config_file)
    if scheme is None:
        return spec
    asked = source.format.lossless(source, scheme)
    if asked is None:
        fix = f"requantize with ctconvert quantize --scheme {scheme}"
        raise UsageError(f"the {source.kind} source converts losslessly to {spec.name} only, not {scheme!r}; {fix}")
    return asked


def convert(
    src: str | Path | Source,
    out: str | Path | None,
    *,
    scheme: str | None = None,
    max_shard_size: str | int = options.DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    dry_run: bool = False,
) -> ConversionResult:
    """Convert ``src`` (a path, or its opened :class:`~ctconvert.sources.Source`) losslessly to compressed-tensors
    at ``out``; see :func:`ctconvert.api.convert`."""
    t0 = time.perf_counter()
    source = src if isinstance(src, Source) else None
    src = source.original.path if source is not None else Path(src)
    shard_limit = parse_size(max_shard_size)
    if source is None:
        source = open_source(open_checkpoint(src, strict=True))
    if not source.quantized:
        raise BadInputError(
            "not a quantized checkpoint (config.json has no quantization_config): nothing to convert; `ctconvert quantize SRC -o OUT --scheme S` quantizes it",
            file=src / CONFIG_NAME,
        )
    spec = lossless_target(source, scheme)
    notes: list[str] = []
    extra = _check_modules(source, spec, notes)
    planned, tasks, rows, ignore = _plan(source, spec, extra)
    groups = {"group_0": (spec, ["Linear"])}
    plan = Plan(scheme=spec, units=[], rows=rows, ignore=ignore, config_groups=groups, config_updates={}, notes=notes, input_bytes=source.original.total_bytes)
    SourceChecks(source.view, plan, None).join()  # what verify fails the output for, found in the source's dense view: a warning
    result = ConversionResult(
        output=str(out) if out is not None else None,
        scheme=spec.name,
        format=spec.format,
        dry_run=dry_run,
        input_bytes=source.original.total_bytes,
        source_format=source.kind,
        lossless=True,
        quantized_modules=len(source.modules),
        ignore=ignore,
        notes=notes,
        plan=plan,
        warnings=plan.warnings,
    )
    if source.dropped:
        n = len(source.dropped)
        notes.append(f"{plural(n, 'activation/KV-cache scale tensor')} of the source {agree(n, 'is', 'are')} not carried over (action 'drop')")
    if dry_run:
        result.output_bytes = sum(t.nbytes for t in planned)
        result.seconds = time.perf_counter() - t0
        return result
    if out is None:
        raise UsageError("an output folder is required (-o/--output)")
    result.output_bytes = _write(source, Path(out), planned, tasks, plan, shard_limit, overwrite)
    result.shards = sorted({p.name for p in Path(out).glob("*.safetensors")})
    result.seconds = time.perf_counter() - t0
    return result


def _write(source: Source, out: Path, planned: list[PlannedTensor], tasks: list, plan: Plan, shard_limit: int, overwrite: bool) -> int:
    """Write the planned tensors, the config and the provenance into ``out`` (atomically); returns the bytes written."""
    src = source.original.path
    check_output_path(src, out, overwrite)
    qconfig = build_quantization_config(plan.config_groups, plan.scheme.format, plan.ignore)

    prov = {
        "ctconvert": __version__,
        "source": os.path.normpath(os.path.abspath(src)),  # absolute and normalised, as derived_from's path
        "provenance_format": PROVENANCE_FORMAT,  # (no hashes here: the format says that the index lists its records)
        "conversion": "lossless",
        "derived_from": source.derived_from(),
        "tensors": {r.name: r.source for r in plan.rows if r.action == "convert"},
    }
    total = sum(t.nbytes for t in planned)
    with OutputFolder(out, overwrite=overwrite) as folder:
        run_tasks(tasks, folder.open_shards(assign_shards(planned, shard_limit)))
        folder.copy_files(src, skip={CONFIG_NAME, PROVENANCE, *SOURCE_CONFIG_FILES})
        folder.finish(updated_config(source.view.config, qconfig, {}), total, {PROVENANCE: prov})
    return total


def _check_modules(source: Source, spec: GroupSpec, notes: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Refuse what compressed-tensors cannot express (naming the tensor and the feature); returns the
    whole-module tensors computed by the format (NVFP4 global scales, input global scales) by module."""
    for m in source.modules.values():
        if (problem := m.ct_problem()) is not None:
            raise UnsupportedError(problem, file=str(m.anchor.file), tensor=m.anchor.name)
    return source.format.lossless_tensors(source, spec, notes)


def _plan(source: Source, spec: GroupSpec, extra: dict):
    """Output tensors, tasks, plan rows and ``ignore``: each quantized module becomes its compressed-tensors
    tensors, every other stored tensor is copied, the source's activation/KV scales are dropped."""
    view = source.view
    planned: list[PlannedTensor] = []
    tasks: list = []
    rows: list[TensorDecision] = []
    with_inputs = spec.inputs is not None
    for name in sorted(view.tensors, key=lambda n: (str(view.tensors[n].file), view.tensors[n].start)):
        info = view.tensors[name]
        if info.virtual is None:
            planned.append(PlannedTensor(name, info.dtype, info.shape))
            tasks.append(CopyTensor(info))
            rows.append(TensorDecision(name, info.file.name, info.dtype, info.shape, "copy"))
            continue
        m = info.virtual.mod
        outs = m.ct_outputs(with_inputs)
        planned += [PlannedTensor(f"{m.name}.{p}", dt, shape) for p, (dt, shape) in outs.items()]
        tasks.append(Compute(lambda m=m, outs=outs: _module_tensors(m, outs, extra.get(m.name, {}))))
        rows.append(TensorDecision(name, info.file.name, info.dtype, info.shape, "convert", scheme=spec.name, source=m.label))
    for name, why in source.dropped.items():
        info = source.original.tensors[name]
        rows.append(TensorDecision(name, info.file.name, info.dtype, info.shape, "drop", reason=why))
    for m in source.modules.values():
        if "input_scale" in m.parts and not with_inputs:
            i = m.parts["input_scale"]
            why = "input scale (the NVFP4A16 target has no activation quantization)"
            rows.append(TensorDecision(i.name, i.file.name, i.dtype, i.shape, "drop", reason=why))
    ignore = list(source.dense_linear)
    if "lm_head.weight" not in view.tensors and "lm_head" not in ignore and tie_word_embeddings(view.config) and is_generative(view.config):
        ignore.append("lm_head")  # the model builds an lm_head Linear from the tied embedding
    linear = set(ignore) | set(source.modules)
    ignore += [p for p in loader_patterns(ignore, linear, view.config) if p not in ignore]
    return planned, tasks, rows, ignore


def _module_tensors(m: SourceModule, outs: dict, whole: dict[str, torch.Tensor]):
    """Yield ``(name, tensor, byte offset)`` of one module's compressed-tensors tensors, by row chunks."""
    n, k = m.shape
    step = max(128, (_CHUNK_ELEMS // max(1, k)) // 128 * 128)
    pos: dict[str, int] = {}
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        try:
            parts = m.ct_rows(r0, r1)
        except ValueError as e:
            raise UnsupportedError(f"{e}: compressed-tensors' symmetric format cannot express it", file=str(m.anchor.file), tensor=m.anchor.name) from e
        for p, t in parts.items():
            _check_finite(m, p, t)
            yield f"{m.name}.{p}", t, pos.get(p, 0)
            pos[p] = pos.get(p, 0) + t.numel() * t.element_size()
    if "weight_shape" in outs:
        yield f"{m.name}.weight_shape", torch.tensor([n, k], dtype=torch.int64), 0
    for p, t in whole.items():
        if p in outs:
            yield f"{m.name}.{p}", t.to(torch.float32), 0


def _check_finite(m: SourceModule, part: str, t: torch.Tensor) -> None:
    """No NaN/inf scale is written (an E4M3 NaN byte is 0x7F/0xFF)."""
    if part != "weight_scale":
        return
    bad = ((t.view(torch.uint8) & 0x7F) == 0x7F).any() if t.dtype == torch.float8_e4m3fn else ~torch.isfinite(t).all()
    if bool(bad):
        info = m.parts.get("weight_scale") or m.parts.get("scales")
        raise BadInputError("scales hold NaN/inf; refusing to convert", file=str(info.file), tensor=info.name)
