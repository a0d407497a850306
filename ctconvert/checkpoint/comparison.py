"""An output checkpoint against the reference it was made from: its tensors beyond the quantized modules, and the
numbers the quantized modules are judged by (relative-L2 limits, the gain check, the reference's experts split).

What ``verify --reference`` requires of every other tensor (:mod:`ctconvert.commands.verify` judges the quantized
modules by value): it comes from the reference with equal bytes, or holds the reference's values cast to another
float dtype (``quantize --dense-dtype``), bit for bit; nothing of the reference is missing but the dense weights of
the quantized modules. Read from the two checkpoints alone, never from the output's plan or provenance.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct

import torch

from ..errors import CTConvertError, agree, plural
from .families import split_fused_experts
from .modules import ACT_PARTS, KV_PARTS, QUANT_PARTS, Module
from .reader import Checkpoint, Problem
from .safetensors_io import read_bytes

__all__ = [
    "CHUNK",
    "GAIN_FEW",
    "GAIN_FLOOR",
    "GAIN_FLOOR_REQUANT",
    "GAIN_SHARE",
    "GAIN_SHARE_MX",
    "GAIN_SHARE_REQUANT",
    "PRUNED_NOTE",
    "THRESHOLDS",
    "WIDE",
    "add_error_sums",
    "compare_others",
    "copy_of",
    "effective_values",
    "error_stats",
    "error_summary",
    "error_threshold",
    "gain_limit",
    "gain_message",
    "same_bytes",
    "split_reference",
    "unread_note",
    "widened",
]

CHUNK = 16 * 2**20  # bytes compared at a time


_MISSING_SHOWN = 8  # reference tensors missing from the output that are listed one by one


_SHORT = {"F64": "fp64", "F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def compare_others(ckpt: Checkpoint, mods: dict[str, Module], ref: Checkpoint, bar=None) -> list[Problem]:
    """Every output tensor that is not a part of a quantized module must come from the reference: equal bytes,
    or (``quantize --dense-dtype``) the reference's values cast to its floating dtype, bit for bit (``torch``'s
    ``.to``); found from the two checkpoints alone, not from the output's provenance. The KV cache scales of a
    ``kv_cache_scheme`` are explained only on an attention module whose ``k_proj`` and ``v_proj`` the output
    holds. Nothing of the reference may be missing but the dense weights of the quantized modules."""
    out = []
    kv = bool((ckpt.quantization_config or {}).get("kv_cache_scheme"))
    cast = 0
    for name, info in ckpt.tensors.items():
        mod, _, part = name.rpartition(".")
        mm = mods.get(mod)
        if mm is not None and mm.quantized and (part in QUANT_PARTS or part in ACT_PARTS or part == "weight"):
            continue  # checked against the config group's format (verify's module and value checks)
        if part in KV_PARTS and kv and f"{mod}.k_proj" in mods and f"{mod}.v_proj" in mods:
            continue  # calibrated KV cache scales of an attention module
        s = ref.tensors.get(name)
        if s is None:
            why = "; a KV cache scale belongs to an attention module with k_proj and v_proj" if part in KV_PARTS and kv else ""
            out.append(Problem("error", f"tensor not in the reference, and the config does not explain it{why}", tensor=name))
        elif s.shape == info.shape and s.dtype != info.dtype and s.dtype in _SHORT and info.dtype in _SHORT:  # quantize --dense-dtype
            if _same_cast(info, s):
                cast += 1
            else:
                c = f"{_SHORT[s.dtype]}->{_SHORT[info.dtype]}"
                out.append(Problem("error", f"values differ from the reference cast to {info.dtype} ({c}, --dense-dtype)", tensor=name))
        elif s.dtype != info.dtype or s.shape != info.shape:
            out.append(Problem("error", f"{info.dtype}{list(info.shape)} differs from the reference {s.dtype}{list(s.shape)}", tensor=name))
        elif not same_bytes(info, s):
            out.append(Problem("error", "bytes differ from the reference (a pass-through tensor was changed)", tensor=name))
        if s is not None and bar is not None:
            bar.update(s.nbytes)
    if cast:
        held = agree(cast, "holds", "hold")
        out.append(Problem("note", f"{plural(cast, 'tensor')} {held} the reference's values cast to another float dtype (--dense-dtype), bit for bit"))
    quant_weights = {m.name + ".weight" for m in mods.values() if m.quantized}
    missing = [name for name in ref.tensors if name not in ckpt.tensors and name not in quant_weights]
    unread = {n for f in ckpt.files for n in (_header_names(f) or ()) if n not in ckpt.tensors}  # in shards the reader refused
    unread |= {n.rpartition(".")[0] for n in unread}  # (their modules: a quantized one's reference weight)
    hidden = [n for n in missing if n in unread or n.rpartition(".")[0] in unread]
    if hidden:  # not missing: in a damaged shard (the reader's errors above), so not compared
        missing = [n for n in missing if n not in set(hidden)]
        out.append(Problem("note", f"{plural(len(hidden), 'tensor')} of the reference not compared: in a shard the reader refuses (the errors above)"))
    if len(missing) > _MISSING_SHOWN:  # another model (more layers, other names): one line, not one per tensor
        shown = ", ".join(missing[:3])
        out.append(
            Problem(
                "error",
                f"{len(missing)} tensors of the reference are missing from the output ({shown} ...): is --reference the checkpoint "
                f"this output was made from? (reference: {plural(len(ref.tensors), 'tensor')}, output: {len(ckpt.tensors)})",
            )
        )
    else:
        out += [Problem("error", "tensor of the reference is missing from the output", tensor=name) for name in missing]
    return out


def copy_of(out, ref) -> bool:
    """Whether tensor ``out`` is a copy of tensor ``ref`` (both :class:`TensorInfo`): the same shape, and the same dtype
    and bytes, or (``quantize --dense-dtype``) ``ref``'s float values cast to ``out``'s float dtype, bit for bit."""
    if tuple(out.shape) != tuple(ref.shape):
        return False
    if out.dtype == ref.dtype:
        return same_bytes(out, ref)
    return out.dtype in _SHORT and ref.dtype in _SHORT and _same_cast(out, ref)


def _same_cast(out, ref) -> bool:
    """``out`` holds ``ref``'s values cast to its dtype (``torch.Tensor.to``), bit for bit."""
    n = math.prod(ref.shape)
    step = max(1, CHUNK // ref.itemsize)
    for e0 in range(0, n, step):
        e1 = min(n, e0 + step)
        want = read_bytes(ref, e0 * ref.itemsize, (e1 - e0) * ref.itemsize).view(ref.torch_dtype).to(out.torch_dtype)
        if not torch.equal(read_bytes(out, e0 * out.itemsize, (e1 - e0) * out.itemsize), want.view(torch.uint8)):
            return False
    return True


def same_bytes(a, b) -> bool:
    for b0 in range(0, a.nbytes, CHUNK):
        nb = min(CHUNK, a.nbytes - b0)
        if not torch.equal(read_bytes(a, b0, nb), read_bytes(b, b0, nb)):
            return False
    return True


# -- the quantized weights' error and gain (verify judges them; the numbers live here) --

#: what verify says once where 2:4 sparse modules were compared
PRUNED_NOTE = (
    "2:4 sparse modules pass or fail on their error against the reference pruned 2:4 by verify (the format's limit; exact for dense "
    "2:4 values); their error against the dense reference, the pruning's own, is reported beside it (rel L2 dense), not judged"
)
#: largest relative L2 error accepted per (type, bits) of the weights
THRESHOLDS = {("float", 8): 0.08, ("int", 8): 0.04, ("int", 4): 0.25, ("float", 4): 0.30}
#: the gain check: ``|gain - 1| <= max(GAIN_FLOOR, GAIN_SHARE * rel_l2)``, the gain being a module's least-squares
#: factor ``<output, reference> / <reference, reference>`` (1 for a correct quantization: rounding errors do not
#: correlate with the weight). A scale off by a factor ``s`` (a global scale written 1.25x, an FP8 scale 1.05x)
#: moves the gain to ``s`` and the error to about ``sqrt((s-1)^2 + e^2)``, ``e`` the format's own error, so it fails
#: once ``|s - 1| > e / sqrt(3)``, well inside the relative-L2 limit. Measured on correct outputs: ``|gain - 1|`` up to
#: 0.1x the error on real weights (all-MiniLM-L6-v2, six schemes) and 0.41x on random weights with very heavy tails
#: (log-normal magnitudes, sigma 1.5; MXFP4, W4A16 with the imatrix observer)
GAIN_SHARE = 0.5
GAIN_FLOOR = 0.005
#: MXFP4/MXFP8: their power-of-two scales (E8M0, ``floor(log2 amax)`` less the format's largest exponent) clip the
#: largest values of a block by design, which lowers the gain by up to ~0.4x the error on heavy-tailed weights; a
#: scale off by a factor there is off by a power of two (gain 0.5 or 2), which this share still fails
GAIN_SHARE_MX = 1.0
#: against a quantized reference (a requantization): rounding values that already lie on another grid is biased by
#: itself (measured over 10 compressed-tensors, 4 GPTQ, AWQ and ModelOpt sources x 7 targets: |gain - 1| up to 0.048,
#: a GPTQ int4 source to W4A16, and up to 0.89x the error, MXFP4 to W8A8), so only a larger factor fails there
GAIN_FLOOR_REQUANT = 0.08
GAIN_SHARE_REQUANT = 0.75


def gain_limit(fmt, rel: float, requantized: bool, n_eff: float | None = None) -> float:
    """The largest ``|gain - 1|`` accepted for a module of format ``fmt`` whose relative L2 error is ``rel``
    (the constants above): against a quantized reference (``requantized``) the wider limit. ``n_eff``: the weight's
    effective number of values, ``(sum x^2)^2 / sum x^4`` (:func:`effective_values`): where a few values hold its
    energy (one 3e38 value among 1e-2 ones: ``n_eff`` ~1) their own rounding errors do not average out and move the
    gain by up to ``rel``, so the limit is at least ``GAIN_FEW * rel / sqrt(n_eff)`` (nothing for real weights, whose
    ``n_eff`` is in the thousands)."""
    few = GAIN_FEW * rel / math.sqrt(n_eff) if n_eff else 0.0
    if requantized:
        return max(GAIN_FLOOR_REQUANT, GAIN_SHARE_REQUANT * rel, few)
    return max(GAIN_FLOOR, (GAIN_SHARE_MX if str(fmt).startswith("mxfp") else GAIN_SHARE) * rel, few)


#: the gain limit's share of ``rel / sqrt(n_eff)`` (gain_limit): one dominant value moves the gain by its own error, ``rel``
GAIN_FEW = 2.0


def effective_values(acc: list) -> float | None:
    """``(sum x^2)^2 / sum x^4`` of the reference from :func:`add_error_sums`' accumulator (None when it is all zero)."""
    return acc[1] * acc[1] / acc[4] if acc[4] > 0 else None


def error_threshold(weights: dict) -> float:
    return THRESHOLDS.get((weights.get("type"), int(weights.get("num_bits") or 0)), 0.3)


def gain_message(row: dict) -> str:
    g, rel = row["gain"], row["rel_l2"]
    return (
        f"the dequantized weight is {g:.4f}x the reference's (least-squares gain; its relative L2 error {rel:.4f} is within "
        f"{row['threshold']}, but a correct quantization's gain is within {row['gain_limit']:.4f} of 1): "
        "a scale (global, per tensor or per group) is off by about that factor"
    )


#: |value| beyond which a chunk's error sums are taken in float64: fp32 squares overflow past ~1.8e19, and a row sums K of them
WIDE = 2.0**50


def widened(got, wants: dict) -> tuple:
    """``got`` (fp32 ``[r, K]``) and ``wants`` (key -> fp32 reference ``[r, K]``) as float64 where any value exceeds
    :data:`WIDE` (a reference with weights of 1e19 and beyond: in fp32 its error sums were inf and its error NaN), else
    as they are (fp32, today's sums bit for bit)."""
    if got.numel() and max(float(got.abs().max()), max(float(w.abs().max()) for w in wants.values())) > WIDE:
        return got.double(), {key: w.double() for key, w in wants.items()}
    return got, wants


def add_error_sums(acc: list, got, want) -> None:
    """Add a chunk's squared error, squared reference, max abs error, ``<got, want>`` and the reference's fourth powers
    (in float64) to ``acc`` (five floats, in that order; :func:`error_stats`, the gain and :func:`effective_values`
    read them). ``got``/``want``: the dequantized and reference values, one shape and dtype."""
    d = got - want
    w2 = want * want
    acc[0] += float((d * d).sum())
    acc[1] += float(w2.sum())
    acc[2] = max(acc[2], float(d.abs().max()) if d.numel() else 0.0)
    acc[3] += float((got * want).sum())
    acc[4] += float((w2.double() ** 2).sum())


def error_stats(se: float, sr: float, mx: float) -> tuple[float, float, float]:
    """``(relative L2, max abs, SNR in dB)`` from the sums of squared error and squared reference."""
    rel = math.sqrt(se / sr) if sr > 0 else (0.0 if se == 0 else math.inf)
    if math.isnan(se) or math.isnan(sr):
        snr = math.nan
    elif se > 0 and sr > 0:  # an error that overflowed (se = inf, a scale off by 2^120): -inf dB, not log10(0)
        snr = 10 * math.log10(sr / se) if sr / se > 0 else -math.inf
    else:
        snr = math.inf
    return rel, mx, snr


def split_reference(ref: Checkpoint, ckpt: Checkpoint, problems: list[Problem]) -> Checkpoint:
    """The reference as the output names it: each fused 3-D expert tensor the output does not hold under its own
    name is replaced by its per-expert parts (:func:`ctconvert.checkpoint.families.split_fused_experts`)."""
    try:
        fused = split_fused_experts(ref.tensors, ref.config)
    except CTConvertError as e:
        problems.append(Problem("warning", f"reference fused experts not split: {e.message}", e.file, e.tensor))
        return ref
    split = {n: fe for n, fe in fused.items() if n not in ckpt.tensors}
    if not split:
        return ref
    tensors = {n: i for n, i in ref.tensors.items() if n not in split}
    tensors.update({p.name: p for fe in split.values() for p in fe.parts})
    return dataclasses.replace(ref, tensors=tensors)


def unread_note(ckpt: Checkpoint) -> Problem:
    """The note of an output none of whose tensors could be read (``verify --reference`` compares nothing then): the
    reader refuses a shard with one damaged tensor (truncated, say) as a whole, so the note counts the tensors its
    shards' headers name and those the errors above call damaged, not "no tensor could be read" of one short tensor."""
    named, unparsed = 0, 0
    for f in ckpt.files:
        names = _header_names(f)
        named += len(names or ())
        unparsed += names is None
    damaged = len({p.tensor for p in ckpt.problems if p.severity == "error" and p.tensor})
    if not named:
        return Problem("note", "not compared with --reference: no shard's header could be read, so no tensor of the output was (the errors above)")
    shards = f"{plural(len(ckpt.files) - unparsed, 'shard')} that {agree(len(ckpt.files) - unparsed, 'holds', 'hold')} them"
    why = f"{plural(damaged, 'tensor')} of {named} {agree(damaged, 'is', 'are')} damaged (the errors above)" if damaged else "the errors above"
    more = f"; {plural(unparsed, 'other shard')} unreadable" if unparsed else ""
    return Problem(
        "note",
        f"not compared with --reference: {why}, and the reader refuses the {shards} as a whole, so none of the output's {named} tensors was compared{more}",
    )


def _header_names(path) -> list[str] | None:
    """The tensor names a safetensors file's header lists (its data unchecked), or None where the header itself cannot be read."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 100 * 2**20)).decode("utf-8"))
        return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else None
    except (OSError, struct.error, ValueError):
        return None


def loose_row(row: dict, info, src, loose: float) -> dict:
    """What a dense output's Linear weight ``info`` (a ``decompress`` copy) is judged by when it is not its dense
    reference ``src`` up to a cast: the loosest format limit ``loose`` (it may have been quantized); and where the
    output is 2:4 sparse (two zeros or more in every group of 4 along K: a decompressed ``--sparsity 2:4`` output),
    against the reference pruned 2:4 by :func:`~ctconvert.formats.sparse24.prune24` (the pruning alone gives ~0.36 on
    Gaussian weights, beyond every limit), the error against the dense reference kept beside it (``rel_l2_dense``).
    Returns the row's updates."""
    from ..formats.sparse24 import prune24
    from .safetensors_io import iter_row_chunks, read_rows

    k = info.shape[-1] if len(info.shape) == 2 else 0
    sums, r0 = [0.0, 0.0], 0
    if k and k % 4 == 0 and str(info.dtype) in ("BF16", "F16", "F32"):
        for r0, got in iter_row_chunks(info):
            got = got.float()
            if not bool(((got.reshape(got.shape[0], -1, 4) == 0).sum(dim=2) >= 2).all()):
                return {"threshold": loose, "ok": row["rel_l2"] <= loose}  # not 2:4
            want = prune24(read_rows(src, r0, r0 + got.shape[0])).float()
            sums[0] += float(((got - want) ** 2).sum())
            sums[1] += float((want * want).sum())
        rel = math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else (0.0 if sums[0] == 0 else math.inf)
        return {"against": "2:4-pruned reference", "rel_l2_dense": row["rel_l2"], "rel_l2": rel, "threshold": loose, "ok": rel <= loose}
    return {"threshold": loose, "ok": row["rel_l2"] <= loose}


def error_summary(rows: list[dict]) -> dict | None:
    """The summary of ``verify``'s error rows (its report's ``summary``, above its error table; None without rows): how
    many modules were compared, how many failed, the worst one, the gains' range."""
    if not rows:
        return None
    worst = max(rows, key=lambda r: r["rel_l2"])
    return {
        "modules": len(rows),
        "failed": sum(not r["ok"] for r in rows),
        "worst_module": worst["module"],
        "worst_rel_l2": worst["rel_l2"],
        "worst_threshold": worst["threshold"],
        "min_snr_db": min(r["snr_db"] for r in rows),
        "gain_failed": sum(not r.get("gain_ok", True) and r["rel_l2"] <= r["threshold"] for r in rows),  # failed on the gain alone
        "values_failed": sum(not r.get("grid_ok", True) for r in rows),  # with values off the grid (checkpoint/grid.py)
        "min_gain": min((r["gain"] for r in rows if "gain" in r), default=None),  # dense rows (a decompress output) have none
        "max_gain": max((r["gain"] for r in rows if "gain" in r), default=None),
        **_sparse_summary(rows),
    }


def _sparse_summary(rows: list[dict]) -> dict:
    """The worst error against the dense reference of the 2:4 modules (their pruning), when there are any."""
    sparse = [r for r in rows if "rel_l2_dense" in r]
    if (worst := max(sparse, key=lambda r: r["rel_l2_dense"], default=None)) is None:
        return {}
    return {"sparse_modules": len(sparse), "worst_dense_module": worst["module"], "worst_rel_l2_dense": worst["rel_l2_dense"]}
