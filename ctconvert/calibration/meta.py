"""The checkpoint's transformers model on the ``meta`` device (no memory, no weights), for calibration: which
transformers class builds it, with which attention, in which dtype, and which ``PreTrainedModel`` owns each module."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.reader import Checkpoint
from ..errors import UnsupportedError

__all__ = ["build_meta", "eager_only", "model_dtype", "pretrained_owners", "transformers_module"]


def transformers_module():
    """The ``transformers`` module; raises :class:`UnsupportedError` (exit 4) when it is not installed."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - installed with the test extras
        raise UnsupportedError("calibration runs the model's own architecture and needs transformers: pip install transformers") from e
    return transformers


def pretrained_owners(model: nn.Module) -> dict[int, nn.Module]:
    """``id(module)`` -> the innermost ``transformers.PreTrainedModel`` that holds it (itself for a sub-model)."""
    from transformers import PreTrainedModel

    out: dict[int, nn.Module] = {}

    def walk(m: nn.Module, owner: nn.Module) -> None:
        owner = m if isinstance(m, PreTrainedModel) else owner
        out[id(m)] = owner
        for child in m.children():
            walk(child, owner)

    walk(model, model)
    return out


def build_meta(tf, ckpt: Checkpoint, dtype: torch.dtype, arch: str, attention: tuple[str, ...] = ("sdpa", "eager")) -> tuple[nn.Module, str]:
    """The checkpoint's model on the meta device (no memory, no weights): ``AutoModelForCausalLM.from_config``, or
    for a vision-language model (Qwen2.5-VL, LLaVA, ...) ``AutoModelForImageTextToText.from_config`` (its language
    model is calibrated on text), with SDPA attention, else with eager attention; ``(model, "sdpa" | "eager")``.
    Raises :class:`UnsupportedError` (exit 4) when neither builds it."""
    first = None
    config = None
    builders = [tf.AutoModelForCausalLM, getattr(tf, "AutoModelForImageTextToText", None)]
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()  # its warnings (a config of another model type, RoPE settings) are not ours to print
    try:
        for impl in attention:
            for auto in filter(None, builders):
                try:
                    config = config or tf.AutoConfig.from_pretrained(str(ckpt.path))
                    with torch.device("meta"):
                        return auto.from_config(config, dtype=dtype, attn_implementation=impl), impl
                except Exception as e:  # noqa: BLE001 - any failure to build it is one clear line
                    first = first or e
    finally:
        tf.logging.set_verbosity(verbosity)
    raise UnsupportedError(
        f"ctconvert cannot calibrate {arch}: its calibration builds the model with transformers' AutoModelForCausalLM "
        f"(or AutoModelForImageTextToText), which cannot build architecture {arch} ({type(first).__name__}: {str(first).splitlines()[0][:200]}): "
        "use a data-free scheme (NVFP4A16, W4A16, FP8_DYNAMIC, ...), which needs no calibration",
        file=ckpt.path / "config.json",
    )


def model_dtype(ckpt: Checkpoint) -> torch.dtype:
    """The model's dtype for calibration: its embedding's, else its first floating-point tensor's."""
    emb_dtype = next((t.torch_dtype for n, t in ckpt.tensors.items() if n.endswith("embed_tokens.weight")), None)
    return emb_dtype or next(t.torch_dtype for t in ckpt.tensors.values() if t.torch_dtype.is_floating_point)


def eager_only(ckpt: Checkpoint) -> str | None:
    """The architecture name when transformers has no SDPA attention for it (its class's ``_supports_sdpa`` is
    False, which makes ``from_config(attn_implementation="sdpa")`` raise), so calibration will run its eager
    attention; None when it has SDPA or when this cannot be told without building the model (the dry run's note)."""
    try:
        tf = transformers_module()
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(tf.AutoConfig.from_pretrained(str(ckpt.path)))]
    except Exception:  # noqa: BLE001 - not knowable from the config alone: the real run says what it did
        return None
    return None if getattr(cls, "_supports_sdpa", True) else cls.__name__
