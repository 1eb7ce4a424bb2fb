"""A local HTTP server that speaks enough of the Hugging Face hub's file API for
`huggingface_hub.snapshot_download` (point HF_ENDPOINT at it):

    GET  /api/models/{repo}[/revision/{rev}]   repo info: sha, siblings
    GET  /api/models/{repo}/tree/{rev}          the file listing (recursive)
    HEAD /{repo}/resolve/{rev}/{file}           X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{file}           the bytes, honouring `Range: bytes=N-`

`cut_after` ({"repo/file": n}) makes the first full GET of a file stop after that many bytes: with
`cut="close"` the connection is dropped (the client retries and resumes), with
`cut="stall"` the server waits, as a dying network does (the test kills the client).
Every request is logged as (method, path, Range header).

    python tests/fake_hub.py REPO_ID=FOLDER [...]   serves folders by hand (prints the URL)
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, repos: dict[str, Path], cut_after: dict[str, int] | None = None, cut: str = "close",
                 delay_per_chunk_s: float = 0.0):
        self.repos = {rid: Path(p) for rid, p in repos.items()}
        self.commits = {rid: hashlib.sha1(rid.encode()).hexdigest() for rid in repos}
        self.cut_after = dict(cut_after or {})
        self.cut = cut
        self.delay = delay_per_chunk_s
        self.log: list[tuple[str, str, str | None]] = []
        self.sent: dict[str, int] = {}  # "repo/file" -> bytes sent so far, all requests
        self.release = threading.Event()  # ends a stall
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.handle(self, head=True)

            def do_GET(self):
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    # -- routes ----------------------------------------------------------------------

    def files(self, repo_id: str) -> list[Path]:
        root = self.repos[repo_id]
        return sorted(p for p in root.rglob("*") if p.is_file())

    def _json(self, h, body, status: int = 200) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _repo(self, path: str) -> tuple[str | None, str]:
        for rid in self.repos:
            if path == rid or path.startswith(rid + "/"):
                return rid, path[len(rid):].lstrip("/")
        return None, path

    def handle(self, h, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.log.append((h.command, path, h.headers.get("Range")))
        if path.startswith("/api/models/"):
            rid, rest = self._repo(path[len("/api/models/"):])
            if rid is None:
                return self._json(h, {"error": "Repository not found"}, 404)
            if rest.startswith("tree/"):
                root = self.repos[rid]
                return self._json(h, [{"type": "file", "path": str(p.relative_to(root)), "size": p.stat().st_size,
                                       "oid": self.etag(p)} for p in self.files(rid)])
            return self._json(h, {"id": rid, "modelId": rid, "sha": self.commits[rid], "private": False,
                                  "siblings": [{"rfilename": str(p.relative_to(self.repos[rid]))} for p in self.files(rid)]})
        rid, rest = self._repo(path.lstrip("/"))
        m = re.fullmatch(r"resolve/([^/]+)/(.+)", rest) if rid else None
        if m is None or not (self.repos[rid] / m.group(2)).is_file():
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.send_header("X-Error-Code", "EntryNotFound")
            h.end_headers()
            return
        self.serve_file(h, rid, self.repos[rid] / m.group(2), m.group(2), head)

    @staticmethod
    def etag(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    def serve_file(self, h, rid: str, file: Path, name: str, head: bool) -> None:
        data = file.read_bytes()
        start = 0
        rng = h.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())):
            start = int(m.group(1))
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", self.commits[rid])
        h.send_header("ETag", f'"{self.etag(file)}"')
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        if head:
            return
        key = f"{rid}/{name}"
        cut = self.cut_after.pop(key, None) if start == 0 else None
        end = len(data) if cut is None else min(cut, len(data))
        pos = start
        while pos < end:
            chunk = data[pos:min(end, pos + 4096)]
            h.wfile.write(chunk)
            h.wfile.flush()
            pos += len(chunk)
            self.sent[key] = self.sent.get(key, 0) + len(chunk)
            if self.delay:
                time.sleep(self.delay)
        if cut is not None:
            if self.cut == "stall":
                self.release.wait(120)
            h.close_connection = True
            try:
                h.connection.shutdown(2)
            except OSError:
                pass


if __name__ == "__main__":
    import sys

    repos = dict(arg.split("=", 1) for arg in sys.argv[1:])
    with FakeHub(repos, delay_per_chunk_s=0.002) as hub:
        print(hub.url, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
