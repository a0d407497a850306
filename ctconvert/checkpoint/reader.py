"""Open a Hugging Face checkpoint folder: validate it from the headers alone.

Handles a single ``model.safetensors`` and sharded checkpoints described by
``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {name:
file}}``, the transformers convention). Tensor data is read lazily, by row
range, through :mod:`ctconvert.checkpoint.safetensors_io`.
"""

from __future__ import annotations

import json
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
    problems: list[Problem] = []

    def problem(message: str, file=None, tensor=None, severity: str = "error"):
        if strict and severity == "error":
            raise BadInputError(message, file=file, tensor=tensor)
        problems.append(Problem(severity, message, str(file) if file else None, tensor))

    if not root.is_dir():
        raise BadInputError("not a checkpoint folder (does not exist or is not a directory)", file=root)
    cfg_path = root / CONFIG_NAME
    config: dict = {}
    if not cfg_path.is_file():
        problem("config.json is missing", file=cfg_path)
    else:
        try:
            config = _load_json(cfg_path, "config.json")
        except BadInputError as e:
            if strict:
                raise
            problems.append(Problem("error", e.message, str(e.file or cfg_path), e.tensor))

    index_path = root / INDEX_NAME
    index = None
    files: list[Path]
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        index = _load_json(index_path, "the index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise BadInputError("index has no weight_map object", file=index_path)
        names = sorted(set(weight_map.values()))
        files = []
        for n in names:
            p = root / n
            if not p.is_file():
                problem(f"index names shard {n!r}, which does not exist", file=index_path)
            else:
                files.append(p)
        listed = set(names)
        for p in sorted(root.glob("*.safetensors")):
            if p.name not in listed:
                problem(f"shard {p.name!r} is not listed in the index", file=index_path)
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise BadInputError("no *.safetensors file and no model.safetensors.index.json", file=root)
        if len(files) > 1 and (root / "model.safetensors").is_file():
            problem("several .safetensors files but no index; only model.safetensors is used", file=root, severity="warning")
            files = [root / "model.safetensors"]

    tensors: dict[str, TensorInfo] = {}
    for f in files:
        try:
            infos, _meta = read_header(f)
        except BadInputError as e:
            if strict:
                raise
            problems.append(Problem("error", e.message, str(e.file or f), e.tensor))
            continue
        for name, info in infos.items():
            if name in tensors:
                problem(f"tensor also stored in {tensors[name].file.name}", file=f, tensor=name)
                continue
            if weight_map is not None and weight_map.get(name) != f.name:
                where = weight_map.get(name)
                msg = "tensor is not in the index" if where is None else f"index says this tensor is in {where!r}"
                problem(msg, file=f, tensor=name)
            tensors[name] = info
    if weight_map is not None:
        present_files = {f.name for f in files}
        for name, fname in weight_map.items():
            if name not in tensors and fname in present_files:
                problem(f"index lists this tensor in {fname!r} but the shard does not hold it", file=index_path, tensor=name)
    return Checkpoint(root, config, tensors, files, index, problems)
