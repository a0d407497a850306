"""Numeric formats: pure, device-agnostic functions on tensors.

Nothing here imports from the rest of the package. Every function computes in
fp32 and rounds to the model dtype ``D`` exactly where compressed-tensors'
CPU path rounds (compressed-tensors-format.md §6), so the results are the same
bytes on any device.
"""
