"""Speed measured side by side with plain mlx-lm, in one process.

For each content and trial the peer (mlx-lm's own `generate_step`, same model, same
dtype, same sampler) and each mode through the Engine run in alternating order;
the report holds medians of end-to-end and decode tokens/s, the speedup against
mlx-lm, tokens committed per target forward, time to first token, and whether the
output was token-for-token identical. `agent` contents replay successive turns of
one conversation and report time to first token per turn against the cold first.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine.base.events import Done, Tokens
from engine.base.loop_guard import DEGENERATE_SHARE, repeated_share
from engine.base.platform import describe_platform, device_name
from engine.base.sampling import SamplingParams
from engine.bench.parting import describe as describe_parting, where_parted
from engine.engine import GenerationRequest, engine_stream
from engine.kernels.cpu_attention import disabled
from engine.tuning.cost_curve import curve_for_requests

CONTENTS = ("chat", "code", "math", "refactor", "edit", "agent", "long")
DEFAULT_CONTENTS = ("chat", "code", "math", "refactor", "edit", "agent")  # `long` takes minutes per trial
LONG_DEPTHS = (16384, 32768)

CHAT_PROMPT = "Explain in a few sentences why unit tests are worth writing."
CODE_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."
MATH_PROMPT = "What is 17 * 24? Work it out step by step."


@dataclass
class Content:
    name: str
    prompts: list[list[int]]  # one prompt; for `agent`, successive turns of one conversation
    max_tokens: int
    kind: str = "decode"  # "decode": peer against modes; "agent": time to first token per turn
    note: str = ""


@dataclass
class Sample:
    tokens: list[int]
    seconds: float  # submit to last token
    ttft_s: float
    decode_tok_s: float  # tokens after the first batch / time after it
    tokens_per_forward: float
    cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    marks: list[tuple[int, float]] = field(default_factory=list)  # (tokens so far, seconds since submit), as they came

    @property
    def tok_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    def seconds_to(self, n: int) -> float:
        """Seconds from submit until the first n tokens had come."""
        return next((t for count, t in self.marks if count >= n), self.seconds)


def shared_speedup(ours: Sample, peer: Sample, n: int) -> float | None:
    """How much sooner ours had the first n tokens than the peer: where two outputs part at n, the
    speed ratio over the text both wrote, the same work on both sides (None for n = 0)."""
    ours_s, peer_s = ours.seconds_to(n), peer.seconds_to(n)
    return round(peer_s / ours_s, 3) if n > 0 and ours_s > 0 else None


# -- contents --------------------------------------------------------------------------


def _chat(engine, user: str, system: str | None = None, history: list[dict] | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + (history or [])
    return engine.render_chat(messages + [{"role": "user", "content": user}])


def refactor_source() -> tuple[str, str, str, str]:
    """(path, code, old, new): a real standard-library module and an identifier to rename."""
    import fnmatch

    return "fnmatch.py", inspect.getsource(fnmatch), "translate", "glob_to_regex"


def edit_source() -> tuple[str, str, str]:
    """(path, code, instruction): a real module and a one-line change described in words."""
    import colorsys

    return "colorsys.py", inspect.getsource(colorsys), "write TWO_THIRD as 2/3 instead of 2.0/3.0"


def _copy_budget(engine, code: str) -> int:
    """Enough tokens to re-emit `code` in a fence, with room for a short preamble."""
    return int(len(engine.encode(code)) * 1.15) + 48


def build_content(engine, name: str, long_depth: int | None = None, tag: str = "") -> Content:
    """A content by name (all but `agent`, which needs a recorded session). A `tag` leads the
    user's message: the same task as a distinct request (the concurrency benchmark's)."""
    import prompts

    system = prompts.load("system").strip()
    user = lambda text: f"{tag}\n{text}" if tag else text  # noqa: E731
    if name == "chat":
        return Content(name, [_chat(engine, user(CHAT_PROMPT))], 200)
    if name == "code":
        return Content(name, [_chat(engine, user(CODE_PROMPT))], 200)
    if name == "math":
        return Content(name, [_chat(engine, user(MATH_PROMPT))], 200)
    if name == "refactor":
        path, code, old, new = refactor_source()
        task = prompts.render("rename_symbol", path=path, old=old, new=new, code=code)
        return Content(name, [_chat(engine, user(task), system)], _copy_budget(engine, code),
                       note=f"rename {old} -> {new} in {path} ({code.count(chr(10))} lines)")
    if name == "edit":
        path, code, instruction = edit_source()
        task = prompts.render("edit_file", path=path, instruction=instruction, code=code)
        return Content(name, [_chat(engine, user(task), system)], _copy_budget(engine, code),
                       note=f"{instruction} in {path} ({code.count(chr(10))} lines)")
    if name == "long":
        return build_long(engine, long_depth or LONG_DEPTHS[0])
    raise ValueError(f"unknown content {name!r}; choose from {', '.join(CONTENTS)}")


def build_long(engine, depth: int, max_tokens: int = 128) -> Content:
    """A rename request after about `depth` tokens of real code read earlier in the chat."""
    import prompts

    path, code, old, new = refactor_source()
    task = prompts.render("rename_symbol", path=path, old=old, new=new, code=code)
    filler_budget = depth - len(_chat(engine, task, prompts.load("system").strip())) - 64
    filler = _stdlib_text(engine, max(filler_budget, 0))
    history = [
        {"role": "user", "content": "Here is code from the project, for context:\n\n" + filler},
        {"role": "assistant", "content": "Read it."},
    ]
    ids = _chat(engine, task, prompts.load("system").strip(), history)
    limit = min(engine.context_window - 1 - max_tokens, len(ids))
    ids = ids[-limit:] if len(ids) > limit else ids
    return Content(f"long-{round(depth / 1024)}k", [ids], max_tokens, note=f"{len(ids)} tokens of context")


def _stdlib_text(engine, tokens: int) -> str:
    """Real source text of standard-library modules, about `tokens` tokens of it."""
    import importlib

    parts, have = [], 0
    for mod in ("argparse", "textwrap", "shlex", "glob", "heapq", "bisect", "calendar", "difflib",
                "inspect", "typing", "dataclasses", "pathlib", "tarfile", "zipfile", "logging"):
        if have >= tokens:
            break
        try:
            src = inspect.getsource(importlib.import_module(mod))
        except (OSError, ImportError, TypeError):
            continue
        n = len(engine.encode(src))
        if have + n > tokens:
            src = src[: int(len(src) * (tokens - have) / n)]
            n = tokens - have
        parts.append(f"# {mod}.py\n{src}")
        have += n
    return "\n".join(parts)


def run_nonce() -> str:
    """A string unique to this run: prompts that start with it are cold in every cache."""
    return uuid.uuid4().hex[:12]


# -- one run ------------------------------------------------------------------------------


def plain_mlx_lm(target, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> Sample:
    """The peer: mlx-lm's generate_step on the same model. Runs on the engine thread."""
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    eos = target.eos_token_ids
    out: list[int] = []
    marks: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    t_first = None

    steps = generate_step(
        mx.array(prompt, dtype=mx.uint32), target.model, max_tokens=max_tokens,
        sampler=sampling.mlx_lm_sampler(), stream=engine_stream(),
    )
    try:
        with disabled():  # the peer is plain mlx-lm: MLX's own attention kernel
            for token, _ in steps:
                if t_first is None:
                    t_first = time.perf_counter()
                token = int(token)
                if token in eos:
                    break
                out.append(token)
                marks.append((len(out), time.perf_counter() - t0))
                if len(out) >= max_tokens:
                    break
    finally:
        steps.close()
        mx.synchronize()  # its one-step-ahead work must not leak into the next run's time
    t_end = time.perf_counter()
    t_first = t_first or t_end
    rest = max(len(out) - 1, 0)
    return Sample(out, t_end - t0, t_first - t0, rest / (t_end - t_first) if rest else 0.0, 1.0, marks=marks)


def engine_run(engine, prompt: list[int], max_tokens: int, sampling: SamplingParams,
               mode: str, max_draft) -> Sample:
    """One generation through the Engine, timed as its caller sees it."""
    request = GenerationRequest(prompt, max_tokens=max_tokens, sampling=sampling, mode=mode,
                                max_draft=max_draft)
    t0 = time.perf_counter()
    done, count, marks = None, 0, []
    for event in engine.generate(request):
        if isinstance(event, Tokens) and event.token_ids:
            count += len(event.token_ids)
            marks.append((count, time.perf_counter() - t0))
        elif isinstance(event, Done):
            done = event
    seconds = time.perf_counter() - t0
    n_first, ttft = marks[0] if marks else (0, seconds)
    rest = len(done.token_ids) - n_first
    s = done.stats
    return Sample(
        list(done.token_ids), seconds, ttft, rest / (seconds - ttft) if rest > 0 else 0.0,
        s.mean_accepted, cached_tokens=s.cached_tokens,
        extra={"rounds": s.rounds, "drafted": s.drafted_tokens, "accepted": s.accepted_tokens,
               "acceptance_rate": round(s.acceptance_rate, 4), "engine_ttft_s": round(s.ttft_s, 4),
               "note": s.note},
        marks=marks,
    )


# -- the benchmark ----------------------------------------------------------------------------


def _median(samples: list[Sample], attr: str) -> float:
    return statistics.median(getattr(s, attr) for s in samples)


def summarize(samples: list[Sample]) -> dict:
    return {
        "tok_s": round(_median(samples, "tok_s"), 2),
        "decode_tok_s": round(_median(samples, "decode_tok_s"), 2),
        "ttft_s": round(_median(samples, "ttft_s"), 4),
        "tokens_per_forward": round(_median(samples, "tokens_per_forward"), 3),
        "generated_tokens": int(statistics.median(len(s.tokens) for s in samples)),
        # the output's fingerprint: other runs of the same content (another machine, a split model)
        # compare by it
        "output_sha256": hashlib.sha256(repr(samples[0].tokens).encode()).hexdigest()[:16] if samples else None,
        "samples": [
            {"tok_s": round(s.tok_s, 2), "decode_tok_s": round(s.decode_tok_s, 2),
             "ttft_s": round(s.ttft_s, 4), "seconds": round(s.seconds, 4), "tokens": len(s.tokens),
             "tokens_per_forward": round(s.tokens_per_forward, 3), "cached_tokens": s.cached_tokens,
             **s.extra}
            for s in samples
        ],
    }


@contextlib.contextmanager
def without_prefix_cache(engine):
    """Decode contents compare cold prompts: the peer has no cache, and a repeated trial
    must not start warm. (The `agent` content measures the cache.)"""
    engine.pause_prefix_cache(True)
    try:
        yield
    finally:
        engine.pause_prefix_cache(False)


def bench_decode(engine, content: Content, modes: list[str], max_draft, trials: int,
                 sampling: SamplingParams, progress: Callable[[str], None]) -> dict:
    with without_prefix_cache(engine):
        return _bench_decode(engine, content, modes, max_draft, trials, sampling, progress)


def _bench_decode(engine, content: Content, modes: list[str], max_draft, trials: int,
                  sampling: SamplingParams, progress: Callable[[str], None]) -> dict:
    prompt = content.prompts[0]
    runs: dict[str, list[Sample]] = {"mlx-lm": [], **{m: [] for m in modes}}
    order = ["mlx-lm", *modes]
    for trial in range(trials):
        # Alternate who goes first, so warm-up and thermal drift don't favour one side.
        for who in order if trial % 2 == 0 else order[::-1]:
            progress(f"{content.name}: trial {trial + 1}/{trials}, {who}")
            if who == "mlx-lm":
                s = engine.call(plain_mlx_lm, prompt, content.max_tokens, sampling)  # every rank's forwards
            else:
                s = engine_run(engine, prompt, content.max_tokens, sampling, who, max_draft)
            runs[who].append(s)
    peer = summarize(runs["mlx-lm"])
    reference = [s.tokens for s in runs["mlx-lm"]]
    # A reply that is mostly one n-gram repeated makes any drafter look fast (it copies the
    # loop): such rows are flagged, and headline figures leave them out.
    share = repeated_share(reference[0])
    result = {"kind": "decode", "prompt_tokens": len(prompt), "max_tokens": content.max_tokens,
              "note": content.note, "repeated_share": round(share, 3),
              "degenerate": share >= DEGENERATE_SHARE, "mlx_lm": peer, "modes": {}}
    for mode in modes:
        m = summarize(runs[mode])
        m["speedup"] = round(m["tok_s"] / peer["tok_s"], 3) if peer["tok_s"] else None
        m["decode_speedup"] = round(m["decode_tok_s"] / peer["decode_tok_s"], 3) if peer["decode_tok_s"] else None
        m["identical"] = all(s.tokens == ref for s, ref in zip(runs[mode], reference))
        if not m["identical"] and sampling.greedy:  # where, and whether the target itself was undecided there
            ours, theirs = next((s, p) for s, p in zip(runs[mode], runs["mlx-lm"]) if s.tokens != p.tokens)
            progress(f"{content.name}: {mode} parted from mlx-lm; finding where")
            parted = engine.call(where_parted, prompt, theirs.tokens, ours.tokens)
            # past the parting the two sides write different texts: the ratio over what both wrote
            parted["shared_speedup"] = shared_speedup(ours, theirs, parted["at"])
            m["parted"] = parted
        # Each trial's pair ran back to back: their ratio is less exposed to a busy machine's drift.
        m["paired_speedup"] = round(statistics.median(
            s.tok_s / p.tok_s for s, p in zip(runs[mode], runs["mlx-lm"]) if p.tok_s), 3)
        result["modes"][mode] = m
    return result


def bench_agent(engine, content: Content, mode: str, max_draft, sampling: SamplingParams,
                progress: Callable[[str], None]) -> dict:
    """Time to first token of each turn, in order; the first is cold (its prompt is unique)."""
    turns = []
    for i, prompt in enumerate(content.prompts):
        progress(f"{content.name}: turn {i + 1}/{len(content.prompts)} ({len(prompt)} tokens)")
        s = engine_run(engine, prompt, content.max_tokens, sampling, mode, max_draft)
        turns.append({"turn": i + 1, "prompt_tokens": len(prompt), "cached_tokens": s.cached_tokens,
                      "ttft_s": round(s.ttft_s, 4)})
    cold = turns[0]["ttft_s"]
    for t in turns:
        # Later prompts are a little longer than the first: scale cold prefill by length.
        cold_here = cold * t["prompt_tokens"] / turns[0]["prompt_tokens"]
        t["fraction_of_cold"] = round(t["ttft_s"] / cold_here, 4) if cold_here else None
    later = [t["fraction_of_cold"] for t in turns[1:]]
    return {"kind": "agent", "mode": mode, "note": content.note, "cold_ttft_s": cold, "turns": turns,
            "later_turns_max_fraction": max(later) if later else None}


def run_benchmark(
    engine,
    contents: list[Content],
    modes: list[str] = ("lookup",),
    max_draft="auto",
    trials: int = 3,
    sampling: SamplingParams | None = None,
    progress: Callable[[str], None] = lambda msg: None,
) -> dict:
    """Every figure, as a dict (the CLI prints it as a table or JSON)."""
    sampling = sampling or SamplingParams()
    t0 = time.perf_counter()
    report = {
        "machine": engine.inspect(lambda target: {**describe_platform(), "device_name": device_name(),
                                                  "load_average": _load_average()}),
        "model": engine.info(),
        "settings": {"modes": list(modes), "max_draft": max_draft, "trials": trials,
                     "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                  "top_k": sampling.top_k, "seed": sampling.seed}},
        "contents": {},
    }
    curve = engine.call(curve_for_requests, engine.kv_bits)
    report["cost_curve"] = {"measured": curve.measured, "measured_at": curve.measured_at,
                            **{f"cost_at_{d}": {str(w): round(curve.relative(w, d), 3)
                                                for w in (2, 4, 8, 16, 32, 64)} for d in curve.depths}}
    for content in contents:
        longest = max(len(p) for p in content.prompts)
        if longest + 1 >= engine.context_window:
            progress(f"{content.name}: skipped, {longest} prompt tokens exceed the context window")
            report["contents"][content.name] = {
                "kind": "skipped", "note": content.note,
                "reason": f"{longest}-token prompt >= the {engine.context_window}-token context window"}
        elif content.kind == "agent":
            report["contents"][content.name] = bench_agent(
                engine, content, modes[0], max_draft, sampling, progress)
        else:
            report["contents"][content.name] = bench_decode(
                engine, content, list(modes), max_draft, trials, sampling, progress)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["load_average"] = {"start": report["machine"].get("load_average"), "end": _load_average()}
    return report


def _load_average() -> list[float] | None:
    """1/5/15-minute load: how busy the machine was (other processes skew timings)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def format_table(report: dict) -> str:
    """The report as a readable text table."""
    head = ("content", "prompt", "tokens", "mlx-lm tok/s", "(decode)", "ttft s", "mode", "tok/s", "(decode)",
            "ttft s", "speedup", "(decode)", "tok/fwd", "identical", "looped")
    rows = []
    for name, r in report["contents"].items():
        if r["kind"] == "skipped":
            rows.append((name, *[""] * 12, "skipped: " + r["reason"], ""))
            continue
        if r["kind"] == "agent":
            for t in r["turns"]:
                rows.append((f"{name} turn {t['turn']}", str(t["prompt_tokens"]), "", "", "", "", r["mode"], "", "",
                             f"{t['ttft_s']:.3f}", "", "", "", f"ttft {t['fraction_of_cold']:.1%} of cold", ""))
            continue
        peer = r["mlx_lm"]
        for mode, m in r["modes"].items():
            rows.append((name, str(r["prompt_tokens"]), str(m["generated_tokens"]), f"{peer['tok_s']:.1f}",
                         f"{peer['decode_tok_s']:.1f}", f"{peer['ttft_s']:.3f}", mode, f"{m['tok_s']:.1f}",
                         f"{m['decode_tok_s']:.1f}", f"{m['ttft_s']:.3f}", f"{m['speedup']:.2f}x",
                         f"{m['decode_speedup']:.2f}x", f"{m['tokens_per_forward']:.2f}",
                         "yes" if m["identical"] else describe_parting(m.get("parted")),
                         f"{r['repeated_share']:.0%}" + (" degenerate" if r["degenerate"] else "")))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i in (0, 6, 13, 14) else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    return "\n".join(o.rstrip() for o in out)
