"""The Python API: what the CLI calls and what pipelines import.

>>> from ctconvert import api
>>> result = api.quantize("model/", "out/", "W4A16")          # doctest: +SKIP
>>> report = api.inspect("out/")                               # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .checkpoint.hashing import HASH_NAME, hash_tensor_bytes, new_hasher
from .checkpoint.reader import INDEX_NAME
from .checkpoint.writer import shard_names
from .errors import OutputError, UnsupportedError, UsageError

from .checkpoint.config import build_quantization_config, updated_config
from .checkpoint.reader import CONFIG_NAME, open_checkpoint
from .checkpoint.safetensors_io import PlannedTensor
from .checkpoint.writer import OutputFolder, assign_shards, check_output_path, parse_size
from .inspect import inspect_checkpoint
from .pipeline import DEFAULT_CHUNK_ELEMS, DEFAULT_HOLD_BYTES, ExecOptions, execute, resolve_devices
from .plan import Plan, make_plan


@dataclass
class QuantizeResult:
    """What a conversion did (``to_dict`` is the ``--json`` document)."""

    output: str | None
    scheme: str
    format: str
    dry_run: bool
    input_bytes: int
    output_bytes: int = 0
    seconds: float = 0.0
    shards: list[str] = field(default_factory=list)
    quantized_modules: int = 0
    ignore: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"
    reused_shards: list[str] = field(default_factory=list)
    error: Exception | None = None  # dry run only: why the real run would stop
    rewritten_shards: list[str] = field(default_factory=list)
    plan: Plan | None = None

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("plan", "error")}
        if self.error is not None:
            d["error"] = str(self.error)
        if self.dry_run and self.plan is not None:
            d["plan"] = self.plan.to_dict()
        return d


def quantize(
    src: str | Path,
    out: str | Path | None,
    scheme: str,
    *,
    lm_head: str = "none",
    targets: list[str] | None = None,
    ignore: list[str] | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    dry_run: bool = False,
    skip_incompatible: bool = False,
    device: str = "auto",
    lm_head_chunk_rows: int = 8192,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    hold_bytes: int = DEFAULT_HOLD_BYTES,
    resume: bool = False,
    refresh: bool = False,
    progress=None,
    kernel_target=None,
) -> QuantizeResult:
    """Convert the dense checkpoint ``src`` to a compressed-tensors checkpoint at ``out``.

    ``scheme``: a compressed-tensors preset name (see :func:`ctconvert.schemes.scheme_names`).
    ``lm_head``: ``none`` | ``nvfp4a16`` | ``fp8``. ``targets``/``ignore``:
    compressed-tensors style names, ``re:`` patterns or ``Linear``.
    ``progress``: a callable ``(total_bytes) -> context manager with .update(n)``.
    ``device``: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``cuda:0,1`` or ``all``
    (several GPUs share the work by fused set and tensor). ``chunk_elems``:
    elements per row chunk; ``hold_bytes``: largest NVFP4 fused set read once
    and held until its global scale is known (larger sets are read twice).

    The plan (every tensor's fate) is made from the headers before any data is
    read; with ``dry_run`` nothing else happens. The output is written into a
    hidden folder and renamed into place only when complete. ``resume`` keeps
    the shards an interrupted run of the same command finished (checked by
    sha256); ``refresh`` re-derives, against an existing output, only the
    tensors whose source bytes changed and rewrites only their shards. Every
    output records per-tensor provenance in ``ctconvert-provenance.json``.
    ``kernel_target`` (a :class:`ctconvert.repack.KernelTarget`; see
    :func:`quantize_to_target`) writes kernel-native layouts instead.

    Raises :class:`ctconvert.errors.CTConvertError` subclasses with one-line
    messages naming the file and tensor.
    """
    t0 = time.perf_counter()
    src = Path(src)
    shard_limit = parse_size(max_shard_size)
    devs = resolve_devices(device)
    ckpt = open_checkpoint(src, strict=True)
    plan_kw = dict(targets=targets, ignore=ignore, lm_head=lm_head, lm_head_chunk_rows=lm_head_chunk_rows)
    dry_error = None
    try:
        plan = make_plan(ckpt, scheme, skip_incompatible=skip_incompatible, **plan_kw)
    except UnsupportedError as e:
        if not dry_run or skip_incompatible:
            raise
        # a dry run still shows the whole plan, with the tensors the real run would stop at
        plan = make_plan(ckpt, scheme, skip_incompatible=True, **plan_kw)
        dry_error = e
    result = QuantizeResult(
        output=str(out) if out is not None else None, scheme=plan.scheme.name, format=plan.format, dry_run=dry_run,
        input_bytes=ckpt.total_bytes, quantized_modules=plan.quantized_modules, ignore=plan.ignore,
        notes=plan.notes, device=",".join(map(str, devs)), plan=plan,
    )
    if dry_run:
        result.seconds = time.perf_counter() - t0
        result.error = dry_error
        return result
    if out is None:
        raise UsageError("an output folder is required (-o/--output)")
    out = Path(out)
    options = {"scheme": plan.scheme.name, "lm_head": lm_head.lower(), "targets": targets or ["Linear"], "ignore": list(ignore or []),
               "max_shard_size": shard_limit, "skip_incompatible": skip_incompatible, "lm_head_chunk_rows": lm_head_chunk_rows}
    old_prov = None
    if refresh:
        old_prov = _load_provenance(out, options)
    else:
        check_output_path(src, out, overwrite)
    qconfig = build_quantization_config(plan.config_groups, plan.format, plan.ignore)
    if kernel_target is not None:
        if resume or refresh:
            raise UsageError("--target cannot be combined with --resume or --refresh")
        options["target"] = [kernel_target.target, kernel_target.layout_version, kernel_target.act_dtype]
        plan = kernel_target.plan(plan, ckpt, qconfig)
    planned = [PlannedTensor(n, d, s) for n, d, s in plan.output_tensors]
    assignment = assign_shards(planned, shard_limit)
    fingerprint = _fingerprint(ckpt, options, planned)
    folder = OutputFolder(out, overwrite=overwrite or refresh, fingerprint=fingerprint, resume=resume)
    keep_partial = False
    try:
        reuse_from = None
        units = plan.units
        known: dict[str, str] = {}  # source tensor -> content hash, computed already
        if old_prov is not None:
            reuse_from, units, result.rewritten_shards, known = _refresh_plan(ckpt, plan, assignment, out, old_prov)
        shards = folder.open_shards(assignment, reuse_from=reuse_from)
        if resume and getattr(folder, "discarded_partial", False):
            result.notes.append("--resume: the interrupted run used other inputs or options; starting over")
        done = folder.completed
        shard_of = folder.weight_map
        todo = [u for u in units if any(shard_of[o[0]] not in done for o in u.outputs)]
        hashes = {s: new_hasher() for u in todo for s in u.sources if s not in known}  # hashed as they stream by
        opts = ExecOptions(device=devs[0], chunk_elems=chunk_elems, hold_bytes=hold_bytes, hashes=hashes, post=kernel_target)
        run_plan = dataclasses.replace(plan, units=todo)
        keep_partial = kernel_target is None  # an interrupted run is kept for --resume, which --target does not offer
        if progress is not None:
            with progress(sum(ckpt.tensors[s].nbytes for u in todo for s in u.sources)) as bar:
                opts.progress = bar
                execute(ckpt, run_plan, shards, opts, devs)
        else:
            execute(ckpt, run_plan, shards, opts, devs)
        src_hashes = {**known, **{n: h.hexdigest() for n, h in hashes.items()}}
        for u in plan.units:  # units kept from an interrupted run: hash their sources now
            for s in u.sources:
                if s not in src_hashes:
                    src_hashes[s] = hash_tensor_bytes(ckpt.tensors[s])
        folder.copy_files(src, skip={CONFIG_NAME, PROVENANCE})
        total = sum(t.nbytes for t in planned)
        prov = _provenance(ckpt, plan, options, src_hashes)
        cfg = updated_config(ckpt.config, qconfig, plan.config_updates)
        if kernel_target is not None:
            cfg["quantization_config"] = kernel_target.config(cfg["quantization_config"])
        folder.finish(cfg, total, {PROVENANCE: prov})
        result.shards = sorted(set(folder.weight_map.values()))
        result.reused_shards = sorted(n for n, why in folder.reused.items() if why == "resume")
        folder.commit()
    except (KeyboardInterrupt, OutputError, OSError):
        folder.abort(keep=keep_partial)
        raise
    except BaseException:
        folder.abort()
        raise
    result.output_bytes = total
    result.seconds = time.perf_counter() - t0
    return result


PROVENANCE = "ctconvert-provenance.json"


def _fingerprint(ckpt, options: dict, planned: list[PlannedTensor]) -> str:
    """Identity of a run: ctconvert version, options, source files (name, size, mtime) and the output layout."""
    h = hashlib.sha256()
    h.update(json.dumps({"version": __version__, "options": options}, sort_keys=True).encode())
    for f in ckpt.files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for t in planned:
        h.update(f"{t.name}:{t.dtype}:{t.shape}".encode())
    return h.hexdigest()


def _provenance(ckpt, plan: Plan, options: dict, src_hashes: dict[str, str]) -> dict:
    """Per output tensor: the source tensors (file, name, content hash) it was derived from."""
    tensors = {}
    for u in plan.units:
        srcs = [{"file": ckpt.tensors[s].file.name, "tensor": s, HASH_NAME: src_hashes[s]} for s in u.sources]
        for name, _, _ in u.outputs:
            if u.kind == "quantize" and not (u.scheme.global_scale and u.fused):
                mod = name.rpartition(".")[0]
                srcs_t = [x for x, m in zip(srcs, u.modules) if m == mod] or srcs
            else:
                srcs_t = srcs
            tensors[name] = srcs_t
    return {"ctconvert": __version__, "hash": HASH_NAME, "source": str(ckpt.path), "options": options, "tensors": tensors}


def _load_provenance(out: Path, options: dict) -> dict:
    p = out / PROVENANCE
    if not p.is_file():
        raise UsageError("--refresh needs an earlier ctconvert output with ctconvert-provenance.json", file=out)
    prov = json.loads(p.read_text())
    if prov.get("options") != json.loads(json.dumps(options)):
        raise UsageError("--refresh needs the same options as the earlier conversion "
                         f"(earlier: {prov.get('options')}); run a full conversion with --overwrite instead", file=p)
    if prov.get("hash") != HASH_NAME:
        raise UsageError(f"earlier provenance uses {prov.get('hash')}, this install {HASH_NAME}; run a full conversion", file=p)
    prov["_hashes"] = {s["tensor"]: s[HASH_NAME] for srcs in prov["tensors"].values() for s in srcs}
    return prov


def _refresh_plan(ckpt, plan: Plan, assignment, out: Path, prov: dict):
    """Which shards of the earlier output can be reused, which units must run, which shards are
    rewritten, and the source hashes computed on the way."""
    old_index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    current: dict[str, str] = {}
    new_map = {t.name: name for name, ts in zip(shard_names(len(assignment)), assignment) for t in ts}
    if old_index != new_map:
        dirty = set(new_map.values())  # layout changed: everything is rewritten
    else:
        dirty = set()
        for u in plan.units:
            for s in u.sources:
                current[s] = hash_tensor_bytes(ckpt.tensors[s])
                if prov["_hashes"].get(s) != current[s]:
                    dirty.update(new_map[o[0]] for o in u.outputs)
                    break
    reuse = {name: out / name for name in set(new_map.values()) - dirty}
    units = [u for u in plan.units if any(new_map[o[0]] in dirty for o in u.outputs)]
    return reuse, units, sorted(dirty), current


def quantize_to_target(src, out, scheme: str, target: str, *, layout_version: str = "0.33", act_dtype: str = "bf16",
                       **kw) -> QuantizeResult:
    """``quantize`` straight into a kernel-native layout (``--target marlin|cutlass-nvfp4``), in one pass.

    Each module is repacked on the device right after it is quantized
    (:class:`ctconvert.repack.KernelTarget`); no compressed-tensors checkpoint is
    written on the way. The tensors and config equal ``quantize`` followed by ``repack``.
    Other keyword arguments are those of :func:`quantize` (not ``resume``/``refresh``).
    """
    from .repack import KernelTarget

    kt = KernelTarget(target, layout_version, act_dtype)
    res = quantize(src, out, scheme, kernel_target=kt, **kw)
    res.format = f"kernel-native ({target}, from {res.format})"
    if not res.dry_run:
        res.notes.append(f"repacked {len(kt.records)} modules for {target} (vLLM layout {layout_version})")
    return res


def verify(path: str | Path, reference: str | Path | None = None) -> dict:
    """Check a compressed-tensors checkpoint (and its error against ``reference``); see :mod:`ctconvert.verify`."""
    from .verify import verify as _verify

    return _verify(path, reference)


def decompress(src: str | Path, out: str | Path, *, dtype: str = "bf16", max_shard_size: str | int = "5GB", overwrite: bool = False) -> dict:
    """Write a dense copy of a compressed-tensors checkpoint; see :mod:`ctconvert.decompress`."""
    from .decompress import decompress as _decompress

    return _decompress(src, out, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)


def inspect(path: str | Path) -> dict:
    """Summarize a dense or compressed-tensors checkpoint; see :mod:`ctconvert.inspect`."""
    return inspect_checkpoint(Path(path))
