"""Checkpoint I/O: safetensors headers and ranged reads, validation, atomic writing."""
