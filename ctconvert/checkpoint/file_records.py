"""The hashes of an output's other files, taken as the run wrote them: what it copied from its source (the tokenizer,
``generation_config.json``, the chat template, the model card with its conversion section ...) beside the shards.

vLLM and transformers read those files as they are: an edited ``generation_config.json`` (sampling defaults, the end
token) or tokenizer changes what a served model says while every tensor still matches its record. The index's metadata
keeps ``{"hash": HASH_SCHEME, "files": {relative path: {"size": bytes, HASH_NAME: hex}}}`` under :data:`FILE_HASHES_KEY`
(the block hash of :func:`.hashing.file_hash`, the shards' scheme); ``verify`` compares each file with it
(:func:`.integrity.file_hash_problems`). The shards, the index, ``config.json`` and ``ctconvert-provenance.json`` have
records of their own and are not listed here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import OutputError
from .hashing import HASH_NAME, HASH_SCHEME, RangeHash, file_hash, shard_hash
from .json_text import canonical_digest

__all__ = ["FILE_HASHES_KEY", "FILES_CHECK", "INDEX_DIGEST_KEY", "file_records", "index_digest", "mismatch", "record_mismatch", "well_formed"]

#: the index metadata key of the record (a release that writes it also lists it in ``ctconvert_records``)
FILE_HASHES_KEY = "ctconvert_file_hashes"
#: the index metadata key of the index's digest of itself (:func:`index_digest`; a release that writes it lists it in
#: ``ctconvert_records`` and writes provenance format 5 or later)
INDEX_DIGEST_KEY = "ctconvert_index_digest"
#: the line ``verify`` lists among its checks where the index holds the record
FILES_CHECK = "the other files (tokenizer, generation_config.json ...) against the hashes recorded as they were written"


def file_records(folder: Path, names: list[str]) -> dict:
    """The record of the files ``names`` (paths relative to ``folder``, as on disk now): their sizes and block hashes,
    hashed in parallel on the hashing threads. Raises :class:`~ctconvert.errors.OutputError` naming a file that cannot
    be read (a run's own folder: it was removed or its disk failed under the run)."""
    begun = {}
    for name in sorted(names):
        path = Path(folder) / name
        try:
            size = path.stat().st_size
            begun[name] = (size, RangeHash(path, 0, size))
        except OSError as e:
            raise OutputError(f"cannot hash a copied file: {e.strerror or e}", file=path) from e
    files = {}
    for name, (size, h) in begun.items():
        try:
            files[name] = {"size": size, HASH_NAME: h.hexdigest()}
        except OSError as e:
            raise OutputError(f"cannot hash a copied file: {e.strerror or e}", file=Path(folder) / name) from e
    return {"hash": HASH_SCHEME, "files": files}


def index_digest(index: dict) -> str:
    """The digest an index records of itself (:data:`INDEX_DIGEST_KEY`): the sha256 (hex) of the whole index as canonical
    JSON (:func:`.json_text.canonical_digest`: keys sorted, so indentation and key order do not count) with that key left
    out of its ``metadata``. The records in the index guard the shards, config.json and the other files, but nothing
    guarded the records: a file deleted with its entries removed from both ``ctconvert_files`` and
    ``ctconvert_file_hashes`` passed a plain ``verify`` (a new user's trial). Any entry edited, added or removed now
    shows. ``index`` is the parsed ``model.safetensors.index.json`` (``metadata`` a dict); raises ``TypeError`` or
    ``ValueError`` where it holds what JSON cannot write."""
    meta = {k: v for k, v in index["metadata"].items() if k != INDEX_DIGEST_KEY}
    return canonical_digest({**index, "metadata": meta})


def record_mismatch(path: Path, rec: dict, digest: Callable[[Path], str] = shard_hash) -> str | None:
    """How the file ``path`` differs from its record (``size`` and content hash ``HASH_NAME``: a shard's in a journal or
    the index's ``ctconvert_shards``, :func:`.hashing.shard_hash`; another file's here, ``digest`` :func:`.hashing.file_hash`),
    or None when it matches: the size first (no read), then the hash (reads every byte). Raises ``OSError`` for a file
    that cannot be read."""
    size = path.stat().st_size
    if size != rec.get("size"):
        return f"size {size} bytes differs from the {rec.get('size')} written"
    if digest(path) != rec.get(HASH_NAME):
        return "bytes differ from those written (content hash)"
    return None


def well_formed(rec: object) -> bool:
    """Whether ``rec`` is a record a run writes: ``{"size": int >= 0, HASH_NAME: lower-case hex of 32 or 64 digits}``
    (one that is not was edited: its file is not to blame)."""
    digest = rec.get(HASH_NAME) if isinstance(rec, dict) else None
    size = rec.get("size") if isinstance(rec, dict) else None
    hex_ok = isinstance(digest, str) and len(digest) in (32, 64) and all(c in "0123456789abcdef" for c in digest)
    return hex_ok and type(size) is int and size >= 0


def mismatch(path: Path, rec: dict) -> str | None:
    """:func:`record_mismatch` of a file of the record (:func:`.hashing.file_hash`; ``rec`` :func:`well_formed`), also
    where ``path`` is missing or unreadable (a message, not an error)."""
    if not path.exists():
        return "missing: the run wrote it (the index records its hash)"
    if path.is_dir():
        return "a folder (or a link to one) where the run wrote a file"
    try:
        return record_mismatch(path, rec, file_hash)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
