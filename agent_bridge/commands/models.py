"""`mlx-dspark models`: the models this machine can run offline, and their drafter heads."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list the bundled model and models in the local hub cache")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine import local_models

    models = local_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    print(f"{'model':<48} {'type':<10} {'bits':>4} {'MB':>8}  drafters")
    for m in models:
        bits = m["quantization"] or "-"
        print(f"{m['name']:<48} {m['model_type']:<10} {bits:>4} {m['weights_mb']:>8}  {', '.join(m['drafters']) or '-'}")
    print("\nuse one with --model NAME_OR_PATH; hub models not listed here need a download first")
    return 0
