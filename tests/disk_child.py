"""A child process for the disk-tier tests: runs prompts through an engine with a disk tier.

    python tests/disk_child.py '{"model": DIR, "cache_dir": DIR, "prompts": [[ids...], ...],
                                 "max_tokens": 8, "fsize": null, "plain": false, "close": true}'

Prints one JSON line per prompt ({"i", "tokens", "cached", and "plain" when asked}) as soon as
it is done, then {"warnings": [...], "stats": {...}} once the engine is closed. `fsize` caps the
size of any file the process writes (RLIMIT_FSIZE: a disk that is full).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("fsize"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    warnings = Collect()
    logging.getLogger("engine").addHandler(warnings)
    from engine import Engine, GenerationRequest

    engine = Engine(cfg["model"], prefix_cache_dir=cfg["cache_dir"], prefill_chunk=64)
    plain = Engine(cfg["model"], prefix_cache=False) if cfg.get("plain") else None
    n = cfg.get("max_tokens", 8)
    for i, prompt in enumerate(cfg["prompts"]):
        done = engine.submit(GenerationRequest(prompt, max_tokens=n)).result()
        rec = {"i": i, "tokens": done.token_ids, "cached": done.stats.cached_tokens}
        if plain is not None:
            rec["plain"] = plain.submit(GenerationRequest(prompt, max_tokens=n)).result().token_ids
        print(json.dumps(rec), flush=True)
    if cfg.get("close", True):
        engine.close()
    print(json.dumps({"warnings": warnings.messages, "stats": engine.cache_stats()}), flush=True)
    os._exit(0)  # the engine thread is parked (see Engine._serve)


if __name__ == "__main__":
    main()
