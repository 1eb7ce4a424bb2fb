"""Several requests at once against the same requests one at a time (`benchmark --concurrency`).

For each level c, c distinct requests of one content (its task, each with its own first
line) are submitted together through the engine's scheduler twice: with max_batch 1 (one
at a time, in arrival order) and with max_batch c (decoding together, verify forwards
batched), alternating which goes first. Reported per level: aggregate tokens/s (all tokens
over the wall time), each request's time to first token from submission (mean and max),
the ratio of the two aggregates (median of the per-trial ratios: a loaded machine drifts
less within a trial) and whether every request's tokens were identical to its one-at-a-time
run. A batched matmul may round differently from a single row's; where an output differs,
`differing` counts the requests (a divergence then starts at a near-tie, tests/test_batching.py).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

from engine.base.events import Done, Tokens
from engine.base.sampling import SamplingParams
from engine.bench.benchmark import CONTENTS, build_content, without_prefix_cache
from engine.engine import GenerationRequest

CONCURRENT_CONTENTS = tuple(c for c in CONTENTS if c not in ("agent", "long"))


def distinct_prompts(engine, name: str, c: int) -> tuple[list[list[int]], int, str]:
    """c requests of content `name`, each its own first line; (prompts, its budget, note)."""
    contents = [build_content(engine, name, tag=f"(Request {i + 1} of {c}.)") for i in range(c)]
    return [x.prompts[0] for x in contents], contents[0].max_tokens, contents[0].note


def run_together(engine, prompts: list[list[int]], max_tokens: int, max_batch: int,
                 sampling: SamplingParams, mode: str | None, max_draft) -> dict:
    """Submit every prompt at once with `max_batch`; read each on its own thread."""
    engine.set_max_batch(max_batch)
    rounds_before, drafts_before = engine.batched_rounds, engine.batched_drafts
    t0 = time.perf_counter()
    jobs = [engine.submit(GenerationRequest(p, max_tokens=max_tokens, sampling=sampling, mode=mode,
                                            max_draft=max_draft)) for p in prompts]
    first: list[float | None] = [None] * len(jobs)
    done: list[Done | BaseException | None] = [None] * len(jobs)

    def read(i: int) -> None:
        try:
            for ev in jobs[i]:
                if isinstance(ev, Tokens) and ev.token_ids and first[i] is None:
                    first[i] = time.perf_counter() - t0
                if isinstance(ev, Done):
                    done[i] = ev
        except BaseException as e:  # re-raised below, on the caller's thread
            done[i] = e

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for d in done:
        if isinstance(d, BaseException):
            raise d
    tokens = sum(len(d.token_ids) for d in done)
    ttfts = [f if f is not None else wall for f in first]
    return {"tok_s": tokens / wall if wall > 0 else 0.0, "wall_s": wall, "tokens": tokens, "ttfts": ttfts,
            "outputs": [list(d.token_ids) for d in done], "batched_rounds": engine.batched_rounds - rounds_before,
            "batched_drafts": engine.batched_drafts - drafts_before}


def _side(runs: list[dict]) -> dict:
    med = lambda xs: round(statistics.median(xs), 4)  # noqa: E731
    return {
        "tok_s": med([r["tok_s"] for r in runs]),
        "wall_s": med([r["wall_s"] for r in runs]),
        "tokens": int(statistics.median(r["tokens"] for r in runs)),
        "ttft_mean_s": med([statistics.mean(r["ttfts"]) for r in runs]),
        "ttft_max_s": med([max(r["ttfts"]) for r in runs]),
        "batched_rounds": int(statistics.median(r["batched_rounds"] for r in runs)),
        "batched_drafts": int(statistics.median(r["batched_drafts"] for r in runs)),
        "samples": [{"tok_s": round(r["tok_s"], 2), "wall_s": round(r["wall_s"], 4), "tokens": r["tokens"],
                     "ttft_s": [round(x, 4) for x in r["ttfts"]]} for r in runs],
    }


def bench_level(engine, name: str, c: int, trials: int, sampling: SamplingParams, mode: str | None,
                max_draft, max_tokens: int | None, progress: Callable[[str], None]) -> dict:
    prompts, budget, note = distinct_prompts(engine, name, c)
    budget = max_tokens or budget
    runs: dict[str, list[dict]] = {"one_at_a_time": [], "together": []}
    for trial in range(trials):
        order = ["one_at_a_time", "together"] if trial % 2 == 0 else ["together", "one_at_a_time"]
        for side in order:  # alternate who goes first: warm-up and drift favour neither
            progress(f"{name} x{c}: trial {trial + 1}/{trials}, {side.replace('_', ' ')}")
            runs[side].append(run_together(engine, prompts, budget, 1 if side == "one_at_a_time" else c,
                                           sampling, mode, max_draft))
    reference = runs["one_at_a_time"][0]["outputs"]
    differing = {i for r in runs["one_at_a_time"] + runs["together"]
                 for i, (out, ref) in enumerate(zip(r["outputs"], reference)) if out != ref}
    ratios = [t["tok_s"] / o["tok_s"] for o, t in zip(runs["one_at_a_time"], runs["together"]) if o["tok_s"]]
    return {"content": name, "requests": c, "max_tokens": budget, "prompt_tokens": [len(p) for p in prompts],
            "note": note, "one_at_a_time": _side(runs["one_at_a_time"]), "together": _side(runs["together"]),
            "ratio": round(statistics.median(ratios), 3) if ratios else None,
            "identical": not differing, "differing": len(differing)}


def run_concurrency(engine, names: list[str], levels: list[int], trials: int = 3,
                    sampling: SamplingParams | None = None, mode: str | None = None, max_draft="auto",
                    max_tokens: int | None = None, progress: Callable[[str], None] = lambda msg: None,
                    on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """One row per content and level (see the module's docstring). Cold prompts (no prefix
    cache: a repeated trial must not start warm); the engine's max_batch is put back after."""
    for name in names:
        if name not in CONCURRENT_CONTENTS:
            raise ValueError(f"content {name!r} can't run concurrently; choose from {', '.join(CONCURRENT_CONTENTS)}")
    if not levels or min(levels) < 1:
        raise ValueError("concurrency levels must be whole numbers >= 1")
    sampling = sampling or SamplingParams()
    saved = engine.max_batch
    rows = []
    try:
        with without_prefix_cache(engine):
            for name in names:
                # warm up (first calls compile kernels, fill allocators): alone and two together
                warm, budget, _ = distinct_prompts(engine, name, 2)
                progress(f"{name}: warming up")
                for b in (1, 2):
                    run_together(engine, warm, min(max_tokens or budget, 16), b, sampling, mode, max_draft)
                for c in levels:
                    rows.append(bench_level(engine, name, c, trials, sampling, mode, max_draft, max_tokens, progress))
                    on_row(rows[-1])
    finally:
        engine.set_max_batch(saved)
    return rows


def row_line(r: dict) -> str:
    """One row as a line, printed as soon as it is measured (a long run cut short keeps it)."""
    one, tog = r["one_at_a_time"], r["together"]
    return (f"{r['content']} x{r['requests']}: {one['tok_s']:.1f} -> {tog['tok_s']:.1f} tok/s ({r['ratio']:.2f}x), "
            f"TTFT mean {one['ttft_mean_s']:.3f} -> {tog['ttft_mean_s']:.3f} s, max {one['ttft_max_s']:.3f} -> "
            f"{tog['ttft_max_s']:.3f} s, identical {'yes' if r['identical'] else 'NO'}")


def format_rows(rows: list[dict]) -> str:
    head = ("content", "requests", "tokens", "one-at-a-time tok/s", "together tok/s", "ratio",
            "TTFT mean s", "TTFT max s", "batched rounds", "batched drafts", "identical")
    cells = []
    for r in rows:
        one, tog = r["one_at_a_time"], r["together"]
        cells.append((r["content"], str(r["requests"]), str(tog["tokens"]), f"{one['tok_s']:.1f}",
                      f"{tog['tok_s']:.1f}", f"{r['ratio']:.2f}x" if r["ratio"] else "-",
                      f"{one['ttft_mean_s']:.3f} -> {tog['ttft_mean_s']:.3f}",
                      f"{one['ttft_max_s']:.3f} -> {tog['ttft_max_s']:.3f}", str(tog["batched_rounds"]),
                      str(tog["batched_drafts"]),
                      "yes" if r["identical"] else f"NO ({r['differing']} of {r['requests']} differ)"))
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, h in enumerate(head)]
    line = lambda row: "  ".join(c.ljust(w) if i in (0, 10) else c.rjust(w)  # noqa: E731
                                 for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join(line(x).rstrip() for x in [head, ["-" * w for w in widths], *cells])
