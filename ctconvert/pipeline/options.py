"""The options of one ``quantize`` run: one frozen record, the single source of their names and defaults.

The CLI (``ctconvert quantize``), the API (:func:`ctconvert.api.quantize` and
:func:`~ctconvert.api.quantize_to_target`), the command
(:func:`ctconvert.commands.quantize.quantize`) and ``batch`` jobs
(:data:`ctconvert.commands.batch.ALLOWED`, derived from :func:`job_keys`) all
read their option names and defaults from :class:`QuantizeOptions`.

It lives here, below ``commands/``, because two commands use it and commands
do not import each other, and not in ``plan/`` because some defaults belong to
the executor and calibration (:data:`~ctconvert.pipeline.executor.DEFAULT_CHUNK_ELEMS`,
:data:`~ctconvert.calibration.data.DEFAULT_SAMPLES`), which sit above ``plan/``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..calibration.data import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from ..errors import UsageError
from ..layouts.kernels import DEFAULT_LAYOUT_VERSION
from ..plan.dense_dtype import DENSE_DTYPES
from .executor import DEFAULT_CHUNK_ELEMS, DEFAULT_HOLD_BYTES

__all__ = ["QuantizeOptions", "job_keys"]


def _job(name: str) -> dict:
    """Field metadata: the key a ``batch`` job spells this option with (the CLI option's name)."""
    return {"job_key": name}


@dataclass(frozen=True)
class QuantizeOptions:
    """Every option of a ``quantize`` run but the source, the output, the scheme and the progress callback.

    See :func:`ctconvert.api.quantize` for what each does. ``targets``/``ignore`` are kept as tuples
    (``None``: the defaults). Build it with :meth:`from_kwargs` to have unknown names refused.
    """

    # what is quantized
    lm_head: str = "none"
    targets: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None
    skip_incompatible: bool = False
    keep_unclassified: bool = False
    default_ignore: bool = True
    quantize_mtp: bool = False
    sparsity: str | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    dense_dtype: str = "keep"  # the tensors that are not quantized: keep | bf16 | fp16 | fp32 (plan/dense_dtype.py)
    # calibration (schemes with static activation scales, --kv-cache)
    calibration: str | Path | None = None
    calibration_samples: int = DEFAULT_SAMPLES
    calibration_seq_len: int = DEFAULT_SEQ_LEN
    calibration_batch_tokens: int = 4096
    kv_cache: str = "none"
    # the output
    max_shard_size: str | int = "5GB"
    overwrite: bool = False
    dry_run: bool = False
    resume: bool = False
    refresh: bool = False
    keep_other_weights: bool = False
    allow_nonfinite: bool = field(default=False, metadata=_job("allow_non_finite"))
    # kernel-native layout (quantize --target)
    target: str | None = None
    layout_version: str = DEFAULT_LAYOUT_VERSION
    act_dtype: str = "bf16"
    # how it runs (the same bytes whatever these say)
    device: str = "auto"
    impl: str = "auto"
    lm_head_chunk_rows: int = 8192
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    hold_bytes: int = DEFAULT_HOLD_BYTES
    map_input: bool | None = None
    tp: int = 1
    ep: int | None = None

    def __post_init__(self):
        for name in ("targets", "ignore"):
            v = getattr(self, name)
            if isinstance(v, str):
                v = [v]
            if v is not None:
                object.__setattr__(self, name, tuple(v))
        dense = str(self.dense_dtype).lower()
        if dense not in DENSE_DTYPES:
            raise UsageError(f"unknown --dense-dtype {self.dense_dtype!r}; choose one of {', '.join(DENSE_DTYPES)}")
        object.__setattr__(self, "dense_dtype", dense)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's keyword name, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, base: QuantizeOptions | None = None, **kw) -> QuantizeOptions:
        """``base`` (default: every default) with the keyword options ``kw``. Raises :class:`TypeError`
        naming every unknown keyword (as a function with these keyword parameters would)."""
        unknown = sorted(set(kw) - set(cls.names()))
        if unknown:
            raise TypeError(f"unknown quantize option(s): {', '.join(unknown)}; the options are {', '.join(cls.names())}")
        return dataclasses.replace(base, **kw) if base is not None else cls(**kw)


def job_keys() -> dict[str, str]:
    """``batch`` job key -> option name, for every option (the CLI's spelling where it differs)."""
    return {f.metadata.get("job_key", f.name): f.name for f in dataclasses.fields(QuantizeOptions)}
