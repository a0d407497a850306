"""The groups an observer searches: a weight chunk reshaped per strategy, the checks, MX, the absmax of ranges."""

from __future__ import annotations

import torch

from ..base import WeightArgs

__all__ = ["args_refusal", "check_weight", "grouped", "is_mx", "range_absmax"]


def grouped(w: torch.Tensor, args: WeightArgs) -> torch.Tensor:
    """``w`` ``[N, K]`` as llm-compressor observes it, without the leading observation dim: ``[N, G, g]``.

    group / tensor_group: ``[N, K/g, g]``; channel: ``[N, 1, K]``; tensor: ``[1, 1, N*K]`` (the chunk must then
    be the whole tensor). Raises ``ValueError`` for a non-2-D ``w``, a K that is not a multiple of the group
    size, and the block strategy.
    """
    if w.dim() != 2:
        raise ValueError(f"an observer takes a 2-D weight chunk, got shape {tuple(w.shape)}")
    n, k = w.shape
    if args.strategy in ("group", "tensor_group"):
        g = args.group_size
        if not g or k % g:
            raise ValueError(f"K={k} is not a multiple of the group size {g}")
        return w.reshape(n, k // g, g)
    if args.strategy == "channel":
        return w.reshape(n, 1, k)
    if args.strategy == "tensor":
        return w.reshape(1, 1, n * k)
    raise ValueError(f"observers do not take the {args.strategy!r} strategy")


def args_refusal(args: WeightArgs) -> str | None:
    """Why no observer takes weights of ``args`` (None: they take one): the block strategy, asymmetric FP4,
    float of other than 4 or 8 bits, FP4 neither NVFP4 nor MXFP4."""
    if args.strategy not in ("group", "tensor_group", "channel", "tensor"):
        return f"observers do not take the {args.strategy!r} strategy"
    if args.type == "float" and args.num_bits == 4 and not args.symmetric:
        return "asymmetric FP4 is not a quantization compressed-tensors implements"
    if args.type == "float" and args.num_bits not in (4, 8):
        return f"float weights of {args.num_bits} bits are not taken by the observers"
    if args.type == "float" and args.num_bits == 4 and args.strategy not in ("tensor_group",) and not is_mx(args):
        return "FP4 takes an observer as NVFP4 (tensor_group, 16) or MXFP4 (group, 32)"
    return None


def check_weight(w: torch.Tensor, args: WeightArgs) -> None:
    """Raises ``ValueError`` for a weight or scheme no observer takes: not bf16/fp16/fp32, NaN or inf, or
    weights of :func:`args_refusal`'s kinds."""
    if not w.dtype.is_floating_point or w.element_size() < 2:
        raise ValueError(f"an observer takes a bf16/fp16/fp32 weight, got {w.dtype}")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("the weight holds NaN or inf: no observer range can be searched for it")
    if (why := args_refusal(args)) is not None:
        raise ValueError(why)


def is_mx(args: WeightArgs) -> bool:
    """Whether ``args`` are an MX scheme (E8M0 scales): float, 4 or 8 bits, strategy group, group 32, as
    compressed-tensors' ``should_generate_mx_scales`` tells (there also ``scale_dtype=uint8``, which
    :class:`WeightArgs` does not carry: ctconvert writes no FP8 group-32 scheme with D scales)."""
    return args.type == "float" and args.num_bits in (4, 8) and args.strategy == "group" and args.group_size == 32


def range_absmax(mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """The absmax of searched ranges, as ``Observer.get_global_scale`` takes it: ``max(max(mx), -min(mn))``.

    ``mn``/``mx``: the ranges of one tensor (any shape, dtype D). Returns fp32 0-d holding a value of D;
    the NVFP4 global scale of a fused set is :func:`.fp4.nvfp4_global_scale` of the max over its members.
    """
    return torch.maximum(mx.max(), -mn.min()).to(torch.float32)
