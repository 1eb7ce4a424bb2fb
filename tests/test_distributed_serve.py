"""`mlx-dspark serve` split over two ranks (issue 32): rank 0 serves HTTP, rank 1 follows. The
real `openai` client gets the reply one process gives; SIGTERM to every rank (what a launcher
or a terminal's Ctrl-C does) writes each rank's part of the prefix cache, so a restart of both
is warm; a rank killed makes `/health` say degraded and the next request fail with the reason.

The ranks are started by hand with the environment `mlx.launch --backend ring` gives them
(MLX_RANK, MLX_HOSTFILE): a launcher would stop rank 0 itself when rank 1 dies. Model: a tiny
random qwen3_moe split by pipeline (every layer computed whole, so the reply is one process's
exactly); it decides for itself, nothing scripted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from tests.tiny_models import FAMILIES, build_tiny_model
from server_harness import free_port

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def rename_symbol(path, old, new):\n    return path.replace(old, new)\n" * 6

pytestmark = pytest.mark.skipif(not mx.distributed.is_available(), reason="MLX distributed is absent")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("split-serve-moe"), arch="qwen3_moe", layers=4,
                            extra=FAMILIES["qwen3_moe"][1])


class Serve:
    """`serve` as `ranks` processes (ring ranks on localhost when 2); rank 0's HTTP at `url`."""

    def __init__(self, model: Path, work: Path, ranks: int, *flags: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "MLX_DSPARK_NO_REEXEC": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
               "MLX_DSPARK_CACHE_DIR": str(work / "measurements")}
        if ranks > 1:
            hosts = work / "hosts.json"
            hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
            env["MLX_HOSTFILE"] = str(hosts)
            flags = ("--split", "pipeline", *flags)
        cmd = [sys.executable, "-m", "agent_bridge", "serve", "--model", str(model), "--port", self.url.rsplit(":", 1)[1],
               "--no-mcp", "--log-level", "warning", *flags]
        self.logs = [work / f"rank{r}.log" for r in range(ranks)]
        self.procs = [subprocess.Popen(cmd, env={**env, "MLX_RANK": str(r)} if ranks > 1 else env, cwd=REPO,
                                       stdout=open(self.logs[r], "w"), stderr=subprocess.STDOUT)
                      for r in range(ranks)]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                self.kill()
                raise AssertionError(f"a rank exited at start:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.kill()
        raise AssertionError(f"serve did not start:\n{self.log()}")

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def log(self) -> str:
        return "\n".join(f"-- rank {r}:\n{path.read_text()[-2000:]}" for r, path in enumerate(self.logs))

    def terminate_all(self) -> list[int]:
        """SIGTERM to every rank at once; their exit codes (no hang: a timeout fails the test)."""
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        return [p.wait(timeout=90) for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def ask(server: Serve):
    return server.client().chat.completions.create(model="m", max_tokens=24, temperature=0,
                                                   messages=[{"role": "user", "content": PROMPT}])


def test_split_serve_replies_as_one_process_and_restarts_warm(moe_model, tmp_path):
    one = Serve(moe_model, tmp_path, 1, "--no-prefix-cache")
    try:
        want = ask(one).choices[0].message.content
    finally:
        one.kill()

    cache = tmp_path / "kv"
    split = Serve(moe_model, tmp_path, 2, "--prefix-cache-dir", str(cache))
    try:
        health = httpx.get(split.url + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["ranks"] == {"size": 2, "split": "pipeline"}
        first = ask(split)
        assert first.choices[0].message.content == want
        # rank 0 ends as uvicorn re-raises the signal; rank 1 by rank 0's close, at the same step
        codes = split.terminate_all()
    finally:
        split.kill()
    assert codes[1] == 0, split.log()
    assert codes[0] in (0, -signal.SIGTERM), split.log()

    again = Serve(moe_model, tmp_path, 2, "--prefix-cache-dir", str(cache))
    try:
        reply = ask(again)
        assert reply.choices[0].message.content == want
        # warm from both ranks' disk tiers: a request starts from the prefix every rank holds
        assert reply.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16, again.log()
        assert again.terminate_all()[1] == 0
    finally:
        again.kill()


def test_lost_rank_degrades_health_and_fails_requests(moe_model, tmp_path):
    from openai import APIStatusError

    split = Serve(moe_model, tmp_path, 2, "--no-prefix-cache")
    try:
        split.procs[1].kill()
        split.procs[1].wait()
        # an idle rank 0 meets the others every few seconds, so it notices without a request
        deadline, health = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            health = httpx.get(split.url + "/health", timeout=10)
            if health.status_code != 200:
                break
            time.sleep(0.5)
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "degraded" and "lost a rank" in health.json()["error"]
        with pytest.raises(APIStatusError) as failed:
            ask(split)
        assert failed.value.status_code == 503 and "lost a rank" in str(failed.value)
        assert split.procs[0].poll() is None  # rank 0 still answers
    finally:
        split.kill()
