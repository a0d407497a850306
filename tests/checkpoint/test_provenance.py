"""The provenance document's format (checkpoint/provenance.py): format 3 promises an index that lists its records; an
output of format 2 (release 0.1.0: the same block hashes, no records) still refreshes."""

from __future__ import annotations

import json

import pytest

from ctconvert import api
from ctconvert.checkpoint.provenance import PROVENANCE_FORMAT, RECORDS_SINCE_FORMAT


@pytest.mark.parametrize("earlier", [2, 3, 4])
def test_an_earlier_block_hash_provenance_still_refreshes_and_becomes_the_current_format(tiny_llama, tmp_path, earlier):
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    p = out / "ctconvert-provenance.json"
    prov = json.loads(p.read_text())
    assert prov["provenance_format"] == PROVENANCE_FORMAT == RECORDS_SINCE_FORMAT + 2 == 5
    # 2: release 0.1.0's, 3: before the file hashes, 4: before the index's digest; the same block hashes
    p.write_text(json.dumps(dict(prov, provenance_format=earlier)))
    res = api.quantize(tiny_llama, out, "W4A16", refresh=True)
    assert res.reused_shards == res.shards and not res.rewritten_shards  # its hashes compared: nothing changed
    assert json.loads(p.read_text())["provenance_format"] == PROVENANCE_FORMAT
    assert api.verify(out)["ok"]
