"""Config groups and which one takes a module: compressed-tensors' matching rule.

A :class:`ConfigGroup` is one ``quantization_config`` group: a name, a :class:`~ctconvert.plan.schemes.Scheme`,
its ``targets`` and its weight observer. :class:`GroupAssignment` answers, per module, which group's scheme
it gets, as compressed-tensors 0.19 applies a config (``quantization/lifecycle/apply.py``,
``apply_quantization_config``; ``utils/match.py``, ``match_targets``): every target of every group goes into
one ordered map target -> group (a target listed by two groups: the later group's), the targets that match
the module are ordered exact names first, then ``re:`` patterns (each kind sorted by its text), then class
names (``Linear``), and the first one's group takes the module. With one group (``--scheme``) that group
takes every matched module and the target reported is the first of its list that matches (a name or
pattern before ``Linear``), the rule of :func:`ctconvert.checkpoint.naming.matches`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.naming import matches
from .schemes import Scheme, get_scheme
from .sparsity import sparse_scheme

__all__ = ["ConfigGroup", "GroupAssignment"]


@dataclass(frozen=True)
class ConfigGroup:
    """One config group: ``name``, ``scheme``, ``targets`` (names, ``re:`` patterns, ``Linear``), weight ``observer``."""

    name: str
    scheme: Scheme
    targets: tuple[str, ...]
    observer: str = "minmax"


class GroupAssignment:
    """The config groups of a run and the rule that gives a module its group (the module docstring).

    ``named``: the plan rows name each quantized tensor's group (a recipe); a run of one ``--scheme`` keeps
    today's rows."""

    def __init__(self, groups: list[ConfigGroup], named: bool = False):
        self.groups = list(groups)
        self.named = named
        self._by_target: dict[str, ConfigGroup] = {}
        for g in self.groups:
            for t in g.targets:
                self._by_target[t] = g

    @classmethod
    def of(cls, scheme_name, targets: list[str] | None, groups: list[ConfigGroup] | None, sparsity=None, sparsity_target=None) -> GroupAssignment:
        """A recipe's ``groups`` (named in the plan rows), else one group ``group_0`` of the preset ``scheme_name`` (or a
        :class:`Scheme`; with ``sparsity``: :func:`~ctconvert.plan.sparsity.sparse_scheme`) and ``targets`` (default ``Linear``).
        Raises :class:`~ctconvert.errors.UsageError` for an unknown scheme."""
        if groups:
            return cls(groups, named=True)
        scheme = sparse_scheme(scheme_name, sparsity, sparsity_target) if sparsity else get_scheme(scheme_name)
        return cls([ConfigGroup("group_0", scheme, tuple(targets) if targets else ("Linear",))])

    @property
    def targets(self) -> list[str]:
        """Every group's targets, each once, in order."""
        return list(dict.fromkeys(t for g in self.groups for t in g.targets))

    def group(self, name: str) -> ConfigGroup:
        return next(g for g in self.groups if g.name == name)

    def match(self, module: str, is_linear: bool) -> tuple[ConfigGroup, str] | None:
        """``(group, target)`` of the group that takes ``module`` and the target that matched it, or None."""
        if len(self.groups) == 1:
            g = self.groups[0]
            explicit = [t for t in g.targets if t != "Linear"]
            hit = matches(module, explicit, is_linear=is_linear) or matches(module, list(g.targets), is_linear=is_linear)
            return None if hit is None else (g, hit)
        names = sorted((t for t in self._by_target if t != "Linear"), key=lambda t: ("re:" in t, t))
        hit = next((t for t in names if matches(module, [t], is_linear=False)), None)
        if hit is None and is_linear and "Linear" in self._by_target:
            hit = "Linear"
        return None if hit is None else (self._by_target[hit], hit)
