"""The prefix cache: reuse the KV state of earlier requests that share a prompt's prefix.

Models whose cache can be cut per token keep a radix tree of KV segments (see
radix_tree.py), bounded by a RAM budget with LRU eviction of leaves into an optional
disk tier (kv_disk.py). Models whose cache can't be cut (sliding windows, recurrent
layers) keep whole-state checkpoints at the end of finished requests instead: an
append-only next turn resumes from one; anything else prefills from scratch.

Runs on the engine thread only; `stats()` reads plain counters, from any thread.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import mlx.core as mx

from .kv_disk import DiskTier
from .kv_segments import (
    build_cache,
    cache_kind,
    cache_offset,
    check_segment,
    cut_segment,
    segment_nbytes,
    segment_signature,
    slice_segment,
)
from .radix_tree import Node, RadixTree

log = logging.getLogger(__name__)

GIB = 1 << 30


def default_max_ram_bytes() -> int:
    """min(8 GiB, a quarter of the machine's memory)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * GIB
    return min(8 * GIB, total // 4)


def default_max_disk_bytes(path: str | os.PathLike) -> int:
    """min(16 GiB, a quarter of the free space where the cache lives)."""
    p = Path(path).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        free = 64 * GIB
    return max(GIB // 4, min(16 * GIB, free // 4))


def cache_identity(target, kv_bits: int | None) -> str:
    """Target.identity plus what it leaves out: the weights files, KV bits, MLX version."""
    weights = []
    local = Path(target.path)
    if local.is_dir():
        for p in sorted(local.glob("*.safetensors")):
            st = p.stat()
            weights.append([p.name, st.st_size, st.st_mtime_ns])
    blob = json.dumps(
        {"target": target.identity, "weights": weights, "kv_bits": kv_bits, "mlx": mx.__version__, "v": 1},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class PrefixCache:
    def __init__(
        self,
        new_cache: Callable[[], list],
        identity: str,
        max_ram_bytes: int | None = None,
        disk_dir: str | os.PathLike | None = None,
        max_disk_bytes: int | None = None,
    ):
        self.new_cache = new_cache
        self.identity = identity
        self.kind = cache_kind(new_cache())
        self.max_ram_bytes = default_max_ram_bytes() if max_ram_bytes is None else int(max_ram_bytes)
        self.tree = RadixTree(cut_segment, segment_nbytes, seed=identity.encode())
        self.checkpoints: dict[tuple, tuple[list, int]] = {}  # tokens -> (cache, last used)
        self.checkpoint_bytes = self.checkpoint_tokens = 0
        self.disk = None
        if disk_dir is not None and self.kind == "segments":
            cap = default_max_disk_bytes(disk_dir) if max_disk_bytes is None else int(max_disk_bytes)
            self.disk = DiskTier(disk_dir, identity, cap)
        self._pinned: set[Node] = set()
        self._signature = None  # this model's segment layout, to check loaded ones against
        self.hits = self.misses = self.evictions = 0
        self.cached_tokens_served = 0

    # -- the engine's hooks -----------------------------------------------------------

    def acquire(self, prompt: list[int]) -> tuple[list, int]:
        """A cache holding the longest cached prefix of prompt[:-1], and its length."""
        self._pinned.clear()  # a request that failed never released its pins
        wanted = prompt[:-1]  # the last prompt token is fed by the first decode round
        if self.kind == "segments" and wanted:
            cache, n = self._acquire_segments(wanted)
        elif self.kind == "checkpoint" and wanted:
            cache, n = self._acquire_checkpoint(wanted)
        else:
            cache, n = self.new_cache(), 0
        if n:
            self.hits += 1
            self.cached_tokens_served += n
        else:
            self.misses += 1
        return cache, n

    def release(self, tokens: list[int], cache: list) -> None:
        """Remember the KV of the tokens the cache provably holds (its offset)."""
        self._pinned.clear()
        n = min(cache_offset(cache) or 0, len(tokens))
        if n <= 0:
            return
        if self.kind == "segments":
            path = self.tree.insert(list(tokens[:n]), lambda a, b: slice_segment(cache, a, b))
            if path and self._signature is None:
                self._signature = segment_signature(path[-1].payload)
        elif self.kind == "checkpoint":
            self._store_checkpoint(tuple(tokens[:n]), cache)
        self._evict()

    def close(self) -> None:
        """Write every segment held in RAM to the disk tier (if any)."""
        if self.disk is not None:
            for node in list(self.tree.nodes()):
                self._to_disk(node)
        self.tree = RadixTree(cut_segment, segment_nbytes, seed=self.identity.encode())
        self.checkpoints.clear()
        self.checkpoint_bytes = self.checkpoint_tokens = 0

    def stats(self) -> dict:
        tokens = self.tree.n_tokens + self.checkpoint_tokens
        ram = self.tree.nbytes + self.checkpoint_bytes
        return {
            "kind": self.kind,
            "entries": self.tree.n_nodes + len(self.checkpoints),
            "cached_tokens": tokens,
            "ram_bytes": ram,
            "max_ram_bytes": self.max_ram_bytes,
            "bytes_per_token": round(ram / tokens, 1) if tokens else 0.0,
            "disk_files": self.disk.files if self.disk else 0,
            "disk_bytes": self.disk.nbytes if self.disk else 0,
            "disk_writes": self.disk.writes if self.disk else 0,
            "disk_loads": self.disk.loads if self.disk else 0,
            "disk_skipped": self.disk.skipped if self.disk else 0,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "tokens_served": self.cached_tokens_served,
        }

    # -- segments (radix tree) --------------------------------------------------------

    def _acquire_segments(self, wanted: list[int]) -> tuple[list, int]:
        path = self._match(wanted)
        n = sum(k for _, k in path)
        if not n:
            return self.new_cache(), 0
        self._pinned.update(node for node, _ in path)
        self.tree.touch(node for node, _ in path)
        parts = [node.payload for node, _ in path[:-1]]
        last, k = path[-1]
        parts.append(last.payload if k == len(last.tokens) else cut_segment(last.payload, 0, k))
        cache = build_cache(self.new_cache(), parts)
        self._evict()  # what came from disk may have pushed RAM past the budget
        return cache, n

    def _match(self, wanted: list[int]) -> list[tuple[Node, int]]:
        """The tree's longest match, extended from the disk tier where that matches further."""
        tried: set = set()
        while True:
            path = self.tree.match(wanted)
            n = sum(k for _, k in path)
            if self.disk is None or n == len(wanted):
                return path
            full = path if not path or path[-1][1] == len(path[-1][0].tokens) else path[:-1]
            base = full[-1][0] if full else self.tree.root
            pos = sum(k for _, k in full)
            found = self.disk.best(base.key, wanted[pos:], tried)
            if found is None or pos + found[1] <= n:
                return path
            entry, _ = found
            tried.add(entry.path)
            loaded = self.disk.load(entry)
            if loaded is None:
                continue
            tokens, segment = loaded
            try:
                check_segment(segment, self._signature, len(tokens))
            except ValueError as err:
                self.disk._skip(entry, str(err))
                continue
            if self._signature is None:
                self._signature = segment_signature(segment)
            nodes = self.tree.insert(tokens, lambda a, b: segment if a == 0 else cut_segment(segment, a, b), start=base)
            if nodes and nodes[-1].parent is base and nodes[-1].tokens == tokens:
                nodes[-1].on_disk = True

    def _to_disk(self, node: Node) -> None:
        if self.disk is not None and not node.on_disk:
            node.on_disk = self.disk.write(node.parent.key, node.key, node.tokens, node.payload)

    def _evict(self) -> None:
        while self.tree.nbytes + self.checkpoint_bytes > self.max_ram_bytes:
            if self.checkpoints:
                self._drop_oldest_checkpoint()
                continue
            victim = self.tree.lru_leaf(self._pinned)
            if victim is None:
                return  # only the running request's path is left
            self._to_disk(victim)
            self.tree.remove_leaf(victim)
            self.evictions += 1

    # -- whole-state checkpoints --------------------------------------------------------

    def _acquire_checkpoint(self, wanted: list[int]) -> tuple[list, int]:
        best = None
        for tokens in self.checkpoints:
            if len(tokens) <= len(wanted) and (best is None or len(tokens) > len(best)):
                if list(tokens) == wanted[: len(tokens)]:
                    best = tokens
        if best is None:
            return self.new_cache(), 0
        cache, _ = self.checkpoints[best]
        self.tree.clock += 1
        self.checkpoints[best] = (cache, self.tree.clock)
        # a deep copy: the request writes into its cache in place, the checkpoint must stay
        return copy.deepcopy(cache), len(best)

    def _store_checkpoint(self, tokens: tuple, cache: list) -> None:
        if tokens in self.checkpoints:
            return
        self.tree.clock += 1
        self.checkpoints[tokens] = (cache, self.tree.clock)
        self.checkpoint_bytes += _cache_nbytes(cache)
        self.checkpoint_tokens += len(tokens)

    def _drop_oldest_checkpoint(self) -> None:
        oldest = min(self.checkpoints, key=lambda t: self.checkpoints[t][1])
        cache, _ = self.checkpoints.pop(oldest)
        self.checkpoint_bytes -= _cache_nbytes(cache)
        self.checkpoint_tokens -= len(oldest)
        self.evictions += 1


    # -- a view for people (the web app's cache page), on the engine thread ---------------

    def branches(self, limit: int = 40) -> list[dict]:
        """The biggest branches of the radix tree (parents before children): which prompts are
        cached and how deep. `ids` are the edge's first and last tokens, for a preview."""
        if self.kind == "checkpoint":
            return [{"id": i, "parent": None, "start": 0, "end": len(t), "tokens": len(t), "subtree_tokens": len(t),
                     "leaves": 1, "ram_bytes": _cache_nbytes(c), "on_disk": False, "age": self.tree.clock - used,
                     "head_ids": list(t[:24]), "tail_ids": list(t[-24:])}
                    for i, (t, (c, used)) in enumerate(self.checkpoints.items())][:limit]
        info: dict = {}  # node -> [start depth, subtree tokens, leaves]
        order, stack = [], [(n, 0) for n in self.tree.root.children.values()]
        while stack:
            node, start = stack.pop()
            order.append(node)
            info[node] = [start, len(node.tokens), 0]
            stack.extend((c, start + len(node.tokens)) for c in node.children.values())
        for node in reversed(order):  # children before parents: sum the subtrees up
            if node.is_leaf():
                info[node][2] = 1
            if node.parent in info:
                info[node.parent][1] += info[node][1]
                info[node.parent][2] += info[node][2]
        chosen = sorted(order, key=lambda n: -info[n][1])[:limit]
        keep = set(chosen)
        ids = {n: i for i, n in enumerate(chosen)}
        chosen.sort(key=lambda n: (info[n][0], -info[n][1]))
        return [{"id": ids[n], "parent": ids.get(n.parent) if n.parent in keep else None,
                 "start": info[n][0], "end": info[n][0] + len(n.tokens), "tokens": len(n.tokens),
                 "subtree_tokens": info[n][1], "leaves": info[n][2], "ram_bytes": n.nbytes, "on_disk": n.on_disk,
                 "age": self.tree.clock - n.last_used, "head_ids": n.tokens[:24], "tail_ids": n.tokens[-24:]}
                for n in chosen]

    def drop(self, disk: bool = False) -> None:
        """Empty the RAM tier. disk=False (evict): segments go to the disk tier first, as on
        close; disk=True (clear): they are forgotten, and the disk tier's files deleted too."""
        if disk:
            if self.disk is not None:
                for entry in list(self.disk.by_end.values()):
                    self.disk._drop(entry, unlink=True)
            self.tree = RadixTree(cut_segment, segment_nbytes, seed=self.identity.encode())
            self.checkpoints.clear()
            self.checkpoint_bytes = self.checkpoint_tokens = 0
        else:
            self.close()
        self._pinned.clear()


def _cache_nbytes(cache: list) -> int:
    total = 0
    for c in cache:
        try:
            total += c.nbytes
        except Exception:  # a layer type without a size
            pass
    return total
