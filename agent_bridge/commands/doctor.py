"""`mlx-dspark doctor`: what this machine runs MLX on, what would make it faster, and
its roofline for a model (memory bandwidth, plain-decode ceiling, verify cost curve)."""

from __future__ import annotations

import argparse
import json
import sys

from agent_bridge.commands import CommandError
from agent_bridge.commands.tune import surface_lines


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="report backend, device, BLAS, dtype, fixes and the roofline")
    p.add_argument("--model", help="model for the roofline (default: the bundled reference model)")
    p.add_argument("--no-model", action="store_true", help="skip loading a model (no roofline)")
    p.add_argument("--prefill-tokens", default=None, metavar="N[,N...]",
                   help="prefill sizes to run cold in full beside their estimate (default: 8192 and 32768 "
                        "are predicted from two timed chunks)")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill estimate")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine import describe_platform

    full = ()
    if args.prefill_tokens:
        try:
            full = tuple(int(n) for n in args.prefill_tokens.split(",") if n.strip())
        except ValueError:
            raise CommandError(f"--prefill-tokens takes comma-separated whole numbers, not {args.prefill_tokens!r}") from None
        if not full or min(full) < 1:
            raise CommandError("--prefill-tokens needs token counts >= 1")
    info = describe_platform()
    roof, problem, prefill, surface = None, None, None, None
    if not args.no_model:
        from engine import Engine, EngineError, machine_report, prefill_report
        from engine.tuning.batch_cost import quick_surface

        try:
            with Engine(args.model, prefix_cache=False) as engine:
                roof = {"model": engine.model_path, **engine.call(machine_report)}
                # what `serve --max-batch auto` uses: cached, else measured now (and cached)
                surface = engine.call(quick_surface)
                if not args.no_prefill and "advice" not in info:  # on a slow BLAS: fix that first
                    sizes = tuple(sorted(set((8192, 32768) + full)))
                    prefill = engine.call(lambda t: prefill_report(t, sizes, engine.prefill_chunk, full))
        except EngineError as e:
            problem = str(e)
    if args.json:
        print(json.dumps({**info, "roofline": roof, "prefill": prefill,
                          "batch_surface": surface.describe() if surface else None,
                          **({"roofline_error": problem} if problem else {})}, indent=2))
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
        if roof.get("rollback"):
            costs = "; ".join(f"{mode} " + " ".join(f"w{w}={c}" for w, c in by_width.items())
                              for mode, by_width in roof["rollback_cost"].items())
            print(f"{'rollback':>14}: {roof['rollback']} (recurrent layers take back a draft by per-position "
                  f"state capture or a replay; verify cost with half taken back: {costs})")
        print(f"{'curve':>14}: {roof['curve']}")
    if surface:
        print()
        print("\n".join(surface_lines(surface)))
    if prefill:
        print(f"\ncold prefill, {prefill['chunk']}-token chunks; float32 matmul: numpy's BLAS "
              f"{prefill['numpy_gflops']} GFLOP/s, MLX's {prefill['mlx_gflops']} GFLOP/s (measured now)")
        for row in prefill["sizes"]:
            parts = [f"estimate {row['estimate_s']} s at the faster rate ({row['gflop']} GFLOP, "
                     f"{row['attention_gflop']} of it attention)"]
            if "measured_s" in row:
                parts.append(f"measured {row['measured_s']} s ({row['measured_s'] / row['estimate_s']:.2f}x)")
            elif "measured_note" in row:
                parts.append(f"not measured: {row['measured_note']}")
            if "predicted_s" in row:
                parts.append(f"predicted {row['predicted_s']} s from two timed chunks "
                             f"({row['predicted_s'] / row['estimate_s']:.2f}x)")
            if len(parts) == 1:
                parts.append("not measured (this cache kind can't be filled at random; --prefill-tokens runs it)")
            print(f"{str(row['tokens']) + ' tokens':>14}: " + "; ".join(parts))
    return 0
