"""Decoding modes and the drafters behind them.

`baseline` is plain decoding through mlx-lm (the reference every mode must equal);
every other mode is a drafter driven by the one verify loop. `auto` resolves to the
best mode available for the target. Drafter heads register here as they are added.
"""

from __future__ import annotations

from typing import Callable

from .drafter import Drafter
from .errors import InvalidRequestError
from .lookup import LookupDrafter
from .target import Target

# mode name -> factory(target, corpus) building a fresh drafter for one generation
DRAFTER_FACTORIES: dict[str, Callable[[Target, list[list[int]]], Drafter]] = {
    "lookup": lambda target, corpus: LookupDrafter(corpus=corpus),
}


def available_modes() -> list[str]:
    return ["auto", "baseline", *DRAFTER_FACTORIES]


def resolve_mode(mode: str, target: Target) -> str:
    if mode == "auto":
        return "lookup"
    if mode != "baseline" and mode not in DRAFTER_FACTORIES:
        raise InvalidRequestError(f"unknown mode {mode!r}; choose from {', '.join(available_modes())}")
    return mode


def make_drafter(mode: str, target: Target, corpus: list[list[int]]) -> Drafter:
    return DRAFTER_FACTORIES[mode](target, corpus)
