"""What the error that refuses a targeted weight tells the user to do (the planner's phase 2: ``planner._decide``).

A weight the scheme cannot take (its shape, its dtype) or that vLLM 0.33 cannot load quantized is refused before any
work, naming the tensor and one way out that works:

* a weight of its own: leave it dense (``--ignore MODULE``, or an entry of the recipe's ``ignore``) or pass
  ``--skip-incompatible``;
* a member of a fused set (``q_proj``/``k_proj``/``v_proj`` ...): the whole set dense, since vLLM loads a fused layer
  with one scheme;
* an expert of a MoE block whose shape the scheme cannot take: vLLM loads every expert of a block, every
  projection, with one scheme (``compressed_tensors_moe.py``), so ignoring that expert only moves the refusal to
  the next one, and ``--skip-incompatible`` keeps that projection of every expert dense while the others are
  quantized (the plan then refuses experts quantized unlike each other): leave the block's experts dense in every
  layer, or, where the problem is K against a group size the scheme lets you choose (``--group-size`` of W4A16,
  W4A16_ASYM, W8A16), use one that divides K. (An expert vLLM cannot load quantized is refused alike in every
  expert and projection: ``--skip-incompatible`` keeps them all dense, and is named.)
"""

from __future__ import annotations

import re

from ..checkpoint.families import is_expert
from ..checkpoint.naming import fused_key, fused_set_name

__all__ = ["every_layer", "refusal_hint"]

#: group sizes suggested for an expert whose K the preset's group does not divide (vLLM's Marlin and Machete kernels
#: take 32, 64 and 128; compressed-tensors any)
GROUP_SIZES = (64, 32)
#: the schemes whose group size ``--group-size`` sets (:data:`ctconvert.options` ``group_size``)
GROUP_SIZE_SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16")


def every_layer(module: str) -> str:
    """A ``re:`` pattern for ``module`` in every layer (and, for an expert, every expert of its block and all its
    projections, and the fused tensors they are split from): ``model.layers.0.mlp.experts.3.down_proj`` ->
    ``re:model\\.layers\\.\\d+\\.mlp\\.experts.*``."""
    head, sep, _ = module.partition(".experts.")
    return "re:" + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(head + "." if sep else module)) + ("experts.*" if sep else "$")


def refusal_hint(module: str, shape: tuple, scheme, unloadable: bool, modules, flag: str) -> str:
    """The way out the refusal of ``module`` names (module docstring). ``shape``: its weight's; ``scheme``: the
    :class:`~ctconvert.plan.schemes.Scheme` it was targeted with; ``unloadable``: vLLM cannot load it quantized
    (rather than the scheme not taking its shape); ``modules``: every module of the checkpoint (a fused set's
    members present); ``flag``: ``--ignore``, or what names the recipe's ignore list."""

    def dense(entry: str) -> str:
        return f"an entry in the recipe's ignore ('{entry}')" if flag != "--ignore" else f"--ignore '{entry}'"

    group = _fitting_group(shape, scheme)
    if is_expert(module) and not unloadable:  # (an expert vLLM cannot load: every expert alike, --skip-incompatible works)
        why = "vLLM loads every expert of a MoE block, every projection, with one scheme"
        hint = f"leave the block's experts dense in every layer with {dense(every_layer(module))} ({why})"
        return hint + (f", or quantize them with a group size that divides K={shape[-1]}: --group-size {group}" if group else "")
    # one entry for every layer (and expert) vLLM cannot load; for a shape, for every layer that holds the module too
    # (its shape comes from the config: the next run would refuse the next layer's)
    entry = every_layer(module) if unloadable or _in_other_layers(module, modules) else module
    fit = f", quantize with a group size that divides K={shape[-1]} (--group-size {group})," if group else ""
    key = fused_key(module)
    present = [m for m in key[1] if f"{key[0]}.{m}" in modules] if key else []
    if len(present) > 1:  # vLLM loads a fused layer with one scheme: the whole set stays dense, or none of it
        others = ", ".join(m for m in present if m != module.rpartition(".")[2])
        return (
            f"leave it dense with {dense(entry)} and its fused set's other members ({others}; vLLM loads "
            f"{fused_set_name(key[0], present)} with one scheme){fit or ','} or pass --skip-incompatible (keeps the whole set dense)"
        )
    return f"leave it dense with {dense(entry)}{fit} or pass --skip-incompatible"


def _fitting_group(shape: tuple, scheme) -> int | None:
    """A group size below the scheme's that divides the weight's K, where K is what the scheme's group does not divide
    and ``--group-size`` sets it (:data:`GROUP_SIZE_SCHEMES`); None otherwise."""
    k = shape[-1] if len(shape) == 2 else 0
    group = scheme.weights.group_size
    base = scheme.base or scheme.name  # (a 2:4 scheme's base is a scheme: --group-size does not set its group)
    if not (group and k % group and isinstance(base, str) and base.upper() in GROUP_SIZE_SCHEMES):
        return None
    return next((g for g in GROUP_SIZES if g < group and k % g == 0), None)


def _in_other_layers(module: str, modules) -> bool:
    """Whether another numbered layer holds ``module``'s path too (``model.layers.0.self_attn.kv_b_proj`` and
    ``model.layers.1.self_attn.kv_b_proj``)."""
    pattern = re.compile(every_layer(module)[3:])
    return any(m != module and pattern.match(m) for m in modules) if re.search(r"\.\d+\.", module) else False
