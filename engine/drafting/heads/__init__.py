"""Drafter heads that read the target's hidden states: DFlash and DSpark.

`load_head` reads a checkpoint in its published layout (strict tensor names and
shapes, pairing checked against the target); `head_for(target, mode)` finds and caches
the head registered for a target (or given with --drafter); `HeadDrafter` runs it in
the shared verify loop.
"""

from __future__ import annotations

from engine.base.errors import InvalidRequestError
from engine.drafting.heads.drafter import HeadDrafter
from engine.drafting.heads.loading import DrafterLoadError, load_head
from engine.drafting.heads.registry import base_name, entry_for

HEAD_MODES = ("dflash", "dspark")


def head_for(target, mode: str):
    """The loaded head for `mode` on this target (loaded once, kept on the target)."""
    if mode in target.heads:
        return target.heads[mode]
    spec = entry_for(target).heads.get(mode)
    if spec is None:
        raise InvalidRequestError(
            f"no {mode} drafter is registered for {base_name(target.path)!r}; "
            f"pass --drafter PATH_OR_ID with a {mode} checkpoint"
        )
    head = load_head(spec, target, bits=getattr(target, "drafter_bits", None))
    if head.kind != mode:
        raise InvalidRequestError(f"--drafter {spec} is a {head.kind} checkpoint, not {mode}")
    target.heads[mode] = head
    return head


def make_head_drafter(mode: str, target, corpus: list[list[int]]) -> HeadDrafter:
    return HeadDrafter(head_for(target, mode), target, corpus)


__all__ = ["DrafterLoadError", "HEAD_MODES", "HeadDrafter", "head_for", "load_head", "make_head_drafter"]
