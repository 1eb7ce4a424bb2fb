"""Signatures of the thinking blocks this server sends (Anthropic `signature_delta`).

Claude Code keeps a thinking block only if it carries a signature, and sends it back in the
next request. The signature is an HMAC-SHA256 of the thinking text under a key of this server
(`MLX_DSPARK_THINKING_KEY`, else random per process), so a block that comes back can be checked:

- signed by this server, text unchanged: the model's own reasoning, shown to its template again
  (templates that keep earlier reasoning render it, so the prompt is what the model wrote);
- anything else (edited text, a signature from another server or from Anthropic, a key that
  changed with a restart, `redacted_thinking`): left out of the prompt, never an error (a session
  that switched servers must keep working), and said in the response's `mlx_dspark.notes`.
  A client can't put words in the model's mouth as "its own reasoning".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets

PREFIX = "mlxd1."


class ThinkingSigner:
    def __init__(self, key: bytes | None = None):
        env = os.environ.get("MLX_DSPARK_THINKING_KEY")
        self.key = key or (env.encode() if env else secrets.token_bytes(32))

    def sign(self, thinking: str) -> str:
        mac = hmac.new(self.key, b"mlx-dspark thinking\0" + thinking.encode("utf-8"), hashlib.sha256).digest()
        return PREFIX + base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def verify(self, thinking: str, signature: object) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign(thinking), signature)
