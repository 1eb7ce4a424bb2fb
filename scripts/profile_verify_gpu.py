"""Which kernel a quantised forward of each width should take, on a GPU.

    python scripts/profile_verify_gpu.py --model DIR [--depth 2048] [--widths 1,2,4,...,512] [--json FILE]

Times the engine's forward of each width at one context depth three times, as tune's cost curve does
(engine/tuning/cost_curve.py: median of `--repeats` sweeps, each pass rolled back), each way set
through engine/kernels/quantized_route.py's variables: through MLX's
quantized kernels; through engine/kernels/narrow_qmm.py where it takes the width (2 to its MAX_ROWS);
and with every QuantizedLinear dequantized for the forward (engine/kernels/wide_dequantize.py at one
row). Prints the three with the rows where the narrow kernel wins (the first run of measured widths
at which it beats MLX's kernels: `MLX_DSPARK_NARROW_QMM_ROWS=FIRST-LAST`, whose default,
narrow_qmm.FASTER_FROM to MAX_ROWS, came from this) and the crossover (the narrowest width from
which the dequantized forward beats both at every wider width: `MLX_DSPARK_WIDE_DEQUANTIZE_ROWS`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_WIDTHS = "1,2,4,8,16,32,48,64,128,256,384,512"


def crossover(widths: list[int], quantized: list[float], dequantized: list[float]) -> int | None:
    """The narrowest width from which every measured width is faster dequantized (None: none is)."""
    best = None
    for w, q, d in reversed(list(zip(widths, quantized, dequantized))):
        if d >= q:
            break
        best = w
    return best


def narrow_wins(widths: list[int], quantized: list[float], narrow: list) -> tuple[int, int] | None:
    """The first run of measured widths at which the narrow kernel beats MLX's, as (first, last)."""
    run = []
    for w, q, n in zip(widths, quantized, narrow):
        if n is not None and n < q:
            run.append(w)
        elif run:
            break
    return (run[0], run[-1]) if run else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--widths", default=DEFAULT_WIDTHS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the rows and the crossover here")
    args = ap.parse_args()
    widths = sorted({int(w) for w in args.widths.split(",")} | {1})

    import mlx.core as mx

    from engine import load_target
    from engine.base.platform import on_cuda
    from engine.kernels import narrow_qmm, quantized_route
    from engine.tuning.cost_curve import measure_cost_curve

    if not on_cuda():
        sys.exit("this compares MLX CUDA's kernels: run it where MLX computes on an NVIDIA GPU")
    os.environ["MLX_DSPARK_WIDE_DEQUANTIZE"] = "1"
    target = load_target(args.model)
    if "quantization" not in target.config:
        sys.exit(f"{args.model} runs unquantised here (nothing to dequantize)")

    def curve(wide_rows: int, narrow_rows: str, at=widths):
        quantized_route.uninstall()
        os.environ["MLX_DSPARK_WIDE_DEQUANTIZE_ROWS"] = str(wide_rows)
        os.environ["MLX_DSPARK_NARROW_QMM_ROWS"] = narrow_rows
        quantized_route.install()
        seconds = measure_cost_curve(target, widths=at, depths=(args.depth,), repeats=args.repeats).seconds[0]
        print("ms:", " ".join(f"w{w}={s * 1e3:.1f}" for w, s in zip(at, seconds)), flush=True)
        return seconds

    never = 1 << 30
    quantized = curve(never, "0")
    few = [w for w in widths if w <= narrow_qmm.MAX_ROWS]
    narrow_at = dict(zip(few, curve(never, f"2-{narrow_qmm.MAX_ROWS}", few)))
    narrow = [narrow_at.get(w) if w >= 2 else None for w in widths]  # None where it doesn't run
    dequantized = curve(1, "0")
    quantized_route.uninstall()

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    device = info.get("device_name", str(mx.default_device()))
    best_below = [min(q, n) if n is not None else q for q, n in zip(quantized, narrow)]
    cross = crossover(widths, best_below, dequantized)
    wins = narrow_wins(widths, quantized, narrow)
    print(f"model {args.model}; depth {args.depth}; MLX {mx.__version__} on {device}")
    print("| width | MLX quantized ms | narrow_qmm ms | dequantized ms | narrow / MLX | dequantized / best |")
    print("|---|---|---|---|---|---|")
    for w, q, n, d, b in zip(widths, quantized, narrow, dequantized, best_below):
        n_ms, n_ratio = (f"{n * 1e3:.2f}", f"{n / q:.2f}") if n is not None else ("-", "-")
        print(f"| {w} | {q * 1e3:.2f} | {n_ms} | {d * 1e3:.2f} | {n_ratio} | {d / b:.2f} |")
    print("narrow_qmm wins: " + (f"{wins[0]}-{wins[1]} rows (MLX_DSPARK_NARROW_QMM_ROWS={wins[0]}-{wins[1]})"
                                 if wins else "at no width measured (MLX_DSPARK_NARROW_QMM_ROWS=0)"))
    print(f"crossover: {cross if cross is not None else 'none (the quantized kernels win at every width)'}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "device": device, "mlx": mx.__version__, "depth": args.depth,
            "widths": widths, "quantized_s": quantized, "narrow_s": narrow, "dequantized_s": dequantized,
            "narrow_wins": wins, "crossover": cross,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
