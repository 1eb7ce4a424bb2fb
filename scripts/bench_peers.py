r"""The same work against the servers users would pick instead, in one run on this machine (issue 30, item 4).

    .venv/bin/python scripts/bench_peers.py [--llama-server PATH --gguf PATH] [--upstream-python PATH]
        [--fixture rename-session] [--max-tokens 400] [--decode-repeats 1] [--work-dir DIR] [--json OUT.json]
    .venv/bin/python scripts/bench_peers.py --setup [--peers-dir /tmp/peers]   # builds the peers (recipe below)

Four servers on the bundled reference model (engine/reference_model, a 12.6M qwen3) in float32 on the
CPU, started one at a time, each given one warm-up request that is not counted:

- ours: `python -m agent_bridge serve` with default flags and a fresh `--prefix-cache-dir`;
- `mlx_lm.server` from this .venv, on a float32 copy of the checkpoint (scripts/replay_agent.py's);
- upstream `mlx-dspark` 0.20.3 from PyPI in its own venv (`--upstream-python`), `serve --mode lookup`
  (its drafter-free prompt-lookup speculation), on the same float32 copy;
- llama.cpp's `llama-server` (`--llama-server`) on an f32 GGUF of the same checkpoint (`--gguf`), with
  n-gram speculation (`--spec-type ngram-simple`), one slot (`-np 1`), its other flags default.

A peer whose path is not given (or not there) is skipped with a line saying so. The three MLX servers
run with OpenBLAS preloaded, as the project's other scripts run them; llama-server without.

Work, the same text to every server through its OpenAI-compatible `/v1/completions` (the prompt rendered
once with the model's chat template, as `serve` renders it, so that every server reads the same tokens):

- decode: a copy-heavy refactor, the project's `rename_symbol` prompt (prompts/, as the benchmark's
  `--contents refactor` builds it, system prompt included) on a file held out of the model's training:
  this Python's standard-library `sched.py`, `Event` renamed to `ScheduledEvent`. 400 tokens greedy
  (temperature 0), not streamed, sent twice: the second is timed (its prompt is then in every server's
  prefix cache), tokens/s = the response's `usage.completion_tokens` / the request's wall time
  (`--decode-repeats K`: K timed sends after the first, their median and range; one send of 400
  tokens takes well under a second here, so single figures move by 10-20% from run to run). Each
  output text is compared with ours (greedy on the same float32 weights should mostly match; a
  difference is reported, not failed on). For llama-server the prompts' tokenization (its /tokenize)
  is compared with ours too.
- agent session: ../shared/fixtures/claude-code/<fixture>.jsonl (a recorded Claude Code rename session)
  rendered as scripts/replay_agent.py renders it, raw text to /v1/completions, max_tokens 1, streamed:
  time to first token per turn; turn 1 is cold, later turns extend it (warm). On each server the
  session runs first (right after the warm-up), then the decode.

Printed: a markdown table (server, decode tok/s, ours' decode over each, output equal to ours, cold turn,
warm turns range), versions, load averages, and the issue's aims against llama-server (ours' decode at
least 1.3x its, our cold turn at most 0.5x its). `--json OUT` writes every figure. A full run took
4-5 minutes on a 2-core x86 CPU (2026-12-04; mlx_lm.server's and upstream's cold 15k-token turn
70-80 s each there, twice that on a slower host of the same kind).

Setup (what `--setup` runs: bash, with PEERS=--peers-dir and REPO=this checkout; about 20-30 minutes on
2 cores, mostly the llama.cpp build; needs PyPI, and cmake and a C++ compiler, which it apt-installs if
missing). llama.cpp is the one vendored in llama-cpp-python's sdist. The GGUF converter pins torch 2.11.0
from download.pytorch.org's CPU index; where that index can't be reached, set TORCH_SPEC and an empty
TORCH_INDEX (e.g. `TORCH_SPEC=torch==2.13.0+cpu TORCH_INDEX=`, a wheel pip finds locally). Its
pre-tokenizer check doesn't know the bundled tokenizer (a BPE with llama-3's split regex, digits in
groups of 3): the recipe patches a copy of the converter to map that tokenizer's hash to `llama-bpe`.

# --- setup recipe ---
set -euo pipefail
PEERS=${PEERS:-/tmp/peers}; REPO=${REPO:?}; LCP=${LLAMA_CPP_PYTHON:-0.3.36}
mkdir -p "$PEERS"; cd "$PEERS"
# 1. upstream mlx-dspark 0.20.3, its own venv
[ -x upstream-venv/bin/python ] || python3 -m venv upstream-venv
upstream-venv/bin/pip install "mlx-dspark==0.20.3" "mlx[cpu]"
# 2. llama-server from the llama.cpp that llama-cpp-python's sdist vendors
command -v cmake >/dev/null && command -v g++ >/dev/null || \
    { apt-get update && apt-get install -y cmake build-essential; }
[ -f sdist/llama_cpp_python-$LCP.tar.gz ] || \
    "$REPO/.venv/bin/pip" download --no-binary :all: --no-deps "llama-cpp-python==$LCP" -d sdist
[ -d llama_cpp_python-$LCP ] || tar xzf sdist/llama_cpp_python-$LCP.tar.gz
LLC=$PEERS/llama_cpp_python-$LCP/vendor/llama.cpp
cmake -S "$LLC" -B llama-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build llama-build --config Release --target llama-server -j2
# 3. the bundled model as an f32 GGUF, with the vendored converter (its requirements, torch apart)
[ -x convert-venv/bin/python ] || python3 -m venv convert-venv
convert-venv/bin/pip install -r "$LLC/requirements/requirements-convert_legacy_llama.txt"
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
convert-venv/bin/pip install "${TORCH_SPEC:-torch==2.11.0}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
rm -rf converter && mkdir converter && cp -r "$LLC/convert_hf_to_gguf.py" "$LLC/conversion" "$LLC/gguf-py" converter/
convert-venv/bin/python - <<'EOF'
from pathlib import Path
p = Path("converter/conversion/base.py")
s = p.read_text()
old = "        res = None\n\n        # NOTE: if you get an error here"
new = ("        res = None\n"
       "        if chkhsh == \"edaee1008c82004734e0364c7cf612c65d2829334fb7fab9bd97a12e6352f7fd\":\n"
       "            # mlx-dspark's bundled reference model: llama-3's split regex (digits in groups of 3)\n"
       "            res = \"llama-bpe\"\n\n"
       "        # NOTE: if you get an error here")
assert s.count(old) == 1, "the converter changed: patch get_vocab_base_pre by hand"
p.write_text(s.replace(old, new))
EOF
convert-venv/bin/python converter/convert_hf_to_gguf.py "$REPO/engine/reference_model" --outtype f32 \
    --outfile reference-f32.gguf
echo "peers: --llama-server $PEERS/llama-build/bin/llama-server --gguf $PEERS/reference-f32.gguf" \
     "--upstream-python $PEERS/upstream-venv/bin/python"
# --- end of setup recipe ---
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replay_agent as ra  # noqa: E402  (its rendering, float32 copy, ports, env, load average)

ROOT = ra.ROOT
RENAME = ("sched.py", "Event", "ScheduledEvent")  # a held-out file (CPython's standard library) and a rename
REFERENCE = "ours"


# -- the work ---------------------------------------------------------------------------------------------


def decode_prompt(model: str) -> tuple[str, str]:
    """The refactor as `--contents refactor` builds it (system prompt, rename_symbol), on sched.py."""
    import sched

    import prompts
    from mlx_lm.utils import load_tokenizer

    path, old, new = RENAME
    code = Path(sched.__file__).read_text(encoding="utf-8")
    task = prompts.render("rename_symbol", path=path, old=old, new=new, code=code)
    messages = [{"role": "system", "content": prompts.load("system").strip()}, {"role": "user", "content": task}]
    tok = load_tokenizer(Path(model))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, f"rename {old} -> {new} in {path} ({code.count(chr(10))} lines, {sched.__file__})"


class Peer(ra.Server):
    """A server as replay_agent.py starts it (its own session: signals reach the whole group; ready once
    /health says 200; one warm-up request), with a peer's environment and folder (a peer runs outside
    this checkout, whose mlx_dspark.egg-info it would see), and a completion and llama's /tokenize."""

    def complete(self, prompt: str, max_tokens: int) -> dict:
        """One greedy completion, not streamed: its text, token count and wall time."""
        body = {"model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": False}
        t0 = time.perf_counter()
        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=7200)
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        data = r.json()
        choice = (data.get("choices") or [{}])[0]
        usage = data.get("usage") or {}
        return {"text": choice.get("text") or "", "finish_reason": choice.get("finish_reason"),
                "completion_tokens": usage.get("completion_tokens"), "seconds": seconds}

    def tokenize(self, text: str) -> list[int] | None:
        """llama-server's own tokenization of `text` (special tokens parsed, none added), else None."""
        try:
            r = httpx.post(f"http://127.0.0.1:{self.port}/tokenize",
                           json={"content": text, "add_special": False, "parse_special": True}, timeout=600)
            r.raise_for_status()
            return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]
        except (httpx.HTTPError, KeyError, ValueError):
            return None


def first_difference(a: list, b: list) -> int | None:
    """Index of the first difference of two sequences (the shorter's length if one is the other's
    prefix), None if equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def measure(peer: Peer, session: list[str], decode: str, max_tokens: int, tok, check_tokens: bool,
            repeats: int = 1) -> dict:
    """Start, warm up, the agent session's turns, the decode 1 + `repeats` times; then stop."""
    print(f"\n== {peer.name}: {' '.join(peer.cmd)}  (load {ra.load_avg()})", flush=True)
    out: dict = {"cmd": peer.cmd, "endpoint": "/v1/completions", "load_start": ra.load_avg()}
    out["start_s"] = peer.start()  # (its warm-up request not counted)
    try:
        if check_tokens:
            out["tokenization"] = {}
            for label, text in (("decode prompt", decode), ("session turn 1", session[0]),
                                (f"session turn {len(session)}", session[-1])):
                theirs = peer.tokenize(text)
                ours = tok.encode(text, add_special_tokens=False)
                diff = None if theirs is None else first_difference(ours, theirs)
                out["tokenization"][label] = {"tokens_ours": len(ours), "tokens_theirs": theirs and len(theirs),
                                              "same": theirs is not None and diff is None, "first_difference": diff}
                same = "?" if theirs is None else "same" if diff is None else f"differs at token {diff}"
                print(f"  tokenization of the {label} ({len(ours)} tokens): {same}", flush=True)
        out["session"] = ra.replay(peer, session, "session")  # turn 1 cold
        runs = [peer.complete(decode, max_tokens) for _ in range(1 + repeats)]  # the first not timed
        for run in runs:
            run["tokens"] = run["completion_tokens"] or len(tok.encode(run["text"], add_special_tokens=False))
            run["tok_s"] = run["tokens"] / run["seconds"]
        out["decode_runs"] = runs
        timed = sorted(runs[1:], key=lambda run: run["tok_s"])[(len(runs) - 2) // 2]  # the median (lower)
        rates = [run["tok_s"] for run in runs[1:]]
        out["decode"] = {"tokens": timed["tokens"], "seconds": timed["seconds"], "tok_s": timed["tok_s"],
                         "tok_s_min": min(rates), "tok_s_max": max(rates), "timed_sends": len(rates),
                         "text": timed["text"], "finish_reason": timed["finish_reason"],
                         "first_send_s": runs[0]["seconds"],
                         "repeat_same_text": all(run["text"] == timed["text"] for run in runs)}
        spread = f" (median of {len(rates)}: {min(rates):.1f}-{max(rates):.1f})" if len(rates) > 1 else ""
        print(f"  decode: {timed['tokens']} tokens in {timed['seconds']:.2f} s = {timed['tok_s']:.1f} tok/s{spread} "
              f"(first send {runs[0]['seconds']:.2f} s)  (load {ra.load_avg()})", flush=True)
    finally:
        peer.stop()
    out["load_end"] = ra.load_avg()
    return out


# -- the peers --------------------------------------------------------------------------------------------


def mlx_env() -> dict:
    return ra.server_env()  # OpenBLAS preloaded, no re-exec, offline


def plain_env() -> dict:
    env = ra.server_env()
    env.pop("LD_PRELOAD", None)
    env.pop("OPENBLAS_THREAD_TIMEOUT", None)
    return env


def llama_versions(binary: Path) -> dict:
    """`llama-server --version`, and the llama-cpp-python sdist its source came from (via CMakeCache)."""
    info: dict = {}
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
        info["version"] = " ".join((r.stdout + r.stderr).split("\n")[0:1]).strip()
        m = re.search(r"version: (\S+) \((\w+)\)", r.stdout + r.stderr)
        if m:
            info["build"], info["commit"] = m.group(1), m.group(2)
    except (OSError, subprocess.SubprocessError) as e:
        info["version"] = f"? ({e})"
    for up in binary.resolve().parents:
        cache = up / "CMakeCache.txt"
        if cache.exists():
            m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", cache.read_text(), re.M)
            if m:
                src = Path(m.group(1))
                info["source"] = str(src)
                pkg = src.parent.parent / "PKG-INFO"
                if pkg.exists():
                    v = re.search(r"^Version: (.*)$", pkg.read_text(), re.M)
                    info["llama_cpp_python"] = v.group(1).strip() if v else None
                try:
                    info["commit_full"] = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"],
                                                         capture_output=True, text=True).stdout.strip() or None
                except OSError:
                    pass
            break
    return info


def python_versions(python: str, names: tuple[str, ...]) -> dict:
    code = ("import importlib.metadata as m, json\nout = {}\nfor n in %r:\n    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\nprint(json.dumps(out))") % (names,)
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {n: None for n in names}


def peers(args, work: Path, f32: Path) -> list[Peer]:
    """The servers to run, ours first; a missing peer is skipped with a line saying so."""
    out = []
    port = ra.free_port()
    cache_dir = work / "prefix-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    out.append(Peer(REFERENCE, [sys.executable, "-m", "agent_bridge", "serve", "--model", args.model, "--port",
                                str(port), "--prefix-cache-dir", str(cache_dir), "--log-level", "warning"],
                    port, work / "serve.log", mlx_env()))
    if args.llama_server and args.gguf and Path(args.llama_server).exists() and Path(args.gguf).exists():
        port = ra.free_port()
        out.append(Peer("llama-server", [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port",
                                         str(port), "-np", "1", "--spec-type", "ngram-simple", *args.llama_arg],
                        port, work / "llama_server.log", plain_env(), work))
    else:
        print(f"skipped llama-server: --llama-server {args.llama_server} / --gguf {args.gguf} not both given "
              f"and present", flush=True)
    if args.upstream_python and Path(args.upstream_python).exists():
        port = ra.free_port()
        out.append(Peer("mlx-dspark 0.20.3", [args.upstream_python, "-m", "mlx_dspark", "serve", "--mode", "lookup",
                                              "--model", str(f32), "--host", "127.0.0.1", "--port", str(port)],
                        port, work / "upstream.log", mlx_env(), work))
    else:
        print(f"skipped upstream mlx-dspark: --upstream-python {args.upstream_python} not given or absent",
              flush=True)
    if not args.no_mlx_lm:
        port = ra.free_port()
        out.append(Peer("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", str(f32), "--port",
                                          str(port), "--log-level", "WARNING"], port, work / "mlx_lm_server.log",
                        mlx_env(), work))
    else:
        print("skipped mlx_lm.server: --no-mlx-lm", flush=True)
    return out


# -- the report -------------------------------------------------------------------------------------------


def compare_texts(results: dict, tok) -> None:
    """Each server's decode text against ours: equal, or where (in our tokens) it first differs."""
    ref = results.get(REFERENCE, {}).get("decode")
    for name, r in results.items():
        d = r.get("decode")
        if not d or not ref:
            continue
        if d["text"] == ref["text"]:
            d["same_as_ours"], d["same_tokens"] = True, None
            continue
        a = tok.encode(ref["text"], add_special_tokens=False)
        b = tok.encode(d["text"], add_special_tokens=False)
        d["same_as_ours"] = False
        d["same_tokens"] = first_difference(a, b)  # leading tokens (ours' tokenization) in common
        d["same_chars"] = first_difference(list(ref["text"]), list(d["text"]))
        # one output a prefix of the other (a server that stops a token early or late): same as far as both go
        d["prefix_of_ours" if ref["text"].startswith(d["text"]) else "extends_ours"] = \
            ref["text"].startswith(d["text"]) or d["text"].startswith(ref["text"])


def fmt(x: float | None, f: str = ".1f") -> str:
    return "-" if x is None else f"{x:{f}}"


def table(results: dict) -> str:
    ours = results.get(REFERENCE, {})
    ours_tok_s = (ours.get("decode") or {}).get("tok_s")
    rows = ["| server | decode tok/s | ours / it | text = ours | cold turn s | warm turns s |",
            "|---|---|---|---|---|---|"]
    for name, r in results.items():
        d, s = r.get("decode") or {}, r.get("session") or []
        ratio = f"{ours_tok_s / d['tok_s']:.2f}x" if d.get("tok_s") and ours_tok_s else "-"
        if name == REFERENCE:
            same = "(ref)"
        elif "same_as_ours" not in d:
            same = "-"
        else:
            same = "yes" if d["same_as_ours"] else f"first {d['same_tokens']} tokens"
            if d.get("extends_ours"):
                same = f"yes, then {len(d['text']) - len(results[REFERENCE]['decode']['text'])} chars more"
            elif d.get("prefix_of_ours"):
                same = f"yes, {len(results[REFERENCE]['decode']['text']) - len(d['text'])} chars short"
        warm = [t["ttft_s"] for t in s[1:]]
        warm_s = f"{min(warm):.2f}-{max(warm):.2f}" if warm else "-"
        rate = fmt(d.get("tok_s"))
        if d.get("timed_sends", 1) > 1:
            rate += f" ({d['tok_s_min']:.0f}-{d['tok_s_max']:.0f})"
        rows.append(f"| {name} | {rate} | {ratio} | {same} | {fmt(s[0]['ttft_s'] if s else None)} "
                    f"| {warm_s} |")
    return "\n".join(rows)


def aims(results: dict) -> list[str]:
    """The issue's aims against llama-server: decode >= 1.3x its, cold turn <= 0.5x its."""
    ours, llama = results.get(REFERENCE), results.get("llama-server")
    if not ours or not llama:
        return ["aims: llama-server not run"]
    out = []
    r = ours["decode"]["tok_s"] / llama["decode"]["tok_s"]
    out.append(f"aim: ours' decode >= 1.3x llama-server's: {r:.2f}x -> {'met' if r >= 1.3 else 'NOT met'}")
    c = ours["session"][0]["ttft_s"] / llama["session"][0]["ttft_s"]
    out.append(f"aim: our cold turn <= 0.5x llama-server's: {c:.2f}x -> {'met' if c <= 0.5 else 'NOT met'}")
    return out


def setup(args) -> int:
    doc = __doc__ or ""
    recipe = doc.split("# --- setup recipe ---", 1)[1].split("# --- end of setup recipe ---", 1)[0]
    env = {**os.environ, "PEERS": str(Path(args.peers_dir).resolve()), "REPO": str(ROOT)}
    print(f"setup in {env['PEERS']}:\n{recipe}", flush=True)
    return subprocess.run(["bash", "-c", recipe], env=env).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--llama-server", default=None, help="the built llama-server binary")
    ap.add_argument("--gguf", default=None, help="the bundled model as an f32 GGUF (for llama-server)")
    ap.add_argument("--upstream-python", default=None, help="python of a venv with mlx-dspark 0.20.3 from PyPI")
    ap.add_argument("--llama-arg", action="append", default=[], help="an extra argument for llama-server (repeat)")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx_lm.server")
    ap.add_argument("--model", default=None, help="model directory (default: the bundled reference model)")
    ap.add_argument("--fixture", default="rename-session",
                    help="a name under ../shared/fixtures/claude-code, or a .jsonl path")
    ap.add_argument("--max-tokens", type=int, default=400, help="decode length (greedy)")
    ap.add_argument("--decode-repeats", type=int, default=1,
                    help="timed decode sends after the first, untimed one; the median is reported (default 1)")
    ap.add_argument("--work-dir", default=None, help="logs, the float32 copy, the cache folder (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    ap.add_argument("--setup", action="store_true", help="build the peers (the docstring's recipe) and exit")
    ap.add_argument("--peers-dir", default="/tmp/peers", help="where --setup builds")
    args = ap.parse_args()
    if args.setup:
        return setup(args)

    if args.model is None:
        from engine.base.bundled import default_model_path

        args.model = str(default_model_path())
    fixture = Path(args.fixture) if args.fixture.endswith(".jsonl") else \
        ra.fixtures_root() / "claude-code" / f"{args.fixture}.jsonl"
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    load_start = ra.load_avg()
    print(f"work dir {work}; model {args.model}; load average {load_start}", flush=True)

    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(args.model))
    session = ra.render_prompts(args.model, fixture) if fixture.exists() else []
    if not session:
        print(f"skipped the agent session: {fixture} not found", flush=True)
    decode, decode_note = decode_prompt(args.model)
    session_tokens = [len(tok.encode(p, add_special_tokens=False)) for p in session]
    decode_tokens = len(tok.encode(decode, add_special_tokens=False))
    print(f"decode: {decode_note}, prompt {decode_tokens} tokens, {args.max_tokens} tokens greedy\n"
          f"session: {fixture.name}, {len(session)} turns, {session_tokens} tokens", flush=True)
    f32 = ra.float32_copy(args.model, work / "model-float32")

    versions = {"ours": {"commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                                  text=True).stdout.strip(),
                         **python_versions(sys.executable, ("mlx", "mlx-lm"))},
                "python": sys.version.split()[0]}
    if args.upstream_python and Path(args.upstream_python).exists():
        versions["upstream"] = python_versions(args.upstream_python, ("mlx-dspark", "mlx", "mlx-lm"))
    if args.llama_server and Path(args.llama_server).exists():
        versions["llama-server"] = llama_versions(Path(args.llama_server))
    print(f"versions: {json.dumps(versions)}", flush=True)

    results: dict = {}
    t0 = time.perf_counter()
    for peer in peers(args, work, f32):
        try:
            results[peer.name] = measure(peer, session, decode, args.max_tokens, tok,
                                         check_tokens=peer.name == "llama-server", repeats=args.decode_repeats)
        except Exception as e:  # noqa: BLE001 - one peer failing shouldn't lose the others' figures
            print(f"  {peer.name} failed: {e!r}", flush=True)
            results[peer.name] = {"error": repr(e)}
    compare_texts(results, tok)
    for name, r in results.items():
        d = r.get("decode") or {}
        if name != REFERENCE and d.get("same_as_ours") is False:
            c, ref = d["same_chars"], results[REFERENCE]["decode"]["text"]
            if d.get("extends_ours") or d.get("prefix_of_ours"):
                print(f"{name}'s decode text equals ours as far as both go ({len(d['text'])} characters against "
                      f"ours' {len(ref)}; {d['tokens']} tokens by its count)", flush=True)
                continue
            print(f"{name}'s decode text differs from ours after {d['same_tokens']} tokens (character {c}): "
                  f"ours ...{ref[max(c - 40, 0):c + 40]!r}, theirs ...{d['text'][max(c - 40, 0):c + 40]!r}",
                  flush=True)

    summary = {"work_dir": str(work), "model": args.model, "fixture": str(fixture), "session_tokens": session_tokens,
               "decode_prompt": decode_note, "decode_prompt_tokens": decode_tokens, "max_tokens": args.max_tokens,
               "versions": versions, "load_start": load_start, "load_end": ra.load_avg(),
               "wall_s": time.perf_counter() - t0, "results": results}
    timing = "the second of two sends timed" if args.decode_repeats == 1 else \
        f"the median of {args.decode_repeats} timed sends after an untimed one"
    print(f"\n{decode_note}: {args.max_tokens} tokens greedy, {timing}; "
          f"{fixture.name}: {len(session)} turns, {session_tokens[0] if session else '-'}-"
          f"{session_tokens[-1] if session else '-'} tokens; all through /v1/completions "
          f"(load average {load_start} -> {summary['load_end']}, {summary['wall_s'] / 60:.1f} min)\n")
    print(table(results))
    summary["aims"] = aims(results)
    print("\n" + "\n".join(summary["aims"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
