"""Several requests at once against the same requests one at a time, in one process.

    python scripts/bench_concurrency.py [--model DIR] [--contents chat,refactor] [--concurrency 1,2,4]

For each content and concurrency c, c distinct requests (the content's prompt, each with its
own first line) are submitted together to the engine, with --max-batch 1 (one at a time, in
arrival order) and with --max-batch c (verified together in batched forwards), alternating
which goes first, `--trials` times (medians reported). Reported: aggregate tokens/s (all tokens / wall time), the median and worst time to
first token per request (from submission), and whether every request's tokens were identical.
Then, over HTTP: how soon a streaming client queued behind a long request gets its first
byte (the opening event) and its first token, with --max-batch 1 and 4.

Ratios within one run are what count: the machine may be loaded (the load average is printed).
On Linux run it with OpenBLAS preloaded, as scripts/test.sh does (MLX's CPU matmuls are far
slower without it): LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Done, Engine, GenerationRequest, Tokens  # noqa: E402
from engine.benchmark import build_content  # noqa: E402


def run_together(engine: Engine, prompts: list[list[int]], max_tokens: int, max_batch: int) -> dict:
    engine.max_batch = max_batch
    t0 = time.perf_counter()
    jobs = [engine.submit(GenerationRequest(p, max_tokens=max_tokens)) for p in prompts]
    first: list[float | None] = [None] * len(jobs)
    done: list[Done | None] = [None] * len(jobs)

    def read(i: int) -> None:
        for ev in jobs[i]:
            if isinstance(ev, Tokens) and first[i] is None:
                first[i] = time.perf_counter() - t0
            if isinstance(ev, Done):
                done[i] = ev

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(len(d.token_ids) for d in done)
    ttfts = [f if f is not None else wall for f in first]
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "ttft_median": statistics.median(ttfts),
            "ttft_max": max(ttfts), "outputs": [d.token_ids for d in done]}


def bench_engine(engine: Engine, contents: list[str], levels: list[int], max_tokens: int | None,
                 trials: int = 3) -> list[dict]:
    rows = []
    for name in contents:
        base = build_content(engine, name)
        prompt_text = engine.decode(base.prompts[0])
        budget = min(base.max_tokens, max_tokens) if max_tokens else base.max_tokens
        for c in levels:
            # distinct requests: the same task, each with its own first line
            prompts = [engine.encode(f"Request {i} of {c}.\n" + prompt_text) for i in range(c)]
            runs: dict[int, list[dict]] = {1: [], c: []}
            for t in range(trials):
                for b in ([1, c] if t % 2 == 0 else [c, 1]):  # alternate which runs first
                    runs[b].append(run_together(engine, prompts, budget, b))
            med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
            one = {k: med(runs[1], k) for k in ("tok_s", "ttft_median", "ttft_max")}
            many = {k: med(runs[c], k) for k in ("tok_s", "ttft_median", "ttft_max")}
            one["outputs"], many["outputs"] = runs[1][0]["outputs"], runs[c][0]["outputs"]
            ratios = [m["tok_s"] / o["tok_s"] for o, m in zip(runs[1], runs[c])]
            rows.append({"content": name, "c": c, "max_tokens": budget,
                         "alone_tok_s": one["tok_s"], "batched_tok_s": many["tok_s"],
                         "ratio": statistics.median(ratios),
                         "alone_ttft_med": one["ttft_median"], "batched_ttft_med": many["ttft_median"],
                         "alone_ttft_max": one["ttft_max"], "batched_ttft_max": many["ttft_max"],
                         "identical": all(r["outputs"] == runs[1][0]["outputs"] for r in runs[1] + runs[c])})
            r = rows[-1]
            print(f"{name:9s} c={c}  one-at-a-time {r['alone_tok_s']:7.1f} tok/s  max-batch {r['batched_tok_s']:7.1f} "
                  f"tok/s  (median of per-trial ratios {r['ratio']:.2f}x)  TTFT median {r['alone_ttft_med']:.2f} -> {r['batched_ttft_med']:.2f} s, "
                  f"worst {r['alone_ttft_max']:.2f} -> {r['batched_ttft_max']:.2f} s  identical={r['identical']}",
                  flush=True)
    return rows


def bench_queued_first_byte(engine: Engine, max_batch: int) -> dict:
    """A long stream runs; a chat stream sent behind it: seconds to its first byte and first token."""
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from server_harness import RunningServer

    from agent_bridge.server import create_app

    engine.max_batch = max_batch
    long_body = {"model": "m", "max_tokens": 400, "stream": True,
                 "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}
    short_body = {"model": "m", "max_tokens": 16, "stream": True,
                  "messages": [{"role": "user", "content": "Say hello."}]}
    with RunningServer(create_app(engine)) as srv:
        with httpx.stream("POST", srv.url + "/v1/messages", json=long_body, timeout=600) as long_r:
            lines = long_r.iter_lines()
            while "text_delta" not in next(lines):  # the long one is decoding
                pass
            t0 = time.perf_counter()
            first_byte = first_token = None
            with httpx.stream("POST", srv.url + "/v1/messages", json=short_body, timeout=600) as r:
                for chunk in r.iter_raw():
                    now = time.perf_counter() - t0
                    if first_byte is None:
                        first_byte = now
                    if b"text_delta" in chunk:
                        first_token = now
                        break
    return {"max_batch": max_batch, "first_byte_s": first_byte, "first_token_s": first_token}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled reference model)")
    ap.add_argument("--contents", default="chat,refactor")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=256, help="cap per request (0: the content's own)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the model's)")
    ap.add_argument("--no-http", action="store_true", help="skip the queued first-byte measurement")
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()}", flush=True)
    with Engine(args.model, prefix_cache=False, dtype=args.dtype) as engine:
        print(f"model: {engine.model_path}", flush=True)
        levels = [int(c) for c in args.concurrency.split(",")]
        bench_engine(engine, args.contents.split(","), levels, args.max_tokens or None, args.trials)
        if not args.no_http:
            for b in (1, 4):
                r = bench_queued_first_byte(engine, b)
                print(f"queued stream behind a long one, max-batch {b}: first byte {r['first_byte_s']:.3f} s, "
                      f"first token {r['first_token_s']:.2f} s", flush=True)
    print(f"load average: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
