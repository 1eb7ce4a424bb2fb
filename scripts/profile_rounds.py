"""Where a verify round's time goes: the engine's rounds against bare forwards of their inputs.

    python scripts/profile_rounds.py --model DIR [--content refactor] [--max-draft auto] [--json FILE]

On an H100 (8-bit 8B yardstick, 2026-12-06) a refactor round took 33.6 ms at ~20 rows while the
cost curve's forward of that width took 19-20 ms (docs/benchmarks.md). This runs one of
`benchmark`'s contents (greedy, lookup drafts, the draft cap the engine would use: `auto`, the
cost curve's controller, by default) through the engine after an untimed run of the same, then
prints the mean milliseconds a round of each of:

- `engine`: a round as `engine.generate`'s caller sees it (`benchmark`'s own path: the engine
  thread's scheduling, the round, its commit and detokenizing, the event to the caller), the
  time after the first token over the rounds after the first;
- `loop`: the verify loop alone on the engine thread (`speculative_rounds` with the same cap:
  drafting, the forward, acceptance, taking back; Round.seconds);
- `new shape`: a bare forward of the loop's round, its width at its depth, on a second cache that
  follows the loop's, after the previous round's (another width, a shallower depth), rolled back;
- `same shape`: the same forward again right after, rolled back: what the cost curve measures;
- `kept`: the same forward a third time, then taken back to what the round kept, so the cache
  grows as the loop's does.

`engine` - `loop` is what the engine's machinery adds; `loop` - `new shape` the loop's own work;
`new shape` - `same shape` what meeting a new shape costs (graphs, kernels, plans built per
shape); `kept` - `same shape` what growing the cache costs. Runs wherever the engine does (on a CPU
its forward dominates every row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = ("engine", "loop", "new shape", "same shape", "kept")
REPLAYS = ROWS[2:]  # the bare forwards of each round


def profile(target, prompt: list[int], max_tokens: int, max_draft: int | str) -> dict:
    """The loop's and the bare forwards' timings of every round of `prompt`'s greedy decode, on
    `target` (run on the engine's thread: `Engine.call`). `max_draft`: a number, or "auto" (a
    fresh draft controller each decode, told every round's acceptance, as the engine does)."""
    import mlx.core as mx

    from engine.base.sampling import SamplingParams
    from engine.caches.kv_segments import fresh_cache
    from engine.caches.rollback import mark, take_back
    from engine.decoding.verify import prefill, speculative_rounds
    from engine.drafting.lookup import LookupDrafter
    from engine.tuning.draft_control import draft_controller

    def decode() -> tuple[list, int]:
        cache = fresh_cache(target)
        prefill(target, cache, prompt[:-1], chunk_size=2048)
        drafter = LookupDrafter()
        drafter.start(prompt)
        controller = draft_controller(target, len(prompt), mode="lookup") if max_draft == "auto" else None
        cap, hard_cap = (controller, controller.max_cap) if controller else (lambda: max_draft, max_draft)
        rounds, made, eos = [], 0, target.eos_token_ids
        left = lambda: max(0, max_tokens - made - 1)  # noqa: E731  (the engine's: no draft past the budget)
        for r in speculative_rounds(target, cache, prompt[-1], drafter, SamplingParams(), lambda: min(cap(), left()),
                                    hard_cap=lambda: min(hard_cap, left())):
            if controller is not None:
                controller.observe(r.drafted, r.accepted, r.source)
            rounds.append(r)
            made += len(r.tokens)
            if made >= max_tokens or eos.intersection(r.tokens):
                break  # where the engine stops
        return rounds, made

    decode()  # untimed: every shape this decode meets, met once
    rounds, made = decode()

    cache = fresh_cache(target)
    prefill(target, cache, prompt[:-1], chunk_size=2048)
    depth, y = len(prompt) - 1, prompt[-1]
    timings = {row: [] for row in REPLAYS}
    for r in rounds:
        width = r.width  # as the loop ran it (padded on MLX CUDA)
        # the loop fed the last token and its draft; the kept part is the round's accepted tokens
        inputs = ([y, *r.tokens[:-1]] + [y] * width)[:width]
        for row in REPLAYS:
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
            "ms_a_round": {"loop": mean_ms([r.seconds for r in rounds]), **{row: mean_ms(timings[row]) for row in REPLAYS}}}


def through_engine(engine, prompt: list[int], max_tokens: int, max_draft: int | str) -> dict:
    """`prompt`'s greedy lookup decode through `engine.generate` as `benchmark` runs it, after an
    untimed run of the same: its rounds and the mean ms of a round after the first, as the caller
    sees them."""
    from engine.base.sampling import SamplingParams
    from engine.bench.benchmark import engine_run

    engine_run(engine, prompt, max_tokens, SamplingParams(), "lookup", max_draft)
    sample = engine_run(engine, prompt, max_tokens, SamplingParams(), "lookup", max_draft)
    rounds = sample.extra["rounds"]
    ms = round(1e3 * (sample.seconds - sample.ttft_s) / (rounds - 1), 2) if rounds > 1 else None
    return {"rounds": rounds, "tokens": len(sample.tokens), "ms_a_round": ms}


def mean_ms(seconds: list[float]) -> float | None:
    return round(1e3 * statistics.fmean(seconds), 2) if seconds else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--content", default="refactor", help="one of benchmark's decode contents (refactor, edit, chat, ...)")
    ap.add_argument("--max-draft", default="auto",
                    help="the rounds' draft cap: auto (the engine's default, from the cost curve) or a number")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the content's own budget")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.max_draft != "auto":
        if not args.max_draft.isdecimal() or int(args.max_draft) < 1:
            sys.exit(f"--max-draft takes auto or a whole number >= 1, not {args.max_draft!r}")
        args.max_draft = int(args.max_draft)

    from engine import Engine
    from engine.bench.benchmark import build_content

    with Engine(args.model, max_draft=args.max_draft, prefix_cache=False) as engine:
        content = build_content(engine, args.content)
        max_tokens = args.max_tokens or content.max_tokens
        whole = through_engine(engine, content.prompts[0], max_tokens, args.max_draft)
        report = engine.call(profile, content.prompts[0], max_tokens, args.max_draft)
    report = {"model": args.model, "content": args.content, "max_draft": args.max_draft, **report,
              "engine": {k: whole[k] for k in ("rounds", "tokens")},
              "ms_a_round": {"engine": whole["ms_a_round"], **report["ms_a_round"]}}
    print(f"{args.content}: {report['rounds']} rounds, {report['tokens']} tokens, mean width {report['mean_width']}, "
          f"depth {report['depths'][0]}-{report['depths'][1]}; through the engine {whole['rounds']} rounds, "
          f"{whole['tokens']} tokens")
    for row, value in report["ms_a_round"].items():
        print(f"  {row:<10} {value if value is not None else float('nan'):8.2f} ms a round")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
