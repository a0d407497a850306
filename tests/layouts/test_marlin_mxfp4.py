"""MXFP4 Marlin (docs/kernel-layouts.md §5.3; ctconvert.layouts.marlin_mxfp4).

``../shared/testvectors`` holds no MXFP4 case (its README lists none). So:

* the weight, which vLLM repacks exactly as for NVFP4 (same ``prepare_fp4_layer_for_marlin``; the
  padding is the same for groups 16 and 32 since both divide lcm(64, 128)), is checked against the
  ``expected.marlin_q_w`` of every NVFP4 Marlin vector case whose K is a multiple of 32;
* the scales are checked against an independent reference written here from vLLM's documented steps,
  in vLLM's own order (§5.3, §4, §3.4): zero-pad the uint8 ``(N, K/32)`` bytes to the padded shape,
  transpose, view as ``float8_e8m0fnu``, cast to the activation dtype, gather each run of 64 with
  ``scale_perm = [i + 8j for i in 0..7 for j in 0..7]``, swap the middle pair of every 4, cast back to
  ``float8_e8m0fnu``. The padded sizes are computed here from §3.4's two candidates.
"""

from __future__ import annotations

import math

import pytest
import torch

from ctconvert.layouts.marlin_mxfp4 import marlin_mxfp4_lost_scales, marlin_mxfp4_repack, marlin_mxfp4_unrepack
from ctconvert.layouts.marlin_nvfp4 import marlin_nvfp4_repack

from helpers import DEVICES, VECTORS, bitwise_equal, stable_seed, vector_cases

NVFP4_FILE = "marlin_nvfp4.safetensors"
NVFP4_CASES = [c for c in vector_cases(NVFP4_FILE) if c[1]["K"] % 32 == 0]
needs_nvfp4 = pytest.mark.skipif(not (VECTORS / NVFP4_FILE).is_file(), reason=f"{NVFP4_FILE} not found")
ACTS = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHAPES = [(64, 128), (96, 256), (200, 64), (128, 96), (64, 416), (320, 32)]


def _padded(n: int, k: int, g: int = 32) -> tuple[int, int]:
    """§3.4: the smaller (by Np*Kp, then Np+Kp) of (roundup(N, 64), roundup(K, lcm(128, g))) and
    (roundup(N, 128), roundup(K, lcm(64, g)))."""

    def up(x, m):
        return -(-x // m) * m

    a = (up(n, 64), up(k, math.lcm(128, g)))
    b = (up(n, 128), up(k, math.lcm(64, g)))
    return min(a, b, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def _vllm_scales(ws: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """The independent reference of the module docstring: uint8 (N, K/32) -> e8m0 (Kp/32, Np)."""
    n, g = ws.shape
    pn, pk = _padded(n, g * 32)
    padded = torch.zeros(pn, pk // 32, dtype=torch.uint8, device=ws.device)
    padded[:n, :g] = ws
    s = padded.t().contiguous().view(torch.float8_e8m0fnu).to(act)
    perm = [i + 8 * j for i in range(8) for j in range(8)]
    s = s.reshape(-1, 64)[:, perm].reshape(pk // 32, pn)
    s = s.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(pk // 32, pn)
    return s.to(torch.float8_e8m0fnu)


def _random_module(n: int, k: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    wp = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    ws = torch.randint(0, 256, (n, k // 32), dtype=torch.uint8, generator=g)  # every byte, NaN (0xFF) included
    ws[0, :2] = 0  # zero-absmax groups of a bf16 model
    return wp.to(device), ws.to(device)


@needs_nvfp4
def test_some_nvfp4_case_has_k_multiple_of_32():
    assert NVFP4_CASES  # whatever cases the file holds, some must serve here


@needs_nvfp4
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx", range(len(NVFP4_CASES)))
def test_weight_equals_vllm_nvfp4_vectors(idx, device):
    i, p, ins, exp = NVFP4_CASES[idx]
    n, k = p["N"], p["K"]
    assert _padded(n, k, 32) == _padded(n, k, 16) == (p["padded_N"], p["padded_K"])
    wp = ins["weight_packed"].to(device)
    ws = torch.full((n, k // 32), 120, dtype=torch.uint8, device=device)
    got = marlin_mxfp4_repack(wp, ws, p["act_dtype"])
    assert got["marlin_q_w"].device.type == device
    assert bitwise_equal(got["marlin_q_w"], exp["marlin_q_w"]), (i, p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["bfloat16", "float16"])
@pytest.mark.parametrize("nk", SHAPES)
def test_scales_equal_the_reference_and_round_trip(nk, act, device):
    n, k = nk
    wp, ws = _random_module(n, k, stable_seed("mxfp4-marlin", n, k, act), device)
    got = marlin_mxfp4_repack(wp, ws, act)
    pn, pk = _padded(n, k)
    assert got["marlin_q_w"].shape == (pk // 16, 2 * pn) and got["marlin_scales"].shape == (pk // 32, pn)
    assert got["marlin_scales"].dtype == torch.float8_e8m0fnu
    assert bitwise_equal(got["marlin_scales"], _vllm_scales(ws, ACTS[act]))
    # the weight is the NVFP4 repack's (vector-checked) on the same bytes
    nv = marlin_nvfp4_repack(wp, torch.zeros(n, k // 16, dtype=torch.uint8, device=device), torch.ones(1, device=device), act)
    assert bitwise_equal(got["marlin_q_w"], nv["marlin_q_w"])
    back = marlin_mxfp4_unrepack(got, n, k)
    assert bitwise_equal(back["weight_packed"], wp)
    # what survives: every byte with bf16; with fp16 the bytes whose 2^(b - 127) is an fp16 value (0, 103..142, 255)
    b = ws.cpu().int()
    want_lost = torch.zeros_like(b, dtype=torch.bool) if act == "bfloat16" else ((b >= 1) & (b <= 102)) | ((b >= 143) & (b <= 254))
    lost = marlin_mxfp4_lost_scales(ws, act).cpu()
    assert torch.equal(lost, want_lost)
    same = back["weight_scale"].cpu() == ws.cpu()
    assert torch.equal(same, ~want_lost)
    if act == "bfloat16":
        assert bitwise_equal(back["weight_scale"], ws)
    # forward(inverse(kernel)) == kernel, lossy or not
    again = marlin_mxfp4_repack(back["weight_packed"], back["weight_scale"], act)
    assert bitwise_equal(again["marlin_q_w"], got["marlin_q_w"]) and bitwise_equal(again["marlin_scales"], got["marlin_scales"])


def test_old_layout_without_padding():
    wp, ws = _random_module(64, 128, 3, "cpu")
    got = marlin_mxfp4_repack(wp, ws, "bfloat16", layout_version="0.21")
    assert got["marlin_scales"].shape == (4, 64)
    assert bitwise_equal(marlin_mxfp4_unrepack(got, 64, 128, layout_version="0.21")["weight_scale"], ws)
    with pytest.raises(ValueError, match="no Marlin tile padding"):
        marlin_mxfp4_repack(*_random_module(96, 128, 3, "cpu"), "bfloat16", layout_version="0.21")


def test_errors():
    wp, ws = _random_module(64, 128, 1, "cpu")
    with pytest.raises(ValueError, match="K % 32"):
        marlin_mxfp4_repack(wp[:, :56], ws, "bfloat16")
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        marlin_mxfp4_repack(wp, ws[:, :3], "bfloat16")
    with pytest.raises(TypeError, match="E8M0 bytes"):
        marlin_mxfp4_repack(wp, ws.float(), "bfloat16")
    with pytest.raises(ValueError, match="act_dtype"):
        marlin_mxfp4_repack(wp, ws, "float32")
    with pytest.raises(ValueError, match="multiple of 32"):
        marlin_mxfp4_unrepack(marlin_mxfp4_repack(wp, ws, "bfloat16"), 64, 112)
