"""Taking back a rejected draft, for every mlx-lm cache type.

A verify pass appends `fed` tokens (the last committed token and the draft) to every
layer's cache; when only the first `kept` of them are accepted, the rest must go, so
that the next round sees exactly what plain decoding would have. Per layer type:

- attention (KVCache, QuantizedKVCache, ConcatenateKVCache, a batched row's RowCache): cut the tail.
- sliding window (RotatingKVCache): a multi-token update leaves the buffer in temporal
  order with the new tokens last, so the rejected ones are its last entries: drop them
  from the buffer. (mlx-lm's own trim only lowers the offset, so a later in-place
  rotation would keep attending to them; it refuses once the window is full.) This is
  right for any window and draft length: nothing a kept token needs was overwritten.
- recurrent state (ArraysCache: Gated DeltaNet, Mamba 2, short conv): a state can't be
  cut. Either the verify pass captured the state after every position
  (engine/caches/state_capture.py) and the layer takes the one after the kept tokens, or
  `mark` kept references to the arrays from before the round (the models assign new
  arrays, so this copies nothing) and `take_back` restores them and replays the kept
  tokens through the model. Only rounds with a rejection pay for the replay; capture
  costs every drafted round a little. cost_curve measures both per model and picks.
- CacheList (falcon_h1: Mamba 2 and attention in one layer): each part as above.
- anything else (chunked, batched caches): `supports_drafts` is False; decode plainly.

Each kind's way (mark, restore, cut) is its own answer, in engine/caches/kinds.py; this module
holds what spans the layers.

When any layer needs a replay, every layer goes back to its mark first (the replay
runs the whole model), so one `take_back` call serves every mix of layer types. With a
capture, recurrent layers take their captured state and the others are cut as usual.
"""

from __future__ import annotations

from typing import Callable

from engine.caches.kinds import holds_state, kind_of, leaves

# How recurrent layers take back a draft: a per-position capture or a snapshot and replay.
# Unmeasured, they capture: on CPU and CUDA mlx-lm's Gated DeltaNet already steps one
# position at a time, and a replay costs a whole forward of the kept tokens.
ROLLBACK_MODES = ("capture", "replay")
DEFAULT_ROLLBACK = "capture"


def supports_drafts(cache: list) -> bool:
    """Can a rejected draft be taken back from this cache exactly?"""
    return bool(cache) and all(kind_of(c).rollback(c) is not None for c in leaves(cache))


def needs_replay(cache: list) -> bool:
    """Does taking back a draft re-run the kept tokens (a layer holds recurrent state)?"""
    return any(holds_state(c) for c in leaves(cache))


def mark(cache: list) -> list:
    """What each layer holds before a verify pass: enough to return to it."""
    return [kind_of(c).mark(c) for c in leaves(cache)]


def take_back(cache: list, before: list, fed: int, kept: int, replay: Callable[[], object] | None,
              captured=None) -> None:
    """Leave the cache holding its marked state plus the first `kept` of the `fed` tokens it
    holds beyond the mark (a verify pass's inputs, or what an earlier take_back kept).

    `captured` (a state_capture.Capture of the verify pass that fed them) gives recurrent
    layers their state after `kept` tokens directly. Without it, `replay` feeds those `kept`
    tokens to the model (with this cache); it is called only when a recurrent layer needs
    it. The caller evaluates lazily with its next pass.
    """
    rejected = fed - kept
    if rejected <= 0:
        return
    layers = list(leaves(cache))
    if any(holds_state(c) for c in layers) and (captured is None or kept == 0):
        for c, m in zip(layers, before):
            kind_of(c).restore(c, m)
        if kept:
            replay()
        return
    for c, m in zip(layers, before):
        kind_of(c).take_back(c, m, rejected, kept, captured)
