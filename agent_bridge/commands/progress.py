"""A long measurement's status line on stderr, shared by `benchmark` and `tune`."""

from __future__ import annotations

import sys
import time

_last_line = [0.0]  # when the last line went to a file (not a terminal)


def progress(msg: str) -> None:
    """One status line rewritten in place on a terminal; a line a second at most into a file."""
    stamp = f"[{time.strftime('%H:%M:%S')}] {msg}"
    if sys.stderr.isatty():
        print(f"\r\033[K{stamp}", end="", file=sys.stderr, flush=True)
    elif time.monotonic() - _last_line[0] >= 1.0:
        _last_line[0] = time.monotonic()
        print(stamp, file=sys.stderr, flush=True)


def end_progress() -> None:
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)
