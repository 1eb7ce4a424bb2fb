"""Every MLX model on this machine, described from its files without loading its weights.

Where models live: the bundled reference model, the Hugging Face cache
(`huggingface_hub.scan_cache_dir`), LM Studio's folders, and folders the user adds
(`--models-dir`, or `models_dirs` in `~/.config/mlx-dspark/config.toml`). For each: its
architecture, parameter count (from the safetensors headers), quantisation, size on disk,
context length, how its cache is rolled back (mlx-lm's own cache objects, built lazily:
no weights are read), its drafters, and its chat template's tool-call and reasoning format
(mlx-lm's own inference from the template and vocabulary).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.base.bundled import bundled_models
from engine.base.files import config_dir
from engine.caches.kinds import kind_of
from engine.drafting.heads.loading import pairing_problems
from engine.drafting.heads.registry import Entry, PUBLISHED, base_name
from engine.model.config import quantization_of, read_config, text_config
from engine.model.vision import image_support

LMSTUDIO_DIRS = ("~/.lmstudio/models", "~/.cache/lm-studio/models")
MAX_DEPTH = 4  # publisher/model/revision-like nesting under a models folder
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel")


@dataclass
class ModelInfo:
    name: str
    path: str
    source: str  # bundled, hf-cache, lmstudio, or the folder it was found under
    architecture: str = "?"
    model_type: str = "?"
    parameters: int | None = None
    quantization: str | None = None  # "4-bit (group 64)", "mxfp4", or None for float weights
    dtype: str | None = None
    size_bytes: int = 0
    context_length: int | None = None
    cache_rollback: str = "?"  # "trimmable" (cut per token) or "checkpoints" (whole-state snapshots)
    drafters: dict[str, str] = field(default_factory=dict)  # mode -> path or hub id
    drafters_to_download: list[str] = field(default_factory=list)  # registered modes not on this machine yet
    tool_call_format: str | None = None
    reasoning_format: str | None = None
    images: str | None = None  # a VLM: "yes", or why its images become placeholders (engine/model/vision.py)
    loads: bool = True
    problem: str | None = None  # why it can't run (unsupported type, weights incomplete)

    def to_dict(self) -> dict:
        return asdict(self)


def configured_model_dirs() -> list[Path]:
    """`models_dirs = [...]` from config.toml in the config dir (absent file: none)."""
    import tomllib

    path = config_dir() / "config.toml"
    if not path.exists():
        return []
    try:
        dirs = tomllib.loads(path.read_text()).get("models_dirs", [])
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return []
    return [Path(d).expanduser() for d in dirs if isinstance(d, str)]


# -- reading a model folder ------------------------------------------------------------

def is_drafter(config: dict) -> bool:
    archs = config.get("architectures") or []
    return any(a in DRAFTER_ARCHITECTURES or "DFlash" in a or "DSpark" in a for a in archs if isinstance(a, str))


def safetensors_header(file: Path) -> dict:
    """The tensor table of a .safetensors file (8-byte length, then JSON); raises if unreadable."""
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header["__data_start__"] = 8 + n
    return header


def _tensors(header: dict):
    return ((k, t) for k, t in header.items() if k not in ("__metadata__", "__data_start__"))


def weights_missing(path: Path) -> list[str]:
    """Weight files the folder needs but lacks (an interrupted download): the index's files,
    or any weights at all; a file whose header is unreadable counts as missing."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            wanted = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError):
            return [index.name]
    else:
        wanted = sorted(p.name for p in path.glob("*.safetensors")) or ["*.safetensors"]
    missing = []
    for name in wanted:
        f = path / name
        try:
            header = safetensors_header(f)
            end = max((t["data_offsets"][1] for _, t in _tensors(header)), default=0)
            if f.stat().st_size < header["__data_start__"] + end:  # a download cut short
                missing.append(name)
        except (OSError, ValueError, struct.error):
            missing.append(name)
    return missing


def count_parameters(path: Path, config: dict) -> int | None:
    """Parameters from the safetensors headers; packed quantised weights count unpacked."""
    bits = (config.get("quantization") or {}).get("bits") if isinstance(config.get("quantization"), dict) else None
    total = 0
    try:
        headers = [safetensors_header(f) for f in sorted(path.glob("*.safetensors"))]
    except (OSError, ValueError, struct.error):
        return None
    names = {k for h in headers for k in h}
    for h in headers:
        for name, t in _tensors(h):
            if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in names:
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            if t["dtype"] == "U32" and bits and name[: -len("weight")] + "scales" in names:
                n = n * 32 // bits
            total += n
    return total or None


def size_on_disk(path: Path) -> int:
    total = 0
    for f in path.iterdir():
        try:
            if f.is_file():
                total += f.stat().st_size  # follows the hub cache's symlinks to their blobs
        except OSError:
            pass
    return total


def cache_rollback(config: dict) -> tuple[str, str | None]:
    """("trimmable" | "checkpoints", problem): from mlx-lm's own cache objects for this config,
    each asked whether it cuts per token (engine/caches/kinds.py). The model is built lazily
    (parameters are never evaluated), so no weights are read."""
    try:
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(config)
        caches = make_prompt_cache(model_class(args_class.from_dict(config)))
    except Exception as e:  # not an mlx-lm family (or a config it can't read)
        return "?", f"mlx-lm can't build it: {type(e).__name__}: {e}"
    trimmable = all(kind_of(c).cuts_per_token for c in caches)
    return ("trimmable" if trimmable else "checkpoints"), None


class _TemplateView:
    """What mlx-lm's format inference reads of a tokenizer: its chat template and vocabulary."""

    def __init__(self, path: Path):
        self.chat_template = None
        cfg = {}
        try:
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            pass
        self.chat_template = cfg.get("chat_template")
        for name in ("chat_template.jinja", "chat_template.json"):
            f = path / name
            if self.chat_template is None and f.exists():
                text = f.read_text()
                self.chat_template = json.loads(text).get("chat_template") if name.endswith("json") else text
        self.vocab: dict[str, int] = {}
        try:
            tok = json.loads((path / "tokenizer.json").read_text())
            vocab = (tok.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                self.vocab.update(vocab)
            for t in tok.get("added_tokens") or []:
                self.vocab[t["content"]] = t["id"]
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return []  # only the markers' strings are reported


def chat_formats(path: Path) -> tuple[str | None, str | None]:
    """(tool-call format, reasoning markers) as mlx-lm infers them for this tokenizer."""
    try:
        from mlx_lm.tokenizer_utils import _infer_thinking, _infer_tool_parser
    except ImportError:
        return None, None
    view = _TemplateView(path)
    tools = thinking = None
    try:
        tools = _infer_tool_parser(view)
        if tools is None and isinstance(view.chat_template, str) and "<tool_call>" in view.chat_template:
            tools = "json_tools"  # Hermes-style, what the server falls back to
        start, end = _infer_thinking(view)[:2]
        thinking = f"{start}...{end}" if start else None
    except Exception:
        pass
    return tools, thinking


# -- drafters --------------------------------------------------------------------------

def heads_beside(path: Path, config: dict) -> dict[str, str]:
    """Drafter heads in the model's `drafters/` folder or next to it that fit it."""
    found: dict[str, str] = {}
    candidates = sorted((path / "drafters").glob("*")) + sorted(path.parent.glob("*"))
    for d in candidates:
        if d == path or not d.is_dir():
            continue
        head = read_config(d)
        if head is None or not is_drafter(head) or pairing_problems(head, config):
            continue
        arch = (head.get("architectures") or ["?"])[0]
        kind = "dspark" if "DSpark" in arch else "dflash"
        found.setdefault(kind, str(d))
    return found


def head_on_disk(spec: str) -> bool:
    """A head folder, or a hub id whose snapshot is in the hub cache (nothing is fetched)."""
    if Path(spec).expanduser().is_dir():
        return True
    repo = hub_cache_dir() / ("models--" + spec.replace("/", "--"))
    return any((snap / "config.json").exists() for snap in (repo / "snapshots").glob("*"))


def registered_heads(name: str) -> dict[str, str]:
    return dict(PUBLISHED.get(base_name(name), Entry()).heads)


# -- describing and finding ------------------------------------------------------------

def describe(path: Path, name: str, source: str) -> ModelInfo:
    path = Path(path)
    config = read_config(path) or {}
    inner = text_config(config)
    info = ModelInfo(name=name, path=str(path), source=source)
    info.model_type = str(config.get("model_type", "?"))
    info.architecture = str((config.get("architectures") or [info.model_type])[0])
    info.quantization = quantization_of(config)
    info.dtype = inner.get("torch_dtype") or inner.get("dtype")
    info.size_bytes = size_on_disk(path)
    ctx = inner.get("max_position_embeddings") or inner.get("max_sequence_length") or inner.get("seq_length")
    info.context_length = int(ctx) if isinstance(ctx, (int, float)) else None
    missing = weights_missing(path)
    if missing:
        info.loads, info.problem = False, f"weights incomplete: {', '.join(missing[:3])} missing or truncated"
    else:
        info.parameters = count_parameters(path, config)
    info.cache_rollback, problem = cache_rollback(config)
    if problem and info.loads:
        info.loads, info.problem = False, problem
    info.drafters = {**registered_heads(name), **heads_beside(path, config)}
    info.drafters_to_download = sorted(m for m, spec in info.drafters.items() if not head_on_disk(spec))
    info.tool_call_format, info.reasoning_format = chat_formats(path)
    info.images = image_support(config)
    return info


def model_folders(root: Path, depth: int = MAX_DEPTH):
    """Folders under root holding a model's config.json and safetensors (drafter heads excluded)."""
    try:
        root = root.expanduser()
        if not root.is_dir():
            return
        entries = sorted(root.iterdir())
    except OSError:
        return
    config = read_config(root)
    if config is not None and "model_type" in config and not is_drafter(config) \
            and (any(root.glob("*.safetensors")) or (root / "model.safetensors.index.json").exists()):
        yield root
        return
    if depth > 0:
        for child in entries:
            if child.is_dir() and not child.name.startswith("."):
                yield from model_folders(child, depth - 1)


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read now (its constants are read at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_cache_models() -> list[tuple[str, Path]]:
    """(repo id, newest snapshot folder) of every model repo in the Hugging Face cache (heads excepted)."""
    try:
        from huggingface_hub import scan_cache_dir

        repos = scan_cache_dir(hub_cache_dir()).repos
    except Exception:  # no cache yet, or an unreadable one
        return []
    out = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        config = read_config(Path(newest.snapshot_path))
        if config is not None and not is_drafter(config):  # drafter heads are listed with their models
            out.append((repo.repo_id, Path(newest.snapshot_path)))
    return out


def model_locations(extra_dirs: list[str | Path] = (), include_bundled: bool = True) -> list[tuple[str, Path, str]]:
    """(name, folder, source) of every model on this machine, each folder once (the first
    source that names it wins). Cheap: reads no weights and builds nothing."""
    found: list[tuple[str, Path, str]] = []
    if include_bundled:
        found += [(name, path, "bundled") for name, path in bundled_models()]
    found += [(repo_id, snap, "hf-cache") for repo_id, snap in hub_cache_models()]
    for root in LMSTUDIO_DIRS:
        base = Path(root).expanduser()
        found += [(str(p.relative_to(base)), p, "lmstudio") for p in model_folders(base)]
    for root in [*map(Path, extra_dirs), *configured_model_dirs()]:
        base = root.expanduser()
        found += [(str(p.relative_to(base)) if p != base else p.name, p, str(base)) for p in model_folders(base)]
    seen: set[Path] = set()
    out = []
    for name, path, source in found:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            out.append((name, path, source))
    return out


def find_models(extra_dirs: list[str | Path] = (), include_bundled: bool = True) -> list[ModelInfo]:
    """Every model on this machine, described."""
    out = []
    for name, path, source in model_locations(extra_dirs, include_bundled):
        info = describe(path, name, source)
        if source == "bundled":  # a bundled model's own heads live in its drafters/ folder
            info.drafters = {p.name: str(p) for p in sorted((path / "drafters").glob("*")) if (p / "config.json").exists()}
        out.append(info)
    return out


def local_models(extra_dirs: list = ()) -> list[dict]:
    """Every model on this machine as dicts (below), the bundled one first."""
    return [m.to_dict() for m in find_models(extra_dirs)]
