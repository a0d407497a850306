"""Small helpers shared by the tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tree_hash(path: Path, skip: tuple[str, ...] = ()) -> str:
    """sha256 over every file (relative name and bytes) under ``path``, except names in ``skip``."""
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file() and p.name not in skip:
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().cpu().contiguous().reshape(-1).view(_INT[a.element_size()])
    b = b.detach().cpu().contiguous().reshape(-1).view(_INT[b.element_size()])
    return torch.equal(a, b)
