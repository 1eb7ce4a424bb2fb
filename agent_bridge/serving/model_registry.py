"""Several models behind one server, switched without a restart.

A small layer in front of the engines: each loaded model is a `Bridge` (its engine, chat
syntax, name). A request picks one with `await use_model(request, req.model)`:

- no model, or a name this machine doesn't know (agents send their own names): the current one;
- the current or another loaded model's name: that one;
- a model on this machine that isn't loaded: loaded and made current with `allow_switch`,
  else a 404 in the API's own shape.

`POST /v1/models/load {"model": NAME_OR_PATH}` loads one and makes it current. Loads run one
at a time, beside the current model; requests that would go to the current model wait for
the switch. A request holds a lease on its model until its response has ended (LeaseMiddleware),
so requests in flight, or queued in the old engine, finish there. Beyond `max_models` loaded,
the least recently used idle model is closed; closing writes its prefix cache to the disk
tier, keyed by that model's own identity, so it starts warm when it comes back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import model_locations, physical_memory_bytes

from agent_bridge.chat.http_errors import ApiError
from agent_bridge.chat.json_body import read_json
from agent_bridge.serving.bridge import Bridge

log = logging.getLogger(__name__)
CATALOG_TTL_S = 30.0
DEFAULT_MEMORY_SHARE = 0.75  # of physical memory, for the weights of all loaded models together


def weights_bytes(path: str) -> int:
    """What a model's weights take in memory, about: their files' size."""
    try:
        return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    except OSError:
        return 0


def default_memory_budget() -> int:
    memory = physical_memory_bytes()
    return int(memory * DEFAULT_MEMORY_SHARE) if memory else 1 << 62  # unknown: no limit


class EngineHandle:
    """The current model's engine for whoever holds one engine for good (the MCP tools at /mcp):
    every attribute is looked up on the engine current at that moment."""

    def __init__(self, engine: Any):
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class ModelRegistry:
    def __init__(self, first: Bridge, load_engine: Callable[[str], Any] | None, *, allow_switch: bool = False,
                 max_models: int = 1, models_dirs: list[str] = (), context_window: int | None = None,
                 handle: EngineHandle | None = None, memory_budget: int | None = None):
        if max_models < 1:
            raise ValueError("max_models must be >= 1")
        self.loaded: OrderedDict[str, Bridge] = OrderedDict({first.model_name: first})  # least recently used first
        self.current = first.model_name
        self.load_engine = load_engine
        self.allow_switch = allow_switch
        self.max_models = max_models
        self.models_dirs = list(models_dirs)
        self.context_window = context_window  # the server's cap (--context-window), applied to each model
        self.handle = handle
        self.memory_budget = memory_budget or default_memory_budget()
        self.leases: dict[str, int] = {}
        self.loading: dict[str, asyncio.Future] = {}
        self._load_lock: asyncio.Lock | None = None
        self._catalog: tuple[float, dict] | None = None
        self._paths: dict[str, str] = {first.model_name: str(getattr(first.engine, "model_path", ""))}

    # -- which model a request gets ---------------------------------------------------

    def _known(self) -> dict[str, str]:
        """name -> folder of the models on this machine (cached a little: it walks folders)."""
        now = time.monotonic()
        if self._catalog is None or now - self._catalog[0] > CATALOG_TTL_S:
            self._catalog = (now, {name: str(path) for name, path, _ in model_locations(self.models_dirs)})
        return self._catalog[1]

    def _locate(self, name: str, allow_paths: bool = False) -> tuple[str, str] | None:
        """(name, folder) of a model on this machine, by its listed name or, with allow_paths
        (POST /v1/models/load only: a request's `model` never opens arbitrary folders), its
        folder; a folder already loaded under another name gives that name."""
        known = self._known()
        if name in known:
            path = known[name]
        elif allow_paths and name.startswith(("/", "~", ".")) and (Path(name).expanduser() / "config.json").is_file():
            path = str(Path(name).expanduser())
            name = next((k for k, p in known.items() if same_folder(p, path)), path)
        else:
            return None
        for loaded_name, loaded_path in self._paths.items():
            if loaded_name in self.loaded and same_folder(loaded_path, path):
                return loaded_name, loaded_path
        return name, path

    async def pick(self, requested: str) -> Bridge:
        """The bridge for a request's `model` field (see the module docstring)."""
        if requested and requested in self.loaded:
            return self.loaded[requested]
        if requested and requested not in self.loading:
            located = await anyio.to_thread.run_sync(self._locate, requested)
            if located is not None and located[0] in self.loaded:
                return self.loaded[located[0]]
            if located is not None:
                if not self.allow_switch:
                    raise ApiError(404, f"model {requested!r} is on this machine but not loaded; this server serves "
                                        f"{self.current!r} (start it with --allow-switch, or POST /v1/models/load)",
                                   code="model_not_found", param="model")
                return await self.load(located[0], located[1])
        if requested in self.loading:
            return await asyncio.shield(self.loading[requested])
        if self.loading:  # a switch is under way: what would go to the current model waits for it
            await asyncio.gather(*[asyncio.shield(f) for f in self.loading.values()], return_exceptions=True)
        return self.loaded[self.current]

    def acquire(self, bridge: Bridge) -> None:
        self.leases[bridge.model_name] = self.leases.get(bridge.model_name, 0) + 1
        self.loaded.move_to_end(bridge.model_name)

    def release(self, bridge: Bridge) -> None:
        self.leases[bridge.model_name] -= 1
        self._evict()

    # -- loading and releasing ------------------------------------------------------------

    async def load(self, name: str, path: str) -> Bridge:
        """Load `path` beside the current model and make it current (one load at a time)."""
        if name in self.loaded:
            self._make_current(name)
            return self.loaded[name]
        if name in self.loading:
            return await asyncio.shield(self.loading[name])
        if self.load_engine is None:
            raise ApiError(400, "this server can't load other models")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.loading[name] = future
        try:
            if self._load_lock is None:
                self._load_lock = asyncio.Lock()
            async with self._load_lock:
                self._make_room(name, path)
                started = time.monotonic()
                try:
                    engine = await anyio.to_thread.run_sync(self.load_engine, path)
                except Exception as e:
                    raise ApiError(400, f"could not load model {name!r}: {e}", param="model") from None
                first = next(iter(self.loaded.values()))
                bridge = Bridge.for_engine(engine, self.context_window, first.default_max_tokens, name,
                                           first.max_queue)
                # one set of server metrics; thinking signed by one model's replies verifies on the next
                bridge = dataclasses.replace(bridge, metrics=first.metrics, signer=first.signer,
                                             strict_tools=first.strict_tools)
                self.loaded[name] = bridge
                self._paths[name] = path
                previous = self.current
                self._make_current(name)
                log.info("model %s loaded in %.1f s; was %s", name, time.monotonic() - started, previous)
            future.set_result(bridge)
            self._evict()
            return bridge
        except BaseException as e:
            if not future.done():
                future.set_exception(e)
                future.exception()  # retrieved: waiters get it, nobody else must
            raise
        finally:
            self.loading.pop(name, None)

    def _make_room(self, name: str, path: str) -> None:
        """Release idle models (not the current one) until the new one's weights fit beside
        the rest in the memory budget; refuse clearly when they can't."""
        need = weights_bytes(path)
        for old in list(self.loaded):
            used = sum(weights_bytes(self._paths.get(n, "")) for n in self.loaded)
            if used + need <= self.memory_budget:
                return
            if old != self.current and self.leases.get(old, 0) == 0:
                threading.Thread(target=_close, args=(self.loaded.pop(old),), daemon=True).start()
        used = sum(weights_bytes(self._paths.get(n, "")) for n in self.loaded)
        if used + need > self.memory_budget:
            raise ApiError(400, f"model {name!r} ({need / 2**20:.0f} MB of weights) does not fit beside the loaded "
                                f"{', '.join(map(repr, self.loaded))} ({used / 2**20:.0f} MB) in the memory budget of "
                                f"{self.memory_budget / 2**20:.0f} MB (--models-memory-mb)", param="model")

    def _make_current(self, name: str) -> None:
        self.current = name
        if self.handle is not None:
            self.handle.engine = self.loaded[name].engine

    def _evict(self) -> None:
        """Close least recently used idle models while more than max_models are loaded."""
        for name in list(self.loaded):
            if len(self.loaded) <= self.max_models:
                return
            if name == self.current or self.leases.get(name, 0) > 0:
                continue
            bridge = self.loaded.pop(name)
            # Closing waits for the engine's queue and writes its prefix cache to disk: off the loop.
            threading.Thread(target=_close, args=(bridge,), name=f"mlx-dspark-release-{name}", daemon=True).start()

    def close_all(self) -> None:
        for bridge in self.loaded.values():
            _close(bridge)

    def describe(self) -> dict:
        return {"current": self.current, "loaded": list(self.loaded), "loading": list(self.loading),
                "allow_switch": self.allow_switch, "max_models": self.max_models}


def _close(bridge: Bridge) -> None:
    try:
        bridge.engine.close()
        log.info("model %s released", bridge.model_name)
    except Exception as e:  # noqa: BLE001 - releasing must not take the server down
        log.warning("model %s: close failed: %s", bridge.model_name, e)


def same_folder(a: str, b: str) -> bool:
    try:
        return bool(a and b) and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


# -- what the routes use ----------------------------------------------------------------

def current_bridge(request: Request) -> Bridge:
    registry: ModelRegistry | None = getattr(request.app.state, "models", None)
    return request.app.state.bridge if registry is None else registry.loaded[registry.current]


async def use_model(request: Request, requested: str) -> Bridge:
    """The bridge this request runs on, leased until its response has ended."""
    registry: ModelRegistry | None = getattr(request.app.state, "models", None)
    if registry is None:
        return request.app.state.bridge
    bridge = await registry.pick(requested or "")
    registry.acquire(bridge)
    request.scope.setdefault("mlx_dspark_leases", []).append(bridge)
    return bridge


class LeaseMiddleware:
    """Gives back a request's model leases once its response (streams included) has ended."""

    def __init__(self, app: Callable, registry: ModelRegistry):
        self.app, self.registry = app, registry

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            for bridge in scope.get("mlx_dspark_leases", ()):
                self.registry.release(bridge)


async def load_model(request: Request):
    """POST /v1/models/load {"model": NAME_OR_PATH}: load it and make it the current model."""
    registry: ModelRegistry = request.app.state.models
    body = await read_json(request)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model: expected a model name or folder (see GET /v1/models?all=1)", param="model")
    started = time.monotonic()
    if name in registry.loaded:
        bridge = await registry.load(name, registry._paths.get(name, ""))
    else:
        located = await anyio.to_thread.run_sync(registry._locate, name, True)
        if located is None:
            raise ApiError(404, f"model {name!r} not found on this machine (see GET /v1/models?all=1)",
                           code="model_not_found", param="model")
        bridge = await registry.load(*located)
    return JSONResponse({"model": bridge.model_name, "context_window": bridge.context_window,
                         "load_s": round(time.monotonic() - started, 3), **registry.describe()})


routes = [Route("/v1/models/load", load_model, methods=["POST"])]
