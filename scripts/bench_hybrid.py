"""Lookup drafting against plain mlx-lm on hybrid, sliding-window, MoE and quantised targets.

    python scripts/bench_hybrid.py [--families qwen3_next lfm2 ...] [--tokens 200] [--cap 16]
                                   [--quantise 4] [--auto] [--rollback capture|replay|both]

Each family is a tiny random model built from mlx-lm's own class (tests/tiny_models.py,
one or two layers of each kind, a 16-token sliding window), decoding a prompt longer
than the window, in one process: plain mlx-lm (generate_step) against the engine's
lookup mode. Random weights don't copy, so the drafter is given the text being
re-emitted, as when an agent rewrites a file that is in its context: `copy` drafts
from a corpus holding the reference output, `corrupted` from one with every 5th token
changed (the drafter's gate then keeps drafts short), `sparse` with every 12th changed
(drafts of about 11 tokens, the last rejected: each round takes a draft back), `context`
from the context alone. On recurrent families `--rollback both` runs each drafting case with
per-position state capture and with snapshot + replay (engine/caches/state_capture.py). The table gives tokens per round,
the time ratio against mlx-lm, and whether the tokens were identical. Absolute
seconds mean little on a tiny model and a loaded machine: the ratios within a run are
the numbers.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from tiny_models import FAMILIES, WINDOW

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--cap", type=int, default=16)
    ap.add_argument("--auto", action="store_true", help="also run --max-draft auto")
    ap.add_argument("--quantise", type=int, choices=(4, 8), help="quantise every model (mlx-lm convert)")
    ap.add_argument("--repeats", type=int, default=3, help="best of N for each timing")
    ap.add_argument("--size", choices=("tiny", "small"), default="tiny",
                    help="small: 8 layers, hidden 512 (qwen3_5, nemotron_h, lfm2 only), where a replay costs real compute")
    ap.add_argument("--rollback", choices=("capture", "replay", "both"), default="both",
                    help="how recurrent layers take back a draft (default: both, side by side)")
    ap.add_argument("--curve", action="store_true",
                    help="instead: the verify cost curve per family (width 4 and 16 against 1, rollback and replay included)")
    ap.add_argument("--qmm", action="store_true",
                    help="instead: MLX's quantized matmul (4/8-bit, mxfp4) against float32, width 1 to 64")
    args = ap.parse_args()
    if args.curve:
        return curves(args)
    if args.qmm:
        return quantized_matmul_widths()

    print(f"{'family':<18}{'case':<11}{'rollback':>9}{'tokens':>7}{'tok/round':>10}{'mlx-lm s':>10}{'lookup s':>10}"
          f"{'vs mlx-lm':>10}{'vs no drafts':>13}  identical")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            rows = bench_family(family, Path(tmp), args, WINDOW)
            plain_loop = rows[0]["lookup_s"]  # the same engine loop without drafts
            for row in rows:
                print(f"{family:<18}{row['case']:<11}{row['rollback']:>9}{row['tokens']:>7}{row['tok_per_round']:>10.2f}{row['mlx_lm_s']:>10.3f}"
                      f"{row['lookup_s']:>10.3f}{row['speedup']:>9.2f}x{plain_loop / row['lookup_s']:>12.2f}x  "
                      f"{row['identical']}", flush=True)


def quantized_matmul_widths(n: int = 4096, repeats: int = 7) -> None:
    """Why a quantised target on CPU rarely pays to draft: quantized_matmul's cost grows with the
    number of rows (tokens) about linearly, float32 BLAS barely (median ms of `repeats`)."""
    import statistics

    import mlx.core as mx

    def ms(fn, x):
        mx.eval(x)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(fn(x))
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    w = mx.random.normal((n, n))
    mx.eval(w)
    widths = (1, 4, 16, 64)
    print(f"{n}x{n} weight, ms at widths {widths}")
    print(f"{'float32':<10}" + "".join(f"{ms(lambda x: x @ w.T, mx.random.normal((k, n))):>10.1f}" for k in widths))
    for mode, bits, group in (("affine", 4, 64), ("affine", 8, 64), ("mxfp4", 4, 32)):
        q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
        mx.eval(q)
        scales_biases = q[1:] if mode == "affine" else (q[1], None)

        def qmm(x, q=q, sb=scales_biases, bits=bits, group=group, mode=mode):
            return mx.quantized_matmul(x, q[0], *sb, transpose=True, group_size=group, bits=bits, mode=mode)

        row = [ms(qmm, mx.random.normal((k, n))) for k in widths]
        label = "mxfp4" if mode == "mxfp4" else f"{bits}-bit"
        print(f"{label:<10}" + "".join(f"{t:>10.1f}" for t in row) + f"   width 16 / 1: {row[2] / row[0]:.1f}x")


def curves(args) -> None:
    """cost(width) / cost(1) of a verify pass per family, as `mlx-dspark tune` measures it."""
    from engine.tuning.cost_curve import measure_cost_curve
    from engine.model.target import load_target

    print("cost(w) = seconds of a width-w verify pass, half of it taken back, over a plain width-1 step")
    print(f"{'family':<18}{'rollback':>9}{'cost(4)':>9}{'cost(16)':>10}{'cost(32)':>10}   picked")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            target = load_target(build_model(family, Path(tmp) / family, args.size))
            curve = measure_cost_curve(target, widths=(1, 4, 16, 32), depths=(256,), repeats=args.repeats)
            plain = curve.step_seconds(1, 256)  # the cheaper way's width 1: the same pass either way
            for mode in sorted(curve.rollback_seconds) or [""]:
                c = curve.for_rollback(mode) if mode else curve
                r = [c.step_seconds(w, 256) / plain for w in (4, 16, 32)]
                mark = "*" if mode == curve.rollback else ""
                print(f"{family:<18}{mode or '-':>9}{r[0]:>9.2f}{r[1]:>10.2f}{r[2]:>10.2f}   {mark}", flush=True)


# --size small: 8 layers at hidden 512 (about 20M parameters), recurrent layers at real head sizes.
SMALL = {
    "qwen3_5": ("qwen3_5", {"linear_num_value_heads": 8, "linear_num_key_heads": 4, "linear_key_head_dim": 64,
                            "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                            "partial_rotary_factor": 0.25, "text_config_from_top": True}),
    "nemotron_h": ("nemotron_h", {"attention_bias": False, "mamba_num_heads": 16, "mamba_head_dim": 64,
                                  "mamba_proj_bias": False, "ssm_state_size": 64, "conv_kernel": 4, "n_groups": 1,
                                  "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
                                  "use_conv_bias": True, "hybrid_override_pattern": list("M-M*M-M*")}),
    "lfm2": ("lfm2", {"norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 512,
                      "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
                      "block_ff_dim": 1024, "layer_types": ["conv"] * 3 + ["full_attention"] + ["conv"] * 3
                      + ["full_attention"]}),
}


def build_model(family: str, out: Path, size: str) -> Path:
    from tiny_models import build_family_model, build_tiny_model

    if size == "tiny":
        return build_family_model(out, family, seed=5)
    if family not in SMALL:
        raise SystemExit(f"--size small has {', '.join(SMALL)}, not {family}")
    arch, extra = SMALL[family]
    return build_tiny_model(out, arch=arch, seed=5, layers=8, hidden=512, scale=8.0, extra=extra)


def bench_family(family: str, tmp: Path, args, window: int) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from engine import Engine, GenerationRequest
    from engine.engine import engine_stream
    from engine.caches.rollback import needs_replay

    path = build_model(family, tmp / family, args.size)
    if args.quantise:
        from mlx_lm.convert import convert

        qpath = tmp / f"{family}-q{args.quantise}"
        convert(str(path), str(qpath), quantize=True, q_bits=args.quantise, q_group_size=32, dtype="float32")
        path = qpath
    rows = []
    with Engine(str(path), prefix_cache=False) as engine:
        eos = engine.target.eos_token_ids

        def plain(target, prompt):
            t0 = time.perf_counter()
            out = []
            for tok, _ in generate_step(mx.array(prompt, dtype=mx.uint32), target.model, max_tokens=args.tokens,
                                        sampler=make_sampler(temp=0.0), stream=engine_stream()):
                if tok in eos:
                    break
                out.append(int(tok))
            return out, time.perf_counter() - t0

        # a prompt (longer than the window) whose greedy output runs long before any EOS
        prompt, best = None, -1
        for seed in range(8):
            rng = random.Random(seed)
            candidate = [rng.randrange(engine.target.vocab_size) for _ in range(2 * window + 8)]
            n = len(engine.call(lambda t: plain(t, candidate))[0])
            if n > best:
                prompt, best = candidate, n
            if n >= args.tokens:
                break

        def lookup(cap, corpus=(), rollback=None):
            engine.target.state_rollback = rollback
            t0 = time.perf_counter()
            req = GenerationRequest(prompt, max_tokens=args.tokens, mode="lookup", max_draft=cap,
                                    corpus=list(corpus), stop=[])
            done = list(engine.generate(req))[-1]
            return done, time.perf_counter() - t0

        ref, t_ref = min((engine.call(lambda t: plain(t, prompt)) for _ in range(args.repeats)), key=lambda r: r[1])
        vocab = engine.target.vocab_size
        exact = [prompt + ref]  # the drafter knows the text being re-emitted (a file in context)
        corrupted = [[(t + 1) % vocab if i % 5 == 4 else t for i, t in enumerate(prompt + ref)]]
        sparse = [[(t + 1) % vocab if i % 12 == 11 else t for i, t in enumerate(prompt + ref)]]
        cases = [("no drafts", 0, ()), ("copy", args.cap, exact), ("corrupted", args.cap, corrupted),
                 ("sparse", args.cap, sparse), ("context", args.cap, ())]
        if args.auto:
            cases += [("copy/auto", "auto", exact), ("corr/auto", "auto", corrupted)]
        recurrent = needs_replay(engine.target.make_cache())
        modes = (["capture", "replay"] if args.rollback == "both" else [args.rollback]) if recurrent else [None]
        for mode in modes:
            lookup(args.cap, exact, mode)  # warm-up
        runs = []
        for case, cap, corpus in cases:
            ways = modes if cap else modes[:1]
            best: dict = {}
            # the ways of taking back a draft interleaved, order flipped each repeat: the load on a
            # shared machine drifts, and a ratio between them only means something measured together
            for r in range(args.repeats):
                for mode in (ways if r % 2 == 0 else ways[::-1]):
                    done, t = lookup(cap, corpus, mode)
                    if mode not in best or t < best[mode][1]:
                        best[mode] = (done, t)
            runs += [(case, cap, mode, *best[mode]) for mode in ways]
        for case, cap, mode, done, t in runs:
            n = len(done.token_ids)
            rows.append({
                "case": case,
                "rollback": (mode if cap else "") or "-",
                "tokens": n,
                "rounds": done.stats.rounds,
                "tok_per_round": done.stats.mean_accepted,
                "mlx_lm_s": t_ref,
                "lookup_s": t,
                "speedup": t_ref / t if t > 0 else 0.0,
                "identical": done.token_ids == ref[:n] and n == len(ref),
            })
    return rows


if __name__ == "__main__":
    main()
