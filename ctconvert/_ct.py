"""Lazy access to compressed-tensors (its import takes seconds and logs through loguru)."""

from __future__ import annotations


def import_compressed_tensors():
    """Import compressed-tensors with its loguru messages silenced; returns the module."""
    try:
        from loguru import logger

        logger.disable("compressed_tensors")
    except ImportError:  # pragma: no cover - loguru is a dependency of compressed-tensors
        pass
    import compressed_tensors

    return compressed_tensors
