"""From how many rows a forward through dequantized weights beats the quantized kernels, on a GPU.

    python scripts/profile_verify_gpu.py --model DIR [--depth 2048] [--widths 1,2,4,...,512] [--json FILE]

Times the engine's forward of each width at one context depth twice, as tune's cost curve does
(engine/tuning/cost_curve.py: median of `--repeats` sweeps, each pass rolled back): once through
MLX's quantized kernels, once with every QuantizedLinear dequantized for the forward
(engine/kernels/wide_dequantize.py at one row). Prints both with their ratio and the crossover, the
narrowest width from which the dequantized forward is faster at every wider width measured:
what `MLX_DSPARK_WIDE_DEQUANTIZE_ROWS` (and wide_dequantize.MIN_ROWS) should be on this device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_WIDTHS = "1,2,4,8,16,32,64,128,192,256,384,512"


def crossover(widths: list[int], quantized: list[float], dequantized: list[float]) -> int | None:
    """The narrowest width from which every measured width is faster dequantized (None: none is)."""
    best = None
    for w, q, d in reversed(list(zip(widths, quantized, dequantized))):
        if d >= q:
            break
        best = w
    return best


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
    from engine.kernels import wide_dequantize
    from engine.tuning.cost_curve import measure_cost_curve

    os.environ["MLX_DSPARK_WIDE_DEQUANTIZE"] = "1"  # installed by load_target on any device
    target = load_target(args.model)
    if "quantization" not in target.config:
        sys.exit(f"{args.model} runs unquantised here (nothing to dequantize)")

    def curve():
        seconds = measure_cost_curve(target, widths=widths, depths=(args.depth,), repeats=args.repeats).seconds[0]
        print("ms:", " ".join(f"w{w}={s * 1e3:.1f}" for w, s in zip(widths, seconds)), flush=True)
        return seconds

    wide_dequantize.uninstall()
    quantized = curve()
    os.environ["MLX_DSPARK_WIDE_DEQUANTIZE_ROWS"] = "1"
    wide_dequantize.install()
    dequantized = curve()
    wide_dequantize.uninstall()

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    device = info.get("device_name", str(mx.default_device()))
    cross = crossover(widths, quantized, dequantized)
    print(f"model {args.model}; depth {args.depth}; MLX {mx.__version__} on {device}")
    print("| width | quantized ms | dequantized ms | dequantized / quantized |\n|---|---|---|---|")
    for w, q, d in zip(widths, quantized, dequantized):
        print(f"| {w} | {q * 1e3:.2f} | {d * 1e3:.2f} | {d / q:.2f} |")
    print(f"crossover: {cross if cross is not None else 'none (the quantized kernels win at every width)'}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "device": device, "mlx": mx.__version__, "depth": args.depth,
            "widths": widths, "quantized_s": quantized, "dequantized_s": dequantized, "crossover": cross,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
