"""dumps_indented: json.dumps(obj, indent=N[, sort_keys]) character for character, on random documents of every JSON
value (strings with quotes, control characters and non-ASCII; huge, tiny, negative-zero and non-finite floats; big
ints; bools; None; empty containers; deep nesting; tuples) and on what it leaves to json (non-string keys, other
objects, circular references)."""

from __future__ import annotations

import json
import random

import pytest

from ctconvert.checkpoint.json_text import dumps_indented

_STRINGS = ["", "a", 'q"uote', "back\\slash", "tab\tnew\nline\r", "\x00\x1f\x7f", "é ü 漢字 🙂", "a,b: {c} [d]", "\ud800"]
_FLOATS = [0.0, -0.0, 1.5, -2.25e-308, 5e-324, 1.7976931348623157e308, 1e16, 0.1, float("nan"), float("inf"), -float("inf")]


def _value(rng: random.Random, depth: int):
    kind = rng.randrange(9 if depth < 5 else 6)
    if kind == 0:
        return rng.choice(_STRINGS) + str(rng.randrange(100))
    if kind == 1:
        return rng.choice(_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6)
    if kind == 2:
        return rng.choice([0, -1, 2**70, -(2**64), rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return {}
    if kind == 5:
        return rng.choice([[], ()])
    if kind in (6, 7):
        return {rng.choice(_STRINGS) + str(i): _value(rng, depth + 1) for i in range(rng.randrange(1, 6))}
    return (list if rng.random() < 0.7 else tuple)(_value(rng, depth + 1) for _ in range(rng.randrange(1, 6)))


@pytest.mark.parametrize("seed", range(40))
def test_the_same_text_as_json_dumps(seed):
    rng = random.Random(seed)
    doc = {"tensors": {f"model.layers.{i}.w": [{"file": "a.safetensors", "xxh3_128": f"{rng.getrandbits(128):032x}"}] for i in range(20)}}
    doc["other"] = _value(rng, 0)
    for indent in (0, 1, 2, 4):
        for sort_keys in (False, True):
            assert dumps_indented(doc, indent, sort_keys=sort_keys) == json.dumps(doc, indent=indent, sort_keys=sort_keys)
    top = _value(rng, 0)  # any value at the top, scalars too
    assert dumps_indented(top, 2) == json.dumps(top, indent=2)


def test_what_it_leaves_to_json_comes_out_as_json_writes_it_or_raises_as_json_does():
    for doc in ({1: "a", "b": 2}, {"x": {None: 1, True: 2, 2.5: 3}}, {"deep": [[[[[[[[[[1]]]]]]]]]] * 10}):
        assert dumps_indented(doc) == json.dumps(doc, indent=2)
    deep: list = []
    for _ in range(100):  # deeper than its own levels
        deep = [deep]
    assert dumps_indented(deep) == json.dumps(deep, indent=2)
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps_indented({"a": {1, 2}})
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="Circular reference"):
        dumps_indented(loop)
    with pytest.raises(TypeError):
        dumps_indented({"a": 1, 2: 3}, sort_keys=True)  # json cannot order mixed keys either


def test_encoded_ahead_holds_the_text_and_canonical_digest_or_none_where_making_it_raised():
    import hashlib

    from ctconvert.checkpoint.json_text import EncodeAhead, Encoded, canonical_digest

    rng = random.Random(7)
    doc = {"b": _value(rng, 0), "a": [1.5, "é", None, {"z": float("inf")}]}
    enc = EncodeAhead(lambda: doc).result()
    assert enc == Encoded.of(doc) and enc.doc is doc and enc.text == json.dumps(doc, indent=2)
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert enc.digest == canonical_digest(doc) == hashlib.sha256(canon).hexdigest()
    assert canonical_digest({"a": 1, "b": 2}) == canonical_digest({"b": 2, "a": 1}) != canonical_digest({"a": 1, "b": 3})

    def fails():
        raise OSError("a source read failed")

    assert EncodeAhead(fails).result() is None
    assert EncodeAhead(lambda: {"x": {1, 2}}).result() is None  # what json refuses: made again by the caller, who meets it
