"""Prometheus text-format metrics, kept by hand (a few counters and histograms).

Thread-safe: handlers record from the event loop, nothing else writes.
"""

from __future__ import annotations

import threading
from collections import defaultdict

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DECODE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
ACCEPT_BUCKETS = (1, 1.25, 1.5, 2, 3, 4, 6, 8, 16)


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.counters: dict[str, float] = defaultdict(float)
        self.finishes: dict[str, int] = defaultdict(int)
        self.by_source: dict[tuple[str, str], int] = defaultdict(int)  # (drafted|accepted, drafter) -> tokens
        self.in_flight = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.decode = Histogram(DECODE_BUCKETS)
        self.accepted = Histogram(ACCEPT_BUCKETS)

    def request(self, method: str, route: str, status: int) -> None:
        with self._lock:
            self.requests[(method, route, status)] += 1

    def generation(self, stats, finish_reason: str = "") -> None:
        """Record one finished generation's engine Stats."""
        with self._lock:
            self.finishes[finish_reason] += 1
            c = self.counters
            c["prompt_tokens"] += stats.prompt_tokens
            c["cached_tokens"] += stats.cached_tokens
            c["prefilled_tokens"] += stats.prefilled_tokens
            c["generated_tokens"] += stats.generated_tokens
            c["drafted_tokens"] += stats.drafted_tokens
            c["accepted_tokens"] += stats.accepted_tokens
            c["generations"] += 1
            for kind, counts in (("drafted", stats.drafted_by_source), ("accepted", stats.accepted_by_source)):
                for source, n in counts.items():
                    self.by_source[(kind, source)] += n
            c["wall_seconds"] += stats.wall_s
            self.ttft.observe(stats.ttft_s)
            if stats.generated_tokens > 1 and stats.decode_s > 0:
                self.decode.observe(stats.decode_tok_s)
            if stats.rounds:
                self.accepted.observe(stats.mean_accepted)

    def mean_wall_s(self) -> float:
        with self._lock:
            n = self.counters["generations"]
            return self.counters["wall_seconds"] / n if n else 0.0

    def render(self) -> str:
        p = "mlx_dspark"
        with self._lock:
            lines = [f"# HELP {p}_requests_total HTTP requests by method, route and status.",
                     f"# TYPE {p}_requests_total counter"]
            for (method, route, status), n in sorted(self.requests.items()):
                lines.append(f'{p}_requests_total{{method="{method}",route="{route}",status="{status}"}} {n}')
            lines += [f"# HELP {p}_generations_by_finish_total Finished generations by finish reason.",
                      f"# TYPE {p}_generations_by_finish_total counter"]
            for reason, n in sorted(self.finishes.items()):
                lines.append(f'{p}_generations_by_finish_total{{finish="{reason}"}} {n}')
            for name, help_ in (
                ("generations", "Finished generations."),
                ("prompt_tokens", "Prompt tokens received."),
                ("cached_tokens", "Prompt tokens served from the prefix cache."),
                ("prefilled_tokens", "Prompt tokens computed."),
                ("generated_tokens", "Tokens generated."),
                ("drafted_tokens", "Draft tokens proposed."),
                ("accepted_tokens", "Draft tokens accepted by the target."),
            ):
                lines += [f"# HELP {p}_{name}_total {help_}", f"# TYPE {p}_{name}_total counter",
                          f"{p}_{name}_total {int(self.counters[name])}"]
            for kind in ("drafted", "accepted"):
                lines += [f"# HELP {p}_{kind}_tokens_by_drafter_total Draft tokens {kind}, by the drafter that proposed them.",
                          f"# TYPE {p}_{kind}_tokens_by_drafter_total counter"]
                lines += [f'{p}_{kind}_tokens_by_drafter_total{{drafter="{source}"}} {n}'
                          for (k, source), n in sorted(self.by_source.items()) if k == kind]
            drafted = self.counters["drafted_tokens"]
            rate = self.counters["accepted_tokens"] / drafted if drafted else 0.0
            lines += [f"# HELP {p}_draft_acceptance_ratio Accepted over drafted tokens since start.",
                      f"# TYPE {p}_draft_acceptance_ratio gauge", f"{p}_draft_acceptance_ratio {rate:.6f}",
                      f"# HELP {p}_requests_in_flight Generations queued or running.",
                      f"# TYPE {p}_requests_in_flight gauge", f"{p}_requests_in_flight {self.in_flight}"]
            for name, hist, help_ in (
                ("time_to_first_token_seconds", self.ttft, "Time from engine start to first token."),
                ("decode_tokens_per_second", self.decode, "Decode speed per generation."),
                ("tokens_per_forward", self.accepted, "Committed tokens per target forward."),
            ):
                lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} histogram", *hist.lines(f"{p}_{name}")]
        return "\n".join(lines) + "\n"


def load_lines(load: dict) -> str:
    """The engine's load (Engine.load plus the bridge's queue bound) as gauges."""
    p = "mlx_dspark"
    lines = []
    for name, value, help_ in (
        ("queue_depth", load["queued"], "Requests waiting for the engine."),
        ("max_queue", load["max_queue"], "Waiting requests past which new ones are refused."),
        ("running_sequences", load["running"], "Sequences the engine is working on."),
        ("max_batch", load["max_batch"], "Sequences the engine runs at once."),
    ):
        lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} gauge", f"{p}_{name} {value}"]
    lines += [f"# HELP {p}_sequences Sequences by phase.", f"# TYPE {p}_sequences gauge"]
    for phase in ("queued", "prefill", "decode"):
        n = sum(1 for q in load["sequences"] if q["phase"] == phase)
        lines.append(f'{p}_sequences{{phase="{phase}"}} {n}')
    return "\n".join(lines) + "\n"
