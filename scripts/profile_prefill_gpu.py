"""Where a long cold prefill's time goes on a GPU: the peer's forward against ours, chunk widths,
quantised against dequantized weights, and the engine's whole first token on top.

    python scripts/profile_prefill_gpu.py --model DIR [--tokens 16384] [--chunks 1024,2048,4096,8192]

Every row prefills the same random `--tokens` into a fresh cache and waits for it; each is timed
twice after one untimed run (kernels build on first use), the best printed with its TFLOP/s against
the weights' and attention's FLOPs:

- `mlx-lm`: mlx-lm's own loop (`model(chunk[None], cache)`, 2048 a forward, as `mlx_lm.server`
  and `generate` prefill), on the model as mlx-lm loads it;
- `ours C`: engine.decoding.verify.prefill at chunk C on the engine's target (the chunk the engine
  would pick is marked), as the engine runs it (on MLX CUDA each quantised weight dequantized per
  forward, engine/kernels/wide_dequantize.py);
- `ours C, quantized kernels`: the same with engine/kernels/quantized_route.py off (MLX's quantized matmul);
- `dequantized C`: the same on weights dequantized once and kept (where they fit);
- `engine first token`: Engine.generate, max_tokens 1, a fresh engine each: without a prefix
  cache, with its RAM tier, with its disk tier too (everything a cold request pays besides HTTP).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best_of(run, repeats: int = 2) -> float:
    run()  # build kernels
    return min(_timed(run) for _ in range(repeats))


def _timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def mlx_lm_prefill(model, ids, chunk: int = 2048):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def run():
        cache = make_prompt_cache(model)
        x = mx.array(ids, dtype=mx.uint32)
        for s in range(0, len(ids), chunk):
            model(x[s:s + chunk][None], cache=cache)
            mx.eval([c.state for c in cache])
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--skip", default="", help="comma list of rows to leave out: mlx-lm,quantized,dequantized,engine")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    import mlx.core as mx
    from mlx_lm import load as mlx_lm_load

    from engine import Engine, GenerationRequest, load_target
    from engine.kernels import quantized_route
    from engine.tuning.prefill_chunk import chunk_for, time_prefill
    from engine.tuning.prefill_estimate import prefill_flops

    target = load_target(args.model)
    ids = np.random.default_rng(0).integers(0, target.vocab_size, size=args.tokens).tolist()
    work = prefill_flops(target, len(ids))["total"]
    picked = chunk_for(target)
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    print(f"model {args.model}; {len(ids)} tokens; {work / 1e15:.3f} PFLOP; MLX {mx.__version__} on "
          f"{info.get('device_name', mx.default_device())}; the engine's chunk {picked}", flush=True)
    print("| prefill | seconds | tokens/s | TFLOP/s |\n|---|---|---|---|", flush=True)

    def row(name, seconds):
        print(f"| {name} | {seconds:.3f} | {len(ids) / seconds:,.0f} | {work / seconds / 1e12:.1f} |", flush=True)

    chunks = [int(c) for c in args.chunks.split(",")]
    if "mlx-lm" not in skip:
        model, _ = mlx_lm_load(args.model)
        row("mlx-lm (2048)", best_of(mlx_lm_prefill(model, ids)))
        del model
    for c in chunks:
        row(f"ours {c}{' (picked)' if c == picked else ''}", best_of(lambda: time_prefill(target, ids, c)))
    if "quantized" not in skip and quantized_route.install():
        quantized_route.uninstall()
        try:
            for c in chunks:
                row(f"ours {c}, quantized kernels", best_of(lambda: time_prefill(target, ids, c)))
        finally:
            quantized_route.install()
    if "dequantized" not in skip and "quantization" in target.config:
        plain = load_target(args.model, dequantize=True)
        for c in chunks:
            row(f"dequantized {c}", best_of(lambda: time_prefill(plain, ids, c)))
        del plain
    if "engine" not in skip:
        del target
        tiers = (("no prefix cache", lambda folder: {"prefix_cache": False}), ("RAM tier", lambda folder: {}),
                 ("disk tier", lambda folder: {"prefix_cache_dir": folder}))
        for name, settings in tiers:
            with tempfile.TemporaryDirectory() as folder, Engine(args.model, **settings(folder)) as engine:
                list(engine.generate(GenerationRequest(ids[::-1][:256], max_tokens=1)))  # its own warm-up
                t0 = time.perf_counter()
                list(engine.generate(GenerationRequest(ids, max_tokens=1)))
                row(f"engine first token, {name}", time.perf_counter() - t0)


if __name__ == "__main__":
    main()
