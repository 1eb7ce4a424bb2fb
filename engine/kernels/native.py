"""Small C kernels beside this file, compiled at first use with the system's C compiler.

numpy has no fused or fast float32 exp on every CPU (see cpu_kernels.c), and the package
stays pure Python: a kernel is compiled once per (source, compiler, CPU) into the cache
folder (an atomic rename, so concurrent processes agree) and loaded with ctypes, whose
calls release the GIL. Where no compiler works, `load` returns None and callers use
their numpy path. `MLX_DSPARK_NATIVE=0` turns every kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path

from engine.base.files import cache_dir

log = logging.getLogger(__name__)
FLAGS = ["-O3", "-funroll-loops", "-march=native", "-fno-math-errno", "-shared", "-fPIC"]
_loaded: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def _cpu() -> str:
    """What -march=native depends on: the CPU model and its feature flags where readable."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return platform.machine() + "\n".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def library_path(name: str, cc: str) -> Path:
    source = Path(__file__).with_name(f"{name}.c").read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(FLAGS).encode(), _cpu().encode()]))
    return cache_dir() / "native" / f"{name}-{key.hexdigest()[:20]}.so"


def _build(name: str) -> ctypes.CDLL | None:
    if os.environ.get("MLX_DSPARK_NATIVE") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler: %s runs on numpy", name)
        return None
    if not Path(__file__).with_name(f"{name}.c").exists():
        return None
    path = library_path(name, cc)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        src = Path(__file__).with_name(f"{name}.c")
        done = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(src), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("compiling %s failed, using numpy: %s", name, done.stderr.strip()[-500:])
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, path)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("loading %s failed, using numpy: %s", path, e)
        return None


def load(name: str) -> ctypes.CDLL | None:
    """engine/<name>.c compiled and loaded (once per process), or None."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name)
        return _loaded[name]
