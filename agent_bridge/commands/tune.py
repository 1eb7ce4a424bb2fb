"""`mlx-dspark tune`: measure (or show) the verify cost curve that `--max-draft auto` uses."""

from __future__ import annotations

import argparse
import json

from agent_bridge.commands import CommandError
from agent_bridge.commands.progress import end_progress, progress


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure this machine's verify cost curve for a model (cached)")
    p.add_argument("--model", help="mlx-lm model directory or hub id (default: the bundled reference model)")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None, help="for a quantised KV cache")
    p.add_argument("--refresh", action="store_true", help="measure again even if a curve is cached")
    p.add_argument("--depths", default=None, help="context depths to measure at (default: 256,2048,8192)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per width (median; default 3)")
    p.add_argument("--acceptance", type=float, default=0.8,
                   help="per-token acceptance to pick a static draft cap for (default: %(default)s)")
    p.add_argument("--no-prefill", action="store_true",
                   help="skip measuring the prefill chunk size and the CPU attention crossover")
    p.add_argument("--json", action="store_true", help="print the curve as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine import Engine, best_draft_cap, curve_key, load_cost_curve, tune, tune_batch, tune_prefill

    kwargs = {}
    if args.depths:
        try:
            kwargs["depths"] = [int(d) for d in args.depths.split(",") if d.strip()]
        except ValueError:
            raise CommandError(f"--depths takes comma-separated whole numbers, not {args.depths!r}") from None
        if not kwargs["depths"] or min(kwargs["depths"]) < 0:
            raise CommandError("--depths needs at least one depth >= 0")
    if args.repeats is not None:
        if args.repeats < 1:
            raise CommandError("--repeats must be >= 1")
        kwargs["repeats"] = args.repeats
    if not 0.0 <= args.acceptance <= 1.0:
        raise CommandError("--acceptance must be between 0 and 1")

    try:
        with Engine(args.model, kv_bits=args.kv_bits, prefix_cache=False) as engine:
            cached = engine.call(lambda t: load_cost_curve(curve_key(t, args.kv_bits)))
            dtype = engine.info()["dtype"]  # while the model is loaded: the report below comes after it closes
            curve = engine.call(lambda t: tune(t, args.kv_bits, refresh=args.refresh, **kwargs,
                                               on_progress=lambda what, i, n: progress(f"measuring {what} ({i}/{n})")))
            surface = engine.call(lambda t: tune_batch(
                t, args.kv_bits, refresh=args.refresh,
                on_progress=lambda what, i, n: progress(f"measuring batch cost surface: {what} ({i}/{n})")))
            prefill = None
            if not args.no_prefill:
                progress("measuring the prefill chunk and the CPU attention crossover")
                prefill = engine.call(lambda t: tune_prefill(t, refresh=args.refresh))
    finally:
        end_progress()
    if args.json:
        print(json.dumps({**curve.to_dict(), "batch_surface": {**surface.to_dict(), **surface.describe()},
                          "prefill": prefill}, indent=1))
        return 0
    fresh = cached is None or args.refresh
    print(f"verify cost curve for {engine.model_path} ({'measured now' if fresh else 'cached'}, "
          f"{curve.measured_at}, {curve.measure_s:.0f}s to measure)")
    print(f"device {curve.key.get('device')}, MLX {curve.key.get('mlx')}, dtype {dtype}")
    widths = [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= curve.widths[-1]]
    print("depth   " + "".join(f"{'w' + str(w):>8}" for w in widths) + "   best perfect-drafter speedup")
    for depth in curve.depths:
        w, s = curve.best_perfect_speedup(depth)
        cells = "".join(f"{curve.relative(x, depth):8.2f}" for x in widths)
        print(f"{depth:<8}{cells}   {s:.2f}x at width {w}  (width 1 = {curve.step_seconds(1, depth) * 1e3:.1f} ms)")
    if curve.rollback:  # recurrent layers: the curve above is the cheaper way of taking back a draft
        other = [m for m in curve.rollback_seconds if m != curve.rollback]
        if other:
            d = curve.depths[0]
            dearer = curve.for_rollback(other[0]).step_seconds(16, d) / curve.step_seconds(16, d)
            print(f"rollback: {curve.rollback} (a width-16 pass with half taken back costs {dearer:.2f}x as much by {other[0]})")
        else:
            print(f"rollback: {curve.rollback} (this model's recurrences can't be captured)")
    cap, gain = best_draft_cap(curve, args.acceptance, depth=curve.depths[0])
    print(f"static draft cap for acceptance {args.acceptance:.2f}: {cap} (expected {gain:.2f}x); "
          "--max-draft auto adapts it per round")
    print("\n".join(surface_lines(surface)))
    if prefill:
        chunk, attn = prefill["chunk"], prefill["attention"]
        times = ", ".join(f"{c}: {s:.2f}s" for c, s in chunk["seconds"].items())
        print(f"prefill chunk: {chunk['chunk']} tokens (prefill of {chunk['tokens']} tokens: {times})")
        if attn:
            where = f"from {attn['min_keys']} keys" if attn["min_keys"] is not None else "never (MLX's is faster here)"
            times = ", ".join(f"{k}: {m:.3f}/{o:.3f}s" for k, m, o in attn["timings"])
            print(f"CPU blockwise attention: {where} (keys: MLX/blockwise for one {512}-query chunk: {times})")
    return 0


def surface_lines(surface) -> list[str]:
    """The batch cost surface as text: ms per batched forward, the saving against running the
    sequences alone, and what follows (the widest batched forward, --max-batch auto)."""
    d = surface.describe()
    if not d["measured"]:
        return [f"batch cost surface: not measured (`mlx-dspark tune` measures it); defaults: max batch "
                f"{d['max_batch']}, forwards up to {d['max_batched_width']} tokens wide batched"]
    lines = [f"batch cost surface ({surface.depth} tokens of context per sequence; ms per forward, "
             f"saving against the sequences one after another):",
             "batch   " + "".join(f"{'w' + str(w):>16}" for w in surface.widths)]
    for b in surface.batches:
        cells = "".join(f"{d['forward_ms'][str(b)][str(w)]:9.1f}" + (
            f" ({d['saving'][str(b)][str(w)]:+.0%})" if b > 1 else "").ljust(7) for w in surface.widths)
        lines.append(f"{b:<8}{cells}")
    lines.append(f"max batch (auto): {d['max_batch']}; verify forwards up to {d['max_batched_width']} tokens "
                 "wide are batched, wider ones run alone")
    return lines
