"""Write a checkpoint folder atomically: shards, index, config.json, copied files.

Everything goes into a hidden temporary folder next to the output
(``.<name>.ctconvert-tmp-<pid>``); only when every shard is flushed, the index
and ``config.json`` written and the other files copied is that folder renamed
to the output path. A run that dies leaves only the hidden folder, which no
loader takes for a checkpoint, and a later run removes stale ones.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import OutputError, UsageError
from .reader import CONFIG_NAME, INDEX_NAME
from .safetensors_io import PlannedTensor, ShardFile


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units, as transformers); ``"512MiB"`` binary; ints pass."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for u, mult in units.items():
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
    """Split tensors, in order, into shards of at most ``max_shard_size`` bytes.

    A tensor larger than the limit gets a shard of its own (as transformers does).
    """
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


def check_output_path(src: Path, out: Path, overwrite: bool) -> None:
    """Refuse an output that is, contains or lies inside the input, or exists without ``overwrite``."""
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents or o in s.parents:
        raise UsageError(f"output {out} overlaps the input {src}; ctconvert never writes into its input")
    if o.exists() and not overwrite:
        raise OutputError("output path exists; pass --overwrite to replace it", file=out)
    if o.exists() and not o.is_dir():
        raise OutputError("output path exists and is not a folder", file=out)


class OutputFolder:
    """The temporary folder that becomes the output checkpoint on :meth:`commit`."""

    def __init__(self, out: Path, overwrite: bool = False):
        self.out = Path(out).absolute()
        self.overwrite = overwrite
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            for stale in parent.glob(f".{self.out.name}.ctconvert-tmp-*"):
                pid = stale.name.rsplit("-", 1)[-1]
                if not (pid.isdigit() and _pid_alive(int(pid))):
                    shutil.rmtree(stale, ignore_errors=True)
            self.tmp = parent / f".{self.out.name}.ctconvert-tmp-{os.getpid()}"
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()
        except OSError as e:
            raise OutputError(f"cannot create the output folder: {e.strerror or e}", file=parent) from e
        self.shards: list[ShardFile] = []
        self.weight_map: dict[str, str] = {}

    def open_shards(self, shards: list[list[PlannedTensor]]) -> dict[str, ShardFile]:
        """Create every shard file with its final header; return tensor name -> shard."""
        by_tensor: dict[str, ShardFile] = {}
        for name, tensors in zip(shard_names(len(shards)), shards):
            f = ShardFile(self.tmp / name, tensors)
            self.shards.append(f)
            for t in tensors:
                by_tensor[t.name] = f
                self.weight_map[t.name] = name
        return by_tensor

    def write_json(self, name: str, data: dict, **kw) -> None:
        try:
            with open(self.tmp / name, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, **kw)
                f.write("\n")
        except OSError as e:
            raise OutputError(f"cannot write: {e.strerror or e}", file=self.tmp / name) from e

    def copy_files(self, src: Path, skip: set[str]) -> list[str]:
        """Copy every file of ``src`` (recursively) except safetensors, the index and ``skip``."""
        copied = []
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if not p.is_file() or p.suffix == ".safetensors" or rel.name == INDEX_NAME or str(rel) in skip:
                continue
            if any(part.startswith(".") and part != ".gitattributes" for part in rel.parts):
                continue
            dest = self.tmp / rel
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dest)
            except OSError as e:
                raise OutputError(f"cannot copy: {e.strerror or e}", file=p) from e
            copied.append(str(rel))
        return copied

    def finish(self, config: dict, total_size: int) -> None:
        """Close shards, write the index and ``config.json`` (last)."""
        for f in self.shards:
            f.close()
        self.write_json(INDEX_NAME, {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(self.weight_map.items()))})
        self.write_json(CONFIG_NAME, config, sort_keys=True)
        _fsync_dir(self.tmp)

    def commit(self) -> None:
        """Rename the finished folder into place (replacing an old output with ``overwrite``)."""
        old = None
        try:
            if self.out.exists():
                old = self.out.parent / f".{self.out.name}.ctconvert-old-{os.getpid()}"
                os.rename(self.out, old)
            os.rename(self.tmp, self.out)
            _fsync_dir(self.out.parent)
        except OSError as e:
            if old is not None and not self.out.exists():
                os.rename(old, self.out)
            raise OutputError(f"cannot move the finished output into place: {e.strerror or e}", file=self.out) from e
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop everything written so far."""
        for f in self.shards:
            f.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
