"""``ctconvert quantize``: a dense checkpoint -> a compressed-tensors (or kernel-native) checkpoint.

Reads top to bottom: open the checkpoint (headers only) -> plan every tensor
(:func:`ctconvert.plan.planner.make_plan`; a dry run stops here) -> with a
``--target``, plan the kernel layout -> open the output folder (hidden,
resumable) -> stream the work units through the executor while the source
bytes are hashed beside it (:class:`~ctconvert.checkpoint.hashing.SourceHashes`) -> copy the other files, write the config and provenance ->
rename into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from pathlib import Path

from ..calibration import apply as calibration
from ..calibration.data import load_tokens
from ..checkpoint.config import build_quantization_config, updated_config
from ..checkpoint.conformance import missing_fused_members
from ..checkpoint.hashing import SourceHashes, hash_tensors
from ..checkpoint.model_card import CARD, append_conversion_section, conversion_section
from ..checkpoint.naming import is_linear_weight
from ..checkpoint.provenance import PROVENANCE, fingerprint, load_provenance, provenance, refresh_plan, shard_map, sources_by_shard
from ..checkpoint.reader import CONFIG_NAME, Checkpoint, open_checkpoint
from ..checkpoint.safetensors_io import PlannedTensor
from ..checkpoint.writer import (
    OutputFolder,
    assign_shards,
    check_output_path,
    disk_full,
    free_space_problem,
    parse_size,
    partial_output,
    shard_names,
)
from ..errors import BadInputError, CTConvertError, OutputError, UnsupportedError, UsageError, agree, plural
from ..layouts.versions import DEFAULT_LAYOUT_VERSION
from ..pipeline.devices import resolve_devices
from ..pipeline.executor import ExecOptions, execute, map_input_default
from ..pipeline.memory import fix_mmap_threshold
from ..pipeline.options import QuantizeOptions
from ..pipeline.zeros import ZeroTracker
from ..plan.dense_dtype import apply_dense_dtype
from ..plan.kernel_targets import CT_FORMAT_TARGETS
from ..plan.parallel import parallel_report, plan_modules
from ..plan.planner import Plan, TensorDecision, make_plan
from ..plan.result import ConversionResult
from ..plan.schemes import resolve_scheme
from ..plan.sparsity import SparseScheme, sparse_config, sparsity_warning
from ..sources import SOURCE_CONFIG_FILES, Source, open_source
from ..stages.layout import LayoutStage

__all__ = ["QuantizeResult", "partial_hint", "quantize"]


#: what a conversion did: the one result type of every conversion (:mod:`ctconvert.plan.result`)
QuantizeResult = ConversionResult


def quantize(src: str | Path, out: str | Path | None, scheme: str, options: QuantizeOptions | None = None, *, progress=None) -> ConversionResult:
    """Convert ``src`` to ``out``; see :func:`ctconvert.api.quantize` for the options and errors.

    ``options``: a :class:`~ctconvert.pipeline.options.QuantizeOptions` (None: every default); with a
    ``target``, the kernel-native tensors are written in the same pass (``quantize --target``,
    :class:`ctconvert.plan.layout.LayoutStage`). ``progress``: ``(total_bytes) -> context manager with .update(n)``."""
    o = options if options is not None else QuantizeOptions()
    layout = LayoutStage(o.target, o.layout_version, o.act_dtype) if o.target is not None else None
    result = _quantize(src, out, scheme, o, progress, layout)
    if layout is not None:
        _describe_target(result, layout)
    return result


def _check_fused_sets(ckpt: Checkpoint) -> None:
    """Raise :class:`BadInputError` (exit 3) for a fused set with a member missing where other layers have it
    (:func:`ctconvert.checkpoint.conformance.missing_fused_members`), naming the file and the missing module."""
    linear = {n.removesuffix(".weight"): str(i.file) for n, i in ckpt.tensors.items() if is_linear_weight(n, i)}
    if found := missing_fused_members(linear, ckpt.config):
        p = found[0]
        more = f" (and {plural(len(found) - 1, 'other fused set')})" if len(found) > 1 else ""
        raise BadInputError(p.message + more, file=p.file, tensor=p.tensor)


def _describe_target(result: ConversionResult, layout: LayoutStage) -> None:
    """``--target``: the result's format names the kernel-native layout, and its notes how many modules it holds."""
    target = layout.target
    result.format = target if target in CT_FORMAT_TARGETS else f"kernel-native ({target}, from {result.format})"  # marlin-24: a compressed-tensors format
    if not result.dry_run and target in CT_FORMAT_TARGETS:
        result.notes.append(f"packed {plural(len(layout.records), 'module')} as {target}")
    elif not result.dry_run:
        result.notes.append(f"repacked {plural(len(layout.records), 'module')} for {target} (vLLM layout {layout.layout_version})")


def _quantize(src: str | Path, out: str | Path | None, scheme: str, o: QuantizeOptions, progress, layout: LayoutStage | None) -> ConversionResult:
    targets, ignore, refresh = _listed(o.targets), _listed(o.ignore), o.refresh
    t0 = time.perf_counter()
    source, src = (src, src.original.path) if isinstance(src, Source) else (None, Path(src))  # a path, or the Source api opened
    shard_limit = parse_size(o.max_shard_size)
    devs = resolve_devices(o.device)
    if not o.sparsity:
        scheme = resolve_scheme(scheme, o.group_size, o.symmetric)
    elif o.group_size is not None or o.symmetric is not None:
        raise UsageError("--group-size/--symmetric/--asymmetric cannot be combined with --sparsity (2:4 takes the presets as they are)")
    source = source if source is not None else open_source(open_checkpoint(src, strict=True))
    ckpt = source.view  # a quantized input is planned and read as its dequantized weights (requantize)
    _check_fused_sets(ckpt)
    plan_ignore = list(ignore or []) + [m for m in source.dense_linear if source.quantized]
    rules = dict(keep_unclassified=o.keep_unclassified, default_ignore=o.default_ignore, quantize_mtp=o.quantize_mtp)
    plan_kw = dict(targets=targets, ignore=plan_ignore or None, lm_head=o.lm_head, lm_head_chunk_rows=o.lm_head_chunk_rows, **rules)
    if o.sparsity:
        if o.lm_head.lower() != "none":  # its sparsity_config would claim the head as 2:4 for loaders
            raise UsageError("--lm-head cannot be combined with --sparsity: 2:4 is for the Linear layers of the blocks")
        plan_kw.update(sparsity=o.sparsity, sparsity_target=layout.target if layout is not None else None)
    plan, dry_error = _plan(ckpt, scheme, o.dry_run, o.skip_incompatible, plan_kw)
    apply_dense_dtype(plan, o.dense_dtype, ckpt.config)
    kv_cache = o.kv_cache.lower()
    calibration.add_outputs(plan, ckpt, kv_cache)
    calibrated = calibration.needs_calibration(plan, kv_cache)
    if plan.views:  # per-expert parts of fused 3-D experts: read as tensors of their own from here on
        ckpt = dataclasses.replace(ckpt, tensors={**ckpt.tensors, **plan.views})
    if calibrated:
        calibration.check_model(ckpt)
    if source.quantized:
        _describe_source(plan, source)
        fix_mmap_threshold()  # dequantized temporaries would otherwise fragment the heaps (pipeline/memory.py)
    result = ConversionResult.of_plan(plan, out, o.dry_run, source.original.total_bytes, devs)
    if o.dry_run or o.tp > 1 or o.ep is not None:
        _parallel(result, plan, ckpt, layout, o.tp, o.ep)
    if (warning := sparsity_warning(plan.scheme, layout.target if layout is not None else None)) is not None:
        result.notes.append(warning)
    if calibrated:
        cost = calibration.estimate(plan, ckpt, o.calibration_samples, o.calibration_seq_len, kv_cache, o.calibration_batch_tokens)
        result.calibration = {**cost.to_dict(), "source": str(o.calibration) if o.calibration else "built-in English corpus"}
        if o.dry_run:
            result.notes += [cost.describe(), *filter(None, [calibration.attention_note(ckpt)])]
            data = _read_calibration_data(ckpt, result, o.calibration, o.calibration_samples, o.calibration_seq_len)
            dry_error = dry_error or (data if isinstance(data, CTConvertError) else None)
    elif o.dry_run:
        result.notes.append("no calibration needed (weights and dynamic activation scales only)")
    if o.dry_run:
        if layout is not None:  # the rows of the tensors --target sends through their module's kernel say so
            layout.mark_carried(plan)
        result.output_bytes = sum(PlannedTensor(*t).nbytes for t in plan.output_tensors)
        result.seconds = time.perf_counter() - t0
        result.error = dry_error
        return result
    if out is None:
        raise UsageError("an output folder is required (-o/--output)")
    out = Path(out)
    options = _run_options(plan, o.lm_head, targets, ignore, shard_limit, o.skip_incompatible, o.lm_head_chunk_rows)
    if o.sparsity:
        options["sparsity"] = o.sparsity
    changed = {**rules, "dense_dtype": o.dense_dtype}
    options.update({k: v for k, v in changed.items() if v != getattr(_DEFAULTS, k)})  # only where not the default: earlier outputs keep their fingerprint
    created = refresh and not out.exists()
    if created:  # "create or update": nothing to refresh yet, so a full conversion (every shard written)
        refresh = False
        result.notes.append(f"--refresh: no earlier output at {out}; converted in full")
    if calibrated:
        if refresh:
            raise UsageError("--refresh cannot update calibrated activation scales (they depend on every earlier layer): convert again")
        options["calibration"] = [str(o.calibration or ""), o.calibration_samples, o.calibration_seq_len, kv_cache]
    old_prov = load_provenance(out, options) if refresh else None
    if not refresh:
        check_output_path(src, out, o.overwrite)
    if calibrated:
        _calibrate(ckpt, plan, devs[0], result, o.calibration, o.calibration_samples, o.calibration_seq_len, kv_cache, o.calibration_batch_tokens, progress)
    qconfig = build_quantization_config(plan.config_groups, plan.format, plan.ignore)
    if isinstance(plan.scheme, SparseScheme):
        qconfig = sparse_config(qconfig, plan.scheme, targets or ["Linear"], plan.ignore)
    if kv_cache != "none":
        qconfig["kv_cache_scheme"] = calibration.kv_cache_config(kv_cache)
    if layout is not None:
        if o.resume or refresh:
            raise UsageError("--target cannot be combined with --resume or --refresh")
        options["target"] = [layout.target, layout.layout_version, layout.act_dtype]
        plan = layout.plan(plan, ckpt, qconfig)
    opts = ExecOptions(
        device=devs[0],
        chunk_elems=o.chunk_elems,
        hold_bytes=o.hold_bytes,
        repack=layout,
        impl=o.impl,
        map_input=map_input_default() if o.map_input is None else o.map_input,
        allow_nonfinite=o.allow_nonfinite,
        zeros=ZeroTracker(),
    )
    _convert(
        ckpt,
        plan,
        out,
        devs,
        opts,
        result,
        options=options,
        qconfig=qconfig,
        shard_limit=shard_limit,
        overwrite=o.overwrite,
        resume=o.resume,
        old_prov=old_prov,
        progress=progress,
        layout=layout,
        keep_other_weights=o.keep_other_weights,
        source=source,
    )
    if created:
        result.rewritten_shards = list(result.shards)
    result.seconds = time.perf_counter() - t0
    return result


def _parallel(result: ConversionResult, plan: Plan, ckpt: Checkpoint, layout: LayoutStage | None, tp: int, ep: int | None) -> None:
    """The tensor-parallel plan (:mod:`ctconvert.plan.parallel`); a real run notes the tensors that do not split at ``tp``
    and an uneven expert-parallel split at ``ep``."""
    kernel, version = (layout.target, layout.layout_version) if layout is not None else (None, DEFAULT_LAYOUT_VERSION)
    mods, result.parallel_of = plan_modules(plan, ckpt.tensors, kernel, version)
    try:
        result.parallel = report = parallel_report(mods, ckpt.config, tp, ep)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not result.dry_run and (not report.ok or report.uneven):
        result.notes.append(report.summary())


def _read_calibration_data(ckpt: Checkpoint, result: ConversionResult, file, samples: int, seq_len: int):
    """Read and tokenize the calibration data as the real run will (a dry run stops where it would stop: no
    tokenizer, too few tokens, ids outside the vocabulary); the data, or the error (returned, not raised)."""
    try:
        data = load_tokens(ckpt.path, file, samples, seq_len, (ckpt.config.get("text_config") or ckpt.config).get("vocab_size"))
    except CTConvertError as e:
        return e
    result.notes.append(f"calibration data: {data.source} ({data.kind}, {data.available} tokens; using {samples} x {seq_len})")
    return data


def _calibrate(
    ckpt: Checkpoint, plan: Plan, device, result: ConversionResult, file, samples: int, seq_len: int, kv_cache: str, batch_tokens: int, progress=None
) -> None:
    """Read the calibration tokens, run the model layer by layer, put the scales into the plan's units; with a
    ``progress`` factory that takes ``unit``/``desc`` keywords, one step per decoder layer."""
    t0 = time.perf_counter()
    data = _read_calibration_data(ckpt, result, file, samples, seq_len)
    if isinstance(data, CTConvertError):
        raise data
    layers = result.calibration["layers"]
    with _layer_progress(progress, layers, f"calibrate ({samples} x {seq_len} tokens)") as step:
        result.notes += calibration.run(plan, ckpt, data.tokens, device, kv_cache, batch_tokens, progress=step)
    result.calibration["seconds"] = round(time.perf_counter() - t0, 3)


@contextlib.contextmanager
def _layer_progress(progress, layers: int, desc: str):
    """``progress(layers, unit="layer", desc=desc)`` as a ``(layer, layers)`` callback (calibration's), or None
    when there is no factory or it takes only ``(total_bytes)`` (the API's older form: no calibration progress)."""
    if progress is None or not _takes_unit(progress) or layers < 1:
        yield None
        return
    with progress(layers, unit="layer", desc=desc) as bar:
        yield lambda done, total: bar.update(1)


def _takes_unit(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "unit" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _describe_source(plan: Plan, source: Source) -> None:
    """Requantize: every row says the source format it is dequantized from; the Linear layers dense in the
    source say so; the source's tensors that have no place in the output (its activation and KV-cache
    scales) are rows of their own (action ``drop``); the notes say what the output derives from."""
    dense = set(source.dense_linear)
    for row in plan.rows:
        row.source = source.format_of(row.name)
        module = row.name.removesuffix(".weight")
        if row.reason == f"--ignore {module}" and module in dense:
            row.reason = "dense in the source (its ignore carries over)"
    dropped = dict(source.dropped)
    for m in source.modules.values():  # a source's input scales travel with its modules (convert keeps them)
        if "input_scale" in m.parts:
            dropped[m.parts["input_scale"].name] = "activation scale of the source's quantization"
    for name, why in dropped.items():
        info = source.original.tensors[name]
        plan.rows.append(TensorDecision(name, info.file.name, info.dtype, info.shape, "drop", reason=why))
    labels = sorted({m.label for m in source.modules.values()})
    plan.notes.append(
        f"requantize: {plural(len(source.modules), 'quantized module')} of the {source.quant_method} source ({'; '.join(labels)}) "
        f"{agree(len(source.modules), 'is', 'are')} dequantized "
        f"on the fly with the source format's exact math and quantized again with {plan.scheme.name}; "
        f"verify --reference {source.original.path} measures the result against the dequantized source"
    )
    bits = min(_source_bits(m) for m in source.modules.values())
    if plan.scheme.num_bits > bits:
        plan.notes.append(
            f"the source holds {bits}-bit weights: {plan.scheme.name} ({plan.scheme.num_bits}-bit) cannot restore the precision they lack, "
            "and rounds them again (lossy twice)"
        )
    else:  # as many bits or fewer: another grid, so the dequantized values are rounded again as well
        plan.notes.append(
            f"the source holds {bits}-bit weights: {plan.scheme.name} rounds their dequantized values again onto its own grid "
            "(lossy twice: its error adds to the source's)"
        )
    if dropped:
        n = len(dropped)
        plan.notes.append(f"{plural(n, 'activation/KV-cache scale tensor')} of the source {agree(n, 'is', 'are')} not carried over (action 'drop')")


def _source_bits(m) -> int:
    if m.kind == "compressed-tensors":
        return int((m.args["module"].weights or {}).get("num_bits") or 8)
    return {"fp8-block": 8, "modelopt-nvfp4": 4}.get(m.kind) or int(m.args.get("bits", 4))


_DEFAULTS = QuantizeOptions()


def _listed(names: tuple[str, ...] | None) -> list[str] | None:
    return list(names) if names is not None else None


def _run_options(plan: Plan, lm_head, targets, ignore, shard_limit: int, skip_incompatible: bool, lm_head_chunk_rows: int) -> dict:
    """The options that define a run's output (its fingerprint, and what ``--refresh`` must match)."""
    return {
        "scheme": plan.scheme.name,
        "lm_head": lm_head.lower(),
        "targets": targets or ["Linear"],
        "ignore": list(ignore or []),
        "max_shard_size": shard_limit,
        "skip_incompatible": skip_incompatible,
        "lm_head_chunk_rows": lm_head_chunk_rows,
    }


def _plan(ckpt: Checkpoint, scheme: str, dry_run: bool, skip_incompatible: bool, plan_kw: dict):
    """The plan, and for a dry run the error the real run would stop at (the plan then shows every tensor)."""
    try:
        return make_plan(ckpt, scheme, skip_incompatible=skip_incompatible, **plan_kw), None
    except UnsupportedError as e:
        if skip_incompatible:
            raise
        try:
            plan = make_plan(ckpt, scheme, skip_incompatible=True, **plan_kw)
        except UnsupportedError as every:  # not one layer fits: --skip-incompatible (the first error's hint) would not help
            if not every.message.startswith("nothing to quantize"):
                raise e from None
            raise UnsupportedError(every.message.replace("--skip-incompatible kept", "--skip-incompatible would keep"), file=every.file) from None
        if not dry_run:
            raise
        stops = " (the run stops here: leave it dense with --ignore, or pass --skip-incompatible)"
        for row in plan.rows:  # say what this run would do, not what --skip-incompatible would
            if row.reason and row.reason.endswith(" (skipped: --skip-incompatible)"):
                row.reason = row.reason.removesuffix(" (skipped: --skip-incompatible)") + stops
        plan.notes[:] = [n.replace("; kept dense and listed in ignore", "; the run stops here unless --skip-incompatible") for n in plan.notes]
        return plan, e


def _convert(
    ckpt: Checkpoint,
    plan: Plan,
    out: Path,
    devs,
    opts: ExecOptions,
    result: ConversionResult,
    *,
    options: dict,
    qconfig: dict,
    shard_limit: int,
    overwrite: bool,
    resume: bool,
    old_prov: dict | None,
    progress,
    layout,
    keep_other_weights: bool = False,
    source: Source | None = None,
) -> None:
    """Write the output folder: shards (reused where ``--resume``/``--refresh`` allow), files, config, provenance."""
    planned = [PlannedTensor(n, d, s) for n, d, s in plan.output_tensors]
    assignment = assign_shards(planned, shard_limit)
    shard_of = shard_map(assignment)
    by_shard = sources_by_shard(plan.units, shard_of)
    known: dict[str, str] = {}  # source tensor -> content hash, computed already
    hashing: list[SourceHashes] = []  # the hashes of this run's sources, computed beside the executor

    def journaled_sources(shard: str) -> dict[str, str]:  # what a finished shard was made from (for --resume)
        return {s: known[s] if s in known else hashing[0].get(s) for s in sorted(by_shard.get(shard, ()))}

    folder = OutputFolder(
        out, overwrite=overwrite or old_prov is not None, fingerprint=fingerprint(ckpt, options, planned), resume=resume, shard_sources=journaled_sources
    )
    keep_partial = False
    try:
        reuse_from, units = None, plan.units
        if old_prov is not None:
            reuse_from, units, result.rewritten_shards, computed = refresh_plan(ckpt, plan.units, assignment, out, old_prov)
            known.update(computed)
        if resume:
            _drop_stale_shards(ckpt, folder, by_shard, known, result)
        _check_free_space(out, assignment, folder, reuse_from)
        shards = folder.open_shards(assignment, reuse_from=reuse_from)
        if resume and getattr(folder, "discarded_partial", False):
            result.notes.append("--resume: the interrupted run used other inputs or options; starting over")
        todo = [u for u in units if any(folder.weight_map[o[0]] not in folder.completed for o in u.outputs)]
        # every source not hashed yet, in the order the executor reads them (units kept from an interrupted run or by
        # --refresh last): block hashes on the hashing threads, off the executor's path
        todo_ids = {id(u) for u in todo}
        order = [s for u in todo for s in u.sources] + [s for u in plan.units if id(u) not in todo_ids for s in u.sources]
        hashing.append(SourceHashes([ckpt.tensors[s] for s in order if s not in known]))
        keep_partial = layout is None  # an interrupted run is kept for --resume, which --target does not offer
        _execute(ckpt, dataclasses.replace(plan, units=todo), shards, opts, devs, progress)
        result.notes += [f"{name}: holds non-finite values (NaN/inf); copied as it is (--allow-non-finite)" for name in opts.nonfinite]
        lost = opts.zeros.reports() if opts.zeros is not None else []
        result.notes += [z.note() for z in lost]
        result.zero_quantized = [z.to_dict() for z in lost]
        src_hashes = {**known, **hashing[0].all()}
        missing = [ckpt.tensors[s] for u in plan.units for s in u.sources if s not in src_hashes]
        src_hashes.update(hash_tensors(missing))
        quantized_source = source is not None and source.quantized
        skip = {CONFIG_NAME, PROVENANCE, *(SOURCE_CONFIG_FILES if quantized_source else ())}
        folder.copy_files(ckpt.path, skip=skip, keep_other_weights=keep_other_weights)
        cal, cal_file = result.calibration, (options.get("calibration") or [""])[0]  # the card names a calibration file, not its local path
        data = f"`{Path(cal_file).name}`" if cal_file else "ctconvert's built-in English corpus"
        calibrated_on = f"{data} ({cal['samples']} x {cal['seq_len']} tokens)" if cal else None
        derived = source.derived_from() if quantized_source else None
        section = conversion_section(
            ckpt.path, plan.scheme.name, plan.format, plan.ignore, options["lm_head"], layout.target if layout is not None else None, calibrated_on, derived
        )
        append_conversion_section(folder.tmp / CARD, section)
        if folder.skipped:
            result.notes.append(f"not copied, weights in other formats (--keep-other-weights copies them): {', '.join(folder.skipped)}")
        total = sum(t.nbytes for t in planned)
        cfg = updated_config(ckpt.config, qconfig, plan.config_updates)
        if layout is not None:
            cfg["quantization_config"] = layout.config(cfg["quantization_config"])
        prov = provenance(ckpt, plan.units, options, src_hashes, derived_from=derived)
        if casts := {r.name: r.cast for r in plan.rows if r.cast}:  # --dense-dtype: what inspect reports
            prov["cast"] = casts
        folder.finish(cfg, total, {PROVENANCE: prov})
        result.shards = sorted(set(folder.weight_map.values()))
        result.reused_shards = sorted(n for n, why in folder.reused.items() if why == "resume")
        folder.commit()
    except (KeyboardInterrupt, OutputError, OSError) as e:
        full = disk_full(e)
        folder.abort(keep=keep_partial and not full)  # a partial folder on a full disk only keeps it full
        if full:
            raise OutputError(f"{e}; the partial output was removed to free the disk", file=out) from e
        if isinstance(e, OutputError) and keep_partial and (left := partial_output(out)) is not None:
            raise OutputError(f"{e.message}; {partial_hint(left)}", file=e.file, tensor=e.tensor) from e
        raise
    except BaseException:
        folder.abort()
        raise
    result.output_bytes = total


def partial_hint(left: dict, batch: bool = False) -> str:
    """How to continue from, or remove, what an interrupted or failed run left (:func:`partial_output`).
    ``batch``: the run was a ``batch`` job, which has no ``--resume`` option but a ``resume: true`` job key."""
    size = f"{left['bytes'] / 2**20:.1f} MiB"
    if not left["shards"]:
        again = "run the batch again" if batch else "run the same command again"
        return f"partial data ({size}, no shard finished yet) is kept in {left['path']}: remove that folder, or {again}"
    how = "set `resume: true` on this job in the jobs file and run the batch again" if batch else "run the same command with --resume"
    done = plural(left["shards"], "finished shard")
    return f"partial data ({size}, {done}) is kept in {left['path']}: {how} to reuse the finished shards, or remove that folder"


def _drop_stale_shards(ckpt: Checkpoint, folder: OutputFolder, by_shard: dict, known: dict, result: ConversionResult) -> None:
    """``--resume``: hash the sources of every finished shard now, and write again each shard whose sources
    changed since it was made (or whose journal does not say what it was made from)."""
    stale = []
    done = sorted(folder.completed)
    known.update(hash_tensors([ckpt.tensors[s] for name in done for s in sorted(by_shard.get(name, ())) if s not in known]))  # in parallel
    for name in done:
        made_from = folder.journaled(name).get("sources")
        now = {s: known[s] for s in sorted(by_shard.get(name, ()))}
        if made_from != now:
            stale.append(name)
    if stale:
        folder.forget(stale)
        n = len(stale)
        result.notes.append(f"--resume: {plural(n, 'finished shard')} {agree(n, 'was', 'were')} made from source bytes that changed since; written again")


def _check_free_space(out: Path, assignment, folder: OutputFolder, reuse_from) -> None:
    """Refuse before writing when the disk cannot hold the shards still to write."""
    names = shard_names(len(assignment))
    kept = folder.completed | set(reuse_from or {})
    needed = sum(t.nbytes for name, ts in zip(names, assignment) if name not in kept for t in ts)
    if (problem := free_space_problem(out, needed)) is not None:
        raise OutputError(problem, file=out)


def _execute(ckpt: Checkpoint, plan: Plan, shards, opts: ExecOptions, devs, progress) -> None:
    if progress is None:
        execute(ckpt, plan, shards, opts, devs)
        return
    with progress(sum(ckpt.tensors[s].nbytes for u in plan.units for s in u.sources)) as bar:
        opts.progress = bar
        execute(ckpt, plan, shards, opts, devs)
