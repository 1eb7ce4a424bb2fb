"""`mlx-dspark mcp`: the MCP server over stdio, for agents that launch it as a subprocess."""

from __future__ import annotations

import argparse
import contextlib
import sys

from agent_bridge.commands import CommandError
from agent_bridge.commands.common import add_engine_args, add_max_edit_hunks, engine_from_args, follows


def add_parser(sub) -> None:
    p = sub.add_parser("mcp", help="MCP server over stdio (tools: rewrite_file, rename_symbol, edit_file, ...)")
    add_engine_args(p)
    p.add_argument("--root", default=None, help="workspace root the tools may read and write (default: current directory)")
    p.add_argument("--server", default=None, metavar="URL",
                   help="generate through a running `mlx-dspark serve` at URL instead of loading the model here")
    p.add_argument("--api-key", default=None, help="bearer token for --server (default: none needed locally)")
    add_max_edit_hunks(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from agent_bridge.mcp.backends import EngineBackend, HTTPBackend
    from agent_bridge.mcp.server import build_server
    from agent_bridge.mcp.workspace import Workspace, WorkspaceError

    if args.max_edit_hunks < 1:
        raise CommandError("--max-edit-hunks must be >= 1")
    try:
        workspace = Workspace(args.root)
    except WorkspaceError as e:
        raise CommandError(str(e)) from None
    engine = None
    if args.server:
        backend = HTTPBackend(args.server, api_key=args.api_key, model=args.model)
    else:
        # stdout is the MCP wire: anything a loader prints must go to stderr
        with contextlib.redirect_stdout(sys.stderr):
            engine = engine_from_args(args, persistent=True)
        if follows(engine):  # a split model's other ranks: rank 0 alone speaks MCP
            return 0
        backend = EngineBackend(engine, mode=args.mode)
    if engine is not None:
        flush_on_signals(engine)
    try:
        build_server(backend, workspace, max_edit_hunks=args.max_edit_hunks).run("stdio")
    finally:
        if engine is not None:
            engine.close()
    return 0


def flush_on_signals(engine) -> None:
    """SIGTERM and SIGINT write the prefix cache's queued segments to disk, then end the process
    as the signal would have (the stdio loop gives no shutdown hook of its own)."""
    import os
    import signal

    def handler(signum, frame):
        engine.flush_disk(timeout=30)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
