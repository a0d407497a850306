"""Build ``config.json``'s ``quantization_config`` with compressed-tensors' own schema.

The groups come from compressed-tensors presets (``preset_name_to_scheme``) and
the whole block is validated and serialized by its pydantic
``QuantizationConfig``, then completed with the keys its ``update_config``
adds (compressed-tensors-format.md §7.1, §7.4): ``quant_method``, ``version``,
``sparsity_config: {}`` and ``transform_config: {}``.
"""

from __future__ import annotations

import copy

from .._ct import import_compressed_tensors


def build_quantization_config(groups: dict[str, tuple[object, list[str]]], fmt: str, ignore: list[str]) -> dict:
    """``groups``: name -> (Scheme, targets). Returns the ``quantization_config`` dict."""
    compressed_tensors = import_compressed_tensors()
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    config_groups = {name: QuantizationScheme.model_validate(s.config_group(t)) for name, (s, t) in groups.items()}
    q = QuantizationConfig(config_groups=config_groups, format=fmt, ignore=list(ignore), quantization_status="compressed")
    data = q.model_dump(exclude=["quant_method"])
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **data,
    }


def updated_config(config: dict, quantization_config: dict, updates: dict) -> dict:
    """A copy of ``config`` with the quantization config and plan updates (e.g. untied embeddings)."""
    out = copy.deepcopy(config)
    for k, v in updates.items():
        out[k] = v
        if isinstance(out.get("text_config"), dict) and k in out["text_config"]:
            out["text_config"][k] = v
    out["quantization_config"] = quantization_config
    return out
