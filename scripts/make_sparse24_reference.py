"""Make ``tests/data/sparse24_ct014.safetensors``: what compressed-tensors 0.14 writes for 2:4 sparse Linear weights.

Run once, in a separate environment (compressed-tensors 0.14 needs transformers < 5; never installed in CI)::

    python3 -m venv /work/venvs/ct014
    /work/venvs/ct014/bin/pip install torch==2.13.0 'compressed-tensors==0.14.*' 'transformers<5' psutil
    /work/venvs/ct014/bin/python scripts/make_sparse24_reference.py tests/data/sparse24_ct014.safetensors

For each case a tiny model of ``nn.Linear`` layers (bf16 weights of awkward content: ties, zero rows,
-0.0, groups already 2:4) goes through the llm-compressor order of operations: magnitude 2:4 pruning
(compressed-tensors' own ``get_24_bytemasks`` on the dense weight), the weight scales from the
min/max of the pruned weight (``calculate_qparams``, what llm-compressor's min-max observer computes),
then ``ModelCompressor.from_pretrained_model(...).compress_model`` and ``update_config``. Stored per
case: the dense input weights, the pruned weights, every compressed tensor, and the
``quantization_config`` JSON ``update_config`` wrote (safetensors metadata ``caseI``).
Also stored: the mask ``get_24_bytemasks`` gives for every weak ordering of 4 elements
(``tie_table``), which pins the tie-breaking of ``torch.topk`` on the CPU.
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
import warnings

import torch
from compressed_tensors import ModelCompressor, __version__
from compressed_tensors.compressors.sparse_compressors.sparse_24_bitmask import get_24_bytemasks
from compressed_tensors.config import DenseSparsityConfig, Sparse24BitMaskConfig
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import save_file

warnings.simplefilter("ignore")


def weight(n: int, k: int, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if kind == "ties":  # few levels: many equal magnitudes in one group of 4
        w = torch.round(w * 40) / 40
    w = w.to(torch.bfloat16)
    w[0] = 0  # a row of zeros
    w[1, :8] = -0.0
    w[2, :4] = torch.tensor([0.5, -0.5, 0.5, -0.5])
    if kind == "already":  # already 2:4 (some groups with one or no non-zero)
        w = w * get_24_bytemasks(w)
        w[3, 4:8] = torch.tensor([0.0, 0.0, 0.25, 0.0])
    return w


class Tiny(torch.nn.Module):
    def __init__(self, shapes, seed, kind):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for i, (n, k) in enumerate(shapes):
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            lin.weight.data = weight(n, k, seed + i, kind)
            self.layers.append(lin)


def scales(model, scheme_name):
    for lin in model.layers:
        args = lin.quantization_scheme.weights
        w = lin.weight.data
        if args.strategy == "group":
            g = w.reshape(w.shape[0], -1, args.group_size)
            mn, mx = g.amin(-1), g.amax(-1)
        else:
            mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        s, zp = calculate_qparams(mn, mx, args)
        lin.weight_scale = torch.nn.Parameter(s.to(w.dtype), requires_grad=False)
        lin.weight_zero_point = torch.nn.Parameter(zp, requires_grad=False)


CASES = [
    # (scheme or None, shapes, kind)
    (None, [(16, 32), (24, 64)], "random"),
    (None, [(8, 40), (16, 16)], "ties"),
    (None, [(16, 32)], "already"),
    ("FP8_DYNAMIC", [(16, 32), (24, 64)], "random"),
    ("FP8_DYNAMIC", [(8, 48)], "ties"),
    ("W8A8", [(16, 32), (32, 64)], "random"),
    ("W8A8", [(8, 48)], "ties"),
    ("W4A16", [(128, 128), (128, 512)], "random"),
    ("W4A16", [(256, 384)], "ties"),
]


def main(path: str) -> None:
    tensors, meta = {}, {}
    for i, (scheme, shapes, kind) in enumerate(CASES):
        model = Tiny(shapes, 100 * i, kind)
        for j, lin in enumerate(model.layers):
            tensors[f"case{i}.input.layers.{j}.weight"] = lin.weight.data.clone()
            lin.weight.data = lin.weight.data * get_24_bytemasks(lin.weight.data)  # magnitude 2:4 pruning
            tensors[f"case{i}.pruned.layers.{j}.weight"] = lin.weight.data.clone()
        if scheme is not None:
            qcfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])})
            apply_quantization_config(model, qcfg)
            scales(model, scheme)
        marlin = scheme == "W4A16"
        cls = DenseSparsityConfig if marlin else Sparse24BitMaskConfig
        scfg = cls(sparsity_structure="2:4", global_sparsity=0.5, targets=["Linear"], ignore=["lm_head"])
        comp = ModelCompressor.from_pretrained_model(model, sparsity_config_or_format=scfg)
        for j, lin in enumerate(model.layers):
            if scheme is not None:
                tensors[f"case{i}.scale.layers.{j}.weight_scale"] = lin.weight_scale.data.clone()
        comp.compress_model(model)
        for name, p in model.named_parameters():
            tensors[f"case{i}.expected.{name}"] = p.data.contiguous()
        with tempfile.TemporaryDirectory() as d:
            comp.update_config(d)
            with open(f"{d}/config.json") as f:
                qc = json.load(f)["quantization_config"]
        meta[f"case{i}"] = json.dumps({"scheme": scheme, "shapes": shapes, "kind": kind, "quantization_config": qc})
    # the tie table: rank vectors r (r_i = how many of the 4 are smaller) of every weak ordering
    table = {}
    for vals in itertools.product(range(4), repeat=4):
        ranks = tuple(sum(v < x for v in vals) for x in vals)
        if ranks not in table:
            m = get_24_bytemasks(torch.tensor([list(ranks)], dtype=torch.float32))[0]
            table[ranks] = sum(1 << b for b in range(4) if m[b])
    meta["tie_table"] = json.dumps({"".join(map(str, r)): v for r, v in sorted(table.items())})
    meta["file"] = json.dumps({"compressed_tensors": __version__, "torch": torch.__version__, "num_cases": len(CASES)})
    save_file(tensors, path, metadata=meta)


if __name__ == "__main__":
    main(sys.argv[1])
