"""The Python API: what the CLI calls and what pipelines import.

>>> from ctconvert import api
>>> result = api.quantize("model/", "out/", "W4A16")          # doctest: +SKIP
>>> report = api.inspect("out/")                               # doctest: +SKIP
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint.config import build_quantization_config, updated_config
from .checkpoint.reader import CONFIG_NAME, open_checkpoint
from .checkpoint.safetensors_io import PlannedTensor
from .checkpoint.writer import OutputFolder, assign_shards, check_output_path, parse_size
from .inspect import inspect_checkpoint
from .pipeline import DEFAULT_CHUNK_ELEMS, ExecOptions, execute, resolve_devices
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
    plan: Plan | None = None

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "plan"}
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
    progress=None,
) -> QuantizeResult:
    """Convert the dense checkpoint ``src`` to a compressed-tensors checkpoint at ``out``.

    ``scheme``: a compressed-tensors preset name (see :func:`ctconvert.schemes.scheme_names`).
    ``lm_head``: ``none`` | ``nvfp4a16`` | ``fp8``. ``targets``/``ignore``:
    compressed-tensors style names, ``re:`` patterns or ``Linear``.
    ``progress``: a callable ``(total_bytes) -> context manager with .update(n)``.
    ``device``: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``cuda:0,1`` or ``all``
    (several GPUs share the work by fused set and tensor).

    The plan (every tensor's fate) is made from the headers before any data is
    read; with ``dry_run`` nothing else happens. The output is written into a
    temporary folder and renamed into place only when complete.

    Raises :class:`ctconvert.errors.CTConvertError` subclasses with one-line
    messages naming the file and tensor.
    """
    t0 = time.perf_counter()
    src = Path(src)
    shard_limit = parse_size(max_shard_size)
    devs = resolve_devices(device)
    ckpt = open_checkpoint(src, strict=True)
    plan = make_plan(
        ckpt, scheme, targets=targets, ignore=ignore, lm_head=lm_head,
        lm_head_chunk_rows=lm_head_chunk_rows, skip_incompatible=skip_incompatible,
    )
    result = QuantizeResult(
        output=str(out) if out is not None else None, scheme=plan.scheme.name, format=plan.format, dry_run=dry_run,
        input_bytes=ckpt.total_bytes, quantized_modules=plan.quantized_modules, ignore=plan.ignore,
        notes=plan.notes, device=",".join(map(str, devs)), plan=plan,
    )
    if dry_run:
        result.seconds = time.perf_counter() - t0
        return result
    if out is None:
        from .errors import UsageError

        raise UsageError("an output folder is required (-o/--output)")
    out = Path(out)
    check_output_path(src, out, overwrite)
    qconfig = build_quantization_config(plan.config_groups, plan.format, plan.ignore)
    planned = [PlannedTensor(n, d, s) for n, d, s in plan.output_tensors]
    folder = OutputFolder(out, overwrite=overwrite)
    try:
        shards = folder.open_shards(assign_shards(planned, shard_limit))
        opts = ExecOptions(device=devs[0], chunk_elems=chunk_elems)
        if progress is not None:
            with progress(ckpt.total_bytes) as bar:
                opts.progress = bar
                execute(ckpt, plan, shards, opts, devs)
        else:
            execute(ckpt, plan, shards, opts, devs)
        folder.copy_files(src, skip={CONFIG_NAME})
        total = sum(t.nbytes for t in planned)
        folder.finish(updated_config(ckpt.config, qconfig, plan.config_updates), total)
        result.shards = sorted(set(folder.weight_map.values()))
        folder.commit()
    except BaseException:
        folder.abort()
        raise
    result.output_bytes = total
    result.seconds = time.perf_counter() - t0
    return result


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
