"""Kernel-native layouts: the tensors vLLM builds at load time, built offline (docs/kernel-layouts.md).

Pure, device-agnostic torch functions (index math only; they run on the GPU
when given CUDA tensors), each with an exact inverse. :mod:`.kernels` holds the
kernel objects (what each takes, its repack and its inverse; the table of targets that
offers them is ``ctconvert.plan.kernel_targets``); :mod:`.batched`
repacks many same-shaped modules at once. Nothing here imports from the rest
of the package but :mod:`ctconvert.cbuild` (the C build of :mod:`.cpu`).
"""
