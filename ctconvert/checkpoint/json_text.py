"""``json.dumps(obj, indent=N)``, the same characters, about twice as fast, for the large JSON files of an output.

Python's ``json`` encodes an indented document in pure Python, one generator frame per container: the provenance
of a 18,867-tensor MoE (22 MB, ``ctconvert-provenance.json``) took 0.35 s of a 2-core machine at the end of every
run, when nothing else is left to overlap it. Here each container is one loop that encodes its scalars with
``json``'s own C string escaper and ``repr`` of numbers, as ``json`` does, and the pieces are joined once.

The result is ``json.dumps(obj, indent=indent, sort_keys=sort_keys)`` character for character (its defaults:
``ensure_ascii``, separators ``(",", ": ")``, ``NaN``/``Infinity`` for non-finite floats, ``{}``/``[]`` for empty
containers); anything else (keys that are not strings, objects ``json`` would refuse or convert) goes to
``json.dumps`` itself, which then decides. The tests compare the two on random documents.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _string

_INF = float("inf")


class _Other(Exception):
    """A value this encoder leaves to ``json.dumps``."""


def _scalar(o) -> str | None:
    """``json``'s text for a str, None, bool, int or float; None for anything else."""
    if isinstance(o, str):
        return _string(o)
    if o is None:
        return "null"
    if o is True:
        return "true"
    if o is False:
        return "false"
    if isinstance(o, int):
        return int.__repr__(o)
    if isinstance(o, float):
        if o != o:
            return "NaN"
        if o == _INF:
            return "Infinity"
        if o == -_INF:
            return "-Infinity"
        return float.__repr__(o)
    return None


def dumps_indented(obj, indent: int = 2, sort_keys: bool = False) -> str:
    """``json.dumps(obj, indent=indent, sort_keys=sort_keys)``: the same string (see the module's docstring).
    ``indent``: spaces per level (an int >= 0). Raises what ``json.dumps`` raises (``TypeError`` for an object JSON
    cannot hold, ``ValueError`` for a circular reference)."""
    out: list[str] = []
    add = out.append
    pad = [" " * (indent * level) for level in range(64)]

    def enc(o, level: int) -> None:
        if level + 1 >= len(pad):
            raise _Other
        if isinstance(o, dict):
            if not o:
                add("{}")
                return
            sep = ",\n" + pad[level + 1]
            add("{" + sep[1:])
            items = o.items()
            if sort_keys:
                items = sorted(items)
            first = True
            for k, v in items:
                if type(k) is not str:
                    raise _Other
                if not first:
                    add(sep)
                first = False
                s = _scalar(v)
                if s is not None:
                    add(_string(k) + ": " + s)
                else:
                    add(_string(k) + ": ")
                    enc(v, level + 1)
            add("\n" + pad[level] + "}")
        elif isinstance(o, (list, tuple)):
            if not o:
                add("[]")
                return
            sep = ",\n" + pad[level + 1]
            add("[" + sep[1:])
            first = True
            for v in o:
                if not first:
                    add(sep)
                first = False
                s = _scalar(v)
                if s is not None:
                    add(s)
                else:
                    enc(v, level + 1)
            add("\n" + pad[level] + "]")
        else:
            s = _scalar(o)
            if s is None:
                raise _Other
            add(s)

    try:
        enc(obj, 0)
    except (_Other, TypeError, RecursionError):
        return json.dumps(obj, indent=indent, sort_keys=sort_keys)
    return "".join(out)


def canonical_digest(doc) -> str:
    """The sha256 (hex) of ``doc`` as canonical JSON: ``json.dumps(doc, sort_keys=True, separators=(",", ":"))``, UTF-8.
    Raises what ``json.dumps`` raises."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Encoded:
    """A JSON document made ahead of its writing: ``doc``, its indented text (:func:`dumps_indented`, indent 2, keys
    in order) and its :func:`canonical_digest`."""

    doc: dict
    text: str
    digest: str

    @classmethod
    def of(cls, doc: dict) -> Encoded:
        return cls(doc, dumps_indented(doc, 2), canonical_digest(doc))


class EncodeAhead:
    """:meth:`Encoded.of` the document ``make()`` returns, on a thread of its own started here, while the caller goes on
    (a conversion's provenance: ``make`` waits until the computing is done and the source hashes are, then it is made
    while the last writes drain and flush, instead of after them). :meth:`result` joins it: the :class:`Encoded`, or None
    where ``make`` or the encoding raised (the caller then makes the document itself, and meets the error where it always
    did)."""

    def __init__(self, make) -> None:
        self._make, self._got = make, None
        self._thread = threading.Thread(target=self._run, daemon=True, name="ctconvert-encode")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._got = Encoded.of(self._make())
        except BaseException:  # noqa: BLE001 - the caller makes it again and raises there
            self._got = None

    def result(self) -> Encoded | None:
        self._thread.join()
        return self._got
