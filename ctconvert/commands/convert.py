"""``ctconvert convert``: a checkpoint of another tool -> compressed-tensors, losslessly.

The values of ModelOpt NVFP4, AutoAWQ GEMM and GPTQ (without act-order)
checkpoints can be re-expressed in compressed-tensors without rounding:

- ModelOpt NVFP4 -> ``nvfp4-pack-quantized`` (``NVFP4`` with the source's
  ``input_scale`` as ``input_global_scale = 1 / input_scale``, as compressed-tensors
  0.20 ``converters/modelopt_nvfp4.py`` does; ``NVFP4A16`` without it): the E2M1
  bytes and E4M3 block scales are copied, and ``weight_global_scale`` is the fp32
  number that makes compressed-tensors' ``e2m1 * (scale / global)`` equal ModelOpt's
  ``e2m1 * (scale * weight_scale_2)`` for every code
  (:func:`ctconvert.formats.foreign.nvfp4_global_scale_for`);
- AutoAWQ GEMM -> ``pack-quantized`` int4 asymmetric (``W4A16_ASYM`` for group 128):
  ``q - 8`` and ``zero - 8`` in compressed-tensors' signed convention, scales transposed;
- GPTQ -> ``pack-quantized`` (``W4A16``/``W8A16`` for sym group 128, asymmetric
  otherwise), the v1 zero-point offset undone.

Whatever compressed-tensors cannot express is refused before anything is written,
naming the tensor and the feature: act-order GPTQ (``g_idx`` not ``k // group_size``;
compressed-tensors 0.19+ has no ``weight_g_idx``), a zero point other than
``2^(B-1)`` in a ``sym: true`` GPTQ checkpoint, a ModelOpt ``weight_scale_2`` no fp32
global scale matches, fused sets (q/k/v, gate/up) whose members have different
``weight_scale_2`` (vLLM keeps one global scale per fused layer; ``quantize --scheme NVFP4A16``
requantizes such a source, each fused set to one global scale). Streaming by row
chunks, written atomically like ``quantize``.

Reads top to bottom: open the source -> choose the target -> check every module ->
plan every output tensor (a dry run stops here) -> run the tasks -> config, provenance.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__, options
from ..checkpoint.config import build_quantization_config, updated_config
from ..checkpoint.naming import FUSED_OF, fused_set_name, is_generative, loader_patterns, tie_word_embeddings
from ..checkpoint.provenance import PROVENANCE
from ..checkpoint.reader import CONFIG_NAME, open_checkpoint
from ..checkpoint.safetensors_io import PlannedTensor, read_tensor
from ..checkpoint.sources import SOURCE_CONFIG_FILES, Source, SourceModule, open_source
from ..checkpoint.writer import check_output_path, parse_size, write_checkpoint
from ..errors import BadInputError, CTConvertError, UnsupportedError, UsageError, agree, plural
from ..formats.foreign import nvfp4_global_scale_for
from ..pipeline.tasks import Compute, CopyTensor, run_tasks
from ..plan.planner import Plan, TensorDecision
from ..plan.result import ConversionResult

__all__ = ["ConvertResult", "GroupSpec", "convert", "lossless_choice", "lossless_target", "scheme_matches"]

_CHUNK_ELEMS = 16 * 2**20
_NVFP4_INPUTS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": 16,
    "strategy": "tensor_group",
    "dynamic": "local",
    "scale_dtype": "torch.float8_e4m3fn",
    "observer": "static_minmax",
}
_PRESETS = {  # (bits, symmetric, group size) -> compressed-tensors preset name (plan/schemes.py)
    (4, True, 128): "W4A16",
    (4, False, 128): "W4A16_ASYM",
    (8, True, 128): "W8A16",
}


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


#: the result of a lossless conversion: the one result type of every conversion (``lossless`` set)
ConvertResult = ConversionResult


def lossless_target(source: Source, with_inputs: bool | None = None) -> GroupSpec:
    """The compressed-tensors group that holds ``source``'s values exactly. Raises :class:`UnsupportedError`
    for a source no compressed-tensors format re-expresses (compressed-tensors itself, FP8 block)."""
    mods = list(source.modules.values())
    kind = source.kind
    if kind == "modelopt":
        inputs = all("input_scale" in m.parts for m in mods) if with_inputs is None else with_inputs
        return GroupSpec("NVFP4" if inputs else "NVFP4A16", "nvfp4-pack-quantized", mods[0].ct_weights(), dict(_NVFP4_INPUTS) if inputs else None)
    if kind in ("awq", "gptq"):
        specs = {(m.args["bits"], m.args["sym"], m.args["group_size"], m.args["channel"]) for m in mods}
        if len(specs) > 1:
            raise UnsupportedError(f"{kind} modules with different bits/group sizes: {sorted(specs)}", file=source.config_file)
        bits, sym, gs, channel = specs.pop()
        name = _PRESETS.get((bits, sym, gs)) if not channel else None
        if name is None:
            name = f"W{bits}A16{'' if sym else '_ASYM'} ({'channel' if channel else f'group {gs}'})"
        return GroupSpec(name, "pack-quantized", mods[0].ct_weights())
    what = "already a compressed-tensors checkpoint" if kind == "compressed-tensors" else f"{kind} has no compressed-tensors format that holds its values"
    raise UnsupportedError(f"{what}: nothing to convert losslessly; requantize with ctconvert quantize --scheme", file=source.config_file)


def scheme_matches(spec: GroupSpec, scheme: str) -> bool:
    """Whether the preset name ``scheme`` asks for exactly ``spec`` (NVFP4A16 also matches an NVFP4 source: its input scales are left out)."""
    key = str(getattr(scheme, "name", scheme)).strip().upper()  # a preset name, or a Scheme
    if spec.format == "nvfp4-pack-quantized":
        return key in ("NVFP4", "NVFP4A16", "W4A4_NVFP4")
    return key == spec.name


def lossless_choice(src: str | Path, scheme: str) -> tuple[bool, str | None]:
    """Whether ``quantize src --scheme scheme`` is a lossless conversion of a ModelOpt, AWQ or GPTQ source:
    ``(True, None)`` when ``scheme`` is the one that holds its values exactly; ``(False, why)`` when it is
    that scheme but a module uses what compressed-tensors cannot express (the run requantizes instead);
    ``(False, None)`` otherwise (a dense or compressed-tensors source, another scheme)."""
    try:
        source = open_source(open_checkpoint(src, strict=True))
    except CTConvertError:  # not a checkpoint folder, or not one it reads: quantize says so in its own words
        return False, None
    if source.kind not in ("modelopt", "awq", "gptq"):
        return False, None
    spec = lossless_target(source)
    if not scheme_matches(spec, scheme):
        return False, None
    for m in source.modules.values():
        if (problem := m.ct_problem()) is not None:
            return False, f"{m.anchor.name}: {problem}"
    if source.kind == "modelopt" and (found := _fused_scale_problem(source)) is not None:
        return False, f"{found[0].name}: {found[1]}; each fused set requantized to one shared global scale"
    return True, None


def convert(
    src: str | Path,
    out: str | Path | None,
    *,
    scheme: str | None = None,
    max_shard_size: str | int = options.DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    dry_run: bool = False,
) -> ConversionResult:
    """Convert ``src`` losslessly to compressed-tensors at ``out``; see :func:`ctconvert.api.convert`."""
    t0 = time.perf_counter()
    src = Path(src)
    shard_limit = parse_size(max_shard_size)
    source = open_source(open_checkpoint(src, strict=True))
    if not source.quantized:
        raise BadInputError(
            "not a quantized checkpoint (config.json has no quantization_config): nothing to convert; `ctconvert quantize SRC -o OUT --scheme S` quantizes it",
            file=src / CONFIG_NAME,
        )
    spec = lossless_target(source)
    if scheme is not None:
        if not scheme_matches(spec, scheme):
            raise UsageError(
                f"the {source.kind} source converts losslessly to {spec.name} only, not {scheme!r}; requantize with ctconvert quantize --scheme {scheme}"
            )
        if spec.format == "nvfp4-pack-quantized":
            spec = lossless_target(source, with_inputs=scheme.strip().upper() != "NVFP4A16")
    notes: list[str] = []
    extra = _check_modules(source, spec, notes)
    planned, tasks, rows, ignore = _plan(source, spec, extra)
    plan = Plan(
        scheme=spec,
        units=[],
        rows=rows,
        ignore=ignore,
        config_groups={"group_0": (spec, ["Linear"])},
        config_updates={},
        notes=notes,
        input_bytes=source.original.total_bytes,
    )
    result = ConversionResult(
        output=str(out) if out is not None else None,
        scheme=spec.name,
        format=spec.format,
        dry_run=dry_run,
        input_bytes=source.original.total_bytes,
        source_format=source.kind,
        lossless=True,
        quantized_modules=len(source.modules),
        ignore=ignore,
        notes=notes,
        plan=plan,
    )
    if source.dropped:
        n = len(source.dropped)
        notes.append(f"{plural(n, 'activation/KV-cache scale tensor')} of the source {agree(n, 'is', 'are')} not carried over (action 'drop')")
    if dry_run:
        result.output_bytes = sum(t.nbytes for t in planned)
        result.seconds = time.perf_counter() - t0
        return result
    if out is None:
        raise UsageError("an output folder is required (-o/--output)")
    out = Path(out)
    check_output_path(src, out, overwrite)
    qconfig = build_quantization_config(plan.config_groups, spec.format, ignore)

    def config():
        return updated_config(source.view.config, qconfig, {})

    prov = {
        "ctconvert": __version__,
        "source": os.path.normpath(os.path.abspath(src)),  # absolute and normalised, as derived_from's path
        "conversion": "lossless",
        "derived_from": source.derived_from(),
        "tensors": {r.name: r.source for r in rows if r.action == "convert"},
    }
    result.output_bytes = write_checkpoint(
        src,
        out,
        planned,
        max_shard_size=shard_limit,
        overwrite=overwrite,
        fill=lambda shards: run_tasks(tasks, shards),
        config=config,
        skip={PROVENANCE, *SOURCE_CONFIG_FILES},
        files={PROVENANCE: prov},
    )
    result.shards = sorted({p.name for p in out.glob("*.safetensors")})
    result.seconds = time.perf_counter() - t0
    return result


def _check_modules(source: Source, spec: GroupSpec, notes: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Refuse what compressed-tensors cannot express (naming the tensor and the feature); returns the
    whole-module tensors computed here (NVFP4 global scales, input global scales) by module."""
    extra: dict[str, dict[str, torch.Tensor]] = {}
    inexact = []
    for m in source.modules.values():
        a = m.anchor
        problem = m.ct_problem()
        if problem is not None:
            raise UnsupportedError(problem, file=str(a.file), tensor=a.name)
        if source.kind != "modelopt":
            continue
        w2 = float(m.scale_2())
        found = nvfp4_global_scale_for(w2)
        if found is None:
            raise UnsupportedError(
                f"weight_scale_2 {w2!r} has no fp32 weight_global_scale that gives the same values (compressed-tensors divides by it)",
                file=str(m.parts["weight_scale_2"].file),
                tensor=m.parts["weight_scale_2"].name,
            )
        g, exact = found
        if not exact:
            inexact.append(m.name)
        extra[m.name] = {"weight_global_scale": g.reshape(1)}
        if spec.inputs is not None:
            if "input_scale" not in m.parts:
                raise BadInputError("NVFP4 (W4A4) needs input_scale for every module (scales missing)", file=str(a.file), tensor=a.name)
            s = read_tensor(m.parts["input_scale"]).to(torch.float32).reshape(-1)[:1]
            extra[m.name]["input_global_scale"] = (1 / s).reshape(1)  # as compressed-tensors 0.20 converters/modelopt_nvfp4.py
    if source.kind == "modelopt":
        _check_fused(source)
    if inexact:
        notes.append(
            f"{plural(len(inexact), 'module')} (e.g. {inexact[0]}): 1 / weight_global_scale differs from weight_scale_2 in the last fp32 bit; "
            "every dequantized value is equal (compressed-tensors' formula), a kernel that multiplies by 1 / global scale sees a 1-ulp different factor"
        )
    return extra


def _fused_scale_problem(source: Source):
    """The first fused set (q/k/v, gate/up) of a ModelOpt source whose members have different ``weight_scale_2``,
    as ``(tensor info, message)``, else None: vLLM keeps one global scale per fused layer (and garbles MoE output
    from such checkpoints, vllm#54974), and compressed-tensors' ``weight_global_scale`` cannot differ within one."""
    sets: dict[str, list[SourceModule]] = {}
    for m in source.modules.values():
        parent, _, leaf = m.name.rpartition(".")
        if leaf in FUSED_OF:
            sets.setdefault(fused_set_name(parent, FUSED_OF[leaf]), []).append(m)
    for name, members in sets.items():
        values = {m.name.rpartition(".")[2]: float(m.scale_2()) for m in members}
        if len(set(values.values())) > 1:
            return members[-1].parts["weight_scale_2"], f"fused set {name} has a different weight_scale_2 per member ({values})"
    return None


def _check_fused(source: Source) -> None:
    """Members of a fused set (q/k/v, gate/up) must share ``weight_scale_2``: vLLM keeps one global scale per fused
    layer. A lossless conversion cannot give them one; ``quantize --scheme NVFP4A16`` requantizes them to one."""
    found = _fused_scale_problem(source)
    if found is not None:
        info, message = found
        raise UnsupportedError(
            f"{message}; vLLM keeps one global scale per fused layer, so no lossless conversion exists: "
            "`ctconvert quantize SRC -o OUT --scheme NVFP4A16` requantizes each fused set to one shared global scale",
            file=str(info.file),
            tensor=info.name,
        )


def _plan(source: Source, spec: GroupSpec, extra: dict):
    """Output tensors, tasks, plan rows and ``ignore``: each quantized module becomes its compressed-tensors
    tensors, every other stored tensor is copied, the source's activation/KV scales are dropped."""
    view = source.view
    planned: list[PlannedTensor] = []
    tasks: list = []
    rows: list[TensorDecision] = []
    with_inputs = spec.inputs is not None
    for name in sorted(view.tensors, key=lambda n: (str(view.tensors[n].file), view.tensors[n].start)):
        info = view.tensors[name]
        if info.virtual is None:
            planned.append(PlannedTensor(name, info.dtype, info.shape))
            tasks.append(CopyTensor(info))
            rows.append(TensorDecision(name, info.file.name, info.dtype, info.shape, "copy"))
            continue
        m = info.virtual.mod
        outs = m.ct_outputs(with_inputs)
        planned += [PlannedTensor(f"{m.name}.{p}", dt, shape) for p, (dt, shape) in outs.items()]
        tasks.append(Compute(lambda m=m, outs=outs: _module_tensors(m, outs, extra.get(m.name, {}))))
        rows.append(TensorDecision(name, info.file.name, info.dtype, info.shape, "convert", scheme=spec.name, source=m.label))
    for name, why in source.dropped.items():
        info = source.original.tensors[name]
        rows.append(TensorDecision(name, info.file.name, info.dtype, info.shape, "drop", reason=why))
    for m in source.modules.values():
        if "input_scale" in m.parts and not with_inputs:
            i = m.parts["input_scale"]
            why = "input scale (the NVFP4A16 target has no activation quantization)"
            rows.append(TensorDecision(i.name, i.file.name, i.dtype, i.shape, "drop", reason=why))
    ignore = list(source.dense_linear)
    if "lm_head.weight" not in view.tensors and "lm_head" not in ignore and tie_word_embeddings(view.config) and is_generative(view.config):
        ignore.append("lm_head")  # the model builds an lm_head Linear from the tied embedding
    linear = set(ignore) | set(source.modules)
    ignore += [p for p in loader_patterns(ignore, linear, view.config) if p not in ignore]
    return planned, tasks, rows, ignore


def _module_tensors(m: SourceModule, outs: dict, whole: dict[str, torch.Tensor]):
    """Yield ``(name, tensor, byte offset)`` of one module's compressed-tensors tensors, by row chunks."""
    n, k = m.shape
    step = max(128, (_CHUNK_ELEMS // max(1, k)) // 128 * 128)
    pos: dict[str, int] = {}
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        try:
            parts = m.ct_rows(r0, r1)
        except ValueError as e:
            raise UnsupportedError(f"{e}: compressed-tensors' symmetric format cannot express it", file=str(m.anchor.file), tensor=m.anchor.name) from e
        for p, t in parts.items():
            _check_finite(m, p, t)
            yield f"{m.name}.{p}", t, pos.get(p, 0)
            pos[p] = pos.get(p, 0) + t.numel() * t.element_size()
    if "weight_shape" in outs:
        yield f"{m.name}.weight_shape", torch.tensor([n, k], dtype=torch.int64), 0
    for p, t in whole.items():
        if p in outs:
            yield f"{m.name}.{p}", t.to(torch.float32), 0


def _check_finite(m: SourceModule, part: str, t: torch.Tensor) -> None:
    """No NaN/inf scale is written (an E4M3 NaN byte is 0x7F/0xFF)."""
    if part != "weight_scale":
        return
    bad = ((t.view(torch.uint8) & 0x7F) == 0x7F).any() if t.dtype == torch.float8_e4m3fn else ~torch.isfinite(t).all()
    if bool(bad):
        info = m.parts.get("weight_scale") or m.parts.get("scales")
        raise BadInputError("scales hold NaN/inf; refusing to convert", file=str(info.file), tensor=info.name)
