"""Record what the real Claude Code CLI sends during a rename session, offline.

    python training/capture_sessions.py --out DIR [--files a.py b.py ...]

For each file: a temporary project holding it, then `claude -p "Rename OLD to NEW in FILE"`
against a local recording server that answers as the trained model should (Read the file, Write
it back renamed, one closing sentence). Every request body lands in DIR/session-K.jsonl; those
requests are what `agent_data.py` builds its training sessions from. Nothing is sent anywhere
else (`CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CLAUDE = ROOT / ".node" / "node_modules" / ".bin" / "claude"


def sse(blocks: list[dict], stop_reason: str) -> bytes:
    """An Anthropic Messages stream holding `blocks` (text or tool_use)."""
    out = [("message_start", {"type": "message_start", "message": {
        "id": "msg_rec", "type": "message", "role": "assistant", "model": "local-model", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}})]
    for i, b in enumerate(blocks):
        if b["type"] == "text":
            out += [("content_block_start", {"type": "content_block_start", "index": i,
                                             "content_block": {"type": "text", "text": ""}}),
                    ("content_block_delta", {"type": "content_block_delta", "index": i,
                                             "delta": {"type": "text_delta", "text": b["text"]}})]
        else:
            out += [("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                        "type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}}),
                    ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(b["input"])}})]
        out.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    out += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                               "usage": {"output_tokens": 10}}),
            ("message_stop", {"type": "message_stop"})]
    return b"".join(f"event: {e}\ndata: {json.dumps(d)}\n\n".encode() for e, d in out)


class Session:
    """The replies of one rename session, chosen by how many tool results the request holds."""

    def __init__(self, path: str, old: str, new: str, renamed: str, log: Path):
        self.replies = [
            ([{"type": "tool_use", "id": "toolu_rec_1", "name": "Read", "input": {"file_path": path}}], "tool_use"),
            ([{"type": "tool_use", "id": "toolu_rec_2", "name": "Write",
               "input": {"file_path": path, "content": renamed}}], "tool_use"),
            ([{"type": "text", "text": f"Renamed `{old}` to `{new}` in {Path(path).name}."}], "end_turn"),
        ]
        self.log = log

    def answer(self, body: dict) -> bytes:
        with self.log.open("a") as f:
            f.write(json.dumps(body) + "\n")
        results = sum(1 for m in body.get("messages", []) if isinstance(m.get("content"), list)
                      for b in m["content"] if b.get("type") == "tool_result")
        blocks, stop = self.replies[min(results, 2)]
        return sse(blocks, stop)


def serve(state: dict) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            if not self.path.startswith("/v1/messages") or self.path.startswith("/v1/messages/count_tokens"):
                payload, ctype = json.dumps({"input_tokens": 1000}).encode(), "application/json"
            else:
                payload, ctype = state["session"].answer(body), "text/event-stream"
            self.send_response(200)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--files", nargs="*", help="Python files to rename in (default: a few of this repository's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = args.files or [str(p) for p in sorted((ROOT / "engine").rglob("*.py")) if 30 < len(p.read_text().splitlines()) < 120][:3]
    rng = random.Random(args.seed)
    state: dict = {}
    srv = serve(state)
    for k, src in enumerate(files):
        text = Path(src).read_text()
        r = data.make_rename(text, rng)
        if r is None:
            continue
        old, new, renamed = r
        with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as proj:
            dst = Path(proj) / Path(src).name
            shutil.copy(src, dst)
            log = out / f"session-{k}.jsonl"
            log.unlink(missing_ok=True)
            state["session"] = Session(str(dst), old, new, renamed, log)
            env = {k2: v for k2, v in os.environ.items() if not k2.startswith("ANTHROPIC_")}
            env.update(HOME=home, ANTHROPIC_BASE_URL=f"http://127.0.0.1:{srv.server_address[1]}",
                       ANTHROPIC_API_KEY="dummy", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                       DISABLE_AUTOUPDATER="1")
            p = subprocess.run([str(CLAUDE), "-p", f"Rename {old} to {new} in {dst.name}", "--output-format", "json",
                                "--allowedTools", "Read,Write", "--permission-mode", "acceptEdits"],
                               env=env, cwd=proj, capture_output=True, text=True, timeout=300)
            ok = dst.read_text() == renamed
            print(f"{src}: {old} -> {new}: rc {p.returncode}, renamed on disk: {ok}, "
                  f"{sum(1 for _ in log.open()) if log.exists() else 0} requests -> {log}")
            if p.returncode:
                print(p.stdout[-1000:], p.stderr[-1000:])
    srv.shutdown()


if __name__ == "__main__":
    main()
