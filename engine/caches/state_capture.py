"""Per-position recurrent state capture: take back a rejected draft without a replay.

A verify pass of width T runs every recurrent layer over T positions. While a `recording()`
is open, the state after each position can be had: Gated DeltaNet with scalar gates runs
chunked (engine/kernels/gated_delta_chunked.py, on CPU and CUDA) and Mamba 2's `ssm_attn` as
is, and the state after any position follows in closed form, built only for the position a
rollback asks for; any other Gated DeltaNet (Metal's kernel, vector gates) runs one position
at a time through the very function mlx-lm calls (`gated_delta_ops` / `gated_delta_kernel`),
keeping a state per position; every `nn.Conv1d` input is kept too
(a short conv's input is its old state followed by the pass's inputs, so the conv state
after j accepted tokens is rows j .. j + kernel - 2 of it: no capture needed beyond the
input). `bind` then maps those to the cache's slots, and `Capture.slots_after(leaf, j)`
gives a layer's state after j tokens directly: rollback.take_back uses it instead of
restoring the snapshot and replaying the kept tokens.

Nothing in mlx-lm's model files is forked: `install()` routes those three functions and
`nn.Conv1d.__call__` here, and they only differ from mlx-lm's while a recording is open
(one verify forward, on the thread that runs it). A layer is matched to its captured states
by the identity of the state array the model stores in its cache, and conv inputs by call
order, checked by shape; where a family doesn't fit (another recurrence, masks, batches),
`bind` returns None and the round keeps snapshot + replay. The verify pass's outputs are the
same bits with or without a recording; whether capture is cheaper than a replay depends on
the model and device: `cost_curve` measures both and picks.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta, ssm

from engine.base.forward_context import forward_context, get_context
from engine.caches.kinds import holds_state, kept_bytes, leaves

# A stepped capture holds every recurrent state of the pass: for a 27B Gated DeltaNet hybrid
# (48 layers of 3 MB float32 state) a 17-token round is 2.4 GB. Past this a round replays instead.
CAPTURE_BYTES = 1 << 30
UNBOUNDED = 1 << 30  # the widest capture where no layer keeps a state per position (an int32: ranks gather it)


def widest_for(per_position_bytes: int) -> int:
    """The widest pass whose capture stays within CAPTURE_BYTES at this many bytes a position."""
    return CAPTURE_BYTES // per_position_bytes if per_position_bytes else UNBOUNDED


def widest_capture(cache: list) -> int:
    """The widest capture over this cache if every recurrent layer stepped (a recorded pass's
    `Capture.widest` knows which did)."""
    return widest_for(kept_bytes([c for c in leaves(cache) if holds_state(c)]))


class Tape:
    """What one verify forward's recurrences left behind, in call order."""

    def __init__(self) -> None:
        # id(final state) -> (final state, positions, state_after(j) for j in 1..positions)
        self.states: dict[int, tuple] = {}
        self.convs: list[mx.array] = []  # each Conv1d's input: old conv state, then new inputs
        self.per_position_bytes = 0  # the states kept for each position (layers that stepped)
        self.over_budget = False  # a layer ran without stepping, to keep within CAPTURE_BYTES: no capture

    def add_states(self, last: mx.array, positions: int, state_after) -> None:
        self.states[id(last)] = (last, positions, state_after)  # holding `last` keeps its id unique


def _tape() -> Tape | None:
    return get_context().tape


@contextlib.contextmanager
def recording(on: bool = True):
    """Record the recurrences of the forward run inside (a Tape, the forward context's `tape`
    on this thread), or do nothing (None)."""
    if not on:
        yield None
        return
    with forward_context(tape=Tape()) as context:
        yield context.tape


class Capture:
    """Each recurrent layer's slots after every position of one verify forward."""

    def __init__(self, per_leaf: dict[int, list], per_position_bytes: int = 0):
        self._per_leaf = per_leaf  # id(ArraysCache) -> per slot: ("state", state_after) | ("conv", x, n_keep)
        self.per_position_bytes = per_position_bytes

    def widest(self) -> int:
        """The widest capture, by what this one kept a position."""
        return widest_for(self.per_position_bytes)

    def slots_after(self, leaf, kept: int) -> list:
        """The leaf's cache slots after the first `kept` (>= 1) positions of the pass."""
        out = []
        for slot in self._per_leaf[id(leaf)]:
            if slot[0] == "state":
                out.append(slot[1](kept))
            else:
                _, x, n_keep = slot
                out.append(x[:, kept : kept + n_keep, :])
        return out


def bind(tape: Tape | None, cache: list, fed: int) -> Capture | None:
    """Match a finished recording to the cache it filled (`fed` tokens), or None where some
    recurrent layer's slots can't be accounted for (then the round replays instead)."""
    if tape is None or tape.over_budget:
        return None
    convs = iter(tape.convs)
    per_leaf: dict[int, list] = {}
    for c in leaves(cache):
        if not holds_state(c):
            continue
        slots = []
        for value in c.cache:
            last, positions, state_after = tape.states.get(id(value), (None, 0, None))
            if last is value and positions == fed:
                slots.append(("state", state_after))
                continue
            x = next(convs, None)
            if value is None or x is None or x.ndim != 3 or value.ndim != 3:
                return None
            n_keep = value.shape[1]
            if (x.shape[0], x.shape[1], x.shape[2]) != (value.shape[0], n_keep + fed, value.shape[2]):
                return None
            slots.append(("conv", x, n_keep))
        per_leaf[id(c)] = slots
    if next(convs, None) is not None:
        return None  # a conv that no cache slot explains: don't guess
    return Capture(per_leaf, tape.per_position_bytes)


# -- the routed functions ---------------------------------------------------------------


def _stepwise_gated_delta(run):
    """`run` (mlx-lm's gated_delta_ops or gated_delta_kernel), one position at a time while
    recording. The ops path already loops over positions with the same compiled step, so
    its outputs and states are the same bits either way."""

    def stepwise(q, k, v, g, beta, state=None, mask=None):
        tape = _tape()
        if tape is None or q.shape[1] == 1 or mask is not None or tape.over_budget:
            return run(q, k, v, g, beta, state, mask)
        state_bytes = q.shape[0] * v.shape[-2] * v.shape[-1] * k.shape[-1] * 4  # float32, as mlx-lm keeps it
        if q.shape[1] * (tape.per_position_bytes + state_bytes) > CAPTURE_BYTES:
            tape.over_budget = True  # this pass can't be captured: the round replays
            return run(q, k, v, g, beta, state, mask)
        if (repeat := v.shape[-2] // q.shape[-2]) > 1:  # grouped heads: repeat once, not per step
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        ys, states = [], []
        for t in range(q.shape[1]):
            at = slice(t, t + 1)
            y, state = run(q[:, at], k[:, at], v[:, at], g[:, at], beta[:, at], state, None)
            ys.append(y)
            states.append(state)
        tape.add_states(state, len(states), lambda j: states[j - 1])
        tape.per_position_bytes += state_bytes
        return mx.concatenate(ys, axis=1), state

    stepwise.__wrapped__ = run
    stepwise.captures_states = True
    return stepwise


def _ssm_attn_with_states(run):
    """mlx-lm's Mamba 2 `ssm_attn` (its outputs untouched); while recording, also the state
    after any position j, in closed form from the same quantities (the chunked form keeps
    only the last): S_j = e^(a_1+..+a_j) S_0 + sum_(s<=j) e^(a_s+1+..+a_j) dt_s x_s B_s^T.
    Built only for the j a rollback asks for: one (head_dim x j) @ (j x state) matmul per head."""

    def with_states(x, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0.001, 100.0),
                    mask=None, lengths=None, step=256):
        y, last = run(x, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask=mask, lengths=lengths, step=step)
        tape = _tape()
        if tape is None or x.shape[1] == 1 or mask is not None or lengths is not None:
            return y, last
        l, h = x.shape[1], x.shape[2]
        g = B.shape[-2]

        def state_after(j: int) -> mx.array:
            if j == l:
                return last
            d = ssm.compute_dt(dt[:, :j], dt_bias, time_step_limit)  # (b, j, h)
            dA = d * (-mx.exp(A_log).astype(d.dtype)).reshape(1, 1, -1)
            total = mx.sum(dA, axis=1, keepdims=True)
            weight = mx.exp(total - mx.cumsum(dA, axis=1))  # e^(a_s+1 + .. + a_j), (b, j, h)
            dtx = ((d * weight)[..., None] * x[:, :j]).transpose(0, 2, 3, 1)  # (b, h, dh, j)
            Bh = mx.repeat(B[:, :j], h // g, axis=2).swapaxes(1, 2)  # (b, h, j, n): head i reads group i // (h/g)
            s = dtx.astype(Bh.dtype) @ Bh
            if state is not None:
                s = s + mx.exp(total)[:, 0, :, None, None] * state
            return s.astype(last.dtype)

        tape.add_states(last, l, state_after)
        return y, last

    with_states.__wrapped__ = run
    return with_states


def _taped_conv1d(call):
    def taped(self, x):
        tape = _tape()
        if tape is not None:
            tape.convs.append(x)
        return call(self, x)

    taped.__wrapped__ = call
    return taped


def install() -> None:
    """Route mlx-lm's recurrences and Conv1d through here (idempotent)."""
    if getattr(gated_delta.gated_delta_ops, "captures_states", False):
        return
    gated_delta.gated_delta_ops = _stepwise_gated_delta(gated_delta.gated_delta_ops)
    gated_delta.gated_delta_kernel = _stepwise_gated_delta(gated_delta.gated_delta_kernel)
    ssm.ssm_attn = _ssm_attn_with_states(ssm.ssm_attn)
    nn.Conv1d.__call__ = _taped_conv1d(nn.Conv1d.__call__)


install()
