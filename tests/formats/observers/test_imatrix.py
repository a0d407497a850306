"""The imatrix observers (ctconvert/formats/observers/imatrix.py) against llm-compressor 0.14.0.1 and a written-out reference.

``tests/data/observers/llmc_imatrix.safetensors`` (``scripts/llmc_imatrix_reference.py``, llm-compressor's own ``oneshot``
in a separate venv) holds each Linear's importance as llm-compressor's observer held it and the compressed tensors it
wrote: fed the same statistic, the search gives those tensors' ranges bit for bit. The property tests compare the
search with ``_grid_search`` written out here (fp32 error, importance per element, one more step than memoryless_mse,
patience only when > 0) on awkward weights and awkward importances (zero channels, one channel, ties), fixed seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ctconvert.formats import WeightArgs, get_format
from ctconvert.formats.observers import OBSERVERS, IMatrixMSEObserver, Importance, TensorSearch, get_observer, grouped

from ..test_observers import (
    FP8_CHANNEL,
    NVFP4,
    W4,
    W4_ASYM,
    W8_CHANNEL,
    awkward_weights,
    bits_of,
    quantize_module_set,
    straight_fake_quant,
    straight_loop,
    straight_unshrunk,
)

REF = Path(__file__).resolve().parents[2] / "data" / "observers" / "llmc_imatrix.safetensors"


def _straight_imatrix(w: torch.Tensor, args: WeightArgs, obs, imp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's ``_grid_search`` written out: ``imp`` fp32 ``[K]`` (normalised) or None."""
    d = w.dtype
    x = grouped(w, args).to(torch.float32)
    mn0, mx0 = straight_unshrunk(x, obs, d)
    weights = None if imp is None else imp.reshape(x.shape[1:])

    def error(smn, smx):
        e = torch.pow((straight_fake_quant(x, smn, smx, args, d) - x).abs(), obs.norm)
        return (e if weights is None else e * weights).sum(-1)

    best = torch.full(mn0.shape, torch.finfo(torch.float32).max)
    steps = max(1, int(obs.maxshrink * obs.grid)) + 1
    return straight_loop(mn0, mx0, obs, d, steps, error, best, lambda stale: obs.patience > 0 and stale >= obs.patience)


def _normalised(s: torch.Tensor, count: int) -> torch.Tensor:
    imp = s / float(count)
    return imp / (imp.mean() + torch.finfo(torch.float32).tiny)


def _importance(k: int, seed: int, kind: str) -> torch.Tensor:
    """An importance sum over 7 tokens of ``k`` channels: heavy-tailed, with zero channels, one channel only, or ties."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(k, generator=g) ** 4 * 7
    if kind == "zeros":
        s[::3] = 0
    elif kind == "one":
        s = torch.zeros(k)
        s[5] = 2.5
    elif kind == "ties":
        s = torch.full((k,), 3.0)
    return s


@pytest.mark.parametrize(
    "name,args,dtype,seed,kind",
    [
        ("imatrix_mse", W4, torch.bfloat16, 1, "zeros"),
        ("imatrix_mse", W4, torch.float16, 2, "one"),
        ("imatrix_mse", W4_ASYM, torch.bfloat16, 3, "zeros"),
        ("imatrix_mse", W4_ASYM, torch.float16, 4, "ties"),
        ("imatrix_mse", W8_CHANNEL, torch.bfloat16, 5, "zeros"),
        ("imatrix_mse", FP8_CHANNEL, torch.bfloat16, 6, "one"),
        ("imatrix_mse", FP8_CHANNEL, torch.float32, 7, "zeros"),
        ("imatrix_mse", NVFP4, torch.bfloat16, 8, "zeros"),
        ("imatrix_mse", W4, torch.float32, 9, "zeros"),
        ("nvfp4_expanded_imatrix", NVFP4, torch.bfloat16, 10, "zeros"),
        ("nvfp4_expanded_imatrix", NVFP4, torch.float16, 11, "one"),
        ("nvfp4_expanded_imatrix", NVFP4, torch.float32, 12, "ties"),
    ],
)
def test_search_equals_straight_reference(name, args, dtype, seed, kind):
    obs = OBSERVERS[name]
    w = awkward_weights(24, 256, dtype, seed)
    s = _importance(256, seed, kind)
    mn, mx = obs.with_importance(Importance(s, 7)).ranges(w, args)
    rmn, rmx = _straight_imatrix(w, args, obs, _normalised(s, 7))
    assert mn.dtype == dtype and mn.shape == rmn.shape
    assert torch.equal(mn, rmn) and torch.equal(mx, rmx)
    umn, umx = obs.ranges(w, args)  # no data: llm-compressor's uniform fallback, the same search unweighted
    rumn, rumx = _straight_imatrix(w, args, obs, None)
    assert torch.equal(umn, rumn) and torch.equal(umx, rumx)


def test_the_importance_changes_the_ranges():
    """A channel of zero importance does not count: the imatrix ranges differ from the unweighted ones, and from
    memoryless_mse's (other steps, another norm)."""
    w = awkward_weights(64, 256, torch.bfloat16, 21)
    obs = OBSERVERS["imatrix_mse"]
    weighted = obs.with_importance(Importance(_importance(256, 21, "zeros"), 7)).ranges(w, W4)[1]
    assert not torch.equal(weighted, obs.ranges(w, W4)[1])
    assert not torch.equal(obs.ranges(w, W4)[1], OBSERVERS["memoryless_mse"].ranges(w, W4)[1])


def test_defaults_and_steps():
    """llm-compressor 0.14.0.1 ``observers/imatrix.py`` defaults; the step count is ``max(1, int(maxshrink * grid)) + 1``."""
    a, b = OBSERVERS["imatrix_mse"], OBSERVERS["nvfp4_expanded_imatrix"]
    assert (a.maxshrink, a.patience, a.grid, a.norm, a.expand) == (0.95, 5, 20, 3.0, 1.0)
    assert (b.maxshrink, b.patience, b.grid, b.norm, b.expand) == (1 - 0.8 / 1.8, 1000, 200, 2.4, 1.8)
    assert (a.total_steps, b.total_steps) == (20, 112)
    assert a.needs_stop_pass and not b.needs_stop_pass and a.needs_data and not OBSERVERS["memoryless_mse"].needs_data
    assert a.config_fields() == {"observer": "imatrix_mse", "observer_kwargs": {}}
    never = IMatrixMSEObserver("x", maxshrink=0.95, patience=0, grid=20, norm=3.0)
    assert not never.needs_stop_pass and never.search(awkward_weights(8, 128, torch.bfloat16, 3), W4).improved.numel() == 20


def test_importance_statistic():
    """``add``: fp32 sum of x^2 per channel over every token (against a float64 sum) and the token count; ``add_samples``
    adds each sample of a batch in order, as separate batch-1 calls do."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=g) * 4).to(torch.bfloat16)
    one = Importance()
    one.add(x)
    assert one.count == 15 and one.sum.dtype == torch.float32
    torch.testing.assert_close(one.sum.double(), x.double().pow(2).sum((0, 1)), rtol=1e-6, atol=0)
    per, calls = Importance(), Importance()
    per.add_samples(x)
    for b in range(3):
        calls.add(x[b : b + 1])
    assert per.count == calls.count == 15 and torch.equal(per.sum, calls.sum)
    flat = Importance()
    flat.add_samples(x[0])  # 2-D (routed expert tokens): one call
    assert flat.count == 5


@pytest.mark.parametrize(
    "sum_,count,args,k,why",
    [
        (None, 0, W4, 256, "no importance data available"),
        (torch.ones(256), 0, W4, 256, "no importance data available"),
        (torch.full((256,), float("nan")), 3, W4, 256, "contains non-finite values"),
        (torch.full((256,), float("inf")), 3, W4, 256, "contains non-finite values"),
        (-torch.ones(256), 3, W4, 256, "contains negative values"),
        (torch.zeros(256), 3, W4, 256, "all zeros"),
        (torch.ones(128), 3, W4, 256, "size mismatch: expected 256, got 128"),
        (torch.ones(256), 3, WeightArgs(type="float", num_bits=8, strategy="tensor"), 256, "TENSOR strategy not supported"),
    ],
)
def test_importance_fallbacks(sum_, count, args, k, why):
    """What llm-compressor's ``_get_validated_importance`` refuses (uniform MSE): the reason, no weights."""
    assert Importance(sum_, count).weights(args, k) == (None, why)


def test_importance_normalised():
    s = torch.tensor([0.0, 1.0, 3.0, 12.0])
    imp, why = Importance(s, 4).weights(W8_CHANNEL, 4)
    assert why is None and imp.dtype == torch.float32
    assert torch.equal(imp, torch.tensor([0.0, 0.25, 0.75, 3.0]) / (torch.tensor(1.0) + torch.finfo(torch.float32).tiny))


@pytest.mark.parametrize("name,args", [("imatrix_mse", W4), ("imatrix_mse", W4_ASYM), ("nvfp4_expanded_imatrix", NVFP4)])
def test_row_chunks_equal_the_whole_tensor(name, args):
    """Global patience over row chunks (:class:`TensorSearch`) gives the whole tensor's ranges."""
    w = awkward_weights(40, 256, torch.bfloat16, 31)
    obs = OBSERVERS[name].with_importance(Importance(_importance(256, 31, "zeros"), 7))
    whole = obs.ranges(w, args)
    ts = TensorSearch(obs, args)
    for r in range(0, 40, 8):
        ts.add(r, w[r : r + 8])
    got = [ts.ranges(r, w[r : r + 8]) for r in range(0, 40, 8)]
    assert torch.equal(torch.cat([g[0] for g in got]), whole[0]) and torch.equal(torch.cat([g[1] for g in got]), whole[1])


def test_binding_per_module():
    """``with_data`` -> ``for_unit`` -> ``member``: each member searches with its own module's statistic."""
    s1, s2 = Importance(_importance(256, 1, "zeros"), 7), Importance(_importance(256, 2, "one"), 7)
    obs = OBSERVERS["imatrix_mse"].with_data({"a": s1, "b": s2}).for_unit(["a", "b", "c"])
    assert obs.member(0).stat is s1 and obs.member(1).stat is s2 and obs.member(2).stat is None
    assert obs.fallback("c", W4, 256) == "no importance data available" and obs.fallback("a", W4, 256) is None
    assert OBSERVERS["imatrix_mse"].stat is None  # the registry's observer is never changed
    assert get_observer("memoryless_mse").for_unit(["a"]).member(0) is get_observer("memoryless_mse")


def test_nan_weights_refused():
    w = awkward_weights(8, 128, torch.bfloat16, 4)
    w[3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        OBSERVERS["imatrix_mse"].ranges(w, W4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_chunk_gives_cpu_ranges():
    w = awkward_weights(16, 256, torch.bfloat16, 5)
    obs = OBSERVERS["nvfp4_expanded_imatrix"].with_importance(Importance(_importance(256, 5, "zeros"), 7))
    cpu, gpu = obs.ranges(w, NVFP4), obs.ranges(w.cuda(), NVFP4)
    assert gpu[0].is_cuda and torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


def _reference():
    from safetensors import safe_open

    f = safe_open(str(REF), "pt")
    return f, json.loads(f.metadata()["reference"])


class _ByModule:
    """One observer per source tensor (``quantize_module_set`` asks by tensor): each module's own importance."""

    def __init__(self, observers: dict[int, object]):
        self.observers = observers

    def ranges(self, w, args, impl="auto"):
        return self.observers[w.data_ptr()].ranges(w, args, impl=impl)


@pytest.mark.parametrize("run", ["W4A16/imatrix_mse", "W4A16_ASYM/imatrix_mse", "FP8_DYNAMIC/imatrix_mse", "NVFP4A16/nvfp4_expanded_imatrix"])
def test_llmcompressor_bytes_from_its_statistic(run):
    """Fed llm-compressor's own importance (count 1: the mean itself), every compressed tensor is oneshot's, bit for bit
    (NVFP4: the global scale from the fused partners' searched ranges); the config records the observer as it does."""
    f, meta = _reference()
    group = meta["runs"][run]["config_groups"]["group_0"]
    args, fmt, obs = WeightArgs.from_dict(group["weights"]), get_format(group["format"]), get_observer(group["weights"]["observer"])
    src = {m: f.get_tensor(f"source/{m}.weight") for m in meta["modules"]}
    by = _ByModule({w.data_ptr(): obs.with_importance(Importance(f.get_tensor(f"importance/{m}"), 1)) for m, w in src.items()})
    got = quantize_module_set(src, fmt, args, by)
    prefix = f"{run}/"
    expected = [k for k in f.keys() if k.startswith(prefix)]
    assert len(expected) >= 2 * len(src)
    for key in expected:
        module, name = key[len(prefix) :].rsplit(".", 1)
        ref, mine = f.get_tensor(key), got[module].pop(name)
        assert mine.dtype == ref.dtype and mine.shape == ref.shape and torch.equal(bits_of(mine), bits_of(ref)), key
    assert all(not rest for rest in got.values()), "ctconvert wrote tensors llm-compressor did not"
    assert {k: group["weights"][k] for k in ("observer", "observer_kwargs")} == obs.config_fields()
