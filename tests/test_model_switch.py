"""Switching models without a restart (agent_bridge/serving/model_registry.py), with the real openai
and anthropic SDKs over a real socket, on two tiny random models (a qwen3 "alpha" and a
llama "beta") in a models folder.

Under load: alpha's engine thread is held busy while streams to it are queued there; beta is
loaded beside it and made current; new requests run on beta at once; then alpha is let go,
its streams finish on it, and it is released with its prefix cache on disk under its own
identity (a later switch back starts warm). Every output equals that model's output alone.
"""

from __future__ import annotations

import shutil
import threading
import time

import anthropic
import httpx
import openai
import pytest

from agent_bridge.serving.model_registry import EngineHandle
from agent_bridge.app import create_app
from engine import Engine
from engine.caches.prefix_cache import cache_identity
from server_harness import RunningServer

PROMPTS = ["def rename_symbol(path, old, new):", "class Engine:\n    def __init__(self, model):", "for i in range(10):"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    root = tmp_path_factory.mktemp("switch-models")
    shutil.copytree(tiny_model_dir, root / "alpha")
    shutil.copytree(tiny_llama_dir, root / "beta")
    return root


def _oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _stream_text(url: str, model: str, prompt: str) -> tuple[str, str]:
    chunks = list(_oai(url).chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")  # the stream ended properly
    return chunks[0].model, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _anthropic_text(url: str, model: str, prompt: str) -> str:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    with client.messages.stream(model=model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}]) as s:
        return "".join(s.text_stream)


@pytest.fixture(scope="module")
def alone(models_dir):
    """Each model's outputs when it is the only one served."""
    out = {}
    for name in ("alpha", "beta"):
        with Engine(str(models_dir / name), prefix_cache=False) as engine, RunningServer(create_app(engine)) as srv:
            out[name] = {"openai": [_stream_text(srv.url, "x", p)[1] for p in PROMPTS],
                         "anthropic": _anthropic_text(srv.url, "x", PROMPTS[0])}
    assert out["alpha"]["openai"] != out["beta"]["openai"]  # the two models are told apart by their outputs
    return out


def _wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_switch_under_load(models_dir, alone, tmp_path):
    disk = tmp_path / "kv"
    load = lambda path: Engine(path, prefix_cache_dir=str(disk))  # noqa: E731
    alpha = load(str(models_dir / "alpha"))
    alpha_identity = alpha.call(lambda t: cache_identity(t, None))
    handle = EngineHandle(alpha)  # what the MCP tools hold
    app = create_app(alpha, model_name="alpha", load_engine=load, allow_switch=True, models_dirs=[str(models_dir)],
                     engine_handle=handle)
    registry = app.state.models
    with RunningServer(app) as srv:
        gate = threading.Event()
        holder = threading.Thread(target=alpha.call, args=(lambda t: gate.wait(120),), daemon=True)
        holder.start()  # alpha's engine thread is busy: what is sent to it now waits in its queue
        results: dict = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _stream_text(srv.url, "alpha", PROMPTS[i])))
                   for i in range(len(PROMPTS))]
        threads.append(threading.Thread(target=lambda: results.__setitem__("a", _anthropic_text(srv.url, "alpha", PROMPTS[0]))))
        for t in threads:
            t.start()
        _wait(lambda: registry.leases.get("alpha", 0) == len(threads))

        r = httpx.post(srv.url + "/v1/models/load", json={"model": "beta"}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["current"] == "beta" and r.json()["loaded"] == ["alpha", "beta"]  # alpha still busy
        assert handle.engine is registry.loaded["beta"].engine and handle.model_path.endswith("beta")
        # New requests go to beta at once, not behind alpha's queue (no model, or a name nobody knows).
        assert _stream_text(srv.url, "", PROMPTS[1]) == ("beta", alone["beta"]["openai"][1])
        assert _stream_text(srv.url, "claude-sonnet-4-5", PROMPTS[2])[1] == alone["beta"]["openai"][2]
        assert not any(k in results for k in range(len(PROMPTS)))  # alpha's streams are still waiting

        gate.set()
        for t in threads:
            t.join(120)
        assert [results[i] for i in range(len(PROMPTS))] == [("alpha", text) for text in alone["alpha"]["openai"]]
        assert results["a"] == alone["alpha"]["anthropic"]
        _wait(lambda: "alpha" not in registry.loaded and alpha._closed)  # released once its streams ended
        assert list((disk / alpha_identity).glob("*.safetensors"))  # its prefix cache, under its own identity

        # Naming alpha again (allow_switch) brings it back, warm from the disk tier.
        c = _oai(srv.url).chat.completions.create(model="alpha", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                  max_tokens=MAX_TOKENS, temperature=0)
        assert c.choices[0].message.content == alone["alpha"]["openai"][0]
        assert c.usage.prompt_tokens_details.cached_tokens > 0
        assert registry.current == "alpha" and list(registry.loaded) == ["alpha"]
        assert handle.engine is registry.loaded["alpha"].engine and handle.engine is not alpha
        health = httpx.get(srv.url + "/health").json()
        assert health["model"] == "alpha" and health["models"]["loaded"] == ["alpha"]
    registry.close_all()


def test_without_allow_switch_a_known_model_is_a_404(models_dir, alone, tmp_path):
    gate = threading.Event()

    def load(path):  # a slow load: what arrives meanwhile for the current model waits for the switch
        gate.wait(120)
        return Engine(path, prefix_cache=False)

    gate.set()
    alpha = load(str(models_dir / "alpha"))
    gate.clear()
    app = create_app(alpha, model_name="alpha", load_engine=load, models_dirs=[str(models_dir)], max_models=2)
    with RunningServer(app) as srv:
        with pytest.raises(openai.NotFoundError) as e:
            _oai(srv.url).chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and "--allow-switch" in e.value.body["message"]
        claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as e:
            claude.messages.create(model="beta", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "not_found_error"
        # names this machine doesn't know are served by the current model, as agents expect
        assert _stream_text(srv.url, "gpt-5-codex", PROMPTS[0]) == ("gpt-5-codex", alone["alpha"]["openai"][0])
        # a folder path in a request's `model` opens nothing (only POST /v1/models/load takes paths)
        assert _stream_text(srv.url, str(models_dir / "beta"), PROMPTS[0])[1] == alone["alpha"]["openai"][0]
        r = httpx.post(srv.url + "/v1/models/load", json={"model": "gamma"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(srv.url + "/v1/models/load", json={"model": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        # the explicit load works without --allow-switch; with --max-models 2 both stay loaded
        loaded: dict = {}
        loader = threading.Thread(target=lambda: loaded.setdefault("r", httpx.post(
            srv.url + "/v1/models/load", json={"model": str(models_dir / "beta")}, timeout=120)))
        loader.start()
        _wait(lambda: app.state.models.loading)
        waiting = threading.Thread(target=lambda: loaded.setdefault("default", _stream_text(srv.url, "", PROMPTS[1])))
        waiting.start()
        time.sleep(1.0)
        assert "default" not in loaded  # it waits for the model being loaded
        gate.set()
        loader.join(120)
        waiting.join(120)
        r = loaded["r"]
        assert r.status_code == 200 and r.json()["loaded"] == ["alpha", "beta"], r.text
        assert loaded["default"] == ("beta", alone["beta"]["openai"][1])
        listed = _oai(srv.url).models.list()
        assert [(m.id, m.model_extra["current"]) for m in listed] == [("beta", True), ("alpha", False)]
        assert _stream_text(srv.url, "alpha", PROMPTS[2])[1] == alone["alpha"]["openai"][2]
        assert _stream_text(srv.url, "beta", PROMPTS[2])[1] == alone["beta"]["openai"][2]
    app.state.models.close_all()


def test_serve_command_switches(models_dir, tmp_path):
    """The CLI wiring: `serve --allow-switch --models-dir`, a load, then a request naming the first model."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = subprocess.Popen([sys.executable, "-m", "agent_bridge", "serve", "--model", str(models_dir / "alpha"),
                             "--models-dir", str(models_dir), "--allow-switch", "--port", str(port),
                             "--prefix-cache-dir", str(tmp_path / "kv"), "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def up():
            assert proc.poll() is None, proc.stderr.read()
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        _wait(up, 120)
        r = httpx.post(url + "/v1/models/load", json={"model": "beta"}, timeout=120)
        assert r.status_code == 200 and r.json()["loaded"] == ["beta"], r.text  # --max-models 1: alpha released
        assert httpx.get(url + "/health").json()["model"] == "beta"
        assert _stream_text(url, "alpha", PROMPTS[0])[0] == "alpha"
        assert httpx.get(url + "/health").json()["models"]["loaded"] == ["alpha"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_memory_budget_refuses_what_does_not_fit(models_dir):
    alpha = Engine(str(models_dir / "alpha"), prefix_cache=False)
    size_mb = sum(p.stat().st_size for p in (models_dir / "alpha").glob("*.safetensors")) / 2**20
    app = create_app(alpha, model_name="alpha", load_engine=lambda p: Engine(p, prefix_cache=False), max_models=2,
                     models_dirs=[str(models_dir)], models_memory_mb=size_mb * 1.5)
    with RunningServer(app) as srv:
        r = httpx.post(srv.url + "/v1/models/load", json={"model": "beta"}, timeout=120)
        assert r.status_code == 400 and "does not fit beside the loaded 'alpha'" in r.json()["error"]["message"]
        assert app.state.models.describe()["loaded"] == ["alpha"]  # nothing changed, still serving
        assert _stream_text(srv.url, "", PROMPTS[0])[0] == "alpha"
    app.state.models.close_all()
