"""The conversion section appended to the output's copy of the model card (``README.md``).

Like other converters (llm-compressor's and mlx_lm's uploads say how a checkpoint was made), the copy of
the source's ``README.md`` in the output gets a short section: the tool and its version, the scheme and
its compressed-tensors format, what was kept dense (``ignore``), and for a kernel-native output its
target. The input's card is never touched: the section is written into the copy in the output folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import __version__

__all__ = ["CARD", "HEADING", "append_conversion_section"]

CARD = "README.md"
HEADING = "## Conversion (ctconvert)"
_SHOWN = 8  # ignore entries listed by name; config.json has all of them


def conversion_section(
    source: str | Path,
    scheme: str,
    fmt: str,
    ignore: list[str],
    lm_head: str = "none",
    target: str | None = None,
    calibration: str | None = None,
    derived_from: dict | None = None,
) -> str:
    """The Markdown section (starts with :data:`HEADING`). ``source``: the input folder, named by its last
    component (a card is published: no local path; ``.`` and ``..`` are resolved first); ``calibration``: the
    data the activation scales were calibrated on (None: none used); ``derived_from``: a quantized source
    (:meth:`ctconvert.sources.Source.derived_from`), requantized."""
    name = Path(os.path.abspath(source)).name or str(source)
    how = f"calibrated on {calibration}" if calibration else "without calibration data"
    shown = ", ".join(f"`{p}`" for p in ignore[:_SHOWN]) or "nothing"
    if len(ignore) > _SHOWN:
        shown += f" and {len(ignore) - _SHOWN} more (`quantization_config.ignore` in config.json)"
    lines = [
        HEADING,
        "",
        f"Converted offline from `{name}` by ctconvert {__version__}, {how}:",
        "",
        f"- scheme: `{scheme}`, compressed-tensors format `{fmt}`",
        f"- kept dense (`ignore`): {shown}",
        f"- lm_head: {'kept dense' if lm_head == 'none' else f'quantized ({lm_head})'}",
    ]
    if derived_from:
        formats = "; ".join(derived_from.get("formats") or [])
        lines.append(f"- requantized from a quantized checkpoint (`quant_method: {derived_from.get('quant_method')}`, {formats}), dequantized exactly first")
    if target:
        lines.append(f"- kernel-native layout: `{target}` (not loadable as compressed-tensors; `ctconvert repack --target compressed-tensors` restores it)")
    return "\n".join(lines) + "\n"


def append_conversion_section(card: Path, section: str) -> bool:
    """Append ``section`` to the card at ``card`` (a copy in the output folder); False when there is none."""
    if not card.is_file():
        return False
    text = card.read_text(encoding="utf-8", errors="replace")
    card.write_text(text.rstrip("\n") + "\n\n" + section, encoding="utf-8")
    return True
