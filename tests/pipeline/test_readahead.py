"""The page-cache read-ahead: the byte ranges of a plan in the executor's order, the window it keeps ahead of the
readers, and that it hints real files (posix_fadvise) and stops when closed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.pipeline.readahead import WindowReadAhead, unit_pieces
from ctconvert.plan.planner import make_plan

MiB = 2**20


def _pieces(sizes, path=Path("f.bin")):
    """Pieces of units: unit k has one piece per size in sizes[k], in ``path``, back to back."""
    out, pos = [], 0
    for ui, parts in enumerate(sizes):
        for n in parts:
            out.append((ui, path, pos, n))
            pos += n
    return out


def _file(tmp_path, nbytes):
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path


def _wait(cond, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_unit_pieces_cover_every_source_byte_once_in_plan_order(tiny_llama):
    ckpt = open_checkpoint(tiny_llama)
    plan = make_plan(ckpt, "NVFP4A16")
    pieces = unit_pieces(ckpt, plan.units, piece_bytes=4096)
    assert [p[0] for p in pieces] == sorted(p[0] for p in pieces)  # in unit order
    assert all(0 < n <= 4096 for *_, n in pieces)
    want = {}
    for unit in plan.units:
        for s in unit.sources:
            info = ckpt.tensors[s]
            want[(info.file, info.start)] = info.nbytes
    got = {}
    for _, f, off, n in pieces:  # pieces of one tensor are contiguous: rebuild each tensor's range
        key = next((k for k in got if k[0] == f and k[1] + got[k] == off), None)
        if key is not None and (f, off) not in want:
            got[key] += n
        else:
            got[(f, off)] = n
    assert got == want
    assert sum(n for *_, n in pieces) == sum(ckpt.tensors[s].nbytes for u in plan.units for s in u.sources)


def test_the_window_runs_from_the_readers_unit_or_to_its_end():
    ra = WindowReadAhead(_pieces([[4 * MiB], [16 * MiB, 16 * MiB], [], [8 * MiB]]), window=10 * MiB)
    assert ra.limit() == 10 * MiB  # nothing read yet: the window from the start
    ra.reached(0)
    assert ra.limit() == 10 * MiB
    ra.reached(1)  # unit 1 starts at 4 MiB and is larger than the window: to its end
    assert ra.limit() == 36 * MiB
    ra.reached(0)  # an earlier unit changes nothing
    assert ra.limit() == 36 * MiB
    ra.reached(2)  # no bytes: from where the next unit starts
    assert ra.limit() == 36 * MiB + 10 * MiB
    ra.reached(3)
    assert ra.limit() == 36 * MiB + 10 * MiB


def test_hints_stay_inside_the_window_until_the_readers_move(tmp_path):
    calls = []
    ra = WindowReadAhead(_pieces([[MiB]] * 10, _file(tmp_path, 10 * MiB)), window=3 * MiB, advise=lambda fd, off, n: calls.append((off, n))).start()
    try:
        assert _wait(lambda: ra.hinted == 3)
        time.sleep(0.2)
        assert ra.hinted == 3  # the fourth piece starts at the window's edge: not hinted
        ra.reached(5)
        assert _wait(lambda: ra.hinted == 8)
        ra.reached(9)
        assert _wait(lambda: ra.hinted == 10)
    finally:
        ra.close()
    assert calls == [(k * MiB, MiB) for k in range(10)]


def test_close_stops_a_waiting_hinter_and_twice_is_harmless(tmp_path):
    ra = WindowReadAhead(_pieces([[MiB]] * 4, _file(tmp_path, 4 * MiB)), window=MiB, advise=lambda fd, off, n: None).start()
    assert _wait(lambda: ra.hinted == 1)
    t0 = time.monotonic()
    ra.close()
    ra.close()
    assert time.monotonic() - t0 < 5 and ra.hinted == 1


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="no posix_fadvise")
def test_real_hints_on_checkpoint_files(tiny_llama):
    ckpt = open_checkpoint(tiny_llama)
    plan = make_plan(ckpt, "W4A16")
    pieces = unit_pieces(ckpt, plan.units)
    ra = WindowReadAhead(pieces, window=1 << 40).start()
    try:
        assert _wait(lambda: ra.hinted == len(pieces) > 0)
    finally:
        ra.close()
