"""Planning: every tensor's fate, decided from the headers before any data is read.

:mod:`.schemes` (presets and their formats), :mod:`.planner` (the plan of a
conversion), :mod:`.layout` (kernel-native layouts for ``repack`` and
``quantize --target``).
"""
