"""The layout stage: which kernel takes each module, and its output tensors, before any data is read; then the repack.

``repack`` (from a compressed-tensors checkpoint) and ``quantize --target``
(in one pass) plan through one :class:`KernelPlanner` (one cache key per
module shape, :attr:`ModulePlan.key`, which ``repack`` also batches by):
:func:`kernel_for` picks the module's kernel from the target's row of
:data:`ctconvert.plan.kernel_targets.TARGETS` (or names the module it cannot
take), and :func:`plan_module` runs the kernel's index math on stand-in
tensors (meta, or host zeros) to get the output names, dtypes and shapes and
the record the inverse needs.

:class:`LayoutStage` is the ``(layout)`` step of ``quantize --target``: it
rewrites a quantize plan so that each quantized module outputs its kernel
tensors (or, for a target that is a compressed-tensors format, ``marlin-24``,
the format's stored tensors), and is then called by the executor on each
finished module.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import NamedTuple

import torch

from ..checkpoint.kernel_native import kernel_native_config
from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import DTYPES, TORCH_TO_ST, read_tensor
from ..errors import BadInputError, UnsupportedError, UsageError
from ..formats import CompressionFormat
from ..layouts import batched, kernels
from ..layouts.kernels import Kernel
from ..plan.kernel_targets import INVERSE_TARGET, TARGETS, check_target, choose_kernel
from ..plan.planner import Plan

__all__ = ["KernelPlanner", "LayoutStage", "ModulePlan", "kernel_for", "plan_module"]


def kernel_for(target: str, module: str, fmt: str | None, weights: dict, parts: set[str], file: str) -> Kernel:
    """The kernel ``target`` gives this module; :class:`UnsupportedError` naming the module when there is none."""
    kernel = choose_kernel(target, weights, parts)
    if kernel is None:
        desc = f"{fmt}, {weights.get('type')} {weights.get('num_bits')}-bit {weights.get('strategy')}"
        takes = "; ".join(f"{t.name} takes {t.takes}" for t in TARGETS.values())
        if fmt == CompressionFormat.INT_QUANTIZED:  # W8A8: vLLM runs these on its int8 GEMM kernels, with no load-time repack to build
            takes += "; int-quantized W8A8 runs on vLLM's int8 GEMM kernels, not Marlin: serve the compressed-tensors checkpoint as it is"
        raise UnsupportedError(f"module {module!r} ({desc}): target {target!r} does not take it; {takes}", file=file)
    return kernel


def plan_module(
    kernel: Kernel,
    meta_in: dict[str, torch.Tensor],
    source: dict[str, tuple[str, tuple[int, ...]]],
    weights: dict,
    layout_version: str,
    act_dtype: torch.dtype,
    file: str,
    tensor: str,
    values=None,
):
    """One module's kernel outputs (meta tensors: shapes, dtypes) and its record, planned without reading data when possible.

    The layouts are index math, so they run on the meta tensors ``meta_in`` (``weight_shape``, when
    present, must hold its values); a layout that needs values (e.g. to sort act-order indices) runs on
    ``values()`` when given. ``source``: part -> (safetensors dtype, shape) of the compressed-tensors
    tensors, kept in the record for the inverse. Raises :class:`UnsupportedError` for a shape the
    kernel rejects (a ``ValueError`` of the layout).
    """
    try:
        try:
            outs, rec = kernels.repack_module(kernel, meta_in, weights, layout_version, act_dtype)
        except ValueError:
            raise
        except Exception:  # noqa: BLE001 - meta tensors cannot run value-dependent code (torch raises NotImplementedError
            # for an op without a meta kernel, e.g. aten::equal of the act-order sort): use the values
            if values is None:
                raise
            outs, rec = kernels.repack_module(kernel, values(), weights, layout_version, act_dtype)
    except (ValueError, NotImplementedError) as e:
        raise UnsupportedError(f"cannot repack for {kernel.name}: {e}", file=file, tensor=tensor) from e
    rec["source_tensors"] = {p: [dt, list(shape)] for p, (dt, shape) in source.items()}
    rec["tensors"] = sorted(outs)
    return outs, rec


class ModulePlan(NamedTuple):
    """One module's kernel plan (:meth:`KernelPlanner.plan`): ``outputs`` ``{part: (safetensors dtype, shape)}``,
    ``record`` (the caller's own copy), and ``key``, the planner's cache key: modules of one key have one plan
    (``repack`` repacks them together)."""

    kernel: Kernel
    outputs: dict[str, tuple[str, tuple[int, ...]]]
    record: dict
    key: tuple


class KernelPlanner:
    """The one planning route of ``repack`` and ``quantize --target`` (:class:`LayoutStage`): which kernel takes
    a module (:func:`kernel_for`), and its output tensors and record (:func:`plan_module`), planned once per
    module shape (one key: kernel, the module's tensors, N and K, weight args).

    ``stand_ins``: what the kernel's index math runs on: ``"meta"`` tensors (``repack``: nothing is
    allocated or computed) or host ``"zeros"`` (``quantize --target``: many layout ops have only Python
    meta functions, whose first call imports torch._dynamo, 1-3 s at start-up). Each falls back to the
    other when it cannot run: a layout that needs values (act-order sorting) on meta tensors, a value
    check that zeros do not pass (a 2:4 bitmask). Value-dependent record fields are then overwritten by
    the real repack. Raises :class:`UnsupportedError` (a module the target does not take, a shape its
    kernel rejects) and :class:`UsageError` (bad options).
    """

    def __init__(self, target: str, layout_version: str = kernels.DEFAULT_LAYOUT_VERSION, act_dtype: str = "bf16", stand_ins: str = "meta"):
        self.target, self.layout_version, self.act = target, layout_version, check_target(target, act_dtype, layout_version)
        self.stand_ins = stand_ins
        self._plans: dict[tuple, tuple[dict, dict]] = {}

    def plan(
        self, module: str, fmt: str | None, weights: dict, parts: dict[str, tuple[str, tuple[int, ...]]], dense: tuple[int, int], file: str, tensor: str
    ) -> ModulePlan:
        """The :class:`ModulePlan` of one module: ``parts`` are its compressed-tensors tensors (every one: local
        name -> safetensors dtype and shape), ``dense`` its ``(N, K)``; ``file``/``tensor`` name it in errors."""
        kernel = kernel_for(self.target, module, fmt, weights, set(parts), file)
        key = (kernel.name, tuple(sorted((p, dt, tuple(sh)) for p, (dt, sh) in parts.items())), tuple(dense), json.dumps(weights, sort_keys=True, default=str))
        if key not in self._plans:
            first, other = ("meta", "zeros") if self.stand_ins == "meta" else ("zeros", "meta")
            args = (parts, weights, self.layout_version, self.act, file, tensor)
            try:
                outs, rec = plan_module(kernel, _stand_ins(parts, dense, first), *args, values=lambda: _stand_ins(parts, dense, other))
            except UnsupportedError:
                if first == "meta":  # on meta tensors only the shapes count: the kernel rejects this one
                    raise
                outs, rec = plan_module(kernel, _stand_ins(parts, dense, "meta"), *args)  # zeros fail a value check
            self._plans[key] = ({p: (TORCH_TO_ST[t.dtype], tuple(t.shape)) for p, t in outs.items()}, rec)
        outs, rec = self._plans[key]
        return ModulePlan(kernel, dict(outs), copy.deepcopy(rec), key)


def _stand_ins(parts: dict, dense: tuple[int, int], kind: str) -> dict[str, torch.Tensor]:
    """Stand-ins for one module's compressed-tensors tensors: host ``zeros`` or ``meta`` tensors; ``weight_shape`` holds its values."""
    make = torch.zeros if kind == "zeros" else torch.empty
    t = {p: make(shape, dtype=DTYPES[dt][0], device="cpu" if kind == "zeros" else "meta") for p, (dt, shape) in parts.items()}
    if "weight_shape" in t:
        t["weight_shape"] = torch.tensor(list(dense), dtype=torch.int64)
    return t


class LayoutStage:
    """``quantize --target`` in one pass: each module is repacked as soon as it is quantized.

    :meth:`plan` rewrites a quantize plan so that each quantized module's
    compressed-tensors outputs are replaced, in place, by its kernel tensors
    (planned once per module shape, on zeros); the executor then calls the
    instance on each finished module's tensors (on its device), and gets the
    kernel tensors back. The tensors and config equal ``quantize`` followed by
    ``repack``, bit for bit, without the intermediate checkpoint (tensors may
    sit at other offsets: the plan's order is kept).
    """

    def __init__(self, target: str, layout_version: str = kernels.DEFAULT_LAYOUT_VERSION, act_dtype: str = "bf16"):
        self.act = check_target(target, act_dtype, layout_version)
        if target == INVERSE_TARGET:
            raise UsageError("--target compressed-tensors is what quantize writes already; leave --target out")
        self.target, self.layout_version, self.act_dtype = target, layout_version, act_dtype
        self.spec = TARGETS[target]
        self.planner = KernelPlanner(target, layout_version, act_dtype, stand_ins="zeros")
        self.records: dict[str, dict] = {}
        self.kernels: dict[str, tuple[Kernel | None, dict]] = {}  # module -> (kernel, weight args); None: the target's format packs it
        self._outputs: dict[str, dict] = {}  # module -> {part: (safetensors dtype, shape)} of its kernel tensors
        self.carried: dict[str, dict[str, tuple]] = {}  # module -> {part: (source TensorInfo, --dense-dtype cast)}

    def plan(self, plan: Plan, ckpt: Checkpoint, qcfg: dict) -> Plan:
        """A copy of ``plan`` whose quantize units output kernel tensors. Raises :class:`UnsupportedError`.

        A copied tensor of a quantized module (a Linear's ``bias``) is no longer copied: it goes through
        the module's kernel with the module's own tensors (:func:`ctconvert.layouts.kernels.repack_module`:
        in the kernel's layout, or copied and recorded), as ``repack`` does; its plan row says so."""
        carried = self.mark_carried(plan)
        units = []
        for u in plan.units:
            if u.kind == "copy" and u.outputs[0][0].rpartition(".")[0] in carried:
                continue
            if u.kind != "quantize":
                units.append(u)
                continue
            grp = (qcfg.get("config_groups") or {}).get(u.group) or {}  # none for a sparse-only (2:4) model
            weights, fmt = grp.get("weights") or {}, grp.get("format") or qcfg.get("format")
            by_mod: dict[str, list] = {}
            for o in u.outputs:
                by_mod.setdefault(o[0].rpartition(".")[0], []).append(o)
            outputs = []
            for mod, outs in by_mod.items():
                if mod not in u.modules:  # calibrated KV cache scales of the attention module: written as they are
                    outputs += outs
                    continue
                src = ckpt.tensors[u.sources[u.modules.index(mod)]]
                for c in carried.get(mod, []):
                    self.carried.setdefault(mod, {})[c.outputs[0][0].rpartition(".")[2]] = (ckpt.tensors[c.sources[0]], c.cast)
                outputs += self._plan_module(mod, outs + [c.outputs[0] for c in carried.get(mod, [])], src, weights, fmt)
            units.append(dataclasses.replace(u, outputs=outputs))
        return dataclasses.replace(plan, units=units)

    def mark_carried(self, plan: Plan) -> dict[str, list]:
        """The copy units of ``plan`` that belong to a quantized module (module -> units: a Linear's bias),
        which :meth:`plan` sends through the module's kernel; their plan rows say so (also for a dry run).
        Nothing for a target whose output is a compressed-tensors format (marlin-24): its kernel takes no
        bias, and the copies stay what compressed-tensors writes (the same bytes, at the same offsets)."""
        if self.spec.ct_format is not None:
            return {}
        repacked = {m for u in plan.units if u.kind == "quantize" for m in u.modules}
        carried: dict[str, list] = {}
        for u in plan.units:
            if u.kind == "copy" and (mod := u.outputs[0][0].rpartition(".")[0]) in repacked:
                carried.setdefault(mod, []).append(u)
        names = {u.sources[0] for us in carried.values() for u in us}
        note = f"goes through its module's {self.target} kernel"
        for row in plan.rows:
            if row.name in names and row.action == "copy" and not (row.reason or "").endswith(note):
                row.reason = f"{row.reason}; {note}" if row.reason else note
        return carried

    def _plan_module(self, mod: str, outs: list, src, weights: dict, fmt: str) -> list[tuple[str, str, tuple[int, ...]]]:
        parts = {name.rpartition(".")[2]: (dt, tuple(shape)) for name, dt, shape in outs}
        if self.spec.packs(fmt):  # the target's own compressed-tensors format (marlin-24): packed, no kernel
            st = {p: (DTYPES[dt][0], shape) for p, (dt, shape) in parts.items()}
            kernel, rec = None, {"size_n": src.shape[0], "size_k": src.shape[1]}
            kouts = {p: (TORCH_TO_ST[dt], tuple(shape)) for p, (dt, shape) in self.spec.packed_outputs(st, tuple(src.shape), weights).items()}
        else:
            kernel, kouts, rec, _ = self.planner.plan(mod, fmt, weights, parts, tuple(src.shape), src.file.name, src.name)
        self.records[mod] = rec
        self.kernels[mod] = (kernel, weights)
        self._outputs[mod] = kouts
        return [(f"{mod}.{p}", dt, shape) for p, (dt, shape) in kouts.items()]

    def __call__(self, module: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Kernel tensors of one quantized module (its compressed-tensors tensors, whole, on any device)."""
        kernel, weights = self.kernels[module]
        if kernel is None:
            return self.spec.pack(tensors, weights)
        dev = next(iter(tensors.values())).device
        tensors = {**tensors, **{p: self._read_carried(info, cast).to(dev) for p, (info, cast) in self.carried.get(module, {}).items()}}
        planned = ({p: (DTYPES[dt][0], shape) for p, (dt, shape) in self._outputs[module].items()}, self.records[module])  # not planned again
        outs, recs = batched.repack_batch(kernel, {p: t.unsqueeze(0) for p, t in tensors.items()}, weights, self.layout_version, self.act, planned=planned)
        self.records[module].update(recs[0])
        return {p: t[0] for p, t in outs.items()}

    @staticmethod
    def _read_carried(info, cast: str | None) -> torch.Tensor:
        """A carried tensor (a bias) as the copy would have written it: its values, cast by ``--dense-dtype``
        (``cast``: a safetensors dtype). Raises :class:`BadInputError` naming it for NaN/inf, or a value
        the cast would turn into inf: it goes into a kernel layout, not through the copy's checks."""
        t = read_tensor(info)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise BadInputError(
                "tensor holds NaN/inf values; refusing to repack it with its module (--allow-non-finite copies only tensors written as they are)",
                file=str(info.file),
                tensor=info.name,
            )
        if cast is not None:
            t = t.to(DTYPES[cast][0])
            if not bool(torch.isfinite(t).all()):
                raise BadInputError(f"a value is beyond the range of {cast} and would become inf (--dense-dtype)", file=str(info.file), tensor=info.name)
        return t

    def config(self, qcfg: dict) -> dict:
        """The kernel-native ``quantization_config`` wrapping the compressed-tensors one (a target whose
        output is a compressed-tensors format, marlin-24, keeps that config)."""
        if self.spec.ct_format is not None:
            return qcfg
        return kernel_native_config(qcfg, self.target, self.layout_version, self.act_dtype, self.records)
