"""The draft cap: how long a draft pays, per round, from the measured cost curve.

A draft of k tokens accepted with per-token probability a commits (1 - a^(k+1)) / (1 - a)
tokens in one verify pass costing cost(k+1) plain steps. `DraftController` applies
that per round for `--max-draft auto`: smoothed acceptance, hysteresis, drafting off
where it doesn't pay, and a probe now and then. A head's round also pays its own draft pass
first (engine/tuning/head_cost.py), charged where it was measured: a head on a target whose
verify is cheap against it (a small model on a CPU) drafts less, or not at all.

What each mode's drafts were seen to be accepted in this process is kept per model
(`seen_acceptance`): the next controller of that mode starts from it, and `auto`'s choice of
mode (engine/tuning/mode_choice.py) reads it.
"""

from __future__ import annotations

from engine.drafting.heads import HEAD_MODES
from engine.kernels.cpu_attention import MAX_WIDTH
from engine.tuning.batch_cost import BatchSurface, surface_for
from engine.tuning.cost_curve import CostCurve, curve_for_requests
from engine.tuning.head_cost import known_head_cost

DEFAULT_PRIOR = 0.7  # a mode's acceptance before any round of it was seen


# -- expected throughput ---------------------------------------------------------------


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens one round commits with a k-token draft whose tokens each hold with prob `acceptance`."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(k: int, acceptance: float, costs: list[float]) -> float:
    """Tokens per second against plain decoding, for a k-token draft (costs[k] = cost(k+1))."""
    return expected_tokens(k, acceptance) / costs[min(k, len(costs) - 1)]


def best_draft_cap(
    curve: CostCurve, acceptance: float, depth: int = 2048, max_cap: int = MAX_WIDTH - 1, draft_cost: float = 0.0
) -> tuple[int, float]:
    """(static draft cap, its expected speedup) maximising tokens/s; (0, 1.0) if none pays.
    `draft_cost`: plain steps a drafted round pays before its verify (a head's pass)."""
    return best_cap(acceptance, round_costs(curve.costs(depth, max_cap + 1), draft_cost), max_cap)


def round_costs(verify_costs: list[float], draft_cost: float) -> list[float]:
    """A round's cost per draft length k (index k, verify width k + 1), in plain steps: the
    verify pass, and the draft pass for every round that drafts."""
    return [c + (draft_cost if k else 0.0) for k, c in enumerate(verify_costs)]


def best_cap(acceptance: float, costs: list[float], max_cap: int) -> tuple[int, float]:
    """(draft length, tokens per plain step) best for these round costs; (0, 1.0) if no draft pays."""
    best_k, best = 0, 1.0
    a = min(max(acceptance, 0.0), 1.0)
    total, term = 1.0, 1.0  # running geometric sum: expected tokens for k = 0
    for k in range(1, max_cap + 1):
        term *= a
        total += term
        gain = total / costs[k]
        if gain > best:
            best_k, best = k, gain
    return best_k, best


# -- acceptance seen in this process ------------------------------------------------------


class SeenAcceptance:
    """One mode's drafts on one model, as seen in this process: accepted tokens and rounds
    that ended on a rejection, whose ratio is the geometric continuation probability."""

    def __init__(self):
        self.accepted, self.rejections, self.rounds = 0, 0, 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.rounds += 1
            self.accepted += accepted
            self.rejections += accepted < drafted

    def acceptance(self, prior: float = DEFAULT_PRIOR) -> float:
        """The estimate, with one pseudo-round at `prior` (so a few rounds move it, none leave it)."""
        prior = min(max(prior, 0.01), 0.99)
        acc = self.accepted + prior / (1 - prior)
        return acc / (acc + self.rejections + 1.0)


_SEEN: dict[tuple[str, str], SeenAcceptance] = {}


def seen_acceptance(target, mode: str) -> SeenAcceptance:
    """What this process saw of `mode`'s drafts on this target (a live record, fed by its controllers)."""
    return _SEEN.setdefault((str(target.identity), mode), SeenAcceptance())


def forget_seen_acceptance() -> None:
    """Forget what this process saw of every mode (a fresh start, as in a new process)."""
    _SEEN.clear()


# -- the adaptive controller ---------------------------------------------------------------


class DraftController:
    """The per-round draft cap for `--max-draft auto`.

    Call it for the cap before a round; tell it `observe(drafted, accepted)` after.
    Acceptance is estimated as a geometric continuation probability, smoothed over
    recent rounds that drafted. The cap moves to the curve's best for that estimate
    only when that beats the current cap by `hysteresis`; drafting turns off when no
    cap is expected to gain `min_gain`, and then a probe of `probe_cap` tokens is
    tried every `probe_every` rounds (doubling while probes fail, up to `probe_max`).

    While `batch` sequences share each verify forward (the engine sets it per round), a
    draft's cost is the width curve's scaled by the batch cost surface's factor for that
    batch size: in a batch, plain steps are cheap per sequence and wide forwards less so,
    so the draft that pays is shorter.
    """

    def __init__(
        self,
        curve: CostCurve,
        depth: int = 0,
        max_cap: int = MAX_WIDTH - 1,
        prior: float = DEFAULT_PRIOR,
        decay: float = 0.8,
        hysteresis: float = 0.05,
        min_gain: float = 1.02,
        probe_every: int = 16,
        probe_max: int = 256,
        probe_cap: int = 4,
        surface: BatchSurface | None = None,
        draft_cost: float = 0.0,
        seen: SeenAcceptance | None = None,
        source: str = "",
    ):
        self.curve, self.depth, self.max_cap = curve, depth, max_cap
        self.surface = surface or BatchSurface.default()
        self.draft_cost = draft_cost  # plain steps a drafted round pays before its verify (a head's pass)
        # the process's record, fed by rounds of `source` only (a head mode's long lookup matches are lookup's)
        self.seen, self.source = seen, source
        self._batch = 1
        self.decay, self.hysteresis, self.min_gain = decay, hysteresis, min_gain
        self.probe_every, self.probe_max, self.probe_cap = probe_every, probe_max, probe_cap
        prior = min(max(prior, 0.01), 0.99)
        self._acc, self._rej = prior / (1 - prior), 1.0  # one pseudo-round at the prior
        self._costs_bucket, self._costs = None, []
        self.cap = 0
        self.off = False
        self._since_probe = 0
        self._interval = probe_every
        self._probing = False
        self.cap = self._decide(first=True)

    @property
    def batch(self) -> int:
        return self._batch

    @batch.setter
    def batch(self, n: int) -> None:
        """Sequences decoding together now; the cap is decided again when it changes."""
        n = max(1, int(n))
        if n != self._batch:
            self._batch = n
            self.cap = self._decide()

    @property
    def acceptance(self) -> float:
        return self._acc / (self._acc + self._rej)

    def __call__(self) -> int:
        if not self.off:
            return self.cap
        if self._probing:
            return self.probe_cap
        self._since_probe += 1
        if self._since_probe >= self._interval:
            self._probing = True
            return self.probe_cap
        return 0

    def observe(self, drafted: int, accepted: int, source: str = "") -> None:
        self.depth += accepted + 1
        if drafted <= 0:
            return  # the drafter had nothing: no evidence either way
        if self.seen is not None and source == self.source:
            self.seen.observe(drafted, accepted)
        self._acc = self.decay * self._acc + accepted
        self._rej = self.decay * self._rej + (1.0 if accepted < drafted else 0.0)
        probed, self._probing = self._probing, False
        self.cap = self._decide()
        if self.off and probed:
            self._since_probe = 0
            self._interval = min(self._interval * 2, self.probe_max)

    def _current_costs(self) -> list[float]:
        bucket = (self.depth // 512, self._batch)  # the curve changes slowly with depth
        if bucket != self._costs_bucket:
            self._costs_bucket = bucket
            costs = self.curve.costs(bucket[0] * 512 + 256, self.max_cap + 1)
            self._costs = round_costs([c * self.surface.factor(self._batch, w) for w, c in enumerate(costs, 1)],
                                      self.draft_cost)
        return self._costs

    def _decide(self, first: bool = False) -> int:
        costs = self._current_costs()
        a = self.acceptance
        k, gain = best_cap(a, costs, self.max_cap)
        if self.off:
            if gain >= self.min_gain * (1 + self.hysteresis):
                self.off = False
                self._interval = self.probe_every
                self._since_probe = 0
                return k
            return 0
        if gain < self.min_gain:
            self.off = True
            self._since_probe = 0
            return 0
        if first or self.cap == 0:
            return k
        if gain > expected_speedup(self.cap, a, costs) * (1 + self.hysteresis):
            return k
        return self.cap


def draft_controller(target, prompt_tokens: int, kv_bits: int | None = None, mode: str = "") -> DraftController:
    """A fresh controller for one generation of `mode` (the engine builds one per `auto` cap):
    starting from the acceptance this process saw of the mode, charging a head's measured draft."""
    seen = seen_acceptance(target, mode) if mode else None
    draft_cost = (known_head_cost(target, mode, kv_bits) or 0.0) if mode in HEAD_MODES else 0.0
    return DraftController(curve_for_requests(target, kv_bits), depth=prompt_tokens,
                           surface=surface_for(target, kv_bits), draft_cost=draft_cost,
                           prior=seen.acceptance() if seen is not None else DEFAULT_PRIOR,
                           seen=seen, source=mode)  # a round's source is the mode's own drafts (a head's kind)
