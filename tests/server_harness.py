"""A real uvicorn server on a free loopback port, in a background thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class RunningServer:
    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """Raw SSE text -> [(event name or None, data)], comments dropped."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if data:
            out.append((event, "\n".join(data)))
    return out


def check_anthropic_stream(text: str) -> list[dict]:
    """Assert the Messages API's event grammar; returns the decoded events."""
    import json

    events = []
    for name, data in sse_events(text):
        payload = json.loads(data)
        assert payload["type"] == name, (name, payload)
        events.append(payload)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    usage = events[0]["message"]["usage"]
    assert isinstance(usage["input_tokens"], int) and usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    assert events[0]["message"]["id"].startswith("msg_")
    open_index, next_index = None, 0
    for e in events[1:-2]:
        if e["type"] == "ping":
            continue
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == next_index, kinds
            open_index, next_index = e["index"], next_index + 1
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index, kinds
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index, kinds
            open_index = None
        else:
            raise AssertionError(f"unexpected event {e['type']} in {kinds}")
    assert open_index is None and next_index >= 1
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    return events
