"""Run a checkpoint's own transformers architecture one decoder layer at a time, observing activations.

1. The model is built from its ``config.json`` on the ``meta`` device (no memory), and the
   checkpoint's tensor names are mapped onto its parameters with transformers' own key
   renamings (``conversion_mapping.get_model_conversion_mapping``: ``block_sparse_moe`` ->
   ``mlp`` and the like). Fused MoE experts (3-D ``gate_up_proj``/``down_proj``, built from
   per-expert checkpoint tensors) are replaced by per-expert ``nn.Linear`` modules named as in
   the checkpoint, whose forward is the experts' loop (tokens routed to each expert only).
2. The embedding (and the other small modules outside the decoder layers) are loaded, and the
   model's own forward runs with every decoder layer replaced by a stand-in that records its
   arguments (the hidden states, the position embeddings and masks the model computes) and
   passes the hidden states on; the last one stops the forward.
3. For each layer: only its weights are read from the safetensors files, the recorded batches
   run through it (forward-pre hooks on every ``nn.Linear`` record the input min/max; an
   attention function registered with transformers' ``AttentionInterface`` records the key and
   value states as the KV cache would store them, after RoPE), its output is the next layer's
   input, and the layer goes back to ``meta``.

Peak memory: one decoder layer plus the hidden states of the calibration batch (and one
micro-batch's intermediate activations). :func:`calibrate_whole_model` runs the same modules,
hooks and micro-batches through the fully loaded model (the reference the tests compare with).
"""

from __future__ import annotations

import contextlib
import gc
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import read_tensor
from ..errors import BadInputError, CTConvertError, UnsupportedError
from .observe import MinMax, Stats

__all__ = ["CalibrationModel", "calibrate", "calibrate_whole_model", "eager_only"]

_ATTN_NAME = "ctconvert_observe"  # the SDPA observer, with transformers' SDPA masks (None where is_causal does)
_EAGER_ATTN_NAME = "ctconvert_observe_eager"  # the eager observer, with transformers' eager (additive) masks
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class _Stop(Exception):
    pass


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - installed with the test extras
        raise UnsupportedError("calibration runs the model's own architecture and needs transformers: pip install transformers") from e
    return transformers


class UnfusedExperts(nn.Module):
    """Per-expert ``nn.Linear`` modules standing in for transformers' fused ``*Experts``, named as the checkpoint
    (or the plan's per-expert parts of fused 3-D experts) names them (``experts.3.gate_proj`` or ``experts.3.w1``).
    The forward is the fused module's loop (transformers 5.24 ``Qwen3MoeExperts.forward``, ``GptOssExperts.forward``):
    each expert sees the tokens routed to it, its output is weighted and summed.

    Two layouts (transformers 5.24): ``gate_up_proj`` ``[E, 2I, H]`` (``x @ W.T``, gate then up, ``act_fn(gate) * up``:
    Qwen3-MoE, Mixtral ...), and gpt-oss's ``[E, H, 2I]`` (``x @ W``, gate and up interleaved, with biases, the
    clamped SwiGLU of ``GptOssExperts._apply_gate``, which this module calls on the re-interleaved halves)."""

    def __init__(self, fused: nn.Module, names: tuple[str, str, str]):
        super().__init__()
        self.gpt_oss = _is_gpt_oss_experts(fused)
        if self.gpt_oss:
            e, h, two_i = fused.gate_up_proj.shape
            self.apply_gate = fused._apply_gate
        else:
            e, two_i, h = fused.gate_up_proj.shape
            self.act_fn = fused.act_fn
        self.names = names
        self.num_experts = e
        dtype = fused.gate_up_proj.dtype
        bias = self.gpt_oss
        for j in range(e):
            m = nn.Module()
            setattr(m, names[0], nn.Linear(h, two_i // 2, bias=bias, device="meta", dtype=dtype))
            setattr(m, names[1], nn.Linear(h, two_i // 2, bias=bias, device="meta", dtype=dtype))
            setattr(m, names[2], nn.Linear(two_i // 2, h, bias=bias, device="meta", dtype=dtype))
            self.add_module(str(j), m)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.gpt_oss:
            return self.apply_gate(torch.stack((gate, up), dim=-1).flatten(-2))  # [..., 2I]: gate at ::2, up at 1::2
        return self.act_fn(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        g, u, d = self.names
        for idx in hit:
            e = int(idx[0])
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            mod = self._modules[str(e)]
            x = hidden_states[tok]
            y = getattr(mod, d)(self._act(getattr(mod, g)(x), getattr(mod, u)(x)))
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def _is_gpt_oss_experts(m: nn.Module) -> bool:
    return hasattr(m, "_apply_gate") and isinstance(getattr(m, "gate_up_proj_bias", None), nn.Parameter)


def _is_fused_experts(m: nn.Module) -> bool:
    p = getattr(m, "gate_up_proj", None)
    fused = isinstance(p, nn.Parameter) and p.dim() == 3 and isinstance(getattr(m, "down_proj", None), nn.Parameter)
    return fused and (hasattr(m, "act_fn") or _is_gpt_oss_experts(m))


@dataclass
class _Recorded:
    """One micro-batch's arguments to a decoder layer (the hidden states are kept apart)."""

    args: tuple
    kwargs: dict


class CalibrationModel:
    """The meta-device model of a checkpoint, with the checkpoint-name map and the observers' hooks."""

    def __init__(self, ckpt: Checkpoint, device: torch.device):
        tf = _transformers()
        self.ckpt, self.device = ckpt, device
        self.dtype = _dtype(ckpt)
        archs = ckpt.config.get("architectures") or [ckpt.config.get("model_type", "?")]
        self.notes: list[str] = []
        model, self.attention = self._build(tf, archs[0])
        self.model = model.eval()
        self.layers_name, self.layers = self._find_layers(model, archs[0])
        for name, m in list(model.named_modules()):
            if _is_fused_experts(m):
                self._unfuse(name, m)
        self._register_attention(tf)
        self.names = self._checkpoint_names(tf)  # model parameter name -> checkpoint tensor name
        self.stats = Stats()
        self.kv = False

    # -- structure ------------------------------------------------------------------------------
    def _build(self, tf, arch: str) -> tuple[nn.Module, str]:
        """The meta-device model with SDPA attention, or with the architecture's eager attention where transformers
        has no SDPA for it (gpt-oss: its attention sinks); ``(model, "sdpa" | "eager")``."""
        model, impl = build_meta(tf, self.ckpt, self.dtype, arch)
        if impl == "eager":
            self.notes.append(
                f"calibration: transformers {tf.__version__} has no SDPA attention for {arch}; calibrated with its eager attention "
                '(attn_implementation="eager": the architecture\'s own attention code, slower)'
            )
        return model, impl

    def _find_layers(self, model: nn.Module, arch: str) -> tuple[str, nn.ModuleList]:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        n = getattr(cfg, "num_hidden_layers", None)
        for name, m in model.named_modules():
            if isinstance(m, nn.ModuleList) and len(m) == n and n and name.split(".")[-1] in ("layers", "h", "blocks", "layer"):
                return name, m
        raise UnsupportedError(f"cannot find the decoder layers of {arch} for calibration", file=self.ckpt.path / "config.json")

    def _unfuse(self, name: str, m: nn.Module) -> None:
        parent_name, _, attr = name.rpartition(".")
        if f"{name}.gate_up_proj" in self.ckpt.tensors and not any(n.startswith(f"{name}.0.") for n in self.ckpt.tensors):
            return  # experts kept dense (not split, e.g. gpt-oss by default): they run fused, from their stored tensors
        names = None
        for cand in _EXPERT_NAMES:
            if any(re.search(rf"\.experts\.0\.{cand[0]}\.weight$", n) for n in self.ckpt.tensors):
                names = cand
        if names is None:
            raise UnsupportedError(f"{name}: fused experts, but the checkpoint has no per-expert gate/up/down weights", file=self.ckpt.path)
        setattr(self.model.get_submodule(parent_name), attr, UnfusedExperts(m, names))

    def _register_attention(self, tf) -> None:
        """Route every attention call through an observer of the key/value states that then calls the attention
        function the model was built with: transformers' SDPA, or the architecture's own ``eager_attention_forward``
        (from its modeling module), which gets the eager mask transformers builds for it."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        name, inner = _ATTN_NAME, ALL_ATTENTION_FUNCTIONS["sdpa"]
        if self.attention == "eager":
            name, inner = _EAGER_ATTN_NAME, self._eager_function()
        # the masks transformers builds for the implementation the observer calls: without one registered, a custom
        # name gets no mask at all (SDPA then runs is_causal and ignores sliding windows; eager would not be causal)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[self.attention])
        owner = self

        def observe(module, query, key, value, attention_mask, **kw):
            if owner.kv:
                name = owner.module_names.get(id(module))
                if name is not None:
                    owner.stats.keys.setdefault(name, MinMax()).update(key, keep_dim=1)
                    owner.stats.values.setdefault(name, MinMax()).update(value, keep_dim=1)
            return inner(module, query, key, value, attention_mask, **kw)

        ALL_ATTENTION_FUNCTIONS.register(name, observe)
        for cfg in [self.model.config, *[getattr(self.model.config, k) for k in ("text_config",) if hasattr(self.model.config, k)]]:
            cfg._attn_implementation_internal = name
        for m in self.model.modules():
            c = getattr(m, "config", None)
            if c is not None and hasattr(c, "_attn_implementation_internal"):
                c._attn_implementation_internal = name

    def _eager_function(self):
        """The ``eager_attention_forward`` of the modeling module that defines the model's attention class."""
        import sys

        for m in self.model.modules():
            if hasattr(m, "k_proj") and hasattr(m, "v_proj"):
                fn = getattr(sys.modules[type(m).__module__], "eager_attention_forward", None)
                if fn is not None:
                    return fn
        what = type(self.model).__name__
        raise UnsupportedError(f"calibration: {what} has neither SDPA attention nor an eager_attention_forward to observe", file=self.ckpt.path / "config.json")

    def _checkpoint_names(self, tf) -> dict[str, str]:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        renamings = [t for t in get_model_conversion_mapping(self.model) if isinstance(t, WeightRenaming)]
        meta = dict(self.model.state_dict(keep_vars=True))
        prefix = getattr(self.model, "base_model_prefix", None)
        out = {}
        for src in self.ckpt.tensors:
            dst, _ = rename_source_key(src, renamings, [], prefix, meta)
            out.setdefault(dst, src)
        return out

    # -- loading --------------------------------------------------------------------------------
    def _materialize(self, module: nn.Module, prefix: str) -> None:
        """Load ``module``'s parameters (named ``prefix`` + local name) from the checkpoint onto the device."""
        buffers = {n: b for n, b in module.named_buffers() if b.device.type != "meta"}
        module.to_empty(device=self.device)
        with torch.no_grad():
            for local, p in module.named_parameters():
                full = prefix + local
                src = self.names.get(full)
                if src is None:
                    raise BadInputError(f"calibration: the checkpoint has no tensor for parameter {full!r} of the model", file=self.ckpt.path)
                t = read_tensor(self.ckpt.tensors[src])
                if tuple(t.shape) != tuple(p.shape):
                    where = str(self.ckpt.tensors[src].file)
                    raise BadInputError(f"calibration: shape {list(t.shape)} does not fit parameter {full} {list(p.shape)}", tensor=src, file=where)
                p.copy_(t)
            for n, b in buffers.items():
                owner, _, attr = n.rpartition(".")
                (module.get_submodule(owner) if owner else module)._buffers[attr] = b.to(self.device)
        self._rebuild_buffers(module)

    def _rebuild_buffers(self, root: nn.Module) -> None:
        """Non-persistent buffers (rotary ``inv_freq``) are not in the checkpoint: rebuild their module from its config."""
        for name, m in list(root.named_modules()):
            if not getattr(m, "_non_persistent_buffers_set", None) or any(True for _ in m.parameters(recurse=False)):
                continue
            cfg = getattr(m, "config", None)
            if cfg is None:
                raise UnsupportedError(f"calibration cannot rebuild the buffers of {type(m).__name__}", file=self.ckpt.path)
            with torch.device(self.device):
                fresh = type(m)(cfg)
            if name:
                owner, _, attr = name.rpartition(".")
                setattr(root.get_submodule(owner) if owner else root, attr, fresh.to(self.device))

    def _outside_layers(self) -> list[tuple[str, nn.Module]]:
        """Modules that hold parameters or buffers and are not inside the decoder layers or the output head."""
        head = self.model.get_output_embeddings()
        out = []
        for name, m in self.model.named_modules():
            if name == self.layers_name or name.startswith(self.layers_name + ".") or m is head:
                continue
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
                out.append((name, m))
        return out

    def load_outside(self) -> None:
        for name, m in self._outside_layers():
            self._materialize_shallow(name, m)

    def _materialize_shallow(self, name: str, m: nn.Module) -> None:
        prefix = name + "." if name else ""
        if any(True for _ in m.buffers(recurse=False)) and not any(True for _ in m.parameters(recurse=False)) and m._non_persistent_buffers_set:
            owner, _, attr = name.rpartition(".")
            try:
                with torch.device(self.device):
                    fresh = type(m)(m.config)
            except (AttributeError, TypeError) as e:
                raise UnsupportedError(f"calibration cannot rebuild {type(m).__name__} ({e})", file=self.ckpt.path / "config.json") from None
            setattr(self.model.get_submodule(owner) if owner else self.model, attr, fresh)
            return
        for local, _ in list(m.named_parameters(recurse=False)):
            full = prefix + local
            src = self.names.get(full)
            if src is None:
                raise BadInputError(f"calibration: the checkpoint has no tensor for parameter {full!r} of the model", file=self.ckpt.path)
            m._parameters[local] = nn.Parameter(read_tensor(self.ckpt.tensors[src]).to(self.device), requires_grad=False)

    # -- observing --------------------------------------------------------------------------------
    def _hooks(self, root: nn.Module, prefix: str):
        handles = []
        self.module_names = {}
        for local, m in root.named_modules():
            full = prefix + local if local else prefix.rstrip(".")
            if isinstance(m, nn.Linear):
                ck = self.names.get(full + ".weight", full + ".weight")[: -len(".weight")]

                def pre(mod, args, ck=ck):
                    self.stats.inputs.setdefault(ck, MinMax()).update(args[0])

                handles.append(m.register_forward_pre_hook(pre))
            elif hasattr(m, "k_proj") and hasattr(m, "v_proj"):
                kw = self.names.get(full + ".k_proj.weight", full + ".k_proj.weight")
                self.module_names[id(m)] = kw[: -len(".k_proj.weight")]
        return handles

    def capture(self, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[_Recorded]]]:
        """Run the model's own forward up to the first layer; returns the layer-0 hidden states and, per layer,
        each micro-batch's arguments."""
        recs: list[list[_Recorded]] = [[] for _ in self.layers]
        hidden: list[torch.Tensor] = []
        originals = list(self.layers)
        last = len(self.layers) - 1

        class Catcher(nn.Module):
            def __init__(self, i):
                super().__init__()
                self.i = i

            def forward(self, hidden_states, *args, **kwargs):
                if self.i == 0:
                    hidden.append(hidden_states)
                recs[self.i].append(_Recorded(args, kwargs))
                if self.i == last:
                    raise _Stop
                return hidden_states

        for i in range(len(self.layers)):
            self.layers[i] = Catcher(i)
        try:
            with torch.no_grad():
                for ids in batches:
                    with contextlib.suppress(_Stop):
                        self.model(input_ids=ids.to(self.device), use_cache=False)
        finally:
            for i, m in enumerate(originals):
                self.layers[i] = m
        return hidden, recs

    def run_layer(self, i: int, hidden: list[torch.Tensor], recs: list[_Recorded]) -> list[torch.Tensor]:
        layer = self.layers[i]
        prefix = f"{self.layers_name}.{i}."
        self._materialize(layer, prefix)
        handles = self._hooks(layer, prefix)
        try:
            with torch.no_grad():
                out = []
                for h, r in zip(hidden, recs):
                    y = layer(h, *r.args, **r.kwargs)
                    out.append(y[0] if isinstance(y, tuple) else y)
        finally:
            for hd in handles:
                hd.remove()
            layer.to("meta")
        return out


def build_meta(tf, ckpt: Checkpoint, dtype: torch.dtype, arch: str) -> tuple[nn.Module, str]:
    """The checkpoint's causal language model on the meta device (no memory, no weights), built by
    ``transformers.AutoModelForCausalLM.from_config`` with SDPA attention, else with eager attention;
    ``(model, "sdpa" | "eager")``. Raises :class:`UnsupportedError` (exit 4) when neither builds: calibration
    builds only what AutoModelForCausalLM builds, which excludes vision-language models (Qwen2.5-VL, ...) today."""
    first = None
    for impl in ("sdpa", "eager"):
        try:
            config = tf.AutoConfig.from_pretrained(str(ckpt.path))
            with torch.device("meta"):
                return tf.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl), impl
        except Exception as e:  # noqa: BLE001 - any failure to build it is one clear line
            first = first or e
    vlm = "vision_config" in ckpt.config
    why = "calibrating vision-language models is not supported yet" if vlm else "calibration supports only the architectures AutoModelForCausalLM builds"
    raise UnsupportedError(
        f"ctconvert cannot calibrate {arch}: its calibration builds the causal language model with transformers' AutoModelForCausalLM, "
        f"which cannot build architecture {arch} ({type(first).__name__}: {str(first).splitlines()[0][:200]}); {why}: "
        "use a data-free scheme (NVFP4A16, W4A16, FP8_DYNAMIC, ...), which needs no calibration",
        file=ckpt.path / "config.json",
    )


def check_buildable(ckpt: Checkpoint) -> None:
    """What :class:`CalibrationModel` does first, without its work: build the meta-device model (seconds, no
    weights read), so that a dry run refuses what the real run would refuse, with the same error (exit 4)."""
    tf = _transformers()
    archs = ckpt.config.get("architectures") or [ckpt.config.get("model_type", "?")]
    build_meta(tf, ckpt, _dtype(ckpt), archs[0])


def _dtype(ckpt: Checkpoint) -> torch.dtype:
    """The model's dtype for calibration: its embedding's, else its first floating-point tensor's."""
    emb_dtype = next((t.torch_dtype for n, t in ckpt.tensors.items() if n.endswith("embed_tokens.weight")), None)
    return emb_dtype or next(t.torch_dtype for t in ckpt.tensors.values() if t.torch_dtype.is_floating_point)


def eager_only(ckpt: Checkpoint) -> str | None:
    """The architecture name when transformers has no SDPA attention for it (its class's ``_supports_sdpa`` is
    False, which makes ``from_config(attn_implementation="sdpa")`` raise), so calibration will run its eager
    attention; None when it has SDPA or when this cannot be told without building the model (the dry run's note)."""
    try:
        tf = _transformers()
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(tf.AutoConfig.from_pretrained(str(ckpt.path)))]
    except Exception:  # noqa: BLE001 - not knowable from the config alone: the real run says what it did
        return None
    return None if getattr(cls, "_supports_sdpa", True) else cls.__name__


def _micro_batches(tokens: torch.Tensor, batch_tokens: int) -> list[torch.Tensor]:
    per = max(1, batch_tokens // max(1, tokens.shape[1]))
    return [tokens[i : i + per] for i in range(0, tokens.shape[0], per)]


def calibrate(ckpt: Checkpoint, tokens: torch.Tensor, device: torch.device, *, kv_cache: bool = False, batch_tokens: int = 4096, progress=None) -> Stats:
    """Observe ``tokens`` (int64 ``[N, L]``) through the checkpoint's architecture, one decoder layer at a time.

    Returns the :class:`Stats` (on the CPU, in the model's dtype): per quantizable Linear the min/max of its
    input over all tokens; with ``kv_cache`` per attention module the per-KV-head min/max of the key and value
    states. ``progress``: called with ``(layer, layers)`` after each layer. Raises :class:`UnsupportedError`
    (transformers cannot build the architecture) or :class:`BadInputError` (a parameter has no checkpoint tensor).
    """
    cm = CalibrationModel(ckpt, device)
    cm.kv = kv_cache
    cm.load_outside()
    with _forward_errors(ckpt, "the embedding"):
        hidden, recs = cm.capture(_micro_batches(tokens, batch_tokens))
    for i in range(len(cm.layers)):
        with _forward_errors(ckpt, f"decoder layer {i}"):
            hidden = cm.run_layer(i, hidden, recs[i])
        recs[i] = None
        gc.collect()
        if progress is not None:
            progress(i + 1, len(cm.layers))
    cm.stats.tokens = int(tokens.numel())
    out = cm.stats.cpu()
    out.notes = list(cm.notes)
    return out


@contextlib.contextmanager
def _forward_errors(ckpt: Checkpoint, where: str):
    """A failure of the model's own code (not ctconvert's errors, not out-of-memory) is one clear line."""
    try:
        yield
    except (CTConvertError, torch.cuda.OutOfMemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - transformers' forward of an architecture it built but cannot run this way
        arch = (ckpt.config.get("architectures") or ["?"])[0]
        raise UnsupportedError(f"calibration: {arch}'s forward failed in {where} ({type(e).__name__}: {str(e).splitlines()[0][:200]})", file=ckpt.path) from e


def calibrate_whole_model(ckpt: Checkpoint, tokens: torch.Tensor, device: torch.device, *, kv_cache: bool = False, batch_tokens: int = 4096) -> Stats:
    """The same observation with every layer loaded at once and the model's forward run whole (for tests)."""
    cm = CalibrationModel(ckpt, device)
    cm.kv = kv_cache
    cm.load_outside()
    for i, layer in enumerate(cm.layers):
        cm._materialize(layer, f"{cm.layers_name}.{i}.")
    handles = []
    for i, layer in enumerate(cm.layers):
        handles += cm._hooks(layer, f"{cm.layers_name}.{i}.")
    names = {}
    for i, layer in enumerate(cm.layers):
        for local, m in layer.named_modules():
            if hasattr(m, "k_proj") and hasattr(m, "v_proj"):
                full = f"{cm.layers_name}.{i}.{local}"
                names[id(m)] = cm.names.get(full + ".k_proj.weight", full + ".k_proj.weight")[: -len(".k_proj.weight")]
    cm.module_names = names
    base = cm.model.get_decoder() if hasattr(cm.model, "get_decoder") else cm.model.model
    with torch.no_grad():
        for ids in _micro_batches(tokens, batch_tokens):
            base(input_ids=ids.to(device), use_cache=False)
    for h in handles:
        h.remove()
    cm.stats.tokens = int(tokens.numel())
    return cm.stats.cpu()
