"""The prefix cache's disk tier: KV segments as safetensors files that survive restarts.

A file holds one edge of the prefix tree: its tokens and per-layer KV arrays. Its name
carries the hash of every token before the edge (the parent's key), the hash through
its end, and a digest of the file's bytes:

    <dir>/<identity>/<parent key>_<end key>_<digest>.safetensors

Keys are seeded with the model identity (weights, config, dtype, KV bits, MLX
version), which also names the folder, so another model's files are never read.
A file that is truncated, corrupt or foreign is skipped with a warning and never
trusted: the digest is checked before anything is loaded. Writes go to a temp file
then os.replace; the size cap deletes the oldest files first (loads refresh mtime).
Writing happens on a background thread (kv_disk_writer.py) as segments are made; the
index is shared with it under a lock.
"""

from __future__ import annotations

import array
import collections
import hashlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.caches.kv_disk_writer import DiskWriter, FileJob, host_tensor

log = logging.getLogger(__name__)

FORMAT = "mlx-dspark-kv/1"
CHECKPOINT = "ckpt"  # the "parent" part of a whole-state checkpoint's file name
SUFFIX = ".safetensors"
KEY_CHARS = 32
STALE_TMP_S = 3600


@dataclass
class DiskEntry:
    path: Path
    parent: str
    end: str
    digest: str
    size: int
    tokens: array.array | None = None  # read lazily from the file (4 bytes a token)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def read_tokens(path: Path) -> array.array:
    """The `tokens` tensor of a safetensors file, read without loading the KV arrays."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > 64 << 20:
            raise ValueError("header longer than the file")
        header = json.loads(f.read(n))
        info = header["tokens"]
        a, b = info["data_offsets"]
        if info["dtype"] != "I32" or not 0 <= a <= b or 8 + n + b > size:
            raise ValueError("bad tokens entry")
        f.seek(8 + n + a)
        raw = f.read(b - a)
    tokens = array.array("i")
    tokens.frombytes(raw)
    if len(tokens) != info["shape"][0]:
        raise ValueError("tokens shape mismatch")
    return tokens


def read_metadata(path: Path) -> dict:
    """The `__metadata__` of a safetensors file, read without its arrays."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > 64 << 20:
            raise ValueError("header longer than the file")
        return json.loads(f.read(n)).get("__metadata__", {})


class DiskTier:
    def __init__(self, root: str | os.PathLike, identity: str, max_bytes: int):
        self.root = Path(root).expanduser()
        self.identity = identity
        self.dir = self.root / identity
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.index: dict[str, list[DiskEntry]] = {}
        self.by_end: dict[str, DiskEntry] = {}
        self.nbytes = 0
        self.writes = self.loads = self.skipped = self.deleted = 0
        self.lock = threading.RLock()  # the index is shared with the writer thread
        self.queued_parents: collections.Counter = collections.Counter()  # files queued, by parent key
        self._scan()
        self.writer = DiskWriter(self.dir, SUFFIX)

    # -- index ----------------------------------------------------------------------

    def _scan(self) -> None:
        now = time.time()
        for p in self.dir.iterdir():
            name = p.name
            if name.startswith(".tmp-"):
                try:  # left by a crash mid-write; young ones may belong to a live writer
                    if now - p.stat().st_mtime > STALE_TMP_S:
                        p.unlink()
                except OSError:
                    pass
                continue
            parts = name[: -len(SUFFIX)].split("_") if name.endswith(SUFFIX) else []
            if len(parts) != 3:
                continue
            try:
                size = p.stat().st_size
            except OSError:
                continue
            self._add(DiskEntry(p, parts[0], parts[1], parts[2], size))

    def _add(self, e: DiskEntry) -> None:
        with self.lock:
            self._add_locked(e)

    def _add_locked(self, e: DiskEntry) -> None:
        self.index.setdefault(e.parent, []).append(e)
        self.by_end[e.end] = e
        self.nbytes += e.size

    def _drop(self, e: DiskEntry, unlink: bool) -> None:
        with self.lock:
            self._drop_locked(e)
        if unlink:
            try:
                e.path.unlink()
            except OSError:
                pass

    def _drop_locked(self, e: DiskEntry) -> None:
        entries = self.index.get(e.parent, [])
        if e in entries:
            entries.remove(e)
            if not entries:
                del self.index[e.parent]
            self.nbytes -= e.size
        if self.by_end.get(e.end) is e:
            del self.by_end[e.end]

    def skip(self, e: DiskEntry, why: str) -> None:
        """Never trust this file again (unreadable, corrupt, or not this model's layout): a warning,
        and it is deleted."""
        log.warning("prefix cache: skipping %s: %s", e.path, why)
        self.skipped += 1
        self._drop(e, unlink=True)  # in our own identity's folder: useless to anyone

    def delete_all(self) -> None:
        """Delete every file of this identity (the prefix cache's clear)."""
        with self.lock:
            entries = list(self.by_end.values())
        for e in entries:
            self._drop(e, unlink=True)

    @property
    def files(self) -> int:
        return len(self.by_end)

    # -- reading --------------------------------------------------------------------

    def best(self, parent_key: str, tokens: list[int], exclude: set) -> tuple[DiskEntry, int] | None:
        """The file continuing `parent_key` that matches most of `tokens`, and how many it matches."""
        parent = parent_key[:KEY_CHARS]
        if self.queued_parents.get(parent):  # a file that may continue here is being written
            self.writer.flush(timeout=30)
        best = None
        with self.lock:
            entries = list(self.index.get(parent, ()))
        for e in entries:
            if e.path in exclude:
                continue
            if e.tokens is None:
                try:
                    e.tokens = read_tokens(e.path)
                except Exception as err:  # truncated or not ours: never trusted
                    self.skip(e, f"unreadable header ({err})")
                    continue
            k = 0
            for a, b in zip(e.tokens, tokens):
                if a != b:
                    break
                k += 1
            if k and (best is None or k > best[1]):
                best = (e, k)
        return best

    def load(self, e: DiskEntry) -> tuple[list[int], list[list[mx.array]]] | None:
        """(tokens, segment) from a file, or None (with a warning) if it can't be trusted."""
        try:
            data = e.path.read_bytes()
        except OSError as err:
            self.skip(e, str(err))
            return None
        if _digest(data) != e.digest:
            self.skip(e, "content digest mismatch (truncated or corrupt)")
            return None
        try:
            arrays, meta = mx.load(str(e.path), return_metadata=True)
            if meta.get("format") != FORMAT or meta.get("identity") != self.identity:
                raise ValueError(f"written by another model or version ({meta.get('identity')})")
            if meta.get("parent", "")[:KEY_CHARS] != e.parent or meta.get("end", "")[:KEY_CHARS] != e.end:
                raise ValueError("keys don't match the file name")
            tokens = arrays.pop("tokens").tolist()
            n_layers, per_layer = int(meta["layers"]), int(meta["arrays"])
            segment = [[arrays[f"l{i}.{j}"] for j in range(per_layer)] for i in range(n_layers)]
            if len(arrays) != n_layers * per_layer:
                raise ValueError("unexpected arrays")
            mx.eval(segment)  # now, while the file is surely there
        except Exception as err:
            self.skip(e, str(err))
            return None
        e.tokens = array.array("i", tokens)
        self.loads += 1
        try:
            os.utime(e.path)  # recently used: last to go under the cap
        except OSError:
            pass
        return tokens, segment

    # -- writing --------------------------------------------------------------------

    def write(self, parent_key: str, end_key: str, tokens: list[int], segment: list[list[mx.array]]) -> bool:
        """Queue a segment's file for the background writer; False if it can't be queued."""
        parent, end = parent_key[:KEY_CHARS], end_key[:KEY_CHARS]
        if end in self.by_end:
            return True
        tok = mx.array(tokens, dtype=mx.int32)
        mx.eval(tok)
        tensors = [host_tensor("tokens", tok)]
        for i, layer in enumerate(segment):
            for j, a in enumerate(layer):
                tensors.append(host_tensor(f"l{i}.{j}", a))
        meta = {"format": FORMAT, "identity": self.identity, "parent": parent, "end": end,
                "layers": str(len(segment)), "arrays": str(len(segment[0]) if segment else 0)}
        token_array = array.array("i", tokens)

        def written(path: Path, digest: str, size: int) -> None:  # on the writer thread
            with self.lock:
                self.queued_parents[parent] -= 1
                self._add_locked(DiskEntry(path, parent, end, digest, size, token_array))
                self.writes += 1
            self.enforce_cap()

        with self.lock:
            self.queued_parents[parent] += 1
        if not self.writer.submit(FileJob(f"{parent}_{end}", tensors, meta, written)):
            with self.lock:
                self.queued_parents[parent] -= 1
            return False
        return True

    # -- whole-state checkpoints (sliding-window and recurrent models) -------------------
    # mlx-lm's prompt-cache file layout (mlx_lm.models.cache.load_prompt_cache reads it), named
    # ckpt_<hash of its tokens>_<digest>.safetensors; its tokens are in the metadata.

    def write_checkpoint(self, key: str, tokens: list[int], cache: list) -> bool:
        from mlx.utils import tree_flatten

        key = key[:KEY_CHARS]
        if key in self.by_end:
            return True
        scalars: list = [""]  # as save_prompt_cache: non-array state as arrays, noted here
        items = []
        for name, data in tree_flatten([c.state for c in cache]):
            if not isinstance(data, mx.array):
                kind = "none" if data is None else "string" if isinstance(data, str) else "scalar"
                if kind == "string":
                    data = mx.array([ord(ch) for ch in data])
                else:
                    data = mx.array([]) if data is None else mx.array(data)
                scalars.append((name, kind))
            items.append((name, data))
        mx.eval([a for _, a in items])
        tensors = [host_tensor(name, a) for name, a in items]
        own = {"format": FORMAT, "identity": self.identity, "tokens": json.dumps(list(tokens))}
        meta = dict(tree_flatten([own, [type(c).__name__ for c in cache], scalars]))
        token_array = array.array("i", tokens)

        def written(path: Path, digest: str, size: int) -> None:  # on the writer thread
            with self.lock:
                self._add_locked(DiskEntry(path, CHECKPOINT, key, digest, size, token_array))
                self.writes += 1
            self.enforce_cap()

        return self.writer.submit(FileJob(f"{CHECKPOINT}_{key}", tensors, meta, written))

    def best_checkpoint(self, wanted: list[int], longer_than: int) -> DiskEntry | None:
        """The longest checkpoint file whose tokens start `wanted`, if longer than `longer_than`."""
        best = None
        with self.lock:
            entries = list(self.index.get(CHECKPOINT, ()))
        for e in entries:
            if e.tokens is None:
                try:
                    e.tokens = array.array("i", json.loads(read_metadata(e.path)["0.tokens"]))
                except Exception as err:
                    self.skip(e, f"unreadable header ({err})")
                    continue
            n = len(e.tokens)
            if longer_than < n <= len(wanted) and (best is None or n > len(best.tokens)):
                if e.tokens.tolist() == wanted[:n]:
                    best = e
        return best

    def load_checkpoint(self, e: DiskEntry, n_layers: int) -> list | None:
        from mlx_lm.models.cache import load_prompt_cache

        try:
            if _digest(e.path.read_bytes()) != e.digest:
                raise ValueError("content digest mismatch (truncated or corrupt)")
            cache, meta = load_prompt_cache(str(e.path), return_metadata=True)
            if meta.get("format") != FORMAT or meta.get("identity") != self.identity:
                raise ValueError(f"written by another model or version ({meta.get('identity')})")
            if json.loads(meta["tokens"]) != e.tokens.tolist() or len(cache) != n_layers:
                raise ValueError("tokens or layers don't match")
            mx.eval([c.state for c in cache])
        except Exception as err:
            self.skip(e, str(err))
            return None
        self.loads += 1
        return cache

    @property
    def writable(self) -> bool:
        return self.writer.failed is None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued files to be written."""
        return self.writer.flush(timeout)

    def close(self, timeout: float | None = 60.0) -> bool:
        return self.writer.close(timeout)

    def enforce_cap(self) -> None:
        """Delete the oldest files under the cache folder (every identity's) until under the cap."""
        files = []
        for p in self.root.rglob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, p, st.st_size))
        total = sum(f[2] for f in files)
        if total <= self.max_bytes:
            return
        with self.lock:
            ours = {e.path: e for e in self.by_end.values()}
        for _, p, size in sorted(files, key=lambda f: (f[0], str(f[1]))):
            if total <= self.max_bytes:
                break
            if p in ours:
                self._drop(ours[p], unlink=True)
            else:
                try:
                    p.unlink()
                except OSError:
                    continue
            total -= size
            self.deleted += 1
