"""Write a checkpoint folder atomically: shards, index, config.json, copied files.

Everything goes into a hidden folder next to the output (``.<name>.ctconvert-partial``); only when every shard is
flushed, the index and ``config.json`` written and the other files copied is that folder renamed to the output path. A
run that dies leaves only the hidden folder, which no loader takes for a checkpoint (it has no ``config.json`` or
index); a later run either resumes from it (``--resume``) or clears it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from .. import __version__
from ..errors import STOP_SIGNALS, OutputError, UsageError, human_bytes, plural
from .file_records import FILE_HASHES_KEY, INDEX_DIGEST_KEY, file_records, index_digest, record_mismatch
from .hashing import HASH_NAME, HASH_SCHEME, shard_hash
from .json_text import Encoded, canonical_digest, dumps_indented
from .reader import CONFIG_NAME, INDEX_NAME
from .shard_file import PlannedTensor, ShardFile


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units, as transformers); ``"512MiB"`` binary; ints pass."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for u, mult in units.items():  # noqa: B007 - mult is read after the loop (break)
        if t.endswith(u):
            num = t[: -len(u)]
            break
    else:
        num, mult = t, 1
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise UsageError(f"cannot read size {text!r} (try 5GB, 500MB, 2GiB)") from None
    if value <= 0:
        raise UsageError(f"size must be positive, got {text!r}")
    return value


def assign_shards(tensors: list[PlannedTensor], max_shard_size: int) -> list[list[PlannedTensor]]:
    """Split tensors, in order, into shards of at most ``max_shard_size`` bytes (a larger tensor gets a shard of its own, as transformers does)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """transformers' names: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def check_output_path(src: Path, out: Path, overwrite: bool, resume: bool = False) -> None:
    """Refuse an output that is, contains or lies inside the input, or exists without ``overwrite`` (``resume``: the
    run was asked to resume, and an earlier output of this source there is a finished one: nothing to resume)."""
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents or o in s.parents:
        raise UsageError(f"output {out} overlaps the input {src}; ctconvert never writes into its input")
    if o.exists() and not overwrite:
        if o.is_dir() and replaceable(o) and not not_written_here(o, s):
            if resume:
                why = "output path holds a finished conversion: nothing to resume; --refresh brings it up to date, --overwrite replaces it"
                raise OutputError(why, file=out)
            raise OutputError("output path exists; pass --overwrite (overwrite=True in the API and batch jobs) to replace it", file=out)
        raise OutputError("output path exists and is not an earlier ctconvert output (which --overwrite replaces); choose another -o", file=out)
    if o.exists() and not o.is_dir():
        raise OutputError("output path exists and is not a folder", file=out)
    if o.exists() and not replaceable(o):
        entries = sorted(p.name for p in o.iterdir())
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise OutputError(
            f"--overwrite replaces only an earlier ctconvert output or an empty folder, and this folder holds "
            f"{plural(len(entries), 'other entry', 'other entries')} ({shown}); remove it yourself or choose another -o",
            file=out,
        )
    if o.exists() and overwrite:
        foreign = not_written_here(o, s)
        if foreign:
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            raise OutputError(
                f"--overwrite would delete {plural(len(foreign), 'file')} that ctconvert did not write ({shown}); "
                f"move {'it' if len(foreign) == 1 else 'them'} out of the folder, or choose another -o",
                file=out,
            )
    for parent in o.parents:  # the first existing ancestor must be a folder
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"cannot create the output folder: {parent} is a file, not a folder", file=out)
            break


JOURNAL = "ctconvert-journal.json"
#: the index metadata key that marks a folder as written by ctconvert (what ``--overwrite`` may replace)
MARKER = "ctconvert"
#: the per-tensor provenance every quantize output holds (:mod:`.provenance`); also how outputs of releases before
#: the marker are recognised
PROVENANCE = "ctconvert-provenance.json"


def _index(folder: Path) -> dict:
    """The folder's safetensors index as a dict whose ``metadata`` is a dict; empty where it is missing or broken."""
    index = _json_object(folder / INDEX_NAME)
    return {**index, "metadata": index["metadata"] if isinstance(index.get("metadata"), dict) else {}}


def replaceable(folder: Path) -> bool:
    """Whether ``--overwrite`` may replace ``folder``: empty, or written by ctconvert (its index says so)."""
    if not any(folder.iterdir()):
        return True
    if MARKER in _index(folder).get("metadata", {}):
        return True
    return (folder / PROVENANCE).is_file() and (folder / INDEX_NAME).is_file()


#: the index metadata key listing every file (relative path) a ctconvert output holds: what ``--overwrite`` may delete
FILES_KEY = "ctconvert_files"
#: the index metadata key holding every shard's size and content hash as it was written (``{"hash": HASH_SCHEME,
#: "files": {shard: {"size": bytes, HASH_NAME: hex}}}``): what ``verify`` compares the shards' bytes with
SHARDS_KEY = "ctconvert_shards"
#: the index metadata keys holding the hash (:func:`config_digest`) of the ``quantization_config`` the run wrote into
#: ``config.json`` (vLLM loads the tensors as it says), of the whole ``config.json`` (vLLM builds the model from it) and
#: of the output's ``ctconvert-provenance.json`` (``verify`` reads from it what the output was made from)
QCFG_KEY, CONFIG_KEY, PROVENANCE_KEY = "ctconvert_quantization_config", "ctconvert_config", "ctconvert_provenance"
#: the index metadata key listing the records above this index holds: an index holding it is of a release that writes
#: them, so ``verify`` fails one listed or always written but absent, ``null`` or of another hash scheme
RECORDS_KEY = "ctconvert_records"


def config_digest(cfg: dict) -> str:
    """The sha256 (hex) of a ``quantization_config`` (or of a whole config) as canonical JSON (keys sorted, no spaces):
    the same for the dict a run writes and for the one read back from ``config.json`` (:func:`.json_text.canonical_digest`)."""
    return canonical_digest(cfg)


def not_written_here(folder: Path, src: Path) -> list[str]:
    """The files (relative paths, sorted) of an earlier ctconvert output ``folder`` that ctconvert did not write,
    which ``--overwrite`` must not delete in silence. The output's index lists the files it wrote
    (:data:`FILES_KEY`); an output of a release before that list counts as written: its index, shards,
    config, provenance and journal, and files named as in ``src`` (the copies a run makes of its input's files)."""
    files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    index = _index(folder)
    listed = index.get("metadata", {}).get(FILES_KEY)
    if isinstance(listed, list):
        ours = {str(x) for x in listed}
    else:
        wm = index.get("weight_map")
        ours = {INDEX_NAME, CONFIG_NAME, PROVENANCE, JOURNAL, *(wm.values() if isinstance(wm, dict) else ())}
        ours |= {str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()} if src.is_dir() else set()
    return sorted(files - ours)


#: files of other weight formats that a converted checkpoint must not carry along (dense copies of the weights)
OTHER_WEIGHT_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".onnx_data", ".tflite", ".mlmodel", ".npz")
OTHER_WEIGHT_FOLDERS = ("original", "onnx", "openvino", "coreml", "tflite", "gguf", "flax")


def is_other_weights(rel: Path) -> bool:
    """Whether a file of the input (path relative to its folder) holds weights in another format."""
    return rel.suffix.lower() in OTHER_WEIGHT_SUFFIXES or (len(rel.parts) > 1 and rel.parts[0].lower() in OTHER_WEIGHT_FOLDERS)


def free_space_problem(out: Path, needed: int) -> str | None:
    """Why ``needed`` bytes cannot be written next to ``out`` (a message), or None."""
    parent = Path(out).absolute().parent
    while not parent.exists():
        parent = parent.parent
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return None
    if free >= needed:
        return None
    return f"not enough free space: the output needs {human_bytes(needed)} and {parent} has {human_bytes(free)} free"


def partial_folder(out: Path) -> Path:
    """The hidden folder a run toward ``out`` writes into, next to it: ``.<name>.ctconvert-partial``."""
    out = Path(out).absolute()
    return out.parent / f".{out.name}.ctconvert-partial"


def _json_object(path: Path) -> dict:
    """The JSON object in the file ``path`` (a journal, an index, a provenance); {} when there is none or it is unreadable."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def partial_output(out: Path) -> dict | None:
    """What an interrupted or failed run toward ``out`` left: ``{"path", "bytes", "shards"}``, or None."""
    folder = partial_folder(out)
    if not folder.is_dir():
        return None
    # the bytes on disk (``du``): a shard is created at its full size and filled in place, so its length says nothing
    size = sum(min(st.st_size, st.st_blocks * 512) for p in folder.rglob("*") if p.is_file() for st in [p.stat()])
    return {"path": str(folder), "bytes": size, "shards": finished_shards(out)}


def disk_full(e: BaseException) -> bool:
    """Whether an error (or one it was raised from) is a full disk or an exhausted quota."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def finished_shards(out: Path) -> int:
    """How many shards an interrupted run toward ``out`` finished and journaled (what ``--resume`` keeps)."""
    shards = _json_object(partial_folder(out) / JOURNAL).get("shards")
    return len(shards) if isinstance(shards, dict) else 0


class OutputFolder:
    """The hidden folder that becomes the output checkpoint on :meth:`commit`.

    It is named ``.<out>.ctconvert-partial`` next to the output and holds a
    journal (``ctconvert-journal.json``): a fingerprint of the run (source
    identity and options) and, for every shard finished so far, its size and
    block hash (:mod:`.hashing`). A later run with ``resume`` and the same fingerprint keeps every
    journaled shard whose bytes still hash the same; any other run starts it
    afresh. A lock (``flock``) keeps two runs out of one folder.

    The one way every command writes a checkpoint (``quantize``, ``convert``, ``repack``, ``decompress``)::

        with OutputFolder(out, overwrite=overwrite) as folder:   # the hidden folder, locked
            fill(folder.open_shards(assign_shards(planned, limit)))   # every shard with its final header
            folder.copy_files(src, skip={CONFIG_NAME})
            folder.finish(config, total_bytes, {name: json_document})

    Leaving the block commits (renames the folder into place); an exception aborts it, keeping the
    partial folder for ``--resume`` only where :attr:`keep_partial` says so (never on a full disk).
    """

    #: set by a writer whose interrupted run can be resumed: an error or Ctrl-C then keeps the partial folder
    keep_partial: bool = False

    def __init__(self, out: Path, overwrite: bool = False, fingerprint: str = "", resume: bool = False, shard_sources=None):
        self.out = Path(out).absolute()
        self.shard_sources = shard_sources  # shard name -> {source tensor: content hash}, journaled with the shard
        self.overwrite = overwrite
        self.fingerprint = fingerprint
        parent = self.out.parent
        self.tmp = partial_folder(self.out)
        self.journal: dict = {"fingerprint": fingerprint, "shards": {}}
        self.reused: dict[str, str] = {}
        self._lock = threading.Lock()
        self._journal_closed = self._aborted = False  # (the first set by commit and abort: no journal is written after them)
        self._pending: list = []
        self.linked_partial = self.tmp.is_symlink()  # a link put in its place is removed, never written through (the output would be a link)
        created = self.linked_partial or not self.tmp.exists()
        try:
            parent.mkdir(parents=True, exist_ok=True)
            if self.linked_partial:
                self.tmp.unlink()
            for stale in parent.glob(f".{self.out.name}.ctconvert-tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            self.tmp.mkdir(exist_ok=True)
            self._lockfd = os.open(self.tmp / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OutputError("another ctconvert run is writing this output", file=self.out) from None
            old = _json_object(self.tmp / JOURNAL)
            self.lost_journal = resume and not old.get("shards") and any(p.suffix == ".safetensors" for p in self.tmp.iterdir())
            self.discarded_partial = bool(old.get("shards")) and old.get("fingerprint") != fingerprint
            keep = {".lock"}
            if resume and old.get("fingerprint") == fingerprint:
                self.journal["shards"] = {k: v for k, v in old.get("shards", {}).items() if self._still_valid(k, v)}
                self.damaged_partial = sorted(set(old.get("shards", {})) - set(self.journal["shards"]))  # written again
                keep |= {JOURNAL, *self.journal["shards"]}  # the rest is written again, and nothing else may ride along as the run's
                # (the run's unfinished shards among them: the plan tells them from files put there, stages.write)
                gone = [p for p in self.tmp.iterdir() if p.name not in keep | {JOURNAL + ".new"}]  # (a link named so: its target stays)
                self.removed_partial = sorted(p.name + (" (a symlink; its target left as it is)" if p.is_symlink() else "") for p in gone)
            for p in self.tmp.iterdir():
                if p.name not in keep:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            self._save_journal()
        except BaseException as e:  # an error or a Ctrl-C before the caller holds the folder: nothing of this run stays
            self._undo(created)
            if isinstance(e, OSError):
                raise OutputError(f"cannot create the output folder (-o): {e.strerror or e}", file=self.out) from e
            raise
        self.shards: list[ShardFile] = []
        self.weight_map: dict[str, str] = {}

    def _undo(self, created: bool) -> None:
        """Release what a failed ``__init__`` took: the lock, and the partial folder where this run created it (one
        an earlier run left for ``--resume``, or another run holds, stays)."""
        fd = getattr(self, "_lockfd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if created:
            _remove_folder(self.tmp)

    def _still_valid(self, name: str, rec: dict) -> bool:
        p = self.tmp / name
        # a link planted meanwhile (symbolic, or a hard link that shares the shard's bytes with a file outside): written again
        return p.is_file() and not p.is_symlink() and p.stat().st_nlink == 1 and record_mismatch(p, rec) is None

    def _save_journal(self) -> None:
        with self._lock:
            if self._journal_closed:
                return
            data = dumps_indented(self.journal, 1)
            tmp = self.tmp / (JOURNAL + ".new")
            tmp.write_text(data)
            os.replace(tmp, self.tmp / JOURNAL)

    def journaled(self, name: str) -> dict:
        """The journal record of a finished shard (``size``, hash, ``sources`` when recorded)."""
        return self.journal["shards"][name]

    def forget(self, names) -> None:
        """Drop finished shards from the journal (and delete them): they are written again."""
        for name in names:
            self.journal["shards"].pop(name, None)
            (self.tmp / name).unlink(missing_ok=True)
        self._save_journal()

    @property
    def completed(self) -> set[str]:
        """Shard names already finished and journaled (kept from an earlier run)."""
        return set(self.journal["shards"])

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None and not self._aborted:  # (a folder aborted inside the block is not committed)
            try:
                self.commit()
            except BaseException as e:
                self.abort_for(e)
                raise
        else:
            self.abort_for(exc)
        return False

    def abort_for(self, exc: BaseException) -> None:
        """Abort after ``exc``: keep the partial folder for ``--resume`` where :attr:`keep_partial` allows it and
        the run was stopped (Ctrl-C) or failed writing (not on a full disk: a partial folder only keeps it full)."""
        stopped = isinstance(exc, (KeyboardInterrupt, OutputError, OSError))
        self.abort(keep=self.keep_partial and stopped and not disk_full(exc))

    def open_shards(self, shards: list[list[PlannedTensor]], reuse_from: dict[str, Path] | None = None) -> dict[str, ShardFile]:
        """Create every shard file with its final header; return tensor name -> shard.

        Shards already completed (resume) are kept as they are; those named in
        ``reuse_from`` (refresh) are copied from there and journaled. Writes
        aimed at kept shards are dropped. Raises :class:`OutputError` before creating any
        file when the disk cannot hold the shards still to write or copy (:func:`free_space_problem`).
        """
        by_tensor: dict[str, ShardFile] = {}
        reuse_from = reuse_from or {}
        kept = self.completed  # already here; a shard reused by refresh is copied here, so it needs its room too
        needed = sum(t.nbytes for name, ts in zip(shard_names(len(shards)), shards) if name not in kept for t in ts)
        if (problem := free_space_problem(self.out, needed)) is not None:
            raise OutputError(problem, file=self.out)
        for name, tensors in zip(shard_names(len(shards)), shards):
            if name in reuse_from and name not in self.journal["shards"]:
                shutil.copyfile(reuse_from[name], self.tmp / name)
                self.journal["shards"][name] = {"size": (self.tmp / name).stat().st_size, HASH_NAME: shard_hash(self.tmp / name)}
                self.reused[name] = "refresh"
            if name in self.journal["shards"]:
                self.reused.setdefault(name, "resume")
                f = ShardFile.existing(self.tmp / name, tensors)
            else:
                f = ShardFile(self.tmp / name, tensors, on_complete=self._shard_done)
            self.shards.append(f)
            for t in tensors:
                by_tensor[t.name] = f
                self.weight_map[t.name] = name
        self._save_journal()
        return by_tensor

    def _shard_done(self, shard: ShardFile) -> None:
        """A shard got all its bytes: flush it, then hash and journal it in the background."""
        shard.close()
        done = threading.Event()
        errors: list[BaseException] = []

        def record():
            try:
                self.journal_shard(shard.path.name, shard.path.stat().st_size, shard.content_hash())  # hashed as written
            except BaseException as e:  # noqa: BLE001 - surfaced by finish()
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=record, daemon=True, name="ctconvert-hash").start()
        self._pending.append((done, errors))

    def journal_shard(self, name: str, size: int, content_hash: str) -> None:
        """Journal shard ``name`` as finished: its ``size`` and content hash (:func:`.hashing.combine_shard_hash`),
        and what it was made from (``shard_sources``). Also for a shard another process wrote into the folder
        (the Ray executor's workers: :mod:`ctconvert.pipeline.ray_executor`)."""
        rec = {"size": size, HASH_NAME: content_hash}
        if self.shard_sources is not None:
            rec["sources"] = self.shard_sources(name)
        with self._lock:
            self.journal["shards"][name] = rec
        self._save_journal()

    def write_json(self, name: str, data: dict | Encoded, sort_keys: bool = False) -> None:
        """``data`` as ``json.dump(data, f, indent=2, sort_keys=sort_keys)`` writes it, and a newline, into the
        folder's file ``name`` (:func:`.json_text.dumps_indented`: the same text, twice as fast; an :class:`Encoded`: its text)."""
        text = data.text if isinstance(data, Encoded) else dumps_indented(data, 2, sort_keys=sort_keys)
        try:
            with open(self.tmp / name, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            raise OutputError(f"cannot write: {e.strerror or e}", file=self.tmp / name) from e

    def copy_files(self, src: Path, skip: set[str], keep_other_weights: bool = False) -> list[str]:
        """Copy every file of ``src`` (recursively) except its own shards (top-level safetensors; those of a subfolder, a
        sentence-transformers module's, are copied), the index, ``skip`` and, unless
        ``keep_other_weights``, weights in other formats (:func:`is_other_weights`; listed in
        :attr:`skipped`); symlinks to a folder or to nothing are not followed (listed in :attr:`links`). Returns the
        copied paths (relative)."""
        copied = []
        self.skipped: list[str] = []
        self.links: list[str] = []
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if any(part.startswith(".") and part != ".gitattributes" for part in rel.parts):
                continue
            if not p.is_file() or (p.suffix == ".safetensors" and len(rel.parts) == 1) or rel.name == INDEX_NAME or str(rel) in skip:
                if p.is_symlink() and not p.is_file():  # to a folder (not followed) or to nothing
                    self.links.append(str(rel))
                continue
            if not keep_other_weights and is_other_weights(rel):
                self.skipped.append(str(rel))
                continue
            dest = self.tmp / rel
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dest)
            except OSError as e:
                raise OutputError(f"cannot copy: {e.strerror or e}", file=p) from e
            copied.append(str(rel))
        return copied

    def finish(self, config: dict, total_size: int, extra_json: dict[str, dict | Encoded] | None = None) -> None:
        """Close shards, write the index (its records: the shards', the ``quantization_config``'s, ``config.json``'s, the provenance's
        and the other files' hashes, and its digest of itself, :data:`RECORDS_KEY`), extra JSON files (a dict, or one
        :class:`.json_text.Encoded` ahead) and ``config.json`` (last), and flush every file and folder of the output to disk
        (before :meth:`commit` renames it into place)."""
        for f in self.shards:
            f.close()
        names = {str(p.relative_to(self.tmp)) for p in self.tmp.rglob("*") if p.is_file()} - {JOURNAL, JOURNAL + ".new", ".lock"}
        names |= {INDEX_NAME, CONFIG_NAME, *(extra_json or {})}
        meta = {"total_size": total_size, MARKER: __version__, FILES_KEY: sorted(names), SHARDS_KEY: self._shard_records()}
        prov = (extra_json or {}).get(PROVENANCE) or _json_object(self.tmp / PROVENANCE)  # one copied (repack) too
        digests = {QCFG_KEY: config.get("quantization_config"), CONFIG_KEY: config, PROVENANCE_KEY: prov or None}
        meta.update({key: doc.digest if isinstance(doc, Encoded) else config_digest(doc) for key, doc in digests.items() if isinstance(doc, (dict, Encoded))})
        own = {INDEX_NAME, CONFIG_NAME, PROVENANCE, *(extra_json or {}), *self.weight_map.values(), *(f.path.name for f in self.shards)}
        meta[FILE_HASHES_KEY] = file_records(self.tmp, sorted(names - own))  # the copied files, the card: as written now
        meta[RECORDS_KEY] = [k for k in (SHARDS_KEY, *digests, FILE_HASHES_KEY) if k in meta] + [INDEX_DIGEST_KEY]
        index = {"metadata": meta, "weight_map": dict(sorted(self.weight_map.items()))}
        meta[INDEX_DIGEST_KEY] = index_digest(index)  # (of the index without it: the records themselves guarded)
        self.write_json(INDEX_NAME, index)
        for name, data in (extra_json or {}).items():
            self.write_json(name, data)
        self.write_json(CONFIG_NAME, config, sort_keys=True)
        # every other file on disk before the folder is renamed into place (the shards this run wrote: ShardFile.close; those --refresh
        # copied are not yet), else a crash just after the rename could leave a complete-looking output with an empty config.json or index
        closed = {f.path.name for f in self.shards if not f.kept}
        for name in sorted(names - closed):
            _fsync(self.tmp / name)
        for sub in sorted({(self.tmp / n).parent for n in names}, reverse=True):  # the copied files' subfolders too
            _fsync(sub, folder=True)

    def _shard_records(self) -> dict:
        """Every shard's journal record (size and content hash, as written: :meth:`journal_shard`), once the hashes
        still being taken are done; the index keeps them (:data:`SHARDS_KEY`) for ``verify``. A hash that failed
        raises its error here."""
        for done, errors in self._pending:
            done.wait()
            if errors:
                raise errors[0]
        shards = {f.path.name for f in self.shards}
        with self._lock:
            files = {n: {"size": r["size"], HASH_NAME: r[HASH_NAME]} for n, r in sorted(self.journal["shards"].items()) if n in shards}
        return {"hash": HASH_SCHEME, "files": files}

    def commit(self) -> None:
        """Rename the finished folder into place (replacing an old output with ``overwrite``).

        Ctrl-C is held off for the whole step: between moving an old output aside and renaming the
        new one in, an interrupt would leave neither at the path, and once the new one is in place
        the run has succeeded (a late Ctrl-C must not report a failure or leave the old one behind).
        """
        with _interrupts_held():
            self._commit()

    def _commit(self) -> None:
        self._lock.acquire()
        self._journal_closed = True
        for name in (JOURNAL, JOURNAL + ".new", ".lock"):
            try:
                (self.tmp / name).unlink()
            except OSError:
                pass
        old = None
        try:
            if self.out.exists():
                old = self.out.parent / f".{self.out.name}.ctconvert-old-{os.getpid()}"
                os.rename(self.out, old)
            os.rename(self.tmp, self.out)
            _fsync(self.out.parent, folder=True)
        except OSError as e:
            if old is not None and not self.out.exists():
                os.rename(old, self.out)
            raise OutputError(f"cannot move the finished output into place: {e.strerror or e}", file=self.out) from e
        finally:
            with contextlib.suppress(OSError):
                os.close(self._lockfd)
            self._lock.release()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self, keep: bool = False) -> None:
        """Stop writing. With ``keep`` the partial folder stays for ``--resume``; else it is removed. No journal is
        written from here on (a shard finishing on a writer thread would create one inside a folder being removed, which
        then stays behind: seen once, a Ctrl-C at the end of a ``--target`` run under load). Runs once (later calls: nothing)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = self._journal_closed = True
        for f in self.shards:
            f.abort()
        for done, _ in self._pending:
            done.wait(5)
        if not keep:
            _remove_folder(self.tmp)
        with contextlib.suppress(OSError):
            os.close(self._lockfd)


def _remove_folder(folder: Path, tries: int = 5) -> None:
    """Remove ``folder`` and everything in it, again where an entry appeared while it was being removed (a thread still
    finishing a file); errors are ignored (a folder that cannot be removed is left, as ``rmtree(ignore_errors)`` does)."""
    for _ in range(tries):
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return
        time.sleep(0.02)


@contextlib.contextmanager
def _interrupts_held():
    """Defer Ctrl-C, SIGTERM and SIGHUP (main thread only, where Python runs signal handlers) for a critical
    step; an interrupt that arrives meanwhile is dropped: the step completes and the run succeeds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _fsync(path: Path, folder: bool = False) -> None:
    """Flush a file (or, with ``folder``, a folder's entries) of the output to disk. Raises :class:`OutputError`
    naming a file that cannot be flushed; a folder is flushed where the filesystem allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if not folder:
            raise OutputError(f"cannot flush: {e.strerror or e}", file=path) from e
