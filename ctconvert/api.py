"""The Python API: every command as a function; what the CLI calls and what pipelines import.

>>> from ctconvert import api
>>> result = api.quantize("model/", "out/", "W4A16")          # doctest: +SKIP
>>> report = api.inspect("out/")                               # doctest: +SKIP

Every function raises :class:`ctconvert.errors.CTConvertError` subclasses
with one-line messages naming the file and tensor; their ``exit_code`` is the
CLI's. Knobs are keyword options; where an environment variable exists it
overrides the default (README "Environment").
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CTConvertError, UsageError
from .options import DEFAULT_ACT_DTYPE, DEFAULT_LAYOUT_VERSION, DEFAULT_SHARD_SIZE
from .options import api_doc as options_doc

if TYPE_CHECKING:  # at run time these come from __getattr__ (below), on first use
    from .checkpoint.kernel_native import KERNEL_NATIVE, is_kernel_native
    from .checkpoint.writer import finished_shards
    from .pipeline.options import QuantizeOptions
    from .plan.result import ConversionResult
    from .plan.result import ConversionResult as QuantizeResult
    from .sources import Source

# The engine (torch, the commands) is imported by the function that needs it, so that ``import ctconvert.api``
# and the commands that need no tensors (``schemes``) start in a fraction of a second; :func:`preload` imports it
# all at once (the console script does, before a command that needs it).

__all__ = [
    "KERNEL_NATIVE",
    "ConversionResult",
    "QuantizeOptions",
    "QuantizeResult",
    "batch",
    "convert",
    "decompress",
    "finished_shards",
    "inspect",
    "is_kernel_native",
    "load_jobs",
    "preload",
    "quantize",
    "quantize_to_target",
    "repack",
    "run_jobs",
    "schemes",
    "verify",
]


def quantize(src: str | Path, out: str | Path | None, scheme: str, *, options: QuantizeOptions | None = None, progress=None, **kw) -> QuantizeResult:
    """Convert the checkpoint ``src`` to a compressed-tensors checkpoint at ``out``.

    ``src`` may be dense or already quantized (compressed-tensors, Hugging Face FP8 block, ModelOpt
    NVFP4, AutoAWQ, GPTQ: :mod:`ctconvert.sources`): a quantized input is dequantized on the
    fly and requantized; when ``scheme`` is the source's own format (AWQ -> ``W4A16_ASYM`` ...), it is
    converted losslessly instead (:func:`convert`; ``lm_head``, ``targets``, ``ignore``, ``resume`` and
    ``refresh`` are then refused).

    The keyword options are the fields of :class:`QuantizeOptions` (their defaults are its own); give
    them one by one, or as ``options`` (a :class:`QuantizeOptions`, which ``kw`` then amends). An
    unknown keyword raises :class:`TypeError` naming it.

    Args:
        scheme: a compressed-tensors preset name (:func:`schemes`), or the path of a ``.json``/``.yaml``
            file holding a compressed-tensors ``QuantizationScheme`` (a preset, or W4A16/W8A16 with
            another ``group_size``/``symmetric``); None with ``recipe`` (an llm-compressor recipe file, whose
            config groups say each module's scheme).
        progress: a callable ``(total_bytes) -> context manager with .update(n)``; one that also takes
            keywords ``unit`` and ``desc`` is called for calibration too, as ``(layers, unit="layer",
            desc="calibrate (N x L tokens)")``, and told each decoder layer calibrated (``update(1)``); the two
            bars may be open at once (calibration runs beside the conversion), each updated from one thread.
        **kw: the options, each one of :data:`ctconvert.options.OPTIONS`:
            {options}

    A quantized tensor whose values all quantize to zero while its source does not (rows of
    fp16 values below the format's smallest scale, for instance) is named in the notes and in
    ``result.zero_quantized``; the bytes are compressed-tensors' own.

    Returns:
        A :class:`QuantizeResult` (``to_dict()`` is the ``--json`` document).

    The plan (every tensor's fate) is made from the headers before any data is
    read; with ``dry_run`` nothing else happens. The output is written into a
    hidden folder and renamed into place only when complete. Every output
    records per-tensor provenance in ``ctconvert-provenance.json``.

    Example::

        r = api.quantize("llama/", "llama-w4a16/", "W4A16", lm_head="fp8")
        print(r.quantized_modules, r.output_bytes)
    """
    from .commands import convert as _convert
    from .commands import quantize as _quantize
    from .pipeline.options import QuantizeOptions

    o = QuantizeOptions.from_kwargs(options, **kw)
    plain = o.group_size is None and o.symmetric is None and o.target is None and o.recipe is None
    source = _opened(src)
    lossless, why = source.lossless_scheme(scheme) if plain and source is not None else (False, None)
    if lossless:
        changed = {
            "lm_head": o.lm_head != "none",
            "targets": bool(o.targets),
            "ignore": bool(o.ignore),
            "resume": o.resume,
            "refresh": o.refresh,
            "tp": o.tp > 1,
            "ep": o.ep is not None,
            "dense_dtype": o.dense_dtype != "keep",
        }
        if any(changed.values()):
            given = ", ".join(f"--{k.replace('_', '-')}" for k, v in changed.items() if v)
            raise UsageError(f"{scheme} is the source's own format: quantize converts it losslessly, which takes no {given}")
        res = _convert.convert(source, out, scheme=scheme, max_shard_size=o.max_shard_size, overwrite=o.overwrite, dry_run=o.dry_run)
        res.notes = [f"lossless conversion of the {res.source_format} source (ctconvert convert): every dequantized value equals the source's", *res.notes]
        return res
    res = _quantize.quantize(source if source is not None else src, out, scheme, o, progress=progress)
    if why is not None:
        res.notes.append(f"not converted losslessly ({why}): requantized")
    return res


def _opened(src: str | Path) -> Source | None:
    """``src`` opened as :func:`quantize` reads it, once for the lossless-or-requantize choice and the run; None when
    it cannot be (not a checkpoint folder, or not one it reads): the command then says so in its own words, after
    the checks it makes first (scheme, shard size, devices)."""
    from .checkpoint.reader import open_checkpoint
    from .sources import open_source

    try:
        return open_source(open_checkpoint(src, strict=True))
    except CTConvertError:
        return None


if quantize.__doc__:  # None under python -OO
    quantize.__doc__ = quantize.__doc__.replace("{options}", options_doc(indent=" " * 12).lstrip())


def convert(
    src: str | Path,
    out: str | Path | None,
    *,
    scheme: str | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    dry_run: bool = False,
):
    """Re-express a ModelOpt NVFP4, AutoAWQ GEMM or GPTQ checkpoint in compressed-tensors without rounding.

    ``scheme``: optional; the target is the source's own (``NVFP4`` or, dropping the input scales,
    ``NVFP4A16``; ``W4A16_ASYM`` for AWQ; ``W4A16``/``W8A16``/asymmetric for GPTQ), and another one
    is a :class:`UsageError`. Every dequantized value of the output equals the source's, bit for
    bit. Raises :class:`UnsupportedError` naming the tensor and the feature where compressed-tensors
    cannot express the source (act-order GPTQ, a sym checkpoint with other zero points, fused
    members with different NVFP4 global scales ...), :class:`BadInputError` for missing scales or
    inconsistent shapes; nothing is written then. Returns a :class:`ConversionResult` (``lossless`` set;
    ``to_dict()`` is the ``--json`` document).

    Example::

        api.convert("llama-awq/", "llama-w4a16-asym/")
        api.convert("llama-nvfp4-modelopt/", "llama-nvfp4a16/", scheme="NVFP4A16")
    """
    from .commands import convert as _convert

    return _convert.convert(src, out, scheme=scheme, max_shard_size=max_shard_size, overwrite=overwrite, dry_run=dry_run)


def quantize_to_target(
    src, out, scheme: str, target: str, *, layout_version: str = DEFAULT_LAYOUT_VERSION, act_dtype: str = DEFAULT_ACT_DTYPE, **kw
) -> QuantizeResult:
    """``quantize`` straight into a kernel-native layout (``--target marlin|cutlass-nvfp4``), in one pass.

    Each module is repacked on the device right after it is quantized; no
    compressed-tensors checkpoint is written on the way. The tensors and config
    equal ``quantize`` followed by ``repack``. Other keyword arguments are those
    of :func:`quantize` (not ``resume``/``refresh``); ``quantize(..., target=...)`` is the same call.

    Example::

        api.quantize_to_target("llama/", "llama-marlin/", "W4A16", "marlin")
    """
    return quantize(src, out, scheme, target=target, layout_version=layout_version, act_dtype=act_dtype, **kw)


def repack(
    src: str | Path,
    out: str | Path,
    target: str,
    *,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
    act_dtype: str = DEFAULT_ACT_DTYPE,
    device: str = "auto",
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress=None,
) -> dict:
    """Rewrite a compressed-tensors checkpoint in a kernel-native layout, or (``target="compressed-tensors"``) back.

    ``target``: ``marlin`` | ``cutlass-nvfp4`` | ``compressed-tensors``; ``layout_version``: the vLLM
    release whose layout to build (``0.21`` ... ``0.33``); ``act_dtype``: ``bf16`` | ``fp16``.
    Returns a summary dict (``output``, ``modules``, bytes, ``seconds``, ``device``). Raises
    :class:`UsageError` (unknown target or dtype), :class:`UnsupportedError` (a module the
    target kernel cannot take, or another tool's ``quant_method``), :class:`BadInputError` (a dense input).

    Example::

        api.repack("llama-w4a16/", "llama-marlin/", "marlin")
        api.repack("llama-marlin/", "back/", "compressed-tensors")   # bit for bit the source
    """
    from .commands import repack as _repack

    return _repack.repack(
        src,
        out,
        target,
        layout_version=layout_version,
        act_dtype=act_dtype,
        device=device,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=progress,
    )


def decompress(
    src: str | Path, out: str | Path, *, dtype: str | None = None, max_shard_size: str | int = DEFAULT_SHARD_SIZE, overwrite: bool = False, progress=None
) -> dict:
    """Write a dense copy of a compressed-tensors checkpoint, or of any other quantized source :func:`quantize`
    reads (Hugging Face FP8 block -> bf16 is exact; ModelOpt NVFP4, AutoAWQ, GPTQ).

    ``dtype`` (``bf16`` | ``fp16`` | ``fp32``): None (default) writes the dequantized weights in the
    model's own dtype (``config.json``'s ``torch_dtype``/``dtype``, else that of most stored floating bytes, else bf16) and keeps every other
    tensor's stored dtype; a dtype casts every floating-point tensor to it and sets it in ``config.json``.
    ``progress``: as for :func:`quantize` (told every output byte).

    Raises :class:`UnsupportedError` for formats or features it cannot dequantize (sparse
    formats, ``weight_g_idx`` act-order), :class:`BadInputError` for a dense input. Returns a summary dict; its
    ``left_out`` maps each input tensor not written (the KV cache's ``k_scale``/``v_scale``) to the reason.

    Example::

        api.decompress("llama-w4a16/", "llama-dense/")
    """
    from .commands import decompress as _decompress

    return _decompress.decompress(src, out, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, progress=progress)


def inspect(path: str | Path) -> dict:
    """Summarize a dense, compressed-tensors or kernel-native checkpoint from its headers (a JSON-ready dict).

    Problems are reported in ``problems`` (``severity`` ``error`` | ``warning``), not raised.

    Example::

        report = api.inspect("llama-w4a16/")
        report["totals"]["linear_bits_per_weight"]
    """
    from .commands import inspection as _inspection

    return _inspection.inspect_checkpoint(Path(path))


def verify(path: str | Path, reference: str | Path | None = None, *, tp: int = 1, ep: int | None = None, progress=None) -> dict:
    """Check a compressed-tensors (or kernel-native) checkpoint, and its error against ``reference``.

    ``reference``: the dense source, or a quantized one (any source :func:`quantize` reads), which is
    dequantized with its format's own math for the comparison (a requantized output).

    Returns the report; ``ok`` is the verdict, ``problems`` the findings, ``tensors`` the error rows,
    ``parallel`` the tensor-parallel plan (:mod:`ctconvert.plan.parallel`: the largest TP degree, and
    with ``tp > 1`` or ``ep`` an error for every tensor that does not split at that degree),
    ``summary`` (with a reference) the worst error row, ``checked`` what was looked at (shards, tensors,
    the checks by name). A dense checkpoint (a ``decompress`` output) with a dense ``reference`` is
    compared value by value. ``progress``: as for :func:`quantize` (the reference bytes compared).
    Raises :class:`BadInputError` for a dense checkpoint without ``reference`` (not a quantized one) and
    :class:`UnsupportedError` for another tool's ``quant_method`` (exit 3 and 4; a failed check is ``ok: False``).

    Example::

        assert api.verify("llama-w4a16/", reference="llama/")["ok"]
    """
    from .commands import verify as _verify

    return _verify.verify(path, reference, tp=tp, ep=ep, progress=progress)


def load_jobs(path: str | Path, emit=None) -> list[dict]:
    """Read and check a ``batch`` jobs file (YAML or JSON). Raises :class:`UsageError` naming the file and job;
    with ``emit``, a refused file is also reported there as an ``error`` JSON line and the summary line."""
    from .commands import batch as _batch

    return _batch.load_jobs(path, emit=emit)


def run_jobs(
    jobs: list[dict], keep_going: bool = False, emit=print, on_job=None, stop_code=None, executor=None, ray_address=None, ray_keep_workers=None
) -> int:
    """Run checked jobs (:func:`load_jobs`) through :func:`quantize` (a job's keys are its options, a
    ``target`` among them); ``emit`` gets one JSON line per job and a summary line, ``on_job(i, job)`` is called
    as each starts; ``stop_code()`` gives the exit code an interrupt is reported with (default 130);
    ``executor``/``ray_address``/``ray_keep_workers``: those options of every job that does not set them (``batch --executor ray``).
    Returns the exit code (0, or the first failure's)."""
    from .commands import batch as _batch

    return _batch.run_jobs(
        jobs,
        quantize,
        keep_going=keep_going,
        emit=emit,
        on_job=on_job,
        stop_code=stop_code,
        executor=executor,
        ray_address=ray_address,
        ray_keep_workers=ray_keep_workers,
    )


def batch(
    path: str | Path, keep_going: bool = False, emit=print, executor: str | None = None, ray_address: str | None = None, ray_keep_workers: int | None = None
) -> int:
    """``ctconvert batch``: :func:`load_jobs`, then :func:`run_jobs` (``executor``/``ray_address``/``ray_keep_workers``: as there).

    Example::

        code = api.batch("jobs.yaml", keep_going=True)
    """
    return run_jobs(load_jobs(path, emit=emit), keep_going=keep_going, emit=emit, executor=executor, ray_address=ray_address, ray_keep_workers=ray_keep_workers)


def schemes() -> list[dict]:
    """Every scheme with its aliases, compressed-tensors format and weight description.

    Example::

        [(s["name"], s["aliases"]) for s in api.schemes()]   # [('FP8_BLOCK', []), ..., ('W8A8', ['INT8'])]
    """
    from .commands import schemes as _schemes

    return _schemes.list_schemes()


def partial_hint(out: str | Path, batch: bool = False) -> str | None:
    """What an interrupted or failed ``quantize`` toward ``out`` left, and how to resume or remove it (None: nothing).
    ``batch``: advise the ``resume: true`` job key of a jobs file instead of ``--resume``."""
    from .commands import quantize as _quantize

    left = _engine("partial_output")(Path(out))
    return _quantize.partial_hint(left, batch=batch) if left else None


def preload() -> None:
    """Import the whole engine now (torch, every command) instead of at the first call that needs it.

    The console script calls it before a command that reads tensors, while stop signals are deferred
    (:mod:`ctconvert.__main__`: a Ctrl-C inside torch's import could be lost); a host program may call it to
    pay the import up front. Returns None; idempotent.

    Example::

        api.preload()   # the next api.quantize(...) starts without the import
    """
    from .commands import batch, convert, decompress, inspection, quantize, repack, verify  # noqa: F401

    globals().update(_engine_names())


#: public names of the engine's types, imported on first use (PEP 562)
_ENGINE_NAMES = ("KERNEL_NATIVE", "ConversionResult", "QuantizeOptions", "QuantizeResult", "Source", "finished_shards", "is_kernel_native", "partial_output")


def _engine_names() -> dict:
    from .checkpoint.kernel_native import KERNEL_NATIVE, is_kernel_native
    from .checkpoint.writer import finished_shards, partial_output
    from .pipeline.options import QuantizeOptions
    from .plan.result import ConversionResult
    from .sources import Source

    #: QuantizeResult: the result of :func:`quantize` (also :func:`quantize_to_target`, :func:`convert`): the one result type
    return {
        "KERNEL_NATIVE": KERNEL_NATIVE,
        "ConversionResult": ConversionResult,
        "QuantizeOptions": QuantizeOptions,
        "QuantizeResult": ConversionResult,
        "Source": Source,
        "finished_shards": finished_shards,
        "is_kernel_native": is_kernel_native,
        "partial_output": partial_output,
    }


def _engine(name: str):
    """This module's engine name ``name`` (:data:`_ENGINE_NAMES`): its global once loaded (or replaced by a host
    program or a test), else loaded now."""
    return globals()[name] if name in globals() else __getattr__(name)


def __getattr__(name: str):
    if name not in _ENGINE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    names = _engine_names()
    globals().update(names)
    return names[name]
