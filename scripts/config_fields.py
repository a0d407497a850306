#!/usr/bin/env python3
"""Write ``ctconvert/checkpoint/transformers_520_fields.txt``: the config.json keys transformers 5.20's strict config
classes check the type of, for each family ``ctconvert verify`` judges (:mod:`ctconvert.checkpoint.config_types`).

Run with the interpreter of a venv holding transformers 5.20.2 (what vLLM 0.33 parses config.json with; the project's
own transformers may be another version, and ctconvert never imports transformers for this at run time):

    /work/venvs/vllm/bin/python scripts/config_fields.py [--check] [--out ctconvert/checkpoint/transformers_520_fields.txt]

For each class of :data:`FAMILIES` (``transformers.CONFIG_MAPPING[model_type]``) it reads the dataclass fields
(``dataclasses.fields``, those inherited from ``configuration_utils.py`` ``PreTrainedConfig`` included) and keeps
those whose annotation is one the checker judges exactly (:data:`CODES`). huggingface_hub 2.4's ``@strict``
(``dataclasses.py`` ``type_validator``) checks a field's value against its annotation as ``__init__`` sets it; an
annotation that is a string (``PreTrainedConfig``'s own fields: ``configuration_utils.py`` has ``from __future__
import annotations``, so ``transformers_version``, ``dtype``, ``architectures``, ``is_encoder_decoder`` ... are
strings) is skipped by ``type_validator``, so such a key is not written. Nor are ``layer_types`` (judged by
``config_types.layer_types_problems``) and the annotations the table has no code for (dicts such as
``rope_parameters``, ``Literal``, ``int | str``): they are printed on stderr.

``--check`` confirms every written key by building the class: a value of each wrong kind the code refuses
(``"1"``, ``1.0``, ``true``, ``0``, ``null`` where not Optional ...) must raise ``StrictDataclassFieldValidationError``
for that field, and a value of the right kind must not.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

#: the model_types ctconvert judges (their classes, transformers 5.20's ``CONFIG_MAPPING``); a composite's text class
#: by its own model_type (``config_types._TEXT_CLASS``)
FAMILIES = (
    "llama mistral phi3 qwen2 qwen3 gemma2 gemma3_text gemma4_text qwen2_vl_text qwen2_5_vl_text qwen3_vl_text mixtral minimax "
    "minimax_m2 phimoe granitemoe jamba qwen2_moe qwen3_moe qwen3_vl_moe_text qwen3_next qwen3_5_moe_text olmoe flex_olmo "
    "hunyuan_v1_moe ernie4_5_moe gpt_oss llama4_text deepseek_v2 deepseek_v3 dots1 glm4_moe glm4v_moe_text glm4_moe_lite"
).split()
#: a composite whose flat config.json keys go to its text class (``Qwen2VLConfig.__post_init__``): the keys the outer
#: class declares stay with it, so the text class must not declare them for the flat level to be judged as the text class
FLAT = {"qwen2_vl_text": "qwen2_vl", "qwen2_5_vl_text": "qwen2_5_vl"}
#: annotation (as ``str()`` writes it) -> the table's code (``?``: ``| None``)
CODES = {
    "int": "i",
    "float": "f",
    "bool": "b",
    "str": "s",
    "list[int]": "I",
    "list[str]": "S",
    "float | int": "n",
    "int | float": "n",
    "int | list[int]": "t",
}
#: judged elsewhere
SKIP = {"layer_types"}
#: PreTrainedConfig's own fields (string annotations, not checked), left out of the listing of what is not judged
BASE_FIELDS = {"transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "chunk_size_feed_forward"}
BASE_FIELDS |= {"is_encoder_decoder", "id2label", "label2id", "problem_type"}
#: per code: values of another kind (refused) and one of its kind (taken)
WRONG = {"i": ["1", 1.0, True], "f": [1, "1.0", True], "b": [0, "true"], "s": [5, True], "I": [["1"], [True], 1], "S": [[1], "a"]}
WRONG |= {"n": ["1", True, [1]], "t": ["1", True, [1.0], ["1"]]}
RIGHT = {"i": 3, "f": 0.5, "b": True, "s": "silu", "I": [1], "S": ["full_attention"], "n": 0.0, "t": [1, 2]}


def code(annotation) -> str | None:
    """The table's code for a field annotation, None where it is not judged."""
    if isinstance(annotation, str):
        return None  # type_validator skips a string annotation
    text = str(annotation).replace("<class '", "").replace("'>", "")
    optional = text.endswith(" | None")
    base = CODES.get(text.removesuffix(" | None"))
    return None if base is None else base + ("?" if optional else "")


def fields_of(cls) -> tuple[dict[str, str], dict[str, str]]:
    """``(judged key -> code, skipped key -> annotation)`` of a config class."""
    judged, skipped = {}, {}
    for f in dataclasses.fields(cls):
        c = code(f.type)
        if c is None or f.name in SKIP:
            skipped[f.name] = f.type if isinstance(f.type, str) else str(f.type)
        else:
            judged[f.name] = c
    return judged, skipped


def check(cls, key: str, c: str) -> list[str]:
    """What the class does against the code's rule for ``key``: an empty list where it agrees."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError as Refused

    def refuses(value) -> bool:
        try:
            cls(**{key: value})
        except Refused as e:
            return key in str(e)
        except Exception:  # noqa: BLE001 - a class validator or __post_init__ failing on a value it took
            return False
        return False

    base = c.rstrip("?")
    out = [f"{cls.__name__}.{key}: {v!r} taken" for v in WRONG[base] if not refuses(v)]
    out += [f"{cls.__name__}.{key}: {v!r} refused" for v in [RIGHT[base]] + ([None] if c.endswith("?") else []) if refuses(v)]
    if not c.endswith("?") and not refuses(None):
        out.append(f"{cls.__name__}.{key}: None taken")
    return out


def main() -> int:
    import transformers
    from transformers import CONFIG_MAPPING

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "ctconvert/checkpoint/transformers_520_fields.txt"))
    ap.add_argument("--check", action="store_true", help="build each class with wrong and right values of every written key")
    args = ap.parse_args()
    if not transformers.__version__.startswith("5.20."):
        print(f"transformers {transformers.__version__}: the table is 5.20's (what vLLM 0.33 runs)", file=sys.stderr)
        return 2
    lines = [
        f"# transformers {transformers.__version__}: the config.json keys each strict config class checks the type of, as",
        "# model_type class key:code ... (codes: ctconvert/checkpoint/config_types.py _WORDS; ? admits null).",
        "# Written by scripts/config_fields.py; do not edit by hand.",
    ]
    problems = []
    for family in FAMILIES:
        cls = CONFIG_MAPPING[family]
        judged, skipped = fields_of(cls)
        if family in FLAT:
            outer = {f.name for f in dataclasses.fields(CONFIG_MAPPING[FLAT[family]]) if not isinstance(f.type, str)}
            problems += [f"{family}: {k} is its composite's own field too" for k in sorted(outer & set(judged))]
        lines.append(" ".join([family, cls.__name__, *(f"{k}:{c}" for k, c in judged.items())]))
        shown = {k: t for k, t in skipped.items() if k not in BASE_FIELDS}
        print(f"{family} {cls.__name__}: {len(judged)} judged; not judged (beside PreTrainedConfig's own): {shown}", file=sys.stderr)
        if args.check:
            for key, c in judged.items():
                problems += check(cls, key, c)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(problems) or "every key agrees with its class", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
