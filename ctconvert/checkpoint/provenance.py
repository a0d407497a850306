"""Provenance of a conversion: what each output tensor was made from, the run's identity, and ``--refresh``.

Every output holds ``ctconvert-provenance.json``: for every output tensor the
source file, tensor and content hash (:data:`.hashing.HASH_NAME` in block form,
:mod:`.hashing`) of the bytes it was derived from, and the options of the run.
The document carries ``provenance_format`` (:data:`PROVENANCE_FORMAT`, 5) and
``hash_block_bytes``; an output of an earlier release (format 1: no such key,
one XXH3-128 over each tensor's bytes) is still understood by ``--refresh``,
which then compares the sources with format-1 hashes and writes the current format. Format 2 hashes as 3 does; from
format 3 (:data:`RECORDS_SINCE_FORMAT`) the output's index also lists its records (:data:`.writer.RECORDS_KEY`: the
shards', config's and this document's hashes), so ``verify`` fails such a provenance beside an index without them
(:mod:`.integrity`) instead of taking the output for an earlier release's; from format 4
(:data:`FILE_HASHES_SINCE_FORMAT`) the index also records the other files' hashes (:mod:`.file_records`), so a
provenance of format 4 beside an index without them is failed the same way; from format 5
(:data:`INDEX_DIGEST_SINCE_FORMAT`) the index also holds its digest of itself (:func:`.file_records.index_digest`), so
an edit of the index's records shows, and a provenance of format 5 beside an index without it fails. ``--resume`` compares a run's
:func:`fingerprint` with the interrupted one's; ``--refresh`` compares the
source hashes with an earlier output's provenance (:func:`refresh_plan`) and
redoes only what changed.

The work units given here are the plan's (anything with ``sources``,
``outputs`` and ``output_sources()``); this module does not depend on how they
were planned.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .. import __version__
from ..errors import UsageError
from .hashing import HASH_BLOCK_BYTES, HASH_NAME, HASH_SCHEME, hash_tensors
from .reader import INDEX_NAME, Checkpoint
from .shard_file import PlannedTensor
from .writer import PROVENANCE, shard_names

__all__ = [
    "PROVENANCE",
    "PROVENANCE_FORMAT",
    "RECORDS_SINCE_FORMAT",
    "FILE_HASHES_SINCE_FORMAT",
    "INDEX_DIGEST_SINCE_FORMAT",
    "fingerprint",
    "load_provenance",
    "provenance",
    "refresh_plan",
    "shard_map",
    "sources_by_shard",
]


#: the provenance document's format: 5 = as 4, and the index holds its digest of itself; 4 = as 3, and the index records
#: the other files' hashes too; 3 = block hashes (:data:`.hashing.HASH_SCHEME`), and the output's index lists its records,
#: this document's hash among them; 2 = block hashes, an index without that promise; 1 (no key) = flat XXH3-128
PROVENANCE_FORMAT = 5
#: the first format written only beside an index that lists its records (:data:`.writer.RECORDS_KEY`)
RECORDS_SINCE_FORMAT = 3
#: the first format written only beside an index that records the other files' hashes (:mod:`.file_records`)
FILE_HASHES_SINCE_FORMAT = 4
#: the first format written only beside an index that holds its digest of itself (:data:`.file_records.INDEX_DIGEST_KEY`)
INDEX_DIGEST_SINCE_FORMAT = 5


def fingerprint(ckpt: Checkpoint, options: dict, planned: list[PlannedTensor]) -> str:
    """Identity of a run: ctconvert version, options, source files (name, size, mtime) and the output layout (sha256 hex)."""
    h = hashlib.sha256()
    h.update(json.dumps({"version": __version__, "options": options, "hash": HASH_SCHEME}, sort_keys=True).encode())
    for f in ckpt.files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for t in planned:
        h.update(f"{t.name}:{t.dtype}:{t.shape}".encode())
    return h.hexdigest()


def provenance(ckpt: Checkpoint, units: list, options: dict, src_hashes: dict[str, str], derived_from: dict | None = None) -> dict:
    """The provenance document: per output tensor, the source tensors (file, name, content hash) it derives from.

    A source tensor that is the dequantized weight of a quantized source (:mod:`.sources`) is hashed as its
    dense bytes and also names the stored tensors and format it was dequantized from (``dequantized_from``);
    ``derived_from`` (:meth:`.sources.Source.derived_from`) says which quantized checkpoint the output was made from."""
    tensors = {}
    entries: dict[str, dict] = {}  # source -> its entry, one dict for every output made from it (NVFP4A16: three)
    for u in units:
        for name, sources in u.output_sources().items():
            tensors[name] = [entries.get(s) or entries.setdefault(s, _entry(ckpt.tensors[s], src_hashes[s])) for s in sources]
    doc = {
        "ctconvert": __version__,
        "provenance_format": PROVENANCE_FORMAT,
        "hash": HASH_NAME,
        "hash_block_bytes": HASH_BLOCK_BYTES,
        "source": os.path.normpath(os.path.abspath(ckpt.path)),  # absolute and normalised, as derived_from's path
        "options": options,
        "tensors": tensors,
    }
    if derived_from is not None:
        doc["derived_from"] = derived_from
    return doc


def _entry(info, digest: str) -> dict:
    e = {"file": info.file.name, "tensor": info.name, HASH_NAME: digest}
    if info.base is not None:  # a per-expert part of a fused tensor: the stored tensor it is a slice of
        e["slice_of"] = info.base
    if info.virtual is not None:
        e["dequantized_from"] = info.virtual.describe()
    return e


def cast_tensors(path: Path) -> dict[str, str]:
    """The tensors of the ctconvert output ``path`` that ``quantize --dense-dtype`` cast (its provenance's ``cast``:
    tensor -> ``"fp32->bf16"``); {} when none, or when the folder has no readable provenance."""
    try:
        prov = json.loads((Path(path) / PROVENANCE).read_text())
    except (OSError, ValueError):
        return {}
    cast = prov.get("cast") if isinstance(prov, dict) else None
    return {str(k): str(v) for k, v in cast.items()} if isinstance(cast, dict) else {}


def load_provenance(out: Path, options: dict) -> dict:
    """An earlier output's provenance, checked for ``--refresh`` (same options, same hash). Raises :class:`UsageError`."""
    p = out / PROVENANCE
    if not p.is_file():
        raise UsageError("--refresh needs an earlier ctconvert output with ctconvert-provenance.json", file=out)
    prov = json.loads(p.read_text())
    now, before = json.loads(json.dumps(options)), prov.get("options") or {}
    if before != now:

        def shown(d: dict, k: str) -> str:  # an option at its default is not recorded
            return repr(d[k]) if k in d else "the default"

        differ = "; ".join(f"{k}: earlier {shown(before, k)}, now {shown(now, k)}" for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k))
        raise UsageError(
            f"--refresh needs the same options as the earlier conversion; these differ: {differ}; "
            "give the earlier options, or run a full conversion with --overwrite instead",
            file=p,
        )
    if prov.get("hash") != HASH_NAME:
        raise UsageError(f"earlier provenance uses {prov.get('hash')}, this install {HASH_NAME}; run a full conversion", file=p)
    fmt = prov.get("provenance_format", 1)
    if fmt not in (1, 2, 3, 4, PROVENANCE_FORMAT) or (fmt != 1 and prov.get("hash_block_bytes") != HASH_BLOCK_BYTES):  # 2 to 4 hash as 5
        raise UsageError(
            f"earlier provenance is format {fmt} (block size {prov.get('hash_block_bytes')}), which this release cannot compare; run a full conversion",
            file=p,
        )
    prov["_legacy"] = fmt == 1  # compare with format-1 (whole-tensor) hashes
    prov["_hashes"] = {s["tensor"]: s[HASH_NAME] for srcs in prov["tensors"].values() for s in srcs}
    return prov


def shard_map(assignment: list[list[PlannedTensor]]) -> dict[str, str]:
    """Output tensor -> the name of the shard it goes to."""
    return {t.name: name for name, ts in zip(shard_names(len(assignment)), assignment) for t in ts}


def sources_by_shard(units: list, shard_of: dict[str, str]) -> dict[str, set[str]]:
    """Shard name -> the source tensors its tensors derive from."""
    out: dict[str, set[str]] = {}
    for u in units:
        for name, sources in u.output_sources().items():
            out.setdefault(shard_of[name], set()).update(sources)
    return out


def refresh_plan(ckpt: Checkpoint, units: list, assignment: list[list[PlannedTensor]], out: Path, prov: dict):
    """Against the earlier output at ``out``: ``(shards to reuse {name: path}, units to run, shards
    rewritten, source hashes computed on the way)``. A changed shard layout rewrites everything."""
    old_index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    current: dict[str, str] = {}
    new_map = shard_map(assignment)
    if old_index != new_map:
        dirty = set(new_map.values())
    else:
        dirty = set()
        legacy = prov.get("_legacy", False)
        hashes = hash_tensors([ckpt.tensors[s] for u in units for s in u.sources], legacy=legacy)  # in parallel
        for u in units:
            if any(prov["_hashes"].get(s) != hashes[s] for s in u.sources):
                dirty.update(new_map[o[0]] for o in u.outputs)
        if not legacy:  # format-1 hashes only serve the comparison; the new provenance is format 2
            current = hashes
    reuse = {name: out / name for name in set(new_map.values()) - dirty}
    todo = [u for u in units if any(new_map[o[0]] in dirty for o in u.outputs)]
    return reuse, todo, sorted(dirty), current
