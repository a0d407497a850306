"""Standard JSON for every ``--json`` document and batch line: no ``Infinity`` / ``NaN`` tokens.

Python's ``json`` writes non-finite floats as ``Infinity``, ``-Infinity`` and ``NaN``, which RFC 8259 does
not allow and parsers outside Python (``jq``, JavaScript's ``JSON.parse``, Go's ``encoding/json``) refuse.
Here a non-finite number is written as the string ``"inf"``, ``"-inf"`` or ``"nan"`` (``float(s)`` reads
each back); everything else is unchanged.
"""

from __future__ import annotations

import json
import math

__all__ = ["dumps", "finite"]


def finite(x):
    """``x`` with every non-finite float (at any depth of dicts, lists and tuples) replaced by its string."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def dumps(data, indent: int | None = None) -> str:
    """``data`` as standard JSON (:func:`finite`; other objects as ``str``). Example: ``dumps({"snr": float("inf")})``
    -> ``'{"snr": "inf"}'``. Raises ``TypeError`` only for dict keys JSON cannot hold."""
    return json.dumps(finite(data), indent=indent, default=str, allow_nan=False)
