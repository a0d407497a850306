"""The plan: what happens to every tensor, decided from the headers alone.

For each input tensor the plan says *quantize* (with which scheme, in which
fused set), *copy* (pass through), or *ignore* (a Linear kept dense and listed
in ``ignore``), with the reason. It also fixes every output tensor's name,
dtype and shape and the ``quantization_config`` groups, before any tensor data
is read. Shape problems (a group size that does not divide K, 3-D weights,
partly ignored fused sets) are found here. The naming rules it applies
(fused sets, default ignores, blocks, embeddings, target matching) are those of
:mod:`ctconvert.checkpoint.naming`.

:func:`make_plan` runs in phases, each a function below: check the options,
decide every tensor (fused 3-D experts as their per-expert parts,
:mod:`ctconvert.checkpoint.families`), settle which fused experts are written
per expert, give every copied tensor its reason (or refuse one no rule
classifies), check the fused sets, make the work units, plan ``lm_head``, and
name the config groups. The fused-experts phases are in :mod:`.experts`; the
rows and the record the phases share in :mod:`.decisions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checkpoint.families import FusedExperts, dense_experts_reason, indexer_dense_reason, is_mtp, mtp_dense_reason, mtp_part_layers, vllm_dense_reason
from ..checkpoint.naming import (
    BLOCK,
    DEFAULT_IGNORE_PATTERNS,
    FLOAT_DTYPES,
    dense_kind,
    find_embedding,
    fused_key,
    fused_set_name,
    is_generative,
    is_linear_weight,
    loader_patterns,
    matches,
    tie_word_embeddings,
)
from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import TensorInfo
from ..errors import UnsupportedError, UsageError, agree
from ..formats import CompressionFormat
from ..options import DEFAULT_LM_HEAD_CHUNK_ROWS
from .advice import refusal_hint
from .decisions import Decisions, TensorDecision
from .experts import fused_experts, settle_experts
from .groups import ConfigGroup, GroupAssignment
from .patterns import check_pattern_use, check_patterns
from .schemes import LM_HEAD_SCHEMES, Scheme, get_scheme, weight_problem

__all__ = ["Plan", "TensorDecision", "WorkUnit", "make_plan"]

_HEAD_GROUP = "lm_head"


@dataclass
class WorkUnit:
    """One unit of work: a fused set (or single Linear) to quantize, or a tensor to copy."""

    kind: str  # "quantize" | "copy"
    sources: list[str]  # input tensor names (for a quantized lm_head from a tied embedding: the embedding)
    modules: list[str] = field(default_factory=list)  # output module names, parallel to sources
    scheme: Scheme | None = None
    group: str | None = None  # config group name
    outputs: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    chunk_rows: int | None = None  # row chunk override (lm_head)
    cast: str | None = None  # a copy written in another dtype (safetensors name; --dense-dtype, plan/dense_dtype.py)

    @property
    def fused(self) -> bool:
        return len(self.sources) > 1

    def output_sources(self) -> dict[str, list[str]]:
        """Output tensor name -> the source tensors its bytes derive from: a module's own weight,
        except for NVFP4 fused sets, whose shared global scale derives from every member."""
        shared = self.kind != "quantize" or (self.scheme.global_scale and self.fused)
        out = {}
        for name, _, _ in self.outputs:
            mod = name.rpartition(".")[0]
            own = [] if shared else [s for s, m in zip(self.sources, self.modules) if m == mod]
            out[name] = own or list(self.sources)
        return out


@dataclass
class Plan:
    """The complete plan of one conversion."""

    scheme: Scheme
    units: list[WorkUnit]
    rows: list[TensorDecision]
    ignore: list[str]
    config_groups: dict[str, tuple[Scheme, list[str]]]
    config_updates: dict
    notes: list[str]
    input_bytes: int
    views: dict[str, TensorInfo] = field(default_factory=dict)  # per-expert parts of split fused tensors, by name
    defaults: dict[str, int] = field(default_factory=dict)  # default rule -> modules it kept dense
    observers: dict[str, str] = field(default_factory=dict)  # config group -> its weight observer, where not minmax (--observer)
    warnings: list[str] = field(default_factory=list)  # the notes saying vLLM 0.33 refuses the output (shown as warnings, -q too)

    @property
    def quantized_modules(self) -> int:
        return sum(len(u.modules) for u in self.units if u.kind == "quantize")

    @property
    def kept_dense(self) -> dict[str, list[str]]:
        """Reason -> the Linear weights kept dense for it (``ignore`` rows: defaults, ``--ignore``,
        ``--skip-incompatible``), in plan order."""
        found: dict[str, list[str]] = {}
        for r in self.rows:
            if r.action == "ignore":
                found.setdefault(r.reason or "ignored", []).append(r.name)
        return found

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
            "warnings": self.warnings,
            "defaults_applied": self.defaults,
            "tensors": [{k: v for k, v in r.__dict__.items() if v is not None} for r in self.rows],
        }

    @property
    def format(self) -> str:
        fmts = {s.format for s, _ in self.config_groups.values()}
        return fmts.pop() if len(fmts) == 1 else CompressionFormat.MIXED_PRECISION.value


@dataclass
class _Rules:
    """The options that decide a tensor beyond targets/ignore (phase 2)."""

    config: dict
    default_ignore: bool = True  # apply the default ignores (lm_head, routers, towers, MTP, outside the blocks)
    quantize_mtp: bool = False
    head_quantized: bool = False
    skip_incompatible: bool = False
    modules: frozenset = frozenset()  # the checkpoint's weight modules (which members of a fused set are present)
    allow_unloadable: bool = False  # quantize modules vLLM 0.33 cannot load quantized (families.vllm_dense_reason)
    mtp_parts: frozenset | None = None  # layers holding an MTP layer's own modules (families.mtp_part_layers)


def make_plan(
    ckpt: Checkpoint,
    scheme_name: str | Scheme,
    *,
    targets: list[str] | None = None,
    ignore: list[str] | None = None,
    lm_head: str = "none",
    lm_head_chunk_rows: int = DEFAULT_LM_HEAD_CHUNK_ROWS,
    skip_incompatible: bool = False,
    sparsity: str | None = None,
    sparsity_target: str | None = None,
    keep_unclassified: bool = False,
    default_ignore: bool = True,
    quantize_mtp: bool = False,
    groups: list[ConfigGroup] | None = None,
    allow_unloadable: bool = False,
) -> Plan:
    """Decide every tensor's fate. Raises before any data is read.

    Raises :class:`UsageError` (bad ``lm_head`` choice, partly ignored fused set), :class:`UnsupportedError`
    (already-quantized input, NVFP4 W4A4, a targeted weight whose shape the scheme cannot take or that vLLM 0.33
    cannot load quantized (``families.vllm_dense_reason``; written with ``allow_unloadable``), unless
    ``skip_incompatible``, which keeps it dense, listed in ``ignore`` and reported in ``notes``; a floating tensor of
    2 or more dimensions that no rule classifies, or fused 3-D experts of a family whose layout is not known, unless
    ``keep_unclassified``, which keeps it dense, lists its module in ``ignore`` and reports it) or :class:`BadInputError`.

    Fused 3-D experts are written as one 2-D Linear per expert
    (:func:`ctconvert.checkpoint.families.split_fused_experts`) when any of
    them is quantized; their parts are in :attr:`Plan.views`. A module that
    ``targets`` names (by name or ``re:`` pattern, not ``Linear``) is quantized
    even where a default would keep it dense; ``default_ignore=False`` drops
    every default (``lm_head``, routers, towers, MTP, Linear outside the
    blocks). MTP layers stay dense unless ``quantize_mtp``. ``groups`` (a recipe, :mod:`.recipe`): several config
    groups in place of ``scheme_name``/``targets``, each module taking its group's scheme by compressed-tensors'
    rule (:class:`~ctconvert.plan.groups.GroupAssignment`); a fused set split over two groups is a :class:`UsageError`.

    Example::

        plan = make_plan(open_checkpoint("model/"), "W4A16")
        [r.action for r in plan.rows]   # 'quantize' | 'ignore' | 'copy' | 'split', one per tensor (and per expert part)
    """
    assign = GroupAssignment.of(scheme_name, targets, groups, sparsity, sparsity_target)
    scheme = assign.groups[0].scheme
    _refuse_quantized(ckpt)
    head_scheme = _head_scheme(lm_head)
    targets = assign.targets
    user_ignore = list(ignore or [])
    check_patterns(targets + user_ignore)

    d = Decisions(flags=("recipe targets", "recipe ignore") if groups else ("--targets", "--ignore"))
    fused = fused_experts(ckpt, keep_unclassified, d)
    tensors = _with_parts(ckpt.tensors, fused)
    modules = frozenset(n[: -len(".weight")] for n in tensors if n.endswith(".weight"))
    rules = _Rules(ckpt.config, default_ignore, quantize_mtp, head_scheme is not None, skip_incompatible, modules, allow_unloadable, mtp_part_layers(tensors))
    for name in _file_order(tensors):
        _decide(d, name, tensors[name], assign, user_ignore, rules)
    _refuse_uncalibratable_mtp(d, scheme, ckpt.config, rules.mtp_parts)
    fused = settle_experts(d, fused, ckpt.tensors)
    tensors = _with_parts(ckpt.tensors, fused)
    order = _file_order(tensors)
    _explain_copies(d, order, tensors, targets, user_ignore, keep_unclassified)
    check_pattern_use(d, tensors, targets, user_ignore)
    sets = _fused_sets(d, tensors, assign)
    units = _units(d, order, tensors, sets, assign, head_scheme, lm_head_chunk_rows)
    config_updates = _plan_head(d, ckpt, units, head_scheme, lm_head_chunk_rows)
    config_groups = _config_groups(d, assign, head_scheme)
    ignore_list = _ignore_list(d, order, tensors, user_ignore, ckpt.config)
    return Plan(
        scheme=scheme,
        units=units,
        rows=[r for n in _file_order(ckpt.tensors) for r in [d.rows[n], *(d.rows[p.name] for p in (fused[n].parts if n in fused else ()))]],
        ignore=ignore_list,
        config_groups=config_groups,
        config_updates=config_updates,
        notes=d.notes,
        input_bytes=ckpt.total_bytes,
        views={p.name: p for fe in fused.values() for p in fe.parts},
        defaults=d.defaults,
    )


def _config_groups(d: Decisions, assign: GroupAssignment, head_scheme: Scheme | None) -> dict[str, tuple[Scheme, list[str]]]:
    """The ``quantization_config`` groups: the head's (when quantized) and each group that quantizes a tensor; raises when there is nothing to quantize."""
    scheme = assign.groups[0].scheme
    config_groups: dict[str, tuple[Scheme, list[str]]] = {}
    if head_scheme is not None:
        # The head gets its own group targeting it by name. Both compressed-tensors
        # (utils/match.py: exact names, then regexes, then class names) and vLLM
        # match names before the class name "Linear", so the head takes this
        # group whatever the group order (docs/compressed-tensors-format.md §7.5, docs/field-notes.md F6).
        config_groups[_HEAD_GROUP] = (head_scheme, _head_targets(d.head_name))
    used = set(d.group_of.values())
    config_groups.update({g.name: (g.scheme, list(g.targets)) for g in assign.groups if g.name in used})
    if assign.named and config_groups:  # a recipe's group that quantizes nothing is left out of the config: say so
        d.notes += [
            f"config group '{g.name}' quantizes no module (its targets take none, or only modules kept dense): left out of the config"
            for g in assign.groups
            if g.name not in used
        ]
    if not config_groups:
        skipped = [r for r in d.rows.values() if r.reason and r.reason.endswith("(skipped: --skip-incompatible)")]
        if skipped:
            kept = agree(len(skipped), "it", f"all {len(skipped)}")
            raise UnsupportedError(
                f"nothing to quantize: {scheme.name} cannot take any targeted Linear layer; --skip-incompatible kept {kept} dense "
                f"(first: {skipped[0].name}: {skipped[0].reason.removesuffix(' (skipped: --skip-incompatible)')}); "
                f"choose another scheme{' or --group-size' if scheme.weights.group_size else ''}"
            )
        raise UsageError("nothing to quantize: no tensor matches the targets (check --targets/--ignore)")
    return config_groups


def _ignore_list(d: Decisions, order: list[str], tensors: dict[str, TensorInfo], user_ignore: list[str], config: dict) -> list[str]:
    """The config's ``ignore``: the modules kept dense, the patterns loaders need for them, and the user's own patterns that were used."""
    ignore_list = list(dict.fromkeys(d.ignored))
    linear_modules = {n[: -len(".weight")] for n in order if is_linear_weight(n, tensors[n])}
    ignore_list += [p for p in loader_patterns(ignore_list, linear_modules, config) if p not in ignore_list]
    ignore_list += [p for p in user_ignore if p in d.used_ignore and p not in ignore_list]  # the user's own words, kept
    return ignore_list


def _file_order(tensors: dict[str, TensorInfo]) -> list[str]:
    """Tensor names in the order their bytes lie in the files (per-expert parts within their fused tensor)."""
    files: dict = {}  # one str() per file, not per tensor
    return sorted(tensors, key=lambda n: (files.get(f := tensors[n].file) or files.setdefault(f, str(f)), tensors[n].start, n))


def _with_parts(tensors: dict[str, TensorInfo], fused: dict[str, FusedExperts]) -> dict[str, TensorInfo]:
    """The checkpoint's tensors with each split fused tensor replaced by its per-expert parts."""
    out = {n: i for n, i in tensors.items() if n not in fused}
    out.update({p.name: p for fe in fused.values() for p in fe.parts})
    return out


def _head_module(head_name: str | None) -> str:
    """The quantized head's module: its stored name when that is an ``lm_head`` (``language_model.lm_head``
    in a LLaVA layout keeps its name), else ``lm_head`` (a tied embedding, or a head stored as ``output``)."""
    module = head_name[: -len(".weight")] if head_name else "lm_head"
    return module if module.split(".")[-1] == "lm_head" else "lm_head"


def _head_targets(head_name: str | None) -> list[str]:
    """The head group's targets: its module name; a head stored under another name than ``lm_head``
    also gets a pattern for the ``lm_head`` loaders build from it (:func:`ctconvert.checkpoint.naming.loader_patterns`)."""
    module = _head_module(head_name)
    return [module] if module == "lm_head" else [module, r"re:(.*\.)?lm_head$"]


# -- phase 1: options ---------------------------------------------------------------


def _refuse_quantized(ckpt: Checkpoint) -> None:
    if ckpt.quantization_config is not None:
        qm = ckpt.quantization_config.get("quant_method", "?")
        raise UnsupportedError(
            f"input is already quantized (quant_method {qm!r}); ctconvert quantize needs a dense bf16/fp16/fp32 checkpoint",
            file=ckpt.path / "config.json",
        )


def _head_scheme(lm_head: str) -> Scheme | None:
    key = lm_head.lower()
    if key not in LM_HEAD_SCHEMES:
        raise UsageError(f"unknown --lm-head {lm_head!r}; choose one of: {', '.join(LM_HEAD_SCHEMES)}")
    return get_scheme(LM_HEAD_SCHEMES[key]) if LM_HEAD_SCHEMES[key] else None


# -- phase 2: every tensor ------------------------------------------------------------


def _decide(d: Decisions, name: str, info: TensorInfo, assign: GroupAssignment, user_ignore: list[str], rules: _Rules) -> None:
    """Record one tensor's decision in ``d`` (a tensor left ``copy`` without a reason is explained, or refused, in phase 2c).

    A module named by an explicit target (a name or ``re:`` pattern) is quantized even where a
    default would keep it dense; the defaults apply to what only ``Linear`` matches."""
    row = d.rows[name] = TensorDecision(name, info.file.name, info.dtype, info.shape, "copy", slice_of=info.base)
    if not name.endswith(".weight"):
        return
    module = name[: -len(".weight")]
    linear = is_linear_weight(name, info)

    def keep_dense(reason: str, listed: bool = True, default: str | None = None) -> None:
        row.action, row.reason = "ignore", reason
        if listed:
            d.ignored.append(module)
        if default is not None:
            d.defaults[default] = d.defaults.get(default, 0) + 1

    group, hit = assign.match(module, linear) or (assign.groups[0], None)
    explicit, scheme = (hit if hit != "Linear" else None), group.scheme
    user = matches(module, user_ignore, is_linear=linear)
    if is_head := bool(DEFAULT_IGNORE_PATTERNS["lm_head"].search(module) and linear):
        d.head_name = name
        if rules.head_quantized:
            return
        if rules.default_ignore:  # the one default a target does not override: --lm-head quantizes the head
            if user is not None:
                d.used_ignore.add(user)
            return keep_dense("lm_head (default; see --lm-head)", default="lm_head")
    if hit is None:
        return
    d.used_targets.add(hit)
    if user is not None:
        d.used_ignore.add(user)  # also where a default keeps it dense: the pattern goes into the config
    if explicit is None and rules.default_ignore and (default := _default_rule(module, name, rules)) is not None:
        return keep_dense(default if "by default" in default else f"{default} (default)", default=default)
    if user is not None:
        return keep_dense(f"{d.flags[1]} {user}", listed=linear)
    problem = weight_problem(info.dtype, info.shape, scheme)
    unloadable = None if problem or rules.allow_unloadable else _unloadable(module, scheme, rules) or (_HEAD if is_head and explicit is None else None)
    problem = problem or unloadable
    if problem is not None:
        if not rules.skip_incompatible:
            part = f"its per-expert part {name}: " if info.base else ""  # named by the stored tensor, which the user can find
            hint = refusal_hint(module, info.shape, scheme, bool(unloadable), rules.modules, d.flags[1])
            anyway = " (or --allow-unloadable to write it quantized for other loaders)"
            shape = f"{list(info.shape)} {info.dtype} weight: " if len(info.shape) == 2 else ""
            raise UnsupportedError(f"{part}{shape}{problem}; {hint}{anyway if unloadable else ''}", file=str(info.file), tensor=info.base or name)
        keep_dense(problem + " (skipped: --skip-incompatible)")
        d.notes.append(f"{name}: {problem}; kept dense and listed in ignore")
        return
    d.to_quantize[name], d.group_of[name] = module, group.name
    row.action, row.scheme, row.group = "quantize", scheme.name, group.name if assign.named else None


#: why a head that a group takes only as a ``Linear`` (--no-default-ignore, a recipe) is refused: vLLM 0.33 matches its
#: ParallelLMHead by name, never as ``Linear`` (compressed_tensors.py ``get_quant_method``), so builds it unquantized
_HEAD = (
    "lm_head: vLLM 0.33 matches the head by name, not as a Linear, and would build it unquantized; "
    "quantize it with --lm-head (nvfp4a16, fp8) or a target naming it"
)


def _unloadable(module: str, scheme: Scheme, rules) -> str | None:
    """:func:`~ctconvert.checkpoint.families.vllm_dense_reason` of ``module`` quantized with ``scheme``."""
    try:
        group = scheme.config_group([])
    except KeyError:  # a scheme of no preset's arguments: the module-only rules
        group = {"weights": None, "input_activations": None}
    return vllm_dense_reason(module, rules.config, group.get("weights"), group.get("input_activations"))


def _default_rule(module: str, name: str, rules: _Rules) -> str | None:
    """The default that keeps a ``Linear``-matched module dense (router, vision tower, MTP layer, outside the blocks,
    experts of a family vLLM cannot load quantized, the DeepSeek V3.2 indexer's wk/weights_proj), or None."""
    default = next((k for k, p in DEFAULT_IGNORE_PATTERNS.items() if k != "lm_head" and p.search(module)), None)
    if default is not None:
        return default
    if (why := dense_experts_reason(module, rules.config)) is not None:
        return f"{why}; kept dense by default (targets naming them, with --allow-unloadable, quantize them)"
    if (why := indexer_dense_reason(module, rules.config)) is not None:
        return f"{why}; kept dense by default"
    if not rules.quantize_mtp and is_mtp(name, rules.config, rules.mtp_parts):
        return "MTP layer; --quantize-mtp quantizes it"
    if (why := mtp_dense_reason(module, rules.config)) is not None:
        return why
    if not BLOCK.search(module):
        return "Linear outside the transformer blocks"
    return None


def _refuse_uncalibratable_mtp(d: Decisions, scheme: Scheme, config: dict, parts: frozenset | None = None) -> None:
    """A quantized MTP layer cannot take a scheme with calibrated activation scales: calibration runs the model's
    decoder layers (transformers' forward), which never run the MTP layer, so no token reaches it."""
    if not scheme.needs_calibration:
        return
    mtp = [n for n in d.to_quantize if is_mtp(n, config, parts)]
    if mtp:
        raise UsageError(
            f"--quantize-mtp with {scheme.name}: the MTP layer ({mtp[0]} ...) needs calibrated activation scales, but calibration runs "
            "the model's own decoder layers and the MTP layer is not one of them (no token reaches it); leave out --quantize-mtp "
            "(it stays dense) or use a weight-only or dynamic scheme (NVFP4A16, W4A16, FP8_DYNAMIC)"
        )


# -- phase 2b: fused 3-D experts ---------------------------------------------------------------


# -- phase 2c: what is copied, and why --------------------------------------------------------


def _explain_copies(
    d: Decisions, order: list[str], tensors: dict[str, TensorInfo], targets: list[str], user_ignore: list[str], keep_unclassified: bool
) -> None:
    """Give every copied tensor its reason. A floating tensor of 2 or more dimensions that no rule explains
    (not a Linear weight, embedding, norm, convolution, tower, router or expert) is refused by name, or with
    ``keep_unclassified`` kept dense, its module listed in ``ignore`` and reported."""
    for name in order:
        row = d.rows[name]
        if row.action != "copy" or row.reason is not None:
            continue
        info = tensors[name]
        module = name.rpartition(".")[0]
        if info.dtype not in FLOAT_DTYPES and info.dtype != "F64":
            row.reason = f"{info.dtype} tensor (not a floating weight)"
        elif len(info.shape) < 2:
            router = DEFAULT_IGNORE_PATTERNS["router"].search(module)
            row.reason = dense_kind(name) or ("router parameter" if router else "bias" if name.endswith(".bias") else "1-D/0-D parameter or buffer")
        elif (kind := dense_kind(name)) is not None:
            row.reason = kind
        elif name.endswith(".weight") and is_linear_weight(name, info):
            row.reason = f"Linear not matched by {d.flags[0]} {','.join(targets)}"
        elif (user := matches(name[: -len(".weight")] if name.endswith(".weight") else module, user_ignore, is_linear=False)) is not None:
            d.used_ignore.add(user)
            row.action, row.reason = "ignore", f"{d.flags[1]} {user}"
            d.ignored.append(name[: -len(".weight")] if name.endswith(".weight") else module)
        elif keep_unclassified:
            row.action, row.reason = "ignore", "unclassified tensor kept dense (--keep-unclassified)"
            d.ignored.append(name[: -len(".weight")] if name.endswith(".weight") else module)
            d.notes.append(f"{name} ({info.file.name}): {len(info.shape)}-D {info.dtype} tensor that no rule classifies; kept dense (--keep-unclassified)")
        else:
            raise UnsupportedError(
                f"cannot classify this {len(info.shape)}-D {info.dtype} tensor {list(info.shape)} (not a Linear weight, embedding, norm, convolution, "
                "vision/audio tower, router or MoE expert): pass --keep-unclassified to keep it dense (listed in ignore and reported), or name it in --ignore",
                file=str(info.file),
                tensor=name,
            )


# -- phase 3: fused sets ------------------------------------------------------------------

_SKIPPED = " (skipped: --skip-incompatible)"  # the reason suffix of a weight --skip-incompatible kept dense


def _fused_sets(d: Decisions, tensors: dict[str, TensorInfo], assign: GroupAssignment) -> dict[tuple, list[str]]:
    """Members to quantize grouped by fused set; a set is all-quantized or all-dense, in one config group (else ``UsageError``)."""
    sets: dict[tuple, list[str]] = {}
    for name, module in d.to_quantize.items():
        key = fused_key(module)
        if key is not None:
            sets.setdefault(key, []).append(name)
    all_modules = {n[: -len(".weight")] for n in tensors if n.endswith(".weight")}
    for (parent, members), names in list(sets.items()):
        present = [m for m in members if f"{parent}.{m}" in all_modules]
        if len(names) != len(present):
            dense = [m for m in present if f"{parent}.{m}.weight" not in d.to_quantize]
            skipped = [m for m in dense if (d.rows[f"{parent}.{m}.weight"].reason or "").endswith(_SKIPPED)]
            if skipped == dense:  # --skip-incompatible kept a member dense: vLLM loads the set with one scheme, so all of it stays dense
                label = fused_set_name(parent, present)
                for name in names:
                    why = f"fused with {', '.join(skipped)} in {label}, which the scheme cannot take; vLLM loads a fused layer with one scheme"
                    row = d.rows[name]
                    row.action, row.scheme, row.reason = "ignore", None, f"{why}{_SKIPPED}"
                    del d.to_quantize[name], d.group_of[name]
                    d.ignored.append(name[: -len(".weight")])
                    d.notes.append(f"{name}: {why}; kept dense and listed in ignore")
                del sets[(parent, members)]
                continue
            raise UsageError(
                f"fused set {fused_set_name(parent, members)} is only partly quantized ({', '.join(dense)} would stay dense); "
                "vLLM needs one scheme per fused layer: ignore all of its members or none"
            )
        if len(split := sorted({d.group_of[n] for n in names})) > 1:
            raise UsageError(
                f"fused set {fused_set_name(parent, members)} is split over config groups {', '.join(split)}; vLLM loads a fused layer "
                "with one scheme: give all of its members one group's targets"
            )
        missing = [m for m in members if m not in present]
        if missing and assign.group(d.group_of[names[0]]).scheme.global_scale:
            d.notes.append(f"{parent}: fused set without {', '.join(missing)}; global scale shared by the members present")
    return sets


# -- phase 4: work units ----------------------------------------------------------------------


def _units(
    d: Decisions,
    order: list[str],
    tensors: dict[str, TensorInfo],
    sets: dict[tuple, list[str]],
    assign: GroupAssignment,
    head_scheme: Scheme | None,
    head_chunk_rows: int,
) -> list[WorkUnit]:
    """Work units in file order: one per fused set or quantized Linear, one per copied tensor."""
    units: list[WorkUnit] = []
    seen: set[str] = set()
    for name in order:
        if name in seen:
            continue
        row = d.rows[name]
        if row.action == "quantize":
            key = fused_key(d.to_quantize[name])
            names = sorted(sets[key], key=lambda n: key[1].index(d.to_quantize[n].rpartition(".")[2])) if key else [name]
            seen.update(names)
            if len(names) > 1:
                label = fused_set_name(key[0], (d.to_quantize[m].rpartition(".")[2] for m in names))
                for n in names:
                    d.rows[n].fused_set = label
            group = assign.group(d.group_of[name])
            unit = WorkUnit("quantize", names, [d.to_quantize[n] for n in names], group.scheme, group.name)
            for n in names:
                unit.outputs += group.scheme.outputs(d.to_quantize[n], tensors[n].shape, tensors[n].torch_dtype)
            units.append(unit)
        elif name == d.head_name and head_scheme is not None:
            units.append(_head_unit(name, tensors[name], head_scheme, head_chunk_rows, row, module=_head_module(name)))
            seen.add(name)
        else:
            info = tensors[name]
            units.append(WorkUnit("copy", [name], [], outputs=[(name, info.dtype, info.shape)]))
            seen.add(name)
    return units


def _head_unit(src: str, info: TensorInfo, scheme: Scheme, chunk_rows: int, row: TensorDecision, module: str = "lm_head") -> WorkUnit:
    if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
        raise UnsupportedError(f"lm_head must be a 2-D bf16/fp16/fp32 weight, got {info.dtype}{list(info.shape)}", file=str(info.file), tensor=src)
    if info.shape[1] % scheme.k_multiple:
        raise UnsupportedError(f"lm_head K={info.shape[1]} is not a multiple of {scheme.k_multiple} ({scheme.name})", file=str(info.file), tensor=src)
    row.action, row.scheme, row.reason = "quantize", scheme.name, "--lm-head"
    unit = WorkUnit("quantize", [src], [module], scheme, _HEAD_GROUP, chunk_rows=chunk_rows)
    unit.outputs = scheme.outputs(module, info.shape, info.torch_dtype)
    return unit


# -- phase 5: lm_head and tied embeddings ------------------------------------------------------------


def _plan_head(d: Decisions, ckpt: Checkpoint, units: list[WorkUnit], head_scheme: Scheme | None, chunk_rows: int) -> dict:
    """A quantized head from a tied embedding (appended to ``units``), the ``ignore`` entry of a tied
    dense head, and the config updates (untied embeddings)."""
    tensors = ckpt.tensors
    tie = tie_word_embeddings(ckpt.config)
    if head_scheme is None:
        if d.head_name is None and tie and is_generative(ckpt.config):
            d.ignored.append("lm_head")  # the model builds an lm_head Linear from the tied embedding
        return {}
    if d.head_name is None:
        emb = find_embedding(tensors)
        if emb is None or not tie:
            raise UsageError("--lm-head was given but the checkpoint has no lm_head.weight and no tied embedding to take it from", file=ckpt.path)
        row = TensorDecision(emb, tensors[emb].file.name, tensors[emb].dtype, tensors[emb].shape, "copy")
        units.append(_head_unit(emb, tensors[emb], head_scheme, chunk_rows, row, module="lm_head"))
        d.notes.append(f"tied embeddings untied: lm_head quantized from {emb}, which is also kept dense; tie_word_embeddings set to false")
    elif tie:
        d.notes.append("tie_word_embeddings set to false: lm_head is quantized and stored separately")
    return {"tie_word_embeddings": False} if tie else {}
