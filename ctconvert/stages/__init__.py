"""The stages of a conversion: source -> plan -> (calibrate) -> quantize -> (layout) -> write."""
