"""Build ``config.json``'s ``quantization_config`` in compressed-tensors' own serialization.

The block is what compressed-tensors' ``ModelCompressor.update_config``
writes (docs/compressed-tensors-format.md §7.1, §7.4): its pydantic
``QuantizationConfig.model_dump`` (config groups from the presets, ``format``,
``ignore``, ``quantization_status: "compressed"``, the null optional keys)
plus ``quant_method``, ``version``, ``sparsity_config: {}`` and
``transform_config: {}``. ``tests/test_config.py`` builds the same block with
the library and checks equality, and that the library validates ours.
"""

from __future__ import annotations

import copy
from importlib import metadata
from pathlib import Path

from ..errors import BadInputError, UnsupportedError


def _ct_version() -> str:
    try:
        return metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        return "0.20.1"


def build_quantization_config(groups: dict[str, tuple[object, list[str]]], fmt: str, ignore: list[str]) -> dict:
    """``groups``: name -> (Scheme, targets). Returns the ``quantization_config`` dict."""
    return {
        "version": _ct_version(),
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {name: s.config_group(t) for name, (s, t) in groups.items()},
        "kv_cache_scheme": None,
        "format": fmt,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "moe_sparsity_config": None,
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


def require_compressed_tensors(qcfg: dict | None, config_file: Path, command: str, fix: str) -> None:
    """Refuse an input ``command`` cannot take, the same way for every command that reads a compressed checkpoint:
    no ``quantization_config`` (a dense checkpoint) is :class:`BadInputError` (exit 3); another ``quant_method``
    (AutoAWQ, GPTQ, HF FP8 ...) is :class:`UnsupportedError` (exit 4). ``fix``: what to do instead."""
    if not qcfg:
        what = "not a quantized checkpoint (config.json has no quantization_config)"
        raise BadInputError(f"{what}: {command} takes a compressed-tensors one; {fix}", file=config_file)
    if qcfg.get("quant_method") != "compressed-tensors":
        raise UnsupportedError(
            f"quant_method {qcfg.get('quant_method')!r} is not compressed-tensors: {command} takes a compressed-tensors checkpoint "
            "(`ctconvert convert` re-expresses ModelOpt NVFP4, AutoAWQ and GPTQ ones losslessly; `ctconvert quantize` requantizes any)",
            file=config_file,
        )
