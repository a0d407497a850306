"""Calibration: the activation statistics static and W4A4 schemes need, gathered one decoder layer at a time.

Between the plan and the quantizer (read -> plan -> **calibrate** -> quantize -> write):
:mod:`.data` turns ``--calibration`` input (or the shipped corpus) into token ids,
:mod:`.model` runs the checkpoint's own transformers architecture one decoder layer at a
time (only that layer's weights in memory), and :mod:`.observe` turns the recorded
min/max into compressed-tensors' scales (``input_global_scale``, ``input_scale``,
``input_zero_point``, ``k_scale``/``v_scale``) with compressed-tensors' own functions, and
:mod:`.apply` adds the calibrated tensors' names to the plan and returns their values after the run.
"""
