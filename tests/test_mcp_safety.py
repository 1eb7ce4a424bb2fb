"""Issue 13 items 1-2: MCP edits never damage a file (fences, hunk limit, renames)."""

from __future__ import annotations

import os

import pytest

import prompts
from agent_bridge.mcp.edits import Edit, GarbledOutput, check_rename, count_hunks, new_text_from_reply

MARKDOWN = "# Setup\n\nInstall it:\n\n```bash\npip install x\n```\n\nThen run `x`.\n\n````text\nnested ``` here\n````\n\nThe end.\n"
DOCSTRING = 'def f():\n    """Example:\n\n    ```python\n    >>> f()\n    ```\n    """\n    return 1\n\n\nTAIL = 2\n'


@pytest.mark.parametrize("text", [MARKDOWN, DOCSTRING, "x = 1\n", "", "a ``` b\n``````\n"])
def test_fence_round_trips_any_file(text):
    # item 1a: the file's own fences never close the fence around it (CommonMark's rule)
    fence = prompts.fence_for(text)
    assert all(not line.lstrip().startswith(fence) for line in text.splitlines())
    assert prompts.extract_code(prompts.fence(text, "markdown")) == (text if text.endswith("\n") or not text else text + "\n")


def test_templates_fence_with_the_files_longest_run():
    from agent_bridge.mcp.server import task_messages

    user = task_messages("edit_file", "README.md", MARKDOWN, instruction="Keep the content exactly as it is.")[1]["content"]
    assert "`````markdown\n" + MARKDOWN + "`````" in user
    assert prompts.extract_code(user) == MARKDOWN


def test_extract_code_follows_commonmark():
    assert prompts.extract_code("````md\na\n```\nb\n````\n") == "a\n```\nb\n"
    assert prompts.extract_code("```\nx\n`````\n") == "x\n"  # a longer closing run closes
    assert prompts.extract_code("````\nx\n```\n") is None  # a shorter one doesn't
    assert prompts.extract_code("  ```py\nx\n  ```\n") == "x\n"  # up to 3 spaces of indent


def test_reply_that_drops_fence_lines_is_refused_with_diff():
    # item 1b: the bundled model dropped both fence lines of the bash block; that was written
    dropped = MARKDOWN.replace("```bash\n", "").replace("pip install x\n```\n", "pip install x\n")
    with pytest.raises(GarbledOutput, match="fence lines") as e:
        new_text_from_reply(prompts.fence(dropped, "markdown"), "stop", MARKDOWN)
    assert "-```bash" in str(e.value)  # the diff is shown


def test_reply_that_adds_fence_lines_is_refused():
    with pytest.raises(GarbledOutput, match="fence lines"):
        new_text_from_reply(prompts.fence("x = 1\n```\n", "python"), "stop", "x = 1\n")


def test_reply_that_loses_the_tail_is_refused():
    # what the old parser produced: the file up to the first inner fence
    old_reply = "```markdown\n" + MARKDOWN + "```"
    with pytest.raises(GarbledOutput):
        new_text_from_reply(old_reply, "stop", MARKDOWN)
    cut = "".join(MARKDOWN.splitlines(keepends=True)[:3])
    with pytest.raises(GarbledOutput, match="tail"):
        new_text_from_reply(prompts.fence(cut, "markdown"), "stop", MARKDOWN)


def test_docstring_examples_survive():
    assert new_text_from_reply(prompts.fence(DOCSTRING), "stop", DOCSTRING) == DOCSTRING


def test_count_hunks():
    old = "".join(f"line {i}\n" for i in range(100))
    new = old.replace("line 5\n", "LINE 5\n")
    assert count_hunks(old, old) == 0
    assert count_hunks(old, new) == 1
    for i in (30, 60, 90):
        new = new.replace(f"line {i}\n", f"LINE {i}\n")
    assert count_hunks(old, new) == 4


# -- the tools end to end, on a real engine whose tiny model was trained on these exact chats --

from mcp_cases import FILES, ONE, SPREAD, SPREAD_EDITED, SPREAD_INSTRUCTION, renamed


def call(server, tool: str, args: dict):
    import asyncio

    from mcp import Client

    async def go():
        async with Client(server) as client:
            return await client.call_tool(tool, args)

    return asyncio.run(go())


def text_of(result) -> str:
    return "\n".join(c.text for c in result.content)


def tree(root) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "spread.py").write_text(SPREAD)
    (root / "one.py").write_text(ONE)
    for p, t in FILES.items():
        (root / p).write_text(t)
    return root


def server_for(engine, root, backend=None, **kw):
    from agent_bridge.mcp.backends import EngineBackend
    from agent_bridge.mcp.server import build_server
    from agent_bridge.mcp.workspace import Workspace

    return build_server(backend or EngineBackend(engine), Workspace(root), **kw)


def test_edit_file_spread_over_many_hunks_is_only_proposed(safety_engine, ws):
    before = tree(ws)
    result = call(server_for(safety_engine, ws), "edit_file",
                  {"path": "spread.py", "instruction": SPREAD_INSTRUCTION, "apply": True})
    assert not result.is_error, text_of(result)
    s = result.structured_content
    assert s["applied"] is False and "4 hunks" in " ".join(s["warnings"]) and "+v36 = 100" in s["diff"]
    assert tree(ws) == before
    # the limit is configurable (--max-edit-hunks)
    result = call(server_for(safety_engine, ws, max_edit_hunks=4), "edit_file",
                  {"path": "spread.py", "instruction": SPREAD_INSTRUCTION, "apply": True})
    assert result.structured_content["applied"] is True
    assert (ws / "spread.py").read_text() == SPREAD_EDITED


def test_crlf_file_keeps_crlf(safety_engine, ws):
    (ws / "spread.py").write_bytes(SPREAD.replace("\n", "\r\n").encode())
    result = call(server_for(safety_engine, ws, max_edit_hunks=4), "edit_file",
                  {"path": "spread.py", "instruction": SPREAD_INSTRUCTION, "apply": True})
    assert not result.is_error, text_of(result)
    assert (ws / "spread.py").read_bytes() == SPREAD_EDITED.replace("\n", "\r\n").encode()


def test_rename_that_rewrites_another_line_is_refused(safety_engine, ws):
    # item 2: the line count is the same, but `a + b` became `a - b`
    before = tree(ws)
    result = call(server_for(safety_engine, ws), "rename_symbol",
                  {"paths": ["one.py"], "old": "add", "new": "plus", "apply": True})
    assert result.is_error and "return a + b" in text_of(result) and "nothing was written" in text_of(result)
    assert tree(ws) == before


def test_rename_of_three_files_commits_together(safety_engine, ws):
    result = call(server_for(safety_engine, ws), "rename_symbol",
                  {"paths": list(FILES), "old": "add", "new": "plus", "apply": True})
    assert not result.is_error, text_of(result)
    assert {p: (ws / p).read_text() for p in FILES} == {p: renamed(t) for p, t in FILES.items()}
    assert not [p for p in ws.iterdir() if p.name.startswith(".")]  # no temp files left


def test_rename_third_file_saved_mid_generation_writes_nothing(safety_engine, ws):
    # item 2: the user saves c.py while the model works on it; a.py and b.py were fine
    from agent_bridge.mcp.backends import EngineBackend

    class SavesC(EngineBackend):
        def generate(self, messages, max_tokens, temperature=0.0):
            gen = super().generate(messages, max_tokens, temperature)
            if "c.py" in messages[-1]["content"]:
                (ws / "c.py").write_text(FILES["c.py"] + "# saved by the user\n")
            return gen

    result = call(server_for(safety_engine, ws, SavesC(safety_engine)), "rename_symbol",
                  {"paths": list(FILES), "old": "add", "new": "plus", "apply": True})
    assert result.is_error and "c.py changed on disk" in text_of(result)
    assert (ws / "a.py").read_text() == FILES["a.py"] and (ws / "b.py").read_text() == FILES["b.py"]
    assert (ws / "c.py").read_text().endswith("# saved by the user\n")


def test_read_only_file_is_not_replaced(safety_engine, ws):
    os.chmod(ws / "c.py", 0o444)
    before = tree(ws)
    result = call(server_for(safety_engine, ws), "rename_symbol",
                  {"paths": list(FILES), "old": "add", "new": "plus", "apply": True})
    assert result.is_error and "read-only" in text_of(result)
    assert tree(ws) == before


def test_bundled_model_keep_as_is_never_drops_fences(tmp_path):
    # item 1b, as reproduced: the bundled model on a Markdown file with a bash block
    from engine import Engine

    from agent_bridge.mcp.backends import EngineBackend

    md = "# Setup\n\nInstall it:\n\n```bash\npip install x\n```\n\nThen run `x`.\n"
    (tmp_path / "README.md").write_text(md)
    engine = Engine(prefix_cache=False)
    try:
        result = call(server_for(engine, tmp_path, EngineBackend(engine)), "edit_file",
                      {"path": "README.md", "instruction": "Keep the content exactly as it is.", "apply": True})
    finally:
        engine.close()
    after = (tmp_path / "README.md").read_text()
    assert prompts.fence_lines(after) == prompts.fence_lines(md), text_of(result)
    assert after == md or not result.is_error
