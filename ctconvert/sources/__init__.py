"""Quantized checkpoints as sources: every input format ctconvert reads, one registered object each, seen as dense tensors.

:func:`open_source` asks each registered :class:`~.base.SourceFormat` whether the checkpoint's
quantization config is its own and presents the checkpoint as a :class:`~.base.Source`: a *view* (a
:class:`~ctconvert.checkpoint.reader.Checkpoint` whose quantized Linear modules are replaced by one
virtual dense ``<module>.weight`` each, with the shape and dtype of the dequantized weight and a reader
that dequantizes rows on demand), the modules, and what is dropped (the source's activation and
KV-cache scales). A checkpoint without a quantization config is dense: its view is itself. The planner
plans on the view's dense names and the executor reads its rows through
:mod:`ctconvert.checkpoint.safetensors_io` as from any tensor
(:attr:`~ctconvert.checkpoint.safetensors_io.TensorInfo.virtual`), so a quantized checkpoint is
requantized in the same streaming pass as a dense one.

The formats (one module each; the math in :mod:`ctconvert.formats` and :mod:`ctconvert.formats.foreign`):
:mod:`.compressed_tensors`, :mod:`.fp8_block` (Hugging Face FP8 block), :mod:`.awq` (AutoAWQ GEMM),
:mod:`.gptq`, :mod:`.modelopt` (ModelOpt NVFP4). The last three are also re-expressed losslessly in
compressed-tensors (:meth:`~.base.SourceFormat.lossless`, ``ctconvert convert``).

Errors are one line naming the file and tensor: an unknown ``quant_method``
(:class:`UnsupportedError`), missing scales or inconsistent shapes
(:class:`BadInputError`), a feature that cannot be read (:class:`UnsupportedError`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from ..checkpoint.kernel_native import KERNEL_NATIVE
from ..checkpoint.reader import CONFIG_NAME, Checkpoint
from ..checkpoint.safetensors_io import TensorInfo
from ..errors import BadInputError, UnsupportedError
from .awq import AWQ
from .base import GroupSpec, Source, SourceFormat, SourceModule, assemble
from .compressed_tensors import COMPRESSED_TENSORS
from .fp8_block import FP8_BLOCK
from .gptq import GPTQ
from .modelopt import MODELOPT

__all__ = ["DENSE", "FORMATS", "SOURCE_CONFIG_FILES", "GroupSpec", "Source", "SourceFormat", "SourceModule", "open_source"]

#: the registered input formats, in the order an unknown ``quant_method``'s error lists them
FORMATS: tuple[SourceFormat, ...] = (COMPRESSED_TENSORS, FP8_BLOCK, AWQ, GPTQ, MODELOPT)
#: a checkpoint without a quantization config
DENSE = SourceFormat()
#: the formats whose own config file beside ``config.json`` is read (in this order) when ``config.json`` has none
_BY_CONFIG_FILE = (MODELOPT, GPTQ, AWQ)
#: quantization configs other tools keep beside ``config.json`` (not copied into an output)
SOURCE_CONFIG_FILES = tuple(f.config_file for f in _BY_CONFIG_FILE)


def open_source(ckpt: Checkpoint) -> Source:
    """The :class:`Source` of an opened checkpoint (headers and small tensors only: ``weight_shape``,
    ``g_idx``). Raises :class:`UnsupportedError` for an unknown ``quant_method`` or a feature that
    cannot be read, :class:`BadInputError` for missing scales or inconsistent shapes."""
    qcfg, where = _quant_config(ckpt)
    if qcfg is None:
        return Source(DENSE, ckpt, ckpt)
    _refuse_unread(ckpt, qcfg, where)
    fmt = next((f for f in FORMATS if f.recognises(qcfg)), None)
    if fmt is None:
        qm = str(qcfg.get("quant_method") or "").lower()
        raise UnsupportedError(f"unknown quant_method {qm or None!r}; ctconvert reads: {', '.join(f.quant_method for f in FORMATS)}", file=where)
    groups: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in ckpt.tensors.items():
        mod, _, part = name.rpartition(".")
        groups[mod][part] = info
    mods, dropped = fmt.read(ckpt, qcfg, where, groups)
    if not mods:
        if where.name == CONFIG_NAME or json.loads(where.read_text()).get("quant_method"):  # (from_config_file adds the method)
            raise BadInputError(f"quant_method {fmt.quant_method!r} but no quantized module was found", file=where)
        why = f"read as {fmt.quant_method!r} for its name (it names no quant_method), but no quantized module was found: "
        why += f"a dense checkpoint with a stray {where.name}? move it away"
        raise BadInputError(why, file=where)
    return assemble(fmt, ckpt, qcfg, where, mods, dropped)


def _refuse_unread(ckpt: Checkpoint, qcfg: dict, where: Path) -> None:
    """The quant_methods known and not read, each refused with the way round."""
    qm = str(qcfg.get("quant_method") or "").lower()
    if qm == KERNEL_NATIVE:  # ctconvert's own kernel-native layout: its inverse is the readable checkpoint
        target = qcfg.get("target", "kernel-native")
        raise UnsupportedError(
            f"a ctconvert kernel-native ({target}) checkpoint, which only its kernel reads: "
            f"`ctconvert repack {ckpt.path} -o OUT --target compressed-tensors` restores the compressed-tensors checkpoint, which this command takes",
            file=where,
        )
    if qm == "mxfp4":  # gpt-oss as OpenAI ships it (``*_blocks``/``*_scales``): not read yet, the way round is transformers'
        raise UnsupportedError(
            "quant_method 'mxfp4' (gpt-oss's own MXFP4 experts, *_blocks/*_scales) is not read yet: write a bf16 copy with transformers "
            "(from_pretrained(SRC, quantization_config=Mxfp4Config(dequantize=True)).save_pretrained(NEW)) and quantize that",
            file=where,
        )


def _quant_config(ckpt: Checkpoint) -> tuple[dict | None, Path | None]:
    """The quantization config and its file: ``config.json``'s, else a tool's own file beside it."""
    if ckpt.quantization_config is not None:
        return ckpt.quantization_config, ckpt.path / CONFIG_NAME
    for fmt in _BY_CONFIG_FILE:
        p = ckpt.path / fmt.config_file
        if not p.is_file():
            continue
        try:
            text = p.read_text()
            d = json.loads(text) if text.strip() else {}  # (an empty file: the stray-file error below)
        except (OSError, ValueError) as e:
            raise BadInputError(f"cannot read {fmt.config_file}: {e}", file=p) from e
        if not isinstance(d, dict):
            raise BadInputError(f"{fmt.config_file} is not a JSON object", file=p)
        if not d:  # (ModelOpt's file then failed on its quant_algo None, exit 4)
            raise BadInputError(f"{fmt.config_file} is empty: a dense checkpoint with a stray {fmt.config_file}? move it away", file=p)
        return fmt.from_config_file(d), p
    return None, None
