"""`mlx-dspark doctor`: what this machine runs MLX on, what would make it faster, and
its roofline for a model (memory bandwidth, plain-decode ceiling, verify cost curve)."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="report backend, device, BLAS, dtype, fixes and the roofline")
    p.add_argument("--model", help="model for the roofline (default: the bundled reference model)")
    p.add_argument("--no-model", action="store_true", help="skip loading a model (no roofline)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine import describe_platform

    info = describe_platform()
    roof, problem = None, None
    if not args.no_model:
        from engine import Engine, EngineError, machine_report

        try:
            with Engine(args.model, prefix_cache=False) as engine:
                roof = {"model": engine.model_path, **engine.call(machine_report)}
        except EngineError as e:
            problem = str(e)
    if args.json:
        print(json.dumps({**info, "roofline": roof, **({"roofline_error": problem} if problem else {})}, indent=2))
        return 0
    for key, value in info.items():
        if key != "advice":
            print(f"{key:>14}: {value}")
    if "advice" in info:
        print(f"\nadvice: {info['advice']}")
    if problem:
        print(f"\nroofline: no model loaded ({problem})", file=sys.stderr)
    if roof:
        print(f"\nroofline for {roof['model']} ({roof['model_bytes'] / 1e6:.1f} MB of weights)")
        print(f"{'bandwidth':>14}: {roof['bandwidth_gb_s']} GB/s (measured)")
        print(f"{'ceiling':>14}: {roof['plain_decode_ceiling_tok_s']} tok/s plain decoding if memory-bound")
        for depth, d in roof["by_depth"].items():
            costs = " ".join(f"w{w}={c}" for w, c in d["cost"].items())
            print(f"{'depth ' + depth:>14}: plain {d['plain_tok_s']} tok/s ({d['plain_step_ms']} ms/step); "
                  f"verify cost {costs}; perfect drafter {d['best_speedup_perfect_drafter']}x at width "
                  f"{d['best_width']}")
        print(f"{'curve':>14}: {roof['curve']}")
    return 0
