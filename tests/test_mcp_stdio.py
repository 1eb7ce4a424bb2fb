"""`mlx-dspark mcp` as a subprocess, spoken to over stdio by the mcp Client."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

from mcp import Client, StdioServerParameters


def mlx_dspark() -> str:
    exe = Path(sys.executable).parent / "mlx-dspark"
    return str(exe) if exe.exists() else shutil.which("mlx-dspark")


def test_stdio_server(tiny_model_dir, tmp_path):
    (tmp_path / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path.parent / "secret.py").write_text("x = 1\n")
    params = StdioServerParameters(
        command=mlx_dspark(),
        args=["mcp", "--model", str(tiny_model_dir), "--root", str(tmp_path)],
        env={**os.environ},
    )

    async def go():
        async with Client(params, read_timeout_seconds=120) as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            status = await client.call_tool("status", {})
            escape = await client.call_tool("rewrite_file", {"path": "../secret.py", "instruction": "x", "apply": True})
            gen = await client.call_tool("generate", {"prompt": "def add(", "max_tokens": 8})
            garbled = await client.call_tool("edit_file", {"path": "a.py", "instruction": "rename add", "apply": True})
            return tools, status, escape, gen, garbled

    tools, status, escape, gen, garbled = asyncio.run(go())
    assert set(tools) == {"rewrite_file", "rename_symbol", "edit_file", "generate", "status"}
    assert status.structured_content["model"] == str(tiny_model_dir)
    assert status.structured_content["workspace_root"] == str(tmp_path.resolve())
    assert escape.is_error and "outside the workspace root" in escape.content[0].text
    assert not gen.is_error and 1 <= gen.structured_content["stats"]["generated_tokens"] <= 8
    assert gen.structured_content["finish_reason"] in ("length", "stop")
    assert garbled.is_error and "garbled" in garbled.content[0].text
    assert (tmp_path / "a.py").read_text() == "def add(a, b):\n    return a + b\n"


def test_stdio_bad_root_is_a_clear_error(tmp_path):
    import subprocess

    r = subprocess.run([mlx_dspark(), "mcp", "--root", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "workspace root is not a directory" in r.stderr and "Traceback" not in r.stderr
