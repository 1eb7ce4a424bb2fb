"""SwiGLU (silu(gate) * x) for CPU prefill chunks in a compiled kernel, both cores busy.

MLX's CPU sigmoid runs at 15-30 ns an element here (a scalar exp), so in a 1024-token
prefill chunk of the bundled model the MLP's activation took about as long as its three
matmuls at BLAS speed, and in a verify forward of 4 rows of 17 tokens 1.8 ms a layer, four
times its three matmuls. mlx-lm's families (77 of them) call `swiglu` from
`mlx_lm.models.activations`, bound by name in their own module; `install_for` rebinds that
name in the loaded model's module to `_routed`, so no model file is forked. A call is taken
only in the engine's forwards (a prefill chunk, or any forward on the engine's thread:
`cpu_attention.engine_thread`), float32, on the CPU, with the kernel compiled; anything
else, and a traced graph, goes to mlx-lm's own. `cpu_attention.disabled()` turns this off too.
Which forward this is comes from the thread's forward context (engine/base/forward_context.py).
"""

from __future__ import annotations

import importlib

import numpy as np

from engine.base.forward_context import get_context
from engine.kernels import cpu_attention, native

_original = None
_kernel = None


def _swiglu_kernel():
    global _kernel
    if _kernel is None:
        import ctypes

        lib = native.load("cpu_kernels")
        if lib is None:
            _kernel = False
        else:
            _kernel = lib.swiglu
            _kernel.restype = None
            _kernel.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    return _kernel or None


def swiglu(gate: np.ndarray, x: np.ndarray, threads: int | None = None) -> np.ndarray:
    """silu(gate) * x for float32 arrays of one shape (the compiled kernel must load)."""
    kernel = _swiglu_kernel()
    g, u = np.ascontiguousarray(gate, np.float32), np.ascontiguousarray(x, np.float32)
    out = np.empty_like(g)
    n = g.size
    parts = max(1, min(threads or cpu_attention.thread_count(), n // 65536))
    bounds = [n * i // parts for i in range(parts + 1)]
    item = g.itemsize

    def run(i):
        a, b = bounds[i], bounds[i + 1]
        kernel(g.ctypes.data + a * item, u.ctypes.data + a * item, out.ctypes.data + a * item, b - a)

    if parts == 1:
        run(0)
    else:
        for f in [cpu_attention.worker_pool().submit(run, i) for i in range(parts)]:
            f.result()
    return out


def handles(gate, x) -> bool:
    import mlx.core as mx

    context = get_context()
    if context.cpu_kernels_off or context.past_unread_call():
        return False  # off; or in a layer whose output nothing reads: MLX's lazy graph skips it
    if gate.shape != x.shape or gate.ndim < 2 or gate.dtype != mx.float32 or x.dtype != mx.float32:
        return False
    prefill_chunk = context.prefill and gate.shape[-2] >= cpu_attention.MIN_QUERIES
    wide = gate.size // gate.shape[-1] >= cpu_attention.MIN_TOKENS  # as the attention's
    if not (prefill_chunk or (context.engine_thread and wide)):
        return False  # a numpy result carries no gradient: only the engine's forwards
    return mx.default_device() == mx.cpu and _swiglu_kernel() is not None


def _routed(gate, x):
    if not handles(gate, x):
        return _original(gate, x)
    import mlx.core as mx

    try:
        mx.eval(gate, x)  # numpy needs values: the MLP's matmuls run here
        g, u = np.asarray(gate), np.asarray(x)
    except Exception:  # a traced graph (mx.compile) has no values: mlx-lm's own
        return _original(gate, x)
    return mx.array(swiglu(g, u))


def install_for(target) -> bool:
    """Rebind `swiglu` in the target model's mlx-lm module (idempotent); False where the
    family doesn't call mlx-lm's `swiglu`."""
    global _original
    from mlx_lm.models import activations

    module = importlib.import_module(type(target.model).__module__)
    current = getattr(module, "swiglu", None)
    if current is _routed:
        return True
    if current is not activations.swiglu:
        return False
    _original = activations.swiglu
    module.swiglu = _routed
    return True
