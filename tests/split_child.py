"""One rank of a split model, for the distributed tests (tests/test_distributed.py).

    mlx.launch --backend ring -n 2 -- python tests/split_child.py '{"model": DIR, "split": "pipeline",
        "out": FILE, "runs": [{"prompt": [ids...], "mode": "lookup", "max_tokens": 24}, ...]}'

Every rank builds the engine; rank 0 runs the requests one after another (or all at once with
"together": true), writes {"runs": [{"tokens", "finish", "drafted", "accepted", "error"}...],
"ranks": n} to "out" and closes; the others follow. "cancel_after": k cancels a run after its
k-th Tokens event; "temperature" and "seed" sample; "die": rank 1 exits hard after loading
(a lost rank), "die": "decoding" once the first run has made a few tokens; "engine": extra Engine keywords.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_one(engine, spec: dict) -> dict:
    from engine import GenerationRequest
    from engine.base.events import Done, Tokens
    from engine.base.sampling import SamplingParams

    sampling = SamplingParams(temperature=spec.get("temperature", 0.0), seed=spec.get("seed"))
    request = GenerationRequest(spec["prompt"], max_tokens=spec.get("max_tokens", 24), mode=spec.get("mode"),
                                max_draft=spec.get("max_draft"), sampling=sampling)
    row = {"tokens": [], "finish": None, "drafted": 0, "accepted": 0, "error": None}
    try:
        job = engine.submit(request)
        seen = 0
        for event in job:
            if isinstance(event, Tokens):
                seen += 1
                if spec.get("cancel_after") and seen >= spec["cancel_after"]:
                    job.cancel()
            elif isinstance(event, Done):
                row.update(tokens=event.token_ids, finish=event.finish_reason, drafted=event.stats.drafted_tokens,
                           accepted=event.stats.accepted_tokens)
    except Exception as e:  # the test reads it
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from engine import Engine

    engine = Engine(cfg["model"], split=cfg.get("split"), **cfg.get("engine", {}))
    ranks = engine.ranks
    if not ranks.leader:
        if cfg.get("die") == "decoding":  # gone mid-forward: the leader notices inside a step
            threading.Thread(target=engine.follow, daemon=True).start()
            while not any(len(s.out) >= 4 for s in list(engine._running)):
                time.sleep(0.01)
            os._exit(3)
        if cfg.get("die"):
            os._exit(3)
        engine.follow()
        return
    rows: list = [None] * len(cfg["runs"])
    if cfg.get("together"):
        def fill(i, spec):
            rows[i] = run_one(engine, spec)

        threads = [threading.Thread(target=fill, args=(i, s)) for i, s in enumerate(cfg["runs"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        rows = [run_one(engine, spec) for spec in cfg["runs"]]
    with open(cfg["out"], "w") as f:
        json.dump({"runs": rows, "ranks": ranks.size, "split": engine.split,
                   "failure": engine.failure}, f)
    engine.close()


if __name__ == "__main__":
    main()
