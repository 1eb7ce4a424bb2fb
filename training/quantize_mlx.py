"""An exported model directory -> an MLX 8-bit copy that fits in the package, checked.

    python training/quantize_mlx.py SRC_DIR DST_DIR [--bits 8] [--max-mb 16]

mlx-lm's own ``convert`` quantises (so the copy is exactly what ``mlx_lm.convert -q`` makes);
then the copy gets the tokenizer files, generation_config.json and train_stats*.json of SRC,
each file is checked under the size limit, and ``mlx_lm`` loads it and generates a few tokens.
Runs on CPU (no download: SRC is a local directory).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

KEEP = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def quantize(src: Path, dst: Path, bits: int = 8, group_size: int = 64) -> list[Path]:
    from mlx_lm.convert import convert

    if dst.exists():
        shutil.rmtree(dst)
    convert(str(src), str(dst), quantize=True, q_bits=bits, q_group_size=group_size)
    for name in KEEP + tuple(p.name for p in src.glob("train_stats*.json")):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    # convert's hub card, and what the copied tokenizer_config.json / the single shard make redundant
    for name in ("README.md", "chat_template.jinja", "model.safetensors.index.json"):
        if (dst / name).exists() and (name != "chat_template.jinja" or _has_template(dst)):
            (dst / name).unlink()
    return sorted(p for p in dst.iterdir() if p.is_file())


def _has_template(d: Path) -> bool:
    import json

    return "chat_template" in json.loads((d / "tokenizer_config.json").read_text())


def check(dst: Path, max_mb: float) -> None:
    from mlx_lm import generate, load

    files = sorted(p for p in dst.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    for p in files:
        print(f"  {p.name:40s} {p.stat().st_size / 1e6:7.2f} MB")
    print(f"  total {total / 1e6:.2f} MB in {len(files)} files")
    if total > max_mb * 1e6:
        sys.exit(f"{dst}: {total / 1e6:.2f} MB is over the {max_mb} MB limit")
    model, tok = load(str(dst))
    out = generate(model, tok, "def fibonacci(n):", max_tokens=24, verbose=False)
    print("  generate:", repr(out[:120]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--max-mb", type=float, default=16.0)
    a = ap.parse_args()
    quantize(Path(a.src), Path(a.dst), a.bits, a.group_size)
    check(Path(a.dst), a.max_mb)


if __name__ == "__main__":
    main()
