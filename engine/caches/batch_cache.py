"""One persistent KV store for every sequence that decodes in a batch.

With `--max-batch` > 1 a sequence's attention KV moves, once another sequence's verify forward
could share its own (the scheduler's `Engine._join_batch`; one decoding alone keeps its cache), into
a `BatchCache`: per layer one buffer of shape (rows, kv heads, capacity, head dim), a row
per sequence, each row left-aligned with its own length. The sequence keeps a list of
`RowCache`s (one per layer, a view of its row) where its `KVCache`s were, so the verify
loop, rollback and drafters see a cache like any other. A decode round of several
sequences is one forward over the rows (`BatchCache.forward`): each row writes its new
keys at its own length, attends through a per-row causal mask (key j is visible to query i
of row b iff j <= length_b + i), and takes RoPE positions from its own length. Nothing is
copied per round: the cost the previous design paid (mlx-lm's `BatchKVCache.merge` and
`extract` of every sequence's whole KV, each round) is gone.

Why this layout, of those considered:
- mlx-lm's `BatchKVCache` keeps rows right-aligned behind left padding with one shared
  write index: rows that accept different numbers of draft tokens stop ending together, and
  realigning them is a copy of every row (`finalize`'s roll), each round; its `trim` is
  the same for every row. Its `filter`/`extend` copy the whole batch on every leave/join.
- One shared write index with per-row masks of the dead (rejected) positions keeps every
  write a single slice, but rejected drafts leave holes that every later round attends
  over, so it needs compaction (a gather of every row) now and then.
- Per-row lengths (this): a rejected draft is taken back by lowering the row's length
  (what `KVCache.trim` does for one sequence), there are no holes, and the mask is computed
  from the lengths. The price: a round writes each row's keys at its own position (one
  scatter per layer), and a short row attends over (masked) columns up to the longest row's
  end. Both are small against one forward's weights.
Measured on a 2-core CPU (bundled 12.6M model, one verify step of 4 sequences against the 4
alone): 2.5-2.7x at 256 tokens of context (merge and split each round: 2.1-2.3x), 1.6-1.8x at 2k
(1.1-1.2x), 1.7x at 8k with 2-token drafts (0.7x); the key writes' time does not grow with
the buffer (they run in place).

Join (`join`: the sequence's KV copied in once), leave (`leave`: copied out once into a
plain `KVCache`, for the prefix cache and so the sequence can run anywhere; the last row
moves into the freed slot so the rows in use stay 0..n-1). A row can run alone
(`RowCache.update_and_fetch`: one row's slice of the buffer, mlx-lm's own causal mask): the
scheduler does that for a forward it doesn't batch, with the same result as a `KVCache`.
Rows that take no part in a batched forward compute a dummy token past their end (written
where nothing reads it): cheaper than gathering the others' rows.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask

from engine.caches.kinds import CutKind, kind_of, register

GROW_TOKENS = 256  # capacity grows by at least this, and by a quarter of itself (amortised copies)


def joinable(target, cache: list) -> bool:
    """Only plain attention caches join (quantised, sliding-window and recurrent ones run alone),
    only once they hold something (the buffers take their shapes from it: a one-token prompt
    runs alone until its first round has filled it), and only for model families whose attention
    is known to take per-row RoPE offsets and masks from its cache (those engine/model/target.py
    walks; others run alone). A cache whose positions are shifted (after an M-RoPE image,
    engine/model/vision.py) runs alone too."""
    return (target.tappable and bool(cache)
            and all(kind_of(c).plain_kv and c.keys is not None and not getattr(c, "position_shift", 0)
                    for c in cache))


def batch_of(cache: list) -> BatchCache | None:
    """The batch this sequence's cache is a row of, else None (its layers are its own)."""
    return cache[0].store if cache and kind_of(cache[0]) is ROW else None


class BatchCache:
    """Per layer one (rows, heads, capacity, dim) buffer for keys and one for values; per row
    and layer a length. Lives on the engine thread."""

    def __init__(self) -> None:
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.lengths = np.zeros((0, 0), dtype=np.int64)  # (rows, layers)
        self.rows: list[tuple[object, list["RowCache"]]] = []  # per slot: (owner, its views)
        self.failed = ""  # why a batched forward failed (its rows then run alone), else ""

    @property
    def used(self) -> int:
        """Rows 0..used-1 hold sequences (leave keeps them packed)."""
        return len(self.rows)

    def owns(self, cache: list) -> bool:
        return batch_of(cache) is self

    # -- join and leave ---------------------------------------------------------------------

    def join(self, cache: list, owner: object = None) -> None:
        """Move a prefilled sequence's KV in: `cache` (its list of KVCaches) now holds its row's
        views, in place, so every holder of the list sees them."""
        if not cache or not all(kind_of(c).plain_kv and c.keys is not None for c in cache):
            raise ValueError("only filled plain KVCache layers can join a batch")
        if self.keys and len(cache) != len(self.keys):
            raise ValueError("a sequence of another model can't join this batch")
        if not self.keys:
            self._start(cache)
        slot = self.used
        if slot >= self.keys[0].shape[0]:
            self._grow_rows(max(1, slot))
        self.lengths = np.concatenate([self.lengths, np.zeros((1, len(cache)), dtype=np.int64)])
        for i, c in enumerate(cache):
            n = c.offset
            if n:
                self._ensure(i, n)
                self.keys[i][slot : slot + 1, :, :n, :] = c.keys[..., :n, :]
                self.values[i][slot : slot + 1, :, :n, :] = c.values[..., :n, :]
            self.lengths[slot, i] = n
        views = [RowCache(self, slot, i) for i in range(len(cache))]
        self.rows.append((owner, views))
        mx.eval(self.keys, self.values)  # the copy happens now; the old arrays can go
        cache[:] = views

    def leave(self, cache: list) -> None:
        """Move a sequence's KV out of the batch into plain KVCaches (in `cache`, in place)."""
        slot = cache[0].slot
        own = []
        for i in range(len(self.keys)):
            kv = KVCache()
            n = int(self.lengths[slot, i])
            if n:  # a fresh KVCache's own buffer: a real copy, so the batch's buffer stays writable in place
                kv.update_and_fetch(self.keys[i][slot : slot + 1, :, :n, :], self.values[i][slot : slot + 1, :, :n, :])
            own.append(kv)
        mx.eval([c.state for c in own if c.keys is not None])
        self._free(slot)
        cache[:] = own

    def drop(self, owner: object) -> None:
        """Free the row of `owner` (a job that ended without leaving: an error, a closed step)."""
        for slot, row in enumerate(self.rows):
            if row[0] is owner:
                self._free(slot)
                return

    def _free(self, slot: int) -> None:
        for view in self.rows[slot][1]:
            view.store = None  # a stale view fails loudly instead of reading another sequence's row
        last = self.used - 1
        if slot != last:  # keep rows packed: the last row moves into the freed slot (one row's copy)
            for i in range(len(self.keys)):
                n = int(self.lengths[last, i])
                self.keys[i][slot : slot + 1, :, :n, :] = self.keys[i][last : last + 1, :, :n, :]
                self.values[i][slot : slot + 1, :, :n, :] = self.values[i][last : last + 1, :, :n, :]
            self.lengths[slot] = self.lengths[last]
            self.rows[slot] = self.rows[last]
            for view in self.rows[slot][1]:
                view.slot = slot
            mx.eval(self.keys, self.values)
        self.rows.pop()
        self.lengths = self.lengths[:last]
        if not self.rows:  # empty: give the memory back
            self.keys, self.values = [], []

    # -- buffers ------------------------------------------------------------------------------

    def _start(self, cache: list) -> None:
        self.keys = [mx.zeros((1, c.keys.shape[1], GROW_TOKENS, c.keys.shape[3]), c.keys.dtype) for c in cache]
        self.values = [mx.zeros((1, c.values.shape[1], GROW_TOKENS, c.values.shape[3]), c.values.dtype)
                       for c in cache]
        self.lengths = np.zeros((0, len(cache)), dtype=np.int64)

    def _grow_rows(self, more: int) -> None:
        grow = lambda a: mx.concatenate([a, mx.zeros((more, *a.shape[1:]), a.dtype)], axis=0)  # noqa: E731
        self.keys = [grow(a) for a in self.keys]
        self.values = [grow(a) for a in self.values]

    def _ensure(self, layer: int, need: int) -> None:
        """Capacity for `need` positions in this layer's buffers (grown for every row)."""
        have = self.keys[layer].shape[2]
        if need <= have:
            return
        more = max(need - have, GROW_TOKENS, have // 4)
        more = -(-more // GROW_TOKENS) * GROW_TOKENS
        grow = lambda a: mx.concatenate(  # noqa: E731
            [a, mx.zeros((a.shape[0], a.shape[1], more, a.shape[3]), a.dtype)], axis=2)
        self.keys[layer] = grow(self.keys[layer])
        self.values[layer] = grow(self.values[layer])

    # -- forwards ------------------------------------------------------------------------------

    def forward(self, target, forwards: list, width: int | None = None) -> None:
        """Run these rows' verify forwards (batch_verify.Forward, each on one of this batch's
        rows) as one forward over rows 0..used-1, `width` tokens wide (at least the widest
        forward); each Forward gets its result."""
        slots = [f.cache[0].slot for f in forwards]
        n = self.used
        width = max(width or 0, *(len(f.tokens) for f in forwards))
        tokens = np.zeros((n, width), dtype=np.uint32)  # rows without a forward: a dummy token past their end
        for slot, f in zip(slots, forwards):
            tokens[slot, : len(f.tokens)] = f.tokens
        starts = self.lengths[:n].copy()
        positions: dict[bytes, _RowPositions] = {}  # layers whose rows start alike share one (all, as a rule)
        layers = []
        for i in range(len(self.keys)):
            key = starts[:, i].tobytes()
            if key not in positions:
                positions[key] = _RowPositions(starts[:, i])
            layers.append(_BatchLayer(self, i, positions[key]))
        x = mx.array(tokens)
        taps = forwards[0].taps
        if taps:
            logits, hidden = target.forward_tapped(x, layers, taps)
        else:
            logits, hidden = target.forward_batch(x, layers), None
        picks = _GreedyPicks(logits)
        for slot, f in zip(slots, forwards):
            w = len(f.tokens)
            self.lengths[slot] = starts[slot] + w  # the padding past w stays out (nothing reads past a length)
            f.result = (logits[slot, :w], None if hidden is None else hidden[slot, :w])
            f.picks = functools.partial(picks.row, slot, w)


class _GreedyPicks:
    """A batched forward's argmax per row and position, read once for every row: one wait for
    the device a round, not one a row (each a kernel launch and a sync on a GPU)."""

    def __init__(self, logits: mx.array):
        self.logits, self.rows = logits, None

    def row(self, slot: int, width: int) -> list[int]:
        if self.rows is None:
            self.rows = mx.argmax(self.logits, axis=-1).tolist()
        return self.rows[slot][:width]


class _RowPositions:
    """Where each row of a batched forward starts (one per distinct start vector, shared by the
    layers: their RoPE offsets and key-write indices are built once a forward, not once a layer)."""

    def __init__(self, starts: np.ndarray):
        self.starts = starts
        self.offset = mx.array(starts.astype(np.int32))  # per-row RoPE positions
        self._writes: dict[tuple[int, int], tuple] = {}

    def writes(self, heads: int, width: int) -> tuple:
        """Scatter indices (row, head, position) of every row's `width` new keys at its own start."""
        at = self._writes.get((heads, width))
        if at is None:
            n = len(self.starts)
            at = self._writes[heads, width] = (
                mx.arange(n)[:, None, None], mx.arange(heads)[None, :, None],
                (self.offset[:, None] + mx.arange(width)[None, :])[:, None, :])
        return at


class _BatchLayer:
    """One layer's cache for a batched forward over rows 0..n-1 starting at `rows.starts`."""

    def __init__(self, store: BatchCache, layer: int, rows: _RowPositions):
        self.store, self.layer, self.rows = store, layer, rows

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE positions (mlx-lm's attention reads `cache.offset`)."""
        return self.rows.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Every row's new keys written at its own length by one scatter per buffer. A slice
        update per row is rows x layers x 2 kernel launches a step, which is what a small model's
        batched step waits on on a GPU (H200, bundled model, 4 rows, 1 token each: 3.8 ms with
        slice updates, 2.3 ms with scatters, 1.5 ms for one row alone); on a 2-core CPU the
        scatters cost about 0.1-0.2 ms more a step, under 1% of it."""
        s, i, (n, heads, w, _) = self.store, self.layer, keys.shape
        end = int(self.rows.starts.max()) + w
        s._ensure(i, end)
        at = self.rows.writes(heads, w)
        s.keys[i][at] = keys
        s.values[i][at] = values
        return s.keys[i][:n, :, :end, :], s.values[i][:n, :, :end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(rows, 1, N, keys): row b's query i (at position start_b + i) sees keys 0..start_b + i
        (within `window_size` of it, where the model has a window)."""
        key_pos = mx.arange(int(self.rows.starts.max()) + N)[None, None, None, :]
        query_pos = self.offset[:, None, None, None] + mx.arange(N)[None, None, :, None]
        mask = key_pos <= query_pos
        return mask if window_size is None else mask & (key_pos > query_pos - window_size)


class RowCache:
    """One layer of one batched sequence: what its cache list holds while it is in a batch.
    Behaves as that layer's KVCache would (offset, trim, a forward of this row alone)."""

    def __init__(self, store: BatchCache, slot: int, layer: int):
        self.store, self.slot, self.layer = store, slot, layer

    @property
    def offset(self) -> int:
        return int(self.store.lengths[self.slot, self.layer])

    @offset.setter
    def offset(self, n: int) -> None:
        self.store.lengths[self.slot, self.layer] = n

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """A forward of this row alone: written at its length, its own keys returned."""
        s, i, b, start, w = self.store, self.layer, self.slot, self.offset, keys.shape[2]
        s._ensure(i, start + w)
        s.keys[i][b : b + 1, :, start : start + w, :] = keys
        s.values[i][b : b + 1, :, start : start + w, :] = values
        self.offset = start + w
        return self.state

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(N, self.offset, return_array, window_size)  # as KVCache's

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        s, i, b, n = self.store, self.layer, self.slot, self.offset
        return s.keys[i][b : b + 1, :, :n, :], s.values[i][b : b + 1, :, :n, :]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        k, v = self.state
        return k.nbytes + v.nbytes


# A batched row takes back a draft as the KVCache it stands for would: its tail is cut (rollback.py).
ROW = CutKind("batched row", cuts_per_token=True)
register(RowCache, ROW)
