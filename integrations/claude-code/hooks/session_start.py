#!/usr/bin/env python3
"""Claude Code SessionStart hook: tell the session whether the local mlx-dspark server is up.

Prints the server's model, context window and cache status as additional context, or a
clear note that it is down. Standard library only; never blocks or fails the session:
any problem ends in exit status 0 with at most a note.

    python3 session_start.py [--url http://127.0.0.1:8080]   (or MLX_DSPARK_URL)
"""

import json
import os
import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8080"
TIMEOUT_S = 1.5


def server_url(argv):
    if "--url" in argv[1:-1]:
        return argv[argv.index("--url") + 1].rstrip("/")
    return os.environ.get("MLX_DSPARK_URL", DEFAULT_URL).rstrip("/")


def get_json(url):
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        return json.loads(r.read().decode("utf-8"))


def describe(url):
    try:
        health = get_json(url + "/health")
    except Exception as e:  # down, refused, timed out, not JSON: all the same to the session
        reason = getattr(e, "reason", None) or e
        return (f"mlx-dspark: the local model server at {url} is not reachable ({reason}). "
                "The local-model MCP tools (rewrite_file, rename_symbol, edit_file) may be unavailable; "
                "start the server with `mlx-dspark serve`.")
    parts = [f"mlx-dspark: local model server at {url} is {health.get('status', 'up')}"]
    if health.get("model"):
        parts.append(f"model {health['model']}")
    if health.get("context_window"):
        parts.append(f"context window {health['context_window']} tokens")
    for key in ("prefix_cache", "cache"):
        if isinstance(health.get(key), dict):
            parts.append(f"{key} " + ", ".join(f"{k}={v}" for k, v in health[key].items()
                                                  if isinstance(v, (int, float, str))))
    return "; ".join(parts) + (". Hand copy-heavy file edits (whole-file rewrites, renames) to its MCP tools "
                               "(rewrite_file, rename_symbol, edit_file).")


def main():
    try:
        sys.stdin.read()  # the event JSON: nothing in it changes what we report
    except Exception:
        pass
    out = {"hookSpecificOutput": {"hookEventName": "SessionStart", "additionalContext": describe(server_url(sys.argv))}}
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # a hook must never fail the session
        pass
    sys.exit(0)
