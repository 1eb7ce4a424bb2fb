"""`mlx-dspark pull HUB_ID [--drafter [ID]]`: download a model (and its drafter head), checked."""

from __future__ import annotations

import argparse
import json
import sys
import threading


def add_parser(sub) -> None:
    p = sub.add_parser("pull", help="download a model from the Hugging Face hub (resumable), then check it")
    p.add_argument("repo_id", metavar="HUB_ID", help="e.g. mlx-community/Qwen3-4B-4bit")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    p.add_argument("--drafter", nargs="?", const=True, default=False, metavar="HEAD_ID",
                   help="also fetch the drafter head registered for this model (or the head HEAD_ID)")
    p.add_argument("--json", action="store_true",
                   help="JSON lines: progress events ({repo, kind: files|bytes|weights, done, total}), then the result")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.catalog.model_pull import pull

    if args.json:
        lock = threading.Lock()  # downloads run in threads: one whole line at a time

        def emit(event: dict) -> None:
            with lock:
                sys.stdout.write(json.dumps(event) + "\n")
                sys.stdout.flush()

        result = pull(args.repo_id, revision=args.revision, drafter=args.drafter, progress=False,
                      say=lambda line: emit({"message": line}), on_progress=emit)
        emit({"ok": True, "repo": result.repo_id, "path": str(result.path),
              "drafters": {k: str(v) for k, v in result.drafters.items()}, "notes": result.notes})
        return 0
    result = pull(args.repo_id, revision=args.revision, drafter=args.drafter, progress=sys.stderr.isatty())
    print(f"ok: {result.repo_id} -> {result.path}")
    for head_id, path in result.drafters.items():
        print(f"ok: drafter {head_id} -> {path}")
    for note in result.notes:
        print(f"note: {note}")
    print(f"run it: mlx-dspark serve --model {result.repo_id}")
    return 0
