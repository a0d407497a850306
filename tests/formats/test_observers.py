"""The weight observers (ctconvert/formats/observers/) against llm-compressor 0.14.0.1 and an independent reference.

``tests/data/observers/llmc_observers.safetensors`` is made by ``scripts/llmc_observer_reference.py`` with
llm-compressor's own ``oneshot`` (separate venv): every case and run it holds is checked, every compressed
tensor bit for bit. The property tests compare the search with a straightforward per-step reference
written here from the upstream algorithm (fp32 arithmetic, each upstream operation rounded to the weight's
dtype by hand), on fresh random inputs with fixed seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ctconvert.formats import WeightArgs, get_format
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.formats.native import observe as native_observe
from ctconvert.formats.observers import OBSERVERS, StopTracker, TensorSearch, get_observer, grouped, range_absmax
from ctconvert.formats.observers.fake_quant import cast_to_fp4, fp4_level

REF = Path(__file__).resolve().parent.parent / "data" / "observers" / "llmc_observers.safetensors"
#: llm-compressor's fused sets for one global scale (``observers/helpers.py: FUSED_LAYER_NAMES``, 0.14.0.1)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"))

NVFP4 = WeightArgs(type="float", num_bits=4, strategy="tensor_group", group_size=16)
W4 = WeightArgs(type="int", num_bits=4, strategy="group", group_size=128)
W4_ASYM = WeightArgs(type="int", num_bits=4, strategy="group", group_size=128, symmetric=False)
W8_CHANNEL = WeightArgs(type="int", num_bits=8, strategy="channel")
FP8_CHANNEL = WeightArgs(type="float", num_bits=8, strategy="channel")


def _reference():
    from safetensors import safe_open

    f = safe_open(str(REF), "pt")
    return f, json.loads(f.metadata()["reference"])


def _runs():
    _, meta = _reference()
    return [(case, run) for case, c in meta["cases"].items() for run in c["runs"]]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def quantize_module_set(src: dict[str, torch.Tensor], fmt, args, obs, impl: str = "auto") -> dict[str, dict[str, torch.Tensor]]:
    """Every module's compressed tensors, with NVFP4 global scales from the fused partners' searched ranges."""
    ranges = {m: obs.ranges(w, args, impl=impl) for m, w in src.items()}
    out = {}
    for m, w in src.items():
        gs = None
        if fmt.needs_global_scale:
            parent, leaf = m.rsplit(".", 1)
            members = next((s for s in FUSED if leaf in s), (leaf,))
            amax = torch.stack([range_absmax(*ranges[f"{parent}.{x}"]) for x in members if f"{parent}.{x}" in ranges]).max()
            gs = nvfp4_global_scale(amax, w.dtype)
        got = fmt.quantize(w, args, gs, ranges=ranges[m])
        got.update(fmt.whole_tensor_outputs(tuple(w.shape), gs))
        out[m] = got
    return out


def _impls():
    """Every reference run through the default search (the C kernel where built) and through the torch
    reference (the slowest one, bf16 NVFP4 with its 111 steps, under ``-m slow``)."""
    out = []
    for case, run in _runs():
        out.append(pytest.param(case, run, "auto", id=f"{case}-{run}-auto"))
        slow = case.endswith("bf16") and run.endswith("nvfp4_expanded_mse")
        out.append(pytest.param(case, run, "torch", id=f"{case}-{run}-torch", marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("case,run,impl", _impls())
def test_llmcompressor_bytes(case, run, impl):
    """ctconvert's observer + quantizer write exactly llm-compressor's packed weights, scales, global scales."""
    f, meta = _reference()
    qc = meta["cases"][case]["runs"][run]
    group = qc["config_groups"]["group_0"]
    args, fmt, obs = WeightArgs.from_dict(group["weights"]), get_format(group["format"]), get_observer(group["weights"]["observer"])
    modules = meta["cases"][case]["modules"]
    src = {m: f.get_tensor(f"{case}/source/{m}.weight") for m in modules}
    got = quantize_module_set(src, fmt, args, obs, impl)
    prefix = f"{case}/{run}/"
    expected = [k for k in f.keys() if k.startswith(prefix)]
    assert expected
    for key in expected:
        module, name = key[len(prefix) :].rsplit(".", 1)
        ref, mine = f.get_tensor(key), got[module].pop(name)
        assert mine.dtype == ref.dtype and mine.shape == ref.shape, key
        assert torch.equal(bits_of(mine), bits_of(ref)), key
    assert all(not rest for rest in got.values()), "ctconvert wrote tensors llm-compressor did not"
    weights = group["weights"]
    if obs.name != "minmax":  # min/max writes today's config, without the field
        assert {k: weights[k] for k in ("observer", "observer_kwargs")} == obs.config_fields()


def test_mse_changes_the_bytes():
    """The searched references are not min/max in disguise: the MSE runs differ from the min/max bytes."""
    f, meta = _reference()
    for case, c in meta["cases"].items():
        for run in c["runs"]:
            if not run.endswith("mse"):
                continue
            scheme = run.split("/")[0]
            args = WeightArgs.from_dict(c["runs"][run]["config_groups"]["group_0"]["weights"])
            fmt = get_format(c["runs"][run]["config_groups"]["group_0"]["format"])
            src = {m: f.get_tensor(f"{case}/source/{m}.weight") for m in c["modules"]}
            plain = quantize_module_set(src, fmt, args, OBSERVERS["minmax"])
            name = "weight_packed" if "weight_packed" in plain[c["modules"][0]] else "weight"
            differ = sum(not torch.equal(bits_of(plain[m][name]), bits_of(f.get_tensor(f"{case}/{run}/{m}.{name}"))) for m in c["modules"])
            assert differ >= len(c["modules"]) // 2, (case, scheme)


def test_minmax_is_todays_bytes():
    """``minmax`` ranges give the bytes of the quantizers' own min/max, for every format that takes ranges."""
    torch.manual_seed(0)
    w = (torch.randn(64, 256) * 0.05).to(torch.bfloat16)
    w[3] = 0
    obs = OBSERVERS["minmax"]
    for name, args in (("pack-quantized", W4), ("pack-quantized", W4_ASYM), ("int-quantized", W8_CHANNEL), ("float-quantized", FP8_CHANNEL)):
        fmt = get_format(name)
        a, b = fmt.quantize(w, args, impl="torch"), fmt.quantize(w, args, ranges=obs.ranges(w, args))
        assert a.keys() == b.keys() and all(torch.equal(bits_of(a[k]), bits_of(b[k])) for k in a), name
    mx = WeightArgs(type="float", num_bits=4, strategy="group", group_size=32)
    for name in ("mxfp4-pack-quantized", "mxfp8-quantized"):
        fmt, args = get_format(name), mx if name.startswith("mxfp4") else WeightArgs(type="float", num_bits=8, strategy="group", group_size=32)
        a, b = fmt.quantize(w, args, impl="torch"), fmt.quantize(w, args, ranges=obs.ranges(w, args))
        assert all(torch.equal(bits_of(a[k]), bits_of(b[k])) for k in a), name
    fmt = get_format("nvfp4-pack-quantized")
    gs = nvfp4_global_scale(range_absmax(*obs.ranges(w, NVFP4)), w.dtype)
    a, b = fmt.quantize(w, NVFP4, gs, impl="torch"), fmt.quantize(w, NVFP4, gs, ranges=obs.ranges(w, NVFP4))
    assert all(torch.equal(bits_of(a[k]), bits_of(b[k])) for k in a)


# -- an independent reference ------------------------------------------------------------------------------


def _rd(x: torch.Tensor, d: torch.dtype) -> torch.Tensor:
    return x.to(d).to(torch.float32)


def _straight_search(w: torch.Tensor, args: WeightArgs, obs) -> tuple[torch.Tensor, torch.Tensor]:
    """The upstream loop written out: fp32 arithmetic, every upstream op rounded to D, no shortcut."""
    d = w.dtype
    x = grouped(w, args).to(torch.float32)
    mn0, mx0 = straight_unshrunk(x, obs, d)

    def error(smn, smx):
        q = straight_fake_quant(x, smn, smx, args, d)
        e = _rd(torch.pow(_rd(q - x, d).abs(), _rd(torch.tensor(obs.norm), d)), d)  # torch's pow of a D tensor: the exponent in D
        return _rd(e.sum(-1), d)

    best = torch.full_like(mn0, torch.finfo(d).max)
    return straight_loop(mn0, mx0, obs, d, int(obs.maxshrink * obs.grid), error, best, lambda stale: stale >= obs.patience)


def straight_loop(mn0, mx0, obs, d: torch.dtype, steps: int, error, best: torch.Tensor, stops) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid loop: ``steps`` candidates, ``error(min, max)`` per group, the strictly better kept (from ``best``), stopping
    when ``stops(stale)`` (steps in a row without an improvement of any group); the ranges in D."""
    best_mn, best_mx = mn0.clone(), mx0.clone()
    stale = 0
    for i in range(steps):
        smn, smx = straight_candidate(mn0, mx0, obs, i, d)
        err = error(smn, smx)
        better = err < best
        if bool(better.any()):
            best = torch.where(better, err, best)
            best_mn, best_mx = torch.where(better, smn, best_mn), torch.where(better, smx, best_mx)
            stale = 0
        else:
            stale += 1
            if stops(stale):
                break
    return best_mn.to(d), best_mx.to(d)


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))  # torch's opmath of a Python scalar


def straight_unshrunk(x: torch.Tensor, obs, d: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``amin``/``amax`` of each group of ``x`` (fp32 values of D) times ``expand``, rounded to D."""
    return _rd(x.amin(-1) * _f32(obs.expand), d), _rd(x.amax(-1) * _f32(obs.expand), d)


def straight_candidate(mn0: torch.Tensor, mx0: torch.Tensor, obs, i: int, d: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid step ``i``'s range: ``p = 1 - i / grid`` times the unshrunk range, rounded to D."""
    p = _f32(1 - i / obs.grid)
    return _rd(mn0 * p, d), _rd(mx0 * p, d)


def straight_fake_quant(x: torch.Tensor, smn: torch.Tensor, smx: torch.Tensor, args: WeightArgs, d: torch.dtype) -> torch.Tensor:
    """compressed-tensors' candidate qparams (no global scale) and fake quantization of ``x`` ``[N, G, g]``, written out:
    fp32 arithmetic, every upstream op rounded to D; fp32 values of D."""
    if args.type == "int":
        qmin, qmax = -(2.0 ** (args.num_bits - 1)), 2.0 ** (args.num_bits - 1) - 1
    else:
        qmax = 448.0 if args.num_bits == 8 else 6.0
        qmin = -qmax
    cmn, cmx = smn.clamp(max=0), smx.clamp(min=0)
    if args.symmetric:
        scale = _rd(torch.maximum(cmn.abs(), cmx.abs()) / ((qmax - qmin) / 2), d)
        zp = torch.zeros_like(scale)
    else:
        scale = _rd(_rd(cmx - cmn, d) / (qmax - qmin), d)
        zp = torch.round(torch.nan_to_num(_rd(qmin - _rd(cmn / scale, d), d).clamp(qmin, qmax), nan=0.0))
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(d).eps), scale)
    s, z = scale.unsqueeze(-1), zp.unsqueeze(-1)
    t = _rd(_rd(x / s, d) + z, d).clamp(qmin, qmax)
    if args.type == "int":
        r = torch.round(t)
    elif args.num_bits == 8:
        r = t.to(torch.float8_e4m3fn).to(torch.float32)
    else:
        r = cast_to_fp4(t.clone())
    return _rd(_rd(r - z, d) * s, d)


def awkward_weights(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02 * (1 + 4 * torch.rand(n, k, generator=g) ** 6)
    w[0] = 0  # zeros
    w[1] = 0.01  # ties: a constant row
    w[2, : k // 2] = -w[2, k // 2 :]  # ties: mirrored halves
    w[3] *= 1e-3  # tiny (fp16 subnormals)
    w[4].abs_()  # no negative value
    return w.to(dtype)


@pytest.mark.parametrize(
    "name,args,dtype,seed",
    [
        ("nvfp4_expanded_mse", NVFP4, torch.bfloat16, 1),
        ("nvfp4_expanded_mse", NVFP4, torch.float16, 2),
        ("memoryless_mse", NVFP4, torch.float32, 3),
        ("memoryless_mse", W4, torch.bfloat16, 4),
        ("memoryless_mse", W4_ASYM, torch.float16, 5),
        ("memoryless_mse", W8_CHANNEL, torch.bfloat16, 6),
        ("memoryless_mse", FP8_CHANNEL, torch.bfloat16, 7),
        ("memoryless_mse", FP8_CHANNEL, torch.float16, 8),
    ],
)
def test_search_equals_straight_reference(name, args, dtype, seed):
    obs = OBSERVERS[name]
    w = awkward_weights(24, 256, dtype, seed)
    mn, mx = obs.ranges(w, args)
    rmn, rmx = _straight_search(w, args, obs)
    assert mn.dtype == dtype and mn.shape == rmn.shape
    assert torch.equal(mn, rmn) and torch.equal(mx, rmx)


def testfp4_level_every_value():
    """The bucketized E2M1 level equals compressed-tensors' step-by-step cast on every bf16 and fp16 value."""
    for d in (torch.bfloat16, torch.float16):
        v = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(d)
        v = v[torch.isfinite(v)]
        a = v.abs()
        assert torch.equal(fp4_level(a), cast_to_fp4(a.clamp(max=6).clone())), d
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0)).abs() * 3
    x = torch.cat([x, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0])])
    assert torch.equal(fp4_level(x), cast_to_fp4(x.clamp(max=6).clone()))


def test_row_chunks_equal_the_whole_tensor():
    """Global patience: the whole tensor's step count (StopTracker over every chunk's full search) gives
    each chunk the ranges of one search of the whole tensor, also where the search stops early."""
    obs = OBSERVERS["memoryless_mse"]
    g = torch.Generator().manual_seed(16)
    w = (torch.randn(4, 128, generator=g) * 0.02).to(torch.bfloat16)  # 4 groups: the search stops early
    whole = obs.search(w, W4)
    assert whole.improved.numel() < obs.total_steps  # the case is one that stops early
    alone = torch.cat([obs.search(w[r : r + 1], W4).min for r in range(4)])
    assert not torch.equal(alone, whole.min)  # and where a row searched alone stops elsewhere
    tracker = obs.stop_tracker()
    assert obs.needs_stop_pass
    for r in range(4):
        tracker.add(obs.search(w[r : r + 1], W4, steps=obs.total_steps).improved)
    assert tracker.steps == whole.improved.numel()
    parts = [obs.search(w[r : r + 1], W4, steps=tracker.steps) for r in range(4)]
    assert torch.equal(torch.cat([p.min for p in parts]), whole.min) and torch.equal(torch.cat([p.max for p in parts]), whole.max)


@pytest.mark.parametrize("impl", ["torch", "native"])
def test_one_search_per_chunk(impl):
    """The streaming plan: one full search per chunk (keeping its ``hits``), the tracker's step count, then
    each chunk's ranges from its hits without a second search, equal to one search of the whole tensor."""
    if impl == "native" and not native_observe.available():
        pytest.skip("no C compiler")
    obs = OBSERVERS["memoryless_mse"]
    for args, w in (
        (W4, (torch.randn(4, 128, generator=torch.Generator().manual_seed(16)) * 0.02).to(torch.bfloat16)),
        (W4_ASYM, awkward_weights(32, 256, torch.float16, 3)),
    ):
        whole = obs.search(w, args, impl="torch")
        tracker, kept = obs.stop_tracker(), []
        for r in range(0, w.shape[0], 2):
            s = obs.search(w[r : r + 2], args, steps=obs.total_steps, impl=impl)
            tracker.add(s.improved)
            kept.append(s.hits)
        step = torch.cat([obs.steps_at(h, tracker.steps) for h in kept])
        assert torch.equal(step, whole.step)
        mn, mx = obs.ranges_from_steps(w, args, step)
        assert torch.equal(mn, whole.min) and torch.equal(mx, whole.max)


def test_stop_tracker_final():
    t = StopTracker(20, 5)
    assert t.steps == 5 and not t.final
    t.add(torch.tensor([True] * 3 + [False] * 17))
    assert t.steps == 8
    t.add(torch.tensor([i % 4 == 0 for i in range(20)]))
    assert t.steps == 20 and t.final
    with pytest.raises(ValueError, match="all 20 steps"):
        t.add(torch.ones(3, dtype=torch.bool))


def test_ranges_from_steps():
    obs = OBSERVERS["nvfp4_expanded_mse"]
    w = awkward_weights(8, 64, torch.bfloat16, 3)
    s = obs.search(w, NVFP4)
    assert not obs.needs_stop_pass and s.improved.numel() == obs.total_steps == 111
    mn, mx = obs.ranges_from_steps(w, NVFP4, s.step)
    assert torch.equal(mn, s.min) and torch.equal(mx, s.max)


def test_awkward_rows():
    """A zero row keeps a zero range (scale eps), a constant row keeps its first (unshrunk) candidate on ties."""
    for name, args in (("memoryless_mse", W4), ("nvfp4_expanded_mse", NVFP4)):
        obs = OBSERVERS[name]
        w = awkward_weights(8, 256, torch.bfloat16, 0)
        s = obs.search(w, args)
        assert not bool(s.min[0].any()) and not bool(s.max[0].any())
        assert bool(torch.isfinite(s.min.float()).all())


def test_refusals():
    obs = OBSERVERS["memoryless_mse"]
    w = torch.zeros(4, 100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of the group size"):
        obs.search(w, W4)
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.zeros(4, 128, dtype=torch.bfloat16)
        w[1, 2] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            obs.search(w, W4)
        with pytest.raises(ValueError, match="NaN or inf"):
            OBSERVERS["minmax"].search(w, W4)
    with pytest.raises(ValueError, match="block"):
        obs.search(torch.zeros(128, 128), WeightArgs(type="float", num_bits=8, strategy="block", block_structure=(128, 128)))
    with pytest.raises(ValueError, match="NVFP4 .* or MXFP4"):
        obs.search(torch.zeros(4, 64), WeightArgs(type="float", num_bits=4, strategy="group", group_size=16))
    with pytest.raises(ValueError, match="unknown observer 'mse2'"):
        get_observer("mse2")
    with pytest.raises(ValueError, match="observer's ranges"):
        get_format("naive-quantized").quantize(torch.zeros(4, 64), W8_CHANNEL, ranges=(None, None))
    with pytest.raises(ValueError, match="global scale"):
        get_format("nvfp4-pack-quantized").quantize(torch.zeros(4, 64), NVFP4, ranges=obs.ranges(torch.zeros(4, 64), NVFP4))


@pytest.mark.skipif(not native_observe.available(), reason="no C compiler")
@pytest.mark.parametrize(
    "name,args,dtype,seed",
    [
        ("nvfp4_expanded_mse", NVFP4, torch.bfloat16, 1),
        ("nvfp4_expanded_mse", NVFP4, torch.float16, 2),
        ("memoryless_mse", NVFP4, torch.bfloat16, 3),
        ("memoryless_mse", W4, torch.bfloat16, 4),
        ("memoryless_mse", W4_ASYM, torch.float16, 5),
        ("memoryless_mse", W4_ASYM, torch.bfloat16, 6),
        ("memoryless_mse", WeightArgs(type="float", num_bits=8, strategy="group", group_size=128), torch.bfloat16, 7),
        ("memoryless_mse", WeightArgs(type="int", num_bits=8, strategy="group", group_size=32), torch.float16, 8),
        ("memoryless_mse", WeightArgs(type="float", num_bits=4, strategy="group", group_size=32), torch.bfloat16, 9),
        ("memoryless_mse", WeightArgs(type="float", num_bits=4, strategy="group", group_size=32), torch.float16, 10),
        ("nvfp4_expanded_mse", WeightArgs(type="float", num_bits=4, strategy="group", group_size=32), torch.bfloat16, 11),
        ("memoryless_mse", WeightArgs(type="float", num_bits=8, strategy="group", group_size=32), torch.bfloat16, 12),
    ],
)
def test_native_equals_torch(name, args, dtype, seed):
    """The C kernel (with its torch fallback for the groups it cannot vouch for) gives the torch search's
    ranges, steps and improvements, early stop included."""
    obs = OBSERVERS[name]
    w = awkward_weights(48, 512, dtype, seed)
    for steps in (None, 7):
        a, b = obs.search(w, args, steps, impl="torch"), obs.search(w, args, steps, impl="native")
        assert torch.equal(a.min, b.min) and torch.equal(a.max, b.max)
        assert torch.equal(a.step, b.step) and torch.equal(a.improved, b.improved)


@pytest.mark.skipif(not native_observe.available(), reason="no C compiler")
def test_native_fallback_is_exercised():
    """Some groups are left to torch (near-ties within the kernel's rounding bounds), and the result is still torch's."""
    obs = OBSERVERS["memoryless_mse"]
    w = awkward_weights(64, 1024, torch.float16, 9)
    p = torch.tensor([1 - i / obs.grid for i in range(obs.total_steps)], dtype=torch.float32)
    norm = float(torch.tensor(obs.norm).to(w.dtype))
    _, _, _, _, unsure, _ = native_observe.mse_search(w, 128, "int", False, -8.0, 7.0, 7.5, 15.0, 1.0, p, norm)
    assert 0 < int(unsure.sum()) < unsure.numel() // 4
    a, b = obs.search(w, W4_ASYM, impl="torch"), obs.search(w, W4_ASYM, impl="native")
    assert torch.equal(a.min, b.min) and torch.equal(a.max, b.max)
    with pytest.raises(ValueError, match="native observer kernel"):
        obs.search(w.float(), W4_ASYM, impl="native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_chunk_gives_cpu_ranges():
    """A CUDA chunk is searched on the CPU (the reference's bytes), its results handed back on the device."""
    for name, args in (("nvfp4_expanded_mse", NVFP4), ("memoryless_mse", W4)):
        obs = OBSERVERS[name]
        w = awkward_weights(16, 256, torch.bfloat16, 4)
        a, b = obs.search(w, args), obs.search(w.cuda(), args)
        assert b.min.device.type == "cuda" and torch.equal(a.min, b.min.cpu()) and torch.equal(a.step, b.step.cpu())
        fmt = get_format("pack-quantized" if args.type == "int" else "nvfp4-pack-quantized")
        gs = nvfp4_global_scale(range_absmax(*a.ranges), w.dtype) if fmt.needs_global_scale else None
        out_cpu = fmt.quantize(w, args, gs, ranges=a.ranges)
        out_gpu = fmt.quantize(w.cuda(), args, None if gs is None else gs.cuda(), ranges=b.ranges)
        assert all(torch.equal(bits_of(out_cpu[k]), bits_of(out_gpu[k].cpu())) for k in out_cpu)


@pytest.mark.parametrize(
    "name,args,dtype",
    [("nvfp4_expanded_mse", NVFP4, torch.bfloat16), ("memoryless_mse", NVFP4, torch.float16), ("memoryless_mse", W4_ASYM, torch.bfloat16)],
)
@pytest.mark.parametrize("batch", [None, 5 * 256 + 1, 10**9])
def test_tensor_search_two_passes(name, args, dtype, batch, monkeypatch):
    """TensorSearch over row chunks: the whole tensor's ranges and searched absmax, chunk by chunk; also with the
    chunks held and searched in batches (``batch`` elements: the first two chunks, then the last; all three at the last)."""
    obs = OBSERVERS[name]
    w = awkward_weights(12, 256, dtype, 5)
    whole = obs.search(w, args)
    rows = []
    search = obs.search
    monkeypatch.setattr(obs, "search", lambda x, *a, **k: rows.append(x.shape[0]) or search(x, *a, **k))
    ts = TensorSearch(obs, args, batch_elems=batch)
    chunks = [(r, w[r : r + 5]) for r in range(0, 12, 5)]
    for r0, c in chunks:
        ts.add(r0, c, last=r0 + 5 >= 12)
    assert rows == {None: [5, 5, 2], 5 * 256 + 1: [10, 2], 10**9: [12]}[batch]
    assert torch.equal(ts.absmax, range_absmax(whole.min, whole.max))
    got = [ts.ranges(r0, c) for r0, c in chunks]
    assert torch.equal(torch.cat([g[0] for g in got]), whole.min) and torch.equal(torch.cat([g[1] for g in got]), whole.max)
    with pytest.raises(KeyError):
        ts.ranges(0, w[:5])
