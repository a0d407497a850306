"""What calibration adds to a plan: the calibrated tensors' names (from the headers) and then their values.

:func:`add_outputs` runs at plan time (``--dry-run`` shows it): per quantized Linear of a
calibrated scheme ``input_global_scale`` (NVFP4, fp32 ``[1]``) or ``input_scale`` (model dtype
``[1]``) and ``input_zero_point`` (int8 ``[1]``, asymmetric INT8); with ``--kv-cache`` per
attention module ``k_scale`` and ``v_scale`` (``[1]``, or ``[num_key_value_heads, 1, 1]`` per
head). Names and shapes are what compressed-tensors registers (``lifecycle/initialize.py``,
release 0.20) and vLLM 0.33 loads (``compressed_tensors.py`` ``CompressedTensorsKVCacheMethod``,
``CompressedTensorsW4A4Fp4``, ``CompressedTensorsW8A8Fp8``/``Int8``). :func:`run` calibrates
and returns the values as :class:`Calibrated` (module -> {part: tensor}), which the executor
writes with the unit whose outputs name them (:attr:`ctconvert.pipeline.executor.ExecOptions.calibrated`).
The ``FP8`` preset's per-tensor ``weight_scale`` is not calibration's: the executor's absmax pass
computes it (:mod:`ctconvert.pipeline.scales`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint.config_types import kv_head_count
from ..checkpoint.naming import is_generative
from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import TORCH_TO_ST
from ..errors import BadInputError, UnsupportedError, UsageError, plural
from ..options import DEFAULT_CALIBRATION_BATCH_TOKENS
from ..plan.planner import Plan
from .observe import KV_CACHE_ARGS, MinMax, input_qparams, kv_qparams

__all__ = [
    "KV_CACHE_CHOICES",
    "Calibrated",
    "CalibrationCost",
    "add_outputs",
    "calibrated_modules",
    "attention_note",
    "estimate",
    "kv_cache_config",
    "needs_calibration",
    "run",
]

KV_CACHE_CHOICES = ("none", *KV_CACHE_ARGS)


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


def _model_dtype(ckpt: Checkpoint) -> torch.dtype:
    return next((t.torch_dtype for n, t in ckpt.tensors.items() if n.endswith("embed_tokens.weight")), torch.bfloat16)


def _calibrated_units(plan: Plan):
    return [u for u in plan.units if u.kind == "quantize" and u.scheme.needs_calibration]


def needs_calibration(plan: Plan, kv_cache: str = "none") -> bool:
    """Whether this run needs calibration data (a static/local activation scheme, or a KV cache scheme)."""
    return kv_cache != "none" or bool(_calibrated_units(plan))


def calibrated_modules(plan: Plan, kv_cache: str = "none") -> set[str]:
    """The modules :func:`run` gives tensors to: every module of a calibrated unit, and with ``kv_cache`` every
    attention module whose ``k_proj`` is quantized."""
    mods = {m for u in _calibrated_units(plan) for m in u.modules}
    return mods | set(_attention_modules(plan)) if kv_cache != "none" else mods


def _attention_modules(plan: Plan) -> dict[str, int]:
    """Attention module (``...self_attn``) -> index of the unit that holds its ``k_proj``."""
    out = {}
    for i, u in enumerate(plan.units):
        if u.kind != "quantize":
            continue
        for m in u.modules:
            if m.endswith(".k_proj"):
                out[m[: -len(".k_proj")]] = i
    return out


def add_outputs(plan: Plan, ckpt: Checkpoint, kv_cache: str = "none") -> None:
    """Add the calibrated tensors' ``(name, dtype, shape)`` to the units' outputs (headers only).

    Raises :class:`UsageError` for an unknown ``kv_cache`` or one without quantized attention projections."""
    if kv_cache not in KV_CACHE_CHOICES:
        raise UsageError(f"unknown --kv-cache {kv_cache!r}; choose one of: {', '.join(KV_CACHE_CHOICES)}")
    dt = TORCH_TO_ST[_model_dtype(ckpt)]
    for u in _calibrated_units(plan):
        parts = [("input_global_scale", "F32")] if u.scheme.input_args["strategy"] == "tensor_group" else [("input_scale", dt)]
        if not u.scheme.input_args["symmetric"]:
            parts.append(("input_zero_point", "I8"))
        for m in u.modules:
            u.outputs += [(f"{m}.{p}", d, (1,)) for p, d in parts]
    if kv_cache == "none":
        return
    attn = _attention_modules(plan)
    if not attn:
        raise UsageError(
            "--kv-cache calibrates the k/v projections (k_proj, v_proj) of decoder self-attention, and this plan quantizes none "
            "(an encoder has no KV cache; MLA attention has no k_proj/v_proj)"
        )
    heads = kv_head_count(ckpt.config)  # null/absent: the class's default (a Qwen2's 32), as vLLM builds the attention
    shape = (1,) if kv_cache == "fp8" else (int(heads), 1, 1)
    for a, i in attn.items():
        plan.units[i].outputs += [(f"{a}.k_scale", dt, shape), (f"{a}.v_scale", dt, shape)]


def attention_note(ckpt: Checkpoint) -> str | None:
    """For a dry run: a note when calibration will run the architecture's eager attention (no SDPA in transformers)."""
    from .meta import eager_only

    arch = eager_only(ckpt)
    if arch is None:
        return None
    return f'calibration will run {arch}\'s eager attention (attn_implementation="eager"): transformers has no SDPA attention for it'


def kv_cache_config(kv_cache: str) -> dict | None:
    """The ``kv_cache_scheme`` entry of ``quantization_config`` (QuantizationArgs as compressed-tensors dumps it)."""
    return None if kv_cache == "none" else dict(KV_CACHE_ARGS[kv_cache])


@dataclass
class CalibrationCost:
    """What ``--dry-run`` says calibration will cost."""

    schemes: list[str]
    layers: int
    samples: int
    seq_len: int
    tokens: int
    peak_bytes: int
    kv_cache: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def describe(self) -> str:
        what = ", ".join(self.schemes) + (f" + KV cache {self.kv_cache}" if self.kv_cache != "none" else "")
        return (
            f"calibration ({what}): {plural(self.layers, 'decoder layer')}, one at a time, {self.samples} x {self.seq_len} = {plural(self.tokens, 'token')}; "
            f"estimated peak memory {self.peak_bytes / 2**30:.2f} GiB (one layer + the batch's activations)"
        )


def estimate(plan: Plan, ckpt: Checkpoint, samples: int, seq_len: int, kv_cache: str, batch_tokens: int) -> CalibrationCost:
    """Layers, tokens and an estimate of the peak memory: embedding + largest decoder layer (as stored) +
    the hidden states of every sample (twice: a layer's input and output) + one micro-batch's activations."""
    cfg = _text_config(ckpt.config)
    n_layers = int(cfg.get("num_hidden_layers") or 0)
    h = int(cfg.get("hidden_size") or 0)
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * h)
    item = _model_dtype(ckpt).itemsize
    per_layer: dict[str, int] = {}
    emb = 0
    for name, t in ckpt.tensors.items():
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            key = ".".join(parts[: parts.index("layers") + 2])
            per_layer[key] = per_layer.get(key, 0) + t.nbytes
        elif name.endswith("embed_tokens.weight"):
            emb = t.nbytes
    tokens = samples * seq_len
    batch = min(tokens, max(seq_len, batch_tokens // seq_len * seq_len))
    act = batch * (3 * inter + 6 * h) * 4
    peak = emb + max(per_layer.values(), default=0) + 2 * tokens * h * item + act
    schemes = sorted({u.scheme.name for u in _calibrated_units(plan)})
    return CalibrationCost(schemes, n_layers, samples, seq_len, tokens, peak, kv_cache)


def _fallback(name: str, stats: dict[str, MinMax]) -> MinMax | None:
    """An expert no calibration token was routed to: the union of its layer's other experts' inputs of the same kind."""
    head, sep, tail = name.partition(".experts.")
    if not sep:
        return None
    kind = tail.partition(".")[2]
    found = MinMax()
    for k, v in stats.items():
        h2, s2, t2 = k.partition(".experts.")
        if s2 and h2 == head and t2.partition(".")[2] == kind:
            found = found.merged(v)
    return found if found.min is not None else None


def _check_finite(ckpt: Checkpoint, module: str, what: str, s: MinMax, dtype: torch.dtype | None = None) -> None:
    """Raises :class:`BadInputError` (exit 3) when ``module``'s observed ``what`` reached NaN/inf on the calibration
    data: no static scale can be computed from it, and none is made up. The causes named, the likelier first: in a
    float16 model (``dtype``, what the calibration computes in), float16's range overflowed upstream of it (finite
    weights, activations beyond 65504: inf, and in attention NaN), then a non-finite tensor upstream; in another dtype
    that tensor alone (a weight kept with ``--allow-non-finite``: without it the run refuses such a tensor by name)."""
    if s.min is not None and not (bool(torch.isfinite(s.min).all()) and bool(torch.isfinite(s.max).all())):
        upstream = "a non-finite tensor upstream of it in the checkpoint (kept with --allow-non-finite; without it the run refuses such a tensor by name)"
        cause, fix = upstream, "use"
        if dtype == torch.float16:
            overflow = (
                "float16 overflowed upstream of it (the model computes in its checkpoint's float16: a |value| beyond 65504 becomes inf, then NaN in attention)"
            )
            cause, fix = f"{overflow}, or {upstream}", "calibrate a bfloat16 copy of the checkpoint, or use"
        raise BadInputError(
            f"calibration: the {what} of {module} are not finite (NaN/inf) on the calibration data, so its static scales "
            f"cannot be computed: {cause}; {fix} a scheme with dynamic activation scales (FP8_DYNAMIC, NVFP4A16, W4A16, ...)",
            file=ckpt.path,
        )


@dataclass
class Calibrated:
    """What :func:`run` gives the quantize stage: ``tensors``, module -> {part: tensor} (CPU tensors: a
    quantized Linear's ``input_scale``/``input_global_scale``/``input_zero_point`` ``[1]``, an attention
    module's ``k_scale``/``v_scale``), and ``notes`` for the result."""

    tensors: dict[str, dict[str, torch.Tensor]]
    notes: list[str]
    importance: dict = field(default_factory=dict)  # Linear module -> its Importance (the imatrix observers': run(importance=True))


def run(
    plan: Plan,
    ckpt: Checkpoint,
    tokens: torch.Tensor,
    device: torch.device,
    kv_cache: str = "none",
    batch_tokens: int = DEFAULT_CALIBRATION_BATCH_TOKENS,
    progress=None,
    importance: bool = False,
    feed=None,
    check=None,
) -> Calibrated:
    """Calibrate: the calibrated tensors of every unit of ``plan`` that needs them, and notes (with ``importance``
    also every Linear's E[x^2] statistic, for the imatrix observers).

    ``feed`` (a :class:`~ctconvert.calibration.feed.CalibratedFeed`): also put each module's tensors into it as soon as
    its decoder layer has run (the same values, computed from the same CPU copies of the statistics), and the rest at
    the end; ``check``: called after each layer (it raises to stop the calibration). The errors are raised at the end,
    in plan order, as without a feed (a unit that would fail is not put: a reader waiting for it gets the error).

    Raises what :func:`ctconvert.calibration.model.calibrate` raises, and :class:`UsageError` when a
    quantized Linear saw no calibration token and has no sibling expert to take its range from."""
    from .model import calibrate

    resolver = _Resolver(plan, ckpt, kv_cache)

    def layer_done(stats, hooked) -> None:
        if check is not None:
            check()
        if feed is not None:
            resolver.stream(stats, hooked, feed)

    stats = calibrate(
        ckpt,
        tokens,
        device,
        kv_cache=kv_cache != "none",
        batch_tokens=batch_tokens,
        progress=progress,
        importance=importance,
        layer_done=layer_done if feed is not None or check is not None else None,
    )
    tensors, notes = resolver.resolve(stats)
    if feed is not None:
        for module, parts in tensors.items():
            feed.put(module, parts)
    notes = [*stats.notes, *notes, f"calibrated on {stats.tokens} tokens"]
    return Calibrated(tensors, notes, stats.importance)


class _Resolver:
    """The calibrated tensors of the plan's calibrated units and attention modules from the calibration statistics
    (CPU copies, as :meth:`~ctconvert.calibration.observe.Stats.cpu` makes them): :meth:`resolve` all of them, in plan
    order, raising the first error; :meth:`stream` those whose modules have all been observed, as layers finish."""

    def __init__(self, plan: Plan, ckpt: Checkpoint, kv_cache: str):
        self.ckpt, self.kv_cache, self.dtype = ckpt, kv_cache, _model_dtype(ckpt)
        self.units = _calibrated_units(plan)
        self.attention = list(_attention_modules(plan)) if kv_cache != "none" else []
        self._unit_of = {m: i for i, u in enumerate(self.units) for m in u.modules}  # calibrated module -> its unit
        self._seen: set[str] = set()  # modules observed by the layers streamed so far
        self._cpu: dict[str, MinMax] = {}  # their final statistics' CPU copies (inputs)
        self._broken = False  # a streamed unit failed: the rest waits for resolve (which raises in plan order)

    def _unit(self, u, inputs: dict[str, MinMax]) -> tuple[dict[str, torch.Tensor], list[str]]:
        observed, notes = [], []
        for m in u.modules:
            s = inputs.get(m)
            if s is None:
                s = _fallback(m, inputs)
                if s is None:
                    raise UsageError(f"calibration: no calibration token reached {m}; it cannot get a static activation scale")
                notes.append(f"{m}: no calibration token was routed to this expert; its input range is that of its layer's other experts")
            _check_finite(self.ckpt, m, "inputs", s, self.dtype)
            observed.append(s)
        return input_qparams(u.scheme.input_args, observed, self.dtype), notes  # a fused set's members see one input: one range

    def _attention(self, a: str, keys: dict[str, MinMax], values: dict[str, MinMax]) -> dict[str, torch.Tensor]:
        k, v = keys.get(a), values.get(a)
        if k is None or v is None:
            raise UsageError(f"calibration: the attention module {a} was not observed (architecture without a k_proj/v_proj attention module)")
        _check_finite(self.ckpt, a, "keys", k, self.dtype)
        _check_finite(self.ckpt, a, "values", v, self.dtype)
        return kv_qparams(self.kv_cache, k, v, self.dtype)

    def resolve(self, stats) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
        """Every calibrated module's tensors and the notes, from the whole pass' :class:`Stats` (on any device)."""
        cpu = stats.cpu()
        calibrated = {m for u in self.units for m in u.modules}
        for m, s in cpu.inputs.items():  # in the order the forward reached them: the first a non-finite value reached is named
            if m in calibrated:
                _check_finite(self.ckpt, m, "inputs", s, self.dtype)
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        notes: list[str] = []
        for u in self.units:
            q, n = self._unit(u, cpu.inputs)
            notes += n
            for m in u.modules:
                tensors.setdefault(m, {}).update(q)
        for a in self.attention:
            tensors.setdefault(a, {}).update(self._attention(a, cpu.keys, cpu.values))
        return tensors, notes

    def stream(self, stats, hooked: set[str], feed) -> None:
        """Put into ``feed`` each unit (and attention module) whose modules have all been observed, once the layer that
        observed its last one has run (``hooked``: the modules observed so far, whose statistics are final). A module
        that is both a unit's and an attention module (none today) is put whole at the end."""
        if self._broken:
            return
        new = hooked - self._seen
        self._seen |= new
        self._cpu.update({k: stats.inputs[k].cpu() for k in new if k in stats.inputs and stats.inputs[k].min is not None})  # siblings too (fallback)
        ready = sorted({self._unit_of[m] for m in new if m in self._unit_of})
        try:
            for i in ready:
                u = self.units[i]
                if not all(m in self._seen for m in u.modules):
                    continue
                q, _ = self._unit(u, self._cpu)
                for m in u.modules:
                    feed.put(m, dict(q))
            final = lambda d, name: {name: d[name].cpu()} if name in d and d[name].min is not None else {}  # as Stats.cpu keeps it
            for a in self.attention:
                if a in new and a not in self._unit_of:
                    feed.put(a, self._attention(a, final(stats.keys, a), final(stats.values, a)))
        except (UsageError, BadInputError):
            self._broken = True


def check_model(ckpt: Checkpoint) -> None:
    """Refuse, before any work (also in a dry run), a checkpoint calibration cannot run: it runs decoder
    language models (``*ForCausalLM``, ``*ForConditionalGeneration``, ``*LMHeadModel``) layer by layer.
    It then builds the meta-device model as the real run does (:func:`.model.check_buildable`; ``ckpt`` with the
    plan's per-expert views): what transformers cannot build, or whose experts calibration cannot run (Llama-4),
    is refused here, with the real run's message (:func:`build_model`). Raises :class:`UnsupportedError` (exit 4)."""
    check_generative(ckpt)
    build_model(ckpt)


def check_generative(ckpt: Checkpoint) -> None:
    """The part of :func:`check_model` that needs no transformers: refuse what is not a decoder language model (from
    ``config.json``'s ``architectures``). Raises :class:`UnsupportedError` (exit 4)."""
    if not is_generative(ckpt.config):
        arch = ", ".join(ckpt.config.get("architectures") or []) or "this architecture"
        raise UnsupportedError(
            f"calibration runs decoder language models layer by layer; {arch} is not one: use a data-free scheme "
            "(FP8_DYNAMIC, W8A8, W4A16, NVFP4A16, MXFP4 ...)",
            file=ckpt.path / "config.json",
        )


def build_model(ckpt: Checkpoint) -> None:
    """Build the meta-device model calibration will run (:func:`.model.check_buildable`: transformers imported, the
    model kept for :func:`run` of the same ``ckpt``). Raises :class:`UnsupportedError` (exit 4)."""
    from .model import check_buildable  # transformers is imported only where calibration runs

    check_buildable(ckpt)
