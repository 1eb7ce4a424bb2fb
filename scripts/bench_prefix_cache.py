"""Replay a multi-turn agent session with the prefix cache off, on, and after a restart.

    python scripts/bench_prefix_cache.py [--model DIR] [--fixture long-session.jsonl]

Turns come from a recorded Claude Code session (../shared/fixtures/claude-code/
long-session.jsonl: each request's system prompt, tools and messages rendered with
the model's chat template) or, without it, from a synthetic session that reads
standard-library files. Without --model and without the bundled reference model's
weights, a random model is built (tests/tiny_models.py) with a long context.

Reports time to first token per turn cold (cache off) and warm (cache on), the first
turn after a restart that reloads the disk tier, bytes per cached token, RAM held,
and whether every turn's tokens were identical. `replay()` is the reusable part.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT.parent / "shared" / "fixtures" / "claude-code" / "long-session.jsonl"
BILLING = "x-anthropic-billing-header"
FOLLOW_UP = "Thanks. Now run the tests and fix whatever fails."


# -- turns ------------------------------------------------------------------------------


def _text(content) -> str:
    """Anthropic content (a string or blocks) flattened to text, tool blocks as JSON."""
    if isinstance(content, str):
        return content
    parts = []
    for b in content or []:
        kind = b.get("type")
        if kind == "text":
            if not b.get("text", "").startswith(BILLING):  # changes per request; not prompt content
                parts.append(b["text"])
        elif kind == "tool_use":
            parts.append("<tool_call>" + json.dumps({"name": b.get("name"), "arguments": b.get("input")}) + "</tool_call>")
        elif kind == "tool_result":
            parts.append("<tool_response>" + _text(b.get("content")) + "</tool_response>")
    return "\n".join(parts)


def fixture_turns(engine, path: Path) -> list[list[int]]:
    """Each recorded request rendered with the model's chat template."""
    turns = []
    for line in path.read_text().splitlines():
        body = json.loads(line)["body"]
        messages = [{"role": "system", "content": _text(body.get("system"))}]
        messages += [{"role": m["role"], "content": _text(m["content"])} for m in body["messages"]]
        tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                   "parameters": t.get("input_schema", {})}}
                 for t in body.get("tools", [])]
        turns.append(engine.render_chat(messages, tools=tools or None))
    return turns


def _source_tokens(engine, modules: tuple[str, ...], n: int) -> str:
    """About n tokens of standard-library source (whole modules, the last one cut)."""
    import importlib
    import inspect

    text = ""
    for mod in modules:
        text += inspect.getsource(importlib.import_module(mod)) + "\n"
        ids = engine.encode(text)
        if len(ids) >= n:
            return engine.decode(ids[:n])
    return text


SHORT_RESULTS = [
    "Exit code 0. 412 passed, 3 skipped in 21.4s",
    "The file lib/util.py has been updated. Here's the result of running `cat -n` on a snippet:\n"
    "   12\tdef parse(argv):\n   13\t    return build_parser().parse_args(argv)",
    "On branch main\nChanges not staged for commit:\n  modified:   lib/util.py\n  modified:   tests/test_util.py",
]


def synthetic_turns(engine, first: int = 8000, step: int = 5000, files: int = 4) -> list[list[int]]:
    """An agent session: a long system prompt, then turns that alternate a file read
    (a ~5k-token tool result) with a short command's output, as Claude Code's do."""
    system = "You are a coding agent. Tools and conventions follow.\n" + _source_tokens(
        engine, ("json.encoder", "json.decoder", "string", "shlex"), first)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Review these modules."}]
    turns = [engine.render_chat(messages)]
    mods = ("argparse", "dataclasses", "textwrap", "tokenize", "ast", "glob")[:files]
    for i, mod in enumerate(mods):
        for name, args, result in (("read_file", {"path": f"lib/{mod}.py"}, _source_tokens(engine, (mod,), step)),
                                   ("bash", {"command": "make test"}, SHORT_RESULTS[i % len(SHORT_RESULTS)])):
            call = json.dumps({"name": name, "arguments": args})
            messages.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
            messages.append({"role": "tool", "content": result})
            turns.append(engine.render_chat(messages))
    return turns


def fit_turns(turns: list[list[int]], max_context: int) -> list[list[int]]:
    """The turns that fit the context (dropping later, longer ones)."""
    return [t for t in turns if len(t) < max_context]


# -- the replay -------------------------------------------------------------------------


def _run(engine, prompt: list[int], max_tokens: int):
    from engine import GenerationRequest

    t0 = time.perf_counter()
    done = engine.submit(GenerationRequest(prompt, max_tokens=max_tokens, mode="baseline")).result()
    return done.token_ids, done.stats, time.perf_counter() - t0


def restart_turn(turns: list[list[int]]) -> int:
    """Where to restart the server: before the turn (third or later) that adds the fewest
    tokens, so the figure shows what reloading costs rather than prefilling new text."""
    adds = {i: len(turns[i]) - len(turns[i - 1]) for i in range(2, len(turns))}
    return min(adds, key=lambda i: (adds[i], -i))


def replay(make_engine: Callable[..., object], turns: list[list[int]], max_tokens: int = 8,
           cache_dir: str | None = None, restart_at: int | None = None,
           log: Callable[[str], None] = print) -> dict:
    """Replay `turns` (successive prompts of one conversation) three ways:

    warm: an engine with the prefix cache and a disk tier runs turns[:restart_at], closes
    (its cache goes to disk), and a new one runs turns[restart_at:] (the first of them
    from the disk tier); cold: an engine without the cache runs turns 2.. (turn 1 is cold
    in the warm run too). make_engine(**engine_options) builds an Engine."""
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="mlx-dspark-kv-")
    restart_at = restart_turn(turns) if restart_at is None else restart_at
    n = len(turns)
    res: dict = {"turn_tokens": [len(t) for t in turns], "new_tokens": [len(turns[0])] + [
        len(b) - len(a) for a, b in zip(turns, turns[1:])], "restart_turn": restart_at + 1,
        "warm_ttft_s": [], "warm_cached": [], "cold_ttft_s": []}
    outs = []

    def run(engine, i, label):
        out, st, _ = _run(engine, turns[i], max_tokens)
        log(f"{label} turn {i + 1}: {len(turns[i])} tokens ({res['new_tokens'][i]} new), "
            f"{st.cached_tokens} cached, ttft {st.ttft_s:.3f}s")
        return out, st

    with make_engine(prefix_cache=True, prefix_cache_dir=cache_dir) as warm:
        for i in range(restart_at):
            out, st = run(warm, i, "warm   ")
            outs.append(out)
            res["warm_ttft_s"].append(st.ttft_s)
            res["warm_cached"].append(st.cached_tokens)
        res["cache"] = warm.cache_stats()
    with make_engine(prefix_cache=True, prefix_cache_dir=cache_dir) as restarted:
        for i in range(restart_at, n):
            out, st = run(restarted, i, "restart" if i == restart_at else "warm   ")
            outs.append(out)
            res["warm_ttft_s"].append(st.ttft_s)
            res["warm_cached"].append(st.cached_tokens)
        res["restart_cache"] = restarted.cache_stats()
    same = True
    res["cold_ttft_s"].append(res["warm_ttft_s"][0])  # nothing cached yet: a cold start
    with make_engine(prefix_cache=False) as cold:
        for i in range(1, n):
            out, st = run(cold, i, "cold   ")
            same &= out == outs[i]
            res["cold_ttft_s"].append(st.ttft_s)
    ratios = [w / c for w, c in zip(res["warm_ttft_s"], res["cold_ttft_s"])]
    res["ratio"] = ratios
    res["restart_ratio"] = ratios[restart_at]
    res["identical"] = same
    return res


# -- the command ------------------------------------------------------------------------


def build_bench_model(out: Path, hidden: int, layers: int, context: int) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tiny_model

    return build_tiny_model(out, arch="qwen3", seed=0, layers=layers, hidden=hidden, context=context)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the bundled reference model if present, else a random one)")
    p.add_argument("--fixture", default=str(FIXTURE), help="recorded Claude Code session (.jsonl)")
    p.add_argument("--max-context", type=int, default=32768, help="drop turns longer than this")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per turn")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None)
    p.add_argument("--hidden", type=int, default=128, help="random model: hidden size")
    p.add_argument("--layers", type=int, default=2, help="random model: layers")
    p.add_argument("--restart-turn", type=int, default=None,
                   help="restart before this turn (1-based; default: the third or later that adds least)")
    p.add_argument("--no-follow-up", dest="follow_up", action="store_false",
                   help="don't add a short last turn after the recorded ones")
    p.add_argument("--cache-dir", default=None, help="disk tier folder (default: a fresh temp folder)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)

    from engine import REFERENCE_MODEL_DIR, Engine, ensure_fast_blas

    ensure_fast_blas()
    model = args.model
    if model is None and any(REFERENCE_MODEL_DIR.glob("*.safetensors")):
        model = str(REFERENCE_MODEL_DIR)
    if model is None:
        model = str(build_bench_model(Path(tempfile.mkdtemp(prefix="bench-model-")), args.hidden, args.layers, 65536))
        print(f"random model: hidden {args.hidden}, {args.layers} layers ({model})")

    def make_engine(**kw):
        return Engine(model, kv_bits=args.kv_bits, **kw)

    with make_engine(prefix_cache=False) as probe:
        fixture = Path(args.fixture)
        limit = min(args.max_context, probe.context_window)
        turns, source = (fit_turns(fixture_turns(probe, fixture), limit), fixture.name) if fixture.exists() else ([], "")
        if len(turns) < 3:  # no fixture, or this tokenizer makes its turns too long
            turns, source = fit_turns(synthetic_turns(probe), limit), "synthetic session (stdlib files)"
        if args.follow_up:  # a short next turn (the user replies in a line): what most agent turns add
            more = turns[-1] + probe.encode(FOLLOW_UP)
            if len(more) < limit:
                turns.append(more)
    if len(turns) < 3:
        print(f"only {len(turns)} turns fit in {args.max_context} tokens; raise --max-context", file=sys.stderr)
        return 2
    print(f"{source}: {len(turns)} turns of {len(turns[0])}..{len(turns[-1])} tokens")
    res = replay(make_engine, turns, args.max_tokens, args.cache_dir,
                 None if args.restart_turn is None else args.restart_turn - 1)
    c, r = res["cache"], res["restart_turn"] - 1
    print()
    print("turn  tokens   new  cached  cold ttft  warm ttft  warm/cold")
    for i, t in enumerate(res["turn_tokens"]):
        tag = "  <- first turn after a restart (disk tier)" if i == r else ""
        print(f"{i + 1:>4} {t:>7} {res['new_tokens'][i]:>5} {res['warm_cached'][i]:>7} "
              f"{res['cold_ttft_s'][i]:>9.2f}s {res['warm_ttft_s'][i]:>9.2f}s {res['ratio'][i]:>9.1%}{tag}")
    later = [x for i, x in enumerate(res["ratio"]) if i >= 1 and i != r]
    if later:
        print(f"turns 2+ (without the restart): warm/cold {min(later):.1%}..{max(later):.1%} (aim <= 5%)")
    print(f"first turn after restart: {res['restart_ratio']:.1%} of cold (aim <= 15%)")
    print(f"bytes per cached token: {c['bytes_per_token']:.0f}; RAM held before the restart: "
          f"{c['ram_bytes'] / 2**20:.1f} MiB for {c['cached_tokens']} tokens in {c['entries']} entries; "
          f"on disk after: {res['restart_cache']['disk_bytes'] / 2**20:.1f} MiB")
    print(f"tokens identical with and without the cache: {res['identical']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
