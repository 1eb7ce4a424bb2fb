"""`mlx-dspark doctor`: what this machine runs MLX on, and what would make it faster."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="report backend, device, BLAS, dtype and fixes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine import describe_platform

    info = describe_platform()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if key != "advice":
            print(f"{key:>14}: {value}")
    if "advice" in info:
        print(f"\nadvice: {info['advice']}")
    return 0
