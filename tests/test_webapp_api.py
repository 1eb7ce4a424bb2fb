"""The web app's API without a browser: per-token provenance in the OpenAI stream, per-request
mode and draft cap, telemetry (snapshot and SSE), the cache view with evict/clear, tune with
progress, integrations, and the API key on the page's routes. A tiny random model in the real
engine behind a real uvicorn socket; the real `openai` and `anthropic` SDKs where a client talks.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from agent_bridge.app import create_app
from agent_bridge.serving.telemetry import client_name
from server_harness import RunningServer, sse_events

KEY = "k-webapp"


@pytest.fixture(scope="module")
def server(tiny_engine):
    with RunningServer(create_app(tiny_engine)) as srv:
        yield srv


def _stream_chat(url: str, ext: dict, max_tokens: int = 24, headers: dict | None = None) -> list[dict]:
    body = {"messages": [{"role": "user", "content": "one two three one two three one two"}], "max_tokens": max_tokens,
            "stream": True, "mlx_dspark": ext}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    return [json.loads(data) for _, data in sse_events(text) if data != "[DONE]"]


def test_provenance_chunks_account_for_every_token(server):
    chunks = _stream_chat(server.url, {"provenance": True, "mode": "lookup", "max_draft": 4}, max_tokens=40)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("reasoning_content", "") + d.get("content", "") for d in deltas)  # a random model thinks
    pieces = [p for c in chunks if not c["choices"] and "mlx_dspark" in c for p in c["mlx_dspark"]["tokens"]]
    stats = chunks[-1]["mlx_dspark"]
    assert stats["mode"] == "lookup"
    assert len(pieces) == stats["generated_tokens"] > 0
    untag = lambda t: t.replace("<think>", "").replace("</think>", "")  # noqa: E731 - the parser eats these
    assert untag("".join(text for text, _ in pieces)) == untag(content)
    assert {source for _, source in pieces} <= {"lookup", "target"}
    assert sum(source == "lookup" for _, source in pieces) == stats["accepted_tokens"]
    drafted = sum(c["mlx_dspark"]["drafted"] for c in chunks if not c["choices"] and "mlx_dspark" in c)
    assert drafted <= stats["drafted_tokens"] and max(stats["drafted_by_position"] and [len(stats["drafted_by_position"])]) <= 4


def test_provenance_is_off_by_default_and_the_openai_sdk_reads_it(server):
    plain = _stream_chat(server.url, {})
    assert all(c["choices"] for c in plain[:-1])  # no extra chunks unless asked
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi there"}], max_tokens=12,
                                            stream=True, extra_body={"mlx_dspark": {"provenance": True}})
    chunks = list(stream)
    assert any(not c.choices and c.model_extra.get("mlx_dspark", {}).get("tokens") for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_mode_and_max_draft_per_request(server):
    base = _stream_chat(server.url, {"mode": "baseline"})[-1]["mlx_dspark"]
    assert base["mode"] == "baseline" and base["drafted_tokens"] == 0 and base["rounds"] == base["generated_tokens"]
    capped = _stream_chat(server.url, {"mode": "lookup", "max_draft": 0})[-1]["mlx_dspark"]
    assert capped["mode"] == "lookup" and capped["drafted_tokens"] == 0
    for ext, param in (({"mode": "nonsense"}, None), ({"max_draft": -1}, "mlx_dspark.max_draft"),
                       ({"max_draft": "lots"}, "mlx_dspark.max_draft"), ({"mode": 3}, "mlx_dspark.mode")):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                  "mlx_dspark": ext}, timeout=60)
        assert r.status_code == 400, (ext, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
        if param:
            assert r.json()["error"]["param"] == param


def test_telemetry_sees_an_anthropic_sdk_request(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x")
    msg = client.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "count: 1 2 3"}])
    snap = httpx.get(server.url + "/v1/telemetry/snapshot").json()
    job = next(j for j in snap["recent"] if j["client"] == "anthropic-sdk")
    assert job["phase"] == "done" and job["generated"] == msg.usage.output_tokens
    assert job["prompt_tokens"] == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert snap["clients"]["anthropic-sdk"]["requests"] >= 1
    # (the session's shared engine may still be finishing other tests' jobs)
    assert snap["totals"]["requests"] >= 1 and not [j for j in snap["in_flight"] if j["client"] == "anthropic-sdk"]
    assert len(snap["throughput"]) == 120 and sum(row[1] for row in snap["throughput"]) >= job["generated"]
    # the live stream opens with a snapshot
    with httpx.stream("GET", server.url + "/v1/telemetry", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            if "\n\n" in buf:
                break
    event, data = sse_events(buf)[0]
    assert event == "snapshot" and "in_flight" in json.loads(data)


def test_cache_view_evict_and_clear(server):
    _stream_chat(server.url, {})
    view = httpx.get(server.url + "/v1/cache").json()
    assert view["stats"]["entries"] > 0 and view["branches"]
    top = view["branches"][0]
    assert top["parent"] is None and top["end"] == top["start"] + top["tokens"] and isinstance(top["head"], str)
    assert httpx.get(server.url + "/v1/cache?limit=x").status_code == 400
    evicted = httpx.post(server.url + "/v1/cache/evict").json()
    assert evicted["stats"]["ram_bytes"] == 0 and evicted["branches"] == []
    _stream_chat(server.url, {})
    cleared = httpx.post(server.url + "/v1/cache/clear").json()
    assert cleared["stats"]["entries"] == 0 and cleared["stats"]["disk_files"] == 0
    after = _stream_chat(server.url, {})[-1]["mlx_dspark"]
    assert after["generated_tokens"] > 0  # still serving, from an empty cache


def test_tune_streams_progress_then_the_curve(server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path))  # never the user's curve
    assert httpx.post(server.url + "/v1/tune", json={"depths": "64"}).status_code == 400
    assert httpx.post(server.url + "/v1/tune", json={"repeats": 0}).status_code == 400
    r = httpx.post(server.url + "/v1/tune", json={"depths": [8, 32], "repeats": 1}, timeout=300)
    events = sse_events(r.text)
    kinds = [e for e, _ in events]
    assert kinds[-1] == "done" and kinds.count("progress") >= 2, kinds
    curve = json.loads(events[-1][1])
    assert curve["measured"] and curve["depths"] == [8, 32] and len(curve["by_depth"]) == 2
    assert httpx.get(server.url + "/v1/cost-curve").json()["depths"] == [8, 32]
    assert list(tmp_path.glob("cost-curve-*.json"))


def test_integrations_list_and_write(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # project scope: the server's folder
    listed = httpx.get(server.url + "/v1/integrations").json()
    names = [c["client"] for c in listed["clients"]]
    assert names == ["claude-code", "codex", "opencode", "cursor", "continue", "zed", "vscode", "aider"]
    assert all(c["files"] for c in listed["clients"])
    assert f"127.0.0.1:{server.port}" in listed["clients"][0]["files"][0]["text"]
    assert httpx.get(server.url + "/v1/integrations?scope=elsewhere").status_code == 400
    assert httpx.post(server.url + "/v1/integrations/nobody/write").status_code == 404
    target = tmp_path / ".aider.conf.yml"
    target.write_text("# mine\nauto-commits: false\n")
    out = httpx.post(server.url + "/v1/integrations/aider/write", json={"scope": "project"}).json()
    assert out["written"][0]["path"] == str(target) and out["written"][0]["backup"]
    text = target.read_text()
    assert "auto-commits: false" in text and "openai-api-base" in text  # merged, not replaced
    broken = tmp_path / ".continue" / "models" / "mlx-dspark.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text("models: [unclosed\n")
    r = httpx.post(server.url + "/v1/integrations/continue/write", json={})
    assert r.status_code == 409 and broken.read_text() == "models: [unclosed\n"


def test_api_key_guards_the_api_not_the_page(tiny_engine):
    with RunningServer(create_app(tiny_engine, api_key=KEY)) as srv:
        page = httpx.get(srv.url + "/", headers={"Accept": "text/html"})
        assert page.status_code == 200 and "<title>mlx-dspark</title>" in page.text
        assert httpx.get(srv.url + "/ui/app.js").status_code == 200
        assert httpx.get(srv.url + "/ui/vendor/uplot/LICENSE").status_code == 200
        health = httpx.get(srv.url + "/").json()  # API clients probing the base URL
        assert health["status"] == "ok" and health["api_key_required"] is True
        assert httpx.head(srv.url + "/").status_code == 200
        for path in ("/v1/server", "/v1/telemetry/snapshot", "/v1/cache", "/v1/integrations", "/v1/cost-curve"):
            assert httpx.get(srv.url + path).status_code == 401, path
        info = httpx.get(srv.url + "/v1/server", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert info["api_key_required"] and "lookup" in info["modes"]
        listed = httpx.get(srv.url + "/v1/integrations", headers={"x-api-key": KEY}).json()
        aider = next(c for c in listed["clients"] if c["client"] == "aider")
        assert KEY in aider["files"][0]["text"]  # the clients get the key they need
        assert httpx.post(srv.url + "/v1/cache/clear").status_code == 401
        # the page opened by another name (a LAN address): its own origin passes, with the key
        lan = {"Host": f"box.lan:{srv.port}", "Origin": f"http://box.lan:{srv.port}", "x-api-key": KEY}
        assert httpx.get(srv.url + "/v1/server", headers=lan).status_code == 200
        other = {**lan, "Origin": "http://evil.example"}
        assert httpx.get(srv.url + "/v1/server", headers=other).status_code == 403
    with RunningServer(create_app(tiny_engine)) as srv:  # no key: a non-loopback origin is refused
        lan = {"Host": f"box.lan:{srv.port}", "Origin": f"http://box.lan:{srv.port}"}
        assert httpx.get(srv.url + "/v1/server", headers=lan).status_code == 403


def test_client_names():
    assert client_name("claude-cli/2.1.328 (external, cli)") == "claude-code"
    assert client_name("Anthropic/Python 0.70.0") == "anthropic-sdk"
    assert client_name("OpenAI/Python 2.3.0") == "openai-sdk"
    assert client_name("codex_cli_rs/0.40.0") == "codex"
    assert client_name("Mozilla/5.0", hint="mlx-dspark-webapp") == "web app"
    assert client_name("python-httpx/0.28", path="/mcp") == "mcp (httpx)"
    assert client_name("") == "unknown"


def test_ui_command_opens_a_running_server_or_serves_first(server, tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys
    import time

    from test_server_cli import REPO, free_port

    env = dict(os.environ, MLX_DSPARK_NO_REEXEC="1", MLX_DSPARK_CACHE_DIR=str(tmp_path), BROWSER="true")
    # a server answers: only the browser part (--no-browser prints the address)
    p = subprocess.run([sys.executable, "-m", "agent_bridge.cli", "ui", "--port", str(server.port), "--no-browser"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and f"web app is at http://127.0.0.1:{server.port}/" in p.stdout, p.stderr
    # none answers: it serves (serve's options pass through), then gives the address
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agent_bridge.cli", "ui", "--port", str(port), "--no-browser",
                             "--model", str(tiny_model_dir), "--no-mcp", "--log-level", "warning"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline, out = time.monotonic() + 120, ""
        while "web app is at" not in out:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, out
            out += line
        page = httpx.get(f"http://127.0.0.1:{port}/", headers={"Accept": "text/html"})
        assert page.status_code == 200 and "/ui/app.js" in page.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_telemetry_sees_mcp_tool_jobs(tiny_engine, tmp_path):
    import asyncio

    from mcp import Client

    from agent_bridge.mcp.server import http_mount

    routes, lifespan = http_mount(tiny_engine, root=tmp_path)
    with RunningServer(create_app(tiny_engine, extra_routes=routes, lifespan=lifespan)) as srv:

        async def go():
            async with Client(f"{srv.url}/mcp") as client:
                return await client.call_tool("generate", {"prompt": "def add(", "max_tokens": 6})

        gen = asyncio.run(go())
        snap = httpx.get(srv.url + "/v1/telemetry/snapshot").json()
    n = gen.structured_content["stats"]["generated_tokens"]
    assert any(j["client"].startswith("mcp") and j["generated"] == n for j in snap["recent"]), snap["recent"][:3]
    assert any(name.startswith("mcp (") for name in snap["clients"])  # the /mcp requests themselves
