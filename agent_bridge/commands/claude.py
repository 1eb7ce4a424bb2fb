"""`mlx-dspark claude [CLAUDE ARGS...]`: run Claude Code on the local model.

Checks the server (/health) and starts one in the background if none answers (waiting,
with progress, until it is healthy), then execs `claude` with the environment that points
it at the server: base URL, token, the model name for every alias, non-essential traffic
and the attribution header off, output and context limits. Arguments this command doesn't
know go to claude unchanged (put `--` before any that clash with the ones below).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from agent_bridge.commands import CommandError

REPO_CLAUDE = Path(__file__).resolve().parents[2] / ".node" / "node_modules" / ".bin" / "claude"


def add_parser(sub) -> None:
    from agent_bridge.integrate.clients import DEFAULT_MAX_OUTPUT, DEFAULT_PORT

    p = sub.add_parser("claude", help="run Claude Code on the local model (starts the server if needed)",
                       allow_abbrev=False, description=__doc__.split("\n\n")[1])
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"server port (default {DEFAULT_PORT})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--serve-model", default=None, help="model for a server started here (default: the bundled reference model)")
    p.add_argument("--api-key", default=None, help="the server's API key, if it requires one")
    p.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT, help="output token limit for Claude Code")
    p.add_argument("--claude-bin", default=None, help="the claude executable (default: claude on PATH)")
    p.add_argument("--no-start", action="store_true", help="fail instead of starting a server when none answers")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for a started server")
    p.set_defaults(run=run, passthrough=[])


def health(url: str, timeout: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return json.loads(r.read().decode("utf-8"))
    except (OSError, ValueError, urllib.error.URLError):
        return None


def find_claude(given: str | None) -> str | None:
    if given:
        return given if Path(given).exists() else shutil.which(given)
    return shutil.which("claude") or (str(REPO_CLAUDE) if REPO_CLAUDE.exists() else None)


def start_server(args: argparse.Namespace, url: str) -> dict:
    """Start `mlx-dspark serve` detached, log to a file, wait for /health with progress."""
    from engine import cache_dir  # commands import the engine when they run (agent_bridge/cli.py)

    log_dir = cache_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"serve-{args.port}.log"
    cmd = [sys.executable, "-m", "agent_bridge.cli", "serve", "--host", args.host, "--port", str(args.port)]
    if args.serve_model:
        cmd += ["--model", args.serve_model]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # outlives this process and claude
    print(f"mlx-dspark: no server at {url}; started one (pid {proc.pid}, log {log_path})", file=sys.stderr)
    t0 = time.monotonic()
    while True:
        info = health(url, timeout=1.0)
        if info:
            print(f"\rmlx-dspark: server ready after {time.monotonic() - t0:.0f}s{' ' * 20}", file=sys.stderr)
            return info
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise CommandError(f"the server exited (status {proc.returncode}) before it was ready:\n  "
                               + "\n  ".join(tail))
        if time.monotonic() - t0 > args.start_timeout:
            raise CommandError(f"the server did not answer within {args.start_timeout:.0f}s (pid {proc.pid}, log {log_path})")
        print(f"\rmlx-dspark: waiting for the server to load the model... {time.monotonic() - t0:.0f}s",
              end="", file=sys.stderr, flush=True)
        time.sleep(0.5)


def claude_environment(base: dict, info: dict, args: argparse.Namespace) -> dict:
    from agent_bridge.integrate.clients import DEFAULT_CONTEXT, Options, claude_env

    context = int(info.get("context_window") or DEFAULT_CONTEXT)
    opts = Options(port=args.port, host=args.host, model=str(info.get("model") or "mlx-dspark"),
                   context=context, max_output=min(args.max_output, max(context // 4, 256)),
                   api_key=args.api_key or "local")
    env = {k: v for k, v in base.items() if k != "ANTHROPIC_API_KEY"}  # a cloud key has no business here
    env.update(claude_env(opts))
    return env


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise CommandError(f"--port must be 1-65535, not {args.port}")
    claude = find_claude(args.claude_bin)
    if claude is None:
        raise CommandError("claude not found: install Claude Code (npm install -g @anthropic-ai/claude-code) "
                           "or pass --claude-bin PATH")
    url = f"http://{args.host}:{args.port}"
    info = health(url)
    if info is None:
        if args.no_start:
            raise CommandError(f"no server answers at {url} (start one with `mlx-dspark serve --port {args.port}`)")
        info = start_server(args, url)
    else:
        print(f"mlx-dspark: using the server at {url} ({info.get('model')})", file=sys.stderr)
    passthrough = list(args.passthrough)
    if passthrough[:1] == ["--"]:
        passthrough = passthrough[1:]
    sys.stderr.flush()
    os.execve(claude, [claude, *passthrough], claude_environment(dict(os.environ), info, args))
    return 0  # not reached
