"""The options of one ``quantize`` run: one frozen record, its fields derived from the option table.

The CLI (``ctconvert quantize``), the API (:func:`ctconvert.api.quantize` and
:func:`~ctconvert.api.quantize_to_target`), the command
(:func:`ctconvert.commands.quantize.quantize`) and ``batch`` jobs
(:data:`ctconvert.commands.batch.ALLOWED`, derived from :func:`job_keys`) all
read their option names and defaults from :data:`ctconvert.options.OPTIONS`,
the one table of every option (name, type, default, help, CLI spelling, batch
key); :class:`QuantizeOptions` has one field per entry, in the table's order.

It lives here, below ``commands/``, because two commands use it and commands
do not import each other; the table itself is a torch-free leaf the CLI reads
for ``--help``.
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import UsageError
from ..options import OBSERVER_NAMES, OPTIONS, job_keys
from ..plan.dense_dtype import DENSE_DTYPES

__all__ = ["QuantizeOptions", "job_keys"]


class _Checked:
    """The behaviour of :class:`QuantizeOptions` (its fields come from the table)."""

    def __post_init__(self):
        for o in OPTIONS.values():
            _check_type(o, getattr(self, o.name))
        for name in ("targets", "ignore"):
            v = getattr(self, name)
            if isinstance(v, str):
                v = [v]
            if v is not None:
                object.__setattr__(self, name, tuple(v))
        self._one_of("dense_dtype", DENSE_DTYPES)
        self._one_of("observer", OBSERVER_NAMES)
        self._one_of("executor", OPTIONS["executor"].choices)

    def _one_of(self, name: str, choices: tuple[str, ...]) -> None:
        """Option ``name`` lower-cased, or :class:`UsageError` (``unknown --NAME 'v'; choose one of ...``) when it is none of ``choices``."""
        value = str(getattr(self, name)).lower()
        if value not in choices:
            raise UsageError(f"unknown --{name.replace('_', '-')} {getattr(self, name)!r}; choose one of {', '.join(choices)}")
        object.__setattr__(self, name, value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's keyword name, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, base=None, **kw):
        """``base`` (a :class:`QuantizeOptions`; default: every default) with the keyword options ``kw``. Raises
        :class:`TypeError` naming every unknown keyword (as a function with these keyword parameters would)."""
        unknown = sorted(set(kw) - set(cls.names()))
        if unknown:
            raise TypeError(f"unknown quantize option(s): {', '.join(unknown)}; the options are {', '.join(cls.names())}")
        return dataclasses.replace(base, **kw) if base is not None else cls(**kw)


def _check_type(o, value) -> None:
    """Refuse a value of the wrong type for option ``o`` (:class:`UsageError` naming it): a flag takes a boolean
    (``"no"`` or ``"false"`` is a string, never read as one), a count an integer (``"64"`` is refused, not
    compared), ``None`` only where the option's annotation allows it. The annotation is the table's."""
    kinds = {k.strip() for k in o.annotation.split("|")}
    if value is None and "None" in kinds:
        return
    if "bool" in kinds:
        ok, what = isinstance(value, bool), "true or false"
    elif "int" in kinds and "str" not in kinds:
        ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
        if ok and o.type == "int>=1" and value < 1:
            ok, what = False, "an integer >= 1"
    elif "int" in kinds:  # a size: "5GB" or a number of bytes
        ok, what = isinstance(value, (str, int)) and not isinstance(value, bool), "a size (text like 5GB, or bytes)"
    elif kinds & {"str", "Path"} and not any(k.startswith("tuple") for k in kinds):
        ok, what = isinstance(value, (str, os.PathLike)), "text"
    else:  # targets / ignore: a name or a list of names
        ok = isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))
        what = "a name or a list of names"
    if not ok:
        key = f" (job key {o.job_key})" if o.job_key and o.job_key != o.name else ""
        raise UsageError(f"option {o.name}{key}: expected {what}, got {value!r}")


QuantizeOptions = dataclasses.make_dataclass(
    "QuantizeOptions",
    [(o.name, o.annotation, dataclasses.field(default=o.default, metadata={"job_key": o.job_key or o.name})) for o in OPTIONS.values()],
    bases=(_Checked,),
    frozen=True,
)
QuantizeOptions.__module__ = __name__  # (make_dataclass takes module= only from Python 3.12)
QuantizeOptions.__doc__ = """Every option of a ``quantize`` run but the source, the output, the scheme and the progress callback.

    One field per entry of :data:`ctconvert.options.OPTIONS` (its name, default and meaning: :func:`ctconvert.api.quantize`).
    ``targets``/``ignore`` are kept as tuples (``None``: the defaults). Build it with :meth:`from_kwargs` to have unknown
    names refused.
    """
