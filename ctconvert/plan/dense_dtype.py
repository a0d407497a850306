"""``quantize --dense-dtype``: the tensors that are not quantized, cast to one dtype (as ``mlx_lm.convert --dtype`` does).

Every floating-point tensor the plan copies (embeddings, norms, biases, routers,
a dense ``lm_head``, Linear layers kept dense by ``ignore``) is written in the
chosen dtype; quantized weights and their scales are not touched (they are
computed from the source values, and the scales' dtype follows the scheme).
``keep`` (the default) changes nothing. ``config.json``'s ``torch_dtype``
(and ``dtype``, where the config has it; also in ``text_config``) then names
the new dtype, which is what transformers builds the model in.

The cast itself is :func:`ctconvert.pipeline.casting.cast_chunk`, on the host
bytes as the executor copies them.
"""

from __future__ import annotations

from ..errors import agree, plural
from .planner import Plan

__all__ = ["CASTABLE", "DENSE_DTYPES", "apply_dense_dtype", "short_name"]

#: ``--dense-dtype`` value -> safetensors dtype (``keep``: none)
DENSE_DTYPES = {"keep": None, "bf16": "BF16", "fp16": "F16", "fp32": "F32"}
#: the stored dtypes a cast applies to (the floating dtypes a checkpoint's dense weights come in, as ``decompress --dtype``)
CASTABLE = ("F32", "F16", "BF16")
_SHORT = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}
_CONFIG_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_DTYPE_KEYS = ("torch_dtype", "dtype")


def short_name(st_dtype: str) -> str:
    """``F32`` -> ``fp32`` (the spelling of the options and the plan)."""
    return _SHORT.get(st_dtype, st_dtype)


def apply_dense_dtype(plan: Plan, dense_dtype: str, config: dict) -> int:
    """Cast every copied floating tensor of ``plan`` to ``dense_dtype`` (``bf16``/``fp16``/``fp32``; ``keep``: nothing).

    Rewrites in place: each such copy unit's output dtype and ``cast`` (the safetensors dtype to write),
    each row's ``cast`` (``"fp32->bf16"``, shown by the plan), and ``plan.config_updates`` (the dtype keys
    of ``config``). Tensors already in that dtype are copied as they are. Returns how many are cast."""
    target = DENSE_DTYPES[dense_dtype]
    if target is None:
        return 0
    rows = {r.name: r for r in plan.rows}
    cast, wide = 0, []
    for u in plan.units:
        if u.kind != "copy":
            continue
        name, dtype, shape = u.outputs[0]
        if dtype == "F64":
            wide.append(name)
        if dtype not in CASTABLE or dtype == target:
            continue
        u.outputs = [(name, target, shape)]
        u.cast = target
        if (row := rows.get(name)) is not None:
            row.cast = f"{short_name(dtype)}->{short_name(target)}"
        cast += 1
    keys = [k for k in _DTYPE_KEYS if k in config or k in (config.get("text_config") or {})] or ["torch_dtype"]
    plan.config_updates.update(dict.fromkeys(keys, _CONFIG_NAMES[target]))
    plan.notes.append(
        f"--dense-dtype {dense_dtype}: {plural(cast, 'tensor')} that {agree(cast, 'is', 'are')} not quantized {agree(cast, 'is', 'are')} cast to {dense_dtype} "
        "(round to nearest even); "
        f"config.json's {'/'.join(keys)} says {_CONFIG_NAMES[target]}; quantized weights are computed from the source values"
    )
    if wide:  # F64 tensors (a rotary table, a buffer) are copied as they are: the cast covers the weights' dtypes only
        names = ", ".join(wide[:3]) + (" ..." if len(wide) > 3 else "")
        stays = agree(len(wide), "stays", "stay")
        plan.notes.append(f"--dense-dtype {dense_dtype}: {plural(len(wide), 'F64 tensor')} {stays} F64 (it casts F32, F16 and BF16 tensors): {names}")
    return cast
