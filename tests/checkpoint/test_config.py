"""Our quantization_config equals what compressed-tensors itself builds, and the library accepts it."""

from __future__ import annotations

import pytest

from ctconvert.checkpoint.config import build_quantization_config
from ctconvert.plan.schemes import get_scheme, scheme_names


def ct_build(groups: dict, fmt: str, ignore: list[str]) -> dict:
    """compressed-tensors' path: presets -> QuantizationConfig -> model_dump (+ update_config's keys)."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, preset_name_to_scheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    cg = {}
    for name, (scheme, targets) in groups.items():
        if scheme.name in PRESET_SCHEMES:
            s = preset_name_to_scheme(scheme.name, targets)
        else:  # our static INT8 schemes (compressed-tensors has no preset for them): W8A8 weights, static per-tensor inputs
            w = PRESET_SCHEMES["W8A8"]["weights"]
            sym = not scheme.name.endswith("ASYM")
            inputs = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=sym, dynamic=False, observer="static_minmax")
            s = QuantizationScheme(targets=targets, weights=w, input_activations=inputs)
        s.format = scheme.format
        cg[name] = s
    q = QuantizationConfig(config_groups=cg, format=fmt, ignore=ignore, quantization_status="compressed")
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **q.model_dump(exclude=["quant_method"]),
    }


@pytest.mark.parametrize("name", scheme_names())
def test_config_matches_compressed_tensors(name):
    s = get_scheme(name)
    groups = {"group_0": (s, ["Linear"])}
    ours = build_quantization_config(groups, s.format, ["lm_head", "model.layers.0.mlp.gate"])
    assert ours == ct_build(groups, s.format, ["lm_head", "model.layers.0.mlp.gate"])


def test_mixed_lm_head_config_matches_and_validates():
    from compressed_tensors.quantization import QuantizationConfig

    groups = {"group_0": (get_scheme("W4A16"), ["Linear"]), "lm_head": (get_scheme("NVFP4A16"), ["lm_head"])}
    ours = build_quantization_config(groups, "mixed-precision", [])
    assert ours == ct_build(groups, "mixed-precision", [])
    q = QuantizationConfig.model_validate(ours)
    assert q.config_groups["lm_head"].weights.group_size == 16
