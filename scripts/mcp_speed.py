"""Speed of an MCP file tool (rewrite_file by default) with lookup drafting vs plain decoding.

    python scripts/mcp_speed.py FILE "INSTRUCTION" [--model DIR] [--tool rewrite_file|edit_file]

Runs the tool through the mcp Client (in memory) on a copy of FILE, once per mode,
and prints tokens, tokens/s, acceptance, and whether both modes produced the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def run_tool(engine, mode: str, root: Path, tool: str, name: str, instruction: str) -> dict:
    from mcp import Client

    from agent_bridge.mcp.backends import EngineBackend
    from agent_bridge.mcp.server import build_server
    from agent_bridge.mcp.workspace import Workspace

    server = build_server(EngineBackend(engine, mode=mode), Workspace(root))
    async with Client(server) as client:
        r = await client.call_tool(tool, {"path": name, "instruction": instruction, "return_text": True})
    if r.is_error:
        return {"mode": mode, "error": r.content[0].text[:300]}
    s = r.structured_content
    return {"mode": mode, "stats": s["stats"], "text": s["new_text"][name], "changed": s["changed_files"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("instruction")
    p.add_argument("--model", default=None)
    p.add_argument("--tool", default="rewrite_file", choices=["rewrite_file", "edit_file"])
    p.add_argument("--modes", default="baseline,lookup")
    args = p.parse_args()
    from engine import Engine, ensure_fast_blas

    ensure_fast_blas()
    root = Path(tempfile.mkdtemp())
    src = Path(args.file)
    shutil.copy(src, root / src.name)
    results = []
    with Engine(args.model) as engine:
        for mode in args.modes.split(","):
            results.append(asyncio.run(run_tool(engine, mode, root, args.tool, src.name, args.instruction)))
    for r in results:
        s = r.get("stats", {})
        keep = {k: s.get(k) for k in ("generated_tokens", "decode_tok_s", "acceptance_rate", "mean_accepted", "decode_s", "wall_s")}
        print(json.dumps({"mode": r["mode"], **keep, "error": r.get("error")}))
    texts = {r.get("text") for r in results if "text" in r}
    print(json.dumps({"file": str(src), "same_text_all_modes": len(texts) == 1,
                      "changed": [r.get("changed") for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
