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
"""

from __future__ import annotations

import hashlib
import array
import json
import logging
import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

log = logging.getLogger(__name__)

FORMAT = "mlx-dspark-kv/1"
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
        self._scan()

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
        self.index.setdefault(e.parent, []).append(e)
        self.by_end[e.end] = e
        self.nbytes += e.size

    def _drop(self, e: DiskEntry, unlink: bool) -> None:
        entries = self.index.get(e.parent, [])
        if e in entries:
            entries.remove(e)
            if not entries:
                del self.index[e.parent]
            self.nbytes -= e.size
        if self.by_end.get(e.end) is e:
            del self.by_end[e.end]
        if unlink:
            try:
                e.path.unlink()
            except OSError:
                pass

    def _skip(self, e: DiskEntry, why: str) -> None:
        log.warning("prefix cache: skipping %s: %s", e.path, why)
        self.skipped += 1
        self._drop(e, unlink=True)  # in our own identity's folder: useless to anyone

    @property
    def files(self) -> int:
        return len(self.by_end)

    # -- reading --------------------------------------------------------------------

    def best(self, parent_key: str, tokens: list[int], exclude: set) -> tuple[DiskEntry, int] | None:
        """The file continuing `parent_key` that matches most of `tokens`, and how many it matches."""
        best = None
        for e in list(self.index.get(parent_key[:KEY_CHARS], ())):
            if e.path in exclude:
                continue
            if e.tokens is None:
                try:
                    e.tokens = read_tokens(e.path)
                except Exception as err:  # truncated or not ours: never trusted
                    self._skip(e, f"unreadable header ({err})")
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
            self._skip(e, str(err))
            return None
        if _digest(data) != e.digest:
            self._skip(e, "content digest mismatch (truncated or corrupt)")
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
            self._skip(e, str(err))
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
        parent, end = parent_key[:KEY_CHARS], end_key[:KEY_CHARS]
        if end in self.by_end:
            return True
        arrays = {"tokens": mx.array(tokens, dtype=mx.int32)}
        for i, layer in enumerate(segment):
            for j, a in enumerate(layer):
                arrays[f"l{i}.{j}"] = a
        meta = {"format": FORMAT, "identity": self.identity, "parent": parent, "end": end,
                "layers": str(len(segment)), "arrays": str(len(segment[0]) if segment else 0)}
        tmp = self.dir / f".tmp-{uuid.uuid4().hex}{SUFFIX}"
        try:
            mx.save_safetensors(str(tmp), arrays, metadata=meta)
            data = tmp.read_bytes()
            digest = _digest(data)
            final = self.dir / f"{parent}_{end}_{digest}{SUFFIX}"
            os.replace(tmp, final)
        except Exception as err:  # a full disk or a read-only folder must not fail the request
            log.warning("prefix cache: could not write to %s: %s", self.dir, err)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
        self._add(DiskEntry(final, parent, end, digest, len(data), array.array("i", tokens)))
        self.writes += 1
        self.enforce_cap()
        return True

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
