"""Kernel-native layouts: the tensors vLLM builds at load time, built offline (kernel-layouts.md).

Pure, device-agnostic torch functions (index math only; they run on the GPU
when given CUDA tensors), each with an exact inverse. Nothing here imports
from the rest of the package.
"""
