"""A scripted model for protocol tests: a real tiny model run by the real engine, whose logits
are replaced so that, after the chat template's generation prompt, it writes a given reply
token by token and then EOS.

The tiny model still runs every forward (so the KV cache, rollback and speculative rounds
behave as usual); only its output is overridden. Each position's next token depends only on
the tokens before it, like any model's, so the engine's lossless verification applies.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

MARKER = "<|im_start|>assistant"  # the tiny template's generation prompt (tests/tiny_models.py)


class Script:
    def __init__(self, engine, marker: str = MARKER):
        self.tok = engine.tokenizer
        self.marker = list(self.tok.encode(marker, add_special_tokens=False))
        self.eos = self.tok.eos_token_id
        self.reply, self.ids = "", []
        self.history: list[int] = []
        self.start = -1  # the position after the last generation prompt seen
        self.matched = 0  # how many tokens after `start` are the reply's own tokens

    def set(self, *replies: str, turn_marker: str = "<tool_response>") -> None:
        """The reply to write; with several, the i-th answers a prompt holding i tool results
        (`turn_marker`, a special token), as an agent's turns after each tool call do."""
        self.replies = [(r, list(self.tok.encode(r, add_special_tokens=False))) for r in replies]
        self.turn_id = self.tok.convert_tokens_to_ids(turn_marker)
        self.reply, self.ids = self.replies[0]

    def begin_reply(self) -> None:
        """A generation prompt was read: pick the reply for this turn."""
        turn = self.history.count(self.turn_id) if len(self.replies) > 1 else 0
        self.reply, self.ids = self.replies[min(turn, len(self.replies) - 1)]

    def next_token(self, p: int) -> int:
        """The token after position p."""
        if self.start < 0 or p + 1 < self.start:
            return self.eos
        k = p + 1 - self.start  # tokens of the reply already written
        if k <= self.matched:
            return self.ids[k] if k < len(self.ids) else self.eos
        # the reply's start was written by the server (a forced tool call): go on from its text
        written = self.tok.decode(self.history[self.start : p + 1])
        if not self.reply.startswith(written) or written == self.reply:
            return self.eos
        return self.tok.encode(self.reply[len(written):], add_special_tokens=False)[0]


def script_engine(engine, marker: str = MARKER) -> Script:
    """Make `engine`'s model follow a Script (set its reply with `script.set(text)`); `marker` is
    the chat template's generation prompt. With the prefix cache on, a request that starts past
    position 0 continues the history of the requests before it (its cached prefix)."""
    script = Script(engine, marker)
    model = engine.target.model
    base = type(model)

    class Scripted(base):
        def __call__(self, inputs, cache=None, **kw):
            offset = cache[0].offset if cache else 0
            logits = base.__call__(self, inputs, cache=cache, **kw)
            tokens = np.array(inputs).reshape(-1).tolist()
            del script.history[offset:]
            if offset == 0 or script.start > offset:
                script.start = -1
            script.matched = max(0, min(script.matched, offset - script.start))
            for t in tokens:
                script.history.append(t)
                n = len(script.history)
                k = n - 1 - script.start
                if script.start >= 0 and script.matched == k and k < len(script.ids) and script.ids[k] == t:
                    script.matched += 1
                inside_reply = script.start >= 0 and script.matched == n - script.start
                if not inside_reply and script.history[n - len(script.marker):] == script.marker:
                    script.start, script.matched = n, 0
                    script.begin_reply()
            rows = logits.shape[1]
            forced = np.full((1, rows, logits.shape[-1]), -1e4, dtype=np.float32)
            for i in range(rows):
                forced[0, i, script.next_token(offset + len(tokens) - rows + i)] = 0.0
            return mx.array(forced)

    model.__class__ = Scripted
    return script
