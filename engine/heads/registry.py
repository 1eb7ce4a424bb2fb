"""Known targets and their published drafters, and the mode that measured best per target.

Targets match on the model's base name (organisation and quantisation suffixes
dropped: `mlx-community/Qwen3-4B-4bit` is `Qwen3-4B`). The bundled reference model's
own heads live in engine/reference_model/drafters/. Only heads found on this machine
count for `auto` (nothing downloads behind the user's back); naming a mode fetches it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..models import REFERENCE_MODEL_DIR

REFERENCE_DRAFTERS = REFERENCE_MODEL_DIR / "drafters"


@dataclass(frozen=True)
class Entry:
    heads: dict[str, str] = field(default_factory=dict)  # mode -> repository id or path
    best: str | None = None  # measured best mode; None: not measured here, auto prefers lookup


# Published checkpoints (z-lab DFlash, DeepSeek DeepSpec). "best" is only set where it was
# measured on this project's engine; the others are selectable with --mode.
PUBLISHED: dict[str, Entry] = {
    "qwen3-4b": Entry({"dflash": "z-lab/Qwen3-4B-DFlash-b16", "dspark": "deepseek-ai/dspark_qwen3_4b_block7"}),
    "qwen3-8b": Entry({"dflash": "z-lab/Qwen3-8B-DFlash-b16", "dspark": "deepseek-ai/dspark_qwen3_8b_block7"}),
    "qwen3-14b": Entry({"dflash": "deepseek-ai/dflash_qwen3_14b_block7", "dspark": "deepseek-ai/dspark_qwen3_14b_block7"}),
    "qwen3-coder-30b-a3b-instruct": Entry({"dflash": "z-lab/Qwen3-Coder-30B-A3B-DFlash"}),
    "llama-3.1-8b-instruct": Entry({"dflash": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"}),
    "meta-llama-3.1-8b-instruct": Entry({"dflash": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"}),
}

# The bundled reference model: from training/heads/README.md's CPU measurement, DSpark beat
# plain decoding in every content measured (1.65x-5.2x, lookup override on) and DFlash in 5 of 8.
REFERENCE_BEST = "dspark"

_QUANT_SUFFIX = re.compile(
    r"[-_.](\d+bit|\d+-bit|bf16|fp16|f16|fp32|fp8|mxfp4|nvfp4|q\d(_k)?(_m)?|dwq\w*|mlx|awq|gptq|gguf)$",
    re.IGNORECASE,
)


def base_name(path_or_id: str) -> str:
    name = str(path_or_id).rstrip("/").rsplit("/", 1)[-1]
    prev = None
    while prev != name:
        prev, name = name, _QUANT_SUFFIX.sub("", name)
    return name.lower()


def is_reference(target) -> bool:
    try:
        return Path(target.path).resolve() == REFERENCE_MODEL_DIR.resolve()
    except OSError:
        return False


def entry_for(target) -> Entry:
    """The drafters known for this target: the user's --drafter first, then the registry."""
    if getattr(target, "drafter", None):
        from .loading import kind_of, resolve_path

        import json

        path = resolve_path(target.drafter)
        kind = kind_of(json.loads((path / "config.json").read_text()))
        return Entry({kind: str(path)}, best=kind)
    if is_reference(target):
        heads = {m: str(REFERENCE_DRAFTERS / m) for m in ("dflash", "dspark") if (REFERENCE_DRAFTERS / m / "config.json").exists()}
        return Entry(heads, REFERENCE_BEST if REFERENCE_BEST in heads else None)
    return PUBLISHED.get(base_name(target.path), Entry())


def available_locally(spec: str) -> bool:
    if Path(spec).expanduser().exists():
        return True
    try:
        from .loading import resolve_path

        resolve_path(spec, allow_download=False)
        return True
    except Exception:
        return False
