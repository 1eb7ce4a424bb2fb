"""`mlx-dspark benchmark`: speedups measured side by side with plain mlx-lm."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from agent_bridge.commands import CommandError
from agent_bridge.commands.common import add_split_args, follows, parse_max_draft
from agent_bridge.commands.progress import end_progress, progress

AGENT_SESSION = Path(__file__).resolve().parents[2].parent / "shared/fixtures/claude-code/rename-session.jsonl"
# engine.bench.benchmark's names, repeated here so that building the parser doesn't import MLX
CONTENTS = ("chat", "code", "math", "refactor", "edit", "agent", "long")
DEFAULT_CONTENTS = ("chat", "code", "math", "refactor", "edit", "agent")
CONCURRENCY_CONTENTS = ("chat", "refactor")


def add_parser(sub) -> None:
    p = sub.add_parser("benchmark", help="measure speedups against plain mlx-lm on this machine")
    p.add_argument("--model", help="mlx-lm model directory or hub id (default: the bundled reference model)")
    p.add_argument("--contents", default=None,
                   help=f"comma-separated, from {','.join(CONTENTS)} (default: {','.join(DEFAULT_CONTENTS)}; "
                        f"with --concurrency: {','.join(CONCURRENCY_CONTENTS)})")
    p.add_argument("--modes", default=None,
                   help="comma-separated decoding modes (default: lookup; with --concurrency: auto, as served)")
    p.add_argument("--concurrency", default=None, metavar="N[,N...]",
                   help="instead of the comparison with mlx-lm: N distinct requests of each content at once "
                        "(batched) against the same N one at a time, for each N (e.g. 1,2,4,8)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: float32 on CPU, the checkpoint's on a GPU)")
    add_split_args(p)
    p.add_argument("--max-draft", default="auto", help="draft cap per round, a number or 'auto' (default: auto)")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None, help="quantise the KV cache")
    p.add_argument("--trials", type=int, default=3, help="runs per content and mode; medians are reported")
    p.add_argument("--max-tokens", type=int, default=None, help="override every content's output budget")
    p.add_argument("--long-depths", default="16384,32768", help="context sizes for `long` (tokens)")
    p.add_argument("--agent-session", default=str(AGENT_SESSION),
                   help="recorded Claude Code session (JSONL of /v1/messages requests) for `agent`")
    p.add_argument("--no-tune", action="store_true",
                   help="don't measure the verify cost curve first when it isn't cached")
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object")
    p.add_argument("--json-file", default=None, metavar="PATH", help="also write that JSON object to PATH")
    p.set_defaults(run=run)


def agent_turns(engine, path: Path, nonce: str) -> list[list[int]]:
    """Each recorded request rendered as the server renders it, the run's nonce leading the
    system prompt so that the first turn is cold in every cache (RAM or disk)."""
    from agent_bridge.apis.anthropic_api import parse_request
    from agent_bridge.chat.chat_request import render

    turns = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        body = json.loads(line).get("body") or {}
        req = parse_request(body, default_max_tokens=1)
        if req.messages and req.messages[0]["role"] == "system":
            req.messages[0] = {**req.messages[0], "content": f"[run {nonce}]\n" + req.messages[0]["content"]}
        else:
            req.messages.insert(0, {"role": "system", "content": f"[run {nonce}]"})
        turns.append(render(engine, req))
    return turns


def build_contents(engine, args: argparse.Namespace, names: list[str]) -> list:
    from engine import BenchContent, build_bench_content, run_nonce

    contents = []
    for name in names:
        if name == "agent":
            path = Path(args.agent_session)
            if not path.is_file():
                print(f"mlx-dspark: skipping `agent`: no recorded session at {path}", file=sys.stderr)
                continue
            try:
                turns = agent_turns(engine, path, run_nonce())
            except Exception as e:  # a line that isn't a /v1/messages request: say which file
                raise CommandError(f"--agent-session {path}: not a recorded session ({e})") from None
            contents.append(BenchContent("agent", turns, 8, kind="agent", note=f"{path.name}, {len(turns)} turns"))
        elif name == "long":
            for depth in _ints(args.long_depths, "--long-depths"):
                if depth + 256 > engine.context_window:
                    depth = engine.context_window - 256
                contents.append(build_bench_content(engine, "long", long_depth=depth))
        else:
            contents.append(build_bench_content(engine, name))
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise CommandError("--max-tokens must be >= 1")
        for c in contents:
            c.max_tokens = args.max_tokens if c.kind != "agent" else c.max_tokens
    return contents


def _ints(value: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise CommandError(f"{flag} takes comma-separated whole numbers, not {value!r}") from None


def _names(value: str, allowed, flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise CommandError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(allowed)}")
    return names


def run(args: argparse.Namespace) -> int:
    from engine import BENCH_CONTENTS, Engine, available_modes, format_bench_table, run_benchmark

    max_draft = parse_max_draft(args.max_draft)
    if args.trials < 1:
        raise CommandError("--trials must be >= 1")
    if args.concurrency is not None:
        return run_concurrency(args, max_draft)
    names = _names(args.contents or ",".join(DEFAULT_CONTENTS), BENCH_CONTENTS, "--contents")
    modes = _names(args.modes or "lookup", [m for m in available_modes() if m not in ("auto",)], "--modes")
    try:
        with Engine(args.model, max_draft=max_draft, kv_bits=args.kv_bits, dtype=args.dtype,
                    split=args.split) as engine:
            if follows(engine):
                return 0
            if max_draft == "auto" and not args.no_tune:
                _tune(engine)
            contents = build_contents(engine, args, names)
            report = run_benchmark(engine, contents, modes=modes, max_draft=max_draft, trials=args.trials,
                                   progress=progress)
    finally:
        end_progress()
    _write_json(args, report)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    m = report["machine"]
    print(f"model {report['model']['model']} ({report['model']['dtype']}); {m['os']}, {m['device_name']}, "
          f"MLX {m['mlx']}; load {report['load_average']['start']} -> {report['load_average']['end']}; "
          f"max draft {args.max_draft}, {args.trials} trials, medians")
    print(format_bench_table(report))
    return 0


def _write_json(args: argparse.Namespace, report: dict) -> None:
    if args.json_file:
        path = Path(args.json_file).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def _tune(engine) -> None:
    """The verify cost curve and the batch cost surface, cached or measured now (once per
    machine and model)."""
    progress("verify cost curve: cached or measuring (once per machine and model)")
    engine.call(_tune_here, engine.kv_bits)


def _tune_here(target, kv_bits) -> None:
    """On every rank of a split model (their forwards go together); the leader shows progress."""
    from engine import tune, tune_batch

    def shown(what: str):
        return lambda step, i, n: progress(f"measuring {what}: {step} ({i}/{n})") if target.ranks.leader else None

    tune(target, kv_bits, on_progress=shown("verify cost curve"))
    tune_batch(target, kv_bits, on_progress=shown("batch cost surface"))


def run_concurrency(args: argparse.Namespace, max_draft) -> int:
    """`--concurrency`: N requests at once against the same N one at a time (engine/bench/concurrency_bench.py)."""
    from engine import Engine, available_modes, describe_platform, surface_for
    from engine.bench.benchmark import _load_average
    from engine.bench.concurrency_bench import CONCURRENT_CONTENTS, format_rows, row_line
    from engine.bench.concurrency_bench import run_concurrency as run_levels
    from engine.base.platform import device_name
    from engine.drafting.modes import resolve_mode

    levels = _ints(args.concurrency, "--concurrency")
    if not levels or min(levels) < 1:
        raise CommandError("--concurrency needs request counts >= 1, e.g. 1,2,4,8")
    names = _names(args.contents or ",".join(CONCURRENCY_CONTENTS), CONCURRENT_CONTENTS, "--contents")
    modes = _names(args.modes or "auto", available_modes(), "--modes")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise CommandError("--max-tokens must be >= 1")
    t0 = time.perf_counter()
    try:
        with Engine(args.model, max_draft=max_draft, kv_bits=args.kv_bits, dtype=args.dtype,
                    prefix_cache=False, split=args.split) as engine:
            if follows(engine):
                return 0
            if max_draft == "auto" and not args.no_tune:
                _tune(engine)
            machine = engine.inspect(lambda t: {**describe_platform(), "device_name": device_name()})
            surface = engine.call(surface_for, engine.kv_bits).describe()
            load_start = _load_average()
            rows = []
            for mode in modes:
                resolved = engine.inspect(lambda t: resolve_mode(mode, t))
                on_row = (lambda r: None) if args.json else (lambda r: print(f"[{resolved}] {row_line(r)}", flush=True))
                for row in run_levels(engine, names, levels, trials=args.trials, mode=mode, max_draft=max_draft,
                                      max_tokens=args.max_tokens, progress=progress, on_row=on_row):
                    rows.append({"mode": resolved, **row})
            report = {"machine": machine, "model": engine.info(),
                      "settings": {"concurrency": levels, "contents": names, "modes": modes, "max_draft": max_draft,
                                   "trials": args.trials, "max_tokens": args.max_tokens, "dtype": args.dtype},
                      "batch_surface": surface, "concurrency": rows, "load_average": {"start": load_start, "end": _load_average()},
                      "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        end_progress()
    _write_json(args, report)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    m, load = report["machine"], report["load_average"]
    print(f"model {report['model']['model']} ({report['model']['dtype']}); {m['os']}, {m['device_name']}, "
          f"MLX {m['mlx']}; load {load['start']} -> {load['end']}; max draft {args.max_draft}, "
          f"{args.trials} trials, medians; ratio = together / one at a time, aggregate tokens/s")
    sf = report["batch_surface"]
    print(f"batch cost surface {'measured ' + sf['measured_at'] if sf['measured'] else 'not measured (defaults)'}: "
          f"verify forwards up to {sf['max_batched_width']} tokens wide batched; --max-batch auto would be "
          f"{sf['max_batch']}")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        print(f"\nmode {mode}")
        print(format_rows([r for r in rows if r["mode"] == mode]))
    return 0
