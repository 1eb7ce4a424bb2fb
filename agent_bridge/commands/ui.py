"""`mlx-dspark ui`: open the web app (chat, live telemetry, roofline, prefix cache,
integrations) in the browser. Serves first when nothing answers on --host/--port; any
other options are `serve`'s (e.g. `mlx-dspark ui --model DIR --api-key KEY`)."""

from __future__ import annotations

import argparse
import threading
import time

from agent_bridge.commands import CommandError, serve


def add_parser(sub) -> None:
    from agent_bridge.app import DEFAULT_HOST, DEFAULT_PORT

    p = sub.add_parser("ui", help="open the web app in the browser (serving first if no server is running)")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--no-browser", action="store_true", help="print the address instead of opening it")
    p.set_defaults(run=run, passthrough=[])


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _open(url: str, no_browser: bool) -> None:
    import webbrowser

    if no_browser or not webbrowser.open(url):
        print(f"mlx-dspark: the web app is at {url}", flush=True)


def run(args: argparse.Namespace) -> int:

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    if _answers(url):
        _open(url + "/", args.no_browser)
        return 0
    serve_parser = argparse.ArgumentParser(prog="mlx-dspark")
    serve.add_parser(serve_parser.add_subparsers())
    serve_args = serve_parser.parse_args(["serve", "--host", args.host, "--port", str(args.port), *args.passthrough])
    if not hasattr(serve_args, "run"):
        raise CommandError("serve did not parse")

    def open_when_up() -> None:
        deadline = time.monotonic() + 600  # loading a large model takes a while
        while time.monotonic() < deadline:
            if _answers(url):
                _open(url + "/", args.no_browser)
                return
            time.sleep(0.5)

    threading.Thread(target=open_when_up, daemon=True).start()
    return serve_args.run(serve_args)
