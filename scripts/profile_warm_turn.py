"""Where a warm agent turn's time goes, stage by stage, end to end in one process.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      .venv/bin/python scripts/profile_warm_turn.py [--model DIR] [--fixture FILE.jsonl]

Replays a recorded Claude Code session (default: ../shared/fixtures/claude-code/rename-session.jsonl)
the way `serve` handles /v1/messages: body parse, chat template, tokenising, then the engine's
prefix-cache lookup, KV assembly, drafter start (the lookup index), prefill of the new tokens and
the first decode round (max_tokens=1). Turn 1 is cold; the later turns are the warm ones. Stages are
timed by wrapping the engine's own functions (nothing here changes what they do); `other` is the
rest of the engine's time to first token. `keep` is the prefix cache keeping the prompt as it is
computed (write-ahead and the prompt's end): with a disk tier (`--prefix-cache-dir`), handing its
segments to the background writer, their copies to the host included. `queued MB` is what that
writer still had to write when the turn began; `--wait-for-disk` lets it finish first, which
separates what the writing costs a turn running beside it from what the turn itself pays.

`--restart`: then the engine is closed (its disk tier written, as on SIGTERM), a new one opened on
the same folder (`--prefix-cache-dir`, else a temporary one) and given one short warm-up request,
and the last turn profiled again: `disk` is the disk tier's reads, within `lookup`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ("parse", "template", "tokenise", "lookup", "disk", "assemble", "drafter", "prefill", "keep", "first_round",
          "other")


class Timers:
    """Wraps functions so that each call adds its wall time to a named stage."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.running: dict[str, int] = {}  # stage -> calls of it under way

    def wrap(self, owner, attr: str, stage: str, not_within: str | None = None) -> None:
        """`not_within`: calls made inside that stage's are left to it (not counted twice)."""
        fn = getattr(owner, attr, None)
        if fn is None:
            return

        def timed(*a, **k):
            if not_within is not None and self.running.get(not_within):
                return fn(*a, **k)
            self.running[stage] = self.running.get(stage, 0) + 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[stage] = self.s.get(stage, 0.0) + time.perf_counter() - t
                self.running[stage] -= 1

        setattr(owner, attr, timed)


def fixtures_root() -> Path:
    """../shared/fixtures from the repository root (a worktree one level deeper looks one up too)."""
    for up in (ROOT.parent, ROOT.parent.parent):
        if (up / "shared/fixtures").is_dir():
            return up / "shared/fixtures"
    return ROOT.parent / "shared/fixtures"


def template_text(engine, req) -> str:
    from agent_bridge.chat.chat_request import fold_system_messages

    tok = engine.tokenizer
    try:
        return tok.apply_chat_template(req.messages, tools=req.tools or None, add_generation_prompt=True,
                                       tokenize=False, **req.template_kwargs)
    except Exception:
        return tok.apply_chat_template(fold_system_messages(req.messages), tools=req.tools or None,
                                       add_generation_prompt=True, tokenize=False, **req.template_kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--fixture", default=str(fixtures_root() / "claude-code/rename-session.jsonl"))
    ap.add_argument("--context-window", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON object per turn as well")
    ap.add_argument("--prefix-cache-dir", default=None, help="the disk tier's folder (with --restart: a temp one)")
    ap.add_argument("--restart", action="store_true", help="the last turn again on a restarted engine")
    ap.add_argument("--wait-for-disk", action="store_true",
                    help="before each turn, wait until the disk tier's writer has written everything queued")
    args = ap.parse_args()
    fixture = Path(args.fixture)
    if not fixture.exists():
        print(f"skipped: {fixture} not found", file=sys.stderr)
        return 0

    import engine.engine as engine_mod
    import engine.caches.prefix_cache as pc_mod
    from agent_bridge.apis.anthropic_api import parse_request
    from agent_bridge.chat.chat_request import render
    from engine import Engine, GenerationRequest

    timers = Timers()
    timers.wrap(pc_mod, "build_cache", "assemble")
    timers.wrap(pc_mod.PrefixCache, "_match", "lookup")
    timers.wrap(engine_mod, "make_drafter", "drafter")
    timers.wrap(engine_mod, "prefill", "prefill")
    timers.wrap(pc_mod.PrefixCache, "release", "release")
    for cls in (pc_mod.PrefixCache, *pc_mod.PrefixCache.__subclasses__()):  # each strategy's own hooks
        for hook in ("write_ahead", "checkpoint"):
            if hook in vars(cls):  # a checkpoint that a release takes at the turn's end is the release's
                timers.wrap(cls, hook, "keep", not_within="release")
    from engine.caches.kv_disk import DiskTier

    timers.wrap(DiskTier, "load_many", "disk")
    from engine.drafting import lookup as lookup_mod

    timers.wrap(lookup_mod.LookupDrafter, "start", "drafter")
    for name in ("ContextIndexCache",):  # the continued lookup index, where it exists
        if hasattr(lookup_mod, name):
            timers.wrap(getattr(lookup_mod, name), "index_for", "drafter")

    lines = [ln for ln in fixture.read_text().splitlines() if ln.strip()]
    print(f"profiling {len(lines)} turns of {fixture.name}", flush=True)
    cache_dir = args.prefix_cache_dir or (tempfile.mkdtemp(prefix="profile-turn-") if args.restart else None)

    def turn(engine, label, line) -> dict:
        t = time.perf_counter()
        if args.wait_for_disk:
            engine.flush_disk(None)
        waited = time.perf_counter() - t
        queued = (engine.cache_stats() or {}).get("disk_pending_bytes", 0)
        timers.s.clear()
        t0 = time.perf_counter()
        body = json.loads(line)["body"]
        req = parse_request(body, 4096)
        t1 = time.perf_counter()
        template_text(engine, req)
        t2 = time.perf_counter()
        ids = render(engine, req)  # template again + tokenising: what serve does
        t3 = time.perf_counter()
        st = engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=1)).result().stats
        row = {
            "turn": label,
            "prompt_tokens": st.prompt_tokens,
            "cached_tokens": st.cached_tokens,
            "parse": t1 - t0,
            "template": t2 - t1,
            "tokenise": max(0.0, (t3 - t2) - (t2 - t1)),
            "lookup": timers.s.get("lookup", 0.0),
            "disk": timers.s.get("disk", 0.0),
            "assemble": timers.s.get("assemble", 0.0),
            "drafter": timers.s.get("drafter", 0.0),
            "prefill": timers.s.get("prefill", 0.0),
            "keep": timers.s.get("keep", 0.0),
            "first_round": max(0.0, st.ttft_s - st.prefill_s),
            "release": timers.s.get("release", 0.0),
            "queued_mb": queued / 2**20,
            "waited_for_disk": waited,
        }
        known = sum(row[k] for k in ("lookup", "assemble", "drafter", "prefill", "keep", "first_round"))
        row["other"] = max(0.0, st.ttft_s - known)
        row["total"] = (t3 - t0) - row["template"] + st.ttft_s  # the template is timed twice above
        if args.json:
            print(json.dumps(row), flush=True)
        print(f"turn {label}: {st.prompt_tokens} tokens, {st.cached_tokens} cached, "
              f"{st.prompt_tokens - st.cached_tokens} new: {row['total'] * 1000:.0f} ms to first token", flush=True)
        return row

    opts = dict(context_window=args.context_window, prefix_cache_dir=cache_dir, long_lived=True)  # as serve runs it
    with Engine(args.model, **opts) as engine:
        rows = [turn(engine, str(i), line) for i, line in enumerate(lines, 1)]
    if args.restart:  # closed above: its segments are on disk, as after a SIGTERM
        with Engine(args.model, **opts) as engine:
            engine.submit(GenerationRequest(prompt_ids=engine.tokenizer.encode("Say hello."), max_tokens=1)).result()
            rows.append(turn(engine, "restart", lines[-1]))
    head = f"{'stage (ms)':<12}" + "".join(f"{r['turn'] if r['turn'] == 'restart' else 'turn ' + r['turn']:>10}" for r in rows)
    print("\n" + head)
    for stage in (*STAGES, "release", "total"):
        print(f"{stage:<12}" + "".join(f"{r[stage] * 1000:>10.1f}" for r in rows))
    if cache_dir is not None:
        print(f"{'queued MB':<12}" + "".join(f"{r['queued_mb']:>10.0f}" for r in rows))
        if args.wait_for_disk:
            print(f"{'waited (ms)':<12}" + "".join(f"{r['waited_for_disk'] * 1000:>10.1f}" for r in rows))
    warm = [r for r in rows[1:] if r["turn"] != "restart"]
    if warm:
        not_compute = [r["total"] - r["prefill"] - r["first_round"] for r in warm]
        print(f"\nwarm turns: not compute (all but prefill and first round) "
              f"{min(not_compute) * 1000:.0f}-{max(not_compute) * 1000:.0f} ms a turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
