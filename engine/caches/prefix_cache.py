"""The prefix cache: reuse the KV state of earlier requests that share a prompt's prefix.

Models whose cache can be cut per token keep a radix tree of KV segments (see
radix_tree.py), bounded by a RAM budget with LRU eviction of leaves. Models with layers
that can't be cut (sliding windows, recurrent layers) keep checkpoints at each prompt's
end and each turn's end: their attention layers still put per-token segments in the tree
(shared between branches), the other layers keep a whole copy of their state at that
point. A prompt resumes from the longest checkpoint it starts with, so one that diverges
mid-conversation resumes from the nearest checkpoint before the divergence. With a disk
tier (kv_disk.py), segments and checkpoints are written by a background writer as they
are made (a prompt's at its prefill's end), and read back lazily after a restart: a matching
chain of files is planned from their token headers, each file kept only while reading it is
faster than computing its tokens (measured rates, re-probed where they say compute), and
the chosen ones read together. The last request's own cache stays live:
the next turn that extends it continues it in place instead of assembling a copy from
segments.

The two strategies are two classes behind `PrefixCache`'s interface (SegmentPrefixCache,
CheckpointPrefixCache); `open_prefix_cache(...)` builds the one the model's cache kinds allow
(engine/caches/kinds.py), and where they allow neither, PrefixCache itself reuses nothing.

Runs on the engine thread only; `stats()` reads plain counters and `flush()` waits for
the writer, from any thread.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

import mlx.core as mx

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from engine.base.platform import physical_memory_bytes
from engine.caches.kinds import kept_bytes, kind_of
from engine.caches.kv_disk import DiskTier
from engine.caches.kv_segments import (
    build_cache,
    cache_offset,
    check_segment,
    cut_segment,
    kv_group_size,
    segment_nbytes,
    segment_layers,
    segment_signature,
    slice_segment,
    state_layers,
)
from engine.caches.radix_tree import Node, RadixTree, common_prefix, token_bytes
from engine.caches.rollback import supports_drafts

log = logging.getLogger(__name__)

PEEK_WAIT_S = 0.5  # how long `cached_prefix` waits for the engine thread's own use of the cache


def _locked(method):
    """Run under the cache's lock: what the engine thread changes, another thread's
    `cached_prefix` never sees half done."""
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run

GIB = 1 << 30


def default_max_ram_bytes() -> int:
    """min(8 GiB, a quarter of the machine's memory)."""
    total = physical_memory_bytes() or 16 * GIB  # unknown: as if 16 GiB
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
    """Target.identity plus what it leaves out: the weights (revision and digests), the KV format
    (quantised KV's bits and group: its segments are kept, and written, in that form), the MLX
    and mlx-lm versions. KV computed with other weights must never be reused, also from the
    disk tier across restarts (a hub model re-uploaded with the same config)."""
    import mlx_lm

    kv_format = {"kv_bits": kv_bits, **({"kv_group": kv_group_size(target.config)} if kv_bits else {})}
    blob = json.dumps(
        {"target": target.identity, **weights_fingerprint(target.path), **kv_format,
         "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "v": 3},  # 3: chunked CRC digests
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def weights_fingerprint(path: str) -> dict:
    """The snapshot revision and per-file digests of a model's weights.

    A hub id is looked up in the local Hugging Face cache (offline), where each weights file
    is a link to a blob named by its SHA-256; a plain directory's files are named by size
    and modification time (hashing gigabytes at every start would cost more than it saves)."""
    local = Path(path)
    if not local.is_dir():
        try:
            from huggingface_hub import snapshot_download
            from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

            local = Path(snapshot_download(path, local_files_only=True, allow_patterns=DEFAULT_ALLOW_PATTERNS))
        except Exception as e:  # not in the cache: nothing to key on but the id
            log.warning("cache identity: %s not found in the local hub cache (%s)", path, e)
            return {"revision": None, "weights": []}
    revision = local.name if local.parent.name == "snapshots" else None
    weights = []
    for f in sorted(local.glob("*.safetensors")):
        real = f.resolve()
        if f.is_symlink() and real.parent.name == "blobs":
            weights.append([f.name, real.name])
        else:
            st = real.stat()
            weights.append([f.name, st.st_size, st.st_mtime_ns])
    return {"revision": revision, "weights": weights}


class PrefixCache:
    """The interface the engine uses, and on its own the cache of a model whose layers neither cut
    per token nor come back whole (chunked or batched caches, unknown classes): it reuses nothing.
    `open_prefix_cache(...)` builds the strategy the model's cache kinds allow (`strategy_for`):
    SegmentPrefixCache or CheckpointPrefixCache."""

    kind = "none"  # what stats() and the web app show: the strategy's name
    keeps = False  # keeps anything (and so has a disk tier)

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
        self.max_ram_bytes = default_max_ram_bytes() if max_ram_bytes is None else int(max_ram_bytes)
        self.tree = self._new_tree()
        self.disk = None
        if disk_dir is not None and self.keeps:
            cap = default_max_disk_bytes(disk_dir) if max_disk_bytes is None else int(max_disk_bytes)
            try:
                self.disk = DiskTier(disk_dir, identity, cap)
            except OSError as err:  # a read-only or unusable folder: serve from RAM
                log.warning("prefix cache: no disk tier at %s (%s); serving goes on from RAM", disk_dir, err)
        self._pinned: set[Node] = set()
        # The last request's own cache and the tokens it holds: the next turn of an agent
        # extends it, and continuing it in place saves assembling (copying) the whole prefix.
        # Taken by acquire and given back by release, so it is never shared by two requests.
        self.live: tuple[list[int], list] | None = None
        self._signature = None  # this model's segment layout, to check loaded ones against
        self.hits = self.misses = self.evictions = 0
        self.cached_tokens_served = 0
        self._lock = threading.RLock()  # see _locked and cached_prefix

    # -- the engine's hooks -----------------------------------------------------------

    @_locked
    def acquire(self, prompt: list[int]) -> tuple[list, int]:
        """A cache holding the longest cached prefix of prompt[:-1], and its length."""
        self._pinned.clear()  # a request that failed never released its pins
        wanted = prompt[:-1]  # the last prompt token is fed by the first decode round
        live, self.live = self.live, None
        cache, n = self._resume(wanted, live) if wanted else (self.new_cache(), 0)
        if n:
            self.hits += 1
            self.cached_tokens_served += n
        else:
            self.misses += 1
        return cache, n

    @_locked
    def release(self, tokens: list[int], cache: list) -> None:
        """Remember the KV of the tokens the cache provably holds (its offset)."""
        self._pinned.clear()
        n = min(cache_offset(cache) or 0, len(tokens))
        if n <= 0:
            return
        self._keep(tokens[:n], cache)
        self._evict()

    def checkpoint(self, tokens: list[int], cache: list) -> None:
        """Keep the state of a cache that holds exactly `tokens`: the engine calls it at each
        prompt's end (only checkpoints keep anything here; release serves the turn's end)."""

    def write_ahead(self, tokens: list[int], cache: list) -> None:
        """A long prompt's first `tokens` are computed (the cache holds exactly them): where they
        can be kept as segments, the disk tier queues them now, so a crash during a long prefill,
        or right after it, loses only its last part (the writers, held while the request waits for
        its first token, go on after HOLD_MAX_S of it; segments only: a checkpoint of recurrent
        state mid-prompt would cost a copy of it each time)."""

    @_locked
    def close(self) -> None:
        """Write every segment held in RAM to the disk tier (if any)."""
        self.live = None
        if self.disk is not None:
            for node in list(self.tree.nodes()):
                self._to_disk(node)
            self.disk.close()
        self._forget()

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's measured prefill (tokens computed in seconds): what reading from disk must beat."""
        if self.disk is not None:
            self.disk.note_prefill(tokens, seconds)

    def hold_writes(self, held: bool) -> None:
        """The engine's signal that a request waits for its first token: the disk tier's writers
        pause meanwhile (kv_disk_writer.DiskWriter.hold)."""
        if self.disk is not None:
            self.disk.writer.hold(held)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every segment queued for the disk tier is written (any thread)."""
        return self.disk.flush(timeout) if self.disk is not None else True

    def stats(self) -> dict:
        entries, tokens, ram = self._held()
        return {
            "kind": self.kind,
            "entries": entries,
            "cached_tokens": tokens,
            "ram_bytes": ram,
            "max_ram_bytes": self.max_ram_bytes,
            "bytes_per_token": round(ram / tokens, 1) if tokens else 0.0,
            "disk_files": self.disk.files if self.disk else 0,
            "disk_bytes": self.disk.nbytes if self.disk else 0,
            "disk_writes": self.disk.writes if self.disk else 0,
            "disk_pending_bytes": self.disk.writer.pending_bytes if self.disk else 0,  # queued, not yet on disk
            "disk_loads": self.disk.loads if self.disk else 0,
            "disk_skipped": self.disk.skipped if self.disk else 0,
            **self._disk_rates(),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "tokens_served": self.cached_tokens_served,
        }

    def _disk_rates(self) -> dict:
        """What restores are chosen by: the disk's restore rate and the model's prefill rate."""
        d = self.disk
        restore, prefill = (d.restore_bytes_per_s, d.prefill_tokens_per_s) if d else (None, None)
        per_token = self.tree.nbytes / self.tree.n_tokens if self.tree.n_tokens else None
        return {
            "disk_restore_gb_per_s": round(restore / 1e9, 3) if restore else None,
            "disk_restore_tokens_per_s": round(restore / per_token, 1) if restore and per_token else None,
            "prefill_tokens_per_s": round(prefill, 1) if prefill else None,
            "disk_restored_bytes": d.restored_bytes if d else 0,
            "disk_restore_s": round(d.restore_seconds, 3) if d else 0.0,
            "disk_declined_tokens": d.declined_tokens if d else 0,
            "disk_reprobes": d.probes if d else 0,
        }

    @_locked
    def drop(self, disk: bool = False) -> None:
        """Empty the RAM tier. disk=False (evict): segments go to the disk tier first, as on
        close; disk=True (clear): they are forgotten, and the disk tier's files deleted too."""
        if disk:
            if self.disk is not None:
                self.disk.delete_all()
            self._forget()
        else:
            self.close()
        self._pinned.clear()

    def cached_prefix(self, prompt: list[int]) -> int | None:
        """How many tokens of `prompt` acquire() would reuse from RAM now, from any thread,
        taking, touching and loading nothing (the disk tier is not read). None when the engine
        thread kept the cache busy past PEEK_WAIT_S (a long disk load or KV assembly)."""
        if not self._lock.acquire(timeout=PEEK_WAIT_S):
            return None
        try:
            wanted = list(prompt[:-1])  # acquire's view: the last token is fed by the first round
            return self._reusable(wanted) if wanted else 0
        finally:
            self._lock.release()

    # -- what each strategy answers -------------------------------------------------------

    def _reusable(self, wanted: list[int]) -> int:
        """How many tokens of `wanted` (non-empty) _resume would give back from RAM, read only."""
        return 0

    def _resume(self, wanted: list[int], live: tuple[list[int], list] | None) -> tuple[list, int]:
        """A cache for `wanted` (non-empty), and how many of its tokens it already holds."""
        return self.new_cache(), 0

    def _keep(self, tokens: list[int], cache: list) -> None:
        """Remember a released cache that holds exactly `tokens`."""

    def _held(self) -> tuple[int, int, int]:
        """(entries, tokens, RAM bytes) kept."""
        return self.tree.n_nodes, self.tree.n_tokens, self.tree.nbytes

    def _forget(self) -> None:
        """Empty the RAM tier."""
        self.tree = self._new_tree()

    # -- the radix tree of KV segments, shared by both strategies ---------------------------

    def _new_tree(self) -> RadixTree:
        return RadixTree(cut_segment, segment_nbytes, seed=self.identity.encode())

    def _match(self, wanted: list[int]) -> list[tuple[Node, int]]:
        """The tree's longest match, extended from the disk tier where that matches further and
        reading is faster than computing (the rest is computed)."""
        tried: set = set()
        while True:
            path = self.tree.match(wanted)
            n = sum(k for _, k in path)
            if self.disk is None or n == len(wanted):
                return path
            full = path if not path or path[-1][1] == len(path[-1][0].tokens) else path[:-1]
            base = full[-1][0] if full else self.tree.root
            plan = self._disk_plan(base.key, wanted, sum(k for _, k in full), n, tried)
            if not plan:
                return path
            tried.update(entry.path for entry, _ in plan)
            for (entry, k), loaded in zip(plan, self.disk.load_many([entry for entry, _ in plan])):
                base = self._insert_loaded(base, entry, k, loaded)
                if base is None:
                    break  # skipped (torn, corrupt, foreign): match again, without it

    def _disk_plan(self, key: str, wanted: list[int], pos: int, reach: int, tried: set) -> list[tuple]:
        """The chain of files that continue the prompt from `key` (at `pos`) past `reach`, as
        [(entry, tokens it matches)], up to the first one faster computed than read. Only their
        token headers are read here: the files themselves are then read together."""
        plan = []
        while pos < len(wanted):
            found = self.disk.best(key, wanted[pos:], tried, beyond=reach - pos)
            if found is None or pos + found[1] <= reach:
                break
            entry, k = found
            if not self.disk.worth_reading(entry, k):
                break
            plan.append(found)
            pos = reach = pos + k
            if k < len(entry.tokens):
                break
            key = entry.end
        return plan

    def _insert_loaded(self, base: Node, entry, k: int, loaded) -> Node | None:
        """A loaded file's first k tokens in the tree under `base`; the node it ends at (None if
        the file was no good)."""
        if loaded is None:
            return None
        tokens, segment = loaded
        try:
            check_segment(segment, self._signature, len(tokens))
        except ValueError as err:
            self.disk.skip(entry, str(err))
            return None
        if self._signature is None:
            self._signature = segment_signature(segment)
        # Only the part the prompt matches: its node's key is then the one that files written
        # after a split of this edge continue from (the file itself still holds it all).
        if k < len(tokens):
            tokens, segment = tokens[:k], cut_segment(segment, 0, k)
        nodes = self.tree.insert(tokens, lambda a, b: segment if a == 0 and b == len(tokens)
                                 else cut_segment(segment, a, b), start=base)
        if nodes and nodes[-1].parent is base and nodes[-1].tokens == tokens:
            nodes[-1].on_disk = True  # whole, or recoverable from its file by a partial match
        return nodes[-1] if nodes else None

    def _take(self, path: list[tuple[Node, int]]) -> list:
        """The segments of a matched path (the last one cut to its match), pinned and touched."""
        self._pinned.update(node for node, _ in path)
        self.tree.touch(node for node, _ in path)
        parts = [node.payload for node, _ in path[:-1]]
        last, k = path[-1]
        parts.append(last.payload if k == len(last.tokens) else cut_segment(last.payload, 0, k))
        return parts

    def _to_disk(self, node: Node) -> None:
        if self.disk is not None and not node.on_disk:
            node.on_disk = self.disk.write(node.parent.key, node.key, node.tokens, node.payload)

    def _evict(self) -> None:
        while self._held()[2] > self.max_ram_bytes:
            victim = self.tree.lru_leaf(self._pinned)
            if victim is None:
                return  # only the running request's path is left
            self._to_disk(victim)
            self.tree.remove_leaf(victim)
            self.evictions += 1

    # -- a view for people (the web app's cache page), on the engine thread ---------------

    def branches(self, limit: int = 40) -> list[dict]:
        """The biggest branches of the radix tree (parents before children): which prompts are
        cached and how deep. `ids` are the edge's first and last tokens, for a preview."""
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


class SegmentPrefixCache(PrefixCache):
    """Every layer cuts per token: the radix tree of KV segments alone, and the last request's
    cache kept live for the next turn that extends it."""

    kind = "segments"
    keeps = True

    def _resume(self, wanted, live):
        path = self._match(wanted)
        n = sum(k for _, k in path)
        m = _live_reach(live, wanted, n)
        if m:
            live_tokens, live_cache = live
            trim_prompt_cache(live_cache, len(live_tokens) - m)  # no copy: continued in place
            self._pinned.update(node for node, _ in path)
            self.tree.touch(node for node, _ in path)
            return live_cache, m
        if not n:
            return self.new_cache(), 0
        cache = build_cache(self.new_cache(), self._take(path))
        self._evict()  # what came from disk may have pushed RAM past the budget
        return cache, n

    def _reusable(self, wanted):
        n = sum(k for _, k in self.tree.match(wanted))
        return _live_reach(self.live, wanted, n) or n

    def checkpoint(self, tokens, cache):
        """With a disk tier, the prompt's new segment goes to the writer at the prompt's end, not
        the turn's: a `kill -9` during (or right after) the reply then loses only the reply."""
        if self.disk is None or not tokens or cache_offset(cache) != len(tokens):
            return
        for node in self.tree.insert(list(tokens), lambda a, b: slice_segment(cache, a, b)):
            self._to_disk(node)
        self._evict()

    write_ahead = checkpoint  # a part of the prompt is a prefix like the whole one

    def _keep(self, tokens, cache):
        kept = list(tokens)
        path = self.tree.insert(kept, lambda a, b: slice_segment(cache, a, b))
        if path and self._signature is None:
            self._signature = segment_signature(path[-1].payload)
        for node in path:  # new segments go to disk now (a background writer), not at exit
            self._to_disk(node)
        self.live = (kept, cache)


class CheckpointPrefixCache(PrefixCache):
    """Some layers keep a state that can't be cut (sliding windows, recurrent layers): those are
    kept whole at checkpoints (each prompt's end and each turn's end), while the attention layers
    still put per-token segments in the tree (shared between branches). A prompt resumes from
    the longest checkpoint it starts with."""

    kind = "checkpoint"
    keeps = True

    def __init__(self, *args, **kwargs):
        self.checkpoints: dict[tuple, tuple[list, int]] = {}  # tokens -> (state layers, last used)
        self.checkpoint_bytes = self.checkpoint_tokens = 0
        super().__init__(*args, **kwargs)

    @_locked
    def checkpoint(self, tokens: list[int], cache: list) -> None:
        if not tokens or cache_offset(cache) != len(tokens):
            return
        attention = segment_layers(cache)
        if attention:
            for node in self.tree.insert(list(tokens), lambda a, b: slice_segment(attention, a, b)):
                self._to_disk(node)
        key = tuple(tokens)
        if key not in self.checkpoints:
            # copies: the request goes on writing into its cache (rotating buffers in place)
            self._store_checkpoint(key, [copy.deepcopy(c) for c in state_layers(cache)])
        self._evict()

    def _keep(self, tokens, cache):
        self.checkpoint(tokens, cache)

    def _resume(self, wanted, live):
        cache = self.new_cache()
        attention = segment_layers(cache)
        # the attention layers' segments must cover the checkpoint (eviction may have cut them)
        reach = sum(k for _, k in self._match(wanted)) if attention else len(wanted)
        best = self._best_checkpoint(wanted, reach)
        if self.disk is not None:  # a longer one from an earlier run, loaded (and kept) only when it serves
            entry = self.disk.best_checkpoint(wanted[:reach], len(best) if best else 0)
            loaded = self.disk.load_checkpoint(entry, len(state_layers(cache))) if entry is not None else None
            if loaded is not None:
                best = tuple(entry.tokens)
                self._store_checkpoint(best, loaded, to_disk=False)
        if best is None:
            return cache, 0
        states, _ = self.checkpoints[best]
        self.tree.clock += 1
        self.checkpoints[best] = (states, self.tree.clock)
        if attention:
            build_cache(attention, self._take(self.tree.match(list(best))))
        for layer, saved in zip(state_layers(cache), states):
            # a copy of the saved layer's fields: the request writes into its cache in place
            layer.__dict__.update(copy.deepcopy(saved).__dict__)
        return cache, len(best)

    def _best_checkpoint(self, wanted: list[int], reach: int) -> tuple | None:
        """The longest checkpoint in RAM that `wanted` starts with, within `reach` tokens."""
        best = None
        for tokens in self.checkpoints:
            if len(tokens) <= reach and (best is None or len(tokens) > len(best)):
                if list(tokens) == wanted[: len(tokens)]:
                    best = tokens
        return best

    def _reusable(self, wanted):
        # an empty tree: a model without attention layers (checkpoints hold it all), as in _resume
        reach = sum(k for _, k in self.tree.match(wanted)) if self.tree.n_tokens else len(wanted)
        best = self._best_checkpoint(wanted, reach)
        return len(best) if best else 0

    def _store_checkpoint(self, tokens: tuple, cache: list, to_disk: bool = True) -> None:
        if tokens in self.checkpoints:
            return
        if to_disk and self.disk is not None:  # written now by the background writer
            h = self.tree.root.hasher.copy()
            h.update(token_bytes(list(tokens)))
            self.disk.write_checkpoint(h.hexdigest(), list(tokens), cache)
        self.tree.clock += 1
        self.checkpoints[tokens] = (cache, self.tree.clock)
        self.checkpoint_bytes += kept_bytes(cache)
        self.checkpoint_tokens += len(tokens)

    def _held(self):
        entries, tokens, ram = super()._held()
        return entries + len(self.checkpoints), tokens + self.checkpoint_tokens, ram + self.checkpoint_bytes

    def _evict(self) -> None:
        while self.checkpoints and self._held()[2] > self.max_ram_bytes:  # checkpoints go first
            oldest = min(self.checkpoints, key=lambda t: self.checkpoints[t][1])
            cache, _ = self.checkpoints.pop(oldest)
            self.checkpoint_bytes -= kept_bytes(cache)
            self.checkpoint_tokens -= len(oldest)
            self.evictions += 1
        super()._evict()

    def _forget(self) -> None:
        super()._forget()
        self.checkpoints.clear()
        self.checkpoint_bytes = self.checkpoint_tokens = 0

    def branches(self, limit: int = 40) -> list[dict]:
        """The checkpoints, each as a branch from the root."""
        return [{"id": i, "parent": None, "start": 0, "end": len(t), "tokens": len(t), "subtree_tokens": len(t),
                 "leaves": 1, "ram_bytes": kept_bytes(c), "on_disk": False, "age": self.tree.clock - used,
                 "head_ids": list(t[:24]), "tail_ids": list(t[-24:])}
                for i, (t, (c, used)) in enumerate(self.checkpoints.items())][:limit]


def _live_reach(live: tuple[list[int], list] | None, wanted: list[int], n: int) -> int:
    """How far the live cache serves `wanted` where it beats the tree's `n` tokens (0: it doesn't)."""
    if live is None:
        return 0
    live_tokens, live_cache = live
    m = common_prefix(live_tokens, wanted)
    return m if m and m >= n and (m == len(live_tokens) or can_trim_prompt_cache(live_cache)) else 0


def strategy_for(cache: list) -> type[PrefixCache]:
    """Which prefix cache a model's (fresh) cache allows, from its layers' kinds: segments where
    every layer cuts per token, checkpoints where some can only come back whole, else none."""
    if cache and all(kind_of(c).segments for c in cache):
        return SegmentPrefixCache
    if supports_drafts(cache) and cache_offset(cache) is not None:
        return CheckpointPrefixCache
    return PrefixCache


def open_prefix_cache(new_cache: Callable[[], list], *args, **kwargs) -> PrefixCache:
    """The prefix cache for a model whose fresh cache `new_cache()` makes (PrefixCache's arguments)."""
    return strategy_for(new_cache())(new_cache, *args, **kwargs)
