"""`mlx-dspark generate --compare` (the README's quick start): the drafted run, then plain mlx-lm
decoding of the same request, with both speeds and whether the outputs are identical."""

from __future__ import annotations

import json

from test_cli import CODE, cli


def test_compare_reports_plain_decoding_beside_the_drafted_run(tiny_model_dir):
    prompt = "Rename `width` to `w` and re-emit:\n" + CODE
    r = cli("generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--mode", "lookup",
            "--max-tokens", "48", "--json", "--compare")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    compare = report["compare"]
    assert compare["identical"] is True  # lossless: plain decoding gives the same tokens
    assert compare["baseline_generated_tokens"] == report["generated_tokens"]
    assert compare["baseline_decode_tok_s"] > 0 and compare["decode_speedup"] > 0


def test_compare_says_so_in_words(tiny_model_dir):
    r = cli("generate", "--model", str(tiny_model_dir), "--prompt", CODE, "--mode", "lookup",
            "--max-tokens", "16", "--compare")
    assert r.returncode == 0, r.stderr
    assert "[plain mlx-lm:" in r.stderr and "outputs identical: yes" in r.stderr


def test_without_compare_nothing_runs_twice(tiny_model_dir):
    r = cli("generate", "--model", str(tiny_model_dir), "--prompt", CODE, "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    assert "compare" not in json.loads(r.stdout)
