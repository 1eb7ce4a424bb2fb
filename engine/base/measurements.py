"""One store for what the engine measures about this machine: cost curves, batch surfaces,
prefill chunks, attention crossovers.

A measurement is a JSON record with a "key": what it depends on (the machine, MLX, the
model, ...). It lies in the cache folder as `<kind>-<digest of its key>.json`, so another
machine, version or model is another file, and one is read back only under the key it was
measured with (a file copied from elsewhere, or edited, is not). It is written whole or not
at all. Each kind keeps its own record type and its measuring; this is where they all live.

The request path and the scheduler read some kinds per request or per round: each store also
holds what this process settled for its kind (`recall`/`remember`), until forgotten (`forget`,
or `forget_measurements` for every kind after a re-measure).

Split over ranks (engine/base/ranks.py), the leader's records are everyone's: each rank runs
the same measuring forwards, but what is read back or measured is the leader's, so every rank
plans its drafts and batches alike; only the leader writes the files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Hashable

from engine.base.files import cache_dir, write_json
from engine.base.ranks import share, world


def key_digest(key: dict) -> str:
    """20 hex digits naming a key's file: equal keys, in any order, name the same file."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


class MeasurementStore:
    """The files of one kind of measurement, and what this process settled for it."""

    def __init__(self, kind: str, shared: bool = True):
        self.kind = kind  # the files' prefix: "cost-curve", "attention-crossover", ...
        # the leader's record on every rank of a split model (what sets the steps all take);
        # False: each rank's own (a kernel pick for its own layers, which changes no step)
        self.shared = shared
        self._settled: dict[Hashable, Any] = {}
        _STORES.append(self)

    def path(self, key: dict) -> Path:
        return cache_dir() / f"{self.kind}-{key_digest(key)}.json"

    def load(self, key: dict) -> dict | None:
        """The record measured under exactly `key`, or None (absent, unreadable, another key's);
        a shared store's: the leader's, on every rank."""
        try:
            record = json.loads(self.path(key).read_text()) if world().leader or not self.shared else None
        except (OSError, ValueError):
            record = None
        record = record if isinstance(record, dict) and record.get("key") == key else None
        return share(record) if self.shared else record

    def save(self, record: dict) -> Path:
        """Write `record` under its own "key", whole (readers never see half a file); a shared
        store's on the leader alone."""
        path = self.path(record["key"])
        return write_json(path, record) if world().leader or not self.shared else path

    def recall(self, memo_key: Hashable) -> Any:
        """What this process settled under `memo_key`, or None."""
        return self._settled.get(memo_key)

    def remember(self, memo_key: Hashable, value: Any) -> Any:
        self._settled[memo_key] = value
        return value

    def forget(self, memo_key: Hashable | None = None) -> None:
        """Forget one settled value (`memo_key`), or all of this kind's (None)."""
        if memo_key is None:
            self._settled.clear()
        else:
            self._settled.pop(memo_key, None)


_STORES: list[MeasurementStore] = []


def cached_or_measured(load: Callable[[], Any], measure: Callable[[], Any], save: Callable[[Any], Any],
                       refresh: bool = False, shared: bool = True) -> Any:
    """The cached record (`load()`, unless `refresh`), else one `measure()`d and `save`d: what
    every `tune_*` does with its own store. Split over ranks, each measures and, `shared`, the
    leader's measure is kept by all."""
    found = None if refresh else load()
    if found is None:
        found = share(measure()) if shared else measure()
        save(found)
    return found


def forget_measurements() -> None:
    """Forget what every store settled in this process: the next reader loads from disk again
    (after a re-measure the readers should see, e.g. the web app's retune)."""
    for store in _STORES:
        store.forget()
