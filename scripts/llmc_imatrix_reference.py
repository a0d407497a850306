#!/usr/bin/env python3
"""Make the llm-compressor reference of the data-driven weight observers: ``tests/data/observers/llmc_imatrix.safetensors``.

Run with a venv that has llm-compressor (``python3 -m venv V && V/bin/pip install torch==2.13.0 &&
V/bin/pip install llmcompressor==0.14.0.1``), from the repository root:

    V/bin/python scripts/llmc_imatrix_reference.py

One tiny random Llama (``llmc_observer_reference.tiny_llama``: bf16, 2 layers, awkward weight rows), with
a zero embedding column and a zero ``input_layernorm`` weight of layer 1 (input channels whose importance
E[x^2] is exactly 0), and fixed calibration token ids (``SAMPLES`` x ``SEQ_LEN``, seed 0). For each
(scheme, observer) of :data:`RUNS` it runs llm-compressor's own ``oneshot(model=..., dataset=<the token
ids, one row a sample, no padding>, recipe=QuantizationModifier(config_groups={"group_0": {"targets":
["Linear"], "weights": {..., "observer": NAME}}}, ignore=["lm_head"]), shuffle_calibration_samples=False)``
on the CPU (``CT_ENFORCE_EAGER=1``), its sequential pipeline (batch size 1, eager attention, the
``imatrix_mse`` forward-pre hook summing x^2 per input channel over every calibration token), and saves:

- ``source/{name}``: every tensor of the source checkpoint (the test writes it back with ``config.json``);
- ``{scheme}/{observer}/{module}.{tensor}``: every compressed tensor of the Linear modules as written;
- ``importance/{module}``: fp32 ``[K]``, each Linear's ``_imatrix_sum / _imatrix_count`` as llm-compressor's
  observer held it (the statistic ctconvert's calibration must reproduce);

and in the metadata (key ``reference``) a JSON document: versions, the model's ``config.json``, the token
ids, and per run the output's ``quantization_config``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmc_observer_reference import saved_weights  # noqa: E402  (the scripts folder, for one helper)

OUT = ROOT / "tests" / "data" / "observers" / "llmc_imatrix.safetensors"
SAMPLES, SEQ_LEN, VOCAB = 8, 32, 64
RUNS = [("W4A16", "imatrix_mse"), ("W4A16_ASYM", "imatrix_mse"), ("FP8_DYNAMIC", "imatrix_mse"), ("NVFP4A16", "nvfp4_expanded_imatrix")]


def model():
    """The reference model: ``tiny_llama`` with two channels whose importance is zero."""
    import torch
    from llmc_observer_reference import tiny_llama

    m = tiny_llama("bfloat16", 128, 256, 2, 0)
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 7] = 0  # channel 7 of layer 0's q/k/v and gate/up inputs: E[x^2] = 0
        m.model.layers[1].input_layernorm.weight[9] = 0  # channel 9 of layer 1's q/k/v input
    return m


def token_ids() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (SAMPLES, SEQ_LEN), generator=g).tolist()


def main() -> None:
    os.environ["CT_ENFORCE_EAGER"] = "1"
    import compressed_tensors
    import llmcompressor
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ids = token_ids()
    tensors: dict[str, torch.Tensor] = {}
    src = model()
    modules = sorted(n for n, m in src.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
    for k, v in src.state_dict().items():
        tensors[f"source/{k}"] = v.clone().contiguous()
    meta: dict = {
        "llmcompressor": llmcompressor.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "torch": torch.__version__,
        "token_ids": ids,
        "modules": modules,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "source"
        src.save_pretrained(str(folder))
        meta["config"] = json.loads((folder / "config.json").read_text())
        for scheme, observer in RUNS:
            # loaded as a user loads a checkpoint (``model()``'s ``.to(bfloat16)`` would also round the rotary
            # embedding's fp32 ``inv_freq`` buffer, which from_pretrained computes in fp32)
            m = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
            group = preset_name_to_scheme(scheme, ["Linear"]).model_dump(exclude_none=True)
            group["weights"]["observer"] = observer
            recipe = QuantizationModifier(config_groups={"group_0": group}, ignore=["lm_head"])
            seen: dict[str, torch.Tensor] = {}
            if not any(k.startswith("importance/") for k in tensors):
                _keep_importance(m, modules, seen)
            ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQ_LEN for _ in ids]})
            out = Path(tmp) / f"{scheme}-{observer}"
            oneshot(
                model=m,
                processor=_tokenizer(),
                dataset=ds,
                recipe=recipe,
                num_calibration_samples=SAMPLES,
                max_seq_length=SEQ_LEN,
                shuffle_calibration_samples=False,
                output_dir=str(out),
            )
            for k, v in seen.items():
                tensors[f"importance/{k}"] = v
            tensors.update({f"{scheme}/{observer}/{k}": v for k, v in saved_weights(out, modules).items()})
            meta["runs"][f"{scheme}/{observer}"] = json.loads((out / "config.json").read_text())["quantization_config"]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"reference": json.dumps(meta, sort_keys=True)})
    print(f"wrote {OUT}: {len(tensors)} tensors, {OUT.stat().st_size} bytes")


def _tokenizer():
    """A word-level tokenizer of the vocabulary (oneshot wants a processor with a dataset; the ids are given, none is tokenized)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


def _keep_importance(m, modules: list[str], seen: dict) -> None:
    """Copy each Linear's importance (``_imatrix_sum / _imatrix_count``, fp32 ``[K]``) as its weight observer is run:
    wraps ``IMatrixMSEObserver._prepare_importance`` of the observers llm-compressor attaches to ``m``'s modules."""
    from llmcompressor.observers.imatrix import IMatrixMSEObserver

    names = {id(mod): n for n, mod in m.named_modules() if n in modules}
    original = IMatrixMSEObserver._prepare_importance

    def keep(self, observed):
        owner = next((names[id(mod)] for mod in m.modules() if getattr(mod, "weight_observer", None) is self and id(mod) in names), None)
        if owner is not None and self._imatrix_count.item():
            seen[owner] = (self._imatrix_sum / self._imatrix_count.float()).clone()
        return original(self, observed)

    IMatrixMSEObserver._prepare_importance = keep


if __name__ == "__main__":
    main()
