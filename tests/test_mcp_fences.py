"""Issue 35 item 4: MCP `rewrite_file` never writes a rewrite that loses or adds a code-fence
line at any indentation (a fenced example inside an indented docstring included).

The model is scripted (tests/scripted_model.py): a real tiny model run by the real engine, its
reply forced to the file with one indented fence line dropped. This tests the guard, not the
model: the MCP client, server, tool and engine are the real ones. The engine decodes plainly
(mode baseline): the scripted model is not causal within a speculative verify forward whose
lookup draft copies the chat template's generation prompt out of the file's echo."""

from __future__ import annotations

import asyncio

import pytest
from scripted_model import script_engine

import prompts

SOURCE = '''def area(width, height):
    """The area of a rectangle.

    Example:

    ```python
    >>> area(2, 3)
    6
    ```
    """
    return width * height
'''
KEEP = "Keep the file exactly as it is."


def dropped(text: str, line: str) -> str:
    assert line + "\n" in text
    return text.replace(line + "\n", "", 1)


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from engine import Engine

    with Engine(str(tiny_model_dir), prefix_cache=False) as engine:
        yield engine, script_engine(engine)


def rewrite(engine, root):
    from mcp import Client

    from agent_bridge.mcp.backends import EngineBackend
    from agent_bridge.mcp.server import build_server
    from agent_bridge.mcp.workspace import Workspace

    async def go():
        async with Client(build_server(EngineBackend(engine, mode="baseline"), Workspace(root))) as client:
            return await client.call_tool("rewrite_file", {"path": "area.py", "instruction": KEEP, "apply": True})

    return asyncio.run(go())


def text_of(result) -> str:
    return "\n".join(c.text for c in result.content)


@pytest.mark.parametrize("change", ["drop closing", "drop opening", "add one"])
def test_rewrite_that_changes_an_indented_fence_line_is_not_written(scripted, tmp_path, change):
    engine, script = scripted
    (tmp_path / "area.py").write_text(SOURCE)
    new = {"drop closing": dropped(SOURCE, "    ```"),
           "drop opening": dropped(SOURCE, "    ```python"),
           "add one": SOURCE.replace("    return", "    ```\n    return")}[change]
    assert len(prompts.fence_lines(new)) != len(prompts.fence_lines(SOURCE))
    script.set(prompts.fence(new, "python"))
    result = rewrite(engine, tmp_path)
    assert (tmp_path / "area.py").read_text() == SOURCE, text_of(result)  # never written
    assert result.is_error and "fence lines" in text_of(result) and "nothing was written" in text_of(result)
    assert ("-    ```" if change != "add one" else "+    ```") in text_of(result)  # the diff comes back


def test_rewrite_that_keeps_the_fences_is_written(scripted, tmp_path):
    # the guard refuses fence changes only: the same tool writes a sound rewrite
    engine, script = scripted
    (tmp_path / "area.py").write_text(SOURCE)
    new = SOURCE.replace("The area of a rectangle.", "Width times height.")
    script.set(prompts.fence(new, "python"))
    result = rewrite(engine, tmp_path)
    assert not result.is_error, text_of(result)
    assert result.structured_content["applied"] is True
    assert (tmp_path / "area.py").read_text() == new
