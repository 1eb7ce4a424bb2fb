"""Where MLX runs and how fast its matrix products can be.

On Linux the `mlx-cpu` wheel links the reference (netlib) BLAS, about 30x slower
than OpenBLAS on the matmuls a forward pass is made of. Preloading Debian's
OpenBLAS before MLX is imported swaps it in; `ensure_fast_blas` does that by
re-executing the current command once with LD_PRELOAD set.

OpenBLAS picks its kernels by CPU model when it loads. A release older than the CPU doesn't
know the model and falls back to its oldest x86-64 kernels: Debian 12's 0.3.21 on a Xeon
of model 207 runs "Prescott" (SSE3) kernels, 3-4x slower on a verify forward's matmuls
than its AVX-512 ones. Where the CPU has AVX-512 (or AVX2) and the kernels chosen don't
use it, the re-exec also sets OPENBLAS_CORETYPE to the kernels that do (`better_core`); a
user's own OPENBLAS_CORETYPE is left alone.

OpenBLAS's idle workers spin for 2^28 cycles (about 0.1 s) after each call before they sleep. The
CPU attention kernel's own threads (engine/kernels/cpu_attention.py) run between MLX's matmuls on
the same cores, and that spinning took their cycles: on 2 cores a 15k-token cold turn took 10.4 s
and decoded 1,073 tok/s by default, 9.2 s and 1,352 tok/s with OPENBLAS_THREAD_TIMEOUT=4 (2^4
cycles; scripts/bench_peers.py, 2026-12-04). The re-exec sets that too, unless the user set it.
"""

from __future__ import annotations

import functools
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
_CORE_GUARD = "MLX_DSPARK_BLAS_CORETYPE"  # set in the re-executed process where we set OPENBLAS_CORETYPE
_TIMEOUT_GUARD = "MLX_DSPARK_BLAS_TIMEOUT"  # set in the re-executed process where we set OPENBLAS_THREAD_TIMEOUT
_UNSET = "-"
BLAS_THREAD_TIMEOUT = "4"  # OpenBLAS idle workers spin 2^4 cycles, not 2^28, before sleeping (docstring)
# OpenBLAS core names (lower case) whose sgemm kernels use AVX-512, and those that use AVX2 at least
AVX512_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
AVX2_CORES = AVX512_CORES | {"haswell", "zen"}


def find_openblas() -> str | None:
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo), or an empty set."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def physical_memory_bytes() -> int | None:
    """The machine's memory in bytes (Linux and macOS), or None where the system doesn't say:
    each caller then assumes its own size."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows) or no such name
        return None
    return total if total > 0 else None


def openblas_core(lib) -> str | None:
    """The kernels a loaded OpenBLAS (a ctypes library) chose ("Haswell", "SkylakeX", ...), or None."""
    import ctypes

    try:
        corename = lib.openblas_get_corename
    except AttributeError:
        return None
    corename.restype = ctypes.c_char_p
    name = corename()
    return name.decode() if name else None


def better_core(core: str | None, flags: set[str]) -> str | None:
    """The OpenBLAS kernels to ask for (OPENBLAS_CORETYPE) when `core`, the ones it chose,
    leave out vector units the CPU has (`flags`); None when its choice is right."""
    if not core:
        return None
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags and core.lower() not in AVX512_CORES:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags and core.lower() not in AVX2_CORES:
        return "Haswell"
    return None


def _core_to_ask(lib_path: str | None) -> str | None:
    """OPENBLAS_CORETYPE for the re-executed process, or None (the user set one, or OpenBLAS's
    own choice is right). `lib_path` None: the OpenBLAS already preloaded in this process."""
    import ctypes

    if sys.platform != "linux" or "OPENBLAS_CORETYPE" in os.environ:
        return None
    try:
        lib = ctypes.CDLL(lib_path)  # None: the global scope, where the preloaded library is
    except OSError:
        return None
    return better_core(openblas_core(lib), cpu_flags())


def ensure_fast_blas(argv: list[str] | None = None) -> None:
    """Re-exec this process with OpenBLAS preloaded (and its fastest kernels asked for, where it
    doesn't choose them itself), where that helps and is possible.

    Call it before anything imports mlx. A no-op on macOS, when OpenBLAS is absent,
    already preloaded with the right kernels, or when MLX_DSPARK_NO_REEXEC is set.
    """
    if _REEXEC_GUARD in os.environ:  # we are the re-executed process: OpenBLAS is mapped now
        restore_caller_env()
        return
    if sys.platform != "linux" or os.environ.get("MLX_DSPARK_NO_REEXEC"):
        return
    preloaded = "openblas" in os.environ.get("LD_PRELOAD", "")
    lib = None if preloaded else find_openblas()
    if not preloaded and lib is None:
        return
    core = _core_to_ask(lib)
    if preloaded and core is None:
        return
    env = dict(os.environ)
    # the caller's LD_PRELOAD ("-" when unset) rides along so the new process can put it back
    env[_REEXEC_GUARD] = env.get("LD_PRELOAD", _UNSET)
    if lib:
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    if core:
        env["OPENBLAS_CORETYPE"], env[_CORE_GUARD] = core, core
    if "OPENBLAS_THREAD_TIMEOUT" not in env:
        env["OPENBLAS_THREAD_TIMEOUT"] = env[_TIMEOUT_GUARD] = BLAS_THREAD_TIMEOUT
    argv = argv if argv is not None else sys.argv
    try:
        os.execve(sys.executable, [sys.executable, *argv], env)
    except OSError:
        return  # keep running on the slow BLAS; `doctor` says how to fix it


def restore_caller_env() -> None:
    """Put LD_PRELOAD back as the caller had it. The loader needed it only at exec time; left
    set, it would reach every program we start (Claude Code, its shell commands, hooks, MCP
    servers: Node.js under it fails with `pthread_create: Invalid argument`)."""
    if os.environ.pop(_CORE_GUARD, None):  # ours, read by OpenBLAS as it loaded: children don't need it
        os.environ.pop("OPENBLAS_CORETYPE", None)
    if os.environ.pop(_TIMEOUT_GUARD, None):
        os.environ.pop("OPENBLAS_THREAD_TIMEOUT", None)
    before = os.environ.pop(_REEXEC_GUARD, _UNSET)
    if before == _UNSET:
        os.environ.pop("LD_PRELOAD", None)
    else:
        os.environ["LD_PRELOAD"] = before


def mlx_blas_path() -> str | None:
    """The file MLX's `cblas_sgemm` (every float32 matmul on CPU) binds to, or None.

    Looked up the way the dynamic linker bound it: the global scope first (the program,
    LD_PRELOAD, libraries loaded RTLD_GLOBAL), then libmlx's own dependencies (the
    mlx-cpu wheel's reference BLAS); `dladdr` names the file holding that address. A
    BLAS that is merely mapped (numpy's bundled OpenBLAS, say) does not count.
    """
    import ctypes
    import ctypes.util

    import mlx.core  # noqa: F401  (loads libmlx)

    try:
        with open("/proc/self/maps") as maps:
            libmlx = next((line.split()[-1] for line in maps if line.rstrip().endswith("/libmlx.so")), None)
        scopes = [ctypes.CDLL(None)] + ([ctypes.CDLL(libmlx)] if libmlx else [])
    except OSError:
        return None
    address = None
    for scope in scopes:
        try:
            address = ctypes.cast(scope.cblas_sgemm, ctypes.c_void_p).value
            break
        except AttributeError:
            continue
    if address is None:
        return None

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    libdl = ctypes.CDLL(ctypes.util.find_library("dl") or None)
    info = DlInfo()
    if not libdl.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def blas_name(path: str | None) -> str:
    """A BLAS library's name in words, from its file."""
    if path is None:
        return "unknown"
    base = os.path.basename(path)
    low = path.lower()
    for marker, name in (("openblas", "OpenBLAS"), ("mkl", "MKL"), ("blis", "BLIS"), ("accelerate", "Accelerate")):
        if marker in low:
            return f"{name} ({base})"
    return f"reference BLAS ({base})"


@functools.cache
def loaded_blas() -> str:
    """The BLAS MLX's matmuls run on: 'OpenBLAS (file, SkylakeX kernels)', 'reference BLAS
    (file)', ... (OpenBLAS's kernels change its speed 3-4x: the cost curves are keyed on them).
    Looked up once: the library and its kernels are fixed once loaded, and every request's
    cost-curve key asks (the lookup runs `ldconfig`)."""
    import ctypes

    if sys.platform == "darwin":
        return "Accelerate"
    path = mlx_blas_path()
    name = blas_name(path)
    if name.startswith("OpenBLAS"):
        try:
            core = openblas_core(ctypes.CDLL(path))
        except OSError:
            core = None
        if core:
            name = f"{name[:-1]}, {core} kernels)"
    return name


def slow_blas_warning() -> str | None:
    """One line when MLX computes on CPU with a slow reference BLAS, else None."""
    import mlx.core as mx

    if sys.platform != "linux" or mx.default_device() != mx.cpu:
        return None
    blas = loaded_blas()
    if not blas.startswith("reference"):
        return None
    fix = ("install OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread); "
           "mlx-dspark preloads it") if find_openblas() is None else (
           f"start without MLX_DSPARK_NO_REEXEC, or with LD_PRELOAD={find_openblas()}")
    return f"warning: MLX runs on a slow {blas}, about 30x slower than OpenBLAS: {fix}"


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
    warning = slow_blas_warning() if on_cpu else None
    if warning:
        info["advice"] = warning.removeprefix("warning: ")
    return info


def on_cuda() -> bool:
    """Is MLX computing on an NVIDIA GPU (MLX CUDA)? Kernel choices measured there key on it."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device().type == mx.gpu


def whole_number_setting(name: str, default: int, meaning_of_1: str) -> int:
    """A kernel setting from environment variable `name`: a whole number >= 1, `default` where unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.isdecimal() or int(raw) < 1:
        raise ValueError(f"{name} takes a whole number >= 1 (1: {meaning_of_1}), not {raw!r}")
    return int(raw)


def device_name() -> str:
    """The compute device in words; on CPU the BLAS too (it changes matmul speed 30x)."""
    import mlx.core as mx

    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # older MLX
        name = ""
    if mx.default_device().type == mx.cpu:
        return f"cpu:{name or platform.processor() or platform.machine()}:{os.cpu_count()} cores:{loaded_blas()}"
    return f"gpu:{name or platform.machine()}"
