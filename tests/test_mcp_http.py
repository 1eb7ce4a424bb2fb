"""MCP over streamable HTTP at /mcp on the real server app, and `mlx-dspark mcp --server URL`."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from mcp import Client, StdioServerParameters

from agent_bridge.mcp.server import http_mount
from agent_bridge.app import create_app
from server_harness import RunningServer
from test_mcp_stdio import mlx_dspark

TOOLS = {"rewrite_file", "rename_symbol", "edit_file", "generate", "status"}


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "secret.py").write_text("x = 1\n")
    return root


def test_mcp_mounted_on_the_server(tiny_engine, ws):
    routes, lifespan = http_mount(tiny_engine, root=ws)
    with RunningServer(create_app(tiny_engine, extra_routes=routes, lifespan=lifespan)) as srv:

        async def go():
            async with Client(f"{srv.url}/mcp") as client:
                tools = {t.name for t in (await client.list_tools()).tools}
                prompt_names = {p.name for p in (await client.list_prompts()).prompts}
                status = await client.call_tool("status", {})
                escape = await client.call_tool("edit_file", {"path": "../secret.py", "instruction": "x", "apply": True})
                gen = await client.call_tool("generate", {"prompt": "def add(", "max_tokens": 6})
                return tools, prompt_names, status, escape, gen

        tools, prompt_names, status, escape, gen = asyncio.run(go())
        health = httpx.get(f"{srv.url}/health").json()  # the OpenAI/Anthropic app still answers beside it
    assert tools == TOOLS and "rewrite_file" in prompt_names
    assert status.structured_content["workspace_root"] == str(ws.resolve())
    assert escape.is_error and "outside the workspace root" in escape.content[0].text
    assert gen.structured_content["stats"]["generated_tokens"] >= 1
    assert health["status"] == "ok"
    assert (ws.parent / "secret.py").read_text() == "x = 1\n"


def test_mcp_http_needs_the_api_key(tiny_engine, ws):
    routes, lifespan = http_mount(tiny_engine, root=ws)
    app = create_app(tiny_engine, api_key="sekrit", extra_routes=routes, lifespan=lifespan)
    with RunningServer(app) as srv:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        refused = httpx.post(f"{srv.url}/mcp", json=body, headers={"Accept": "application/json, text/event-stream"})

        async def go():
            async with httpx.AsyncClient(headers={"Authorization": "Bearer sekrit"}) as http:
                from mcp.client.streamable_http import streamable_http_client

                async with Client(streamable_http_client(f"{srv.url}/mcp", http_client=http)) as client:
                    return {t.name for t in (await client.list_tools()).tools}

        assert refused.status_code == 401
        assert asyncio.run(go()) == TOOLS


def test_stdio_forwarding_to_a_running_server(tiny_engine, ws):
    with RunningServer(create_app(tiny_engine)) as srv:
        params = StdioServerParameters(command=mlx_dspark(), args=["mcp", "--server", srv.url, "--root", str(ws)],
                                       env={**os.environ})

        async def go():
            async with Client(params, read_timeout_seconds=120) as client:
                status = await client.call_tool("status", {})
                gen = await client.call_tool("generate", {"prompt": "def add(", "max_tokens": 6})
                garbled = await client.call_tool("rewrite_file", {"path": "a.py", "instruction": "x", "apply": True})
                return status, gen, garbled

        status, gen, garbled = asyncio.run(go())
    assert status.structured_content["backend"] == "http" and status.structured_content["status"] == "ok"
    stats = gen.structured_content["stats"]
    assert stats["generated_tokens"] >= 1 and "mode" in stats  # the engine's own stats, from the server's reply
    assert garbled.is_error and "garbled" in garbled.content[0].text
    assert (ws / "a.py").read_text() == "def add(a, b):\n    return a + b\n"


def test_stdio_forwarding_server_down(ws):
    params = StdioServerParameters(command=mlx_dspark(), args=["mcp", "--server", "http://127.0.0.1:9", "--root", str(ws)],
                                   env={**os.environ})

    async def go():
        async with Client(params, read_timeout_seconds=60) as client:
            return await client.call_tool("generate", {"prompt": "x"})

    result = asyncio.run(go())
    assert result.is_error and "http://127.0.0.1:9" in result.content[0].text
