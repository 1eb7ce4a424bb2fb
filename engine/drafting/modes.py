"""Decoding modes and the drafters behind them.

`baseline` is plain decoding through mlx-lm (the reference every mode must equal);
every other mode is a drafter driven by the one verify loop. `auto` resolves to the
best mode available for the target. Drafter heads register here as they are added.
"""

from __future__ import annotations

from typing import Callable

from engine.base.errors import InvalidRequestError
from engine.drafting.drafter import Drafter
from engine.drafting.heads import auto_mode, head_for, make_head_drafter
from engine.drafting.heads.registry import entry_for
from engine.drafting.lookup import LookupDrafter
from engine.model.target import Target

# mode name -> factory(target, corpus) building a fresh drafter for one generation
DRAFTER_FACTORIES: dict[str, Callable[[Target, list[list[int]]], Drafter]] = {
    "lookup": lambda target, corpus: LookupDrafter(corpus=corpus),
    "dflash": lambda target, corpus: make_head_drafter("dflash", target, corpus),
    "dspark": lambda target, corpus: make_head_drafter("dspark", target, corpus),
}


def available_modes() -> list[str]:
    return ["auto", "baseline", *DRAFTER_FACTORIES]


def resolve_mode(mode: str, target: Target) -> str:
    if mode == "auto":
        # The registered head that measured best for this target (weights present), else lookup.
        return auto_mode(target) or "lookup"
    if mode != "baseline" and mode not in DRAFTER_FACTORIES:
        raise InvalidRequestError(f"unknown mode {mode!r}; choose from {', '.join(available_modes())}")
    return mode


def make_drafter(mode: str, target: Target, corpus: list[list[int]]) -> Drafter:
    return DRAFTER_FACTORIES[mode](target, corpus)


def attach_drafter(target: Target, drafter: str | None, bits: int | None = None) -> None:
    """Use this drafter checkpoint (path or hub id) for the target; load and pair-check it now."""
    target.drafter, target.drafter_bits = drafter, bits
    target.heads.clear()
    if drafter:
        for mode in entry_for(target).heads:
            head_for(target, mode)
