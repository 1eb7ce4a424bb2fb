"""`mlx-dspark generate` and `doctor` as a user runs them: real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.base.platform import find_openblas

CODE = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n"


def cli(*args, env_extra=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_DSPARK_NO_REEXEC",)}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "agent_bridge", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


def test_generate_json_lookup_equals_baseline(tiny_model_dir):
    prompt = "Rename `width` to `w` and re-emit:\n" + CODE
    reports = {}
    for mode in ("lookup", "baseline"):
        r = cli("generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--mode", mode,
                "--max-tokens", "48", "--json")
        assert r.returncode == 0, r.stderr
        reports[mode] = json.loads(r.stdout)
    assert reports["lookup"]["token_ids"] == reports["baseline"]["token_ids"]
    for key in ("text", "token_ids", "prompt_tokens", "generated_tokens", "mode", "rounds",
                "mean_accepted", "ttft_s", "decode_tok_s", "wall_s"):
        assert key in reports["lookup"], key
    assert reports["lookup"]["mode"] == "lookup"
    assert reports["baseline"]["rounds"] == reports["baseline"]["generated_tokens"]


def test_generate_streams_text(tiny_model_dir, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text(CODE)
    r = cli("generate", "--model", str(tiny_model_dir), "--prompt-file", str(f), "--max-tokens", "10")
    assert r.returncode == 0, r.stderr
    assert "tokens/forward" in r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "--model", "/nonexistent/model", "--prompt", "hi"], "not found"),
        (["generate", "--prompt-file", "/nonexistent.txt"], "prompt file not found"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--mode", "warp"], "unknown mode"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--max-draft", "lots"], "--max-draft"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "-2"], "temperature"),
    ],
)
def test_bad_arguments_give_one_line(tiny_model_dir, args, message):
    args = [a.replace("{model}", str(tiny_model_dir)) for a in args]
    r = cli(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_missing_required_argument():
    r = cli("generate")
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.skipif(sys.platform != "linux" or find_openblas() is None, reason="needs Linux with OpenBLAS installed")
def test_doctor_reports_openblas_after_reexec():
    env = {"LD_PRELOAD": ""}
    r = cli("doctor", "--json", "--no-prefill", env_extra=env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["blas"].startswith("OpenBLAS")
    assert info["compute_dtype"] == "float32" and info["device"] == "cpu"


def test_doctor_advises_when_blas_is_slow():
    r = cli("doctor", "--json", "--no-prefill", env_extra={"MLX_DSPARK_NO_REEXEC": "1", "LD_PRELOAD": ""})
    info = json.loads(r.stdout)
    # Debian's alternatives may already route libblas.so.3 to OpenBLAS; only then is there no advice.
    if sys.platform == "linux" and info["blas"].startswith("reference"):
        assert ("libopenblas0-pthread" if find_openblas() is None else "LD_PRELOAD=") in info["advice"]
    else:
        assert "advice" not in info


def test_long_lived_commands_keep_a_disk_tier_by_default(monkeypatch, tmp_path):
    import argparse

    from agent_bridge.commands.common import prefix_cache_dir

    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path))
    ns = lambda **kw: argparse.Namespace(**{"prefix_cache_dir": None, "no_prefix_cache": False, **kw})  # noqa: E731
    assert prefix_cache_dir(ns(), persistent=True) == str(tmp_path / "prefix-cache")
    assert prefix_cache_dir(ns(), persistent=False) is None  # one-off commands write nothing
    assert prefix_cache_dir(ns(prefix_cache_dir="off"), persistent=True) is None
    assert prefix_cache_dir(ns(no_prefix_cache=True), persistent=True) is None
    assert prefix_cache_dir(ns(prefix_cache_dir="/x"), persistent=False) == "/x"
