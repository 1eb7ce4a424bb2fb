"""`mlx-dspark integrate CLIENT`: print, or merge into place, the config that points an agent
or editor at the local server and adds the MCP tools (and, for Claude Code, the hooks)."""

from __future__ import annotations

import argparse
import shutil
import sys

from agent_bridge.commands import CommandError
from agent_bridge.integrate.clients import (CLIENTS, DEFAULT_PORT, HOOK_SCRIPTS, HOOKS_DIR, PARTS, Options,
                                         claude_hooks_dir, mcp_command, targets)


def add_parser(sub) -> None:
    p = sub.add_parser("integrate", help="configure an agent or editor: " + ", ".join(CLIENTS))
    p.add_argument("client", choices=sorted(CLIENTS), metavar="CLIENT", help=", ".join(CLIENTS))
    p.add_argument("--write", action="store_true", help="merge into the client's config files (keeps every key, writes a backup)")
    p.add_argument("--scope", choices=["project", "user"], default="project",
                   help="project: files in the current folder; user: files in your home (default: project)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port of `mlx-dspark serve` (default {DEFAULT_PORT})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                   help="MCP over stdio (the client launches `mlx-dspark mcp`) or HTTP (/mcp on the server)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"what to configure, comma-separated from {','.join(PARTS)} (default: all)")
    p.add_argument("--model-name", default=None, help="model name the client asks for (default: mlx-dspark)")
    p.add_argument("--context", type=int, default=None, help="context window to tell the client")
    p.add_argument("--max-output", type=int, default=None, help="output token limit to tell the client")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from agent_bridge.integrate.config_files import ConfigError, dumps, merge_into_file  # loads MLX (engine.base)

    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - set(PARTS):
        raise CommandError(f"--parts: choose from {', '.join(PARTS)}")
    if not 0 < args.port < 65536:
        raise CommandError(f"--port must be 1-65535, not {args.port}")
    opts = Options(port=args.port, host=args.host, scope=args.scope, transport=args.transport, command=mcp_command())
    if args.model_name:
        opts.model = args.model_name
    if args.context:
        opts.context = args.context
    if args.max_output:
        opts.max_output = args.max_output
    found = targets(args.client, opts, parts)
    if not found:
        raise CommandError(f"{args.client}: nothing to configure for --parts {args.parts}")

    if not args.write:
        for t in found:
            print(f"# {t.about}\n# merge into {t.path}")
            print(dumps(t.data, t.fmt))
        print("# run again with --write to merge these into place (a backup of each file is kept)", file=sys.stderr)
        return 0

    for t in found:
        existed = t.path.exists()
        try:
            backup = merge_into_file(t.path, t.data, t.fmt)
        except ConfigError as e:
            raise CommandError(f"{e} (nothing written; fix the file or merge the snippet by hand)") from None
        if existed and backup is None:
            print(f"{t.path}: already up to date")
        else:
            print(f"wrote {t.path}" + (f" (backup: {backup})" if backup else " (new file)"))
    if args.client == "claude-code" and "hooks" in parts:
        dest = claude_hooks_dir(opts)
        dest.mkdir(parents=True, exist_ok=True)
        for script in HOOK_SCRIPTS:
            shutil.copyfile(HOOKS_DIR / script, dest / script)
        print(f"wrote hook scripts to {dest}")
    return 0
