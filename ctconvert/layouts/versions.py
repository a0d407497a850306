"""The vLLM releases whose load-time layouts ctconvert builds, and the default one (imports nothing: the CLI's help reads it without torch).

Every ``layout_version`` default of the package (the layouts' functions, ``repack``, ``quantize --target``,
the option table :mod:`ctconvert.options`) is :data:`DEFAULT_LAYOUT_VERSION`.
"""

from __future__ import annotations

__all__ = ["DEFAULT_LAYOUT_VERSION", "LAYOUT_VERSIONS"]

#: the releases whose layouts are built, newest first (what each changed: :mod:`ctconvert.layouts.kernels`)
LAYOUT_VERSIONS = ("0.33", "0.32", "0.31", "0.30", "0.29", "0.25", "0.21")
#: the release a layout is built for unless told otherwise: the newest
DEFAULT_LAYOUT_VERSION = LAYOUT_VERSIONS[0]
