"""Issue 13 item 6: every tokenizer call (server routes, the in-process MCP backend,
starts_thinking, the engine's own detokenizing) goes through the engine's one lock.

Hugging Face fast tokenizers fail with "Already borrowed" when two threads use one at
once; the tiny test tokenizer doesn't reproduce that race, so this checks the one way in:
while the lock is held, no path gets to the tokenizer."""

from __future__ import annotations

import threading
import time

import pytest


def blocked_while_locked(engine, fn) -> bool:
    """True if fn() waits while the engine's tokenizer lock is held, and finishes after."""
    done = threading.Event()
    with engine.tokenizer_lock:
        t = threading.Thread(target=lambda: (fn(), done.set()), daemon=True)
        t.start()
        time.sleep(0.3)
        waited = not done.is_set()
    t.join(timeout=30)
    return waited and done.is_set()


def test_mcp_backend_uses_the_engine_lock(tiny_engine):
    from agent_bridge.mcp.backends import EngineBackend

    backend = EngineBackend(tiny_engine)
    messages = [{"role": "user", "content": "hello there"}]
    assert blocked_while_locked(tiny_engine, lambda: backend.count_tokens("some text"))
    assert blocked_while_locked(tiny_engine, lambda: backend.room(messages))


def test_server_paths_use_the_engine_lock(tiny_engine):
    import asyncio

    from agent_bridge.chat.chat_request import ChatRequest
    from agent_bridge.serving.bridge import Bridge

    bridge = Bridge.for_engine(tiny_engine, None, 64)
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}])
    assert blocked_while_locked(tiny_engine, lambda: asyncio.run(bridge.prompt_ids(req)))
    assert blocked_while_locked(tiny_engine, lambda: asyncio.run(bridge.encode("some text")))
    assert blocked_while_locked(tiny_engine, lambda: bridge.starts_thinking([1, 2, 3]) or True)


def test_generation_detokenizes_under_the_lock(tiny_engine):
    from engine import GenerationRequest

    assert blocked_while_locked(tiny_engine, lambda: tiny_engine.submit(
        GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=3, mode="baseline")).result())
