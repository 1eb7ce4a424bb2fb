"""Decoding modes and the drafters behind them.

`baseline` is plain decoding through mlx-lm (the reference every mode must equal);
every other mode is a drafter driven by the one verify loop. `auto` is chosen per request
among `auto_candidates` by their expected speed here (engine/tuning/mode_choice.py: this
layer knows what can run, the tuning layer what it costs). Drafter heads register here as
they are added.
"""

from __future__ import annotations

from typing import Callable

from engine.base.errors import InvalidRequestError
from engine.drafting.drafter import Drafter
from engine.drafting.heads import head_for, make_head_drafter
from engine.drafting.heads.registry import available_locally, entry_for
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


def auto_candidates(target: Target) -> list[str]:
    """The modes `auto` chooses among here: lookup, and each head registered for the target
    (or given with --drafter) whose weights are on this machine (`auto` never downloads), on
    a target whose hidden states can be tapped."""
    heads = [m for m, spec in entry_for(target).heads.items() if m in DRAFTER_FACTORIES and available_locally(spec)]
    if heads:
        try:
            target.check_tappable()
        except ValueError:
            heads = []
    return ["lookup", *heads]


def resolve_mode(mode: str, target: Target) -> str:
    """The mode checked: "auto" stays "auto" (the engine chooses per request), any other
    must be one this engine has."""
    if mode != "auto" and mode != "baseline" and mode not in DRAFTER_FACTORIES:
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
