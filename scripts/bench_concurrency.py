"""`mlx-dspark benchmark --concurrency`'s figures, plus one that needs the HTTP server.

    python scripts/bench_concurrency.py [--model DIR] [--contents chat,refactor] [--concurrency 1,2,4]
        [--dtype bfloat16] [--tune] [--json-file PATH] [--no-http]

The concurrency rows (aggregate tokens/s and time to first token of N requests at once
against the same N one at a time, identical outputs) are engine/bench/concurrency_bench.py's, the
same code `mlx-dspark benchmark --concurrency` runs. Added here: how soon a streaming client
queued behind a long request gets its first byte (the opening event) and its first token,
over HTTP, with --max-batch 1 and 4 (the test harness's server; `--no-http` skips it).
With `--no-http` nothing imports starlette (a GPU machine without it can run this); `--tune`
measures the verify cost curve and the batch cost surface first, as `mlx-dspark benchmark`
does (cached under MLX_DSPARK_CACHE_DIR).

On Linux run it with OpenBLAS preloaded, as scripts/test.sh does (the CLI does that itself):
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, describe_platform, surface_for, tune, tune_batch  # noqa: E402
from engine.bench.concurrency_bench import format_rows, row_line, run_concurrency  # noqa: E402
from engine.base.platform import device_name  # noqa: E402


def bench_queued_first_byte(engine: Engine, max_batch: int) -> dict:
    """A long stream runs; a chat stream sent behind it: seconds to its first byte and first token."""
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from server_harness import RunningServer

    from agent_bridge.app import create_app

    engine.set_max_batch(max_batch)
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
    ap.add_argument("--tune", action="store_true", help="measure the cost curve and batch surface first (if not cached)")
    ap.add_argument("--json-file", default=None, help="also write the rows, the surface and the machine here")
    args = ap.parse_args()
    load_start = os.getloadavg()
    print(f"load average: {load_start}", flush=True)
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with Engine(args.model, prefix_cache=False, dtype=args.dtype) as engine:
        print(f"model: {engine.model_path} ({engine.target.dtype})", flush=True)
        if args.tune:
            engine.call(lambda t: tune(t, on_progress=lambda what, i, n: progress(f"cost curve: {what} ({i}/{n})")))
            engine.call(lambda t: tune_batch(t, on_progress=lambda what, i, n: progress(f"batch surface: {what} ({i}/{n})")))
        surface = engine.call(lambda t: surface_for(t)).describe()
        print(f"batch surface: measured {surface['measured']}, widest batched width {surface['max_batched_width']}, "
              f"max batch (auto) {surface['max_batch']}", flush=True)
        levels = [int(c) for c in args.concurrency.split(",")]
        rows = run_concurrency(engine, args.contents.split(","), levels, args.trials, max_tokens=args.max_tokens or None,
                               progress=progress, on_row=lambda r: print(row_line(r), flush=True))
        print(format_rows(rows), flush=True)
        if args.json_file:
            report = {"machine": {**describe_platform(), "device_name": engine.call(lambda t: device_name())},
                      "model": engine.info(), "batch_surface": surface, "concurrency": rows,
                      "load_average": {"start": load_start, "end": os.getloadavg()}}
            Path(args.json_file).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_file).write_text(json.dumps(report, indent=1) + "\n")
        if not args.no_http:
            for b in (1, 4):
                r = bench_queued_first_byte(engine, b)
                print(f"queued stream behind a long one, max-batch {b}: first byte {r['first_byte_s']:.3f} s, "
                      f"first token {r['first_token_s']:.2f} s", flush=True)
    print(f"load average: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
