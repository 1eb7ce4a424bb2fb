"""Chat messages -> token ids, through the model's own chat template."""

from __future__ import annotations

from typing import Any, Callable

from engine.base.errors import InvalidRequestError


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    encode: Callable[[str], list[int]] | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Apply the tokenizer's chat template (mlx-lm's wrapper) and tokenize (with `encode`, e.g. a
    PieceEncoder's, when given: the ids must equal the tokenizer's own, special tokens not added)."""
    text = chat_text(tokenizer, messages, tools, add_generation_prompt, **template_kwargs)
    if encode is not None:
        return encode(text)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_text(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The chat template's text for the messages (not tokenized)."""
    if not getattr(tokenizer, "has_chat_template", False):
        # No template: plain concatenation of the contents, the one thing that works with any model.
        return "\n".join(str(m.get("content", "")) for m in messages)
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
    except Exception as e:  # jinja errors on messages the template can't render
        raise InvalidRequestError(f"the model's chat template rejected the messages: {e}") from e
