"""One module per command, each reading top to bottom; commands never import each other.

:mod:`ctconvert.api` is their public surface and :mod:`ctconvert.cli` the shell
over it: ``quantize``, ``repack``, ``decompress``, ``inspection`` (``inspect``),
``verify``, ``batch``, ``schemes``.
"""
