"""What a drafter head's draft costs here, against a plain one-token step: measured and cached.

A head drafts a block in one pass of its own (a small network and, for DSpark, a Markov walk),
before the target verifies it. On a small target on a CPU that pass is a large part of a
round (about 0.6 of a plain step for the bundled model's heads); beside a 4-8B target it is a
few percent. The draft control (engine/tuning/draft_control.py) and the choice of mode for
`auto` (engine/tuning/mode_choice.py) charge it per head round, in plain steps, so both read
it in the cost curve's units whether or not the curve was measured.

Measured once per (machine, MLX, model, head, KV bits) in a second or so: a head draft of its
full block after a 256-token random context, and a plain step at that depth, the fastest of a
few of each (on a shared machine, other work only ever adds time, and to the two unequally).
"""

from __future__ import annotations

import time

from engine.base.measurements import MeasurementStore, cached_or_measured
from engine.caches.kv_segments import fresh_cache
from engine.caches.rollback import mark, take_back
from engine.decoding.verify import prefill
from engine.drafting.heads import make_head_drafter
from engine.drafting.heads.registry import entry_for
from engine.tuning.cost_curve import curve_key

HEAD_COST_FORMAT = 1
MEASURE_DEPTH = 256
MEASURE_REPEATS = 7

# head-draft-cost-<digest of key>.json; what it settles per process is each key's record
HEAD_COSTS = MeasurementStore("head-draft-cost")


def head_cost_key(target, mode: str, kv_bits: int | None = None) -> dict:
    """What a head's draft cost depends on: what the target's cost curve does, and the head's checkpoint."""
    return curve_key(target, kv_bits, format=HEAD_COST_FORMAT, mode=mode,
                     head=str(entry_for(target).heads.get(mode)), head_bits=getattr(target, "drafter_bits", None))


def measure_head_cost(target, mode: str, kv_bits: int | None = None, repeats: int = MEASURE_REPEATS,
                      key: dict | None = None) -> dict:
    """Time the head's full-block draft and a plain step after the same random context."""
    import mlx.core as mx
    import numpy as np

    drafter = make_head_drafter(mode, target, [])
    context = np.random.default_rng(0).integers(0, target.vocab_size, size=MEASURE_DEPTH).tolist()
    cache = fresh_cache(target, kv_bits)
    drafter.start(context)
    prefill(target, cache, context[:-1], chunk_size=MEASURE_DEPTH, on_hidden=drafter.observe_prefill,
            tap_layers=drafter.tap_layers)
    block = drafter.head.max_draft
    t_start = time.perf_counter()

    def draft_s() -> float:
        t0 = time.perf_counter()
        drafter.propose(block)  # tokens come back as Python ints: the pass has run
        return time.perf_counter() - t0

    def step_s() -> float:
        before = mark(cache)
        t0 = time.perf_counter()
        mx.eval(mx.argmax(target.forward(context[-1:], cache), axis=-1))
        dt = time.perf_counter() - t0
        take_back(cache, before, 1, 0, replay=None)
        return dt

    draft_s(), step_s()  # warm up (the first draft also takes in the prompt's features)
    drafts, steps = [], []
    for _ in range(repeats):  # interleaved: a burst of load spoils one of each, not one kind
        drafts.append(draft_s())
        steps.append(step_s())
    draft, step = min(drafts), min(steps)
    return {"key": key or head_cost_key(target, mode, kv_bits), "draft_s": round(draft, 7), "step_s": round(step, 7),
            "ratio": round(draft / step, 4), "block": block,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "measure_s": round(time.perf_counter() - t_start, 3)}


def _memo(key: dict) -> str:
    return str(HEAD_COSTS.path(key))


def save_head_cost(record: dict) -> None:
    HEAD_COSTS.save(record)
    HEAD_COSTS.forget()  # the next request settles on the new record (every rank's, whatever its key)


def head_cost(target, mode: str, kv_bits: int | None = None, refresh: bool = False) -> dict:
    """The head's cost record for this machine: cached, else measured now (and cached)."""
    key = head_cost_key(target, mode, kv_bits)
    settled = None if refresh else HEAD_COSTS.recall(_memo(key))
    if settled is None:
        settled = cached_or_measured(lambda: HEAD_COSTS.load(key), save=save_head_cost, refresh=refresh,
                                     measure=lambda: measure_head_cost(target, mode, kv_bits, key=key))
        HEAD_COSTS.remember(_memo(key), settled)
    return settled


def known_head_cost(target, mode: str, kv_bits: int | None = None) -> float | None:
    """The head's draft cost in plain steps where it was measured on this machine, else None
    (never measures: what a head mode chosen by name plans with)."""
    key = head_cost_key(target, mode, kv_bits)
    record = HEAD_COSTS.recall(_memo(key)) or HEAD_COSTS.load(key)
    if record is None:
        return None
    HEAD_COSTS.remember(_memo(key), record)
    return float(record["ratio"])
