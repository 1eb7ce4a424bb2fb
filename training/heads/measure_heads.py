"""Measure the reference model's heads against plain mlx-lm decoding on CPU.

    python training/heads/measure_heads.py [--trials 2] [--max-tokens 160] [--json OUT]

Contents: the benchmark's chat, code and math prompts (engine/bench/benchmark.py) and a
`continue_file` task on a standard-library module. Each is decoded greedily and sampled
(temperature 0.8, fixed seeds) by the Engine in `baseline` (mlx-lm's generate_step: the
peer), `lookup`, `dflash`, `dspark`, and the heads alone (`*-only`: the long-lookup-match
override off). Reported: decode tok/s and speedup over baseline (medians over trials),
tokens per target forward, acceptance rate by draft position.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine.drafting.heads.drafter as head_drafter  # noqa: E402
from engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from engine.bench.benchmark import CHAT_PROMPT, CODE_PROMPT, MATH_PROMPT  # noqa: E402


def contents(engine) -> dict[str, list[int]]:
    import inspect
    import textwrap

    import prompts

    system = prompts.load("system").strip()
    src = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))[:1200]
    chat = lambda u: engine.render_chat([{"role": "system", "content": system}, {"role": "user", "content": u}])  # noqa: E731
    return {
        "chat": chat(CHAT_PROMPT),
        "code": chat(CODE_PROMPT),
        "math": chat(MATH_PROMPT),
        "continue": chat(prompts.render("continue_file", path="textwrap.py", code=src)),
    }


def run(engine, ids, mode, sampling, max_tokens):
    only = mode.endswith("-only")
    head_drafter.LOOKUP_OVERRIDE = 1 << 30 if only else 8  # off for the heads alone
    done = list(engine.generate(GenerationRequest(ids, max_tokens=max_tokens, mode=mode.removesuffix("-only"),
                                                  sampling=sampling)))[-1]
    head_drafter.LOOKUP_OVERRIDE = 8
    return done


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--modes", default="lookup,dflash,dspark,dflash-only,dspark-only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = ["baseline", *args.modes.split(",")]
    report = {}
    with Engine(prefix_cache=False) as engine:
        for name, ids in contents(engine).items():
            for label, temp in (("greedy", 0.0), ("t0.8", 0.8)):
                rows = {}
                for m in modes:
                    runs = [run(engine, ids, m, SamplingParams(temperature=temp, seed=100 + t), args.max_tokens)
                            for t in range(args.trials)]
                    s = [d.stats for d in runs]
                    drafted = [sum(x) for x in zip(*[st.drafted_by_position[:8] + [0] * (8 - len(st.drafted_by_position[:8])) for st in s])]
                    accepted = [sum(x) for x in zip(*[st.accepted_by_position[:8] + [0] * (8 - len(st.accepted_by_position[:8])) for st in s])]
                    rows[m] = {
                        "decode_tok_s": round(statistics.median(st.decode_tok_s for st in s), 1),
                        "tokens_per_forward": round(sum(st.generated_tokens for st in s) / max(1, sum(st.rounds for st in s)), 2),
                        "acceptance_by_position": [round(a / d, 2) if d else None for a, d in zip(accepted, drafted)],
                        "tokens": [st.generated_tokens for st in s],
                    }
                base = rows["baseline"]["decode_tok_s"]
                for m in modes:
                    rows[m]["speedup"] = round(rows[m]["decode_tok_s"] / base, 2) if base else None
                report[f"{name}/{label}"] = rows
                print(f"{name}/{label} ({len(ids)} prompt tokens)", flush=True)
                for m, r in rows.items():
                    print(f"  {m:12s} {r['decode_tok_s']:7.1f} tok/s  x{r['speedup']:<5} {r['tokens_per_forward']:5.2f}/fwd  "
                          f"acc {r['acceptance_by_position']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
