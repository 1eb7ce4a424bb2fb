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
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT.parent / "shared" / "fixtures" / "claude-code" / "long-session.jsonl"
BILLING = "x-anthropic-billing-header"


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


def replay(make_engine: Callable[..., object], turns: list[list[int]], max_tokens: int = 8,
           cache_dir: str | None = None, log: Callable[[str], None] = print) -> dict:
    """Cold (cache off), warm (cache on: turns[:-1]) and restart (new engine, disk tier: turns[-1]).

    make_engine(**engine_options) builds an Engine; returns a dict of figures."""
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="mlx-dspark-kv-")
    res: dict = {"turn_tokens": [len(t) for t in turns], "cold_ttft_s": [], "warm_ttft_s": [], "warm_cached": []}
    outs_cold = []
    with make_engine(prefix_cache=False) as cold:
        for i, t in enumerate(turns):
            out, st, _ = _run(cold, t, max_tokens)
            outs_cold.append(out)
            res["cold_ttft_s"].append(st.ttft_s)
            log(f"cold  turn {i + 1}: {len(t)} tokens, ttft {st.ttft_s:.3f}s")
    same = True
    with make_engine(prefix_cache=True, prefix_cache_dir=cache_dir) as warm:
        for i, t in enumerate(turns[:-1]):
            out, st, _ = _run(warm, t, max_tokens)
            same &= out == outs_cold[i]
            res["warm_ttft_s"].append(st.ttft_s)
            res["warm_cached"].append(st.cached_tokens)
            log(f"warm  turn {i + 1}: {len(t)} tokens, {st.cached_tokens} cached, ttft {st.ttft_s:.3f}s "
                f"({st.ttft_s / res['cold_ttft_s'][i]:.1%} of cold)")
        res["cache"] = warm.cache_stats()
    with make_engine(prefix_cache=True, prefix_cache_dir=cache_dir) as restarted:
        out, st, _ = _run(restarted, turns[-1], max_tokens)
        same &= out == outs_cold[-1]
        res["restart_ttft_s"], res["restart_cached"] = st.ttft_s, st.cached_tokens
        log(f"after restart, turn {len(turns)}: {len(turns[-1])} tokens, {st.cached_tokens} cached "
            f"(from disk), ttft {st.ttft_s:.3f}s")
        res["restart_cache"] = restarted.cache_stats()
    cold_ttft = res["cold_ttft_s"]
    res["warm_ratio"] = [w / c for w, c in zip(res["warm_ttft_s"][1:], cold_ttft[1:-1])]
    res["restart_ratio"] = res["restart_ttft_s"] / cold_ttft[-1]
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
    p.add_argument("--hidden", type=int, default=256, help="random model: hidden size")
    p.add_argument("--layers", type=int, default=4, help="random model: layers")
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
    if len(turns) < 3:
        print(f"only {len(turns)} turns fit in {args.max_context} tokens; raise --max-context", file=sys.stderr)
        return 2
    print(f"{source}: {len(turns)} turns of {len(turns[0])}..{len(turns[-1])} tokens")
    res = replay(make_engine, turns, args.max_tokens, args.cache_dir)
    c = res["cache"]
    warm = res["warm_ratio"]
    print()
    new = [len(b) - len(a) for a, b in zip(turns, turns[1:])]
    print(f"ttft turns 2..{len(turns) - 1}, warm/cold (new tokens): "
          + ", ".join(f"{r:.1%} ({n})" for r, n in zip(warm, new)))
    small = [r for r, n in zip(warm, new) if n < 1000]
    if small:
        print(f"  turns adding < 1000 tokens: max {max(small):.1%} of cold (aim <= 5%)")
    print(f"first turn after restart (disk tier, {len(turns[-1]) - len(turns[-2])} new tokens), vs cold: "
          f"{res['restart_ratio']:.1%}  (aim <= 15%)")
    print(f"bytes per cached token: {c['bytes_per_token']:.0f}; RAM held: {c['ram_bytes'] / 2**20:.1f} MiB "
          f"for {c['cached_tokens']} tokens in {c['entries']} entries; "
          f"disk after restart: {res['restart_cache']['disk_bytes'] / 2**20:.1f} MiB")
    print(f"tokens identical with and without the cache: {res['identical']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
