"""``--recipe FILE.yaml``: an llm-compressor recipe read into config groups (:class:`~ctconvert.plan.groups.ConfigGroup`).

The forms read are llm-compressor 0.14.0.1's (``llmcompressor/recipe/recipe.py``, ``Recipe.from_dict``;
``modifiers/quantization/quantization/mixin.py``, ``QuantizationMixin.resolve_quantization_config``):

- the file is YAML or JSON: top-level keys ending in ``_stage`` (``quant_stage:``), each holding keys ending
  in ``_modifiers`` (``quant_modifiers:``), each holding modifiers by class name (``QuantizationModifier:``)
  with their arguments; ``args`` and other top-level keys are what llm-compressor skips, and are refused here
  (a recipe that says nothing is not silently a no-op);
- exactly one ``QuantizationModifier`` in the whole recipe. Another modifier (``GPTQModifier``,
  ``AWQModifier``, ``SmoothQuantModifier``, ``SparseGPTModifier`` ...) is refused by name;
- its arguments: ``config_groups`` (name -> compressed-tensors ``QuantizationScheme``: ``targets``,
  ``weights`` with an optional ``observer``, ``input_activations``, ``format``), or ``scheme`` (a preset name,
  with the modifier's ``targets``, or a mapping preset -> targets; groups ``group_0``, ``group_1`` ... in
  order, as llm-compressor names them), ``targets``, ``ignore``, ``weight_observer`` / ``observer:
  {weights: NAME}`` (every group's weight observer, as ``_apply_observer_overrides`` sets it). The
  arguments llm-compressor writes into a saved recipe at their defaults (``bypass_divisibility_checks:
  false``, ``requires_calibration_data``, ``index``/``group``/``start``/``end``/``update``: null) are taken;
  any other argument or value (``kv_cache_scheme``, input/output observers, ``start: 0`` ...) is refused by name.

Each group's scheme must be one ctconvert writes bit for bit (:func:`~ctconvert.plan.schemes.scheme_from_dict`)
and without calibrated activations; its observer one of :data:`ctconvert.options.OBSERVER_NAMES`
(``memoryless_minmax``, the default, is ``minmax``; an ``imatrix`` observer makes the run calibrate, as ``--observer``
does, :mod:`ctconvert.stages.calibrate`). Every error is
a :class:`~ctconvert.errors.UsageError` naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..options import OBSERVER_NAMES
from .groups import ConfigGroup
from .schemes import get_scheme, read_document, scheme_from_dict

__all__ = ["Recipe", "read_recipe"]

#: QuantizationModifier arguments taken at these values (what a recipe saved by llm-compressor holds by default)
_DEFAULTS = {"bypass_divisibility_checks": (False,), "index": (None,), "group": None, "start": (None,), "end": (None,), "update": (None,)}
_DEFAULTS["requires_calibration_data"] = None  # derived by llm-compressor from the groups: any value (a calibrated group is refused)
_TAKEN = {"config_groups", "scheme", "targets", "ignore", "weight_observer", "observer", *_DEFAULTS}


@dataclass(frozen=True)
class Recipe:
    """What a recipe asks for: its config groups (in the order llm-compressor resolves them) and ``ignore``."""

    path: Path
    groups: tuple[ConfigGroup, ...]
    ignore: tuple[str, ...]

    @property
    def observers(self) -> dict[str, str]:
        """Config group -> its weight observer, where not min/max."""
        return {g.name: g.observer for g in self.groups if g.observer != "minmax"}


def read_recipe(path: str | Path) -> Recipe:
    """Read an llm-compressor recipe file (the forms of the module docstring). Raises :class:`UsageError`."""
    p = Path(path)
    args = _modifier_args(read_document(p, "the recipe"), p)
    unknown = sorted(set(args) - _TAKEN)
    if unknown:
        raise UsageError(f"QuantizationModifier argument {', '.join(unknown)} is not implemented by ctconvert (refused, not partly applied)", file=p)
    for key, allowed in _DEFAULTS.items():
        if allowed is not None and key in args and args[key] not in allowed:
            raise UsageError(f"QuantizationModifier {key}: {args[key]!r} is not implemented by ctconvert (only {allowed[0]!r})", file=p)
    observer = _override(args, p)
    groups = _groups(args, p, observer)
    ignore = args.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise UsageError("QuantizationModifier ignore must be a list of module names or re: patterns", file=p)
    return Recipe(p, tuple(groups), tuple(ignore))


def _modifier_args(doc, p: Path) -> dict:
    """The arguments of the recipe's one QuantizationModifier (``Recipe.from_dict``'s walk: ``*_stage`` -> ``*_modifiers`` -> class name)."""
    if not isinstance(doc, dict):
        raise UsageError("recipe must be a mapping of stages (quant_stage: quant_modifiers: QuantizationModifier: ...)", file=p)
    other = [k for k, v in doc.items() if not (str(k).endswith("_stage") and isinstance(v, dict))]
    if other:
        raise UsageError(
            f"recipe key {other[0]!r} is not a stage: llm-compressor reads only keys ending in _stage holding keys ending in _modifiers "
            "(quant_stage: quant_modifiers: QuantizationModifier: ...)",
            file=p,
        )
    found = []
    for stage, groups in doc.items():
        for key, mods in groups.items():
            if not (str(key).endswith("_modifiers") and isinstance(mods, dict)):
                raise UsageError(f"{stage}: key {key!r} is not a modifier group (a key ending in _modifiers holding modifiers by class name)", file=p)
            for name, margs in mods.items():
                if name != "QuantizationModifier":
                    raise UsageError(
                        f"{stage}.{key}: {name} is not implemented by ctconvert (it writes data-free QuantizationModifier recipes only); "
                        "run that recipe with llm-compressor's oneshot",
                        file=p,
                    )
                found.append(margs or {})
    if len(found) != 1:
        raise UsageError(f"recipe holds {len(found)} QuantizationModifier entries; ctconvert takes exactly one", file=p)
    if not isinstance(found[0], dict):
        raise UsageError("QuantizationModifier's arguments must be a mapping", file=p)
    return found[0]


def _override(args: dict, p: Path) -> str | None:
    """The modifier-wide weight observer (``weight_observer``, or ``observer: {weights: ...}``, which wins), or None."""
    obs = args.get("observer")
    if obs is not None:
        if not isinstance(obs, dict) or set(obs) - {"weights"}:
            raise UsageError(f"QuantizationModifier observer: {obs!r}: only a weights observer is implemented by ctconvert", file=p)
        return _observer_name(obs.get("weights"), p)
    return _observer_name(args.get("weight_observer"), p) if args.get("weight_observer") is not None else None


def _observer_name(name, p: Path) -> str:
    key = "minmax" if name in (None, "minmax", "memoryless_minmax") else str(name).lower()
    if key not in OBSERVER_NAMES:
        raise UsageError(f"weight observer {name!r} is not implemented by ctconvert; one of {', '.join(OBSERVER_NAMES)} (memoryless_minmax: minmax)", file=p)
    return key


def _targets(value, what: str, p: Path) -> tuple[str, ...]:
    value = [value] if isinstance(value, str) else value
    if not value or not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise UsageError(f"{what}: targets must be a non-empty list of module names, re: patterns or Linear", file=p)
    return tuple(value)


def _groups(args: dict, p: Path, observer: str | None) -> list[ConfigGroup]:
    """The config groups, in llm-compressor's resolution order (``resolve_quantization_config``)."""
    scheme, config_groups = args.get("scheme"), args.get("config_groups")
    if scheme is not None and config_groups is not None:
        raise UsageError("QuantizationModifier takes either scheme or config_groups, not both (llm-compressor refuses it too)", file=p)
    if scheme is None and not config_groups:
        raise UsageError("QuantizationModifier without scheme or config_groups quantizes nothing ctconvert can name", file=p)
    groups = []
    if scheme is not None:
        if isinstance(scheme, str):
            scheme = {scheme: args.get("targets", ["Linear"])}
        if not isinstance(scheme, dict):
            raise UsageError("QuantizationModifier scheme must be a preset name or a mapping preset -> targets", file=p)
        for i, (preset, targets) in enumerate(scheme.items()):
            try:
                s = get_scheme(str(preset))
            except UsageError as e:
                raise UsageError(f"scheme {preset!r}: {e.message}", file=p) from None
            groups.append(ConfigGroup(f"group_{i}", _data_free(s, f"scheme {preset}", p), _targets(targets, f"scheme {preset}", p), observer or "minmax"))
        return groups
    if "targets" in args and args["targets"] not in (["Linear"], "Linear"):
        raise UsageError("QuantizationModifier targets with config_groups: llm-compressor takes each group's own targets; drop it", file=p)
    if not isinstance(config_groups, dict):
        raise UsageError("QuantizationModifier config_groups must be a mapping name -> QuantizationScheme", file=p)
    for name, g in config_groups.items():
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise UsageError(f"config group {name}: needs weights (a QuantizationScheme mapping)", file=p)
        weights = {k: v for k, v in g["weights"].items() if v is not None and k not in ("observer", "observer_kwargs")}
        if g["weights"].get("observer_kwargs"):
            raise UsageError(f"config group {name}: observer_kwargs {g['weights']['observer_kwargs']!r} are not implemented by ctconvert", file=p)
        doc = {**{k: v for k, v in g.items() if v is not None and k != "targets"}, "weights": weights}
        if isinstance(doc.get("input_activations"), dict):
            doc["input_activations"] = {k: v for k, v in doc["input_activations"].items() if v is not None and v != {}}
        try:
            s = scheme_from_dict(doc, p)
        except UsageError as e:
            raise UsageError(f"config group {name}: {e.message}", file=p) from None
        obs = observer or _observer_name(g["weights"].get("observer"), p)
        groups.append(ConfigGroup(str(name), _data_free(s, f"config group {name}", p), _targets(g.get("targets"), f"config group {name}", p), obs))
    return groups


def _data_free(scheme, what: str, p: Path):
    if scheme.needs_calibration:
        raise UsageError(
            f"{what}: {scheme.name} needs calibrated activation scales, which a recipe run does not take yet (use --scheme {scheme.name} with calibration)",
            file=p,
        )
    return scheme
