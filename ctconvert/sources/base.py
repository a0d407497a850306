"""The protocol of an input format: what it reads, the dense tensors it presents, its lossless conversion.

A :class:`SourceFormat` recognises its ``quantization_config`` (:meth:`SourceFormat.recognises`) and
reads a checkpoint's tensors into :class:`SourceModule` objects (:meth:`SourceFormat.read`), one per
quantized Linear, each presenting the virtual dense ``<module>.weight`` it stands for
(:meth:`SourceModule.dense`, read through :class:`VirtualDense`). :func:`assemble` makes the
:class:`Source` of them: the checkpoint seen as dense (its *view*), what is dropped, and the format
object itself, which also says whether (and how) the values are re-expressed in compressed-tensors
without rounding (:meth:`SourceFormat.lossless`: a :class:`GroupSpec`; ``ctconvert convert`` and a
``quantize`` whose scheme is the source's own, :meth:`Source.lossless_scheme`).

The dequantization math lives in :mod:`ctconvert.formats` and :mod:`ctconvert.formats.foreign`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from ..checkpoint.naming import is_linear_weight
from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import DTYPES, TensorInfo, map_rows, read_spans
from ..errors import BadInputError

__all__ = [
    "KV_SCALES",
    "GroupSpec",
    "Source",
    "SourceFormat",
    "SourceModule",
    "VirtualDense",
    "assemble",
    "at",
    "cols",
    "drop_kv_scales",
    "need",
    "preset_key",
    "shape_is",
]

#: the KV-cache and attention scales a source's quantization stores (no place in the dense view)
KV_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")


@dataclass(frozen=True)
class GroupSpec:
    """One config group of a conversion: the compressed-tensors weight (and input) QuantizationArgs.

    ``name``: the preset it equals (or a description); ``format``: the compressed-tensors format."""

    name: str
    format: str
    weights: dict
    inputs: dict | None = None

    def config_group(self, targets: list[str]) -> dict:
        """The ``config_groups`` entry, as compressed-tensors 0.20 ``QuantizationScheme.model_dump`` writes it."""
        return {"targets": list(targets), "weights": dict(self.weights), "input_activations": self.inputs, "output_activations": None, "format": self.format}


def preset_key(scheme) -> str:
    """A preset name (or a :class:`~ctconvert.plan.schemes.Scheme`'s name) as the presets spell it: ``" w4a16 "`` -> ``"W4A16"``."""
    return str(getattr(scheme, "name", scheme)).strip().upper()


@dataclass
class SourceModule:
    """One quantized Linear of a source: its tensors, its dense shape/dtype and how to read it.

    ``kind`` (per class): ``compressed-tensors`` | ``fp8-block`` | ``awq`` | ``gptq`` | ``modelopt-nvfp4``;
    ``label``: the format in words (plan and provenance); ``parts``: local name -> stored tensor;
    ``shape``: dense ``[N, K]``; ``dtype``: dense safetensors dtype; ``align``: dense row ranges
    are read from multiples of it; ``args``: what the format's readers need (bits, group size ...).
    """

    kind: ClassVar[str] = ""
    name: str
    label: str
    parts: dict[str, TensorInfo]
    shape: tuple[int, int]
    dtype: str
    align: int = 128
    args: dict = field(default_factory=dict)

    @property
    def anchor(self) -> TensorInfo:
        """The stored tensor the virtual weight stands in for (file order, errors)."""
        for p in ("weight", "qweight", "weight_packed"):
            if p in self.parts:
                return self.parts[p]
        return next(iter(self.parts.values()))

    @property
    def bits(self) -> int:
        """The bits of one stored weight value (8 for FP8, 4 for NVFP4 and AWQ ...)."""
        return int(self.args.get("bits", 4))

    @property
    def group_size(self) -> int | None:
        """The input columns one scale covers as the source's config states it (``inspect``); None per channel or block."""
        return None if self.args.get("channel") else self.args.get("group_size")

    @property
    def block(self) -> list[int] | None:
        """``[rows, columns]`` of a block scale (``inspect``), None for other scales."""
        return None

    def dense(self, r0: int, r1: int) -> torch.Tensor:
        """Dense rows ``[r0, r1)`` (``r0`` a multiple of :attr:`align`) as the source's reference computes them."""
        raise NotImplementedError

    #: whether :meth:`stored_rows` and :meth:`dense_from` exist: the stored rows can be moved to a GPU and dequantized
    #: there, giving the bytes :meth:`dense` gives (elementwise IEEE arithmetic only: conversions, products, roundings)
    on_device: ClassVar[bool] = False

    def stored_spans(self, r0: int, r1: int) -> dict[str, tuple[TensorInfo, int | None, int | None]]:
        """Where the stored rows that dense rows ``[r0, r1)`` are computed from lie (``r0`` a multiple of
        :attr:`align`): part name -> ``(stored tensor, a, b)``, its rows ``[a, b)``, or ``(tensor, None, None)``, all
        of it. A reader may place them in a buffer of its own (``pipeline/stored.py``: page-locked, for a GPU)."""
        raise NotImplementedError

    def stored_rows(self, r0: int, r1: int) -> dict[str, torch.Tensor]:
        """The stored tensors' rows that dense rows ``[r0, r1)`` are computed from (CPU tensors read from
        :meth:`stored_spans`), for :meth:`dense_from` on another device."""
        return read_spans(self.stored_spans(r0, r1))

    def dense_from(self, parts: dict[str, torch.Tensor], r0: int, r1: int) -> torch.Tensor:
        """Dense rows ``[r0, r1)`` from :meth:`stored_rows`' tensors, on their device (the torch reference)."""
        raise NotImplementedError

    # -- lossless re-expression in compressed-tensors (formats that have one override these) -------------
    def ct_problem(self) -> str | None:
        """Why the values cannot be re-expressed in compressed-tensors without rounding, or None."""
        return f"{self.kind} is not converted (it is already compressed-tensors, or requantized)"

    def ct_outputs(self, with_input_scale: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Local name -> (safetensors dtype, shape) of the compressed-tensors tensors of this module."""
        raise NotImplementedError

    def ct_rows(self, r0: int, r1: int) -> dict[str, torch.Tensor]:
        """The compressed-tensors tensors of dense rows ``[r0, r1)`` (row-chunked ones only; ``r0`` a multiple of 128)."""
        raise NotImplementedError


class SourceFormat:
    """One input format, registered in :mod:`ctconvert.sources`; this base is a dense checkpoint's.

    ``kind``: :attr:`Source.kind` (the ``source_format`` of results and provenance); ``quant_method``: the
    ``quantization_config.quant_method`` it reads; ``config_file``: the tool's own config file beside
    ``config.json`` (None: ``config.json`` only)."""

    def __init__(self, kind: str = "dense", quant_method: str | None = None, config_file: str | None = None):
        self.kind, self.quant_method, self.config_file = kind, quant_method, config_file

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r})"

    def recognises(self, qcfg: dict | None) -> bool:
        """Whether ``qcfg`` (a ``quantization_config``) is this format's."""
        return qcfg is not None and str(qcfg.get("quant_method") or "").lower() == self.quant_method

    def from_config_file(self, d: dict) -> dict:
        """The ``quantization_config`` a :attr:`config_file`'s JSON object stands for."""
        return {**d, "quant_method": d.get("quant_method", self.quant_method)}

    def read(self, ckpt: Checkpoint, qcfg: dict, where: Path, groups: dict[str, dict[str, TensorInfo]]) -> tuple[list[SourceModule], dict[str, str]]:
        """The quantized modules of ``ckpt`` (``groups``: module -> local name -> stored tensor) and the stored
        tensors dropped (name -> why). Raises :class:`UnsupportedError` / :class:`BadInputError` naming file and tensor."""
        raise NotImplementedError

    # -- lossless conversion --------------------------------------------------------------------
    #: why nothing converts losslessly (formats without a lossless conversion)
    no_lossless: ClassVar[str] = "no compressed-tensors format holds its values"

    def lossless(self, source: Source, scheme=None) -> GroupSpec | None:
        """The compressed-tensors group that holds ``source``'s values exactly: for the preset ``scheme`` (None: the
        source's own), None when ``scheme`` is another one or no compressed-tensors format holds the values."""
        return None

    def lossless_blocker(self, source: Source) -> str | None:
        """Why a lossless conversion cannot be made although every module could be (a whole-source rule), or None."""
        return None

    def lossless_tensors(self, source: Source, spec: GroupSpec, notes: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """The whole-module tensors of a lossless conversion to ``spec`` (module -> local name -> tensor), computed and
        checked here (raising :class:`UnsupportedError` / :class:`BadInputError` naming the tensor); notes appended."""
        return {}


@dataclass
class Source:
    """A checkpoint seen through its quantization (:mod:`ctconvert.sources`).

    ``format``: the :class:`SourceFormat` that read it; ``view``: the dense view (``original``
    itself for a dense checkpoint); ``modules``: quantized modules by name; ``dropped``: stored
    tensor -> why it has no place in the view; ``dense_linear``: modules whose Linear weight is
    dense in the source (a requantized output keeps them dense: the source's ``ignore`` carries
    over); ``config_file``: where the quantization config was read.
    """

    format: SourceFormat
    original: Checkpoint
    view: Checkpoint
    quantization_config: dict | None = None
    config_file: Path | None = None
    modules: dict[str, SourceModule] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    dense_linear: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """``dense``, ``compressed-tensors``, ``fp8-block``, ``awq``, ``gptq`` or ``modelopt``."""
        return self.format.kind

    @property
    def quantized(self) -> bool:
        return bool(self.modules)

    @property
    def quant_method(self) -> str | None:
        return (self.quantization_config or {}).get("quant_method")

    def format_of(self, name: str) -> str | None:
        """The source format of a view tensor: its module's label, None for a stored dense tensor."""
        info = self.view.tensors.get(name)
        return info.virtual.mod.label if info is not None and info.virtual is not None else None

    def derived_from(self) -> dict:
        """What an output made from this source records (provenance, ``inspect``)."""
        labels = sorted({m.label for m in self.modules.values()})
        path = os.path.normpath(os.path.abspath(self.original.path))  # absolute and normalised, whatever the caller passed (no ./, ..)
        return {"path": path, "quant_method": self.quant_method, "source_format": self.kind, "formats": labels}

    def lossless_scheme(self, scheme) -> tuple[bool, str | None]:
        """Whether ``quantize --scheme scheme`` of this source is a lossless conversion: ``(True, None)`` when
        ``scheme`` holds its values exactly; ``(False, why)`` when it is that scheme but a module uses what
        compressed-tensors cannot express (the run requantizes instead); ``(False, None)`` otherwise (a dense
        or compressed-tensors source, another scheme). Raises :class:`UnsupportedError` for modules of one
        source with different bits or group sizes."""
        if self.format.lossless(self, scheme) is None:
            return False, None
        for m in self.modules.values():
            if (problem := m.ct_problem()) is not None:
                return False, f"{m.anchor.name}: {problem}"
        why = self.format.lossless_blocker(self)
        return why is None, why


class VirtualDense:
    """The reader of a virtual dense weight (:attr:`ctconvert.checkpoint.safetensors_io.TensorInfo.virtual`)."""

    def __init__(self, mod: SourceModule):
        self.mod = mod
        self.dtype = DTYPES[mod.dtype][0]
        self.row_bytes = mod.shape[1] * DTYPES[mod.dtype][1]

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        a0, a1 = self._aligned(r0, r1)
        with self._naming():
            t = self.mod.dense(a0, a1) if a1 > a0 else torch.empty((0, self.mod.shape[1]), dtype=self.dtype)
        return t.to(self.dtype)[r0 - a0 : r1 - a0]

    def stored(self) -> list:
        """The stored tensors this weight is computed from (what provenance hashes: :mod:`ctconvert.checkpoint.hashing`)."""
        return list(self.mod.parts.values())

    @property
    def on_device(self) -> bool:
        """Whether :meth:`stored_rows` / :meth:`dense_from` can dequantize on a GPU (:attr:`SourceModule.on_device`)."""
        return self.mod.on_device

    def _aligned(self, r0: int, r1: int) -> tuple[int, int]:
        m = self.mod
        return r0 // m.align * m.align, min(m.shape[0], math.ceil(r1 / m.align) * m.align)

    def stored_rows(self, r0: int, r1: int) -> dict[str, torch.Tensor]:
        """The stored rows (CPU) that dense rows ``[r0, r1)`` come from (:meth:`SourceModule.stored_rows` of the
        aligned range); raises :class:`BadInputError` naming the module's tensor as :meth:`rows` does."""
        with self._naming():
            return self.mod.stored_rows(*self._aligned(r0, r1))

    def stored_spans(self, r0: int, r1: int) -> dict[str, tuple[TensorInfo, int | None, int | None]]:
        """Where :meth:`stored_rows`' rows lie (:meth:`SourceModule.stored_spans` of the aligned range)."""
        with self._naming():
            return self.mod.stored_spans(*self._aligned(r0, r1))

    def dense_from(self, parts: dict[str, torch.Tensor], r0: int, r1: int) -> torch.Tensor:
        """Dense rows ``[r0, r1)`` of this weight's dtype from :meth:`stored_rows`' tensors, on their device: the
        bytes :meth:`rows` gives."""
        a0, a1 = self._aligned(r0, r1)
        if a1 <= a0:  # no rows: an empty tensor where the parts are (the device the caller asked for)
            device = next(iter(parts.values())).device if parts else torch.device("cpu")
            return torch.empty((0, self.mod.shape[1]), dtype=self.dtype, device=device)
        with self._naming():
            t = self.mod.dense_from(parts, a0, a1)
        return t.to(self.dtype)[r0 - a0 : r1 - a0]

    @contextlib.contextmanager
    def _naming(self):
        try:
            yield
        except (KeyError, ValueError, RuntimeError, IndexError) as e:
            a = self.mod.anchor
            raise BadInputError(f"cannot dequantize ({self.mod.label}): {e}", file=str(a.file), tensor=a.name) from e

    def read_bytes(self, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        r0 = offset // self.row_bytes
        r1 = math.ceil((offset + nbytes) / self.row_bytes) if nbytes else r0
        raw = self.rows(r0, r1).contiguous().reshape(-1).view(torch.uint8)
        raw = raw[offset - r0 * self.row_bytes :][:nbytes]
        if out is None:
            return raw.clone()
        out[:nbytes].copy_(raw)
        return out[:nbytes]

    def describe(self) -> dict:
        m = self.mod
        return {"format": m.label, "tensors": [i.name for i in m.parts.values()]}


def assemble(fmt: SourceFormat, ckpt: Checkpoint, qcfg: dict, where: Path, mods: list[SourceModule], dropped: dict[str, str]) -> Source:
    """The :class:`Source` of ``mods``: each module's anchor replaced by its virtual dense weight, its other
    stored tensors and ``dropped`` left out, every other tensor as stored; the view's config has no
    ``quantization_config``."""
    consumed = {i.name: m for m in mods for i in m.parts.values()}
    anchors = {m.anchor.name: m for m in mods}
    tensors: dict[str, TensorInfo] = {}
    dense_linear = []
    for name in sorted(ckpt.tensors, key=lambda n: (str(ckpt.tensors[n].file), ckpt.tensors[n].start)):
        info = ckpt.tensors[name]
        if name in anchors:
            m = anchors[name]
            vname = m.name + ".weight"
            nbytes = m.shape[0] * m.shape[1] * DTYPES[m.dtype][1]
            tensors[vname] = TensorInfo(vname, info.file, m.dtype, m.shape, info.start, nbytes, virtual=VirtualDense(m))
        elif name in consumed or name in dropped:
            continue
        else:
            tensors[name] = info
            if is_linear_weight(name, info):
                dense_linear.append(name[: -len(".weight")])
    config = copy.deepcopy(ckpt.config)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    view = Checkpoint(ckpt.path, config, tensors, ckpt.files, ckpt.index, list(ckpt.problems))
    return Source(fmt, ckpt, view, qcfg, where, {m.name: m for m in mods}, dropped, dense_linear)


# -- helpers of the format readers ---------------------------------------------------------------


def at(info: TensorInfo) -> dict:
    """``file=`` and ``tensor=`` of an error about ``info``."""
    return {"file": str(info.file), "tensor": info.name}


def cols(info: TensorInfo, c0: int, c1: int) -> torch.Tensor:
    """Columns ``[c0, c1)`` of a stored 2-D tensor (through a mapping: only those bytes are read)."""
    return map_rows(info, 0, info.shape[0])[:, c0:c1].clone()


def need(parts: dict[str, TensorInfo], name: str, part: str, anchor: TensorInfo, what: str) -> TensorInfo:
    """``parts[part]``; :class:`BadInputError` (scales missing) naming ``anchor`` when it is not there."""
    if part not in parts:
        raise BadInputError(f"{what} {name}.{part} is missing (scales missing)", **at(anchor))
    return parts[part]


def shape_is(info: TensorInfo, want: tuple[int, ...], what: str) -> None:
    """:class:`BadInputError` (shapes inconsistent) when ``info`` is not ``want``-shaped."""
    if tuple(info.shape) != tuple(want):
        raise BadInputError(f"{info.dtype}{list(info.shape)} but {what} needs {list(want)} (shapes inconsistent)", **at(info))


def drop_kv_scales(parts: dict[str, TensorInfo], dropped: dict[str, str]) -> None:
    """Put a module's KV-cache scales into ``dropped``."""
    for p in KV_SCALES:
        if p in parts:
            dropped[parts[p].name] = "KV-cache scale of the source's quantization"
