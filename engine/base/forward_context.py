"""What the kernels of the forward running on this thread need to know: one small object.

The CPU kernels (engine/kernels/) and state capture (engine/caches/state_capture.py) are
routed under mlx-lm's own functions, so the forward can't pass them arguments; they read
this instead (as nano-vllm's `Context`). `forward_context(**fields)` sets fields for a
block and puts the old values back after; `get_context()` reads. Each thread has its own
object: the engine's thread runs its forwards while other threads run measurements or
training, and one thread's switches must not reach another's forward.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass


@dataclass(slots=True)
class ForwardContext:
    engine_thread: bool = False  # the engine's thread: its decode and verify forwards may take the CPU kernels
    engine_forward: bool = False  # a forward Target builds, not mlx-lm's own loop: quantized_route may route it
    prefill: bool = False  # inside a prefill chunk's forward: eager kernels may run (no autodiff, no mx.compile)
    unread_call: int | None = None  # the attention call (1-based) whose output nobody reads; None: all are read
    attention_calls_made: int = 0  # attention calls so far since unread_call was set (counted while it is)
    cpu_kernels_off: bool = False  # MLX's own attention and SwiGLU (cpu_attention.disabled)
    chunked_delta_off: bool = False  # mlx-lm's own Gated DeltaNet step loop (gated_delta_chunked.disabled)
    tape: object = None  # state_capture's Tape while a verify pass is recorded, else None
    attention_shapes: list | None = None  # where a list: each attention call's shape is appended to it
    mask_read: tuple | None = None  # (mask, shape, row offsets): the last array mask read (once per forward, not per layer)

    def past_unread_call(self) -> bool:
        """Nothing from here on in this forward is read, so nothing may be computed eagerly."""
        return self.unread_call is not None and self.attention_calls_made >= self.unread_call


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.context = ForwardContext()


_this_thread = _PerThread()


def get_context() -> ForwardContext:
    """This thread's forward context."""
    return _this_thread.context


@contextlib.contextmanager
def forward_context(**fields):
    """These fields set on this thread's context inside the block, as they were after.
    Fields not named are shared with the enclosing block (a call count goes on counting)."""
    context = _this_thread.context
    old = {name: getattr(context, name) for name in fields}  # an unknown name raises here
    for name, value in fields.items():
        setattr(context, name, value)
    try:
        yield context
    finally:
        for name, value in old.items():
            setattr(context, name, value)
