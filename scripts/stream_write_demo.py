"""A streamed tool call of a 2,000-line `Write` arriving in pieces over its whole generation.

Starts the server on a tiny model (one layer, a 16k vocabulary) scripted (tests/scripted_model.py) to answer with one
Hermes `<tool_call>` writing a 2,000-line file, reads the Anthropic stream with httpx and
prints when each `input_json_delta` arrived, relative to the request. Usage:

    .venv/bin/python scripts/stream_write_demo.py [--lines 2000] [--syntax hermes|qwen3_coder]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

WRITE = {"name": "Write", "input_schema": {"type": "object", "properties": {
    "file_path": {"type": "string"}, "content": {"type": "string"}}, "required": ["file_path", "content"]}}


def reply_for(syntax: str, content: str) -> str:
    if syntax == "qwen3_coder":
        return ("<tool_call>\n<function=Write>\n<parameter=file_path>\nbig.py\n</parameter>\n"
                f"<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>")
    args = json.dumps({"file_path": "big.py", "content": content})
    return f'<tool_call>\n{{"name": "Write", "arguments": {args}}}\n</tool_call>'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--syntax", default="hermes", choices=["hermes", "qwen3_coder"])
    args = ap.parse_args()

    import httpx
    from scripted_model import script_engine
    from server_harness import RunningServer, build_agent_sized_model

    from agent_bridge.app import create_app
    from agent_bridge.chat.tool_stream import Syntax
    from engine import Engine

    content = "".join(f"    total += step_{i}(x)\n" if i % 4 else f"def step_{i}(x):\n" for i in range(args.lines))
    assert content.count("\n") == args.lines
    reply = reply_for(args.syntax, content)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_agent_sized_model(Path(tmp) / "tiny")  # a 16k vocabulary: code is ~4 characters a token
        with Engine(str(model), prefix_cache=False) as engine:
            script = script_engine(engine)
            script.set(reply)
            app = create_app(engine, context_window=65536)
            app.state.bridge.syntax = Syntax(args.syntax)
            print(f"reply: {len(script.ids)} tokens, {args.lines} lines, {len(content)} characters of content")
            body = {"model": "m", "max_tokens": 60000, "stream": True, "tools": [WRITE],
                    "messages": [{"role": "user", "content": "Write big.py"}]}
            with RunningServer(app) as srv:
                t0 = time.perf_counter()
                arrivals, pieces, first_token = [], [], None
                with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=600) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[6:])
                        now = time.perf_counter() - t0
                        if event["type"] == "content_block_start" and first_token is None:
                            first_token = now
                        if event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
                            arrivals.append(now)
                            pieces.append(event["delta"]["partial_json"])
                        if event["type"] == "message_delta":
                            stop, stats = event["delta"]["stop_reason"], event["mlx_dspark"]
                total = time.perf_counter() - t0
    written = json.loads("".join(pieces))
    assert written["content"] == content and stop == "tool_use"
    print(f"tool_use block opened at {first_token:.2f} s; request took {total:.2f} s; stop_reason {stop}; "
          f"{stats['generated_tokens']} tokens generated")
    print(f"{len(arrivals)} input_json_delta events; first at {arrivals[0]:.2f} s, last at {arrivals[-1]:.2f} s")
    print("arrivals per tenth of the request (events, characters of JSON):")
    for k in range(10):
        lo, hi = total * k / 10, total * (k + 1) / 10
        idx = [i for i, t in enumerate(arrivals) if lo <= t < hi]
        print(f"  {lo:6.2f}-{hi:6.2f} s: {len(idx):5d} events, {sum(len(pieces[i]) for i in idx):7d} chars")
    print("first 5 arrivals:", ", ".join(f"{t:.3f}s {pieces[i][:24]!r}" for i, t in enumerate(arrivals[:5])))


if __name__ == "__main__":
    main()
