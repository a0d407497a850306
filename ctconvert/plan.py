"""The plan: what happens to every tensor, decided from the headers alone.

For each input tensor the plan says *quantize* (with which scheme, in which
fused set), *pass through*, or *keep dense and list in ``ignore``* (a Linear
that is not quantized). It also fixes every output tensor's name, dtype and
shape, the shard each goes to, and the ``quantization_config``, before any
tensor data is read. Shape problems (group size that does not divide K, 3-D
weights, partly ignored fused sets) are found here.

Matching follows compressed-tensors (compressed-tensors-format.md §7.5): a
``targets``/``ignore`` entry is a module's full name, ``re:<pattern>``
(``re.match``, anchored at the start), or a class name; the only class name a
checkpoint without a model can resolve is ``Linear``, which means "a 2-D
floating-point ``*.weight`` of a linear layer" as recognized by
:func:`is_linear_weight`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .checkpoint.reader import Checkpoint
from .checkpoint.safetensors_io import TensorInfo
from .errors import UnsupportedError, UsageError
from .schemes import LM_HEAD_SCHEMES, Scheme, get_scheme

FLOAT_DTYPES = ("BF16", "F16", "F32")

# Module names that hold 2-D weights but are not Linear layers.
_NOT_LINEAR = re.compile(
    r"(^|\.)(embed_tokens|embeddings?|word_embeddings|position_embeddings|token_type_embeddings|wte|wpe|"
    r"shared|embed_positions|rotary_emb|relative_attention_bias)(\.|$)|norm|(^|\.)ln_?\w*$"
)
# Default ignore: kept dense and listed in `ignore` (field-notes §4, reports 9, F6).
DEFAULT_IGNORE_PATTERNS = {
    "lm_head": re.compile(r"(^|\.)lm_head$|^output$"),
    "router": re.compile(r"(^|\.)(mlp\.gate|block_sparse_moe\.gate|router|gate\.wg|shared_expert_gate|moe\.gate)$"),
    "vision": re.compile(
        r"(^|\.)(visual|vision_tower|vision_model|vision_encoder|multi_modal_projector|mm_projector|"
        r"vision_embed_tokens|audio_tower|audio_model|image_newline|vision)\."
    ),
}
# A decoder (or encoder) block: `...layers.7.`, `...layer.7.`, `...h.7.`, `...blocks.7.`
_BLOCK = re.compile(r"(^|\.)(layers|layer|h|blocks|block|decoder_layers)\.\d+\.")

# Fused sets: vLLM loads these as one layer and keeps one NVFP4 global scale
# (compressed-tensors-format.md §9.1; field-notes F5).
FUSED_SETS = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)
_FUSED_OF = {m: s for s in FUSED_SETS for m in s}


def is_linear_weight(name: str, info: TensorInfo) -> bool:
    """Whether ``name`` looks like the weight of an ``nn.Linear``: 2-D float ``*.weight``, not an embedding or norm."""
    if not name.endswith(".weight") or info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
        return False
    module = name[: -len(".weight")]
    return not _NOT_LINEAR.search(module)


def matches(module: str, patterns: list[str], *, is_linear: bool) -> str | None:
    """The first pattern of ``patterns`` that matches ``module`` (compressed-tensors rules), else None."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return p
        elif p == module or (p == "Linear" and is_linear):
            return p
    return None


@dataclass
class Unit:
    """One unit of work: a fused set (or single Linear) to quantize, or a tensor to copy."""

    kind: str  # "quantize" | "copy"
    sources: list[str]  # input tensor names (for a quantized lm_head from a tied embedding: the embedding)
    modules: list[str] = field(default_factory=list)  # output module names, parallel to sources
    scheme: Scheme | None = None
    group: str | None = None  # config group name
    outputs: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    chunk_rows: int | None = None  # row chunk override (lm_head)

    @property
    def fused(self) -> bool:
        return len(self.sources) > 1


@dataclass
class TensorPlan:
    """Row of the plan table: one input tensor and what happens to it."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    action: str  # quantize | ignore | copy
    scheme: str | None = None
    fused_set: str | None = None
    reason: str | None = None


@dataclass
class Plan:
    """The complete plan of one conversion."""

    scheme: Scheme
    units: list[Unit]
    rows: list[TensorPlan]
    ignore: list[str]
    config_groups: dict[str, tuple[Scheme, list[str]]]
    config_updates: dict
    notes: list[str]
    input_bytes: int

    @property
    def quantized_modules(self) -> int:
        return sum(len(u.modules) for u in self.units if u.kind == "quantize")

    @property
    def output_tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [o for u in self.units for o in u.outputs]

    def to_dict(self) -> dict:
        return {
            "scheme": self.scheme.name,
            "format": self.format,
            "quantized_modules": self.quantized_modules,
            "ignore": self.ignore,
            "notes": self.notes,
            "tensors": [{k: v for k, v in r.__dict__.items() if v is not None} for r in self.rows],
        }

    @property
    def format(self) -> str:
        fmts = {s.format for s, _ in self.config_groups.values()}
        return fmts.pop() if len(fmts) == 1 else "mixed-precision"


def _fused_key(module: str) -> tuple[str, tuple[str, ...]] | None:
    parent, _, leaf = module.rpartition(".")
    s = _FUSED_OF.get(leaf)
    return (parent, s) if s else None


def make_plan(
    ckpt: Checkpoint,
    scheme_name: str,
    *,
    targets: list[str] | None = None,
    ignore: list[str] | None = None,
    lm_head: str = "none",
    lm_head_chunk_rows: int = 8192,
    skip_incompatible: bool = False,
) -> Plan:
    """Decide every tensor's fate. Raises before any data is read.

    Raises :class:`UsageError` (bad ``lm_head`` choice, partly ignored fused
    set), :class:`UnsupportedError` (already-quantized input, NVFP4 W4A4, a
    targeted weight whose shape the scheme cannot take, unless
    ``skip_incompatible``, in which case it is kept dense, listed in ``ignore``
    and reported in ``notes``) or :class:`BadInputError`.
    """
    scheme = get_scheme(scheme_name)
    if ckpt.quantization_config is not None:
        qm = ckpt.quantization_config.get("quant_method", "?")
        raise UnsupportedError(
            f"input is already quantized (quant_method {qm!r}); ctconvert quantize needs a dense bf16/fp16/fp32 checkpoint",
            file=ckpt.path / "config.json",
        )
    lm_key = lm_head.lower()
    if lm_key not in LM_HEAD_SCHEMES:
        raise UsageError(f"unknown --lm-head {lm_head!r}; choose one of: {', '.join(LM_HEAD_SCHEMES)}")
    head_scheme = get_scheme(LM_HEAD_SCHEMES[lm_key]) if LM_HEAD_SCHEMES[lm_key] else None
    targets = list(targets) if targets else ["Linear"]
    user_ignore = list(ignore or [])
    for pat in targets + user_ignore:
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as e:
                raise UsageError(f"invalid pattern {pat!r}: {e}") from None
    notes: list[str] = []

    tensors = ckpt.tensors
    order = sorted(tensors, key=lambda n: (str(tensors[n].file), tensors[n].start))
    rows: dict[str, TensorPlan] = {}
    to_quantize: dict[str, str] = {}  # tensor name -> module
    ignored: list[str] = []

    def fail_or_skip(name: str, module: str, msg: str, info: TensorInfo):
        if not skip_incompatible:
            raise UnsupportedError(
                f"{msg}; leave it dense with --ignore {module!r} or pass --skip-incompatible",
                file=str(info.file), tensor=name,
            )
        rows[name].action = "ignore"
        rows[name].reason = msg + " (skipped: --skip-incompatible)"
        notes.append(f"{name}: {msg}; kept dense and listed in ignore")
        ignored.append(module)

    head_name = None
    used_targets: set[str] = set()
    used_ignore: set[str] = set()
    for name in order:
        info = tensors[name]
        row = TensorPlan(name, info.file.name, info.dtype, info.shape, "copy")
        rows[name] = row
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        linear = is_linear_weight(name, info)
        if DEFAULT_IGNORE_PATTERNS["lm_head"].search(module) and linear:
            head_name = name
            if head_scheme is None:
                row.action, row.reason = "ignore", "lm_head (default; see --lm-head)"
                ignored.append(module)
            continue
        hit = matches(module, targets, is_linear=linear)
        if hit is None:
            continue
        used_targets.add(hit)
        if hit == "Linear" and (m := next((k for k, p in DEFAULT_IGNORE_PATTERNS.items() if k != "lm_head" and p.search(module)), None)):
            row.action, row.reason = "ignore", f"{m} (default)"
            ignored.append(module)
            continue
        if hit == "Linear" and not _BLOCK.search(module):
            row.action, row.reason = "ignore", "Linear outside the transformer blocks (default)"
            ignored.append(module)
            continue
        if (u := matches(module, user_ignore, is_linear=linear)) is not None:
            used_ignore.add(u)
            row.action, row.reason = "ignore", f"--ignore {u}"
            if linear:
                ignored.append(module)
            continue
        if info.dtype not in FLOAT_DTYPES:
            fail_or_skip(name, module, f"dtype {info.dtype} is not bf16/fp16/fp32", info)
            continue
        if len(info.shape) != 2:
            fail_or_skip(name, module, f"{len(info.shape)}-D weight {list(info.shape)}; only 2-D Linear weights can be quantized", info)
            continue
        n_rows, k = info.shape
        if k % scheme.k_multiple:
            what = "block width" if scheme.kind == "fp8_block" else "group size"
            fail_or_skip(name, module, f"K={k} is not a multiple of the {what} {scheme.k_multiple} of {scheme.name}", info)
            continue
        if scheme.kind == "fp8_block" and n_rows % scheme.block[0]:
            fail_or_skip(name, module, f"N={n_rows} is not a multiple of the block height {scheme.block[0]} of {scheme.name} "
                         "(transformers and vLLM need whole blocks)", info)
            continue
        to_quantize[name] = module
        row.action, row.scheme = "quantize", scheme.name

    for pat in targets:
        if pat not in used_targets:
            notes.append(f"--targets {pat!r} matched no tensor")
    for pat in user_ignore:
        if pat not in used_ignore:
            notes.append(f"--ignore {pat!r} matched no tensor")

    # Fused sets: group members by parent; a set is all-quantized or all-dense.
    sets: dict[tuple, list[str]] = {}
    for name, module in to_quantize.items():
        key = _fused_key(module)
        if key is not None:
            sets.setdefault(key, []).append(name)
    all_modules = {n[: -len(".weight")] for n in tensors if n.endswith(".weight")}
    for (parent, members), names in sets.items():
        present = [m for m in members if f"{parent}.{m}" in all_modules]
        if len(names) != len(present):
            dense = [m for m in present if f"{parent}.{m}.weight" not in to_quantize]
            raise UsageError(
                f"fused set {parent}.{{{','.join(members)}}} is only partly quantized ({', '.join(dense)} would stay dense); "
                "vLLM needs one scheme per fused layer: ignore all of its members or none"
            )
        missing = [m for m in members if m not in present]
        if missing and scheme.global_scale:
            notes.append(f"{parent}: fused set without {', '.join(missing)}; global scale shared by the members present")

    units: list[Unit] = []
    seen: set[str] = set()
    group0 = "group_0"
    for name in order:
        row = rows[name]
        if name in seen:
            continue
        if row.action == "quantize":
            key = _fused_key(to_quantize[name])
            names = sorted(sets[key], key=lambda n: key[1].index(to_quantize[n].rpartition(".")[2])) if key else [name]
            for n in names:
                seen.add(n)
                if len(names) > 1:
                    rows[n].fused_set = f"{key[0]}.{{{','.join(to_quantize[m].rpartition('.')[2] for m in names)}}}"
            unit = Unit("quantize", names, [to_quantize[n] for n in names], scheme, group0)
            for n in names:
                unit.outputs += scheme.outputs(to_quantize[n], tensors[n].shape, tensors[n].torch_dtype)
            units.append(unit)
        elif name == head_name and head_scheme is not None:
            units.append(_head_unit(name, tensors[name], head_scheme, lm_head_chunk_rows, rows[name]))
            seen.add(name)
        else:
            info = tensors[name]
            units.append(Unit("copy", [name], [], outputs=[(name, info.dtype, info.shape)]))
            seen.add(name)

    config_updates: dict = {}
    tie = _tie_flag(ckpt.config)
    if head_scheme is not None:
        if head_name is None:
            emb = _find_embedding(tensors)
            if emb is None or not tie:
                raise UsageError(
                    "--lm-head was given but the checkpoint has no lm_head.weight and no tied embedding to take it from",
                    file=ckpt.path,
                )
            head_name = "lm_head.weight"
            row = TensorPlan(emb, tensors[emb].file.name, tensors[emb].dtype, tensors[emb].shape, "copy")
            unit = _head_unit(emb, tensors[emb], head_scheme, lm_head_chunk_rows, row, module="lm_head")
            units.append(unit)
            notes.append(f"tied embeddings untied: lm_head quantized from {emb}, which is also kept dense; tie_word_embeddings set to false")
        elif tie:
            notes.append("tie_word_embeddings set to false: lm_head is quantized and stored separately")
        if tie:
            config_updates["tie_word_embeddings"] = False
    elif head_name is None and tie and _is_generative(ckpt.config):
        ignored.append("lm_head")  # the model builds an lm_head Linear from the tied embedding

    config_groups: dict[str, tuple[Scheme, list[str]]] = {}
    if head_scheme is not None:
        # The head gets its own group targeting it by name. Both compressed-tensors
        # (utils/match.py: exact names, then regexes, then class names) and vLLM
        # match names before the class name "Linear", so the head takes this
        # group whatever the group order (§7.5, field-notes F6).
        config_groups["lm_head"] = (head_scheme, ["lm_head"])
    if to_quantize:
        config_groups[group0] = (scheme, targets)
    if not config_groups:
        raise UsageError("nothing to quantize: no tensor matches the targets (check --targets/--ignore)")
    ignore_list = list(dict.fromkeys(ignored))
    return Plan(
        scheme=scheme,
        units=units,
        rows=[rows[n] for n in order],
        ignore=ignore_list,
        config_groups=config_groups,
        config_updates=config_updates,
        notes=notes,
        input_bytes=ckpt.total_bytes,
    )


def _head_unit(src: str, info: TensorInfo, scheme: Scheme, chunk_rows: int, row: TensorPlan, module: str = "lm_head") -> Unit:
    if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
        raise UnsupportedError(f"lm_head must be a 2-D bf16/fp16/fp32 weight, got {info.dtype}{list(info.shape)}", file=str(info.file), tensor=src)
    if info.shape[1] % scheme.k_multiple:
        raise UnsupportedError(f"lm_head K={info.shape[1]} is not a multiple of {scheme.k_multiple} ({scheme.name})", file=str(info.file), tensor=src)
    row.action, row.scheme, row.reason = "quantize", scheme.name, "--lm-head"
    unit = Unit("quantize", [src], [module], scheme, "lm_head", chunk_rows=chunk_rows)
    unit.outputs = scheme.outputs(module, info.shape, info.torch_dtype)
    return unit


def _tie_flag(config: dict) -> bool:
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    tc = config.get("text_config")
    if isinstance(tc, dict) and "tie_word_embeddings" in tc:
        return bool(tc["tie_word_embeddings"])
    return False


def _is_generative(config: dict) -> bool:
    return any(a.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")) for a in config.get("architectures") or [])


def _find_embedding(tensors: dict[str, TensorInfo]) -> str | None:
    for cand in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight", "embed_tokens.weight"):
        if cand in tensors:
            return cand
    hits = [n for n in tensors if n.endswith("embed_tokens.weight")]
    return hits[0] if len(hits) == 1 else None
