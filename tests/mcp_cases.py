"""Files and model replies for the MCP safety tests (tests/test_mcp_safety.py, test_mcp_paths.py):
a tiny model is trained on exactly these chats (conftest.safety_engine)."""

from __future__ import annotations

import prompts

SPREAD = "".join(f"v{i} = {i}\n" for i in range(40))
SPREAD_EDITED = SPREAD.replace("v1 = 1\n", "v1 = 100\n").replace("v12 = 12\n", "v12 = 100\n") \
    .replace("v24 = 24\n", "v24 = 100\n").replace("v36 = 36\n", "v36 = 100\n")
SPREAD_INSTRUCTION = "set v1, v12, v24 and v36 to 100"
ONE = "def add(a, b):\n    return a + b\n"
ONE_BAD = "def plus(a, b):\n    return a - b\n"  # renamed, and the body changed: not a rename
FILES = {"a.py": "from m import add\nadd(1, 2)\n", "b.py": "import m\nm.add(3, 4)\n",
         "c.py": "from m import add as add\nprint(add)\n"}


def renamed(text: str) -> str:
    return text.replace("add", "plus")


def safety_chats() -> list:
    from agent_bridge.mcp.server import task_messages

    chats = [(task_messages("edit_file", "spread.py", SPREAD, instruction=SPREAD_INSTRUCTION), prompts.fence(SPREAD_EDITED)),
             (task_messages("rename_symbol", "one.py", ONE, old="add", new="plus"), prompts.fence(ONE_BAD))]
    chats += [(task_messages("rename_symbol", p, t, old="add", new="plus"), prompts.fence(renamed(t))) for p, t in FILES.items()]
    return chats
