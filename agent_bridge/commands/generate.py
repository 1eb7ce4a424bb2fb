"""`mlx-dspark generate`: one prompt in, text (or a JSON report) out."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from agent_bridge.commands import CommandError
from agent_bridge.commands.common import add_engine_args, engine_from_args, follows


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--compare", action="store_true",
                   help="then run the same request with plain mlx-lm decoding (mode baseline): speeds side "
                        "by side, and whether the outputs are identical")
    p.set_defaults(run=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    path = Path(args.prompt_file)
    if not path.is_file():
        raise CommandError(f"prompt file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CommandError(f"prompt file is not UTF-8 text: {path}") from None


def run(args: argparse.Namespace) -> int:
    from engine import Done, GenerationRequest, PrefillProgress, SamplingParams, Tokens

    prompt = read_prompt(args)
    with engine_from_args(args) as engine:
        if follows(engine):
            return 0
        if args.no_chat_template:
            ids = engine.encode(prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = engine.render_chat(messages)
        request = GenerationRequest(
            prompt_ids=ids,
            max_tokens=args.max_tokens,
            sampling=SamplingParams(
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
            ),
            stop=args.stop,
            mode=args.mode,
        )
        done = None
        for event in engine.generate(request):
            if isinstance(event, Tokens) and not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, PrefillProgress) and not args.json and event.total > 4096:
                print(f"\rprefill {event.done}/{event.total}", end="", file=sys.stderr, flush=True)
            elif isinstance(event, Done):
                done = event
        choice = engine.last_mode_choice if (args.mode or engine.default_mode) == "auto" else None
        plain = None
        if args.compare:
            if not args.json:
                print("\n[now the same request with plain mlx-lm decoding...]", file=sys.stderr, flush=True)
            plain = [e for e in engine.generate(replace(request, mode="baseline")) if isinstance(e, Done)][0]
    stats = done.stats
    if args.json:
        report = {
            "text": done.text,
            "token_ids": done.token_ids,
            "finish_reason": done.finish_reason,
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "mode": stats.mode,
            "mode_choice": choice.to_dict() if choice else None,  # why `auto` ran this mode
            "rounds": stats.rounds,
            "mean_accepted": round(stats.mean_accepted, 4),
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "ttft_s": round(stats.ttft_s, 4),
            "decode_tok_s": round(stats.decode_tok_s, 2),
            "wall_s": round(stats.wall_s, 4),
            "stats": stats.to_dict(),
        }
        if plain is not None:
            report["compare"] = comparison(done, plain)
        print(json.dumps(report))
    else:
        print()
        print(
            f"[{stats.mode}: {stats.generated_tokens} tokens, {stats.decode_tok_s:.1f} tok/s, "
            f"{stats.mean_accepted:.2f} tokens/forward, ttft {stats.ttft_s:.2f}s]",
            file=sys.stderr,
        )
        if plain is not None:
            c = comparison(done, plain)
            print(f"[plain mlx-lm: {c['baseline_decode_tok_s']:.1f} tok/s; {stats.mode} is {c['decode_speedup']:.2f}x "
                  f"as fast; outputs identical: {'yes' if c['identical'] else 'NO'}]", file=sys.stderr)
    return 0


def comparison(done, plain) -> dict:
    """The drafted run against plain decoding of the same request: decode speeds (time to first
    token apart: the second run finds the prompt in the prefix cache) and token-for-token equality."""
    fast, slow = done.stats.decode_tok_s, plain.stats.decode_tok_s
    return {"identical": done.token_ids == plain.token_ids, "baseline_decode_tok_s": round(slow, 2),
            "decode_speedup": round(fast / slow, 3) if slow else None,
            "baseline_generated_tokens": plain.stats.generated_tokens}
