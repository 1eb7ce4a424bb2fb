"""Options every model-running command shares, and the engine they build."""

from __future__ import annotations

import argparse
import os
import signal
import threading

from agent_bridge.commands import CommandError
from agent_bridge.mcp.edits import DEFAULT_MAX_EDIT_HUNKS


def add_split_args(parser) -> None:
    """How the model is split over the ranks `mlx.launch` starts (docs/distributed.md)."""
    parser.add_argument("--split", choices=["pipeline", "tensor"], default=None,
                        help="under mlx.launch: split the model over its ranks by layers (pipeline) or by "
                             "matmul slices (tensor) (default: mlx-lm's pick, tensor where the model has it)")
    parser.add_argument("--pipeline", dest="split", action="store_const", const="pipeline",
                        help="the same as --split pipeline (mlx-lm's name)")


LEADER_CLOSE_WAIT_S = 30  # how long a follower told to stop waits for rank 0's close


def follows(engine) -> bool:
    """On a rank other than 0 of a split model: take rank 0's steps until it closes (True then).
    Rank 0 alone serves, prints and writes.

    SIGTERM or SIGINT (a launcher or a terminal signals every rank) waits for rank 0's close,
    which closes this rank's engine at the same step, its prefix cache written to disk; a rank
    signalled alone writes its queued segments after that wait and ends as the signal would."""
    if engine.ranks.leader:
        return False
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: _end_after_leader(engine, signum))
    engine.follow()
    return True


def _end_after_leader(engine, signum: int) -> None:
    def wait_then_end():
        if not engine.stopped(LEADER_CLOSE_WAIT_S):
            engine.flush_disk(timeout=30)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    threading.Thread(target=wait_then_end, daemon=True).start()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and decoding")
    g.add_argument("--model", help="mlx-lm model directory or hub id (default: the bundled reference model)")
    add_split_args(g)
    g.add_argument("--mode", default="auto", help="auto, baseline, lookup, or a drafter mode (default: auto)")
    g.add_argument("--max-draft", default=None, help="cap on draft length per round, or 'auto' (default: engine's)")
    g.add_argument("--context-window", type=int, default=None, help="maximum prompt + output tokens")
    g.add_argument("--prefill-chunk", type=int, default=None,
                   help="tokens per prefill step (default: measured by `tune` for this machine and model)")
    g.add_argument("--drafter", default=None, metavar="PATH_OR_ID",
                   help="a DFlash or DSpark head checkpoint for this model (checked against it at start)")
    g.add_argument("--drafter-bits", type=int, choices=[4, 8], default=None, help="quantise drafter heads at load")
    g.add_argument("--loop-guard", type=int, default=None, metavar="TOKENS",
                   help="end a reply whose last TOKENS tokens repeat one short n-gram, as if max_tokens "
                        "was reached (serve and mcp default: 256; others: 0, off)")
    c = parser.add_argument_group("prefix cache")
    c.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt from scratch")
    c.add_argument("--prefix-cache-max-ram-mb", type=float, default=None,
                   help="RAM for cached KV (default: min(8 GiB, a quarter of the machine's memory))")
    c.add_argument("--prefix-cache-dir", default=None,
                   help="write cached KV here as it is made (a background writer), so a restart starts warm "
                        "(serve and mcp default: ~/.cache/mlx-dspark/prefix-cache; 'off' for none)")
    c.add_argument("--prefix-cache-max-disk-mb", type=float, default=None,
                   help="disk cap of --prefix-cache-dir (default: min(16 GiB, a quarter of the free space))")
    c.add_argument("--kv-bits", type=int, choices=[4, 8], default=None, help="quantise the KV cache")


def add_max_edit_hunks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-edit-hunks", type=int, default=DEFAULT_MAX_EDIT_HUNKS, metavar="N",
                        help="MCP edit_file writes a change of at most N diff hunks; a larger one is "
                             f"returned as a proposal (default {DEFAULT_MAX_EDIT_HUNKS})")


def parse_max_draft(value: str | None) -> int | str | None:
    if value is None:
        return None
    if value == "auto":  # adapt per round from the measured cost curve (engine/tuning/cost_curve.py, engine/tuning/draft_control.py)
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise CommandError(f"--max-draft must be a whole number or 'auto', not {value!r}") from None
    if n < 0:
        raise CommandError("--max-draft must be >= 0")
    return n


def prefix_cache_dir(args: argparse.Namespace, persistent: bool) -> str | None:
    """The disk tier's folder: the flag's, else for long-lived commands the user's cache dir."""
    from engine import cache_dir

    value = getattr(args, "prefix_cache_dir", None)
    if value == "off" or getattr(args, "no_prefix_cache", False):
        return None
    if value is None and persistent:
        return str(cache_dir() / "prefix-cache")
    return value


def engine_from_args(args: argparse.Namespace, persistent: bool = False):
    """The engine the flags describe; `persistent` (serve, mcp) keeps a disk tier by default and
    is long-lived (its start does what makes later turns faster)."""
    import sys

    from engine import DEFAULT_MAX_DRAFT, Engine, slow_blas_warning
    from engine.base.loop_guard import DEFAULT_WINDOW as DEFAULT_LOOP_GUARD

    warning = slow_blas_warning()
    if warning:
        print(warning, file=sys.stderr)  # one line; `doctor` says more
    for flag in ("prefix_cache_max_ram_mb", "prefix_cache_max_disk_mb"):
        if (getattr(args, flag, None) or 0) < 0:
            raise CommandError(f"--{flag.replace('_', '-')} must be >= 0")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise CommandError(f"--prefill-chunk must be >= 1, not {args.prefill_chunk}")
    max_draft = parse_max_draft(args.max_draft)
    loop_guard = getattr(args, "loop_guard", None)
    if loop_guard is None:  # long-lived servers guard agents against a looping model by default
        loop_guard = DEFAULT_LOOP_GUARD if persistent else 0
    if loop_guard == 1 or loop_guard < 0:
        raise CommandError("--loop-guard must be 0 (off) or at least 2 tokens")
    return Engine(
        args.model,
        mode=args.mode,
        max_draft=DEFAULT_MAX_DRAFT if max_draft is None else max_draft,
        prefill_chunk=args.prefill_chunk,
        context_window=args.context_window,
        prefix_cache=not getattr(args, "no_prefix_cache", False),
        prefix_cache_max_ram_mb=getattr(args, "prefix_cache_max_ram_mb", None),
        prefix_cache_dir=prefix_cache_dir(args, persistent),
        prefix_cache_max_disk_mb=getattr(args, "prefix_cache_max_disk_mb", None),
        kv_bits=getattr(args, "kv_bits", None),
        drafter=getattr(args, "drafter", None),
        drafter_bits=getattr(args, "drafter_bits", None),
        loop_guard=loop_guard,
        max_batch=getattr(args, "max_batch", 1),
        split=getattr(args, "split", None),
        long_lived=persistent,
    )
