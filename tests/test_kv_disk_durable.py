"""The disk tier loses nothing it acknowledged: segments are written as they are made (a
background writer), a SIGTERM'd server flushes before it ends, a `kill -9` mid-write costs only
what was not yet written, and a disk that fills up or turns read-only costs one warning.
Every output is compared token for token with a cache-less engine (tiny random model)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine import Engine, GenerationRequest
from test_prefix_cache import rand_tokens

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("disk_child.py")


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), prefix_cache=False)
    yield engine
    engine.close()


def out(engine: Engine, prompt: list[int], n: int = 8):
    done = engine.submit(GenerationRequest(prompt, max_tokens=n)).result()
    return done.token_ids, done.stats.cached_tokens


def session(n_turns: int, first: int = 300, step: int = 120, seed: int = 0) -> list[list[int]]:
    """An agent's prompts: each the last one plus new tokens."""
    prompts = [rand_tokens(first, seed)]
    for t in range(1, n_turns):
        prompts.append(prompts[-1] + rand_tokens(step, seed + 100 + t))
    return prompts


def files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.rglob("*.safetensors") if not p.name.startswith(".tmp-"))


def run_child(cfg: dict, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(CHILD), json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **popen)


@pytest.mark.parametrize("writers", [1, 3])
def test_segments_reach_disk_as_they_are_made(tiny_model_dir, plain, tmp_path, monkeypatch, writers):
    """(3 writer threads: what a machine of 12 cores or more uses, files finished out of order.)"""
    from engine.caches import kv_disk_writer

    monkeypatch.setattr(kv_disk_writer, "default_writer_threads", lambda: writers)
    prompts = session(6, first=300, step=60)
    e = Engine(str(tiny_model_dir), prefix_cache_dir=tmp_path)
    try:
        for p in prompts:
            out(e, p)
        assert e.flush_disk(timeout=30)
        # still running, never closed: a second process would find every turn on disk
        assert len(files(tmp_path)) >= 6
        with Engine(str(tiny_model_dir), prefix_cache_dir=tmp_path) as other:
            got, cached = out(other, prompts[-1] + [7, 8])
            assert got == out(plain, prompts[-1] + [7, 8])[0]
            assert cached == len(prompts[-1])
    finally:
        e.close()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _serve(model: Path, cache_dir: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "agent_bridge", "serve", "--model", str(model), "--port", str(port),
           "--prefix-cache-dir", str(cache_dir), "--no-mcp", "--log-level", "warning", "--max-draft", "8"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MLX_DSPARK_NO_REEXEC": "1"})
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("serve did not start")


def _complete(port: int, prompt: list[int]) -> tuple[str, int]:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_signal_then_restart_is_warm(tiny_model_dir, plain, tmp_path, sig):
    prompts = session(2, first=400, seed=7)
    port = _free_port()
    proc = _serve(tiny_model_dir, tmp_path, port)
    try:
        for p in prompts:
            _complete(port, p)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert files(tmp_path)
    port = _free_port()
    proc = _serve(tiny_model_dir, tmp_path, port)
    try:
        final = prompts[-1] + [5, 6, 7]
        text, cached = _complete(port, final)
        assert cached == len(prompts[-1])
        assert text == plain.decode(out(plain, final)[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_kill_9_while_writing_then_restart(tiny_model_dir, plain, tmp_path):
    prompts = session(8, first=400, step=200, seed=11)  # files of ~100-200 KB, written while the next turn runs
    child = run_child({"model": str(tiny_model_dir), "cache_dir": str(tmp_path), "prompts": prompts,
                       "max_tokens": 4, "close": False})
    try:
        for _ in range(5):
            line = child.stdout.readline()
            assert line, child.stderr.read()
        child.send_signal(signal.SIGKILL)  # turn 6 is being prefilled, turn 5's file being written
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    written = files(tmp_path)
    assert written, "nothing was written before the kill"
    # and what a kill in the middle of a write leaves: a torn temp file, a torn final file
    folder = written[0].parent
    (folder / ".tmp-0123456789abcdef.safetensors").write_bytes(written[-1].read_bytes()[:1000])
    newest = max(written, key=lambda p: p.stat().st_mtime_ns)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with Engine(str(tiny_model_dir), prefix_cache_dir=tmp_path) as e:
        seen = []
        for p in prompts:
            got, cached = out(e, p + [3, 4])
            assert got == out(plain, p + [3, 4])[0]
            seen.append(cached)
        assert e.cache_stats()["disk_skipped"] >= 1  # the torn file
    # turn 1's file was written long before the kill: the first prompt comes from disk
    assert seen[0] >= len(prompts[0])


def test_full_disk_one_warning_serving_goes_on(tiny_model_dir, tmp_path):
    prompts = session(4, first=300, seed=21)
    child = run_child({"model": str(tiny_model_dir), "cache_dir": str(tmp_path), "prompts": prompts,
                       "max_tokens": 6, "plain": True, "fsize": 64 * 1024})  # no file over 64 KB
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    lines = [json.loads(x) for x in stdout.splitlines()]
    for rec in lines[:-1]:
        assert rec["tokens"] == rec["plain"]
    assert [rec["cached"] for rec in lines[1:-1]] == [len(p) for p in prompts[:-1]]  # RAM goes on
    warnings = [m for m in lines[-1]["warnings"] if "prefix cache" in m]
    assert len(warnings) == 1 and "disk tier is off" in warnings[0]


# A preloaded OpenBLAS starts threads in every process, and a threaded process can't enter a user namespace
NO_PRELOAD = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _read_only(cmd: list[str], folder: Path) -> list[str]:
    """cmd run with `folder` read-only (a read-only bind mount in a user namespace when we are root)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return cmd
    probe = subprocess.run(["unshare", "-r", "-m", "true"], capture_output=True, text=True, env=NO_PRELOAD)
    if probe.returncode != 0:
        pytest.skip(f"running as root without user namespaces ({probe.stderr.strip()}): no way to make a folder read-only")
    script = (f'mount --bind "{folder}" "{folder}" && mount -o remount,ro,bind "{folder}" && exec "$@"')
    return ["unshare", "-r", "-m", "sh", "-c", script, "sh", *cmd]


@pytest.mark.parametrize("populated", [True, False])
def test_read_only_folder_one_warning_serving_goes_on(tiny_model_dir, plain, tmp_path, populated):
    prompts = session(3, first=300, seed=31)
    if populated:  # files from an earlier run stay readable
        with Engine(str(tiny_model_dir), prefix_cache_dir=tmp_path) as e:
            out(e, prompts[0])
    cfg = {"model": str(tiny_model_dir), "cache_dir": str(tmp_path), "prompts": prompts, "max_tokens": 6,
           "plain": True}
    cmd = _read_only([sys.executable, str(CHILD), json.dumps(cfg)], tmp_path)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=NO_PRELOAD)
    finally:
        tmp_path.chmod(0o755)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(x) for x in run.stdout.splitlines()]
    for rec in lines[:-1]:
        assert rec["tokens"] == rec["plain"]
    assert lines[0]["cached"] == (len(prompts[0]) - 1 if populated else 0)
    assert [rec["cached"] for rec in lines[1:-1]] == [len(p) for p in prompts[:-1]]
    warnings = [m for m in lines[-1]["warnings"] if "prefix cache" in m]
    assert len(warnings) == 1, warnings


def test_checkpoint_models_get_a_disk_tier(tmp_path_factory, tmp_path):
    """Sliding-window (and recurrent) models keep whole-state checkpoints: those go to disk too."""
    from tiny_models import build_tiny_model

    d = build_tiny_model(tmp_path_factory.mktemp("tiny-swa-disk"), arch="llama", seed=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    (d / "config.json").write_text(json.dumps(cfg))
    prompt = rand_tokens(200, 120)
    with Engine(str(d), prefix_cache=False) as ref:
        e = Engine(str(d), prefix_cache_dir=tmp_path)
        try:
            assert e.cache_stats()["kind"] == "checkpoint"
            first, _ = out(e, prompt)
            assert first == out(ref, prompt)[0]
            assert e.flush_disk(timeout=30)  # written as stored, not at close
            assert files(tmp_path)
            turn2 = prompt + first + rand_tokens(30, 121)
            with Engine(str(d), prefix_cache_dir=tmp_path) as restarted:  # another process's view
                got, cached = out(restarted, turn2)
                assert got == out(ref, turn2)[0]
                assert cached >= len(prompt)
                # the checkpoint of the sliding layer's state, and the full-attention layer's
                # per-token segments it rests on (one file per turn's segment)
                stats = restarted.cache_stats()
                assert stats["disk_loads"] >= 2 and stats["disk_skipped"] == 0
                # a torn checkpoint is skipped, never used
                for f in files(tmp_path):
                    f.write_bytes(f.read_bytes()[:-50])
            with Engine(str(d), prefix_cache_dir=tmp_path) as torn:
                got, cached = out(torn, turn2)
                assert got == out(ref, turn2)[0] and cached == 0
                assert torn.cache_stats()["disk_skipped"] >= 1
        finally:
            e.close()


def _children_named(word: bytes) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and word in cmd:
            out.append(int(d))
    return out


def _ended(pid: int) -> bool:
    """Exited: a zombie not yet reaped, or gone (the client reaped it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the server's pid through /proc")
def test_mcp_stdio_sigterm_keeps_the_cache(tiny_model_dir, tmp_path):
    import asyncio

    from mcp import Client, StdioServerParameters

    from test_mcp_stdio import mlx_dspark

    cache = tmp_path / "cache"
    params = StdioServerParameters(command=mlx_dspark(), env={**os.environ},
                                   args=["mcp", "--model", str(tiny_model_dir), "--root", str(tmp_path),
                                         "--prefix-cache-dir", str(cache)])
    ended = {}

    async def go():
        try:
            async with Client(params, read_timeout_seconds=600) as client:
                gen = await client.call_tool("generate", {"prompt": "def add(a, b):\n    return", "max_tokens": 8})
                assert not gen.is_error
                pids = _children_named(b"mcp")
                ended["pids"] = pids
                (pid,) = pids
                os.kill(pid, signal.SIGTERM)
                deadline = time.time() + 60
                while time.time() < deadline and not _ended(pid):
                    await asyncio.sleep(0.1)
                ended["ended"] = _ended(pid)
        except Exception as e:  # the client notices its server is gone
            ended.setdefault("error", repr(e))

    asyncio.run(go())
    assert ended.get("ended"), f"the mcp server did not end on SIGTERM: {ended}"
    assert files(cache)
