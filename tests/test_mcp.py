"""MCP tools through the mcp Client, in memory, with real engines (tiny models)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from mcp import Client

from agent_bridge.mcp.backends import EngineBackend
from agent_bridge.mcp.server import build_server, task_messages
from agent_bridge.mcp.workspace import Workspace

CALC = "def add(a, b):\n    return a + b\n\n\ndef twice(x):\n    return add(x, x)\n"
CALC_RENAMED = CALC.replace("add", "plus")
MAIN = "from calc import add\n\nprint(add(2, 3))\n"
MAIN_RENAMED = MAIN.replace("add", "plus")
GREET = "def greet(name):\n    print('hello', name)\n"
GREET_NEW = "def greet(name: str) -> None:\n    print('hello', name)\n"
GREET_INSTRUCTION = "add type hints"


def call(server, tool: str, args: dict):
    async def go():
        async with Client(server) as client:
            return await client.call_tool(tool, args)

    return asyncio.run(go())


def text_of(result) -> str:
    return "\n".join(c.text for c in result.content)


@pytest.fixture(scope="module")
def forced_engine(tmp_path_factory):
    """An engine whose model answers the tools' exact prompts for CALC, MAIN and GREET."""
    from engine import Engine
    from forced_model import train_forced_model
    from prompts import fence

    chats = [
        (task_messages("rename_symbol", "calc.py", CALC, old="add", new="plus"), fence(CALC_RENAMED)),
        (task_messages("rename_symbol", "main.py", MAIN, old="add", new="plus"), fence(MAIN_RENAMED)),
        (task_messages("rewrite_file", "greet.py", GREET, instruction=GREET_INSTRUCTION), fence(GREET_NEW)),
    ]
    model_dir = train_forced_model(tmp_path_factory.mktemp("forced"), chats)
    engine = Engine(str(model_dir))
    yield engine
    engine.close()


@pytest.fixture
def ws(tmp_path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    (root / "main.py").write_text(MAIN)
    (root / "greet.py").write_text(GREET)
    return root


def snapshot(root: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.iterdir())}


def test_tools_prompts_and_status_resource(tiny_engine, ws):
    server = build_server(EngineBackend(tiny_engine), Workspace(ws))

    async def go():
        async with Client(server) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            prompt_list = {p.name: p for p in (await client.list_prompts()).prompts}
            review = await client.get_prompt("code_review", {"path": "calc.py"})
            resource = await client.read_resource("dspark://status")
            status = await client.call_tool("status", {})
            return tools, prompt_list, review, resource, status

    tools, prompt_list, review, resource, status = asyncio.run(go())
    assert set(tools) == {"rewrite_file", "rename_symbol", "edit_file", "generate", "status"}
    for name in ("rewrite_file", "edit_file"):
        schema = tools[name].input_schema
        assert schema["required"] == ["path", "instruction"]
        assert schema["properties"]["apply"]["default"] is False
        assert tools[name].description and "apply=true" in tools[name].description
    assert tools["rename_symbol"].input_schema["required"] == ["paths", "old", "new"]
    assert {"rewrite_file", "rename_symbol", "edit_file", "code_review", "system"} <= set(prompt_list)
    # a template's {code} is read from the workspace when only the path is given
    assert "def twice(x):" in review.messages[0].content.text
    info = json.loads(resource.contents[0].text)
    assert info["model"] == tiny_engine.model_path and info["workspace_root"] == str(ws.resolve())
    assert status.structured_content["context_window"] == tiny_engine.context_window


@pytest.mark.parametrize(
    "bad",
    ["../outside.py", "/etc/passwd", "link_out.py", "linkdir/secret.py", "sub/../../outside.py"],
)
def test_path_escapes_refused(tiny_engine, ws, bad):
    outside = ws.parent / "outside.py"
    outside.write_text("SECRET = 1\n")
    (ws.parent / "outdir").mkdir(exist_ok=True)
    (ws.parent / "outdir" / "secret.py").write_text("SECRET = 2\n")
    (ws / "link_out.py").symlink_to(outside)
    (ws / "linkdir").symlink_to(ws.parent / "outdir")
    (ws / "sub").mkdir()
    server = build_server(EngineBackend(tiny_engine), Workspace(ws))
    before = outside.read_bytes()
    for tool, args in [
        ("rewrite_file", {"path": bad, "instruction": "x", "apply": True}),
        ("edit_file", {"path": bad, "instruction": "x", "apply": True}),
        ("rename_symbol", {"paths": ["calc.py", bad], "old": "SECRET", "new": "X", "apply": True}),
    ]:
        result = call(server, tool, args)
        assert result.is_error, (tool, bad)
        assert "outside the workspace root" in text_of(result)
    assert outside.read_bytes() == before


def test_bad_files_get_clear_errors(tiny_engine, ws):
    (ws / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02")
    (ws / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (ws / "dir").mkdir()
    server = build_server(EngineBackend(tiny_engine), Workspace(ws, max_bytes=1000))
    (ws / "huge.py").write_text("x = 1\n" * 500)
    expected = {"blob.bin": "binary", "latin1.py": "not UTF-8", "dir": "not a regular file",
                "huge.py": "too large", "missing.py": "no such file"}
    for path, words in expected.items():
        result = call(server, "edit_file", {"path": path, "instruction": "x"})
        assert result.is_error and words in text_of(result), (path, text_of(result))


def test_garbled_output_is_reported_not_applied(tiny_engine, ws):
    # a random tiny model never closes the code fence: the reply is garbled (or cut by max_tokens)
    server = build_server(EngineBackend(tiny_engine), Workspace(ws))
    before = snapshot(ws)
    result = call(server, "rewrite_file", {"path": "calc.py", "instruction": "add docstrings", "apply": True})
    assert result.is_error
    assert "garbled" in text_of(result) and "nothing was written" in text_of(result)
    assert snapshot(ws) == before


def test_rename_without_apply_leaves_files_untouched(forced_engine, ws):
    server = build_server(EngineBackend(forced_engine), Workspace(ws))
    before = snapshot(ws)
    result = call(server, "rename_symbol", {"paths": ["calc.py", "main.py"], "old": "add", "new": "plus"})
    assert not result.is_error, text_of(result)
    s = result.structured_content
    assert s["applied"] is False and s["changed_files"] == ["calc.py", "main.py"]
    assert "-def add(a, b):\n+def plus(a, b):\n" in s["diff"]
    assert "-print(add(2, 3))\n+print(plus(2, 3))\n" in s["diff"]
    assert s["stats"]["generated_tokens"] > 0 and s["stats"]["files"] == 2
    assert snapshot(ws) == before


def test_rename_apply_writes_atomically(forced_engine, ws):
    os.chmod(ws / "calc.py", 0o640)
    server = build_server(EngineBackend(forced_engine), Workspace(ws))
    result = call(server, "rename_symbol",
                  {"paths": ["calc.py", "main.py"], "old": "add", "new": "plus", "apply": True, "return_text": True})
    assert not result.is_error, text_of(result)
    assert result.structured_content["applied"] is True
    assert (ws / "calc.py").read_text() == CALC_RENAMED
    assert (ws / "main.py").read_text() == MAIN_RENAMED
    assert result.structured_content["new_text"]["calc.py"] == CALC_RENAMED
    assert (ws / "calc.py").stat().st_mode & 0o777 == 0o640  # permissions kept across the rename
    assert sorted(p.name for p in ws.iterdir()) == ["calc.py", "greet.py", "main.py"]  # no temp files left


def test_rename_is_all_or_nothing(forced_engine, ws):
    # calc.py gets a sound rename, then other.py is refused (not UTF-8): neither file may be written
    (ws / "other.py").write_bytes("add = 'caf\xe9'\n".encode("latin-1"))
    server = build_server(EngineBackend(forced_engine), Workspace(ws))
    before = snapshot(ws)
    result = call(server, "rename_symbol", {"paths": ["calc.py", "other.py"], "old": "add", "new": "plus", "apply": True})
    assert result.is_error and "other.py" in text_of(result)
    assert snapshot(ws) == before


def test_rewrite_file_apply_through_symlink_inside_root(forced_engine, ws):
    (ws / "alias.py").symlink_to(ws / "greet.py")
    server = build_server(EngineBackend(forced_engine), Workspace(ws))
    dry = call(server, "rewrite_file", {"path": str(ws / "greet.py"), "instruction": GREET_INSTRUCTION})
    assert not dry.is_error and (ws / "greet.py").read_text() == GREET
    stats = dry.structured_content["stats"]
    assert stats["generated_tokens"] > 0 and "acceptance_rate" in stats and "decode_tok_s" in stats
    result = call(server, "rewrite_file", {"path": "greet.py", "instruction": GREET_INSTRUCTION, "apply": True})
    assert not result.is_error, text_of(result)
    assert (ws / "greet.py").read_text() == GREET_NEW
    assert (ws / "alias.py").is_symlink()
