"""Training-step throughput of the bundled qwen3 and the hybrid qwen3_5 on random tokens, one
run, same device, same shapes (no data pipeline): tokens/s of forward + backward + AdamW, and
the number of operator calls per step (what bounds a loop of small kernels on a GPU).

    python3 training/bench_step.py [--seq 8192 --batch 16 --chunk 64 --steps 6 --arch qwen3,qwen3_5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(arch: str, chunk: int):
    if arch == "qwen3_5":
        from qwen3_5_torch import Qwen35Config, Qwen35ForCausalLM

        return Qwen35ForCausalLM(Qwen35Config(), chunk=chunk)
    from qwen3_torch import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config())


def count_ops(step) -> int:
    """Operator calls of one step, from the profiler (CPU-side aten calls; on CUDA, kernels too)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
    ev = prof.key_averages()
    if torch.cuda.is_available():
        return sum(e.count for e in ev if e.device_type.name == "CUDA")
    return sum(e.count for e in ev if e.key.startswith("aten::"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3,qwen3_5")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-ops", action="store_true", help="skip the profiled step")
    args = ap.parse_args()
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    amp = torch.autocast(dev, dtype=torch.bfloat16) if dev == "cuda" else torch.autocast("cpu", enabled=False)
    x = torch.randint(0, 8192, (args.batch, args.seq + 1), device=dev)
    mask = torch.rand(args.batch, args.seq, device=dev) < 0.7
    results = {}
    for arch in args.arch.split(","):
        model = build(arch, args.chunk).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=(dev == "cuda"))

        def step():
            with amp:
                loss = model(x[:, :-1], targets=x[:, 1:], loss_mask=mask)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        step()  # warm-up
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        loss.item()
        dt = (time.perf_counter() - t) / args.steps
        ops = None if args.no_ops else count_ops(step)
        mem = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None
        results[arch] = dt
        print(f"{arch:8s} params {model.num_parameters() / 1e6:.2f}M  {dt * 1e3:8.1f} ms/step  "
              f"{args.batch * args.seq / dt / 1e6:.4f}M tok/s  ops/step {ops}"
              + (f"  peak {mem:.1f} GiB" if mem else ""), flush=True)
        del model, opt
    if len(results) == 2:
        a, b = results.values()
        print(f"step time ratio {list(results)[1]}/{list(results)[0]}: {b / a:.2f}x "
              f"(device {dev}, seq {args.seq}, batch {args.batch}, chunk {args.chunk})")


if __name__ == "__main__":
    main()
