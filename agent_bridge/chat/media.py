"""Image blocks' bytes, for a model that reads images (a VLM target).

Anthropic `image` blocks (base64, or a `url` source), OpenAI `image_url` parts and Responses
`input_image` parts (data: URLs, file:// URLs and local paths). Remote URLs are never fetched:
a local server must not reach out to the network on a request's say-so; the client is told to
send the image inline. Each error is a 400 naming the block.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlparse

from agent_bridge.chat.http_errors import bad_request

IMAGE_BLOCKS = ("image", "image_url", "input_image")
MAX_IMAGE_BYTES = 20 << 20


def image_bytes(block: dict, where: str) -> bytes:
    """The image a block carries, as the bytes of its file (PNG, JPEG, ...)."""
    kind = block.get("type")
    if kind == "image":  # Anthropic
        source = block.get("source")
        if not isinstance(source, dict):
            raise bad_request(f"{where}.source: expected an object")
        if source.get("type") == "base64":
            return _base64(source.get("data"), f"{where}.source.data")
        if source.get("type") == "url":
            return _from_url(source.get("url"), f"{where}.source.url")
        raise bad_request(f"{where}.source.type: {source.get('type')!r} is not supported here "
                          "(send the image as base64)")
    if kind == "image_url":  # OpenAI chat: {"image_url": {"url": ...}} (or the URL itself)
        ref = block.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        return _from_url(url, f"{where}.image_url.url")
    if kind == "input_image":  # Responses: {"image_url": "..."} or {"file_id": ...}
        if block.get("image_url") is None and block.get("file_id") is not None:
            raise bad_request(f"{where}.file_id: this server keeps no files; send the image as a data: URL")
        return _from_url(block.get("image_url"), f"{where}.image_url")
    raise bad_request(f"{where}: {kind!r} is not an image block")


def _from_url(url: object, where: str) -> bytes:
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: expected a URL string")
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise bad_request(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
        return _base64(data, where)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise bad_request(f"{where}: remote image URLs are not fetched by this server; "
                          "send the image as base64 (a data: URL) or as a local file path")
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise bad_request(f"{where}: only local file:// URLs are read")
        return _read_file(Path(unquote(parsed.path)), where)
    if parsed.scheme == "" and (url.startswith("/") or url.startswith("~")):
        return _read_file(Path(url).expanduser(), where)
    raise bad_request(f"{where}: unsupported image URL (use a data: URL, a file:// URL or an absolute path)")


def _read_file(path: Path, where: str) -> bytes:
    try:
        if not path.is_file():
            raise bad_request(f"{where}: no such file: {path}")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise bad_request(f"{where}: {path} is larger than {MAX_IMAGE_BYTES >> 20} MB")
        return path.read_bytes()
    except OSError as e:
        raise bad_request(f"{where}: can't read {path}: {e.strerror or e}") from None


def _base64(data: object, where: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise bad_request(f"{where}: expected base64 image data")
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad_request(f"{where}: the image is larger than {MAX_IMAGE_BYTES >> 20} MB")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: not valid base64") from None
