"""Content hashes of source tensors (provenance) and output shards.

Source tensors are hashed as they stream through the reader, so the hash must
be fast: xxHash XXH3-128 (https://github.com/Cyan4973/xxHash) when the
``xxhash`` package is present, sha256 otherwise. The algorithm's name is
recorded next to every hash.
"""

from __future__ import annotations

import hashlib

try:
    import xxhash

    HASH_NAME = "xxh3_128"

    def new_hasher():
        return xxhash.xxh3_128()
except ImportError:  # pragma: no cover - xxhash is a dependency; kept for minimal installs
    HASH_NAME = "sha256"

    def new_hasher():
        return hashlib.sha256()


def hash_tensor_bytes(info, chunk: int = 64 * 2**20) -> str:
    """Hash of one source tensor's bytes, read in chunks."""
    from .safetensors_io import read_bytes

    h = new_hasher()
    for b0 in range(0, info.nbytes, chunk):
        h.update(read_bytes(info, b0, min(chunk, info.nbytes - b0)).numpy())
    return h.hexdigest()
