"""What vLLM 0.33 builds, judged from a checkpoint's headers: the checks ``verify`` runs without a reference, from here.

:func:`loadability_problems` is the one list: the config values vLLM refuses when it parses the config
(:func:`.config_types.parse_problems`: a string ``rms_norm_eps``, a ``layer_types`` of another length than the
layers; alone where there are any, since vLLM then builds nothing from the config and the checks below would read
values of another type), the decoder layer count (:func:`.depth.count_problems`), the widths
(:func:`.widths.width_problems`), the sizes of the small parameters (:func:`.param_shapes.param_shape_problems`), the
tensors each layer stores (:func:`.expected.expected_problems`) and the attention projections' rows
(:func:`.files_check.attention_shape_problems`; DeepSeek's MLA projections: :func:`.mla_shapes.mla_shape_problems`), each
judged as the class vLLM builds from ``architectures`` (:func:`.architectures.mismatch_problems` warns where
``model_type`` names another). ``inspect`` shows them as warnings, and ``quantize`` warns of them in a source (its
output carries them, and ``verify`` fails it; another tool's checkpoint: its dense view); ``verify`` runs the same two
parts (:func:`header_problems`, :func:`architecture_problems`), so the three commands cannot drift apart. Only a tied
head's bytes are read (:func:`.widths.tied_head_problems`), not the weights.
"""

from __future__ import annotations

from pathlib import Path

from .architectures import mismatch_problems
from .config_types import PARSE_CHECK, parse_problems
from .depth import count_problems
from .expected import expected_problems
from .files_check import attention_shape_problems
from .mla_shapes import mla_shape_problems
from .modules import Module
from .param_shapes import param_shape_problems
from .reader import CONFIG_NAME, Checkpoint, Problem
from .widths import width_problems

__all__ = ["PARSE_CHECK", "architecture_problems", "header_problems", "loadability_problems"]


def header_problems(ckpt: Checkpoint, mods: dict[str, Module], folder: str | Path) -> list[Problem]:
    """The config values vLLM refuses when it parses the config (alone where there are any), else the decoder layer
    count, the widths and the sizes of the small parameters against ``config.json`` (any checkpoint: a kernel-native one
    with ``mods`` {}); ``folder``: the path a config problem names. ``verify`` runs them first, whatever else it finds."""
    config, tensors = ckpt.config, ckpt.tensors
    if refused := parse_problems(config, str(folder)):
        return refused
    found = count_problems(config, tensors, str(folder)) + width_problems(config, tensors, mods, str(folder))
    return found + param_shape_problems(config, tensors, mods)


def architecture_problems(ckpt: Checkpoint, mods: dict[str, Module], expected: bool = True) -> list[Problem]:
    """A warning where ``config.json``'s ``architectures`` and ``model_type`` name different families
    (:func:`.architectures.mismatch_problems`: vLLM builds the class ``architectures`` names, and the checks judge by
    it), the attention projections' rows (MLA's sizes) against ``config.json`` and, with ``expected``, the tensors each
    layer stores against what the family's vLLM 0.33 class builds (its notes included: the families it does not judge);
    none where vLLM refuses the config when it parses it (:func:`header_problems` says why)."""
    if parse_problems(ckpt.config, ckpt.path):
        return []
    found = mismatch_problems(ckpt.config, str(ckpt.path / CONFIG_NAME)) + attention_shape_problems(mods, ckpt.config, ckpt.tensors)
    found += mla_shape_problems(mods, ckpt.config, ckpt.tensors)
    return found + (expected_problems(ckpt, mods) if expected else [])


def loadability_problems(ckpt: Checkpoint, mods: dict[str, Module], folder: str | Path) -> list[Problem]:
    """The errors (and their notes) the checks of the module docstring find in ``ckpt`` (its modules ``mods``:
    :func:`.modules.modules_of`, or {} for a kernel-native checkpoint, which leaves the count, widths and sizes;
    ``folder``: the path a config problem names): :func:`header_problems`, then :func:`architecture_problems`; [] where
    a shard could not be read (``ckpt.problems`` holds an error: its own message says why, and every check would follow
    from it). The notes of families not judged are left out."""
    if any(p.severity == "error" for p in ckpt.problems) or not isinstance(ckpt.config, dict):
        return []
    return header_problems(ckpt, mods, folder) + [p for p in architecture_problems(ckpt, mods) if p.severity != "note"]
