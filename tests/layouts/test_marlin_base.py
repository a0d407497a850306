"""Marlin's shared shape rules and index helpers (ctconvert.layouts.marlin_base)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.layouts import marlin, marlin_base
from ctconvert.layouts.marlin_base import check_bits, gather_last, inverse, marlin_padded_nk, pack_words, pad2, scale_dims, unpack_words, unpad2


@pytest.mark.parametrize("bits", [4, 8])
def test_words_unpack_and_pack_are_inverses(bits):
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=g)
    values = unpack_words(words, bits)
    assert values.shape == (3, 5, 32 // bits) and values.dtype == torch.uint8 and int(values.max()) < 2**bits
    assert torch.equal(pack_words(values, bits), words)


def test_pad_and_unpad_are_inverses_and_padding_must_be_zero():
    x = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    p = pad2(x, 4, 5)
    assert p.shape == (4, 5) and torch.equal(p[:2, :3], x) and not p[2:].any() and not p[:, 3:].any()
    assert torch.equal(unpad2(p, 2, 3, True, "x"), x)
    p[3, 4] = 1
    with pytest.raises(ValueError, match="padding region"):
        unpad2(p, 2, 3, True, "x")


def test_gather_and_inverse():
    perm = torch.tensor([2, 0, 3, 1])
    x = torch.arange(8).reshape(2, 4)
    assert torch.equal(gather_last(gather_last(x, perm), inverse(perm)).reshape(2, 4), x)


def test_shape_rules():
    assert check_bits(4) == 8 and check_bits(8) == 4
    with pytest.raises(ValueError, match="num_bits"):
        check_bits(3)
    assert marlin_padded_nk(4096, 4096, 128) == (4096, 4096)
    assert marlin_padded_nk(100, 200, -1) == (128, 256)
    with pytest.raises(ValueError, match="no Marlin tile padding"):
        marlin_padded_nk(100, 200, -1, "0.21")
    assert scale_dims(256, 128, 128, "0.33") == (2, 128, 256, 2)


def test_marlin_keeps_its_public_names():
    assert marlin.marlin_padded_nk is marlin_base.marlin_padded_nk and marlin.scale_dims is marlin_base.scale_dims
