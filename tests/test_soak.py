"""A bounded soak (issue 13's fault suite): mixed concurrent clients, both real SDKs, streaming
and not, plus a client that keeps hanging up, for about 30 s. Every response is well-formed,
and the server's memory and open file descriptors stay flat. Real uvicorn server and
sockets, a tiny random model."""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time

import anthropic
import openai
import pytest

from agent_bridge.app import create_app
from server_harness import RunningServer

SOAK_S = float(os.environ.get("MLX_DSPARK_SOAK_S", "30"))
PROMPTS = ["hi", "def f(x):\n    return x\n", "list three colours", "class A:\n    pass\n"]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_soak(tiny_engine):
    with RunningServer(create_app(tiny_engine)) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        stop = threading.Event()
        errors: list[str] = []
        counts = {"openai": 0, "anthropic": 0, "responses": 0, "hang-ups": 0}

        def openai_client(rng: random.Random):
            while not stop.is_set():
                msgs = [{"role": "user", "content": rng.choice(PROMPTS)}]
                if rng.random() < 0.5:
                    r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=rng.randint(1, 24))
                    assert isinstance(r.choices[0].message.content, str) and r.choices[0].finish_reason in ("stop", "length")
                else:
                    chunks = list(oai.chat.completions.create(model="m", messages=msgs, max_tokens=rng.randint(1, 24),
                                                              stream=True))
                    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                counts["openai"] += 1

        def anthropic_client(rng: random.Random):
            while not stop.is_set():
                kw = dict(model="m", max_tokens=rng.randint(1, 24), messages=[{"role": "user", "content": rng.choice(PROMPTS)}])
                if rng.random() < 0.5:
                    m = claude.messages.create(**kw)
                else:
                    with claude.messages.stream(**kw) as s:
                        m = s.get_final_message()
                assert m.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in m.content)
                counts["anthropic"] += 1

        def responses_client(rng: random.Random):
            while not stop.is_set():
                r = oai.responses.create(model="m", input=rng.choice(PROMPTS), max_output_tokens=rng.randint(1, 24))
                assert r.status in ("completed", "incomplete") and isinstance(r.output_text, str)
                counts["responses"] += 1

        def hanging_up_client(rng: random.Random):
            host, port = srv.url.removeprefix("http://").split(":")
            while not stop.is_set():
                body = json.dumps({"model": "m", "max_tokens": 200, "stream": rng.random() < 0.7,
                                   "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}).encode()
                with socket.create_connection((host, int(port))) as s:
                    s.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                    s.settimeout(5)
                    try:
                        s.recv(rng.choice([0, 1, 64, 512]) or 1)
                    except OSError:
                        pass
                    time.sleep(rng.random() * 0.3)  # and hang up, at some stage
                counts["hang-ups"] += 1

        def run(fn, seed):
            try:
                fn(random.Random(seed))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")
                stop.set()

        threads = [threading.Thread(target=run, args=(fn, i)) for i, fn in
                   enumerate([openai_client, openai_client, anthropic_client, anthropic_client, responses_client,
                              hanging_up_client])]
        for t in threads:
            t.start()
        time.sleep(SOAK_S / 3)  # warmed up: buffers, caches and pools at their working size
        rss_mid, fds_mid = rss_bytes(), open_fds()
        time.sleep(SOAK_S * 2 / 3)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        time.sleep(1)
        rss_end, fds_end = rss_bytes(), open_fds()
        print(f"soak {SOAK_S} s: {counts}; rss {rss_mid >> 20} -> {rss_end >> 20} MiB; fds {fds_mid} -> {fds_end}")
        assert not errors, errors
        assert all(counts.values()), counts
        assert fds_end <= fds_mid + 4, (fds_mid, fds_end)
        assert rss_end - rss_mid < 64 * 2**20, (rss_mid, rss_end, counts)
        # and the server still answers
        assert oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2) \
            .choices[0].message.content is not None
        oai.close()
        claude.close()
