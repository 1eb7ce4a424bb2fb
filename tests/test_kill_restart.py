"""`kill -9` of the server mid-generation (and while its disk tier is being written), then a
restart on the same cache folder: every output identical to a cold run (issue 13's fault
suite). Real `mlx-dspark serve` processes, real sockets, a tiny random model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_harness import free_port

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def add(a, b):\n    return a + b\n" * 8, "class Point:\n    x: int\n    y: int\n" * 8, "hello " * 40]


def start(model: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "MLX_DSPARK_NO_REEXEC": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "agent_bridge", "serve", "--model", str(model), "--port", str(port),
                             "--no-mcp", "--log-level", "warning", *flags],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def ask(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "m", "max_tokens": 48, "temperature": 0, "messages": [{"role": "user", "content": prompt}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_kill_9_mid_generation_then_restart_is_identical(tiny_model_dir, tmp_path):
    cold, url = start(tiny_model_dir, "--no-prefix-cache")
    try:
        expected = [ask(url, p) for p in PROMPTS]
    finally:
        cold.kill()
        cold.wait()

    cache = tmp_path / "kv"
    # a tiny RAM budget: every request evicts segments to the disk tier, so writes are under way
    flags = ("--prefix-cache-dir", str(cache), "--prefix-cache-max-ram-mb", "0.05")
    for kill_after in (0, 1, 2):
        proc, url = start(tiny_model_dir, *flags)
        try:
            for p in PROMPTS[:kill_after]:
                ask(url, p)
            with httpx.Client(base_url=url, timeout=60) as client:
                with client.stream("POST", "/v1/chat/completions", json={
                        "model": "m", "max_tokens": 2000, "temperature": 0, "stream": True,
                        "messages": [{"role": "user", "content": PROMPTS[kill_after] + " go on"}]}) as r:
                    for chunk in r.iter_text():
                        if '"content":"' in chunk:
                            os.kill(proc.pid, signal.SIGKILL)  # mid-generation
                            break
        except httpx.HTTPError:
            pass
        finally:
            proc.kill()
            proc.wait()
        restarted, url = start(tiny_model_dir, *flags)
        try:
            assert [ask(url, p) for p in PROMPTS] == expected, f"after a kill at request {kill_after}"
            assert [ask(url, p) for p in PROMPTS] == expected  # and again, warm
        finally:
            restarted.kill()
            restarted.wait()
