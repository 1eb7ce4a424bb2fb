"""Evaluate the reference model on CPU with MLX (float32), on held-out standard-library code.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python training/eval_mlx.py [--model engine/reference_model] [--n 20] [--min-lines 100 --max-lines 160]

Reports: perplexity on stdlib files; on N stdlib excerpts, the rename task's exact-match rate
(greedy output through prompts.extract_code == excerpt with the rename applied) and token-level
match; greedy decode tokens/s. Uses mlx_lm directly (not the engine).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

import data  # noqa: E402
import prompts  # noqa: E402


def stdlib_files(stdlib: str) -> list[Path]:
    out = []
    for p in sorted(Path(stdlib).rglob("*.py")):
        s = str(p)
        if "site-packages" in s or "/test" in s or "/idlelib/" in s or "/lib2to3/tests" in s:
            continue
        out.append(p)
    return out


def perplexity(model, tok, files, n_files, window, rng):
    nll, n, nbytes = 0.0, 0, 0
    for p in rng.sample(files, n_files):
        text = p.read_text(encoding="utf-8", errors="replace").replace("\t", "    ")
        ids = tok.encode(text, add_special_tokens=False)[: window + 1]
        if len(ids) < 64:
            continue
        x = mx.array(ids)[None]
        logits = model(x[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum")
        nll += loss.item()
        n += len(ids) - 1
        nbytes += len(tok.decode(ids[1:]).encode())
    return math.exp(nll / n), nll / nbytes / math.log(2), n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "engine" / "reference_model"))
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--n", type=int, default=20, help="rename excerpts")
    ap.add_argument("--min-lines", type=int, default=100)
    ap.add_argument("--max-lines", type=int, default=160)
    ap.add_argument("--ppl-files", type=int, default=40)
    ap.add_argument("--ppl-window", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--show-fail", action="store_true")
    args = ap.parse_args()

    model, tok = mlx_lm.load(args.model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    files = stdlib_files(args.stdlib)
    rng = random.Random(args.seed)
    res = {"model": args.model, "stdlib": args.stdlib, "device": str(mx.default_device())}

    t = time.time()
    ppl, bpb, ntok = perplexity(model, tok, files, args.ppl_files, args.ppl_window, rng)
    res.update(ppl=ppl, bits_per_byte=bpb, ppl_tokens=ntok)
    print(f"perplexity on {args.ppl_files} stdlib files (first {args.ppl_window} tokens): {ppl:.3f} "
          f"({bpb:.3f} bits/byte, {ntok} tokens, {time.time() - t:.0f}s)", flush=True)

    system = prompts.load("system").rstrip("\n")
    sampler = make_sampler(0.0)
    exact, tok_match, prefix_match, gen_tokens, gen_time, tps = 0, [], [], 0, 0.0, []
    done = 0
    while done < args.n:
        p = rng.choice(files)
        text = p.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n").replace("\t", "    ")
        ex = data.excerpt(text, rng, args.min_lines, args.max_lines)
        if ex is None or len(ex.splitlines()) < args.min_lines:
            continue
        r = data.make_rename(ex, rng)
        if r is None:
            continue
        old, new, want = r
        rel = str(p.relative_to(args.stdlib))
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": prompts.render("rename_symbol", path=rel, old=old, new=new, code=ex)}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
        want_ids = tok.encode(data.reply(want), add_special_tokens=False)
        t = time.time()
        out_ids, last = [], None
        for resp in mlx_lm.stream_generate(model, tok, prompt=prompt, max_tokens=len(want_ids) + 32, sampler=sampler):
            out_ids.append(resp.token)
            last = resp
        dt = time.time() - t
        got_text = tok.decode([i for i in out_ids if i not in tok.eos_token_ids] )
        got = prompts.extract_code(got_text)
        ok = got == want
        exact += ok
        n_eq = sum(a == b for a, b in zip(out_ids, want_ids))
        tok_match.append(n_eq / max(len(want_ids), len(out_ids)))
        pre = next((i for i, (a, b) in enumerate(zip(out_ids, want_ids)) if a != b), min(len(out_ids), len(want_ids)))
        prefix_match.append(pre / len(want_ids))
        gen_tokens += len(out_ids)
        gen_time += dt
        tps.append(last.generation_tps)
        done += 1
        print(f"[{done}/{args.n}] {rel} {len(ex.splitlines())} lines, {len(prompt)} prompt tok, rename {old}->{new}: "
              f"{'EXACT' if ok else 'miss'} tokmatch {tok_match[-1]:.3f} prefix {prefix_match[-1]:.3f} "
              f"{last.generation_tps:.1f} tok/s", flush=True)
        if not ok and args.show_fail and got is not None:
            import difflib
            print("".join(list(difflib.unified_diff(want.splitlines(True), got.splitlines(True), n=0))[:20]))
    if done:  # --n 0: perplexity only
        res.update(
            rename_n=args.n, rename_lines=[args.min_lines, args.max_lines],
            rename_exact=exact / args.n, rename_token_match=sum(tok_match) / len(tok_match),
            rename_prefix_match=sum(prefix_match) / len(prefix_match),
            decode_tps_mean=sum(tps) / len(tps), gen_tokens=gen_tokens, gen_seconds=gen_time,
        )
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
