"""Kernel-native layouts: the tensors vLLM builds at load time, built offline (docs/kernel-layouts.md).

Pure, device-agnostic torch functions (index math only; they run on the GPU
when given CUDA tensors), each with an exact inverse. :mod:`.kernels` is the
table of kernels (what each takes, its repack and its inverse); :mod:`.batched`
repacks many same-shaped modules at once. Nothing here imports from the rest
of the package but :mod:`ctconvert.cbuild` (the C build of :mod:`.cpu`).
"""
