"""What each kind of layer cache answers for itself: can a rejected draft be taken back from it,
and how; can its KV be cut per token (into prefix-cache segments, or by mlx-lm's trim at any
length); may it join a batch; what it costs to keep.

One entry per mlx-lm cache class (mlx_lm/models/cache.py), looked up by the cache object's type;
a class the table doesn't know (a model's own, a wrapper) gets the unknown kind, whose every
answer is the conservative one. The project's own caches register themselves (a batched row's
RowCache, engine/caches/batch_cache.py). Where mlx-lm's classes already answer (`trim`,
`nbytes`, `offset`), the kinds ask them rather than repeat them.

How a rejected draft is taken back (`Kind.rollback`; engine/caches/rollback.py says why):
- "cut": attention KV; mlx-lm's own `trim` cuts the tail.
- "window": a sliding window (RotatingKVCache); the buffer's last entries are dropped.
- "state": recurrent state (ArraysCache); a captured state, or a snapshot and a replay.
- None: it can't (chunked and batched caches, unknown classes): decode plainly.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

CUT, WINDOW, STATE = "cut", "window", "state"


class Kind:
    """One cache class's answers. On its own it is the unknown kind: nothing it can't prove."""

    way: str | None = None  # how a rejected draft goes: CUT, WINDOW, STATE, or None (it can't)
    segments = False  # its KV slices per token into prefix-tree segments (kv_segments.py)
    # mlx-lm's plain KVCache: one keys and one values buffer, cached before attention, so it may
    # join a batch, be filled with random keys, and leave its model's last attention call unread
    plain_kv = False

    def __init__(self, name: str, cuts_per_token: bool = False):
        self.name = name
        # mlx-lm's trim cuts it at any length: what the catalog calls "trimmable" (a sliding
        # window's trim refuses once full, a recurrent state has none)
        self.cuts_per_token = cuts_per_token

    def rollback(self, c) -> str | None:
        """How a rejected draft is taken back from this cache object (None: it can't)."""
        return self.way

    def parts(self, c) -> list | None:
        """The caches it is made of (a CacheList's), else None: it is a leaf."""
        return None

    def mark(self, c):
        """What it holds before a verify pass: enough to return to it."""
        raise TypeError(f"a {type(c).__name__} can't take back a draft")

    def restore(self, c, marked) -> None:
        """Back to what `mark` saw."""
        raise TypeError(f"a {type(c).__name__} can't take back a draft")

    def take_back(self, c, marked, rejected: int, kept: int, captured) -> None:
        """Drop the last `rejected` tokens it holds; the `kept` before them stay (a recurrent
        state takes its captured state after them)."""
        raise TypeError(f"a {type(c).__name__} can't take back a draft")


class CutKind(Kind):
    """Attention KV: cut the tail, by the cache's own trim."""

    way = CUT

    def mark(self, c):
        return c.offset

    def restore(self, c, marked) -> None:
        c.trim(c.offset - marked)

    def take_back(self, c, marked, rejected, kept, captured) -> None:
        c.trim(rejected)


class PlainKVKind(CutKind):
    """mlx-lm's KVCache: a segment is [keys, values]."""

    segments = plain_kv = True

    def segment_arrays(self, c) -> list[mx.array]:
        return [c.keys, c.values]

    def fill(self, c, arrays: list[mx.array], n: int) -> None:
        c.state = (arrays[0], arrays[1], n)


class QuantizedKVKind(CutKind):
    """mlx-lm's QuantizedKVCache: a segment is the six quantised parts (data, scales, biases of
    the keys, then of the values)."""

    segments = True

    def segment_arrays(self, c) -> list[mx.array]:
        return [*c.keys, *c.values]

    def fill(self, c, arrays: list[mx.array], n: int) -> None:
        half = len(arrays) // 2
        c.keys, c.values, c.offset = tuple(arrays[:half]), tuple(arrays[half:]), n


class WindowKind(Kind):
    """A sliding window (RotatingKVCache). A multi-token update leaves the buffer in temporal order
    with the new tokens last, so the rejected ones are its last entries (mlx-lm's own trim only
    lowers the offset, and refuses once the window is full)."""

    way = WINDOW

    def mark(self, c):
        # new handles: a one-token update writes into the buffer in place (a wider one builds
        # new arrays), and must not reach what is kept here
        keys, values = (None, None) if c.keys is None else (mx.array(c.keys), mx.array(c.values))
        return keys, values, c.offset, c._idx

    def restore(self, c, marked) -> None:
        c.keys, c.values, c.offset, c._idx = marked

    def take_back(self, c, marked, rejected, kept, captured) -> None:
        if kept == 0:
            # nothing kept: go back whole (a one-token update rotated the buffer in place, and a
            # full window cut below max_size would break mlx-lm's next in-place update)
            self.restore(c, marked)
            return
        end = c.keys.shape[2] - rejected
        c.keys, c.values = c.keys[..., :end, :], c.values[..., :end, :]
        c.offset -= rejected
        c._idx = end


class StateKind(Kind):
    """Recurrent state (ArraysCache: Gated DeltaNet, Mamba 2, short conv): it can't be cut. The
    models assign new arrays, so a mark keeps references and copies nothing."""

    way = STATE

    def rollback(self, c) -> str | None:
        # mlx-lm's batched form (lengths or left padding set) can't take back one row's draft
        return STATE if c.lengths is None and c.left_padding is None else None

    def mark(self, c):
        return list(c.cache)

    def restore(self, c, marked) -> None:
        c.cache = list(marked)

    def take_back(self, c, marked, rejected, kept, captured) -> None:
        c.cache = captured.slots_after(c, kept)


class PartsKind(Kind):
    """A CacheList (falcon_h1: Mamba 2 and attention in one layer): its parts answer each for
    itself. The catalog and the prefix cache take it whole (checkpoints), as they always did."""

    def parts(self, c) -> list | None:
        return list(c.caches)


UNKNOWN = Kind("unknown")
_KINDS: dict[type, Kind] = {}


def register(cls: type, kind: Kind) -> None:
    """The kind of every cache object of exactly this class."""
    _KINDS[cls] = kind


register(KVCache, PlainKVKind("attention", cuts_per_token=True))
register(QuantizedKVCache, QuantizedKVKind("quantised attention", cuts_per_token=True))
register(ConcatenateKVCache, CutKind("concatenated attention", cuts_per_token=True))
register(ChunkedKVCache, Kind("chunked attention", cuts_per_token=True))  # trims, but no draft rollback here
register(RotatingKVCache, WindowKind("sliding window"))
register(ArraysCache, StateKind("recurrent state"))
register(CacheList, PartsKind("cache list"))
register(BatchKVCache, Kind("batched attention"))  # mlx-lm's batch generation, not this engine's
register(BatchRotatingKVCache, Kind("batched sliding window"))


def kind_of(c) -> Kind:
    """The kind of one layer's cache object."""
    found = _KINDS.get(type(c))
    if found is None and isinstance(c, ArraysCache):  # a subclass (older mlx-lm's MambaCache) keeps state as its base
        return _KINDS[ArraysCache]
    return found or UNKNOWN


def leaves(cache: list):
    """Every leaf cache (a CacheList's parts flattened), in layer order."""
    for c in cache:
        parts = kind_of(c).parts(c)
        if parts is None:
            yield c
        else:
            yield from leaves(parts)


def holds_state(c) -> bool:
    """A recurrent layer: its draft goes back by a capture or a snapshot and replay."""
    return kind_of(c).rollback(c) == STATE


def kept_bytes(cache: list) -> int:
    """What keeping these layers costs, by mlx-lm's own count (0 for a layer without one)."""
    total = 0
    for c in cache:
        try:
            total += c.nbytes
        except Exception:  # a layer type without a size
            pass
    return total
