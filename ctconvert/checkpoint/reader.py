"""Open a Hugging Face checkpoint folder: validate it from the headers alone.

Handles a single ``model.safetensors`` and sharded checkpoints described by
``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {name:
file}}``, the transformers convention). Tensor data is read lazily, by row
range, through :mod:`ctconvert.checkpoint.safetensors_io`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInputError
from .safetensors_io import TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


@dataclass
class Problem:
    """A finding of validation: ``severity`` is ``"error"`` or ``"warning"``."""

    severity: str
    message: str
    file: str | None = None
    tensor: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Checkpoint:
    """A validated checkpoint folder: config, index and every tensor's location."""

    path: Path
    config: dict
    tensors: dict[str, TensorInfo]
    files: list[Path]
    index: dict | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def quantization_config(self) -> dict | None:
        q = self.config.get("quantization_config")
        if q is None and isinstance(self.config.get("text_config"), dict):
            q = self.config["text_config"].get("quantization_config")
        return q

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _load_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise BadInputError(f"cannot read {what}: {e.strerror or e}", file=path) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"{what} is not valid JSON ({e})", file=path) from e
    if not isinstance(data, dict):
        raise BadInputError(f"{what} is not a JSON object", file=path)
    return data


def open_checkpoint(path: str | Path, *, strict: bool = True) -> Checkpoint:
    """Read every header of the checkpoint at ``path`` and validate the folder.

    Checks: the folder exists; ``config.json`` exists and parses; the index (if
    any) parses and names only files that exist; every tensor of every shard is
    listed in the index under that shard; no tensor appears twice; every
    indexed tensor exists. With ``strict`` (conversion) the first problem
    raises :class:`BadInputError`; without it (``inspect``) problems are
    collected in ``Checkpoint.problems`` and reading goes on where it can.
    """
    root = Path(path)
    problems = _Problems(strict)
    if not root.is_dir():
        raise BadInputError(_not_a_folder(root), file=root)
    config = _config(root, problems)
    index, files, weight_map = _shard_files(root, problems)
    unreadable: set[str] = set()
    tensors = _headers(files, weight_map, problems, unreadable)
    if weight_map is not None:
        present_files = {f.name for f in files} - unreadable  # an unreadable shard is reported once, not per tensor
        for name, fname in weight_map.items():
            if name not in tensors and fname in present_files:
                problems.add(f"index lists this tensor in {fname!r} but the shard does not hold it", file=root / INDEX_NAME, tensor=name)
    return Checkpoint(root, config, tensors, files, index, problems.found)


class _Problems:
    """Findings of validation: raised at once when strict, else collected."""

    def __init__(self, strict: bool):
        self.strict, self.found = strict, []

    def add(self, message: str, file=None, tensor=None, severity: str = "error") -> None:
        if self.strict and severity == "error":
            raise BadInputError(message, file=file, tensor=tensor)
        self.found.append(Problem(severity, message, str(file) if file else None, tensor))

    def caught(self, e: BadInputError, file) -> None:
        """A read that failed: re-raised when strict, else recorded with its own file."""
        if self.strict:
            raise e
        self.found.append(Problem("error", e.message, str(e.file or file), e.tensor))


def _config(root: Path, problems: _Problems) -> dict:
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        problems.add("config.json is missing", file=cfg_path)
        return {}
    try:
        return _load_json(cfg_path, "config.json")
    except BadInputError as e:
        problems.caught(e, cfg_path)
        return {}


def _shard_files(root: Path, problems: _Problems) -> tuple[dict | None, list[Path], dict[str, str] | None]:
    """``(index, shard files, weight_map)``: from the index when there is one, else the folder's ``*.safetensors``."""
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        files = sorted(root.glob("*.safetensors"))
        if not files:
            try:  # a folder of models (a model store): name the checkpoints in it
                inner = sorted(d.name for d in root.iterdir() if d.is_dir() and (d / "config.json").is_file() and any(d.glob("*.safetensors")))
            except OSError:
                inner = []
            hint = f"; it holds checkpoint folders ({', '.join(inner[:4])}{', ...' if len(inner) > 4 else ''}): give one of them" if inner else ""
            other = sorted(f.name for f in root.glob("*") if f.suffix in (".bin", ".pt", ".pth", ".gguf", ".ckpt"))
            if other and not inner:  # weights in another format: ctconvert reads safetensors only
                hint = (
                    f"; it holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, weights in another format: ctconvert reads "
                    "safetensors only (transformers' save_pretrained writes them: AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(NEW))"
                )
            raise BadInputError(f"no *.safetensors file and no model.safetensors.index.json{hint}", file=root)
        if len(files) > 1 and (root / "model.safetensors").is_file():
            problems.add("several .safetensors files but no index; only model.safetensors is used", file=root, severity="warning")
            files = [root / "model.safetensors"]
        return None, files, None
    index = _load_json(index_path, "the index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise BadInputError("index has no weight_map object", file=index_path)
    names = sorted(set(weight_map.values()))
    files = []
    for n in names:
        p = root / n
        if not p.is_file():
            problems.add(f"index names shard {n!r}, which does not exist", file=index_path)
        else:
            files.append(p)
    listed = set(names)
    for p in sorted(root.glob("*.safetensors")):
        if p.name not in listed:
            problems.add(f"shard {p.name!r} is not listed in the index", file=index_path)
    return index, files, weight_map


def _not_a_folder(root: Path) -> str:
    """Why ``root`` is not a checkpoint folder, and what to pass instead."""
    if root.is_file():
        if root.suffix == ".safetensors" and (root.parent / CONFIG_NAME).is_file():
            return f"is a file; give the checkpoint folder that holds it and its config.json: {root.parent}"
        return "is a file; give the checkpoint folder (config.json and the *.safetensors shards)"
    text = str(root)
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) and not root.parent.exists():
        return (
            f"no such folder; {text!r} looks like a Hugging Face Hub id: ctconvert works offline on local folders, "
            f"download it first (`hf download {text} --local-dir DIR`) and pass DIR"
        )
    return "not a checkpoint folder (does not exist or is not a directory)"


def _headers(files: list[Path], weight_map: dict[str, str] | None, problems: _Problems, unreadable: set[str]) -> dict[str, TensorInfo]:
    """Every tensor of every shard, each once and (with an index) in the shard the index names; the names of
    shards whose header cannot be read are added to ``unreadable``."""
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        try:
            infos, _meta = read_header(f)
        except BadInputError as e:
            problems.caught(e, f)
            unreadable.add(f.name)
            continue
        for name, info in infos.items():
            if name in tensors:
                problems.add(f"tensor also stored in {tensors[name].file.name}", file=f, tensor=name)
                continue
            if weight_map is not None and weight_map.get(name) != f.name:
                where = weight_map.get(name)
                msg = "tensor is not in the index" if where is None else f"index says this tensor is in {where!r}"
                problems.add(msg, file=f, tensor=name)
            tensors[name] = info
    return tensors
