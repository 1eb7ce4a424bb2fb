"""Options every model-running command shares, and the engine they build."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and decoding")
    g.add_argument("--model", help="mlx-lm model directory or hub id (default: the bundled reference model)")
    g.add_argument("--mode", default="auto", help="auto, baseline, lookup, or a drafter mode (default: auto)")
    g.add_argument("--max-draft", default=None, help="cap on draft length per round (default: engine's)")
    g.add_argument("--context-window", type=int, default=None, help="maximum prompt + output tokens")
    g.add_argument("--prefill-chunk", type=int, default=512, help="tokens per prefill step")


def parse_max_draft(value: str | None) -> int | None:
    from agent_bridge.cli import CommandError

    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise CommandError(f"--max-draft must be a whole number, not {value!r}") from None
    if n < 0:
        raise CommandError("--max-draft must be >= 0")
    return n


def engine_from_args(args: argparse.Namespace):
    from engine import DEFAULT_MAX_DRAFT, Engine

    max_draft = parse_max_draft(args.max_draft)
    return Engine(
        args.model,
        mode=args.mode,
        max_draft=DEFAULT_MAX_DRAFT if max_draft is None else max_draft,
        prefill_chunk=args.prefill_chunk,
        context_window=args.context_window,
    )
