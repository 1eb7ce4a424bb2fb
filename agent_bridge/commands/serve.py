"""`mlx-dspark serve`: the OpenAI, Anthropic and Responses APIs over HTTP."""

from __future__ import annotations

import argparse

from agent_bridge.commands import CommandError
from agent_bridge.commands.common import add_engine_args, add_max_edit_hunks, engine_from_args, follows
from agent_bridge.commands.models import add_models_dir_arg


def add_parser(sub) -> None:
    from agent_bridge.serving.bridge import DEFAULT_MAX_QUEUE
    from agent_bridge.app import DEFAULT_HOST, DEFAULT_MAX_TOKENS, DEFAULT_PORT

    p = sub.add_parser("serve", help="serve the OpenAI, Anthropic and Responses APIs")
    add_engine_args(p)
    add_models_dir_arg(p)
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer or x-api-key)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --api-key (anyone who can reach it may use the "
                        "model and the MCP file tools)")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="output cap when an OpenAI request sets none")
    p.add_argument("--model-name", default=None, help="name reported by /v1/models (default: the model directory's)")
    p.add_argument("--root", default=None, help="workspace root for the MCP tools at /mcp (default: current directory)")
    p.add_argument("--no-mcp", action="store_true", help="don't serve MCP (streamable HTTP) at /mcp")
    p.add_argument("--max-batch", default="auto", metavar="N|auto",
                   help="requests the engine works on at once, their verify forwards batched (default auto: "
                        "the largest batch that still gains throughput on this machine, from its measured "
                        "batch cost surface; measured once per model, `doctor` prints it)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"waiting requests past which new ones get 429/529 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--strict-tools", action=argparse.BooleanOptionalAction, default=None,
                   help="keep every tool call valid by construction: the call's markup and its arguments typed "
                        "by the tool's schema, through the grammar, in every call syntax the server parses (default: "
                        "on; a tool marked strict by the client is kept to its schema either way)")
    add_max_edit_hunks(p)
    p.add_argument("--allow-switch", action="store_true",
                   help="a request naming another model on this machine loads it (else a 404)")
    p.add_argument("--max-models", type=int, default=1, metavar="N",
                   help="models kept loaded at once; the least recently used idle one is released (default 1)")
    p.add_argument("--models-memory-mb", type=float, default=None, metavar="MB",
                   help="weights of all loaded models together stay under this (default: 3/4 of the machine's memory)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def is_loopback(host: str) -> bool:
    import ipaddress

    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: may resolve anywhere


def run(args: argparse.Namespace) -> int:
    from agent_bridge.app import serve

    if not 0 < args.port < 65536:
        raise CommandError(f"--port must be 1-65535, not {args.port}")
    if not is_loopback(args.host) and not args.api_key and not args.insecure:
        raise CommandError(f"--host {args.host} is reachable from other machines, and /mcp serves tools that "
                           "write files: set --api-key KEY (or --insecure to serve it open anyway)")
    if args.default_max_tokens < 1:
        raise CommandError("--default-max-tokens must be >= 1")
    if args.max_batch != "auto":
        try:
            args.max_batch = int(args.max_batch)
        except ValueError:
            raise CommandError(f"--max-batch takes a whole number or 'auto', not {args.max_batch!r}") from None
    if (args.max_batch != "auto" and args.max_batch < 1) or args.max_queue < 0:
        raise CommandError("--max-batch must be >= 1 (or auto) and --max-queue >= 0")
    if args.max_edit_hunks < 1:
        raise CommandError("--max-edit-hunks must be >= 1")
    if args.max_models < 1:
        raise CommandError("--max-models must be >= 1")

    def load_engine(path: str):  # another model, with the same flags (its own registered drafters)
        return engine_from_args(argparse.Namespace(**{**vars(args), "model": path, "drafter": None}), persistent=True)

    with engine_from_args(args, persistent=True) as engine:
        if follows(engine):
            return 0
        if engine.ranks.split and args.allow_switch:
            raise CommandError("--allow-switch: a split model's ranks load one model; restart them all for another")
        print(f"mlx-dspark: serving {engine.model_path} on http://{args.host}:{args.port} "
              f"(context {engine.context_window} tokens, max batch {engine.max_batch}"
              f"{'' if args.no_mcp else ', MCP at /mcp'})", flush=True)
        from agent_bridge.serving.model_registry import EngineHandle

        handle = EngineHandle(engine)  # the MCP tools follow a model switch
        mcp_routes, mcp_lifespan = (), None
        if not args.no_mcp:
            from agent_bridge.mcp.server import http_mount

            mcp_routes, mcp_lifespan = http_mount(handle, root=args.root, host=args.host,
                                                   max_edit_hunks=args.max_edit_hunks)  # MCP at /mcp
        serve(engine, host=args.host, port=args.port, log_level=args.log_level, api_key=args.api_key,
              default_max_tokens=args.default_max_tokens, model_name=args.model_name, max_queue=args.max_queue,
              extra_routes=mcp_routes, lifespan=mcp_lifespan, models_dirs=args.models_dir,
              load_engine=load_engine, allow_switch=args.allow_switch, max_models=args.max_models,
              engine_handle=handle, models_memory_mb=args.models_memory_mb, strict_tools=args.strict_tools)
    return 0
