"""A real uvicorn server on a free loopback port, in a background thread, for the server tests."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from agent_bridge.app import UVICORN_OPTIONS


def free_port() -> int:
    """A port free on the loopback now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_test(cli, name: str):
    """A decorator for a slow test that runs a real agent CLI from .node (`cli`, its path),
    skipped where Node.js or the CLI is absent."""
    def mark(test):
        for m in (pytest.mark.slow,
                  pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed (setup.sh needs npm)"),
                  pytest.mark.skipif(not cli.exists(), reason=f"{name} is absent: run setup.sh")):
            test = m(test)
        return test
    return mark


@contextmanager
def engine_held(engine):
    """The engine thread blocked in a call (between two steps of whatever runs) until the block ends.
    Yields `still_held()`: whether the engine is blocked yet (what answered meanwhile didn't wait for it)."""
    started, gate = threading.Event(), threading.Event()

    def block(_target):
        started.set()
        gate.wait(120)

    t = threading.Thread(target=engine.call, args=(block,), daemon=True)
    t.start()
    assert started.wait(60), "the engine never ran the blocking call"
    try:
        yield t.is_alive
    finally:
        gate.set()
        t.join(60)


class RunningServer:
    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **UVICORN_OPTIONS))
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


def build_agent_sized_model(out, vocab_size: int = 16384, layers: int = 1, context: int = 65536):
    """A tiny random model whose tokenizer has a real-sized vocabulary (trained here on the
    Python standard library's source), so a 100 KB agent prompt is ~20k tokens, not ~40k,
    and whose context fits Claude Code's prompt."""
    import functools
    import glob
    import json
    import sysconfig
    from pathlib import Path

    import tiny_models

    lib = sysconfig.get_paths()["stdlib"]
    texts = [Path(f).read_text(errors="ignore") for f in sorted(glob.glob(lib + "/*.py"))[:80]]
    saved = tiny_models.TRAINING_TEXT, tiny_models.build_tokenizer
    try:
        tiny_models.TRAINING_TEXT = texts + list(saved[0])
        tiny_models.build_tokenizer = functools.partial(saved[1], vocab_size=vocab_size)
        out = tiny_models.build_tiny_model(Path(out), layers=layers, context=context)
    finally:
        tiny_models.TRAINING_TEXT, tiny_models.build_tokenizer = saved
    cfg_path = Path(out) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = context
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return Path(out)


def force_reply(model_dir, after: str, reply: str):
    """Rewrite a tiny model's weights so that it is a bigram model whose greedy output after
    the text `after` (e.g. the chat template's generation prompt) is `reply` then EOS,
    whatever came before: every layer's output projections are zeroed (the residual stream
    is the current token's embedding) and lm_head maps each token of the chain to the next."""
    import json
    from pathlib import Path

    import mlx.core as mx
    import numpy as np
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    chain = [tok.encode(after, add_special_tokens=False).ids[-1]] + tok.encode(reply, add_special_tokens=False).ids + [eos]
    assert len(set(chain[:-1])) == len(chain) - 1, "the reply must not repeat a token (or its start token)"
    weights = {k: np.array(v) for k, v in mx.load(str(model_dir / "model.safetensors")).items()}
    for k in weights:
        if k.endswith("self_attn.o_proj.weight") or k.endswith("mlp.down_proj.weight"):
            weights[k][:] = 0
    emb, norm_w = weights["model.embed_tokens.weight"], weights["model.norm.weight"]
    eps = config.get("rms_norm_eps", 1e-6)

    def hidden(t):
        e = emb[t]
        return norm_w * e / np.sqrt(np.mean(e * e) + eps)

    head = weights["lm_head.weight"] * 0.01
    for a, b in zip(chain, chain[1:]):
        h = hidden(a)
        head[b] += 100.0 * h / float(h @ h)
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(model_dir / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return model_dir
