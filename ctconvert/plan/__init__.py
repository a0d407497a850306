"""Planning: every tensor's fate, decided from the headers before any data is read.

:mod:`.schemes` (presets and their formats), :mod:`.planner` (the plan of a
conversion), :mod:`.kernel_targets` (the ``--target`` table: the kernels each target offers; the layout
stage that plans them is :mod:`ctconvert.stages.layout`).
"""
