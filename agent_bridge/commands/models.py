"""`mlx-dspark models`: every MLX model on this machine, and how each would run here."""

from __future__ import annotations

import argparse
import json


def add_models_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                        help="also look for models under DIR (repeatable; config.toml's models_dirs too)")


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list every MLX model on this machine (bundled, hub cache, LM Studio, your folders)")
    add_models_dir_arg(p)
    p.add_argument("--json", action="store_true", help="one JSON object per model, in an array")
    p.set_defaults(run=run)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _params(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_table(models: list[dict]) -> str:
    rows = [("model", "source", "arch", "params", "quant", "size", "context", "rollback", "drafters", "tools", "reasoning", "images")]
    for m in models:
        rows.append((m["name"] + ("" if m["loads"] else " (!)"), m["source"], m["model_type"], _params(m["parameters"]),
                     m["quantization"] or (m["dtype"] or "float"), _size(m["size_bytes"]),
                     str(m["context_length"] or "?"), m["cache_rollback"],
                     ", ".join(d + ("*" if d in m["drafters_to_download"] else "") for d in sorted(m["drafters"])) or "-",
                     m["tool_call_format"] or "-", m["reasoning_format"] or "-",
                     "-" if m["images"] is None else m["images"].split(":")[0]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for m in models:
        if not m["loads"]:
            lines.append(f"(!) {m['name']}: {m['problem']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from engine.catalog.model_catalog import find_models

    models = [m.to_dict() for m in find_models(args.models_dir)]
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    print(format_table(models))
    print("\n* registered drafter head not downloaded yet: `mlx-dspark pull MODEL --drafter`")
    print("run one with --model NAME_OR_PATH; fetch a hub model with `mlx-dspark pull HUB_ID`")
    return 0
