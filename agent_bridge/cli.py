"""`mlx-dspark` command line: one module per subcommand under agent_bridge/commands/.

Each command module has `add_parser(subparsers)` and `run(args) -> int`. Heavy
imports (MLX, the engine) happen inside `run`, after OpenBLAS has been preloaded.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from agent_bridge.commands import CommandError

# subcommand -> module under agent_bridge.commands
COMMANDS = {
    "generate": "generate",
    "doctor": "doctor",
    "models": "models",
    "pull": "pull",
    "serve": "serve",
    "mcp": "mcp",
    "integrate": "integrate",
    "claude": "claude",
    "benchmark": "benchmark",
    "tune": "tune",
    "ui": "ui",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-dspark",
        description="Lossless speculative decoding on MLX for local coding agents.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        importlib.import_module(f"agent_bridge.commands.{module}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine.base.platform import ensure_fast_blas

    ensure_fast_blas()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # only a command that hands its arguments on (`claude`) takes unknown ones
        if not hasattr(args, "passthrough"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.passthrough = extra
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - a CLI shows a line, not a traceback
        from engine.base.errors import EngineError

        if isinstance(e, (CommandError, EngineError, OSError, ValueError)):
            print(f"mlx-dspark: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    # Run through the package so that CommandError has one identity (`python -m agent_bridge`).
    from agent_bridge.cli import main as package_main

    sys.exit(package_main())
