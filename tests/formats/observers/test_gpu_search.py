"""The MSE observers' GPU search (formats/observers/gpu_search.py, gpu_kernel.py) against the CPU path.

Every field of a search (ranges, steps, improvements, hits) must equal the torch reference's
(``MSEObserver.search(..., impl="torch")`` on the CPU, operation for operation upstream's), on awkward
inputs: zero rows, constant and mirrored rows (ties), tiny fp16 values, huge values, row counts that are
no multiple of a kernel block, early stops of the global patience, and with the kernel's bounds widened so
that most groups are settled exactly on the CPU. The kernel runs on CUDA, or on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, with Triton installed); without either those tests skip. The pow table
and the exact comparisons run everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from ctconvert.formats import WeightArgs
from ctconvert.formats.observers import OBSERVERS, TensorSearch, gpu_search
from ctconvert.formats.observers.gpu_search import PowTable
from formats.test_observers import awkward_weights as awkward_rows

NVFP4 = WeightArgs(type="float", num_bits=4, strategy="tensor_group", group_size=16)
MXFP4 = WeightArgs(type="float", num_bits=4, strategy="group", group_size=32)
MXFP8 = WeightArgs(type="float", num_bits=8, strategy="group", group_size=32)
FP8_G = WeightArgs(type="float", num_bits=8, strategy="group", group_size=16)
W4 = WeightArgs(type="int", num_bits=4, strategy="group", group_size=32)
W4_ASYM = WeightArgs(type="int", num_bits=4, strategy="group", group_size=32, symmetric=False)
W8_ASYM = WeightArgs(type="int", num_bits=8, strategy="group", group_size=16, symmetric=False)

CUDA = torch.cuda.is_available() and gpu_search.available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and gpu_search.available()
DEVICES = [d for d, ok in (("cuda", CUDA), ("cpu", INTERPRET)) if ok]
needs_kernel = pytest.mark.skipif(not DEVICES, reason="no CUDA, and not running under Triton's interpreter")
#: grid steps where the interpreter runs the kernel (slow); on CUDA every step of the observer
STEPS = {"cuda": None, "cpu": 24}


def _awkward(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """test_observers' awkward rows (zeros, constant and mirrored rows, tiny values, no negative value), and a
    row a third zeros and a huge row (errors that overflow D, sums past the fp32 range)."""
    w = awkward_rows(n, k, torch.float32, seed)
    w[5, ::3] = 0
    big = 6e4 if dtype == torch.float16 else 1e30
    w[6] = w[6] / w[6].abs().max() * big
    return w.to(dtype)


def _fields(s) -> list:
    return [s.min, s.max, s.step, s.improved, s.hits]


def _assert_same(got, ref):
    for name, a, b in zip(("min", "max", "step", "improved", "hits"), _fields(got), _fields(ref)):
        if b is None:
            assert a is None, name
            continue
        a = a.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        bad = a.view(torch.int16) != b.view(torch.int16) if a.is_floating_point() else a != b
        assert not bool(bad.any()), f"{name}: {int(bad.sum())} of {bad.numel()} differ"


def _search(obs, w, args, steps, device, **kw):
    """The GPU search of ``w`` moved to ``device``, as a Search (what MSEObserver.search returns on CUDA)."""
    from ctconvert.formats.observers import Search

    return Search(*gpu_search.search(obs, w.to(device), args, steps, **kw))


CASES = [
    ("nvfp4_expanded_mse", NVFP4, torch.bfloat16),
    ("nvfp4_expanded_mse", NVFP4, torch.float16),
    ("memoryless_mse", NVFP4, torch.bfloat16),
    ("memoryless_mse", W4, torch.bfloat16),
    ("memoryless_mse", W4_ASYM, torch.float16),
    ("memoryless_mse", W8_ASYM, torch.bfloat16),
    ("memoryless_mse", MXFP4, torch.bfloat16),
    ("memoryless_mse", MXFP4, torch.float16),
    ("memoryless_mse", MXFP8, torch.bfloat16),
    ("memoryless_mse", FP8_G, torch.float16),
]


@needs_kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,args,dtype", CASES, ids=[f"{n}-{a.type}{a.num_bits}-{a.strategy}{a.group_size}-{str(d)[6:]}" for n, a, d in CASES])
def test_equals_cpu_reference(device, name, args, dtype):
    """Fixed step counts (every field, hits included) and llm-compressor's own stop (steps=None)."""
    obs = OBSERVERS[name]
    w = _awkward(9, 128, dtype, seed=len(name) + args.num_bits)  # 9 rows: no multiple of a kernel block
    steps = STEPS[device] or obs.total_steps
    for s in (steps, None) if device == "cuda" or obs.total_steps <= steps else (steps,):
        _assert_same(_search(obs, w, args, s, device), obs.search(w, args, s, impl="torch"))


@needs_kernel
@pytest.mark.parametrize("device", DEVICES)
def test_group_size_not_a_power_of_two(device):
    """A group of 48 is padded to 64 columns in the kernel; the padding takes no part in a range or an error."""
    obs, args = OBSERVERS["memoryless_mse"], WeightArgs(type="int", num_bits=4, strategy="group", group_size=48, symmetric=False)
    w = _awkward(9, 96, torch.bfloat16, seed=7)
    _assert_same(_search(obs, w, args, None, device), obs.search(w, args, impl="torch"))


@needs_kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,args,dtype", [CASES[0], CASES[1], CASES[4], CASES[6]], ids=["nvfp4-bf16", "nvfp4-fp16", "w4asym-fp16", "mxfp4-bf16"])
def test_settled_groups_are_exact(device, name, args, dtype):
    """Bounds widened 2^12 times: most comparisons are left undecided by the kernel, settled on the CPU from
    torch's own errors, and the result is still the reference's; with the real bounds some group of a larger
    random tensor is settled too."""
    obs = OBSERVERS[name]
    w = _awkward(8, 64, dtype, seed=3)
    steps = STEPS[device] or obs.total_steps
    launch = gpu_search._Launch(obs, args, w.to(device), steps, widen=4096.0)
    assert int(launch.run(w.to(device).reshape(-1, args.group_size))["unsure"].sum()) > w.numel() // args.group_size // 4
    _assert_same(_search(obs, w, args, steps, device, widen=4096.0), obs.search(w, args, steps, impl="torch"))


@pytest.mark.skipif(not CUDA, reason="CUDA not available")
def test_real_bounds_settle_some_groups_on_cuda():
    obs, args = OBSERVERS["nvfp4_expanded_mse"], NVFP4
    w = _awkward(256, 1024, torch.bfloat16, seed=11)
    launch = gpu_search._Launch(obs, args, w.cuda(), obs.total_steps)
    unsure = int(launch.run(w.cuda().reshape(-1, 16))["unsure"].sum())
    assert 0 < unsure < w.numel() // 16 // 50
    _assert_same(_search(obs, w, args, None, "cuda"), obs.search(w, args, None, impl="torch"))


@needs_kernel
@pytest.mark.parametrize("device", DEVICES)
def test_global_patience_stops_early(device):
    """memoryless_mse stops after 5 steps in which no group of the tensor improved: a tensor of zero and
    constant rows stops at once, the GPU search with it (improvements, steps, hits as the reference's)."""
    obs = OBSERVERS["memoryless_mse"]
    w = torch.zeros(3, 64, dtype=torch.bfloat16)
    w[1] = 0.5
    w[2, :32] = -0.25
    ref = obs.search(w, W4, impl="torch")
    assert ref.improved.numel() < obs.total_steps
    _assert_same(_search(obs, w, W4, None, device), ref)


@pytest.mark.skipif(not CUDA, reason="CUDA not available")
def test_cuda_dispatch_and_refusals():
    """MSEObserver.search of a CUDA chunk runs here (results on the device), refuses NaN and shapes off the
    group as the CPU path does, and a scheme the kernel does not take (per channel) still gets the CPU's ranges."""
    obs = OBSERVERS["nvfp4_expanded_mse"]
    w = _awkward(16, 256, torch.bfloat16, 5)
    got = obs.search(w.cuda(), NVFP4)
    assert got.min.device.type == "cuda" and got.step.device.type == "cuda"
    _assert_same(got, obs.search(w, NVFP4))
    bad = w.clone()
    bad[3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        obs.search(bad.cuda(), NVFP4)
    with pytest.raises(ValueError, match="multiple of the group size"):
        obs.search(w[:, :100].cuda(), NVFP4)
    ch = WeightArgs(type="int", num_bits=8, strategy="channel")
    assert not gpu_search.takes(w.cuda(), ch, 20)
    _assert_same(OBSERVERS["memoryless_mse"].search(w.cuda(), ch), OBSERVERS["memoryless_mse"].search(w, ch))


@pytest.mark.skipif(not CUDA, reason="CUDA not available")
@pytest.mark.parametrize("name,args", [("nvfp4_expanded_mse", NVFP4), ("memoryless_mse", W4_ASYM)])
def test_tensor_search_of_cuda_chunks(name, args):
    """The pre-pass over CUDA row chunks (the executor's) gives the CPU pre-pass's absmax and ranges."""
    obs = OBSERVERS[name]
    w = _awkward(12, 256, torch.float16, 6)
    cpu, gpu = TensorSearch(obs, args), TensorSearch(obs, args)
    chunks = [(r, w[r : r + 5]) for r in range(0, 12, 5)]
    for r0, c in chunks:
        cpu.add(r0, c)
        gpu.add(r0, c.cuda())
    assert torch.equal(cpu.absmax, gpu.absmax.cpu())
    for r0, c in chunks:
        a, b = cpu.ranges(r0, c), gpu.ranges(r0, c.cuda())
        assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pow_table_holds_torchs_pow_anywhere_in_a_tensor(dtype):
    """Every |d| ** norm torch computes, at any position of a tensor (vectorized body or scalar tail), lies in
    the table's [lo, hi] of its value; NaN/inf count as inf."""
    norm = 2.4
    t = PowTable(dtype, norm, "cpu")
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F80 if dtype == torch.bfloat16 else 0x7C00, (100003,), generator=g, dtype=torch.int32).to(torch.int16)
    v = bits.view(dtype)
    for part in (v, v[:37], v[5:70]):  # lengths that leave scalar tails
        got = part.pow(norm).float()
        idx = part.view(torch.int16).long()
        assert bool(((t.lo[idx] <= got) & (got <= t.hi[idx])).all())
    one = torch.tensor([1.0], dtype=dtype).view(torch.int16).long()
    assert float(t.lo[one]) == 1.0 and float(t.lo[0]) == 0.0
    assert float(t.lo[torch.tensor(0x7F80 if dtype == torch.bfloat16 else 0x7C00)]) == float("inf")


def test_exact_comparisons():
    """The settled groups' comparisons: strictly below the best so far (the first of equal errors wins), the
    initial best D's max (an error of inf or NaN never improves), hits as bits, improvements per step."""
    dmax = torch.finfo(torch.bfloat16).max
    inf, nan = float("inf"), float("nan")
    err = torch.tensor(
        [
            [5.0, 5.0, 3.0, 3.0, 4.0, 2.0],
            [inf, inf, inf, inf, inf, inf],
            [nan, 1.0, nan, 0.5, 0.5, 1.0],
            [dmax, dmax, 7.0, 7.0, 7.0, 7.0],
        ]
    )
    step, hits, improved = gpu_search._decide(err, dmax)
    assert step.tolist() == [5, -1, 3, 2]
    assert hits.tolist() == [0b100101, 0, 0b1010, 0b100]
    assert improved.tolist() == [True, True, True, True, False, True]
