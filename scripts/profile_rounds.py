"""Where a verify round's time goes: the engine's verify loop against bare forwards of its rounds.

    python scripts/profile_rounds.py --model DIR [--content refactor] [--max-draft 32] [--json FILE]

On an H100 (8-bit 8B yardstick, 2026-12-06) a refactor round took 33.6 ms at ~20 rows while the
cost curve's forward of that width took 19-20 ms (docs/benchmarks.md). This runs one of
`benchmark`'s contents through `speculative_rounds` (the engine's verify loop: lookup drafts,
greedy acceptance, the cache taken back) on a fresh cache, after an untimed run of the same, then
feeds each round's inputs again as bare forwards on a second cache, three passes a round, and
prints the mean milliseconds a round of each:

- `loop`: the verify loop's round (Round.seconds: drafting, the forward, acceptance, taking back);
- `new shape`: a bare forward of the round's width at its depth after the previous round's
  (another width, a shallower depth), rolled back: what the loop's forward alone costs;
- `same shape`: the same forward again right after, rolled back: what the cost curve measures;
- `kept`: the same forward a third time, then taken back to what the round kept, so the cache
  grows as the loop's does.

`loop` - `new shape` is the loop's own work; `new shape` - `same shape` what meeting a new shape
costs (graphs, kernels, plans built per shape); `kept` - `same shape` what growing the cache costs.
Runs wherever the engine does (on a CPU its forward dominates every row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = ("loop", "new shape", "same shape", "kept")


def profile(target, prompt: list[int], max_tokens: int, max_draft: int) -> dict:
    """The four timings of every round of `prompt`'s greedy decode, on `target` (run on the
    engine's thread: `Engine.call`)."""
    import mlx.core as mx

    from engine.base.sampling import SamplingParams
    from engine.caches.kv_segments import fresh_cache
    from engine.caches.rollback import mark, take_back
    from engine.decoding.verify import prefill, speculative_rounds
    from engine.drafting.lookup import LookupDrafter

    def decode() -> tuple[list, int]:
        cache = fresh_cache(target)
        prefill(target, cache, prompt[:-1], chunk_size=2048)
        drafter = LookupDrafter()
        drafter.start(prompt)
        rounds, made = [], 0
        for r in speculative_rounds(target, cache, prompt[-1], drafter, SamplingParams(), max_draft):
            rounds.append(r)
            made += len(r.tokens)
            if made >= max_tokens:
                return rounds, made
        return rounds, made

    decode()  # untimed: every shape this decode meets, met once
    rounds, made = decode()

    cache = fresh_cache(target)
    prefill(target, cache, prompt[:-1], chunk_size=2048)
    depth, y = len(prompt) - 1, prompt[-1]
    timings = {row: [] for row in ROWS[1:]}
    for r in rounds:
        width = r.drafted + 1
        # the loop fed the last token and its draft; the kept part is the round's accepted tokens
        inputs = ([y, *r.tokens[:-1]] + [y] * width)[:width]
        for row in ROWS[1:]:
            before = mark(cache)
            t0 = time.perf_counter()
            mx.argmax(target.forward(inputs, cache), axis=-1).tolist()
            timings[row].append(time.perf_counter() - t0)
            kept = r.accepted + 1 if row == "kept" else 0
            take_back(cache, before, width, kept, replay=lambda: target.forward(inputs[:kept], cache))
            mx.eval([c.state for c in cache])
        depth, y = depth + len(r.tokens), r.tokens[-1]
    return {"rounds": len(rounds), "tokens": made, "mean_width": round(statistics.fmean(r.drafted + 1 for r in rounds), 1),
            "depths": [len(prompt) - 1, depth],
            "replay_depth": getattr(cache[0], "offset", None),  # where the replay's cache ended (a KV layer's)
            "ms_a_round": {"loop": mean_ms([r.seconds for r in rounds]), **{row: mean_ms(timings[row]) for row in ROWS[1:]}}}


def mean_ms(seconds: list[float]) -> float | None:
    return round(1e3 * statistics.fmean(seconds), 2) if seconds else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--content", default="refactor", help="one of benchmark's decode contents (refactor, edit, chat, ...)")
    ap.add_argument("--max-draft", type=int, default=32, help="the rounds' draft cap (fixed: no cost curve needed)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the content's own budget")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.max_draft < 1:
        sys.exit("--max-draft must be at least 1")

    from engine import Engine
    from engine.bench.benchmark import build_content

    with Engine(args.model, max_draft=args.max_draft, prefix_cache=False) as engine:
        content = build_content(engine, args.content)
        max_tokens = args.max_tokens or content.max_tokens
        report = engine.call(profile, content.prompts[0], max_tokens, args.max_draft)
    report = {"model": args.model, "content": args.content, "max_draft": args.max_draft, **report}
    print(f"{args.content}: {report['rounds']} rounds, {report['tokens']} tokens, mean width {report['mean_width']}, "
          f"depth {report['depths'][0]}-{report['depths'][1]}")
    for row, value in report["ms_a_round"].items():
        print(f"  {row:<10} {value:8.2f} ms a round")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
