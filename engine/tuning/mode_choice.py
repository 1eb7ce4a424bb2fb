"""What `auto` runs: the mode expected to commit the most tokens per second here, per request.

One rule for every candidate (engine/drafting/modes.py `auto_candidates`): its expected speed,
in plain decoding steps, is the tokens its rounds commit over what they cost, a round costing
its draft pass (a head's, measured here: engine/tuning/head_cost.py; lookup's is a dictionary
walk) plus the verify pass at its width (the cost curve: engine/tuning/cost_curve.py).

What a mode's rounds commit comes from what is known when the request starts:

- lookup: replayed on the prompt's last tokens, as it would draft them from what came before
  (its matches on this prompt are known once the prompt is): tokens and verify cost per round.
- a head: rounds where lookup has a long verbatim match go to lookup in a head mode too (the
  head drafter's override), so they count the same for both; elsewhere the head drafts at the
  acceptance this process saw of it (engine/tuning/draft_control.py `seen_acceptance`), else
  at HEAD_PRIOR, with the draft length that pays best at its draft cost (none, where none pays:
  then that part runs at plain speed, as the draft control would run it).

Ties go to lookup (it taps no hidden states and loads nothing). Whatever is chosen, the output
is the target's own: every mode is lossless, so the choice only moves speed. Within the request
the draft control keeps adapting the chosen mode's draft length to what is accepted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.drafting.heads import HEAD_MODES, head_for
from engine.drafting.heads.drafter import LOOKUP_OVERRIDE
from engine.drafting.lookup import LookupDrafter
from engine.drafting.modes import auto_candidates
from engine.kernels.cpu_attention import MAX_WIDTH
from engine.tuning.cost_curve import curve_for_requests
from engine.tuning.draft_control import best_cap, round_costs, seen_acceptance
from engine.tuning.head_cost import head_cost

# A head's acceptance per drafted token before this process has seen it draft: the bundled
# heads alone made 1.36-2.0 tokens per forward (training/heads/README.md), about 0.5.
HEAD_PRIOR = 0.5
# the prompt's tail lookup is replayed on, and what it drafts from before it: enough to see its
# matches, few enough to cost milliseconds per request (the real drafter indexes the whole prompt)
REPLAY_TOKENS = 256
REPLAY_CONTEXT = 2048
LONG_DRAFT = 2 * LOOKUP_OVERRIDE  # a lookup draft this long replaces a head's (engine/drafting/heads/drafter.py)


@dataclass
class LookupReplay:
    """Lookup replayed on a prompt's tail: tokens committed and verify cost (plain steps), split
    into rounds of a long verbatim match (which a head mode hands to lookup too) and the rest."""

    long_tokens: int = 0
    long_cost: float = 0.0
    other_tokens: int = 0
    other_cost: float = 0.0
    rounds: int = 0

    @property
    def tokens(self) -> int:
        return self.long_tokens + self.other_tokens


def replay_lookup(prompt: list[int], costs: list[float], tail: int = REPLAY_TOKENS) -> LookupReplay:
    """Draft the prompt's last `tail` tokens with lookup, round by round, as if generating them:
    what a round drafts is checked against the prompt's own next tokens. `costs[k]` is a verify
    of width k + 1 relative to width 1. From the prompt alone: the corpus documents lookup also
    drafts from would make it cost a corpus walk per round (and agents' files are in the prompt)."""
    out = LookupReplay()
    start = max(1, len(prompt) - tail)
    drafter = LookupDrafter()
    drafter.start(prompt[max(0, start - REPLAY_CONTEXT) : start])
    cap = len(costs) - 1
    i = start
    while i < len(prompt):
        ungated = drafter.propose(cap, gated=False).tokens
        long = len(ungated) >= LONG_DRAFT
        draft = ungated[: drafter.limit]  # what lookup's gate lets it draft
        truth = prompt[i : i + len(draft)]
        accepted = next((j for j, (a, b) in enumerate(zip(draft, truth)) if a != b), len(truth))
        committed = prompt[i : i + accepted + 1]
        drafter.commit(committed, len(draft), accepted)
        i += len(committed)
        out.rounds += 1
        if long:
            out.long_tokens += len(committed)
            out.long_cost += costs[len(draft)]
        else:
            out.other_tokens += len(committed)
            out.other_cost += costs[len(draft)]
    return out


@dataclass
class ModeSpeed:
    """One candidate's expected speed and the numbers behind it."""

    mode: str
    speed: float  # expected committed tokens per plain step's time: x plain decoding
    draft_cost: float = 0.0  # plain steps of a draft pass, before each drafted round's verify
    acceptance: float | None = None  # a head's, per drafted token
    acceptance_from: str = ""  # "seen in N rounds" or "prior"
    draft: int = 0  # a head's best draft length at that cost (0: drafting doesn't pay)
    head_gain: float = 0.0  # tokens per plain step where the head drafts
    lookup_share: float = 0.0  # of the replayed tokens, those in long lookup matches

    def describe(self) -> str:
        if self.mode not in HEAD_MODES:
            return f"{self.mode} {self.speed:.2f}x"
        return (f"{self.mode} {self.speed:.2f}x (draft {self.draft_cost:.2f} of a step, acceptance "
                f"{self.acceptance:.2f} {self.acceptance_from}, best draft {self.draft}: "
                f"{self.head_gain:.2f}x where lookup has no long match)")


@dataclass
class ModeChoice:
    mode: str
    speeds: list[ModeSpeed] = field(default_factory=list)
    replayed: int = 0  # prompt tokens lookup was replayed on
    lookup_share: float = 0.0  # of them, covered by long lookup matches
    depth: int = 0
    curve_measured: bool = False

    def reason(self) -> str:
        ranked = sorted(self.speeds, key=lambda s: -s.speed)
        curve = "measured" if self.curve_measured else "unmeasured (the default; `mlx-dspark tune` measures it)"
        return (f"{'; '.join(s.describe() for s in ranked)}. Lookup replayed on the prompt's last "
                f"{self.replayed} tokens: {self.lookup_share:.0%} in long matches; verify cost curve {curve}")

    def to_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason(), "speeds": [asdict(s) for s in self.speeds],
                "replayed_tokens": self.replayed, "lookup_share": round(self.lookup_share, 4),
                "depth": self.depth, "curve_measured": self.curve_measured}


def head_speed(target, mode: str, costs: list[float], replay: LookupReplay, kv_bits: int | None) -> ModeSpeed:
    """A head mode's expected speed: lookup's long-match rounds as they are, the rest at the
    head's best gain at its measured draft cost (plain speed where no draft pays)."""
    draft_cost = float(head_cost(target, mode, kv_bits)["ratio"])
    seen = seen_acceptance(target, mode)
    acceptance = seen.acceptance(HEAD_PRIOR)
    max_draft = min(head_for(target, mode).max_draft, len(costs) - 1)
    k, gain = best_cap(acceptance, round_costs(costs, draft_cost), max_draft)
    other_cost = replay.other_tokens / gain
    total_cost = replay.long_cost + other_cost
    speed = replay.tokens / total_cost if total_cost else gain
    return ModeSpeed(mode, round(speed, 4), round(draft_cost, 4), round(acceptance, 4),
                     f"seen in {seen.rounds} rounds" if seen.rounds else "prior", k,
                     round(gain, 4), round(replay.long_tokens / replay.tokens, 4) if replay.tokens else 0.0)


def lookup_speed(replay: LookupReplay) -> ModeSpeed:
    cost = replay.long_cost + replay.other_cost
    return ModeSpeed("lookup", round(replay.tokens / cost, 4) if cost else 1.0)


def choose_mode(target, prompt: list[int], kv_bits: int | None = None, heads: bool = True) -> ModeChoice:
    """The candidate expected fastest for this prompt here (`heads=False`: lookup's rivals are
    out, e.g. for an image prompt the heads can't read)."""
    curve = curve_for_requests(target, kv_bits)
    costs = curve.costs(len(prompt), MAX_WIDTH)
    replay = replay_lookup(prompt, costs)
    speeds = [lookup_speed(replay)]
    if heads:
        speeds += [head_speed(target, m, costs, replay, kv_bits) for m in auto_candidates(target) if m in HEAD_MODES]
    best = max(speeds, key=lambda s: s.speed)  # the first of equals: lookup
    return ModeChoice(best.mode, speeds, replay.tokens,
                      replay.long_tokens / replay.tokens if replay.tokens else 0.0, len(prompt), curve.measured)
