"""Time to first token of a recorded Claude Code session, replayed through `mlx-dspark serve`'s app.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      .venv/bin/python scripts/serve_ttft.py [--model DIR] [--fixture ../shared/fixtures/claude-code/rename-session.jsonl]

Each request is sent as Claude Code sent it (max_tokens lowered to 8); prints, per turn, the prompt
and cached tokens, the client's time to the first content block and the engine's own ttft.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--fixture", default=str(ROOT.parent / "shared/fixtures/claude-code/rename-session.jsonl"))
    ap.add_argument("--no-prefix-cache", action="store_true")
    args = ap.parse_args()

    from agent_bridge.app import create_app
    from engine import Engine

    engine = Engine(args.model, prefix_cache=not args.no_prefix_cache)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    records = [json.loads(line) for line in Path(args.fixture).read_text().splitlines() if line.strip()]
    with httpx.Client(base_url=url, timeout=3600) as client:
        for i, rec in enumerate(records, 1):
            body = dict(rec["body"], max_tokens=8)
            t0, first, stats = time.perf_counter(), None, None
            with client.stream("POST", rec["path"], json=body) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("event: content_block_start"):
                        first = time.perf_counter() - t0
                    if line.startswith("data: ") and '"message_delta"' in line:
                        stats = json.loads(line[6:])["mlx_dspark"]
            print(f"turn {i}: prompt {stats['prompt_tokens']} tokens, cached {stats['cached_tokens']}, "
                  f"client ttft {first:.3f} s, engine ttft {stats['ttft_s']:.3f} s", flush=True)
    server.should_exit = True
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
