#!/usr/bin/env python3
"""Claude Code PostToolUse hook (Read|Edit|Write): send the file's current text to the
local mlx-dspark server's draft corpus (POST /v1/corpus), so that when the model later
re-emits that file, lookup drafting copies from it.

Standard library only; silent; never blocks or fails the agent: a short timeout, and
every problem (server down, binary file, bad input) ends in exit status 0.

    python3 post_tool_use.py [--url http://127.0.0.1:8080]   (or MLX_DSPARK_URL)
"""

import json
import os
import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8080"
TIMEOUT_S = 2.0
MAX_BYTES = 1_000_000
TOOLS = ("Read", "Edit", "Write", "MultiEdit")


def server_url(argv):
    if "--url" in argv[1:-1]:
        return argv[argv.index("--url") + 1].rstrip("/")
    return os.environ.get("MLX_DSPARK_URL", DEFAULT_URL).rstrip("/")


def file_text(event):
    if event.get("tool_name") not in TOOLS:
        return None, None
    tool_input = event.get("tool_input") or {}
    path = tool_input.get("file_path") or tool_input.get("path")
    if not isinstance(path, str) or not path:
        return None, None
    if not os.path.isabs(path):
        path = os.path.join(event.get("cwd") or os.getcwd(), path)
    if not os.path.isfile(path) or os.path.getsize(path) > MAX_BYTES:
        return None, None
    with open(path, "rb") as f:
        data = f.read()
    if b"\x00" in data[:8192]:
        return None, None
    try:
        return path, data.decode("utf-8")
    except UnicodeDecodeError:
        return None, None


def post(url, path, text):
    body = json.dumps({"path": path, "text": text}).encode("utf-8")
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("MLX_DSPARK_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/corpus", data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        r.read()


def main():
    event = json.loads(sys.stdin.read() or "{}")
    path, text = file_text(event)
    if text:
        post(server_url(sys.argv), path, text)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # server down, timeout, odd input: the agent carries on regardless
        pass
    sys.exit(0)
