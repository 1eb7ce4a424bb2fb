"""Where a long cold prefill's time goes on CPU: attention kernel, the rest of the forward, at depth.

    python scripts/profile_prefill.py [--model DIR] [--chunk 1024] [--depths 0,8192,16384,31744]

For each depth, one prefill chunk runs over a KV cache filled with that many random keys and
values (as `doctor`'s prediction does), with the blockwise attention (`engine/kernels/cpu_attention.py`)
timed inside the forward. Printed per depth: the chunk's wall time; the attention kernel's share
against its FLOPs at the BLAS rate that `doctor` uses; the rest (MLX: weight matmuls, norms, rope,
MLP, logits, cache writes) against the weights' FLOPs at that rate. Then the attention kernel's
work item (one kv head's query rows over 16k keys) against its two matmuls alone, in CPU ns
per score. Run it with OpenBLAS preloaded (as scripts/test.sh does, or through `mlx-dspark`), at low
load: the load average is printed with the numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def chunk_profile(target, depth: int, chunk: int, calls, rate: float) -> dict:
    from engine.kernels import cpu_attention
    from engine.kernels.attention_crossover import unread_last_call
    from engine.tuning.prefill_estimate import prefill_params, time_chunk_at

    spent, cpu = [], []
    real = cpu_attention.attention

    def timed(*a, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        out = real(*a, **kw)
        spent.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        return out

    ids = np.random.default_rng(depth).integers(0, target.vocab_size, size=chunk).tolist()
    cpu_attention.attention = timed
    try:
        c0 = time.process_time()
        total = time_chunk_at(target, depth, ids, calls)
        total_cpu = time.process_time() - c0
    finally:
        cpu_attention.attention = real
    pairs = chunk * depth + chunk * (chunk + 1) / 2
    routed = calls[:-1] if unread_last_call(target, target.make_cache()) else calls
    attn_flops = sum(2.0 * hq * (dk + dv) * pairs for hq, _, dk, dv in routed)
    weight_flops = 2.0 * prefill_params(target) * chunk
    attention = sum(spent)
    return {"depth": depth, "total_s": total, "attention_s": attention, "routed_calls": len(spent),
            "attention_estimate_s": attn_flops / rate / 1e9, "rest_s": total - attention,
            "rest_estimate_s": weight_flops / rate / 1e9, "total_cpu_s": total_cpu, "attention_cpu_s": sum(cpu)}


def kernel_parts(hq: int, hkv: int, d: int, keys: int = 16384) -> dict:
    """CPU ns per score of one work item (one thread, as each worker runs it): the whole item
    as the engine runs it, and its two matmuls alone in numpy; the difference is the softmax."""
    from engine.kernels import cpu_attention

    rep = hq // hkv
    positions = max(1, cpu_attention.QUERY_ROWS // rep)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, positions, d), dtype=np.float32)
    k = rng.standard_normal((1, hkv, keys, d), dtype=np.float32)
    v = rng.standard_normal((1, hkv, keys, d), dtype=np.float32)
    rows, kb = positions * rep, cpu_attention.KEY_BLOCK
    out = np.empty((1, hq, positions, d), np.float32)
    qb, tile = q[0, :rep].transpose(1, 0, 2).reshape(rows, d), np.empty((rows, kb), np.float32)
    with cpu_attention._one_blas_thread():
        t0 = time.process_time()
        cpu_attention._tile(q, k, v, out, 0, 0, rep, 0, positions, 0, False, d**-0.5, kb)
        t1 = time.process_time()
        for k0 in range(0, keys, kb):
            np.matmul(qb, k[0, 0, k0:k0 + kb].T, out=tile)
            tile @ v[0, 0, k0:k0 + kb]
        t2 = time.process_time()
    scores = rows * keys
    return {"kernel": "compiled" if cpu_attention._compiled() else "numpy",
            "work_item_ns": round((t1 - t0) / scores * 1e9, 3), "matmuls_ns": round((t2 - t1) / scores * 1e9, 3),
            "matmul_gflops_one_thread": round(4.0 * d * scores / (t2 - t1) / 1e9, 1),
            "work_item_gflops_one_thread": round(4.0 * d * scores / (t1 - t0) / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--chunk", type=int, default=None, help="default: the engine's measured chunk")
    ap.add_argument("--depths", default="0,8192,16384,31744")
    args = ap.parse_args()

    from engine import load_target
    from engine.kernels.attention_crossover import attention_calls
    from engine.base.bundled import default_model_path
    from engine.base.platform import loaded_blas
    from engine.tuning.prefill_chunk import chunk_for
    from engine.tuning.prefill_estimate import blas_rates

    target = load_target(args.model or default_model_path())
    chunk = args.chunk or chunk_for(target)
    calls = attention_calls(target)
    rates = blas_rates()
    rate = max(rates["numpy_gflops"], rates["mlx_gflops"])
    print(f"model {target.path}; chunk {chunk}; MLX on {loaded_blas()}; BLAS rate {rate} GFLOP/s "
          f"(numpy {rates['numpy_gflops']}, MLX {rates['mlx_gflops']}); load {os.getloadavg()[0]:.2f}")
    print("| depth | chunk | attention (estimate) | rest of forward (estimate) | CPU s: chunk, attention | load |\n"
          "|---|---|---|---|---|---|")
    for depth in (int(x) for x in args.depths.split(",")):
        r = chunk_profile(target, depth, chunk, calls, rate)
        print(f"| {depth} | {r['total_s']:.2f} s | {r['attention_s']:.2f} s ({r['attention_estimate_s']:.2f} s, "
              f"{r['routed_calls']} calls) | {r['rest_s']:.2f} s ({r['rest_estimate_s']:.2f} s) "
              f"| {r['total_cpu_s']:.2f}, {r['attention_cpu_s']:.2f} | {os.getloadavg()[0]:.2f} |", flush=True)
    hq, hkv, dk, _ = max(calls, key=lambda c: c[0] * c[2])
    print(f"attention tile loop, ns of one core per score: {kernel_parts(hq, hkv, dk)} (load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
