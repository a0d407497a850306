"""The plan stage: every tensor's fate, from the headers alone (:func:`ctconvert.plan.planner.make_plan`).

Its rules: ``--sparsity`` takes the presets as they are (no ``--group-size``/``--symmetric``) and no
``--lm-head``; a dry run shows the error the real run would stop at and the whole plan. It also
describes a quantized source (requantize) and starts the result.
"""

from __future__ import annotations

import dataclasses
import threading

from ..checkpoint.architectures import mismatch_problems
from ..checkpoint.config import build_quantization_config
from ..checkpoint.conformance import mixed_expert_blocks, vllm_expert_mismatches
from ..checkpoint.expected import is_router_bias, router_bias_problem
from ..checkpoint.families import is_expert, split_fused_experts, vllm_dense_reason, vllm_head
from ..checkpoint.loadable import loadability_problems
from ..checkpoint.modules import modules_of
from ..checkpoint.naming import is_generative, is_lm_head, matches, tie_word_embeddings
from ..checkpoint.reader import Checkpoint
from ..errors import UnsupportedError, UsageError, agree, plural
from ..pipeline.options import QuantizeOptions
from ..plan.dense_dtype import apply_dense_dtype
from ..plan.groups import GroupAssignment
from ..plan.planner import Plan, TensorDecision, make_plan
from ..plan.recipe import read_recipe
from ..plan.result import ConversionResult
from ..plan.schemes import resolve_scheme
from .job import QuantizeJob, Stage

__all__ = ["PlanErrorStage", "PlanStage", "allowed_unloadable_notes", "describe_source", "plan_or_error", "vllm_expert_error"]


class PlanStage(Stage):
    """``scheme`` and the options that choose what is quantized: ``targets``, ``ignore``, ``lm_head``,
    ``lm_head_chunk_rows``, ``skip_incompatible``, ``keep_unclassified``, ``default_ignore``,
    ``quantize_mtp``, ``sparsity`` (with ``group_size``/``symmetric``), ``dense_dtype``; ``target`` for the
    2:4 kernel.

    ``recipe`` (:func:`~ctconvert.plan.recipe.read_recipe`) in place of ``scheme``: its groups, its ``ignore``, its
    observers (``plan.observers``), no default ignores (the recipe is applied as llm-compressor's ``oneshot`` applies it).

    Raises :class:`UsageError` for ``--group-size``/``--symmetric`` or ``--lm-head`` with ``--sparsity``, for a recipe
    with ``scheme`` or an option the recipe decides, for neither (and what :func:`~ctconvert.plan.schemes.resolve_scheme`,
    :func:`~ctconvert.plan.recipe.read_recipe` and :func:`make_plan` raise)."""

    def __init__(self, scheme: str | None, o: QuantizeOptions):
        self.recipe = _recipe(scheme, o)
        if self.recipe is not None:
            scheme = self.recipe.groups[0].scheme
        elif not o.sparsity:
            scheme = resolve_scheme(scheme, o.group_size, o.symmetric)
        elif o.group_size is not None or o.symmetric is not None:
            raise UsageError("--group-size/--symmetric/--asymmetric cannot be combined with --sparsity (2:4 takes the presets as they are)")
        self.scheme, self.o = scheme, o

    def prepare(self, job: QuantizeJob) -> None:
        o, source = self.o, job.source
        plan_ignore = list(o.ignore or []) + [m for m in source.dense_linear if source.quantized]
        rules = dict(keep_unclassified=o.keep_unclassified, default_ignore=o.default_ignore, quantize_mtp=o.quantize_mtp, allow_unloadable=o.allow_unloadable)
        plan_kw = dict(targets=_listed(o.targets), ignore=plan_ignore or None, lm_head=o.lm_head, lm_head_chunk_rows=o.lm_head_chunk_rows, **rules)
        if self.recipe is not None:  # its groups and ignore, applied literally (no default ignores), as oneshot applies it
            _refuse_tied_head(self.recipe, job.ckpt)
            modules = {n.rpartition(".")[0] for n in job.ckpt.tensors} | _expert_modules(job.ckpt)  # naming none (a tied lm_head): config only
            used = [p for p in self.recipe.ignore if any(matches(m, [p], is_linear=False) for m in modules)]
            plan_kw.update(groups=list(self.recipe.groups), ignore=used + plan_ignore or None, default_ignore=False)
        if o.sparsity:
            if o.lm_head.lower() != "none":  # its sparsity_config would claim the head as 2:4 for loaders
                raise UsageError("--lm-head cannot be combined with --sparsity: 2:4 is for the Linear layers of the blocks")
            plan_kw.update(sparsity=o.sparsity, sparsity_target=o.target)
        plan, job.dry_error = plan_or_error(job.ckpt, self.scheme, o.dry_run, o.skip_incompatible, plan_kw)
        apply_dense_dtype(plan, o.dense_dtype, job.ckpt.config)
        _no_head_note(plan, job.ckpt, o.lm_head, o.target)
        _architecture_warning(plan, job.ckpt)
        said = _router_bias_note(plan, job.ckpt, o.target)
        checks = SourceChecks(job.ckpt, plan, o.target, said)  # on a thread: a 9,400-tensor MoE's checks take ~0.15 s
        if o.dry_run:  # (another tool's source: its dense view, job.ckpt, what the output carries)
            checks.join()
        else:
            job.before_commit.append(checks.join)  # its warning: with the result, before the output is committed
        if plan.views:  # per-expert parts of fused 3-D experts: read as tensors of their own from here on
            job.ckpt = dataclasses.replace(job.ckpt, tensors={**job.ckpt.tensors, **plan.views})
        if source.quantized:
            describe_source(plan, source)
        if self.recipe is not None:  # its observers per group; its ignore as written (llm-compressor writes it whole)
            plan.observers.update({g: name for g, name in self.recipe.observers.items() if g in plan.config_groups})
            plan.ignore += [p for p in self.recipe.ignore if p not in plan.ignore]
        job.dry_error = job.dry_error or vllm_expert_error(plan, o.allow_unloadable)
        if o.allow_unloadable:
            allowed_unloadable_notes(plan, job.ckpt.config, o.target)
        job.plan = plan
        job.result = ConversionResult.of_plan(plan, job.out, o.dry_run, source.original.total_bytes, ())  # the device: the quantize stage's
        if self.recipe is not None:  # the result names every scheme of the recipe's groups: W4A16+FP8_DYNAMIC
            job.result.scheme = "+".join(dict.fromkeys(s.name for s, _ in plan.config_groups.values()))

    def report(self, job: QuantizeJob) -> None:
        job.result.error = job.dry_error


class PlanErrorStage(Stage):
    """A real run stops here at the plan's error (``job.dry_error``: a shape the scheme cannot take), after every check
    a dry run makes too (calibration data and model, ``--observer``, ``--tp``), so that both stop at the same first error
    with the same exit code; a dry run reports it with the plan (:meth:`PlanStage.report`)."""

    def prepare(self, job: QuantizeJob) -> None:
        if not job.options.dry_run and job.dry_error is not None:
            raise job.dry_error


#: the options a recipe decides itself: name -> its value when not given
_RECIPE_DECIDES = {"targets": None, "ignore": None, "lm_head": "none", "observer": "minmax", "sparsity": None, "group_size": None}
_RECIPE_DECIDES.update(symmetric=None, kv_cache="none")


def _expert_modules(ckpt: Checkpoint) -> set[str]:
    """The per-expert modules split from fused 3-D experts (``<parent>.<e>.<leaf>``): a recipe's ignore entry naming them
    names modules of the plan (the plan itself says why a family's fused experts cannot be split)."""
    try:
        return {p.name.rpartition(".")[0] for fe in split_fused_experts(ckpt.tensors, ckpt.config).values() for p in fe.parts}
    except UnsupportedError:
        return set()


def _recipe(scheme, o: QuantizeOptions):
    """The run's recipe (None without ``--recipe``); :class:`UsageError` for ``scheme`` with it, or neither, or an option it decides."""
    if o.recipe is None:
        if scheme is None:
            raise UsageError("no scheme: give --scheme (a preset or QuantizationScheme file) or --recipe FILE.yaml")
        return None
    if scheme is not None:
        raise UsageError(f"--recipe and --scheme {scheme} cannot be combined: the recipe's config groups say each module's scheme")
    given = [k for k, v in _RECIPE_DECIDES.items() if (getattr(o, k) or None) != (v or None) and not (k == "lm_head" and str(o.lm_head).lower() == v)]
    if given:
        named = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UsageError(f"--recipe cannot be combined with {named}: the recipe's QuantizationModifier says that (targets, ignore, observers ...)")
    if o.target is not None:
        raise UsageError(f"--recipe with --target {o.target}: a kernel-native layout of a recipe's output is not implemented; leave out --target")
    return read_recipe(o.recipe)


def _refuse_tied_head(recipe, ckpt: Checkpoint) -> None:
    """A recipe whose groups take ``lm_head`` of a model with tied embeddings (no ``lm_head`` tensor): llm-compressor unties
    and quantizes it, which ctconvert does only with ``--lm-head``; refused by name rather than written dense."""
    if "lm_head.weight" in ckpt.tensors or not tie_word_embeddings(ckpt.config) or not is_generative(ckpt.config):
        return
    hit = GroupAssignment(list(recipe.groups)).match("lm_head", True)
    if hit is not None and matches("lm_head", list(recipe.ignore), is_linear=True) is None:
        raise UsageError(
            f"the recipe's config group {hit[0].name} ({hit[1]}) takes lm_head, which this model ties to its embeddings: llm-compressor "
            "would untie and quantize it, ctconvert does not from a recipe; add lm_head to the recipe's ignore",
            file=recipe.path,
        )


def _listed(names: tuple[str, ...] | None) -> list[str] | None:
    return list(names) if names is not None else None


def plan_or_error(ckpt: Checkpoint, scheme, dry_run: bool, skip_incompatible: bool, plan_kw: dict) -> tuple[Plan, Exception | None]:
    """The plan, and the error the run stops at (a dry run's plan then shows every tensor; a real run raises it in
    :class:`PlanErrorStage`, after the checks a dry run makes too). Raises :class:`UnsupportedError` where not one layer fits."""
    try:
        return make_plan(ckpt, scheme, skip_incompatible=skip_incompatible, **plan_kw), None
    except UnsupportedError as e:
        if skip_incompatible:
            raise
        try:
            plan = make_plan(ckpt, scheme, skip_incompatible=True, **plan_kw)
        except UnsupportedError as every:  # not one layer fits: --skip-incompatible (the first error's hint) would not help
            if not every.message.startswith("nothing to quantize"):
                raise e from None
            raise UnsupportedError(every.message.replace("--skip-incompatible kept", "--skip-incompatible would keep"), file=every.file) from None
        if not dry_run:
            return plan, e
        anyway = ", or --allow-unloadable" if "--allow-unloadable" in str(e) else ""  # (a module vLLM cannot load quantized)
        stops = f" (the run stops here: leave it dense with --ignore or the recipe's ignore, or pass --skip-incompatible{anyway})"
        # an expert the scheme cannot take: --skip-incompatible would leave its block's experts quantized unlike each other
        expert_way = "leave the block's experts dense in every layer, or use a group size that divides K; the error says how"

        def expert(name: str) -> bool:
            return is_expert(name) and not anyway

        for row in plan.rows:  # say what this run would do, not what --skip-incompatible would
            if row.reason and row.reason.endswith(" (skipped: --skip-incompatible)"):
                row.reason = row.reason.removesuffix(" (skipped: --skip-incompatible)") + (
                    f" (the run stops here: {expert_way})" if expert(row.name) else stops
                )
        unless = {True: f"the run stops here unless you {expert_way}", False: f"the run stops here unless --skip-incompatible{anyway}"}
        plan.notes[:] = [n.replace("; kept dense and listed in ignore", "; " + unless[expert(n.partition(":")[0])]) for n in plan.notes]
        return plan, e


def vllm_expert_error(plan: Plan, allow_unloadable: bool = False) -> UsageError | None:
    """The error of a plan whose MoE experts vLLM 0.33 would load with another config group than the one that holds
    their tensors (:func:`~ctconvert.checkpoint.conformance.vllm_expert_mismatches` over the ``quantization_config``
    the run would write): targets written for the checkpoint's expert names (``experts.N.``) that miss the name vLLM
    matches; or whose experts of one MoE block are not quantized alike (some dense, or in other groups:
    :func:`~ctconvert.checkpoint.conformance.mixed_expert_blocks`; allowed with ``allow_unloadable``, an output for
    other loaders). None when vLLM agrees (one group targeting ``Linear``, the usual run, always does). ``verify``
    checks the same of a written checkpoint."""
    quantized = {m: u.group for u in plan.units if u.kind == "quantize" for m in u.modules}
    if not allow_unloadable:
        dense = {r.name.removesuffix(".weight"): None for r in plan.rows if r.action != "quantize" and r.name.endswith(".weight")}
        mixed = mixed_expert_blocks({**dense, **quantized})
        if mixed:
            more = f" (and {plural(len(mixed) - 1, 'more such MoE block')})" if len(mixed) > 1 else ""
            return UsageError(f"{mixed[0].experts}{more}: {mixed[0].message()}; --allow-unloadable writes it for other loaders")
    qcfg = build_quantization_config(plan.config_groups, plan.format, plan.ignore)
    found = vllm_expert_mismatches(quantized, qcfg)
    if not found:
        return None
    blocks, projs = sorted({f.block for f in found}), sorted({f.proj for f in found})
    more = f" ({len(found)} in all: {plural(len(blocks), 'MoE block')} x {', '.join(projs)})" if len(found) > 1 else ""
    return UsageError(f"{found[0].experts}: {found[0].message()}{more}")


def allowed_unloadable_notes(plan: Plan, config: dict, target: str | None = None) -> None:
    """``--allow-unloadable``: what the plan quantizes that vLLM 0.33 cannot load, as ``verify`` finds it in the output,
    one warning each (:func:`_unloadable_note`): the modules quantized though vLLM cannot load them quantized, per reason
    (:func:`~ctconvert.checkpoint.families.vllm_dense_reason` with each group's arguments: gpt-oss's experts, experts
    with static INT8 inputs, most MoE routers; verify's :func:`~ctconvert.checkpoint.conformance.vllm_unloadable_problems`),
    and the MoE blocks whose experts are not quantized alike (:func:`~ctconvert.checkpoint.conformance.mixed_expert_blocks`).
    The option writes them for other loaders; without these warnings a run said nothing of it but a note."""
    groups = build_quantization_config(plan.config_groups, plan.format, plan.ignore)["config_groups"]
    found: dict[str, list[str]] = {}
    for u in (u for u in plan.units if u.kind == "quantize"):
        args = groups.get(u.group) or {}
        for m in u.modules:
            if (why := vllm_dense_reason(m, config, args.get("weights"), args.get("input_activations"))) is not None:
                found.setdefault(why, []).append(m)
    for why, ms in found.items():
        more = f" (and {plural(len(ms) - 1, 'more such module')})" if len(ms) > 1 else ""
        _unloadable_note(plan, f"--allow-unloadable quantized {ms[0]}{more}, but {why}", target)
    dense = {r.name.removesuffix(".weight"): None for r in plan.rows if r.action != "quantize" and r.name.endswith(".weight")}
    mixed = mixed_expert_blocks({**dense, **{m: u.group for u in plan.units if u.kind == "quantize" for m in u.modules}})
    if mixed:
        more = f" (and {plural(len(mixed) - 1, 'more such MoE block')})" if len(mixed) > 1 else ""
        _unloadable_note(plan, f"--allow-unloadable wrote {mixed[0].experts}{more} so: {mixed[0].message()}", target)


def _no_head_note(plan: Plan, ckpt: Checkpoint, lm_head: str, target: str | None = None) -> None:
    """A family whose vLLM 0.33 class builds no ``lm_head`` (:data:`.families.VLLM_HEAD` ``"embedding"``: Gemma 2)
    while the output would store one (the source's, or ``--lm-head``'s untied head): a note that vLLM refuses the
    output (and ``verify`` fails it); it is still written, for other loaders (transformers builds the untied head)."""
    head = vllm_head(ckpt.config)
    stored = next((n for n in ckpt.tensors if is_lm_head(n.rpartition(".")[0])), None)
    if head is None or head[0] != "embedding" or (stored is None and lm_head.lower() == "none"):
        return
    what = f"the source stores {stored}" if stored else f"--lm-head {lm_head} writes lm_head"
    _unloadable_note(plan, f"{what}, but vLLM 0.33 {head[1]} {head[2]} builds no lm_head (it computes logits with the embedding)", target)


def _architecture_warning(plan: Plan, ckpt: Checkpoint) -> None:
    """A source whose ``architectures`` and ``model_type`` name different families (:func:`.architectures.mismatch_problems`):
    a plan note and warning that vLLM 0.33 builds the class ``architectures`` names, which the output's config (the
    source's) keeps, so verify judges the output as that class builds it. It names the source's folder (a user running
    several conversions tells which source it is about)."""
    for p in mismatch_problems(ckpt.config):
        note = f"the source {ckpt.path}: {p.message}; the output keeps this config.json"
        plan.notes.append(note)
        plan.warnings.append(note)


def _router_bias_note(plan: Plan, ckpt: Checkpoint, target: str | None = None) -> bool:
    """A MoE source whose router ``e_score_correction_bias`` disagrees with what its config makes vLLM 0.33 build
    (:func:`.expected.router_bias_problem`: DeepSeek/Kimi storing one while ``topk_method`` is not ``noaux_tc``, as
    transformers saves a DeepSeek-V3, or lacking one while it is): a plan note (a dry run shows it before any work)
    that vLLM refuses the output and plain ``verify`` fails it; the output is still written as the source is. Whether it
    said so."""
    found = router_bias_problem(ckpt.config, ckpt.tensors)
    if found is not None:
        why, n = found
        routers = "router" if n == 1 else f"routers ({n}; the first)"
        _unloadable_note(plan, f"the source's {routers}: {why}", target)
    return found is not None


def _unloadable_note(plan: Plan, why: str, target: str | None = None, refused: bool = True) -> None:
    """A note that vLLM 0.33 refuses the output for ``why`` (``refused``; else ``why`` says what vLLM makes of it) and
    that verify fails it, written all the same (for other loaders); also one of the plan's ``warnings``: a run prints it
    as a warning, ``-q`` too, and ``--json`` lists it under ``warnings``. A ``--target`` output's verify does not judge
    what vLLM builds (``checked.not_checked``): the note says which does."""
    judge = "`ctconvert verify OUT` fails it" if target is None else "plain `ctconvert verify` fails its compressed-tensors form"
    note = f"{why}; {'vLLM refuses this output and ' if refused else ''}{judge} (it is written for other loaders)"
    plan.notes.append(note)
    plan.warnings.append(note)


class SourceChecks:
    """What verify's architecture checks find in the source (:func:`.loadable.loadability_problems`: its output carries
    it, so verify fails the output; each problem says what vLLM 0.33 makes of it), run on a thread from here; :meth:`join` (before the output is
    committed, or at once in a dry run) adds one warning naming the source's folder and the first problem and counting
    the others (the router bias note's own excepted). A check that raises adds nothing: verify, the judge, still runs
    them on the output."""

    def __init__(self, ckpt: Checkpoint, plan: Plan, target: str | None, router_said: bool = False) -> None:
        self.found: list = []
        self._plan, self._target, self._router_said = plan, target, router_said  # (router_said: the router note is in the plan)
        self._path = ckpt.path  # (the warning names it)
        self._thread = threading.Thread(target=self._run, args=(ckpt,), daemon=True, name="ctconvert-source-checks")
        self._thread.start()

    def _run(self, ckpt: Checkpoint) -> None:
        try:
            found = loadability_problems(ckpt, modules_of(ckpt), ckpt.path)
        except Exception:  # noqa: BLE001 - verify judges the output all the same
            return
        self.found = [p for p in found if p.severity == "error" and not (self._router_said and is_router_bias(p))]

    def join(self) -> None:
        self._thread.join()
        if not self.found:
            return
        first, more = self.found[0], len(self.found) - 1
        where = f"{first.tensor}: " if first.tensor else ""  # (a config problem names config.json in its message)
        others = f" (and {plural(more, 'more problem')}: `ctconvert inspect SRC` lists them)" if more else ""
        _unloadable_note(self._plan, f"the source {self._path}: {where}{first.message}{others}", self._target, refused=False)  # (it says what vLLM does)


def describe_source(plan: Plan, source) -> None:
    """Requantize: every row says the source format it is dequantized from; the Linear layers dense in the
    source say so; the source's tensors that have no place in the output (its activation and KV-cache
    scales) are rows of their own (action ``drop``); the notes say what the output derives from."""
    dense = set(source.dense_linear)
    for row in plan.rows:
        row.source = source.format_of(row.name)
        module = row.name.removesuffix(".weight")
        if row.reason == f"--ignore {module}" and module in dense:
            row.reason = "dense in the source (its ignore carries over)"
    dropped = dict(source.dropped)
    for m in source.modules.values():  # a source's input scales travel with its modules (convert keeps them)
        if "input_scale" in m.parts:
            dropped[m.parts["input_scale"].name] = "activation scale of the source's quantization"
    for name, why in dropped.items():
        info = source.original.tensors[name]
        plan.rows.append(TensorDecision(name, info.file.name, info.dtype, info.shape, "drop", reason=why))
    labels = sorted({m.label for m in source.modules.values()})
    plan.notes.append(
        f"requantize: {plural(len(source.modules), 'quantized module')} of the {source.quant_method} source ({'; '.join(labels)}) "
        f"{agree(len(source.modules), 'is', 'are')} dequantized "
        f"on the fly with the source format's exact math and quantized again with {plan.scheme.name}; "
        f"verify --reference {source.original.path} measures the result against the dequantized source"
    )
    _requantize_note(plan, min(m.bits for m in source.modules.values()))
    if dropped:
        n = len(dropped)
        plan.notes.append(f"{plural(n, 'activation/KV-cache scale tensor')} of the source {agree(n, 'is', 'are')} not carried over (action 'drop')")


def _requantize_note(plan: Plan, bits: int) -> None:
    """What requantizing a ``bits``-bit source with the plan's scheme costs (lossy twice, either way)."""
    if plan.scheme.num_bits > bits:
        plan.notes.append(
            f"the source holds {bits}-bit weights: {plan.scheme.name} ({plan.scheme.num_bits}-bit) cannot restore the precision they lack, "
            "and rounds them again (lossy twice)"
        )
    else:  # as many bits or fewer: another grid, so the dequantized values are rounded again as well
        plan.notes.append(
            f"the source holds {bits}-bit weights: {plan.scheme.name} rounds their dequantized values again onto its own grid "
            "(lossy twice: its error adds to the source's)"
        )
