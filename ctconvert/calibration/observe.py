"""Observers: running min/max of activations, and the scales compressed-tensors derives from them.

The statistic is llm-compressor's ``static_minmax`` observer (the observer the
``FP8`` and ``NVFP4`` presets name; llm-compressor ``observers/min_max.py``,
``StaticMinMaxObserver``): the elementwise min and max of every observed value,
over all calibration tokens, combined across batches with ``min``/``max``
(exact in any dtype: no averaging). The reductions run on the values in the
model's dtype, as the observer sees them.

With ``Stats.collect_importance`` set (the ``imatrix`` weight observers), each Linear's input also feeds its
:class:`~ctconvert.formats.observers.Importance` (llm-compressor ``observers/imatrix.py``: the fp32 sum of ``x ** 2``
per input channel and the token count), one sample of a micro-batch at a time, in order, as llm-compressor's
batch-size-1 calibration adds them.

The scales are compressed-tensors' own functions (release 0.20,
``compressed_tensors/quantization/utils/helpers.py``): ``generate_gparam`` for the
NVFP4 ``input_global_scale`` (fp32 ``[1]``; llm-compressor ``observers/base.py``
``get_global_scale`` feeds it ``(-absmax, absmax)`` of the fused set) and
``calculate_qparams`` for static per-tensor ``input_scale`` / ``input_zero_point``
and the KV cache ``k_scale`` / ``v_scale``. Scales are stored in the model dtype
(compressed-tensors ``lifecycle/initialize.py`` creates them with the observed
module's dtype), zero points as ``zp_dtype`` (int8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats.observers import Importance

__all__ = ["MinMax", "Stats", "global_scale_of", "input_qparams", "kv_qparams"]


@dataclass
class MinMax:
    """Running elementwise min/max over the reduced dimensions (a 0-d tensor each, or per head ``[H]``)."""

    min: torch.Tensor | None = None
    max: torch.Tensor | None = None
    tokens: int = 0

    def update(self, x: torch.Tensor, keep_dim: int | None = None) -> None:
        """Observe ``x``: all of it (``keep_dim`` None), or per index of dimension ``keep_dim``."""
        if x.numel() == 0:
            return
        if keep_dim is None:
            lo, hi = torch.aminmax(x)
        else:
            dims = tuple(d for d in range(x.dim()) if d != keep_dim)
            lo, hi = torch.amin(x, dim=dims), torch.amax(x, dim=dims)
        self.min = lo if self.min is None else torch.minimum(self.min, lo)
        self.max = hi if self.max is None else torch.maximum(self.max, hi)
        self.tokens += x.numel() // max(1, x.shape[-1])

    def cpu(self) -> MinMax:
        """A copy on the CPU (the same values: a copy, no arithmetic)."""
        return MinMax(self.min.cpu(), self.max.cpu(), self.tokens)

    def merged(self, other: MinMax) -> MinMax:
        if self.min is None:
            return other
        if other.min is None:
            return self
        return MinMax(torch.minimum(self.min, other.min), torch.maximum(self.max, other.max), self.tokens + other.tokens)


@dataclass
class Stats:
    """What a calibration pass recorded: Linear inputs and attention key/value states, by checkpoint module name."""

    inputs: dict[str, MinMax] = field(default_factory=dict)  # Linear module -> its input's min/max
    keys: dict[str, MinMax] = field(default_factory=dict)  # attention module -> cached key states (post-RoPE)
    values: dict[str, MinMax] = field(default_factory=dict)
    tokens: int = 0
    notes: list[str] = field(default_factory=list)  # how the model was run (eager attention where it has no SDPA)
    importance: dict[str, Importance] = field(default_factory=dict)  # Linear module -> its inputs' E[x^2] statistic
    collect_importance: bool = False

    def observe_input(self, module: str, x: torch.Tensor) -> None:
        """One forward call's input ``x`` ``[..., K]`` of Linear ``module``: its min/max, and its importance when collected."""
        self.inputs.setdefault(module, MinMax()).update(x)
        if self.collect_importance:
            self.importance.setdefault(module, Importance()).add_samples(x)

    def cpu(self) -> Stats:
        conv = lambda d: {k: v.cpu() for k, v in d.items() if v.min is not None}
        out = Stats(conv(self.inputs), conv(self.keys), conv(self.values), self.tokens, list(self.notes))
        out.importance = {k: v.cpu() for k, v in self.importance.items()}
        return out


def _ct():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    return QuantizationArgs, calculate_qparams, generate_gparam


def global_scale_of(stats: list[MinMax]) -> torch.Tensor:
    """NVFP4 ``input_global_scale`` (fp32 ``[1]``) of a fused set: ``generate_gparam(-absmax, absmax)`` over all members."""
    _, _, generate_gparam = _ct()
    absmax = None
    for s in stats:
        a = torch.maximum(-s.min.min(), s.max.max())
        absmax = a if absmax is None else torch.maximum(absmax, a)
    return generate_gparam(-absmax.reshape(1), absmax.reshape(1))


def input_qparams(input_args: dict, stats: list[MinMax], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The calibrated input tensors of one Linear (``stats``: its fused set's members, which see one input).

    ``input_args``: the preset's ``input_activations`` dict. Returns ``input_global_scale`` (fp32 ``[1]``) for
    ``tensor_group`` (NVFP4), or ``input_scale`` (``dtype`` ``[1]``) and, when asymmetric, ``input_zero_point``
    (int8 ``[1]``) for static ``tensor`` inputs.
    """
    if input_args["strategy"] == "tensor_group":
        return {"input_global_scale": global_scale_of(stats)}
    QuantizationArgs, calculate_qparams, _ = _ct()
    args = QuantizationArgs(**{k: v for k, v in input_args.items() if k != "observer"})
    lo = stats[0].min
    hi = stats[0].max
    for s in stats[1:]:
        lo, hi = torch.minimum(lo, s.min), torch.maximum(hi, s.max)
    scale, zp = calculate_qparams(lo.reshape(1), hi.reshape(1), args)
    out = {"input_scale": scale.to(dtype).reshape(1)}
    if not args.symmetric:
        out["input_zero_point"] = zp.to(torch.int8).reshape(1)
    return out


#: the KV cache scheme ``--kv-cache fp8`` writes (compressed-tensors ``QuantizationArgs.model_dump``, as llm-compressor's
#: FP8 KV cache recipes give it, with the observer named: llm-compressor's default for a KV cache scheme without
#: one is ``minmax``, a moving average over batches); ``fp8-head`` is the same per attention head (``attn_head``)
KV_CACHE_ARGS = {
    kind: {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy, "dynamic": False, "observer": "static_minmax"}
    for kind, strategy in (("fp8", "tensor"), ("fp8-head", "attn_head"))
}


def kv_qparams(kind: str, key: MinMax, value: MinMax, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``k_scale`` and ``v_scale`` of one attention module (``dtype``; ``[1]``, or ``[H, 1, 1]`` per KV head)."""
    QuantizationArgs, calculate_qparams, _ = _ct()
    args = QuantizationArgs(**{k: v for k, v in KV_CACHE_ARGS[kind].items() if k != "observer"})
    out = {}
    for name, s in (("k_scale", key), ("v_scale", value)):
        lo, hi = (s.min.min().reshape(1), s.max.max().reshape(1)) if kind == "fp8" else (s.min.reshape(-1), s.max.reshape(-1))
        scale, _ = calculate_qparams(lo, hi, args)
        out[name] = scale.to(dtype).reshape((1,) if kind == "fp8" else (-1, 1, 1))
    return out
