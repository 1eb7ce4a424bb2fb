"""Download a model (and its registered drafter head) from the Hugging Face hub, then check it.

`huggingface_hub.snapshot_download` does the work: files land in the shared hub cache
(where `mlx-dspark models` and `--model HUB_ID` find them) and it draws progress bars. Before
that, one short request tells "offline" apart at once; after it, the folder must hold a
config mlx-lm can build and every weight file whole, and a head must fit the model.

Weight files are fetched first by `fetch_weights`, into the cache's blob folder: huggingface_hub
2.x resumes a cut file within a run only (each download has a temporary name of its own, deleted
on failure), so a pull killed at 20 of 30 GB would start that file over. Ours keep their bytes
in `blobs/<etag>.part` across processes and continue with a Range request; a finished part is
checked (size, and SHA-256 where the hub's ETag is one) and renamed to the blob, which
snapshot_download then only links.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from engine.base.errors import ModelLoadError
from engine.catalog.model_catalog import cache_rollback, registered_heads, weights_missing
from engine.drafting.heads.loading import DrafterLoadError, check_configs
from engine.model.config import read_config

# What running a model needs: configs, weights, tokenizer and chat template files. Not *.py
# (remote code is never run) nor other frameworks' weights (*.bin, *.pth, *.gguf).
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
HEAD_FILES = ["*.json", "*.safetensors"]
PROBE_TIMEOUT_S = 5.0
FETCH_ATTEMPTS = 5  # a dropped connection is resumed this many times within one run


class PullError(ModelLoadError):
    pass


@dataclass
class Pulled:
    repo_id: str
    path: Path
    drafters: dict[str, Path] = field(default_factory=dict)  # hub id -> folder
    notes: list[str] = field(default_factory=list)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def probe(repo_id: str, revision: str | None = None) -> None:
    """One short request: offline, unreachable, unknown or gated fails here, at once."""
    import httpx

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise PullError(f"can't download {repo_id}: offline mode is on (HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']}); "
                        "`mlx-dspark models` lists what is already on this machine")
    url = f"{endpoint()}/api/models/{repo_id}" + (f"/revision/{revision}" if revision else "")
    headers = {}
    token = os.environ.get("HF_TOKEN")
    if token:
        headers["authorization"] = f"Bearer {token}"
    try:
        r = httpx.get(url, headers=headers, timeout=PROBE_TIMEOUT_S, follow_redirects=True)
    except httpx.HTTPError as e:
        raise PullError(f"can't download {repo_id}: {endpoint()} is unreachable ({type(e).__name__}: {e}); "
                        "offline? `mlx-dspark models` lists what is already on this machine") from None
    if r.status_code == 404:
        raise PullError(f"no model {repo_id!r}" + (f" at revision {revision!r}" if revision else "") + f" on {endpoint()}")
    if r.status_code in (401, 403):
        raise PullError(f"{repo_id} needs access: accept its terms on the hub and set HF_TOKEN")
    if r.status_code >= 400:
        raise PullError(f"can't download {repo_id}: {endpoint()} answered {r.status_code}")


def check_model(path: Path) -> None:
    """A pulled folder is usable: config mlx-lm can build, weights whole, a tokenizer."""
    config = read_config(path)
    if config is None or "model_type" not in config:
        raise PullError(f"{path}: no usable config.json (is this an MLX/transformers model repository?)")
    _, problem = cache_rollback(config)
    if problem:
        raise PullError(f"{path}: {problem}")
    missing = weights_missing(path)
    if missing:
        raise PullError(f"{path}: weights incomplete ({', '.join(missing)}); if the download was cut, run pull again")
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise PullError(f"{path}: no tokenizer files")


class _Nowhere:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def reporting_bars(repo_id: str, on_progress):
    """A tqdm class for snapshot_download that hands its counts to `on_progress` as events
    ({"repo", "kind": "files" | "bytes", "done", "total"}) and draws nothing."""
    from tqdm.auto import tqdm

    kinds = {"Downloading bytes": "bytes"}
    lock = threading.RLock()

    class ReportingBar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # huggingface_hub's own bar option
            super().__init__(*args, **{**kwargs, "disable": False, "file": _Nowhere()})

        def update(self, n=1):
            with lock:  # files download in threads: counts go out in order
                shown = super().update(n)
                desc = str(self.desc or "")
                kind = "files" if desc.startswith("Fetching") else kinds.get(desc)
                if kind:
                    on_progress({"repo": repo_id, "kind": kind, "done": int(self.n), "total": int(self.total or 0)})
            return shown

    return ReportingBar


def _auth() -> dict:
    token = os.environ.get("HF_TOKEN")
    return {"authorization": f"Bearer {token}"} if token else {}


def fetch_weights(repo_id: str, revision: str | None, progress: bool, on_progress=None) -> None:
    """Each *.safetensors file of the repository not yet in the hub cache, fetched resumably
    into its blob (see the module's docstring). `on_progress` gets {"kind": "weights"} events:
    bytes of all the weight files together (those already whole count as done)."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.file_download import repo_folder_name

    info = HfApi(endpoint=endpoint()).model_info(repo_id, revision=revision)
    blobs = Path(HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"
    files = []
    for name in sorted(s.rfilename for s in info.siblings or [] if s.rfilename.endswith(".safetensors")):
        url = hf_hub_url(repo_id, name, revision=info.sha, endpoint=endpoint())
        meta = get_hf_file_metadata(url, headers=_auth())
        if meta.etag and meta.size is not None:
            files.append((name, meta.location or url, meta.etag, meta.size))
    total = sum(size for *_, size in files)
    done = 0
    for name, url, etag, size in files:
        if not (blobs / etag).exists():
            blobs.mkdir(parents=True, exist_ok=True)
            sha = etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None
            report = None
            if on_progress:
                report = lambda n, base=done: on_progress(  # noqa: E731
                    {"repo": repo_id, "kind": "weights", "file": name, "done": base + n, "total": total})
            fetch_resumable(url, blobs / etag, size, sha, name, progress, report)
        done += size
        if on_progress:
            on_progress({"repo": repo_id, "kind": "weights", "file": name, "done": done, "total": total})


def fetch_resumable(url: str, dest: Path, size: int, sha256: str | None, name: str = "", progress: bool = False,
                    on_bytes=None) -> None:
    """`url`'s bytes to `dest`, through `dest.part`: what an earlier (killed) run left there is kept
    and continued with `Range: bytes=N-`; the whole is checked before it takes dest's name.
    `on_bytes(n)`: n bytes of the file are on disk."""
    import httpx
    from tqdm.auto import tqdm

    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    bar = tqdm(total=size, initial=have, unit="B", unit_scale=True, desc=name, disable=not progress)
    try:
        for _ in range(FETCH_ATTEMPTS):
            if have >= size:
                break
            try:
                headers = {**_auth(), **({"Range": f"bytes={have}-"} if have else {})}
                with httpx.stream("GET", url, headers=headers, follow_redirects=True, timeout=30.0) as r:
                    r.raise_for_status()
                    if have and r.status_code != 206:  # the server sent it all again: start over
                        have = 0
                        bar.reset(total=size)
                    # unbuffered: what was received is on disk if the process is killed
                    with part.open("ab" if have else "wb", buffering=0) as f:
                        for chunk in r.iter_bytes(1 << 20):
                            f.write(chunk)
                            have += len(chunk)
                            bar.update(len(chunk))
                            if on_bytes:
                                on_bytes(have)
            except httpx.HTTPStatusError as e:
                raise PullError(f"{name}: the hub answered {e.response.status_code}") from None
            except (httpx.TransportError, OSError):  # a dropped connection: resumed from what was written
                have = part.stat().st_size if part.exists() else 0
    finally:
        bar.close()
    if have != size:
        raise PullError(f"{name}: {have} of {size} bytes received; run pull again to resume")
    if sha256 is not None and _sha256(part) != sha256:
        part.unlink()
        raise PullError(f"{name}: the downloaded bytes don't match the hub's SHA-256; run pull again")
    part.replace(dest)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def download(repo_id: str, patterns: list[str], revision: str | None, progress: bool, on_progress=None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    bars = reporting_bars(repo_id, on_progress) if on_progress else None
    try:
        if "*.safetensors" in patterns:
            fetch_weights(repo_id, revision, progress, on_progress)
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, tqdm_class=bars))
    except PullError:
        raise
    except Exception as e:  # hub errors come in many kinds: one line for the user
        raise PullError(f"download of {repo_id} failed: {type(e).__name__}: {e}; run pull again to resume") from None
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()


def pull_head(head_id: str, target: Path, progress: bool, say=print, on_progress=None) -> Path:
    """Download a drafter head and check it fits the target (from both configs)."""
    probe(head_id)
    say(f"pulling drafter {head_id}")
    path = download(head_id, HEAD_FILES, None, progress, on_progress)
    head_config = read_config(path)
    if head_config is None:
        raise PullError(f"{head_id}: no config.json")
    try:
        check_configs(head_config, read_config(target) or {}, f"drafter {head_id}")
    except DrafterLoadError as e:
        raise PullError(str(e)) from None
    return path


def pull(repo_id: str, revision: str | None = None, drafter: bool | str = False, progress: bool = True,
         say=print, on_progress=None) -> Pulled:
    """Download `repo_id` (and with `drafter`, its registered heads, or the head named) and check them.
    `progress` draws huggingface_hub's bars; `on_progress(event)` gets the counts instead (a web app)."""
    probe(repo_id, revision)
    say(f"pulling {repo_id} from {endpoint()}")
    path = download(repo_id, MODEL_FILES, revision, progress, on_progress)
    check_model(path)
    result = Pulled(repo_id, path)
    heads = [drafter] if isinstance(drafter, str) else list(registered_heads(repo_id).values()) if drafter else []
    if drafter is True and not heads:
        result.notes.append(f"no drafter head is registered for {repo_id}; lookup drafting needs none")
    for head_id in heads:
        try:
            result.drafters[head_id] = pull_head(head_id, path, progress, say, on_progress)
        except PullError as e:
            if isinstance(drafter, str):  # the head the user named: its failure is the command's
                raise
            result.notes.append(f"drafter {head_id} not fetched: {e}")
    return result
