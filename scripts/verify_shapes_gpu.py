"""Does a verify forward's varying width cost MLX CUDA a kernel build each round? Forwards of one model
at a growing depth: one width repeated, widths varying (twice), widths padded up to a few buckets;
then the same with engine/kernels/gpu_attention.py routing them (no cuDNN graph per shape).

    python3 scripts/verify_shapes_gpu.py MODEL_DIR   (e.g. a training/widen.py yardstick)
"""
import random, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

model, _ = load(sys.argv[1])
rng = random.Random(0)
widths = [rng.choice([1, 2, 3, 5, 8, 13, 17, 23, 29, 31, 40, 47, 55, 63, 64]) for _ in range(60)]

def run(name, seq):
    cache = make_prompt_cache(model)
    model(mx.array([[5] * 2000]), cache=cache); mx.eval([c.state for c in cache])
    for w in seq[:5]:  # warm-up of these shapes
        mx.eval(model(mx.array([[7] * w]), cache=cache))
    mx.synchronize()
    t = time.perf_counter()
    for w in seq:
        out = model(mx.array([[7] * w]), cache=cache)
        mx.eval(out)
        for c in cache: c.trim(w - 1)  # keep one token per round: the depth grows as decoding does
    mx.synchronize()
    ms = (time.perf_counter() - t) * 1000 / len(seq)
    print(f"{name:28s} {ms:7.2f} ms/forward  (mean width {sum(seq)/len(seq):.1f})", flush=True)

bucket = lambda w: next(b for b in (1, 8, 16, 32, 64) if b >= w)
run("width 26 repeated", [26] * 60)
run("widths varying", widths)
run("widths padded to buckets", [bucket(w) for w in widths])
run("widths varying again", widths)
run("width 1 repeated", [1] * 60)

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from engine.kernels import gpu_attention  # noqa: E402

print("gpu_attention installed:", gpu_attention.install())
widths = [rng.choice([1, 2, 3, 5, 8, 13, 17, 23, 29, 31, 40, 47, 55, 63, 64]) for _ in range(60)]  # new ones
run("routed: width 26 repeated", [26] * 60)
run("routed: widths varying", widths)
run("routed: widths varying again", widths)
