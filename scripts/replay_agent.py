"""Side-by-side replay of recorded agent sessions: `mlx_lm.server` against `mlx-dspark serve`.

    .venv/bin/python scripts/replay_agent.py [--fixtures rename-session,long-session] [--model DIR]
        [--context-window N] [--no-restarts] [--no-peer] [--json OUT.json]

Each request of ../shared/fixtures/claude-code/<name>.jsonl is rendered once, as `serve` renders it
(the model's chat template, ChatML for the bundled model), and the same text goes to both servers'
/v1/completions (streaming, max_tokens 1, greedy). Both servers are started here, one at a time, on
the same model: on a CPU in float32 (a float32 copy is made for mlx_lm.server) with OpenBLAS
preloaded; on a GPU the checkpoint as it is, on both sides. Each server gets one warm-up request
first (a GPU compiles its kernels on first use), longer than a prefill chunk, not counted, by
the client its turns then use (one per server, its connection kept where the server keeps it:
`serve` does, mlx_lm.server's HTTP/1.0 closes it); turns are TURN_GAP_S apart, as an agent's
are at least (the constant says why). Printed
per turn: prompt tokens and each server's time to first token; then the total waiting, and for
`serve` the last turn again after a `kill -9` and restart, and after a SIGTERM and restart (a fresh
cache folder at the start). Fixtures that are absent are skipped.

Split over ranks (issue 32): `--ranks 2 [--split tensor|pipeline] [--delay-ms 5]` starts both
servers as that many ring ranks on localhost (engine/bench/shaped_link.py, which adds the
latency between them): `mlx_lm.server` with its own sharded loading, `serve` with `--split`.
A stop or restart signals every rank, as a launcher or a terminal would.

Another model size without a download: `scripts/make_random_model.py DIR` writes a qwen3 of about
4.5x the bundled model's parameters with random weights and the bundled tokenizer; then
`--model DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
START_TIMEOUT_S = 600
# Each server's first request, not counted, sharing no prefix with the sessions: ~5,300 tokens
# (the bundled tokenizer's count), more than a prefill chunk on either side (mlx_lm.server's 2048,
# ours at most 4096), so a GPU compiles its prefill kernels here, not in the first measured turn
# (after "Say hello.", a fresh H200's mlx_lm.server took 48.7 s for long-session's first turn).
WARM_UP = "Say hello after counting: " + " ".join(str(i) for i in range(1700))
# After a restart, a short one: the long one's KV would come back from the disk tier first and
# move the read rate the tier decides by, before the restored turn that is measured.
RESTART_WARM_UP = "Say hello."
# Between turns, not counted: an agent's next request follows its own work (the reply parsed, tools
# run), and a request sent the moment a stream ends could beat a server's own end of that turn
# (mlx_lm.server 0.32 ends the stream before it stores the turn's cache). On an H100 its
# rename-session turn 3 recomputes with the gap as without it (1.1-1.9 s against 0.2-0.4 s for
# turns 2 and 4; docs/benchmarks.md): that is not the race, and its cause is not known.
TURN_GAP_S = 0.5


def fixtures_root() -> Path:
    """../shared/fixtures from the repository root (a worktree one level deeper looks one up too)."""
    for up in (ROOT.parent, ROOT.parent.parent):
        if (up / "shared/fixtures").is_dir():
            return up / "shared/fixtures"
    return ROOT.parent / "shared/fixtures"


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def server_env() -> dict:
    from engine.base.platform import BLAS_THREAD_TIMEOUT, find_openblas  # here: engine/__init__ loads MLX

    env = {**os.environ, "MLX_DSPARK_NO_REEXEC": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    lib = find_openblas()
    if lib:  # as `mlx-dspark`'s re-exec preloads it (engine/base/platform.py)
        env["LD_PRELOAD"] = lib
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
    return env


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def render_prompts(model: str, fixture: Path) -> list[str]:
    """Each request's prompt text, as `serve` renders it (system messages folded where needed)."""
    from mlx_lm.utils import load_tokenizer

    from agent_bridge.apis.anthropic_api import parse_request
    from agent_bridge.chat.chat_request import fold_system_messages

    tok = load_tokenizer(Path(model))
    texts = []
    for line in fixture.read_text().splitlines():
        if not line.strip():
            continue
        req = parse_request(json.loads(line)["body"], 4096)
        kwargs = dict(tools=req.tools or None, add_generation_prompt=True, tokenize=False, **req.template_kwargs)
        try:
            text = tok.apply_chat_template(req.messages, **kwargs)
        except Exception:
            text = tok.apply_chat_template(fold_system_messages(req.messages), **kwargs)
        texts.append(text + req.assistant_prefix)
    return texts


def float32_copy(model: str, out: Path) -> Path:
    """The model's weights in float32 for mlx_lm.server (which serves a checkpoint's own dtype)."""
    if not out.exists():
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", model, "--mlx-path", str(out),
                        "--dtype", "float32"], check=True, env=server_env(), stdout=subprocess.DEVNULL)
    return out


def group_alive(pgid: int) -> bool:
    """Is any process of this process group (a server, or a launcher and its ranks) still running?"""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    out = subprocess.run(["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    return any(not stat.startswith("Z") for stat in out)  # zombies are gone, awaiting their parent's wait


def as_ranks(cmd: list[str], args) -> list[str]:
    """`cmd` run as `args.ranks` ring ranks on localhost, `args.delay_ms` apart (one: as it is)."""
    if args.ranks <= 1:
        return cmd
    return [sys.executable, "-m", "engine.bench.shaped_link", "-n", str(args.ranks), "--delay-ms", str(args.delay_ms),
            "--", *cmd]


class Server:
    """A server process and, split over ranks, its launcher's: signals go to the whole group."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict | None = None,
                 cwd: Path = ROOT):
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self.env, self.cwd = env or server_env(), cwd
        self.proc: subprocess.Popen | None = None
        # One client, its connection kept alive between turns where the server keeps it, as an
        # agent's is. A client made per request charged every turn, on both sides, its set-up
        # (~50 ms on a 2-core CPU: httpx loads the CA bundle).
        self.client = httpx.Client(timeout=7200)

    def start(self, warm_up: str = WARM_UP) -> float:
        """Seconds until /health says 200; then one warm-up request, not counted."""
        t0 = time.perf_counter()
        f = open(self.log, "a")
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start; see {self.log}")
            try:
                ready = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                ready = False
            if not ready:  # (llama-server answers 503 while it loads)
                time.sleep(0.25)
                continue
            started = time.perf_counter() - t0
            self.ttft(warm_up)  # not counted: a GPU compiles its kernels on first use
            return started
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"{self.name} did not start in {START_TIMEOUT_S} s; see {self.log}")

    def stop(self, sig: int = signal.SIGTERM) -> float:
        t0 = time.perf_counter()
        if self.proc is not None:
            if sig == signal.SIGKILL:
                os.killpg(self.proc.pid, sig)  # every rank at once, as a crash of the machine would
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)  # a launcher passes it on to its ranks
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and group_alive(self.proc.pid):
                time.sleep(0.05)
            if group_alive(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        self.client.close()  # its connection died with the server: a restart's client connects anew
        self.client = httpx.Client(timeout=7200)
        return time.perf_counter() - t0

    def wait_written(self, timeout: float = 120) -> float:
        """Seconds until the prefix cache's disk writes are done (its /v1/cache says none pending)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            stats = httpx.get(f"http://127.0.0.1:{self.port}/v1/cache", timeout=10).json()
            if not (stats.get("stats") or stats).get("disk_pending_bytes"):
                break
            time.sleep(0.1)
        return time.perf_counter() - t0

    def restored(self, prompt: str) -> dict:
        """The last turn on a restarted server: its time to first token, and what its disk tier read."""
        row = self.ttft(prompt)
        stats = httpx.get(f"http://127.0.0.1:{self.port}/v1/cache", timeout=30).json()
        stats = stats.get("stats") or stats
        row.update({k: stats.get(k) for k in ("disk_restored_bytes", "disk_restore_s", "disk_restore_gb_per_s",
                                              "prefill_tokens_per_s", "disk_declined_tokens")})
        return row

    def ttft(self, prompt: str) -> dict:
        """Seconds from sending the request to its first streamed token."""
        body = {"model": "default_model", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True}
        t0 = time.perf_counter()
        first, stats = None, {}
        with self.client.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                choice = (data.get("choices") or [{}])[0]
                if first is None and (choice.get("text") or choice.get("finish_reason")):
                    first = time.perf_counter() - t0
                stats = data.get("mlx_dspark") or stats
                if (data.get("timings") or {}).get("cache_n") is not None:  # llama-server (scripts/bench_peers.py)
                    stats = {"cached_tokens": data["timings"]["cache_n"]}
        return {"ttft_s": first if first is not None else time.perf_counter() - t0,
                "cached_tokens": stats.get("cached_tokens"), "prompt_tokens": stats.get("prompt_tokens")}


def replay(server: Server, prompts: list[str], label: str, peer: bool = False) -> list[dict | None]:
    """Each turn's time to first token. A peer that fails a turn (mlx_lm.server out of GPU memory
    on a long session's 38k-token turn, answering 404 after its generation thread died) ends its
    replay there: its remaining turns are None and ours still run."""
    rows: list[dict | None] = []
    for i, p in enumerate(prompts, 1):
        if i > 1:
            time.sleep(TURN_GAP_S)
        try:
            row = server.ttft(p)
        except httpx.HTTPError as e:
            if not peer:
                raise
            print(f"  {label} turn {i}: failed ({e}); its later turns skipped, see {server.log}", flush=True)
            return rows + [None] * (len(prompts) - len(rows))
        rows.append(row)
        cached = "" if row["cached_tokens"] is None else f", {row['cached_tokens']} cached"
        print(f"  {label} turn {i}: {row['ttft_s']:.2f} s{cached}  (load {load_avg()})", flush=True)
    return rows


def replay_peer(prompts: list[str], args, work: Path) -> list[dict]:
    port = free_port()
    pipeline = ["--pipeline"] if args.ranks > 1 and args.split == "pipeline" else []
    peer = Server("mlx_lm.server", as_ranks([sys.executable, "-m", "mlx_lm", "server", "--model", str(args.peer_model),
                                             "--port", str(port), "--log-level", "WARNING", *pipeline], args),
                  port, work / "mlx_lm_server.log")
    peer.start()
    try:
        return replay(peer, prompts, "mlx_lm.server", peer=True)
    finally:
        peer.stop()


def session_window(model: str, n_tokens: list[int], given: int | None) -> int | None:
    """The context window `serve` starts with: the one given; else, where the session's longest
    prompt overruns the model's own (its config's max_position_embeddings, which `serve` enforces
    and mlx_lm.server does not: long-session's 38k tokens against the bundled model's 32,768), the
    next multiple of 4,096 that holds it; else None (serve's default)."""
    from engine.model.config import read_config  # here: engine/__init__ loads MLX

    if given:
        return given
    own = (read_config(Path(model)) or {}).get("max_position_embeddings")
    longest = max(n_tokens) + 1  # and the one token each turn asks for
    return -(-longest // 4096) * 4096 if isinstance(own, int) and longest > own else None


def run_fixture(name: str, path: Path, args, work: Path) -> dict:
    prompts = render_prompts(args.model, path)
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(args.model))
    n_tokens = [len(tok.encode(p, add_special_tokens=False)) for p in prompts]
    print(f"\n== {name}: {len(prompts)} turns, {n_tokens[0]}-{n_tokens[-1]} tokens (load {load_avg()})", flush=True)
    result = {"fixture": name, "tokens": n_tokens, "load_start": load_avg()}

    result["mlx_lm"] = None if args.no_peer else replay_peer(prompts, args, work)

    cache_dir = work / f"prefix-cache-{name}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    port = free_port()
    cmd = [sys.executable, "-m", "agent_bridge", "serve", "--model", args.model, "--port", str(port),
           "--prefix-cache-dir", str(cache_dir), "--log-level", "warning", *args.serve_args]
    window = session_window(args.model, n_tokens, args.context_window)
    if window:
        cmd += ["--context-window", str(window)]
    if args.ranks > 1:
        cmd += ["--split", args.split]
    ours = Server("mlx-dspark serve", as_ranks(cmd, args), port, work / "serve.log")
    ours.start()
    try:
        result["serve"] = replay(ours, prompts, "serve")
        if not args.no_restarts:
            ours.stop(signal.SIGKILL)  # right after the last turn: its newest segments may be unwritten
            ours.start(RESTART_WARM_UP)
            result["after_kill9"] = ours.restored(prompts[-1])
            print(f"  serve last turn after kill -9 + restart: {result['after_kill9']['ttft_s']:.2f} s", flush=True)
            # the same once the disk tier has caught up (a crash some seconds after the turn)
            result["written_s"] = ours.wait_written()
            ours.stop(signal.SIGKILL)
            ours.start(RESTART_WARM_UP)
            result["after_kill9_written"] = ours.restored(prompts[-1])
            print(f"  serve last turn after its writes ({result['written_s']:.1f} s), kill -9 + restart: "
                  f"{result['after_kill9_written']['ttft_s']:.2f} s", flush=True)
            result["sigterm_stop_s"] = ours.stop(signal.SIGTERM)
            ours.start(RESTART_WARM_UP)
            result["after_sigterm"] = ours.restored(prompts[-1])
            print(f"  serve last turn after SIGTERM + restart: {result['after_sigterm']['ttft_s']:.2f} s", flush=True)
    finally:
        ours.stop()
    result["load_end"] = load_avg()
    return result


def report(r: dict) -> None:
    ours = r["serve"]
    peer = r["mlx_lm"] or [None] * len(ours)  # None: --no-peer

    def vs(a: float | None, b: float, f: str = ".2f") -> str:
        return f"{a:{f}} s | {b:{f}} s | {b / a:.2f}x" if a is not None else f"- | {b:{f}} s | -"

    print(f"\n{r['fixture']} (load average {r['load_start']} -> {r['load_end']})")
    print(f"| turn | tokens | mlx_lm.server | serve | ratio |\n|---|---|---|---|---|")
    for i, (a, b) in enumerate(zip(peer, ours), 1):
        print(f"| {i}{', cold' if i == 1 else ''} | {r['tokens'][i - 1]} | {vs(a and a['ttft_s'], b['ttft_s'])} |")
    if r["mlx_lm"] and None in peer:  # it failed a turn: no totals to compare
        print(f"| total waiting | | mlx_lm.server failed at turn {peer.index(None) + 1} | {sum(x['ttft_s'] for x in ours):.1f} s | - |")
    elif r["mlx_lm"]:
        print(f"| total waiting | | {vs(sum(x['ttft_s'] for x in peer), sum(x['ttft_s'] for x in ours), '.1f')} |")
        if len(peer) > 1:
            print(f"| warm turns, worst | | {vs(max(x['ttft_s'] for x in peer[1:]), max(x['ttft_s'] for x in ours[1:]))} |")
    cold = ours[0]["ttft_s"]
    for key, label in (("after_kill9", "kill -9"), ("after_kill9_written", "its writes, kill -9"),
                       ("after_sigterm", "SIGTERM")):
        if key in r:
            t = r[key]["ttft_s"]
            gb, s = (r[key].get("disk_restored_bytes") or 0) / 1e9, r[key].get("disk_restore_s") or 0
            read = f", {gb:.2f} GB read in {s:.2f} s" if gb else ""
            print(f"| last turn after {label} + restart | | - | {t:.2f} s ({100 * t / cold:.1f}% of cold, "
                  f"{r[key]['cached_tokens']} cached{read}) | |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", default="rename-session,long-session",
                    help="comma-separated names under ../shared/fixtures/claude-code, or .jsonl paths")
    ap.add_argument("--model", default=None, help="model directory (default: the bundled reference model)")
    ap.add_argument("--context-window", type=int, default=None,
                    help="passed to serve (default: the model's own, or what holds a longer session)")
    ap.add_argument("--no-restarts", action="store_true", help="skip the kill -9 and SIGTERM restarts")
    ap.add_argument("--no-peer", action="store_true",
                    help="skip mlx_lm.server (restart figures only: they are ratios to serve's own cold turn)")
    ap.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                    help="an extra argument for serve (repeat)")
    ap.add_argument("--ranks", type=int, default=1, help="run both servers split over this many ranks on localhost")
    ap.add_argument("--split", choices=["tensor", "pipeline"], default="tensor", help="how, with --ranks")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="latency added between ranks, with --ranks")
    ap.add_argument("--work-dir", default=None, help="logs, the float32 copy and the cache folder (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    args = ap.parse_args()

    if args.model is None:
        from engine.base.bundled import default_model_path

        args.model = str(default_model_path())
    found = []
    for name in args.fixtures.split(","):
        name = name.strip()
        path = Path(name) if name.endswith(".jsonl") else fixtures_root() / "claude-code" / f"{name}.jsonl"
        if path.exists():
            found.append((path.stem, path))
        else:
            print(f"skipped {name}: {path} not found", flush=True)
    if not found:
        return 0
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="replay-agent-"))
    work.mkdir(parents=True, exist_ok=True)
    split = f"; {args.ranks} ranks, {args.split} split, {args.delay_ms:g} ms apart" if args.ranks > 1 else ""
    print(f"work dir {work}; model {args.model}{split}; load average {load_avg()}", flush=True)
    # the peer serves the same weights `serve` computes with: float32 on a CPU (serve's dtype
    # there), the checkpoint itself on a GPU
    import mlx.core as mx

    on_gpu = mx.default_device() == mx.gpu
    args.peer_model = args.model if on_gpu or args.no_peer else float32_copy(args.model, work / "model-float32")
    results = [run_fixture(name, path, args, work) for name, path in found]
    for r in results:
        report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
