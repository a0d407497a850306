"""The write stage's provenance, made on a thread once the source hashes are done (json_text.EncodeAhead): the same
files as one made after the run, and made again where the thread has none or its options are not the run's."""

from __future__ import annotations

import filecmp
import json

from ctconvert import api
from ctconvert.checkpoint.json_text import Encoded
from ctconvert.checkpoint.provenance import PROVENANCE
from ctconvert.checkpoint.reader import INDEX_NAME
from ctconvert.checkpoint.writer import PROVENANCE_KEY, config_digest
from ctconvert.stages import write

from conftest import moe_checkpoint


def _same_folders(a, b) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and PROVENANCE in names
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert mismatch == [] and errors == []


class _None(write.EncodeAhead):
    def result(self):
        super().result()
        return None


class _Stale(write.EncodeAhead):
    def result(self):
        got = super().result()
        return Encoded.of(dict(got.doc, options={"scheme": "an earlier run's"}))


def test_the_provenance_made_ahead_is_the_one_made_after(tmp_path, monkeypatch):
    src = moe_checkpoint(tmp_path, experts=4, inter=64)
    made = []
    real = write.EncodeAhead

    class Seen(real):
        def result(self):
            made.append(super().result())
            return made[-1]

    monkeypatch.setattr(write, "EncodeAhead", Seen)
    api.quantize(src, tmp_path / "ahead", "NVFP4A16", device="cpu")
    assert len(made) == 1 and made[0] is not None  # the thread's document was the one written
    prov = json.loads((tmp_path / "ahead" / PROVENANCE).read_text())
    assert prov == made[0].doc and len(prov["tensors"]) > 40
    index = json.loads((tmp_path / "ahead" / INDEX_NAME).read_text())
    assert index["metadata"][PROVENANCE_KEY] == config_digest(prov) == made[0].digest
    for cls, name in ((_None, "none"), (_Stale, "stale")):  # made after the run instead: the same bytes
        monkeypatch.setattr(write, "EncodeAhead", cls)
        api.quantize(src, tmp_path / name, "NVFP4A16", device="cpu")
        _same_folders(tmp_path / "ahead", tmp_path / name)
