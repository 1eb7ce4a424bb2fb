"""MCP tools share the engine's scheduler with the HTTP APIs: a tool call waiting for the engine
blocks nobody, and a cancelled call (the real `mcp` client abandoning it, which sends
`notifications/cancelled`) cancels its engine job. Streamable HTTP on the real server app;
the engine held busy deterministically. Model: a tiny random qwen3."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from mcp import Client

from agent_bridge.mcp.server import http_mount
from agent_bridge.app import create_app
from server_harness import RunningServer, engine_held


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engine import Engine

    e = Engine(str(tiny_model_dir))
    yield e
    e.close()


async def until(cond, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_mcp_call_waits_without_blocking_and_cancels_its_job(engine, tmp_path):
    routes, lifespan = http_mount(engine, root=tmp_path)
    app = create_app(engine, extra_routes=routes, lifespan=lifespan)
    with RunningServer(app) as srv:

        async def go():
            async with Client(f"{srv.url}/mcp") as client, httpx.AsyncClient(timeout=10) as http:
                with engine_held(engine):
                    calls = [asyncio.create_task(client.call_tool("generate", {"prompt": f"hi {i}", "max_tokens": 50}))
                             for i in range(2)]
                    await until(lambda: engine.load()["queued"] == 2, "both MCP jobs queued")
                    # the HTTP APIs answer meanwhile: a stream opens at once behind the MCP jobs
                    async with http.stream("POST", f"{srv.url}/v1/messages", json={
                            "model": "m", "max_tokens": 2, "stream": True,
                            "messages": [{"role": "user", "content": "x"}]}) as r:
                        first = await r.aiter_lines().__anext__()
                    assert first == "event: message_start"
                    calls[0].cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await calls[0]
                    # its job leaves the queue while the engine is still busy; the other one stays
                    await until(lambda: engine.load()["queued"] == 1, "the cancelled call's job dropped")
                result = await calls[1]
                assert result.structured_content["stats"]["generated_tokens"] >= 1
                # a call whose client gives up (a read timeout) is cancelled the same way
                with engine_held(engine):
                    with pytest.raises(Exception):
                        await client.call_tool("generate", {"prompt": "late", "max_tokens": 50},
                                               read_timeout_seconds=0.5)
                    await until(lambda: engine.load()["queued"] == 0, "the timed-out call's job dropped")

        asyncio.run(go())
        assert engine.load()["running"] == 0
