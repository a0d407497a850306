"""Helpers every kernel layout shares: vLLM release strings, argument checks, bit views, rounding.

One definition each, so that every layout parses a ``layout_version``, checks
its arguments and reports errors the same way. Argument errors are
``ValueError``; a wrong type or dtype raises :class:`LayoutTypeError`, which is
both a ``TypeError`` and a ``ValueError`` (callers may catch either).
"""

from __future__ import annotations

import re

import torch

__all__ = ["LayoutTypeError", "act_dtype", "check_tensor", "int_view", "parse_version", "round_up"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ACT_DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16}


class LayoutTypeError(TypeError, ValueError):
    """A layout function got an argument of the wrong type or dtype."""


def parse_version(layout_version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM release string (``"0.33"``, ``"0.29.0"``, ``"v0.30.1"``). Raises ``ValueError``."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:[.+-].*)?", str(layout_version).strip())
    if m is None:
        raise ValueError(f"layout_version must be a vLLM release like '0.33' or '0.29.0', got {layout_version!r}")
    return int(m.group(1)), int(m.group(2))


def act_dtype(dtype) -> torch.dtype:
    """A 16-bit activation dtype from a torch dtype or ``"float16"``/``"bfloat16"`` (``"torch."`` prefix allowed).

    Raises ``ValueError`` for anything else (docs/kernel-layouts.md §5.1/§5.2: the Marlin float
    layouts take 16-bit activations)."""
    dt = _ACT_DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if dt not in (torch.float16, torch.bfloat16):
        raise ValueError(f"act_dtype must be float16 or bfloat16 (16-bit activations, §5.1/§5.2), got {dtype!r}")
    return dt


def check_tensor(t, name: str, dtype: torch.dtype | tuple | None = None, shape: tuple | None = None, ndim: int | None = None) -> None:
    """Raise :class:`LayoutTypeError` unless ``t`` is a tensor of ``dtype`` (one dtype or a tuple of them),
    and ``ValueError`` unless it has ``ndim`` dims and ``shape``."""
    if not isinstance(t, torch.Tensor):
        raise LayoutTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise LayoutTypeError(f"{name} must be {want}, got {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        want = tuple(shape) if shape is not None else f"{ndim}-D"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def int_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` reinterpreted as integers of its element size (so -0.0 and NaN payloads count as bits);
    an integer tensor is returned as it is."""
    if not (x.is_floating_point() or x.is_complex()):
        return x
    return x.view(_INT_OF_SIZE[x.element_size()])


def round_up(x: int, m: int) -> int:
    """The least multiple of ``m`` that is ``>= x``."""
    return -(-x // m) * m
