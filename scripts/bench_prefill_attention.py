"""Prefill attention on CPU: MLX's kernel against the blockwise one (engine/kernels/cpu_attention.py).

    python scripts/bench_prefill_attention.py                    # one layer, 2048-query chunk at 30k keys
    python scripts/bench_prefill_attention.py --prefill 15000    # + a cold prefill, both ways
    python scripts/bench_prefill_attention.py --chunks 256,512,1024,2048   # + prefill chunk sizes

Uses the bundled reference model's attention shape (or --model's). Run it with OpenBLAS
preloaded (as scripts/test.sh does, or through `mlx-dspark`). Prints seconds and ratios
measured in this run; the machine's load average is printed with them.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def one_layer(args, rng, hq, hkv, dk, dv) -> None:
    import mlx.core as mx

    from engine.kernels import cpu_attention

    L, S = args.queries, args.depth
    q = rng.standard_normal((1, hq, L, dk), dtype=np.float32)
    k = rng.standard_normal((1, hkv, S, dk), dtype=np.float32)
    v = rng.standard_normal((1, hkv, S, dv), dtype=np.float32)
    qm, km, vm = mx.array(q), mx.array(k), mx.array(v)
    mx.eval(qm, km, vm)
    t0 = time.perf_counter()
    with cpu_attention.disabled():
        ref = mx.fast.scaled_dot_product_attention(qm, km, vm, scale=dk**-0.5, mask="causal")
        mx.eval(ref)
    t_mlx = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = cpu_attention.attention(q, k, v, dk**-0.5, causal=True)
    t_ours = time.perf_counter() - t0
    err = float(np.abs(out - np.array(ref)).max())
    flops = 2.0 * hq * (dk + dv) * L * (S - L + (L + 1) / 2)
    print(f"one layer, {L} queries at {S} keys: MLX {t_mlx:.2f} s, blockwise {t_ours:.2f} s "
          f"({t_mlx / t_ours:.1f}x; {flops / t_ours / 1e9:.1f} GFLOP/s; max |diff| {err:.1e}); "
          f"load average {os.getloadavg()[0]:.2f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--depth", type=int, default=30000, help="keys of the one-layer measurement")
    p.add_argument("--queries", type=int, default=2048, help="queries (a prefill chunk) of it")
    p.add_argument("--no-layer", action="store_true", help="skip the one-layer measurement")
    p.add_argument("--prefill", type=int, default=0, help="also time a cold prefill of this many tokens")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the engine's choice)")
    p.add_argument("--chunks", default=None, help="also time a prefill of --chunk-tokens at these chunk sizes")
    p.add_argument("--chunk-tokens", type=int, default=4096)
    args = p.parse_args()

    from engine import load_target
    from engine.kernels import cpu_attention
    from engine.kernels.attention_crossover import attention_shape
    from engine.base.bundled import default_model_path
    from engine.base.platform import loaded_blas
    from engine.tuning.prefill_chunk import chunk_for, time_prefill

    target = load_target(args.model or default_model_path())
    hq, hkv, dk, dv = attention_shape(target)
    print(f"model {target.path}; attention {hq} query heads, {hkv} kv heads, head {dk}; "
          f"MLX on {loaded_blas()}; load average {os.getloadavg()[0]:.2f}")

    rng = np.random.default_rng(0)
    if not args.no_layer:
        one_layer(args, rng, hq, hkv, dk, dv)
    chunk = args.chunk or chunk_for(target)

    if args.prefill:
        ids = rng.integers(0, target.vocab_size, size=args.prefill).tolist()
        on = time_prefill(target, ids, chunk)
        with cpu_attention.disabled():
            off = time_prefill(target, ids, chunk)
        print(f"cold prefill of {args.prefill} tokens, {chunk}-token chunks: MLX attention {off:.1f} s, "
              f"blockwise {on:.1f} s ({off / on:.2f}x); load average {os.getloadavg()[0]:.2f}")
    if args.chunks:
        ids = rng.integers(0, target.vocab_size, size=args.chunk_tokens).tolist()
        times = {c: time_prefill(target, ids, c) for c in (int(x) for x in args.chunks.split(","))}
        print(f"prefill of {args.chunk_tokens} tokens by chunk: "
              + ", ".join(f"{c}: {s:.2f} s" for c, s in times.items())
              + f"; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
