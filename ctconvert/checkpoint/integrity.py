"""The shards' bytes against the hashes ctconvert took as it wrote them (``verify``, with or without ``--reference``).

Every output folder ctconvert writes (``quantize``, ``convert``, ``repack``, ``decompress``) records in its index's
metadata (:data:`~.writer.SHARDS_KEY`) each shard's size and content hash (:func:`.hashing.combine_shard_hash`: the
block hashes of its header and of each tensor's bytes, :mod:`.hashing`), taken from the bytes as they were handed to
the disk. A shard whose bytes differ now was changed or damaged after the run: one flipped bit of a packed code or
scale is invisible to the error statistics of ``--reference`` (a few wrong values among millions stay within the
format's limits), but never to this comparison. Folders without the record (an earlier release, another tool) are
not judged here; :func:`shard_hash_problems` then says so in a warning when the folder is otherwise ctconvert's.
The index also records the hash of the ``quantization_config`` written into ``config.json`` (:data:`~.writer.QCFG_KEY`)
and of the whole ``config.json`` (:data:`~.writer.CONFIG_KEY`): :func:`config_record_problems` fails a config edited
afterwards, which no tensor may contradict. It records the hash of the output's ``ctconvert-provenance.json`` too
(:data:`~.writer.PROVENANCE_KEY`): :func:`provenance_record_problems` fails one edited afterwards, and only a provenance
that matches its record may steer ``verify`` (:func:`recorded_provenance`: an added ``derived_from`` turned the value
check off). A provenance of a format that a release writing these records wrote (:data:`.provenance.RECORDS_SINCE_FORMAT`)
beside an index without them is an error (:func:`stripped_records_problems`), not an earlier release's output. The
index holds a digest of itself too (:data:`~.file_records.INDEX_DIGEST_KEY`): :func:`index_digest_problems` fails an
index whose records were edited together (a file deleted with its entries removed from two records).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import CTConvertError
from .file_records import FILE_HASHES_KEY, FILES_CHECK, INDEX_DIGEST_KEY, index_digest, mismatch, record_mismatch, well_formed
from .hashing import HASH_NAME, HASH_SCHEME
from .model_card import CARD, HEADING
from .provenance import FILE_HASHES_SINCE_FORMAT, INDEX_DIGEST_SINCE_FORMAT, RECORDS_SINCE_FORMAT
from .reader import CONFIG_NAME, INDEX_NAME, Checkpoint, Problem
from .safetensors_io import read_header
from .writer import CONFIG_KEY, FILES_KEY, MARKER, PROVENANCE, PROVENANCE_KEY, QCFG_KEY, RECORDS_KEY, SHARDS_KEY, config_digest

__all__ = [
    "CONFIG_CHECK",
    "INDEX_CHECK",
    "PROVENANCE_CHECK",
    "SHARDS_CHECK",
    "WHOLE_CONFIG_CHECK",
    "config_record_problems",
    "file_hash_problems",
    "index_digest_problems",
    "DENSE_RECORDS",
    "dense_record_problems",
    "judged_by_records",
    "link_problems",
    "provenance_module_problems",
    "provenance_record_problems",
    "record_problems",
    "recorded_provenance",
    "shard_hash_problems",
    "total_size_problems",
    "shards_checks",
    "stripped_records_problems",
]

#: the lines ``verify`` lists among its checks
SHARDS_CHECK = "shard bytes against the hashes recorded as they were written"
CONFIG_CHECK = "config.json's quantization_config against the hash recorded as it was written"
#: the line ``verify`` lists where it compares the whole ``config.json`` with its record (:data:`~.writer.CONFIG_KEY`)
WHOLE_CONFIG_CHECK = "config.json against the hash recorded as it was written"
#: the line ``verify`` lists where it compares ``ctconvert-provenance.json`` with its record (:data:`~.writer.PROVENANCE_KEY`)
PROVENANCE_CHECK = "ctconvert-provenance.json against the hash recorded as it was written"
#: the line ``verify`` lists where it compares the index with its digest of itself (:data:`~.file_records.INDEX_DIGEST_KEY`)
INDEX_CHECK = "the index and its records against the digest recorded as it was written"


def _metadata(ckpt: Checkpoint) -> dict:
    """The ``metadata`` of the index of ``ckpt``, a dict (empty where there is none or it is not one)."""
    meta = (ckpt.index or {}).get("metadata")
    return meta if isinstance(meta, dict) else {}


def record_problems(ckpt: Checkpoint, added: bool = True) -> list[Problem]:
    """The output of ``ckpt`` against every record of it taken as it was written: :func:`shard_hash_problems`,
    :func:`file_hash_problems` (``added``: with its warning on files the run did not write), :func:`config_record_problems`,
    :func:`provenance_record_problems`, :func:`provenance_module_problems`, and :func:`index_digest_problems` where no
    error of those or of the reader names the index already; where the records were stripped from the index
    (:func:`stripped_records_problems`), that error instead of the comparisons."""
    stripped = stripped_records_problems(ckpt)
    if any(p.severity == "error" for p in stripped):
        return stripped + provenance_module_problems(ckpt)
    found = (
        stripped
        + shard_hash_problems(ckpt)
        + file_hash_problems(ckpt, added)
        + link_problems(ckpt)
        + total_size_problems(ckpt)
        + config_record_problems(ckpt)
        + provenance_record_problems(ckpt)
        + provenance_module_problems(ckpt)
    )
    index = str(Path(ckpt.path) / INDEX_NAME)
    said = any(p.severity == "error" and p.file == index for p in found + ckpt.problems)  # (the reader's: a weight_map entry)
    return found + ([] if said else index_digest_problems(ckpt))


def index_digest_problems(ckpt: Checkpoint) -> list[Problem]:
    """An error naming the index where it is not the one the run wrote: its digest of itself
    (:data:`~.file_records.INDEX_DIGEST_KEY`, :func:`~.file_records.index_digest`) no longer matches it (an entry edited,
    added or removed after the run: a file deleted with its entries removed from ``ctconvert_files`` and
    ``ctconvert_file_hashes`` passed a plain verify), or the digest was removed from an index that lists it, or beside a
    provenance of format :data:`.provenance.INDEX_DIGEST_SINCE_FORMAT` or later. Nothing for an index of an earlier
    release or another tool (no digest, no such provenance)."""
    meta, index = _metadata(ckpt), str(Path(ckpt.path) / INDEX_NAME)
    recorded = meta.get(INDEX_DIGEST_KEY)
    if not isinstance(recorded, str):
        exists, doc = _provenance(ckpt.path)
        required = exists and _format(doc) >= INDEX_DIGEST_SINCE_FORMAT
        if INDEX_DIGEST_KEY not in meta and not (required and RECORDS_KEY in meta):
            return _removed(meta, INDEX_DIGEST_KEY, index, required=False)
        why = f"the index's {INDEX_DIGEST_KEY} (its digest of itself, which this release always writes) was removed or emptied after the run"
        return [Problem("error", f"{why}: its records cannot be trusted; convert again", index)]
    try:
        same = index_digest(ckpt.index) == recorded
    except (TypeError, ValueError):
        same = False
    if same:
        return []
    why = (
        f"the index is not the one ctconvert wrote (its {INDEX_DIGEST_KEY} no longer matches it): an entry was edited, added or removed "
        "after the run, so the records it holds (the shards', the config's and the other files' hashes) cannot be trusted; convert again"
    )
    return [Problem("error", why, index)]


def total_size_problems(ckpt: Checkpoint) -> list[Problem]:
    """An error where the ``metadata.total_size`` of ctconvert's index (its :data:`~.writer.MARKER`) is not the bytes
    of the tensors its shards hold (what the writer records there, as transformers' ``save_pretrained`` does): it was
    edited after the run (a trial's ``+4`` passed verify), and a loader that sizes or checks the download by it reads
    a wrong number. Nothing for another tool's index, one without the key, shards that cannot be read, or a shard
    missing from the folder or not in the index's ``weight_map`` (the reader's and the shard record's errors name
    them, not a ``total_size`` edited)."""
    meta = _metadata(ckpt)
    if MARKER not in meta or "total_size" not in meta:
        return []
    weight_map = (ckpt.index or {}).get("weight_map")
    if not isinstance(weight_map, dict) or {p.name for p in ckpt.files} != set(weight_map.values()):
        return []  # a shard missing or not listed: its own error says so, not a total_size edited
    if any(p.severity == "error" and p.file in {str(f) for f in ckpt.files} for p in ckpt.problems):
        return []  # a shard the reader could not read (truncated, bad header): said once, by the reader
    try:
        held = sum(info.nbytes for path in ckpt.files for info in read_header(path)[0].values())
    except (OSError, CTConvertError):
        return []
    recorded = meta["total_size"]
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded == held:
        return []
    why = f"the index's total_size is {recorded!r}, but its shards hold {held} bytes of tensors (what ctconvert wrote there): edited after the run"
    why += "; convert again"
    return [Problem("error", why, str(Path(ckpt.path) / INDEX_NAME))]


def _provenance(folder: Path) -> tuple[bool, dict | None]:
    """``(whether the folder holds ctconvert-provenance.json, its JSON object or None where it cannot be read as one)``."""
    path = Path(folder) / PROVENANCE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return path.exists(), None
    return True, doc if isinstance(doc, dict) else None


def _format(doc: dict | None) -> int:
    """The ``provenance_format`` of a provenance document (1 where it has none or it is not an integer: format 1 had no key)."""
    fmt = (doc or {}).get("provenance_format", 1)
    return fmt if isinstance(fmt, int) and not isinstance(fmt, bool) else 1


#: the first ctconvert release whose version an output names (its index's :data:`~.writer.MARKER`, its provenance's
#: ``ctconvert``) where every output holds the records: an output naming it or a later one without them was stripped
RECORDS_SINCE_RELEASE = (0, 2)


def _writes_records(version: object) -> bool:
    """Whether ``version`` (``"X.Y[.Z]"``) names :data:`RECORDS_SINCE_RELEASE` or a later release."""
    found = re.match(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    return found is not None and (int(found.group(1)), int(found.group(2))) >= RECORDS_SINCE_RELEASE


def _records_release(meta: dict, doc: dict | None) -> str | None:
    """The ctconvert version that wrote the folder, named by its index's marker or its provenance, where it is
    :data:`RECORDS_SINCE_RELEASE` or later (a release that always writes its records); else None."""
    return next((v for v in (meta.get(MARKER), (doc or {}).get("ctconvert")) if _writes_records(v)), None)


def _card_release(folder: Path) -> str | None:
    """The ctconvert release the folder's model card names in its conversion section (:data:`.model_card.HEADING`,
    "by ctconvert X.Y.Z"), where it is one that always writes the records (:data:`RECORDS_SINCE_RELEASE`); else None."""
    try:
        text = (folder / CARD).read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"by ctconvert (\d+\.\d+(\.\d+)?)", text.partition(HEADING)[2]) if HEADING in text else None
    return found.group(1) if found is not None and _writes_records(found.group(1)) else None


def stripped_records_problems(ckpt: Checkpoint) -> list[Problem]:
    """An error naming the index where the folder's ``ctconvert-provenance.json`` is of a format that only a release
    writing the index's records writes (``provenance_format`` >= :data:`.provenance.RECORDS_SINCE_FORMAT`) while the
    index does not list them (:data:`~.writer.RECORDS_KEY`): the records were removed after the run (a new user's trial
    deleted them, and the output passed as an earlier release's, unjudged), so the shards, ``config.json`` and the
    provenance cannot be compared with what was written. A warning where a provenance of an earlier format sits beside an
    index without ctconvert's marker either (an earlier release's index rewritten, or every ctconvert key stripped and
    the format edited back: a trial's output passed silently). An error too where the index's marker or the provenance
    names a release that always writes the records (:data:`RECORDS_SINCE_RELEASE`: a trial stripped them and set the
    provenance's format back to 2, and the output passed as an earlier release's). Empty for an index that lists its records, a provenance of
    an earlier format beside a marked index (release 0.1.0 wrote format 2 and no records: the warning of
    :func:`shard_hash_problems`), no provenance, or no index (:func:`shard_hash_problems` reports a deleted one)."""
    meta = _metadata(ckpt)
    if ckpt.index is None or RECORDS_KEY in meta:
        return []
    held, doc = _provenance(ckpt.path)
    release = _records_release(meta, doc)
    if release is not None and INDEX_DIGEST_KEY not in meta and _format(doc) < RECORDS_SINCE_FORMAT:  # (its format edited back)
        why = (
            f"the index holds none of the records ctconvert writes ({RECORDS_KEY}), though ctconvert {release} wrote this output "
            "(its index's marker or its provenance says so), a release that always writes them: they were removed after the run, "
            "so nothing can be compared with what was written; convert again"
        )
        return [Problem("error", why, str(Path(ckpt.path) / INDEX_NAME))]
    if _format(doc) < RECORDS_SINCE_FORMAT:
        if not held and MARKER not in meta and (card := _card_release(Path(ckpt.path))) is not None:
            why = (
                f"{CARD} says ctconvert {card} converted this checkpoint, but its index holds no ctconvert marker or record and the folder "
                f"no {PROVENANCE}: if ctconvert wrote it, they were removed after the run and nothing is compared with what was "
                "written (judged as another tool's checkpoint); `verify --reference SRC` compares its values"
            )
            return [Problem("warning", why, str(Path(ckpt.path) / INDEX_NAME))]
        if not held or MARKER in meta:  # (an earlier release's index, marked: shard_hash_problems warns)
            return []
        why = (
            f"{PROVENANCE} (format {_format(doc)}) is ctconvert's, but the index holds neither its marker ({MARKER}) nor its "
            "records: the index was rewritten or its records removed, so the shards and config.json are not compared with what "
            "was written (judged as another tool's checkpoint)"
        )
        return [Problem("warning", why, str(Path(ckpt.path) / INDEX_NAME))]
    if INDEX_DIGEST_KEY in meta:  # (the records may be there: their list is gone, which the digest shows)
        why = f"the index's list of its records ({RECORDS_KEY}) was removed after the run, which its {INDEX_DIGEST_KEY} shows: convert again"
        return [Problem("error", why, str(Path(ckpt.path) / INDEX_NAME))]
    why = (
        f"the index holds none of the records ctconvert writes ({RECORDS_KEY}: the shards', the config's and the provenance's "
        f"hashes), though {PROVENANCE} is of format {_format(doc)}, which only a release that writes them writes: they were "
        "removed after the run, so nothing can be compared with what was written; convert again"
    )
    return [Problem("error", why, str(Path(ckpt.path) / INDEX_NAME))]


def recorded_provenance(folder: str | Path) -> dict | None:
    """The output's ``ctconvert-provenance.json`` (a dict) where its index records the provenance's hash
    (:data:`~.writer.PROVENANCE_KEY`, :func:`~.writer.config_digest` of the document) and the file matches it; else None
    (no record, an earlier release's output; an edited, missing or unreadable file). What verify reads from a provenance
    to relax a check (``derived_from``: :func:`.grid.rounded_elsewhere`) is read from this only: a key added by hand
    switches nothing off."""
    try:
        meta = json.loads((Path(folder) / INDEX_NAME).read_text()).get("metadata")
    except (OSError, ValueError, AttributeError):
        return None
    recorded = meta.get(PROVENANCE_KEY) if isinstance(meta, dict) else None
    _, doc = _provenance(Path(folder))
    return doc if isinstance(recorded, str) and doc is not None and config_digest(doc) == recorded else None


def provenance_record_problems(ckpt: Checkpoint) -> list[Problem]:
    """``ctconvert-provenance.json`` against the hash its index records (:data:`~.writer.PROVENANCE_KEY`): an error naming
    it where it differs (edited after the run: an added ``derived_from`` once turned verify's value check off), was
    deleted or is not a JSON object; an error naming the index where the record was removed from an index that lists
    it, or that a provenance of format :data:`.provenance.RECORDS_SINCE_FORMAT` or later always comes with. A note where
    a provenance no record covers (an earlier release's) says the output was requantized from another checkpoint:
    verify does not take that on trust, so its values are still judged against a dense reference."""
    meta, path = _metadata(ckpt), Path(ckpt.path) / PROVENANCE
    exists, doc = _provenance(ckpt.path)
    recorded = meta.get(PROVENANCE_KEY)
    if not isinstance(recorded, str):
        required = exists and _format(doc) >= RECORDS_SINCE_FORMAT
        if removed := _removed(meta, PROVENANCE_KEY, str(Path(ckpt.path) / INDEX_NAME), required=required):
            return removed
        derived = (doc or {}).get("derived_from")
        if not isinstance(derived, dict):
            return []
        why = (
            f"the provenance says the output was requantized from {derived.get('path')}, but the index records no hash of the "
            "provenance (an earlier release's output), so verify does not take it on trust: against a dense --reference its values "
            "are judged one by one; if they fail, verify against that checkpoint"
        )
        return [Problem("note", why, str(path))]
    if not exists:
        why = f"{PROVENANCE}, whose hash the index records, is missing: deleted after the run; convert again"
    elif doc is None:
        why = f"{PROVENANCE} is not a JSON object, and the index records the hash of the one ctconvert wrote: damaged after the run; convert again"
    elif config_digest(doc) != recorded:
        why = (
            f"{PROVENANCE} is not the one ctconvert wrote (the index records its hash): edited after the run, and verify reads from it "
            "what the output was made from (an added derived_from would switch off the value check); convert again"
        )
    else:
        return []
    return [Problem("error", why, str(path))]


#: the records every dense output (``decompress``) of a release that lists its records holds, and what each guards
DENSE_RECORDS = {SHARDS_KEY: "the shards' bytes", CONFIG_KEY: "config.json", FILE_HASHES_KEY: "the other files"}


def judged_by_records(ckpt: Checkpoint) -> bool:
    """Whether a checkpoint without a ``quantization_config`` (a ``decompress`` output) gets a plain ``verify``'s verdict
    from its records alone (:func:`dense_record_problems`): its index lists its records (:data:`~.writer.RECORDS_KEY`,
    this release), or its digest of itself (:data:`~.file_records.INDEX_DIGEST_KEY`: the list removed, which the
    digest shows), or its marker names a release that writes them (:data:`RECORDS_SINCE_RELEASE`: all removed).
    Otherwise (a dense model of another tool, an index of an earlier release or with all of these removed: what was
    written cannot be told) ``verify`` asks for ``--reference``."""
    meta = _metadata(ckpt)
    listed = isinstance(meta.get(RECORDS_KEY), list) or INDEX_DIGEST_KEY in meta
    return listed or _records_release(meta, None) is not None


def dense_record_problems(ckpt: Checkpoint) -> list[Problem]:
    """What a plain ``verify`` of a dense output (:func:`judged_by_records`) needs beside the record comparisons: an
    error for each record of :data:`DENSE_RECORDS` its index's list lacks (removed with its listing after the run, so
    what it guards is not compared: a trial's edited config.json passed so), and for a ``ctconvert-provenance.json``,
    which only a quantized output holds (its ``quantization_config`` and the config's records were removed)."""
    meta, index = _metadata(ckpt), str(Path(ckpt.path) / INDEX_NAME)
    listed = meta.get(RECORDS_KEY)
    found = [
        Problem("error", f"the index's {RECORDS_KEY} lacks {key}, which every dense output holds: removed after the run, so {what} cannot be compared", index)
        for key, what in DENSE_RECORDS.items()
        if isinstance(listed, list) and key not in listed  # (the list itself removed: the index's digest says so)
    ]
    if (Path(ckpt.path) / PROVENANCE).is_file():
        why = f"config.json has no quantization_config, but {PROVENANCE} is there, which only a quantized output holds: the config was edited after the run"
        found.append(Problem("error", why, str(Path(ckpt.path) / CONFIG_NAME)))
    return found


def shards_checks(ckpt: Checkpoint) -> list[str]:
    """The check lines of :func:`shard_hash_problems` for a report's list of checks: ``[SHARDS_CHECK]`` where it
    compares the shards of ``ckpt`` with a record (its index holds one, taken with this installation's hash scheme),
    else none (a warning says why nothing was compared)."""
    meta = _metadata(ckpt)
    record = meta.get(SHARDS_KEY)
    shards = [SHARDS_CHECK] if isinstance(record, dict) and record.get("hash") == HASH_SCHEME else []
    recorded = ((CONFIG_CHECK, QCFG_KEY), (WHOLE_CONFIG_CHECK, CONFIG_KEY), (PROVENANCE_CHECK, PROVENANCE_KEY))
    configs = [c for c, key in recorded if isinstance(meta.get(key), str)]
    files = meta.get(FILE_HASHES_KEY)
    files_check = [FILES_CHECK] if isinstance(files, dict) and files.get("hash") == HASH_SCHEME else []
    return shards + configs + files_check + ([INDEX_CHECK] if isinstance(meta.get(INDEX_DIGEST_KEY), str) else [])


def _removed(meta: dict, key: str, index: str, required: bool) -> list[Problem]:
    """An error where an index of a release that lists its records (:data:`~.writer.RECORDS_KEY`) lacks a usable
    ``key`` record that it lists, or that such a release always writes (``required``: the shard hashes, and the
    config's hash where ``config.json`` holds a ``quantization_config``): the record was deleted or emptied after the
    run (``null`` included), so what it guards cannot be compared; else empty."""
    listed = meta.get(RECORDS_KEY)
    if RECORDS_KEY in meta and (required or (isinstance(listed, list) and key in listed)):
        why = f"the index's {key} record was removed or emptied after the run (this release always writes it): what it guards cannot be compared; convert again"
        return [Problem("error", why, index)]
    return []


def config_record_problems(ckpt: Checkpoint) -> list[Problem]:
    """An error where ``config.json``'s ``quantization_config`` is not the one the run wrote (its hash, recorded in the
    index's metadata as :data:`~.writer.QCFG_KEY`, differs): arguments edited by hand that no tensor contradicts (a
    weight ``type``, ``strategy`` or ``dynamic``, added ``input_activations``) change what vLLM loads, or make it refuse
    the checkpoint. A warning where an index of this release (it records shard hashes) lacks it; nothing for a folder
    of an earlier release or another tool."""
    meta = _metadata(ckpt)
    recorded = meta.get(QCFG_KEY)
    qcfg = ckpt.config.get("quantization_config") if isinstance(ckpt.config, dict) else None
    if not isinstance(recorded, str):
        if removed := _removed(meta, QCFG_KEY, str(Path(ckpt.path) / INDEX_NAME), required=qcfg is not None):
            return removed + _whole_config_problems(ckpt, meta)  # (a dense output's config replaced by a quantized one: said too)
        if MARKER in meta and SHARDS_KEY in meta and qcfg is not None:  # ctconvert's index of this release, the record gone
            why = "the index records no hash of the quantization_config: config.json is not compared with what was written"
            return [Problem("warning", why, str(Path(ckpt.path) / INDEX_NAME))] + _whole_config_problems(ckpt, meta)
        return _whole_config_problems(ckpt, meta)
    if isinstance(qcfg, dict) and config_digest(qcfg) == recorded:
        return _whole_config_problems(ckpt, meta)
    what = "was removed" if qcfg is None else "is not the one ctconvert wrote (the index records its hash)"
    why = f"the quantization_config {what}: it was changed after the conversion, and vLLM loads the tensors as it says; convert again"
    return [Problem("error", why, str(Path(ckpt.path) / "config.json"))]


def _whole_config_problems(ckpt: Checkpoint, meta: dict) -> list[Problem]:
    """An error where ``config.json`` is not the one the run wrote (its hash, :data:`~.writer.CONFIG_KEY`, differs):
    vLLM builds the model from every key, so an edited size, count, head, activation, bias, rope or MoE routing key
    makes it refuse the checkpoint or compute other numbers from the same tensors (a trial's ``num_key_value_heads``,
    ``rope_theta``, ``rms_norm_eps``, ``num_experts_per_tok`` edits loaded and served other numbers), which no tensor
    shows; an error too where an index that lists the record lacks it. Nothing for an index without the record (an
    earlier release's, another tool's) or a ``config.json`` that is not a JSON object (the reader reports it)."""
    recorded = meta.get(CONFIG_KEY)
    if not isinstance(recorded, str):
        return _removed(meta, CONFIG_KEY, str(Path(ckpt.path) / INDEX_NAME), required=False)
    if not isinstance(ckpt.config, dict) or config_digest(ckpt.config) == recorded:
        return []
    why = (
        "config.json is not the one ctconvert wrote (the index records its hash): edited after the run, and vLLM builds the model "
        "from it; verify --reference SRC names the keys that differ; convert again"
    )
    return [Problem("error", why, str(Path(ckpt.path) / "config.json"))]


def shard_hash_problems(ckpt: Checkpoint) -> list[Problem]:
    """Problems of the shards of ``ckpt`` (its index's files) against the record in its index (:data:`~.writer.SHARDS_KEY`).

    An error for each shard whose size or content hash differs from the recorded one (naming the file), and for each
    shard the record does not list; a warning when the index is ctconvert's but holds no record (an output of a
    release before it: not judged); nothing for a folder of another tool, or for a record taken with another hash
    scheme than this installation's (:data:`~.hashing.HASH_SCHEME`: a warning). A shard that cannot be read is left
    to the checks that read it (the reader's errors name it already). Reads every byte of each shard (hashed in parallel, :func:`.hashing.shard_hash`)."""
    index = str(Path(ckpt.path) / INDEX_NAME)
    if ckpt.index is None and (Path(ckpt.path) / PROVENANCE).is_file():  # ctconvert writes an index into every output
        why = (
            "the index ctconvert wrote is missing (the folder holds its ctconvert-provenance.json): the shards' bytes and the "
            "quantization_config cannot be compared with what was written; restore it or convert again"
        )
        return [Problem("error", why, index)]
    meta = _metadata(ckpt)
    record = meta.get(SHARDS_KEY)
    if not isinstance(record, dict):
        if removed := _removed(meta, SHARDS_KEY, index, required=True):
            return removed
        if MARKER in meta:
            why = "the index records no shard hashes (an output of an earlier ctconvert release, or the record was removed): the shards' bytes are not compared"
            return [Problem("warning", why, index)]
        return []
    if record.get("hash") != HASH_SCHEME:
        taken = f"the shard hashes were taken with {record.get('hash')!r}, this installation hashes with {HASH_SCHEME!r}"
        if RECORDS_KEY in meta:  # a release that lists its records hashes with this scheme: the record was edited
            return [Problem("error", f"{taken}, the only scheme of a release that lists its records: the record was edited", index)]
        return [Problem("warning", f"{taken}: not compared", index)]
    if not isinstance(files := record.get("files"), dict):  # (not "no hash for this shard", repeated for each)
        return [Problem("error", f"the index's {SHARDS_KEY} record is malformed (its files are not a table): the record was edited", index)]
    problems, unread = [], {p.file for p in ckpt.problems if p.severity == "error"}  # (a truncated shard: said once, by the reader)
    for path in sorted(p for p in ckpt.files if str(p) not in unread):
        rec = files.get(path.name)
        if rec is None:
            problems.append(Problem("error", "no hash recorded for this shard in the index (it was not written with the others)", str(path)))
            continue
        try:
            why = record_mismatch(path, rec)
        except (OSError, ValueError, KeyError, AttributeError):
            continue  # unreadable: reported by the checks that read it
        if why is not None:
            problems.append(Problem("error", f"{why}: the shard was changed or damaged after it was written", str(path)))
    return problems


def file_hash_problems(ckpt: Checkpoint, added: bool = True) -> list[Problem]:
    """An error for each file of the output's :data:`~.file_records.FILE_HASHES_KEY` record (the files the run copied
    or wrote beside its shards: tokenizer, ``generation_config.json``, chat template, model card) that is missing or
    differs from it (:func:`.file_records.mismatch`): vLLM and transformers read them as they are, and no tensor shows an
    edit (a trial's edited ``generation_config.json`` passed a plain verify). An error too for a file the index lists
    as written (:data:`~.writer.FILES_KEY`) that the record lacks, and where the record is gone from an index that
    lists it or beside a provenance of format :data:`.provenance.FILE_HASHES_SINCE_FORMAT` (the record, or an entry,
    deleted to hide an edit), or holds another hash scheme. With ``added``, a warning names the files of the folder the
    run did not write (added afterwards: not judged; ``verify --reference`` names them itself). Nothing for an index
    without the record of an earlier release or another tool."""
    meta, index = _metadata(ckpt), str(Path(ckpt.path) / INDEX_NAME)
    record, files = meta.get(FILE_HASHES_KEY), _recorded_files(meta)
    if files is None:
        exists, doc = _provenance(ckpt.path)
        return _removed(meta, FILE_HASHES_KEY, index, required=exists and _format(doc) >= FILE_HASHES_SINCE_FORMAT)
    if record.get("hash") != HASH_SCHEME:
        why = f"the other files' hashes were taken with {record.get('hash')!r}, this installation hashes with {HASH_SCHEME!r}"
        return [Problem("error" if RECORDS_KEY in meta else "warning", f"{why}: not compared", index)]
    problems, after = [], "changed after the run, and vLLM and transformers read it as it is; restore it or convert again"
    for name, rec in sorted(files.items()):
        if not _inside(name):  # (verify reads no file outside the folder)
            problems.append(Problem("error", f"the index's {FILE_HASHES_KEY} record names {name}, outside the folder: the record was edited", index))
        elif not well_formed(rec):
            problems.append(Problem("error", f"{name}: its record in the index is not a size and a {HASH_NAME} hash: the record was edited", index))
        elif (why := mismatch(Path(ckpt.path) / name, rec)) is not None:
            problems.append(Problem("error", f"{why}: {after}", str(Path(ckpt.path) / name)))
    return problems + _unrecorded(ckpt, meta, set(files), index, added)


def link_problems(ckpt: Checkpoint) -> list[Problem]:
    """A warning naming the shards and recorded files of a ctconvert output (its :data:`~.writer.MARKER`) that are
    symlinks: ctconvert writes none, their bytes may change without the folder changing, and a copy or upload of the
    folder may not carry them (a trial's ``--resume`` kept a shard replaced by a link to a file outside)."""
    meta = _metadata(ckpt)
    if MARKER not in meta:
        return []
    names = _own_files(ckpt) | {n for n in _recorded_files(meta) or {} if _inside(n)}
    links = sorted(n for n in names if (Path(ckpt.path) / n).is_symlink())
    if not links:
        return []
    why = f"symlinks where ctconvert wrote files ({', '.join(links)}): their bytes can change without the folder, and a copy or upload may not carry them"
    return [Problem("warning", why, str(ckpt.path))]


def _unrecorded(ckpt: Checkpoint, meta: dict, recorded: set[str], index: str, added: bool) -> list[Problem]:
    """An error for the files :data:`~.writer.FILES_KEY` lists as written that the record lacks (beside the shards, the
    index, ``config.json`` and the provenance, which have records of their own); a warning for the files of the folder
    that neither lists (hidden ones aside)."""
    listed = meta.get(FILES_KEY)
    if not isinstance(listed, list):
        return []
    own = _own_files(ckpt)
    lacking = sorted({str(n) for n in listed} - own - recorded)
    problems = []
    if lacking:
        shown = ", ".join(lacking)
        why = f"the index's {FILE_HASHES_KEY} record lacks files the run wrote ({FILES_KEY} lists them: {shown}): the record was edited; convert again"
        problems.append(Problem("error", why, index))
    if not added:
        return problems
    root = Path(ckpt.path)
    on_disk = {p.relative_to(root) for p in root.rglob("*") if p.is_file() or p.is_symlink()}  # (a link to nothing or to a folder too)
    extra = sorted({str(r) for r in on_disk if not any(x.startswith(".") for x in r.parts)} - {str(n) for n in listed} - own - recorded)
    if extra:
        shown = ", ".join(extra)
        why = f"files the run did not write (added afterwards; vLLM and transformers may read them, and verify does not judge them): {shown}"
        problems.append(Problem("warning", why, str(root)))
    return problems


def _recorded_files(meta: dict) -> dict | None:
    """The ``files`` of the index's :data:`~.file_records.FILE_HASHES_KEY` record (relative path -> record), or None
    where there is no such record or it is not of that shape."""
    record = meta.get(FILE_HASHES_KEY)
    files = record.get("files") if isinstance(record, dict) else None
    return files if isinstance(files, dict) else None


def _inside(name: str) -> bool:
    """Whether a recorded relative path stays inside the folder (not absolute, no ``..``)."""
    return not Path(name).is_absolute() and ".." not in Path(name).parts


def _own_files(ckpt: Checkpoint) -> set[str]:
    """The files with records of their own: the index, ``config.json``, the provenance and the shards."""
    weight_map = (ckpt.index or {}).get("weight_map")
    return {INDEX_NAME, CONFIG_NAME, PROVENANCE, *(weight_map.values() if isinstance(weight_map, dict) else ()), *(p.name for p in ckpt.files)}


def provenance_module_problems(ckpt: Checkpoint) -> list[Problem]:
    """An error where modules the output's ``ctconvert-provenance.json`` records (each output tensor's module: its
    name up to the last dot) hold no tensor in the shards: a shard dropped with its index entries and records (a new
    user's edit that left ``lm_head`` or the embedding out, which vLLM refuses) still shows against the provenance.
    Modules, not tensors: ``repack`` and ``decompress`` keep their input's provenance while renaming the parts. Nothing
    where there is no provenance or it cannot be read."""
    path = Path(ckpt.path) / PROVENANCE
    try:
        recorded = json.loads(path.read_text()).get("tensors")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(recorded, dict) or not ckpt.tensors:
        return []
    held = {n.rpartition(".")[0] for n in ckpt.tensors}
    lost = sorted({n.rpartition(".")[0] for n in recorded} - held)
    if not lost:
        return []
    shown = ", ".join(m or "(top level)" for m in lost[:3]) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
    why = f"{len(lost)} modules the provenance records hold no tensor in the shards ({shown}): a shard or its tensors were removed after the run"
    return [Problem("error", why, str(path))]
