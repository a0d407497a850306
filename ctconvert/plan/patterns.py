"""The plan's checks of ``--targets``/``--ignore`` entries (and a recipe's): patterns that compile, entries that name
a module (:func:`ctconvert.plan.planner.make_plan` calls them before and after its per-tensor phase)."""

from __future__ import annotations

import re

from ..checkpoint.naming import is_linear_weight, matches
from ..checkpoint.safetensors_io import TensorInfo
from ..errors import UsageError
from .decisions import Decisions

__all__ = ["check_pattern_use", "check_patterns"]


def check_patterns(patterns: list[str]) -> None:
    for pat in patterns:
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as e:
                raise UsageError(f"invalid pattern {pat!r}: {e}") from None


def check_pattern_use(d: Decisions, tensors: dict[str, TensorInfo], targets: list[str], user_ignore: list[str]) -> None:
    """After the per-tensor phase: a ``--targets``/``--ignore`` entry that names no module of the checkpoint is a
    :class:`UsageError` that says how to write it (the usual slip: a bare ``q_proj`` where compressed-tensors wants
    a full module name or a ``re:`` pattern; ``lm_head`` in ``--targets`` instead of ``--lm-head``). An entry that
    names modules none of which it changes (they stay dense by default anyway, or another target takes them) gets a
    note. Entries are quoted as written (no repr: a pattern's backslashes stay single)."""
    modules = sorted({n.rpartition(".")[0] for n in tensors})
    for opt, patterns, used in ((d.flags[0], targets, d.used_targets), (d.flags[1], user_ignore, d.used_ignore)):
        for pat in patterns:
            if pat in used or pat == "Linear":
                continue
            if opt == d.flags[0] and pat.removeprefix("re:").strip(".*$^").endswith("lm_head"):
                raise UsageError(f"{opt} '{pat}': lm_head is quantized with --lm-head nvfp4a16 or --lm-head fp8, not with {opt}")
            hit = [m for m in modules if matches(m, [pat], is_linear=False) is not None]
            if hit:
                taken = set(d.to_quantize.values()).intersection(hit)
                why = "another target already takes" if taken else "stay dense anyway"
                d.notes.append(f"{opt} '{pat}' matched only modules that {why}")
                continue
            bare = pat.removeprefix("re:")
            like = [m for m in modules if m == bare or m.endswith("." + bare)]
            if not pat.startswith("re:") and like:
                raise UsageError(
                    f"{opt} '{pat}' matches no module: entries are full module names (like {like[0]!r}) or re: patterns "
                    f"(re.match from the start of the name, like 're:.*{re.escape(bare)}$')"
                )
            linear = sorted(n[: -len(".weight")] for n, i in tensors.items() if n.endswith(".weight") and is_linear_weight(n, i))
            example = linear[len(linear) // 2] if linear else modules[len(modules) // 2]
            raise UsageError(
                f"{opt} '{pat}' matches no module of this checkpoint: entries are full module names (like {example!r}) "
                f"or re: patterns (re.match from the start of the name, like 're:.*{re.escape(example.rpartition('.')[2])}$')"
            )
