"""What a generation reports, in order: prefill progress, committed tokens, the end."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class PrefillProgress:
    done: int
    total: int


@dataclass
class Tokens:
    token_ids: list[int]
    text: str  # text delta, stop strings already cut
    # How each token was produced: [text delta, source] with source a drafter's name (an
    # accepted draft token) or "target" (the target's own); the deltas join to `text` less a
    # held-back tail. `drafted`: draft tokens the round proposed.
    provenance: list[list[str]] = field(default_factory=list)
    drafted: int = 0


@dataclass
class Stats:
    mode: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # rounds whose i-th draft token held
    drafted_by_position: list[int] = field(default_factory=list)  # rounds that drafted an i-th token
    # draft tokens proposed / accepted by each drafter ("lookup", "head", ...): a head drafter
    # hands long verbatim runs to lookup, and an agent's re-emitted file should show up there
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    queued_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0
    note: str = ""  # e.g. why speculation was turned off

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target forward during decoding."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def add_round(self, drafted: int, accepted: int, source: str = "") -> None:
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if drafted:
            source = source or "draft"
            self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + drafted
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + accepted
        for counts, n in ((self.drafted_by_position, drafted), (self.accepted_by_position, accepted)):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    @classmethod
    def sum(cls, parts: "list[Stats | dict]") -> "Stats":
        """Several generations' statistics as one (counts and times added; rates follow).
        The one place stats are summed: the MCP tools' totals and multi-file results use it."""
        total = cls()
        for part in parts:
            d = asdict(part) if isinstance(part, Stats) else part
            for f in fields(cls):
                value = d.get(f.name)
                if value is None:
                    continue
                if f.name in ("mode", "note"):
                    if value:
                        setattr(total, f.name, value)
                elif f.name == "ttft_s":
                    total.ttft_s = total.ttft_s or float(value)
                elif isinstance(getattr(total, f.name), dict):
                    mine = getattr(total, f.name)
                    for k, v in value.items():
                        mine[k] = mine.get(k, 0) + v
                elif isinstance(getattr(total, f.name), list):
                    mine = getattr(total, f.name)
                    mine.extend([0] * (len(value) - len(mine)))
                    for i, v in enumerate(value):
                        mine[i] += v
                else:
                    setattr(total, f.name, getattr(total, f.name) + type(getattr(total, f.name))(value))
        return total

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_accepted=round(self.mean_accepted, 4),
            acceptance_rate=round(self.acceptance_rate, 4),
            decode_tok_s=round(self.decode_tok_s, 2),
        )
        return d


@dataclass
class Done:
    finish_reason: str  # "stop" (EOS), "stop_string", "length", "cancelled"
    token_ids: list[int]
    text: str
    stats: Stats
    stop_string: str | None = None
