"""Known targets and their published drafters, and the mode that measured best per target.

Targets match on the model's base name (organisation and quantisation suffixes
dropped: `mlx-community/Qwen3-4B-4bit` is `Qwen3-4B`). The bundled reference model's
own heads live in engine/reference_model/drafters/. Only heads found on this machine
count for `auto` (nothing downloads behind the user's back); naming a mode fetches it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.base.bundled import REFERENCE_MODEL_DIR
from engine.base.errors import ModelLoadError
from engine.drafting.heads import dflash, dspark

REFERENCE_DRAFTERS = REFERENCE_MODEL_DIR / "drafters"


class DrafterLoadError(ModelLoadError):
    pass


def kind_of(config: dict) -> str:
    arch = (config.get("architectures") or [None])[0]
    if arch in dflash.ARCHITECTURES:
        return "dflash"
    if arch in dspark.ARCHITECTURES or (arch and "DSpark" in arch):
        return "dspark"
    raise DrafterLoadError(f"unknown drafter architecture {arch!r} (expected DFlashDraftModel or Qwen3DSparkModel)")


def resolve_path(path_or_id: str | Path, allow_download: bool = True) -> Path:
    path = Path(str(path_or_id)).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise DrafterLoadError(f"{path} is not a drafter directory (no config.json)")
        return path
    if str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") != 1:
        raise DrafterLoadError(f"drafter not found: {path_or_id}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), allow_patterns=["*.json", "*.safetensors"],
                                      local_files_only=not allow_download))
    except Exception as e:
        raise DrafterLoadError(f"could not fetch drafter {path_or_id!r}: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class Entry:
    heads: dict[str, str] = field(default_factory=dict)  # mode -> repository id or path
    best: str | None = None  # measured best mode; None: not measured here, auto prefers lookup
    # mode -> the checkpoint's published config values (taps, sizes, block): checked at load
    published: dict[str, dict] = field(default_factory=dict)


# Published checkpoints (z-lab DFlash, DeepSeek DeepSpec). "best" is only set where it was
# measured on this project's engine; the others are selectable with --mode.
PUBLISHED: dict[str, Entry] = {
    "qwen3-4b": Entry({"dflash": "z-lab/Qwen3-4B-DFlash-b16", "dspark": "deepseek-ai/dspark_qwen3_4b_block7"}),
    "qwen3-8b": Entry({"dflash": "z-lab/Qwen3-8B-DFlash-b16", "dspark": "deepseek-ai/dspark_qwen3_8b_block7"}),
    "qwen3-14b": Entry({"dflash": "deepseek-ai/dflash_qwen3_14b_block7", "dspark": "deepseek-ai/dspark_qwen3_14b_block7"}),
    "qwen3-coder-30b-a3b-instruct": Entry({"dflash": "z-lab/Qwen3-Coder-30B-A3B-DFlash"}),
    "llama-3.1-8b-instruct": Entry({"dflash": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"}),
    "meta-llama-3.1-8b-instruct": Entry({"dflash": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"}),
    # Hybrid (Gated DeltaNet) and MoE targets. Values from the checkpoints' config.json:
    # z-lab/Qwen3.6-35B-A3B-DFlash at revision 42d3b34d588423cdae7ba8f53a8cf7789346a719
    # (huggingface.co/z-lab/Qwen3.6-35B-A3B-DFlash/blob/42d3b34d.../config.json; 8 layers).
    "qwen3.6-35b-a3b": Entry({"dflash": "z-lab/Qwen3.6-35B-A3B-DFlash"}, published={"dflash": {
        "hidden_size": 2048, "vocab_size": 248320, "block_size": 16, "mask_token_id": 248070,
        "target_layer_ids": [1, 10, 19, 28, 37]}}),
    # DFlash 2 (DFlash2DraftModel, conv-mixing layers): incoai/Qwen3.8-27B-DFlash2's config.json.
    "qwen3.8-27b": Entry({"dflash": "incoai/Qwen3.8-27B-DFlash2"}, published={"dflash": {
        "hidden_size": 5120, "vocab_size": 248320, "block_size": 8, "mask_token_id": 248070,
        "target_layer_ids": [5, 19, 33, 47, 61]}}),
    # The pairing is published (z-lab's DFlash collection, vLLM/SGLang recipes); its config values
    # were not found in a citable source here, so nothing is checked beyond the load-time pairing.
    "qwen3.6-27b": Entry({"dflash": "z-lab/Qwen3.6-27B-DFlash"}),
    # gpt-oss (MoE, sliding-window attention with sinks): listed as supported in z-lab/dflash's README.
    "gpt-oss-20b": Entry({"dflash": "z-lab/gpt-oss-20b-DFlash"}),
    # Gemma 4 MoE (sliding-window attention): huggingface.co/makora-ai/gemma4-26b-a4b-dspark's card
    # (speculators format, 5 layers, Markov rank 256, draft vocabulary 32,000 mapped to 262,144).
    # Gemma 4 is not tappable here yet (engine/model/target.py), so `auto` skips it.
    "gemma-4-26b-a4b-it": Entry({"dspark": "makora-ai/gemma4-26b-a4b-dspark"}, published={"dspark": {
        "block_size": 7, "target_layer_ids": [3, 10, 18, 25, 28], "markov_rank": 256}}),
}


def published_config(config: dict) -> dict:
    """The values a registry row pins, read from a head's config.json (flat or nested)."""
    nested = config.get("dflash_config") or config.get("dspark_config") or {}
    out = {}
    for key in ("hidden_size", "vocab_size", "block_size", "mask_token_id", "target_layer_ids", "markov_rank"):
        value = nested.get(key, config.get(key))
        if value is not None:
            out[key] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def published_mismatches(spec: str, config: dict) -> list[str]:
    """Where a registered checkpoint's config differs from its published values (a re-upload,
    another revision, a wrong file): one line each; [] for unregistered checkpoints."""
    have = published_config(config)
    out = []
    for entry in PUBLISHED.values():
        for mode, repo in entry.heads.items():
            if repo != spec:
                continue
            for key, want in entry.published.get(mode, {}).items():
                if key in have and have[key] != want:
                    out.append(f"{spec}: {key} is {have[key]}, the published checkpoint has {want}")
    return out

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
        resolve_path(spec, allow_download=False)
        return True
    except Exception:
        return False
