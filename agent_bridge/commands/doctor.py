"""`mlx-dspark doctor`: what this machine runs MLX on, what would make it faster, and
its roofline for a model (memory bandwidth, plain-decode ceiling, verify cost curve), and
which mode `auto` runs for that model here, with the numbers it chose by."""

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
    p.add_argument("--no-roofline", action="store_true",
                   help="skip the roofline and batch measurements (the model still loads: `auto`'s pick in seconds)")
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="show the mode `auto` picks for this prompt (default: a prompt lookup finds no match in)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def _read_prompt(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"--prompt-file {path}: {e}") from None


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
    roof, problem, prefill, surface, auto, disk = None, None, None, None, None, None
    prompt = _read_prompt(args.prompt_file)
    if not args.no_model:
        from engine import Engine, EngineError, machine_report, prefill_report
        from engine.tuning.batch_cost import quick_surface

        try:
            with Engine(args.model, prefix_cache=False) as engine:
                if not args.no_roofline:
                    roof = {"model": engine.model_path, **engine.call(machine_report)}
                    # what `serve --max-batch auto` uses: cached, else measured now (and cached)
                    surface = engine.call(quick_surface)
                ids = engine.render_chat([{"role": "user", "content": prompt}]) if prompt is not None else []
                auto = engine.mode_choice(ids)  # measures a head's draft cost once, if not yet measured here
                disk = engine.call(_disk_rates)
                if not args.no_prefill and "advice" not in info:  # on a slow BLAS: fix that first
                    sizes = tuple(sorted(set((8192, 32768) + full)))
                    prefill = engine.call(lambda t: prefill_report(t, sizes, engine.prefill_chunk, full))
        except EngineError as e:
            problem = str(e)
    if args.json:
        print(json.dumps({**info, "roofline": roof, "prefill": prefill,
                          "batch_surface": surface.describe() if surface else None,
                          "auto_mode": auto.to_dict() if auto else None, "disk_tier": disk,
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
        print(f"{'bandwidth':>14}: {roof['bandwidth_gb_s']} GB/s (measured by the {roof['bandwidth_source']})")
        print(f"{'ceiling':>14}: {roof['plain_decode_ceiling_tok_s']} tok/s plain decoding if memory-bound "
              f"(weights only; each depth below adds its KV cache)")
        for depth, d in roof["by_depth"].items():
            costs = " ".join(f"w{w}={c}" for w, c in d["cost"].items())
            print(f"{'depth ' + depth:>14}: plain {d['plain_tok_s']} tok/s ({d['plain_step_ms']} ms/step, "
                  f"ceiling {d['ceiling_tok_s']}); "
                  f"verify cost {costs}; perfect drafter {d['best_speedup_perfect_drafter']}x at width "
                  f"{d['best_width']}")
        if roof.get("rollback"):
            costs = "; ".join(f"{mode} " + " ".join(f"w{w}={c}" for w, c in by_width.items())
                              for mode, by_width in roof["rollback_cost"].items())
            print(f"{'rollback':>14}: {roof['rollback']} (recurrent layers take back a draft by per-position "
                  f"state capture or a replay; verify cost with half taken back: {costs})")
        print(f"{'curve':>14}: {roof['curve']}")
    if auto:
        which = f"the prompt in {args.prompt_file}" if prompt is not None else "a prompt lookup finds no match in"
        print(f"\n{'auto mode':>14}: {auto.mode} for {which}")
        print(f"{'why':>14}: expected speed against plain decoding: {auto.reason()}")
        print(f"{'':>14}  (per request, `auto` replays lookup on that prompt's last tokens and picks again)")
    if surface:
        print()
        print("\n".join(surface_lines(surface)))
    if prefill:
        n = prefill["mlx_n"]
        print(f"\ncold prefill, {prefill['chunk']}-token chunks; matmul: numpy's float32 BLAS "
              f"{prefill['numpy_gflops']} GFLOP/s, MLX's {prefill['mlx_dtype']} at {n}x{n}x{n} "
              f"{prefill['mlx_gflops']} GFLOP/s (measured now)")
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
    if disk:
        print("\n".join(_disk_lines(disk)))
    return 0


def _disk_rates(target) -> dict:
    """The rates `serve`'s disk tier chooses restores by, as kept in its folder for this model."""
    from engine import cache_dir
    from engine.caches.kv_disk import kept_rates
    from engine.caches.prefix_cache import cache_identity

    folder = cache_dir() / "prefix-cache" / cache_identity(target, None)
    return {"folder": str(folder), **kept_rates(folder)}


def _disk_lines(disk: dict) -> list[str]:
    restore, prefill = disk["restore_bytes_per_s"], disk["prefill_tokens_per_s"]
    return [f"\ndisk tier {disk['folder']} (a file is read only where that is faster than computing it)",
            f"{'restore':>14}: " + (f"{restore / 1e9:.2f} GB/s (measured by restores)" if restore else "not measured yet"),
            f"{'prefill':>14}: " + (f"{prefill:.0f} tokens/s (measured by prefills)" if prefill else "not measured yet")]
