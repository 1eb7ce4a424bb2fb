"""A tiny model trained (seconds, on CPU) to answer one exact chat with one exact reply.

A random tiny model never produces a sensible file, so the MCP tools' apply path would
only ever see garbled output. Overfitting a tiny model on the tool's own prompt makes the
real engine produce the expected reply, end to end, with nothing mocked.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm import load

from engine.base.chat import render_chat
from tiny_models import build_tiny_model


def train_forced_model(out: Path, chats: list[tuple[list[dict], str]], seed: int = 3, max_steps: int = 400) -> Path:
    """A model dir whose greedy reply to each chat's messages is exactly its reply text."""
    out = build_tiny_model(out, arch="qwen3", seed=seed)
    model, tok = load(str(out))
    eos = tok.eos_token_id
    batch = []
    for messages, reply in chats:
        prompt = render_chat(tok, messages)
        batch.append((prompt, list(tok.encode(reply, add_special_tokens=False)) + [eos]))

    def loss_fn(m):
        total = 0.0
        for prompt, answer in batch:
            x = mx.array([prompt + answer])
            logits = m(x[:, :-1])[:, len(prompt) - 1 :]
            total = total + nn.losses.cross_entropy(logits, x[:, len(prompt) :], reduction="mean")
        return total / len(batch)

    def greedy_ok() -> bool:
        for prompt, answer in batch:
            x = mx.array([prompt + answer])
            pred = mx.argmax(model(x[:, :-1])[0, len(prompt) - 1 :], axis=-1).tolist()
            if pred != answer:
                return False
        return True

    opt = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(model, loss_fn)
    for i in range(max_steps):
        loss, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        if i % 10 == 9 and loss.item() < 0.05 and greedy_ok():
            break
    else:
        raise RuntimeError("the forced model did not learn its replies")
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out
