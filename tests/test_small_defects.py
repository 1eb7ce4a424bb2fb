"""Issue 13 items 9 and 10: the smaller defects, one test each (written before the fix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ld_preload_not_leaked_to_children(tmp_path):
    # item 9: the OpenBLAS re-exec must not hand LD_PRELOAD to the programs we start
    from engine.platform import find_openblas

    if sys.platform != "linux" or find_openblas() is None:
        pytest.skip("no OpenBLAS to preload here")
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, subprocess, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from engine.platform import ensure_fast_blas, loaded_blas\n"
        "ensure_fast_blas()\n"
        "import mlx.core\n"
        "child = subprocess.run(['sh', '-c', 'echo \"$LD_PRELOAD\"'], capture_output=True, text=True).stdout.strip()\n"
        "print(json.dumps({'blas': loaded_blas(), 'own': os.environ.get('LD_PRELOAD'), 'child': child}))\n")
    for preload in (None, "/nonexistent-user-lib.so"):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLX_DSPARK_NO_REEXEC")}
        if preload:
            env["LD_PRELOAD"] = preload  # the user's own preload survives, ours is gone
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        info = json.loads(out.stdout.strip().splitlines()[-1])
        assert info["blas"] == "OpenBLAS"  # the re-exec still happened
        assert info["own"] == preload and info["child"] == (preload or "")
