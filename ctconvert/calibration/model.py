"""Run a checkpoint's own transformers architecture one decoder layer at a time, observing activations.

1. The model is built from its ``config.json`` on the ``meta`` device (no memory): a causal LM, or a
   vision-language model's ``*ForConditionalGeneration`` (whose language model is calibrated on text); the
   checkpoint's tensor names are mapped onto its parameters with transformers' own key
   renamings (``conversion_mapping.get_model_conversion_mapping``: ``block_sparse_moe`` ->
   ``mlp`` and the like). Fused MoE experts (3-D ``gate_up_proj``/``down_proj``, built from
   per-expert checkpoint tensors) are replaced by per-expert ``nn.Linear`` modules named as in
   the checkpoint, whose forward computes what the fused module computes (:mod:`.experts`; :class:`UnfusedExperts`:
   the tokens routed to each expert; :class:`ScoredExperts`: Llama-4's, every token scaled by its score).
2. The text model's modules outside its decoder layers (embeddings, rotary embedding, ...) are loaded,
   and the text model's own forward runs with every decoder layer replaced by a stand-in that records its
   arguments (the hidden states, the position embeddings and masks the model computes) and
   passes the hidden states on; the last one stops the forward.
3. For each layer: only its tensors are read from the safetensors files, the recorded batches
   run through it (forward-pre hooks on every ``nn.Linear`` record the input min/max; an
   attention function registered with transformers' ``AttentionInterface`` records the key and
   value states as the KV cache would store them, after RoPE), its output is the next layer's
   input, and the layer goes back to ``meta``. A value a layer hands the next one beside its hidden states
   (:data:`CARRIED`: GLM-5's DSA top-k selection) is passed on as the model's forward passes it.

Every module is loaded as ``from_pretrained`` loads it (:meth:`CalibrationModel._materialize`): each parameter
and persistent buffer from its checkpoint tensor, each non-persistent buffer computed by the model's own
``_init_weights``, and anything else an error naming it; no value is the uninitialised memory ``to_empty``
allocates, so two runs write the same bytes.

Reading: :class:`~.prefetch.LayerPrefetcher` reads the next layer's tensors (in background threads, into
page-locked memory for a GPU) while this one runs; the copies to the GPU are asynchronous, so that the device never
waits on the host between layers. The layers' memory is freed by reference counting (no garbage collection pass).

Peak memory: one decoder layer (two while the next one is read) plus the hidden states of the calibration batch (and
one micro-batch's intermediate activations). :func:`calibrate_whole_model` runs the same modules,
hooks and micro-batches through the fully loaded model (the reference the tests compare with).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import TensorInfo, read_tensor
from ..errors import BadInputError, CTConvertError, UnsupportedError
from ..options import DEFAULT_CALIBRATION_BATCH_TOKENS
from .experts import EXPERT_NAMES, ScoredExperts, UnfusedExperts, is_fused_experts, is_llama4_experts
from .meta import build_meta, eager_only, model_dtype, pretrained_owners, transformers_module
from .observe import MinMax, Stats
from .prefetch import LayerPrefetcher, StagedGroup, default_threads

__all__ = ["CalibrationModel", "calibrate", "calibrate_whole_model", "eager_only"]

_ATTN_NAME = "ctconvert_observe"  # the SDPA observer, with transformers' SDPA masks (None where is_causal does)
_EAGER_ATTN_NAME = "ctconvert_observe_eager"  # the eager observer, with transformers' eager (additive) masks


class _Stop(Exception):
    pass


#: keyword arguments a decoder layer takes from the layer before it, which returns ``(hidden_states, value)``: GLM-5's
#: ``prev_topk_indices`` (transformers 5.25 ``models/glm_moe_dsa/modeling_glm_moe_dsa.py``: ``GlmMoeDsaModel.forward``
#: passes each layer's top-k token selection to the next, whose "shared" indexer reuses it). The stand-ins of
#: :meth:`CalibrationModel.capture` return the same shape, and :meth:`CalibrationModel.run_layer` hands each layer's
#: value to the next (calibration of a GLM-5 failed at the first layer: its forward unpacks two values).
CARRIED = ("prev_topk_indices",)


def _carried(layer: nn.Module) -> str | None:
    """The :data:`CARRIED` keyword ``layer``'s forward takes, or None."""
    params = inspect.signature(type(layer).forward).parameters
    return next((k for k in CARRIED if k in params), None)


@dataclass
class _Recorded:
    """One micro-batch's arguments to a decoder layer (the hidden states are kept apart)."""

    args: tuple
    kwargs: dict


class CalibrationModel:
    """The meta-device model of a checkpoint, with the checkpoint-name map and the observers' hooks."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, attention: tuple[str, ...] = ("sdpa", "eager")):
        tf = transformers_module()
        self.ckpt, self.device = ckpt, device
        self.dtype = model_dtype(ckpt)
        archs = ckpt.config.get("architectures") or [ckpt.config.get("model_type", "?")]
        self.notes: list[str] = []
        model, self.attention = self._build(tf, archs[0], attention)
        self.model = model.eval()
        self.layers_name, self.layers = self._find_layers(model, archs[0])
        self.carried = _carried(self.layers[0]) if len(self.layers) else None
        self._carry: list | None = None  # the last layer's carried value per micro-batch
        for name, m in list(model.named_modules()):
            if is_fused_experts(m):
                self._unfuse(name, m)
        self._register_attention(tf)
        self.names = self._checkpoint_names(tf)  # model parameter name -> checkpoint tensor name
        self._pretrained_owner = pretrained_owners(model)
        self.stats = Stats()
        self.hooked: set[str] = set()  # checkpoint names of the modules observed so far (their layers have run)
        self.kv = False
        self._prefetch: LayerPrefetcher | None = None

    # -- structure ------------------------------------------------------------------------------
    def _build(self, tf, arch: str, attention: tuple[str, ...]) -> tuple[nn.Module, str]:
        """The meta-device model with SDPA attention, or with the architecture's eager attention where transformers
        has no SDPA for it (gpt-oss: its attention sinks); ``(model, "sdpa" | "eager")``. ``attention``: the
        implementations to try, in order (``("eager",)``: llm-compressor's calibration, which forces eager attention)."""
        model, impl = build_meta(tf, self.ckpt, self.dtype, arch, attention)
        if impl == "eager" and attention[0] != "eager":
            self.notes.append(
                f"calibration: transformers {tf.__version__} has no SDPA attention for {arch}; calibrated with its eager attention "
                '(attn_implementation="eager": the architecture\'s own attention code, slower)'
            )
        return model, impl

    def _find_layers(self, model: nn.Module, arch: str) -> tuple[str, nn.ModuleList]:
        """The decoder layers of the language model (``model.get_decoder()``: for a vision-language model its text
        model, not a tower that may have as many layers): ``(name, ModuleList)``."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        n = getattr(cfg, "num_hidden_layers", None)
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            decoder = model
        where = next((name for name, m in model.named_modules() if m is decoder), "")
        for name, m in decoder.named_modules():
            if isinstance(m, nn.ModuleList) and len(m) == n and n and name.split(".")[-1] in ("layers", "h", "blocks", "layer"):
                return (f"{where}.{name}" if where else name), m
        raise UnsupportedError(f"cannot find the decoder layers of {arch} for calibration", file=self.ckpt.path / "config.json")

    @property
    def text_model(self) -> nn.Module:
        """The module that holds the decoder layers (``LlamaModel``, ``Qwen2_5_VLTextModel`` ...): calibration runs its
        forward on the tokens (a vision-language model's language model, on text, as llm-compressor calibrates it)."""
        return self.model.get_submodule(self.layers_name.rpartition(".")[0])

    def _unfuse(self, name: str, m: nn.Module) -> None:
        """Replace fused experts ``m`` by :class:`UnfusedExperts` (called with the routing), or by
        :class:`ScoredExperts` (Llama-4's, called with every token scaled by its router score); other fused experts
        are an :class:`UnsupportedError` (exit 4)."""
        import inspect

        parent_name, _, attr = name.rpartition(".")
        if f"{name}.gate_up_proj" in self.ckpt.tensors and not any(n.startswith(f"{name}.0.") for n in self.ckpt.tensors):
            return  # experts kept dense (not split, e.g. gpt-oss by default): they run fused, from their stored tensors
        routed = len(inspect.signature(type(m).forward).parameters) >= 4  # (self, hidden_states, top_k_index, top_k_weights)
        scored = not routed and is_llama4_experts(m)
        if not routed and not scored:
            raise UnsupportedError(
                f"calibration does not support {type(m).__name__} ({name}): its experts are called neither with the routed tokens "
                "(top_k_index, top_k_weights) nor as Llama-4's (every token, scaled by its router score); use a data-free scheme "
                "(NVFP4A16, W4A16, FP8_DYNAMIC, ...), which needs no calibration",
                file=self.ckpt.path / "config.json",
            )
        names = None
        for cand in EXPERT_NAMES:
            if any(re.search(rf"\.experts\.0\.{cand[0]}\.weight$", n) for n in self.ckpt.tensors):
                names = cand
        if names is None:
            raise UnsupportedError(f"{name}: fused experts, but the checkpoint has no per-expert gate/up/down weights", file=self.ckpt.path)
        setattr(self.model.get_submodule(parent_name), attr, (UnfusedExperts if routed else ScoredExperts)(m, names))

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
    def _materialize(self, module: nn.Module, prefix: str, recurse: bool = True, staged: StagedGroup | None = None) -> None:
        """Load ``module`` (named ``prefix`` + local names; ``recurse=False``: its own tensors only) onto the device,
        every tensor of it accounted for, as transformers' ``from_pretrained`` does it (5.24 ``modeling_utils``:
        ``_move_missing_keys_from_meta_to_device``, then ``_initialize_missing_keys``). ``staged``: the module's
        tensors as :class:`~.prefetch.LayerPrefetcher` read them (:meth:`staging_groups`; copied to the device
        asynchronously from page-locked memory; a tensor it lacks is read here; the caller releases it):

        - every parameter and every persistent buffer (DeepSeek-V3's router ``e_score_correction_bias``, Gemma-4's
          ``layer_scalar``) is read from its checkpoint tensor; one the checkpoint lacks is a :class:`BadInputError`
          naming it (never left as the uninitialised memory of ``to_empty``);
        - every non-persistent buffer (rotary ``inv_freq``, Gemma-4's ``embed_scale``) is computed from the config by
          the model's own ``_init_weights`` of the module that owns it (the loaded tensors are flagged
          ``_is_hf_initialized``, which transformers' init functions leave alone); one it does not write is an
          :class:`UnsupportedError` naming it.
        """
        module.to_empty(device=self.device, recurse=recurse)
        persistent, computed = self._tensors_of(module, recurse)
        loaded = []
        with torch.no_grad():
            for local, t in persistent:
                full = prefix + local
                src = self.names.get(full)
                if src is None:
                    kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
                    raise BadInputError(f"calibration: the checkpoint has no tensor for {kind} {full!r} of the model", file=self.ckpt.path)
                v = staged.get(src) if staged is not None else None
                v = read_tensor(self.ckpt.tensors[src]) if v is None else v
                if tuple(v.shape) != tuple(t.shape):
                    where = str(self.ckpt.tensors[src].file)
                    raise BadInputError(f"calibration: shape {list(v.shape)} does not fit {full} {list(t.shape)}", tensor=src, file=where)
                t.copy_(v, non_blocking=staged is not None and staged.pinned)
                t._is_hf_initialized = True
                loaded.append((full, t, t._version))
        if computed:
            self._compute_buffers(module, prefix, computed)
        for full, t, version in loaded:
            if t._version != version:  # pragma: no cover - transformers' init functions skip flagged tensors
                raise CTConvertError(f"internal: calibration: {full} was changed after it was loaded from the checkpoint")

    @staticmethod
    def _tensors_of(module: nn.Module, recurse: bool) -> tuple[list, list]:
        """``(persistent, computed)``: ``(local name, tensor)`` of every parameter and persistent buffer (the
        checkpoint's), and ``(local owner, owner module, buffer name)`` of every non-persistent buffer."""
        persistent, computed, seen = [], [], set()
        mods = module.named_modules() if recurse else [("", module)]
        for owner, m in mods:
            pre = owner + "." if owner else ""
            for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                if id(t) in seen:  # a tensor tied between two modules of the layer: loaded once, under its first name
                    continue
                seen.add(id(t))
                if n in m._non_persistent_buffers_set and not isinstance(t, nn.Parameter):
                    computed.append((owner, m, n))
                else:
                    persistent.append((pre + n, t))
        return persistent, computed

    def _compute_buffers(self, module: nn.Module, prefix: str, computed: list) -> None:
        """Fill the non-persistent buffers with what transformers' ``_init_weights`` computes for their module (the
        ``PreTrainedModel`` that holds the module dispatches, as ``initialize_weights``' ``smart_apply`` does)."""
        from transformers import initialization as init

        before = [(owner, m, n, m._buffers[n], m._buffers[n]._version) for owner, m, n in computed]
        with torch.no_grad(), init.guard_torch_init_functions():
            for m in {id(m): m for _, m, _ in computed}.values():
                self._init_owner(m)._init_weights(m)
        for owner, m, n, old, version in before:
            b = m._buffers[n]
            if b is old and b._version == version:
                full = prefix + (owner + "." if owner else "") + n
                raise UnsupportedError(
                    f"calibration: the buffer {full!r} ({type(m).__name__}) is not in the checkpoint, and transformers' "
                    f"{type(self._init_owner(m)).__name__}._init_weights does not compute it",
                    file=self.ckpt.path / "config.json",
                )

    def _init_owner(self, m: nn.Module):
        """The innermost ``PreTrainedModel`` holding ``m`` (whose ``_init_weights`` transformers calls for it)."""
        return self._pretrained_owner.get(id(m), self.model)

    def _outside_layers(self) -> list[tuple[str, nn.Module]]:
        """Modules of the text model that hold parameters or buffers and are not inside its decoder layers (the
        embeddings, the rotary embedding, Gemma-4's per-layer-input projection ...); the output head, a vision
        tower and a projector are not run (text only) and stay on ``meta``."""
        base = self.layers_name.rpartition(".")[0]
        out = []
        for name, m in self.model.named_modules():
            inside = not base or name == base or name.startswith(base + ".")
            if not inside or name == self.layers_name or name.startswith(self.layers_name + "."):
                continue
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
                out.append((name, m))
        return out

    def load_outside(self) -> None:
        staged = self._staged(0)
        for name, m in self._outside_layers():
            self._materialize(m, name + "." if name else "", recurse=False, staged=staged)
        _release(staged)

    def staging_groups(self) -> list[list[TensorInfo]]:
        """The checkpoint tensors :meth:`load_outside` and then each :meth:`run_layer` read, in that order (the
        groups of a :class:`~.prefetch.LayerPrefetcher`): every parameter and persistent buffer that has a
        checkpoint tensor, each tensor once; what has none is left to :meth:`_materialize`'s error."""
        parts = [[(m, (name + ".") if name else "", False) for name, m in self._outside_layers()]]
        parts += [[(layer, f"{self.layers_name}.{i}.", True)] for i, layer in enumerate(self.layers)]
        groups = []
        for part in parts:
            names: dict[str, None] = {}
            for module, prefix, recurse in part:
                for local, _ in self._tensors_of(module, recurse)[0]:
                    src = self.names.get(prefix + local)
                    if src is not None:
                        names.setdefault(src)
            groups.append([self.ckpt.tensors[n] for n in names])
        return groups

    @contextlib.contextmanager
    def prefetching(self):
        """While the context lasts, :meth:`load_outside` and then each :meth:`run_layer` (in order) take their tensors
        from a :class:`~.prefetch.LayerPrefetcher` of :meth:`staging_groups`, which reads the next group while
        this one runs (page-locked on a GPU; the embedding, read once, in pageable memory)."""
        pf = LayerPrefetcher(self.staging_groups(), pin_memory=self.device.type == "cuda", unpinned=(0,), threads=default_threads(self.device))
        self._prefetch = pf
        try:
            yield pf
        finally:
            self._prefetch = None
            pf.close()

    def _staged(self, group: int) -> StagedGroup | None:
        """Group ``group`` of :meth:`staging_groups` from the prefetcher (None without one: :meth:`_materialize` reads)."""
        if self._prefetch is None:
            return None
        staged = self._prefetch.take()
        if staged.index != group:
            raise CTConvertError(f"internal: calibration loads group {group} but the prefetcher read group {staged.index} (layers out of order)")
        return staged

    # -- observing --------------------------------------------------------------------------------
    def _hooks(self, root: nn.Module, prefix: str):
        handles = []
        self.module_names = {}
        for local, m in root.named_modules():
            full = prefix + local if local else prefix.rstrip(".")
            if isinstance(m, nn.Linear):
                ck = self.names.get(full + ".weight", full + ".weight")[: -len(".weight")]

                def pre(mod, args, ck=ck):
                    self.stats.observe_input(ck, args[0])

                handles.append(m.register_forward_pre_hook(pre))
                self.hooked.add(ck)
            elif hasattr(m, "k_proj") and hasattr(m, "v_proj"):
                kw = self.names.get(full + ".k_proj.weight", full + ".k_proj.weight")
                self.module_names[id(m)] = kw[: -len(".k_proj.weight")]
                self.hooked.add(self.module_names[id(m)])
        return handles

    def capture(self, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[_Recorded]]]:
        """Run the model's own forward up to the first layer; returns the layer-0 hidden states and, per layer,
        each micro-batch's arguments."""
        recs: list[list[_Recorded]] = [[] for _ in self.layers]
        hidden: list[torch.Tensor] = []
        originals = list(self.layers)
        last, carried = len(self.layers) - 1, self.carried
        self._carry = None

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
                return (hidden_states, kwargs.get(carried)) if carried else hidden_states

        for i in range(len(self.layers)):
            self.layers[i] = Catcher(i)
        try:
            with torch.no_grad():
                for ids in batches:
                    with contextlib.suppress(_Stop):
                        self.text_model(input_ids=ids.to(self.device), use_cache=False)
        finally:
            for i, m in enumerate(originals):
                self.layers[i] = m
        return hidden, recs

    def run_layer(self, i: int, hidden: list[torch.Tensor], recs: list[_Recorded]) -> list[torch.Tensor]:
        """Load decoder layer ``i`` (from the prefetcher, inside :meth:`prefetching`), run every micro-batch through it
        with the observers' hooks, and put it back on ``meta``; its outputs."""
        layer = self.layers[i]
        prefix = f"{self.layers_name}.{i}."
        staged = self._staged(i + 1)
        self._materialize(layer, prefix, staged=staged)
        _release(staged)
        handles = self._hooks(layer, prefix)
        try:
            with torch.no_grad():
                out, carry = [], []
                for j, (h, r) in enumerate(zip(hidden, recs)):
                    kwargs = r.kwargs if self._carry is None else {**r.kwargs, self.carried: self._carry[j]}
                    y = layer(h, *r.args, **kwargs)
                    out.append(y[0] if isinstance(y, tuple) else y)
                    carry.append(y[1] if self.carried and isinstance(y, tuple) and len(y) > 1 else None)
                self._carry = carry if self.carried else None
        finally:
            for hd in handles:
                hd.remove()
            layer.to("meta")
        return out


def _release(staged: StagedGroup | None) -> None:
    """Hand a staged group back once its copies are issued (the host allocator keeps a page-locked block until the
    copies that read it are done); the prefetcher may then read the next one."""
    if staged is not None:
        staged.release()


#: the model :func:`check_buildable` built, ``(checkpoint, model)``, until :func:`calibrate` of that checkpoint takes it
_PREBUILT: list[tuple[Checkpoint, CalibrationModel]] = []


def check_buildable(ckpt: Checkpoint) -> None:
    """What :class:`CalibrationModel` does before its work: build the meta-device model, replace its fused experts
    and map the checkpoint's names onto it (seconds, no weights read), so that a dry run refuses what the real run
    would refuse, with the same error (exit 4). ``ckpt``: with the plan's per-expert views, as calibration gets it.
    The model is kept (one, the latest) for :func:`calibrate` of the same ``ckpt`` object, which then builds none."""
    _PREBUILT[:] = [(ckpt, CalibrationModel(ckpt, torch.device("cpu")))]


def _take_prebuilt(ckpt: Checkpoint, device: torch.device, attention: tuple[str, ...] = ("sdpa", "eager")) -> CalibrationModel:
    """The model :func:`check_buildable` built for this ``ckpt`` (unused: every module still on ``meta``), its
    attention observer registered again (another model may have been built since), else a new one built with
    ``attention`` (the prebuilt one has the default attention: it is dropped when another is asked for)."""
    if attention != ("sdpa", "eager"):
        _PREBUILT.clear()
        return CalibrationModel(ckpt, device, attention)
    if _PREBUILT and _PREBUILT[0][0] is ckpt:
        cm = _PREBUILT.pop()[1]
        cm.device = device
        cm._register_attention(transformers_module())
        return cm
    return CalibrationModel(ckpt, device)


def _micro_batches(tokens: torch.Tensor, batch_tokens: int) -> list[torch.Tensor]:
    per = max(1, batch_tokens // max(1, tokens.shape[1]))
    return [tokens[i : i + per] for i in range(0, tokens.shape[0], per)]


def calibrate(
    ckpt: Checkpoint,
    tokens: torch.Tensor,
    device: torch.device,
    *,
    kv_cache: bool = False,
    batch_tokens: int = DEFAULT_CALIBRATION_BATCH_TOKENS,
    progress=None,
    importance: bool = False,
    layer_done=None,
) -> Stats:
    """Observe ``tokens`` (int64 ``[N, L]``) through the checkpoint's architecture, one decoder layer at a time.

    Returns the :class:`Stats` (on the CPU, in the model's dtype): per quantizable Linear the min/max of its
    input over all tokens; with ``kv_cache`` per attention module the per-KV-head min/max of the key and value
    states; with ``importance`` per Linear its inputs' E[x^2] statistic (``Stats.importance``), the model run with its
    eager attention, as llm-compressor's calibration runs it (``utils/helpers.py: use_eager_attention``). ``progress``: called with
    ``(layer, layers)`` after each layer. ``layer_done``: called after each layer with the :class:`Stats` so far (on the
    device) and the checkpoint names of every module observed so far (Linear modules and attention modules: their
    statistics are final once their layer has run), before ``progress``. Raises :class:`UnsupportedError`
    (transformers cannot build the architecture) or :class:`BadInputError` (a parameter has no checkpoint tensor).
    """
    cm = _take_prebuilt(ckpt, device, ("eager",) if importance else ("sdpa", "eager"))
    cm.kv = kv_cache
    cm.stats.collect_importance = importance
    cm.hooked = set()
    with cm.prefetching():
        cm.load_outside()
        with _forward_errors(ckpt, "the embedding"):
            hidden, recs = cm.capture(_micro_batches(tokens, batch_tokens))
        for i in range(len(cm.layers)):
            with _forward_errors(ckpt, f"decoder layer {i}"):
                hidden = cm.run_layer(i, hidden, recs[i])
            recs[i] = None  # the layer's arguments and its input: freed by reference counting (no cycles hold them)
            if layer_done is not None:
                layer_done(cm.stats, cm.hooked)
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


def calibrate_whole_model(
    ckpt: Checkpoint, tokens: torch.Tensor, device: torch.device, *, kv_cache: bool = False, batch_tokens: int = DEFAULT_CALIBRATION_BATCH_TOKENS
) -> Stats:
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
    with torch.no_grad():
        for ids in _micro_batches(tokens, batch_tokens):
            cm.text_model(input_ids=ids.to(device), use_cache=False)
    for h in handles:
        h.remove()
    cm.stats.tokens = int(tokens.numel())
    return cm.stats.cpu()
