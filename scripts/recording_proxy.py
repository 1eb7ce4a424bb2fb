"""A pass-through HTTP proxy that records each request a client sends to a server, as one JSON line
(`{"path", "headers", "body"}`: the format of ../shared/fixtures/claude-code/*.jsonl).

    .venv/bin/python scripts/recording_proxy.py --upstream http://127.0.0.1:8080 --out FILE.jsonl [--port 8081]

then point the client at the proxy (`ANTHROPIC_BASE_URL=http://127.0.0.1:8081 claude -p ...`).
Responses, streamed ones included, pass back unchanged. scripts/agent_rename_eval.py `--capture DIR`
puts one in front of its server and writes one file per session. Captured sessions are third-party
text (Claude Code's prompts): keep them out of the repository.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


class Recorder:
    """Where the next requests go: `out` (a JSONL file, appended) or nowhere when None."""

    def __init__(self, out: Path | None = None):
        self.out = out
        self.lock = threading.Lock()

    def record(self, path: str, headers: dict, raw: bytes) -> None:
        if self.out is None:
            return
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        with self.lock, open(self.out, "a") as f:
            f.write(json.dumps({"path": path, "headers": headers, "body": body}) + "\n")


def proxy_app(upstream: str, recorder: Recorder) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def forward(request: Request):
        raw = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if request.method == "POST":
            recorder.record(path, headers, raw)
        upstream_request = client.build_request(request.method, path, headers=headers, content=raw)
        response = await client.send(upstream_request, stream=True)
        passed = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        return StreamingResponse(response.aiter_raw(), status_code=response.status_code, headers=passed,
                                 background=BackgroundTask(response.aclose))

    methods = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


class RecordingProxy:
    """The proxy on a free loopback port in a background thread: `with RecordingProxy(url) as p:`
    then `p.url`; `p.recorder.out = FILE` starts recording into FILE."""

    def __init__(self, upstream: str, out: Path | None = None):
        from server_harness import RunningServer

        self.recorder = Recorder(out)
        self.server = RunningServer(proxy_app(upstream, self.recorder))
        self.url = self.server.url

    def __enter__(self) -> "RecordingProxy":
        self.server.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="the server's base URL")
    ap.add_argument("--out", required=True, help="JSONL file to append the requests to")
    ap.add_argument("--port", type=int, default=8081)
    args = ap.parse_args()
    uvicorn.run(proxy_app(args.upstream.rstrip("/"), Recorder(Path(args.out))), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
