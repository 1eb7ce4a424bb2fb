"""Where MLX runs and how fast its matrix products can be.

On Linux the `mlx-cpu` wheel links the reference (netlib) BLAS, about 30x slower
than OpenBLAS on the matmuls a forward pass is made of. Preloading Debian's
OpenBLAS before MLX is imported swaps it in; `ensure_fast_blas` does that by
re-executing the current command once with LD_PRELOAD set.
"""

from __future__ import annotations

import os
import platform
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_REEXEC_GUARD = "MLX_DSPARK_BLAS_REEXEC"  # set in the re-executed process: the caller's LD_PRELOAD
_UNSET = "-"


def find_openblas() -> str | None:
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def ensure_fast_blas(argv: list[str] | None = None) -> None:
    """Re-exec this process with OpenBLAS preloaded, where that helps and is possible.

    Call it before anything imports mlx. A no-op on macOS, when OpenBLAS is absent,
    already preloaded, or when MLX_DSPARK_NO_REEXEC is set.
    """
    if _REEXEC_GUARD in os.environ:  # we are the re-executed process: OpenBLAS is mapped now
        restore_caller_env()
        return
    if sys.platform != "linux" or os.environ.get("MLX_DSPARK_NO_REEXEC"):
        return
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    # the caller's LD_PRELOAD ("-" when unset) rides along so the new process can put it back
    env[_REEXEC_GUARD] = env.get("LD_PRELOAD", _UNSET)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    argv = argv if argv is not None else sys.argv
    try:
        os.execve(sys.executable, [sys.executable, *argv], env)
    except OSError:
        return  # keep running on the slow BLAS; `doctor` says how to fix it


def restore_caller_env() -> None:
    """Put LD_PRELOAD back as the caller had it. The loader needed it only at exec time; left
    set, it would reach every program we start (Claude Code, its shell commands, hooks, MCP
    servers: Node.js under it fails with `pthread_create: Invalid argument`)."""
    before = os.environ.pop(_REEXEC_GUARD, _UNSET)
    if before == _UNSET:
        os.environ.pop("LD_PRELOAD", None)
    else:
        os.environ["LD_PRELOAD"] = before


def loaded_blas() -> str:
    """Name of the BLAS library mapped into this process (Linux), or the platform's."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "blas" in line.lower()}
    except OSError:
        return "unknown"
    if any("openblas" in lib for lib in libs):
        return "OpenBLAS"
    if libs:
        return "reference BLAS (" + ", ".join(sorted(os.path.basename(l) for l in libs)) + ")"
    return "none loaded yet"


def describe_platform() -> dict:
    """Backend, device, BLAS and the dtype the engine will compute in."""
    import mlx.core as mx

    device = mx.default_device()
    on_cpu = device.type == mx.cpu
    info = {
        "os": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": "cpu" if on_cpu else "gpu",
        "backend": "cpu" if on_cpu else ("metal" if sys.platform == "darwin" else "cuda"),
        "compute_dtype": "float32" if on_cpu else "checkpoint dtype",
        "blas": loaded_blas() if on_cpu else "n/a (GPU)",
        "cpu_count": os.cpu_count(),
    }
    if on_cpu and sys.platform == "linux" and info["blas"] != "OpenBLAS":
        info["advice"] = (
            "MLX is using a slow reference BLAS; install OpenBLAS "
            "(Debian/Ubuntu: apt-get install libopenblas0-pthread) and mlx-dspark will "
            "preload it automatically."
        )
    return info
