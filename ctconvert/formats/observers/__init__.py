"""Weight observers: the per-group ranges a format's quantizer turns into scales, llm-compressor's way.

An observer looks at a weight chunk ``w`` ``[N, K]`` (bf16/fp16/fp32) and returns, per quantization group,
the ``(min, max)`` range (in the weight's dtype D, shape ``[N, G]``) that the format's quantizer turns into
scales (``WeightFormat.quantize(..., ranges=...)``); the bytes then equal those of llm-compressor 0.14.0.1
``oneshot`` with ``QuantizationModifier(config_groups={...: {"weights": {..., "observer": NAME}}})`` on its
eager (CPU) path, and the output config records ``"observer": NAME`` (and ``"observer_kwargs": {}``) in the
weights' QuantizationArgs, as llm-compressor writes it.

Observers (llm-compressor's registry names, ``llmcompressor/observers/``, release 0.14.0.1):

====================== ====================================================================================
``minmax``             the group's min and max (ctconvert's default; llm-compressor's weight default
                       ``memoryless_minmax``, ``min_max.py: MemorylessMinMaxObserver``): today's bytes and
                       config (no ``observer`` field written)
``memoryless_mse``     ``mse.py: MemorylessMSEObserver``: maxshrink 0.20, patience 5, grid 100, norm 2.4,
                       expand 1.0: 20 steps, p = 1 .. 0.81
``nvfp4_expanded_mse`` ``mse.py: NVFP4ExpandedMSEObserver``: expand 1.8, maxshrink 1 - 0.8/1.8, grid 200,
                       patience 1000, norm 2.4 (PR #2950; ``fouroversix`` is an alias of it there):
                       ``int(maxshrink * grid)`` = 111 steps, p = 1 .. 0.45 (its docstring says 112)
``imatrix_mse``        ``imatrix.py: IMatrixMSEObserver``, with calibration data: maxshrink 0.95, patience 5, grid
                       20, norm 3.0: 20 steps, the error in fp32 weighted by each input channel's E[x^2]
                       (:mod:`.imatrix`)
``nvfp4_expanded_imatrix`` ``imatrix.py: NVFP4ExpandedIMatrixObserver``: ``nvfp4_expanded_mse``'s range, 112 steps
====================== ====================================================================================

The search (``mse_quant.py: _grid_search_mse``, the eager implementation, used for every CPU tensor; the
Triton one, registered for CUDA, differs: a zero point fixed from the unshrunk range and per-group
patience with an error buffer, and is *not* what this module matches):

1. ``observed`` is the weight reshaped per strategy (``helpers.py: _flatten_weight``): group and
   tensor_group ``[1, N, G, g]``, channel ``[1, N, 1, K]``, tensor ``[1, 1, N*K]``. Here: ``[N, G, g]``.
2. ``min0 = amin(observed) * expand``, ``max0 = amax(observed) * expand`` over the group, in D.
3. For step ``i`` in ``range(int(maxshrink * grid))``: ``p = 1 - i / grid``, candidate range
   ``(min0 * p, max0 * p)`` in D; candidate scale and zero point by compressed-tensors 0.19.0
   ``quantization/utils/helpers.py: calculate_qparams`` with ``global_scale=None`` and, for
   tensor_group (NVFP4), ``scale_dtype=None`` (so the candidate NVFP4 scale is ``D(amax / 6)``, neither
   multiplied by a global scale nor rounded to E4M3); fake quantization by ``lifecycle/forward_helpers.py:
   _quantize_dequantize`` with the TOKEN strategy (``x / scale`` in D, ``+ zp``, clamp, round to the
   element type: ``torch.round`` for int, E4M3 for FP8, ``fp4_utils.py: cast_to_fp4`` for FP4, then
   ``(q - zp) * scale`` in D); error ``sum(|q - observed| ** norm)`` over the group, in D.
4. A group keeps the candidate whose error is strictly below its best so far (the first of equal
   errors wins; the initial best error is ``finfo(D).max``, so a group whose every error is inf keeps the
   unshrunk range). Patience is *global*: the loop stops after ``patience`` consecutive steps in which no
   group of the whole tensor improved. With ``nvfp4_expanded_mse`` (patience 1000 > 111 steps) it never
   stops early; with ``memoryless_mse`` (patience 5, 20 steps) it can, and a row chunk alone would stop at
   a different step than the whole tensor: :class:`StopTracker` finds the whole tensor's step count from
   every chunk's ``improved`` steps, and ``search(..., steps=S)`` then gives each chunk the whole tensor's
   ranges.
5. The searched ranges are the observer's statistics: ``base.py: Observer.get_qparams`` computes the
   scales from them by ``calculate_qparams`` (the format's usual min/max arithmetic), and for tensor_group
   the global scale from the absmax of the *searched* ranges of every fused partner
   (``base.py: Observer.get_global_scale``, ``fusion.py: FusionHandler``, ``helpers.py:
   FUSED_LAYER_NAMES``: q/k/v, gate/up, q_a/kv_a_with_mqa, w1/w3): :func:`range_absmax`.

Every step here is the same torch operation on the same dtypes as llm-compressor's (so the same bytes,
with the same torch, rounding, reductions and ``pow`` included); for MX schemes (:func:`is_mx`) the
candidate scale is the E8M0 one of ``calculate_qparams`` (``generate_mx_scales``: the search keeps
``scale_dtype=uint8`` for the group strategy). Two facts of torch 2.13's CPU kernels
that this depends on (and that a fused kernel must reproduce): a D tensor times a Python float is
``D(float32(x) * float32(p))``; and ``pow`` of a bf16/fp16 tensor with a Python scalar exponent rounds the
exponent to D first, so the error norm is in effect 2.40625 for bf16 weights and 2.400390625 for fp16
(2.4 for fp32), ``|d| ** norm`` rounded to D, and the group sum accumulates in fp32 and rounds to D. Formats: int (symmetric or not), FP8
(channel, tensor, group), NVFP4 (tensor_group) and MXFP4/MXFP8 (group 32); the block strategy is
refused (``ValueError``).

How a streaming quantizer uses it (one chunk = some rows of one tensor; the pipeline's part, not here):

- ``minmax``: nothing changes (no ranges are passed, the fused quantizers run as today).
- The observer replaces the min/max of the scale step only: ``fmt.quantize(chunk, args, global_scale,
  ranges=(mn, mx))`` with the chunk's searched ranges; everything after (scale arithmetic, rounding,
  packing) is the format's own.
- Pre-pass, when the chunk alone does not decide its ranges:
  NVFP4 (``fmt.needs_global_scale``): the fused set's global scale is
  ``nvfp4_global_scale(max over members and chunks of range_absmax(*search.ranges), D)`` -- the searched
  ranges, not the weights' absmax; global patience (``obs.needs_stop_pass``, ``memoryless_mse``): each
  chunk's ``search(chunk, args, steps=obs.total_steps)`` goes into ``obs.stop_tracker().add(improved)``.
  Keep each chunk's ``Search.step`` (int16 per group; with global patience ``Search.hits``, int64 per
  group) instead of searching again: in the quantize pass ``obs.ranges_from_steps(chunk, args, step)``
  (with ``step = obs.steps_at(hits, tracker.steps)``) gives the same ranges from the chunk's own min/max.
  Both can share one pre-pass (:class:`TensorSearch` does both: ``add`` per chunk, ``absmax``, then
  ``ranges`` per chunk); a tensor needs none when neither applies (a group format with
  ``nvfp4_expanded_mse``, whose patience never stops it: ``obs.ranges(chunk, args)`` per chunk).
- The tensor strategy (FP8 per tensor) searches the whole tensor as one group: its chunk is the tensor.
- Output config: the weights' QuantizationArgs of the group get ``obs.config_fields()``.

An observer that needs data (``needs_data``: the imatrix ones) is bound to it as the executor meets it:
``obs.with_data({module: Importance})`` (the calibration pass'), ``.for_unit(unit.modules)``, ``.member(i)``; a
data-free observer's ``for_unit``/``member`` are itself.

A CUDA chunk of a group strategy (bf16/fp16) is searched on the GPU, with the CPU path's results exactly
(``gpu_search``: every candidate's error bounded in a Triton kernel, the groups whose comparisons the bounds
do not decide settled from torch's own pow and sum); other CUDA chunks are searched on the CPU.

Modules: ``imatrix`` (the imatrix observers and their :class:`Importance` statistic),
``groups`` (the reshape per strategy, the checks, :func:`range_absmax`), ``fake_quant`` (the candidate
qparams and fake quantization, E2M1 rounding), ``search`` (the observers and their grid search), ``patience``
(:class:`StopTracker`), ``prepass`` (:class:`TensorSearch`), ``registry`` (:data:`OBSERVERS`), ``gpu_search``
and ``gpu_kernel`` (the search on the GPU; Triton is imported only for a CUDA chunk).
"""

from .groups import args_refusal, grouped, is_mx, range_absmax
from .imatrix import IMatrixMSEObserver, Importance
from .patience import StopTracker
from .prepass import TensorSearch
from .registry import OBSERVERS, get_observer
from .search import MinMaxObserver, MSEObserver, Search, WeightObserver

__all__ = [
    "OBSERVERS",
    "IMatrixMSEObserver",
    "Importance",
    "MSEObserver",
    "MinMaxObserver",
    "Search",
    "StopTracker",
    "TensorSearch",
    "WeightObserver",
    "args_refusal",
    "get_observer",
    "grouped",
    "is_mx",
    "range_absmax",
]
