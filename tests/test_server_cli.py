"""`mlx-dspark serve` as a user runs it: a subprocess on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from server_harness import free_port

REPO = Path(__file__).resolve().parents[1]


def test_serve_command(tiny_model_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "agent_bridge.cli", "serve", "--model", str(tiny_model_dir),
                             "--port", str(port), "--api-key", "k", "--root", str(tmp_path),
                             "--log-level", "warning"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, MLX_DSPARK_NO_REEXEC="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        headers = {"x-api-key": "k"}
        r = httpx.post(url + "/v1/messages", headers=headers, timeout=60,
                       json={"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3
        assert httpx.post(url + "/v1/messages", json={}).status_code == 401
        # MCP is mounted at /mcp (and behind the same key)
        assert httpx.post(url + "/mcp", json={}).status_code == 401
        assert httpx.post(url + "/mcp", headers=headers, json={}).status_code != 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_serve_rejects_bad_port():
    p = subprocess.run([sys.executable, "-m", "agent_bridge.cli", "serve", "--port", "70000"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, MLX_DSPARK_NO_REEXEC="1"))
    assert p.returncode == 2 and "--port must be 1-65535" in p.stderr
